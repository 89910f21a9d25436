# SPDX-License-Identifier: Apache-2.0
"""pytest plugin: the ``capture_contract`` fixture and a report of the shared
device fields that captures wrote.

Enable it with ``pytest -p vllm_capture_guard.tools.pytest_plugin`` or with
``pytest_plugins = ["vllm_capture_guard.tools.pytest_plugin"]`` in a root
``conftest.py``. It is not registered automatically (no ``pytest11`` entry
point): installing the guard into an environment changes no test run.

::

    def test_my_builder(capture_contract, vllm_config):
        builder = MyMetadataBuilder(spec, layer_names, vllm_config, device)
        capture_contract.check(builder)                         # 4-request decode
        capture_contract.check(builder, common_attn_metadata)   # or your own batch

``check`` fails the test when the capture writes a shared CPU field in place.
Shared *device* fields it writes become findings: listed in a
"vllm-capture-guard" section of the terminal summary and attached to the test
as ``user_properties`` (so they reach ``--junitxml``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

SECTION = "vllm-capture-guard: shared device metadata written during capture"


@dataclasses.dataclass(frozen=True)
class Finding:
    nodeid: str
    builder: str
    write: str


_FINDINGS = pytest.StashKey[list]()


class CaptureContract:
    """Returned by the ``capture_contract`` fixture."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        self.findings: list[Finding] = []

    def check(self, builder: Any, common_attn_metadata: Any = None) -> Any:
        from vllm_capture_guard.tools.testing import capture_on_shared_metadata

        result = capture_on_shared_metadata(builder, common_attn_metadata)
        node = self._request.node
        for w in result.device_writes:
            finding = Finding(node.nodeid, result.builder, str(w))
            self.findings.append(finding)
            node.config.stash[_FINDINGS].append(finding)
            node.user_properties.append(
                ("capture_device_write", f"{result.builder}: {w}")
            )
        if result.cpu_writes:
            pytest.fail(result.failure_message(), pytrace=False)
        return result


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_FINDINGS] = []


@pytest.fixture
def capture_contract(request: pytest.FixtureRequest) -> CaptureContract:
    """Checks builders' captures against the shared-metadata contract."""
    return CaptureContract(request)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    findings = config.stash.get(_FINDINGS, [])
    if not findings:
        return
    terminalreporter.section(SECTION)
    for f in findings:
        terminalreporter.line(f"{f.nodeid}: {f.builder}: {f.write}")
