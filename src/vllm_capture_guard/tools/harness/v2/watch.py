# SPDX-License-Identifier: Apache-2.0
"""Model Runner V2's own ``capture_model()``, and what each of its metadata
builds did, read at the model state's ``prepare_attn`` (see :mod:`..v2`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch

from vllm_capture_guard.tools.harness import streams
from vllm_capture_guard.tools.harness.capture import error_site, error_text
from vllm_capture_guard.tools.harness.v2.make import chosen, worker


@dataclasses.dataclass
class Build:
    """One metadata build of the runner, as its model state's ``prepare_attn``
    was asked for it."""

    for_capture: bool
    num_reqs: int
    num_tokens: int
    #: the host offsets vLLM's dummy batch holds before any builder ran
    offsets: list[int]
    #: the shared offsets after every builder ran: host, device
    host_after: list[int] = dataclasses.field(default_factory=list)
    device_after: list[int] = dataclasses.field(default_factory=list)
    decode_query_len: int | None = None
    error: str | None = None
    error_site: str | None = None
    error_line: str | None = None


def _ints(values: Any) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
    return [int(v) for v in values]


def _decode_query_len(metadata: Any) -> int | None:
    """What MiniMax-M3's indexer computed, from the per-layer metadata."""
    values = metadata.values() if isinstance(metadata, dict) else [metadata]
    for value in values:
        if isinstance(value, dict):
            found = _decode_query_len(value)
            if found is not None:
                return found
        decode = getattr(value, "decode", None)
        if decode is not None and hasattr(decode, "decode_query_len"):
            return int(decode.decode_query_len)
    return None


def _find(args: tuple, kwargs: dict, name: str, position: int) -> Any:
    return kwargs[name] if name in kwargs else args[position]


def observe(runner: Any) -> list[Build]:
    """Every metadata build of ``runner``'s model state from now on, read
    around its own ``prepare_attn`` (set on the instance; the call itself is
    vLLM's)."""
    state = runner.model_state
    prepare = state.prepare_attn
    builds: list[Build] = []

    def prepare_attn(*args: Any, **kwargs: Any) -> Any:
        batch = _find(args, kwargs, "input_batch", 0)
        n = batch.num_reqs
        build = Build(
            for_capture=bool(kwargs.get("for_capture", False)),
            num_reqs=n,
            num_tokens=batch.num_tokens,
            offsets=_ints(batch.query_start_loc_np[: n + 1]),
        )
        builds.append(build)
        try:
            metadata = prepare(*args, **kwargs)
        except Exception as e:
            build.error = error_text(e)
            build.error_site, build.error_line = error_site(e)
            raise
        finally:
            build.host_after = _ints(batch.query_start_loc_np[: n + 1])
            build.device_after = _ints(batch.query_start_loc[: n + 1])
        build.decode_query_len = _decode_query_len(metadata)
        return metadata

    state.prepare_attn = prepare_attn
    return builds


@dataclasses.dataclass
class Descriptor:
    """One FULL graph the runner's ``CudaGraphManager`` captures."""

    num_tokens: int
    num_reqs: int | None


@dataclasses.dataclass
class V2Capture:
    """What the runner's ``capture_model()`` did."""

    descriptors: list[Descriptor]
    builds: list[Build]
    error: str | None = None
    error_site: str | None = None
    error_line: str | None = None
    #: the stream each ``torch.cuda.graph`` call got (CPU: recorded)
    streams: list[str | None] = dataclasses.field(default_factory=list)

    def per_descriptor(self) -> list[tuple[Descriptor, list[Build]]]:
        """The capture builds of each descriptor vLLM reached, in its order."""
        builds = [b for b in self.builds if b.for_capture]
        found = []
        for desc in self.descriptors:
            mine = []
            while builds and builds[0].num_tokens == desc.num_tokens:
                mine.append(builds.pop(0))
            if not mine:
                break
            found.append((desc, mine))
        return found


def full_descriptors(runner: Any) -> list[Descriptor]:
    """The FULL graphs ``runner``'s ``CudaGraphManager`` captures, in its order
    (its own descriptors; which config fields made them differs by release)."""
    from vllm.config import CUDAGraphMode

    manager = runner.cudagraph_manager
    descs = getattr(manager, "_capture_descs", {}).get(CUDAGraphMode.FULL, [])
    return [Descriptor(d.num_tokens, getattr(d, "num_reqs", None)) for d in descs]


@contextlib.contextmanager
def _no_progress_bar(manager: Any) -> Iterator[None]:
    """vLLM's capture progress bar off (``tqdm`` as the manager's modules
    bound it, given ``disable=True``): the result is the command's output."""
    modules = {sys.modules.get(c.__module__) for c in type(manager).__mro__}
    held = {m: m.tqdm for m in modules if m is not None and hasattr(m, "tqdm")}
    for module, bar in held.items():
        module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        for module, bar in held.items():
            module.tqdm = bar


@contextlib.contextmanager
def driving(runner: Any) -> Iterator[streams.Recorder]:
    """What the runner's own calls run under here: Model Runner V2 chosen,
    its config current, ``torch.cuda.graph`` recorded where there is no GPU
    (the recorder is yielded), vLLM's progress bar quiet."""
    from vllm.config import set_current_vllm_config

    recorder = streams.Recorder()
    on_cpu = not torch.cuda.is_available()
    recording = streams.cpu_capture(recorder) if on_cpu else contextlib.nullcontext()
    quiet = _no_progress_bar(runner.cudagraph_manager)
    with chosen(), set_current_vllm_config(runner.vllm_config), recording, quiet:
        yield recorder


def capture(runner: Any) -> V2Capture:
    """``runner.capture_model()``, as the worker calls it after the KV cache
    is made; ``torch.cuda.graph`` recorded where there is no GPU."""
    found = V2Capture(full_descriptors(runner), observe(runner))
    recorder = None
    try:
        with driving(runner) as recorder:
            runner.capture_model()
    except Exception as e:
        found.error = error_text(e)
        found.error_site, found.error_line = error_site(e)
    found.streams = [streams.stream_name(s) for s in recorder.streams]
    return found


def execute_dummy_batch(runner: Any) -> None:
    """An idle data-parallel rank's step at serving time, after capture:
    vLLM's GPU worker's own ``execute_dummy_batch`` (the runner's
    ``_dummy_run``, a uniform decode batch, its FULL graph's metadata built
    for capture). Raises what vLLM raises."""
    with driving(runner):
        worker(runner.vllm_config, runner).execute_dummy_batch()
