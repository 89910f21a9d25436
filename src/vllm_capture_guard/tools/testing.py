# SPDX-License-Identifier: Apache-2.0
"""Test helpers: "this builder's capture leaves shared CPU metadata alone".

For vLLM developers and plugin authors. During full-graph capture the model
runner hands every KV-cache group's metadata builder a *shallow copy* of one
``CommonAttentionMetadata``, so an in-place write by one builder's
``build_for_cudagraph_capture`` is read by every builder after it. A write to a
CPU field (``query_start_loc_cpu``, ``_seq_lens_cpu``, ...) changes host values
that later builders bake into their graphs; that is how MiniMax-M3 failed to
start on ROCm (vLLM PR #51585). Device writes are reported, not failed: some
are deliberate (``seq_lens.fill_(1)`` keeps capture fast) and the runner
rewrites those buffers before every replay.

Plain helper, in any test::

    from vllm_capture_guard.tools.testing import (
        assert_capture_keeps_shared_cpu_metadata,
    )

    def test_capture_is_private(vllm_config):
        builder = MyMetadataBuilder(spec, ["model.layers.0.attn"], vllm_config, dev)
        assert_capture_keeps_shared_cpu_metadata(builder)  # a 4-request decode
        assert_capture_keeps_shared_cpu_metadata(builder, common_attn_metadata)

It raises ``AssertionError`` naming each CPU field written (old and new
values) and emits one :class:`SharedMetadataWriteWarning` per device field
written. With the pytest plugin (``pytest -p vllm_capture_guard.tools.pytest_plugin``
or ``pytest_plugins = ["vllm_capture_guard.tools.pytest_plugin"]`` in a root
``conftest.py``) the ``capture_contract`` fixture does the same and lists the
device writes in a report section at the end of the session instead.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from vllm_capture_guard.tools.contract import CPU, DEVICE, FieldWrite

#: The default batch: four single-token decodes, the runner's common capture.
DEFAULT_NUM_REQS = 4


class SharedMetadataWriteWarning(UserWarning):
    """A capture wrote a shared *device* field in place (reported, not failed)."""


@dataclasses.dataclass
class CaptureCheck:
    """What one builder's capture did to the shared metadata."""

    builder: str
    metadata: Any  # what build_for_cudagraph_capture returned
    writes: list[FieldWrite]
    rebinds: list[str]  # fields rebound on its own copy (not shared)

    @property
    def cpu_writes(self) -> list[FieldWrite]:
        return [w for w in self.writes if w.side == CPU]

    @property
    def device_writes(self) -> list[FieldWrite]:
        return [w for w in self.writes if w.side == DEVICE]

    def failure_message(self) -> str:
        lines = "\n".join(f"  {w}" for w in self.cpu_writes)
        return (
            f"{self.builder}.build_for_cudagraph_capture wrote shared CPU "
            f"metadata in place:\n{lines}\n"
            "Every later metadata builder in the capture reads these values: the "
            "runner hands each KV-cache group a shallow copy of one "
            "CommonAttentionMetadata. Write to a private copy instead (as vLLM "
            "PR #51585 did for ROCM_ATTN)."
        )


def runner_metadata(num_reqs: int = DEFAULT_NUM_REQS, device: Any = "cpu") -> Any:
    """A ``CommonAttentionMetadata`` of views of runner-like persistent buffers
    (:class:`vllm_capture_guard.tools.harness.RunnerBuffers`) for a uniform
    decode."""
    from vllm_capture_guard.tools.harness import Batch, shared_metadata

    return shared_metadata(Batch(num_reqs), device)


def capture_on_shared_metadata(
    builder: Any, common_attn_metadata: Any = None
) -> CaptureCheck:
    """Run ``builder``'s capture on a shallow copy of ``common_attn_metadata``
    (as the runner does, through the harness) and record what it changed in
    the shared tensors. The builder's own exceptions propagate."""
    from vllm_capture_guard.tools.harness import capture

    base = common_attn_metadata
    if base is None:
        base = runner_metadata(device=getattr(builder, "device", "cpu"))
    run = capture([("builder", builder)], metadata=base, raise_errors=True)
    g = run.groups[0]
    return CaptureCheck(type(builder).__qualname__, g.returned, g.writes, g.rebinds)


def assert_capture_keeps_shared_cpu_metadata(
    builder: Any, common_attn_metadata: Any = None, *, warn: bool = True
) -> CaptureCheck:
    """Fail if ``builder``'s capture writes a shared CPU field in place;
    warn (:class:`SharedMetadataWriteWarning`) for each shared device field it
    writes. Returns the :class:`CaptureCheck`."""
    result = capture_on_shared_metadata(builder, common_attn_metadata)
    if warn:
        for w in result.device_writes:
            warnings.warn(
                SharedMetadataWriteWarning(
                    f"{result.builder}.build_for_cudagraph_capture wrote shared "
                    f"device field {w}"
                ),
                stacklevel=2,
            )
    if result.cpu_writes:
        raise AssertionError(result.failure_message())
    return result
