# SPDX-License-Identifier: Apache-2.0
"""Tensors that report a GPU device on a CPU host (:mod:`tests.fake_device`):
what they promise, and that vLLM's own ROCm capture takes its GPU path on
them."""

from __future__ import annotations

import torch

from tests.fake_device import DeviceTensor, fake_cuda, no_cuda_init, on_device
from vllm_capture_guard.tools import harness as sc


def test_reports_cuda_and_writes_land_in_the_cpu_data():
    data = torch.arange(8, dtype=torch.int32)
    with no_cuda_init():
        t = on_device(data)
        assert (t.device, t.is_cuda, t.is_cpu) == (torch.device("cuda", 0), True, False)
        assert t.device.type != "cpu" and t.get_device() == 0
        view = t[2:5]
        assert isinstance(view, DeviceTensor) and view.is_cuda
        view.zero_()
        t[5:6].fill_(7)
        t[6:] = 9
        t[:2].copy_(torch.tensor([4, 4], dtype=torch.int32))
        assert data.tolist() == [4, 4, 0, 0, 0, 7, 9, 9]
        assert torch.equal(t, t.clone())


def test_moves_between_devices_like_a_gpu_tensor():
    data = torch.arange(4, dtype=torch.int32)
    with no_cuda_init():
        t = on_device(data)
        for host in (t.cpu(), t.to("cpu"), t.to(device=torch.device("cpu"))):
            assert type(host) is torch.Tensor and host.device.type == "cpu"
            host.zero_()  # a device-to-host copy, not a view
        assert data.tolist() == [0, 1, 2, 3]
        assert t.cuda() is t and t.to("cuda") is t
        wide = t.to(torch.int64)
        assert wide.is_cuda and wide.dtype == torch.int64


def test_factories_under_fake_cuda():
    with no_cuda_init(), fake_cuda():
        made = torch.zeros(3, dtype=torch.int32, device="cuda")
        full = torch.full((2,), 5, device=torch.device("cuda"))
        host = torch.zeros(3)
        assert made.is_cuda and full.is_cuda and full.tolist() == [5, 5]
        assert not host.is_cuda


def test_vllm_rocm_capture_takes_its_gpu_path(vllm_version):
    """No guard in this process: vLLM's installed ROCm builder, built for a
    ``cuda`` device on GPU-reporting runner buffers, zeroes the device offsets
    as on a GPU (every release), and the CPU offsets where the release does
    (0.27.x/0.28.0)."""
    batch = sc.Batch(4)
    config = sc.make_vllm_config(0)
    with no_cuda_init(), fake_cuda():
        buffers = sc.RunnerBuffers(device="cuda")
        builder = sc.attention_builder("ROCM_ATTN", config, "cuda")
        assert builder.device.type == "cuda"
        run = sc.capture([("attention", builder)], batch, buffers=buffers)
    assert run.failed is None, run.failed
    written = {w.field: w for w in run.groups[0].writes}
    assert written["query_start_loc"].before == batch.offsets()
    assert run.values("query_start_loc") == [0] * (batch.total_reqs + 1)
    # what each release does to the CPU copy, seen on plain CPU tensors too
    plain = sc.run_capture("ROCM_ATTN", batch)
    cpu_zeroed = plain.values("query_start_loc_cpu") != batch.offsets()
    assert ("query_start_loc_cpu" in written) == cpu_zeroed
