# SPDX-License-Identifier: Apache-2.0
"""The ROCm tier's run of the GPU tier's asynchronous-copy cases
(:mod:`tests.gpu.async_copies`) on an MI-series GPU: pinned host offsets
copied to and from the device with ``non_blocking=True`` behind a busy
stream, side streams, a Triton kernel and a device view reading them (a
device view needs CuPy; without it that one case says it was skipped), a
capture inside an active HIP graph capture (replayed), and one while another
thread records a HIP graph. One GPU (the TP1 job). Skips on any other host,
and fails there where ``CAPTURE_GUARD_REQUIRE_GPUS`` says the host must be a
ROCm one."""

from __future__ import annotations

import pytest

from tests.rocm.test_engine_startup import rocm_host  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.rocm]

#: The cases, named without importing torch (CPU collection stays cheap).
CASES = ("host_to_device", "device_to_host", "side_streams", "to_device",
         "unseen_copies", "inside_a_graph_capture",
         "beside_another_threads_capture")  # fmt: skip


@pytest.fixture(scope="module")
def guarded(rocm_host):  # noqa: F811  (a ROCm GPU host, or skip / fail)
    from tests.gpu import async_copies

    assert tuple(async_copies.CHECKS) == CASES
    with async_copies.guard_loaded():
        yield {}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c}-tp1")
def test_async_copies(case, guarded):
    from tests.gpu import async_copies

    async_copies.CHECKS[case](guarded)
