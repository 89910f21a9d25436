# SPDX-License-Identifier: Apache-2.0
"""vLLM's three capture functions of PR #53818, driven on the CPU through
their ``torch.cuda.graph`` call, recording the stream each one passes.

vLLM's real functions run (``CudaGraphManager.capture`` of Model Runner V2,
``EncoderCudaGraphManager._capture_budget_graph``, which V1 uses too, and
``Gemma4Proposer._setup_centroids_cuda_graphs``), on instances that carry
only the attributes those functions read (their constructors need a
distributed group or a model). What a CPU cannot do is stood in for: torch's
``cuda.graph`` (the :class:`Recorder`), ``cuda.CUDAGraph`` and
``accelerator.synchronize``, and the device stream that vLLM's
``graph_capture()`` makes current (vLLM's own ``current_stream()`` is set to
:data:`STREAM` for the capture, as ``graph_capture()`` does on a GPU).

:func:`check_sites` is ``check``'s judgement: in a process where vLLM's
plugin loader has run, each site must hand vLLM's current stream to every
``torch.cuda.graph`` call. A site that passes none captures on torch's own
side stream, where AITER's split-K GEMM finds no workspace at start-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import sys
import threading
import types
from typing import Any

import torch

from vllm_capture_guard.tools.support import module_exists

CUDAGRAPH = "vllm.v1.worker.gpu.cudagraph_utils"
ENCODER = "vllm.v1.worker.encoder_cudagraph"
GEMMA4 = "vllm.v1.spec_decode.gemma4"
SITES = ("capture", "encoder", "gemma4")
#: The start-up error the stream fix prevents (AITER, ROCm).
CRASH = (
    "splitk workspace not initialized for the current CUDA stream. "
    "Call aiter.opus_gemm_workspace_init()"
)


class Stream:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Stream({self.name})"


#: The stream that graph_capture() makes current.
STREAM = Stream("current")


@dataclasses.dataclass
class Recorder:
    """A recording ``torch.cuda.graph``: the stream of every call, and what
    ``torch.cuda.graph`` was for code called from inside the capture and for
    another thread at that moment."""

    streams: list[Any] = dataclasses.field(default_factory=list)
    seen_inside: list[Any] = dataclasses.field(default_factory=list)
    inference_mode: list[bool] = dataclasses.field(default_factory=list)

    def __call__(self, cuda_graph, pool=None, stream=None, capture_error_mode=None):
        self.streams.append(stream)
        return contextlib.nullcontext()


class _Graph:  # torch.cuda.CUDAGraph on a CPU
    def replay(self) -> None:
        pass


def _set_current(stream: Any) -> Any:
    tls = sys.modules["vllm.utils.torch_utils"]._current_stream_tls
    old = getattr(tls, "value", None)
    tls.value = stream
    return old


@contextlib.contextmanager
def cpu_capture(recorder: Recorder):
    """torch's GPU pieces stood in for the duration, vLLM's current stream
    set."""
    import vllm.utils.torch_utils  # noqa: F401  (vLLM imports it first anyway)

    accel = getattr(torch, "accelerator", None)
    sync = getattr(accel, "synchronize", None)
    saved = (torch.cuda.graph, torch.cuda.CUDAGraph)
    torch.cuda.graph, torch.cuda.CUDAGraph = recorder, _Graph
    if sync is not None:
        accel.synchronize = lambda *a, **k: None
    old = _set_current(STREAM)
    try:
        yield recorder
    finally:
        _set_current(old)
        torch.cuda.graph, torch.cuda.CUDAGraph = saved
        if sync is not None:
            accel.synchronize = sync


def _look(recorder: Recorder) -> None:
    """From inside the capture: what do other code and another thread see?"""
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.cuda.graph))
    t.start()
    t.join()
    recorder.seen_inside.append((torch.cuda.graph, seen[0]))
    recorder.inference_mode.append(torch.is_inference_mode_enabled())


def drive_capture(recorder: Recorder) -> None:
    """``CudaGraphManager.capture``: one FULL graph of one token."""
    m = sys.modules[CUDAGRAPH]
    from vllm.config.compilation import CUDAGraphMode

    desc = m.BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.FULL, num_tokens=1, num_reqs=1
    )
    mgr = object.__new__(m.CudaGraphManager)
    attrs = dict(
        device=torch.device("cpu"), _capture_descs={CUDAGraphMode.FULL: [desc]},
        use_breakable_cg=False, graphs={}, pool="pool", ubatch_runner=None,
        _max_full_descs_to_capture=None, _capture_mem_samples=None,
        vllm_config=types.SimpleNamespace(use_cumem_cudagraph_pool=False),
    )  # fmt: skip
    mgr.__dict__.update(attrs)

    @contextlib.contextmanager
    def graph_capture(device, *args, **kwargs):  # vLLM's makes a stream current
        old = _set_current(STREAM)
        try:
            yield types.SimpleNamespace(stream=STREAM)
        finally:
            _set_current(old)

    def create_forward_fn(desc, warmup):
        return lambda mode: _look(recorder)

    real = m.graph_capture
    m.graph_capture = graph_capture
    try:
        mgr.capture(create_forward_fn)
    finally:
        m.graph_capture = real


class _Encoder:
    def prepare_encoder_cudagraph_capture_inputs(self, budget, *args):
        return types.SimpleNamespace(values={"x": torch.ones(budget)})

    def encoder_cudagraph_forward(self, values, path=None):
        return values["x"] * 2


def drive_encoder(recorder: Recorder) -> None:
    """``EncoderCudaGraphManager._capture_budget_graph`` for one budget."""
    m = sys.modules[ENCODER]
    mgr = object.__new__(m.EncoderCudaGraphManager)
    mgr.__dict__.update(
        budget_graphs={}, model=_Encoder(), max_batch_size=1, max_frames_per_batch=1,
        device=torch.device("cpu"), dtype=torch.float32, graph_pool=None,
        # 0.34: buffers shared by the budgets of one path
        _shared_input_buffers={}, _shared_output_buffers={}, _shared_input_keys={},
    )  # fmt: skip
    mgr._capture_budget_graph(8)


class _MaskedEmbedding:
    hidden_size = 4

    def get_top_tokens(self, x, weight):
        return x @ weight


def drive_gemma4(recorder: Recorder) -> None:
    """``Gemma4Proposer._setup_centroids_cuda_graphs`` (seven sizes)."""
    m = sys.modules[GEMMA4]
    prop = object.__new__(m.Gemma4Proposer)
    model = types.SimpleNamespace(
        masked_embedding=_MaskedEmbedding(),
        _get_full_lm_head_weight=lambda: torch.ones(4, 3),
    )
    prop.__dict__.update(
        model=model, dtype=torch.float32, device=torch.device("cpu"),
        _centroids_graphs={}, _centroids_inputs={}, _centroids_outputs={},
    )  # fmt: skip
    prop._setup_centroids_cuda_graphs()


DRIVERS = {"capture": drive_capture, "encoder": drive_encoder, "gemma4": drive_gemma4}


def where(site: str) -> tuple[str, str, str]:
    """``(module, class, function)`` of a site, as the runtime patch names it."""
    from vllm_capture_guard.runtime.patches import graph_capture_stream as patch

    return dict(zip(SITES, patch.SITES, strict=True))[site]


def record(site: str) -> Recorder:
    """Run one site with the recorder; its module must be imported."""
    recorder = Recorder()
    with cpu_capture(recorder):
        DRIVERS[site](recorder)
    return recorder


def present() -> tuple[str, ...]:
    """The sites whose module this vLLM has (0.34.0 has no Gemma4 proposer in
    ``vllm/v1/spec_decode/``), in :data:`SITES`' order."""
    return tuple(site for site in SITES if module_exists(where(site)[0]))


def import_sites() -> None:
    """Import every site's module that this vLLM has."""
    for site in present():
        importlib.import_module(where(site)[0])


def stream_name(stream: Any) -> str | None:
    """``current``, ``None`` (torch's side stream) or the stream's repr."""
    return "current" if stream is STREAM else None if stream is None else repr(stream)


def summary(recorder: Recorder) -> dict[str, Any]:
    """JSON-able: each stream passed (``current``, ``None`` or another), and
    whether code inside the capture or another thread saw the recorder."""
    return {
        "streams": [stream_name(s) for s in recorder.streams],
        "inference_mode": recorder.inference_mode,
        "others_see_torch_graph": all(
            a is recorder and b is recorder for a, b in recorder.seen_inside
        ),
    }


@dataclasses.dataclass
class SiteRun:
    """One capture site, driven: what it passed to ``torch.cuda.graph``."""

    site: str  # "CudaGraphManager.capture"
    module: str
    streams: list[str | None]  # per torch.cuda.graph call
    #: every call got vLLM's current stream; None: not driven here (error)
    ok: bool | None
    error: str | None = None
    #: the release has no such module (the site is gone from vLLM)
    absent: bool = False


def check_site(site: str) -> SiteRun:
    """Import the site's module (the plugin's hooks patch it at import, as in
    a worker) and drive vLLM's own function with the recorder."""
    from vllm_capture_guard.tools.harness.capture import error_text

    module, cls, fn = where(site)
    name = f"{cls}.{fn}"
    if not module_exists(module):
        return SiteRun(name, module, [], None, "not in this vLLM", absent=True)
    try:
        importlib.import_module(module)
        with contextlib.redirect_stderr(io.StringIO()):  # vLLM's progress bar
            streams = [stream_name(s) for s in record(site).streams]
    except Exception as e:  # a release whose site no longer fits the drive
        return SiteRun(name, module, [], None, error_text(e)[:300])
    if not streams:
        return SiteRun(name, module, [], None, "it made no torch.cuda.graph call")
    return SiteRun(name, module, streams, all(s == "current" for s in streams))


def check_sites() -> list[SiteRun]:
    """Every site of PR #53818, in the runtime patch's order."""
    return [check_site(site) for site in SITES]
