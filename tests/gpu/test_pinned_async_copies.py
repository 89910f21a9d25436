# SPDX-License-Identifier: Apache-2.0
"""The guard on the GPU's asynchronous copies (cases in
:mod:`tests.gpu.async_copies`): copies between pinned host offsets and the
device with ``non_blocking=True`` behind a busy stream (``copy_`` both ways,
``.to(device)``), copies on a side stream (joined, and left running), a
Triton kernel given the pinned host tensor and a device tensor over its
memory (the copies the guard cannot see), a capture run inside an active CUDA
graph capture (replayed), and a guarded capture while another thread records
a graph.

Asserted, against the same capture run without the guard: the device
receives what it receives without the guard, the host offsets are kept, and
the log names what the capture wrote (and, where the guard cannot see the
copies, that it waited for the stream); inside a graph capture, the graph
stays valid and its replay reads the kept host values, as 0.29.0's capture
would; beside another thread's capture, that graph stays valid. Taking out
the following of the copies (``GPU_TIER_MUTATE=unfollowed``) fails every case
that copies behind a busy stream; leaving the capture mode as it is fails the
last.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu import async_copies

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="GPU tier: torch.cuda.is_available() is False (no CUDA/ROCm GPU)",
    ),
]


@pytest.fixture(scope="module")
def guarded(gpu_results):
    with async_copies.guard_loaded():
        yield gpu_results.setdefault("async_copies", {})


@pytest.mark.parametrize("case", list(async_copies.CHECKS))
def test_async_copies(case, guarded):
    async_copies.CHECKS[case](guarded)
