# SPDX-License-Identifier: Apache-2.0
"""No metadata builder's capture may change the host values other builders
read.

What: ``build_for_cudagraph_capture`` of every metadata builder: each one
    vLLM makes (``AttentionGroup.create_metadata_builders``, which V1, Model
    Runner V2, the encoder-only state and the proposers use), and, for
    callers that make builders themselves, every builder class with a
    capture of its own.
Symptom: ``vllm serve`` of MiniMax-M3 with ``ROCM_ATTN`` or
    ``ROCM_AITER_UNIFIED_ATTN`` and full CUDA-graph capture dies at startup:
    ``indexer.py, line 317, in build: assert decode_query_len > 0``.
Cause: the runner hands one ``CommonAttentionMetadata`` (views of its
    buffers) to every builder in turn; the ROCm capture zeroes the device
    ``query_start_loc`` (vLLM #25985) and also ``query_start_loc_cpu``, which
    MiniMax-M3's indexer reads next.
Upstream: vllm-project/vllm PR #51585, in 0.29.0: only the device offsets.
Affected: 0.27.0, 0.27.1, 0.28.0 and the ROCm nightlies built from them; any
    builder, in any release, whose capture writes a host value in place.
Detected: never by reading or by running anything but vLLM's own call: every
    capture runs guarded, and the guard tells from its own copies what the
    capture wrote. The first capture of each builder class is logged once:
    what it wrote (kept from the other builders), or that it wrote nothing.
How: the capture runs on a shallow copy of the metadata whose host values
    are copies (pinned where the runner's are): every CPU tensor where the
    device fields are on an accelerator, CPU tensors by name (``*_cpu``, ...)
    where everything is on the CPU, and arrays, dicts and lists always.
    Device writes reach
    the runner's buffers (#25985, as in 0.29.0); whatever else the capture
    does to the metadata (a rebound field, a lazily filled cache) reaches it
    as without the guard. A capture nested in a guarded one runs as it is.
    If no copy can be made, vLLM's own call runs and the host values are put
    back, with one WARNING. ``build()`` is untouched.
Delete when: the oldest vLLM this project supports is 0.29.0 or newer.
"""

from __future__ import annotations

import copy
import logging
import sys
import threading
from types import ModuleType
from typing import Any

from vllm_capture_guard.runtime import patches as base

PR, METHOD = "#51585", "build_for_cudagraph_capture"
UTILS, GROUP, MAKE = (
    "vllm.v1.worker.utils",
    "AttentionGroup",
    "create_metadata_builders",
)
BASE, BUILDER = "vllm.v1.attention.backend", "AttentionMetadataBuilder"
ROCM = "vllm.v1.attention.backends.rocm_attn"
#: Host fields whose names do not say so (the rule where all is on the CPU).
HOST_NAMES = frozenset({"is_prefilling", "rswa_prefix_lens", "req_idx"})
#: What each builder class's captures did: {"calls": n, "wrote": {field:
#: size at the first write}}; the tools read it.
SEEN: dict[str, dict] = {}
_log = logging.getLogger("vllm.capture_guard")
_state = threading.local()  # .depth > 0 inside a guarded capture
_said: set[str] = set()


def is_host_field(name: str) -> bool:
    """vLLM's naming of host values: ``*_cpu``, ``*_cpu_*``, ``*_np``,
    ``*_host``, ``cpu_*``, ``host_*``, or one of :data:`HOST_NAMES`."""
    n = name.lower()
    return (
        n.endswith(("_cpu", "_np", "_host"))
        or n.startswith(("cpu_", "host_"))
        or "_cpu_" in n
        or n in HOST_NAMES
    )


def _copy_of(name: str, value: Any, on_device: bool) -> Any:
    """A copy of a host value, or None for a device value (or a scalar)."""
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    if isinstance(value, (dict, list)):
        return copy.deepcopy(value)
    if np is not None and isinstance(value, np.ndarray):
        return value.copy()
    if torch is None or not isinstance(value, torch.Tensor):
        return None
    if not (value.is_cpu if on_device else is_host_field(name)):
        return None
    if on_device and value.is_pinned():  # as the runner's pinned buffers
        return torch.empty(value.shape, dtype=value.dtype, pin_memory=True).copy_(value)
    return value.clone()


def own_copy(metadata: Any) -> tuple[Any, dict[str, tuple[Any, Any]]]:
    """A shallow copy of ``metadata`` with copies of its host values, and
    ``{field: (shared value, the copy's)}``."""
    own = object.__new__(type(metadata))  # vLLM's dataclass: a fast copy
    own.__dict__.update(metadata.__dict__)
    fields = vars(own)
    on_device = getattr(fields.get("query_start_loc"), "is_cpu", True) is False
    copies = {}
    for name, value in fields.items():
        mine = None if value is None else _copy_of(name, value, on_device)
        if mine is not None:
            copies[name] = (value, mine)
            fields[name] = mine
    return own, copies


def _same(a: Any, b: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    if hasattr(a, "shape"):  # an array
        return a.shape == b.shape and bool((a == b).all())
    return bool(a == b)


def _settle(shared: Any, own: Any, copies: dict, owner: str) -> None:
    """What the capture did to its copy reaches the shared metadata, except
    its in-place host writes; say once what it wrote."""
    mine, theirs = vars(own), vars(shared)
    for name, value in mine.items():
        before = copies[name][1] if name in copies else theirs.get(name)
        if value is not before or name not in theirs:
            setattr(shared, name, value)  # rebound: as without the guard
    wrote = [n for n, (s, m) in copies.items() if mine.get(n) is m and not _same(s, m)]
    seen = SEEN.setdefault(owner, {"calls": 0, "wrote": {}})
    seen["calls"] += 1
    size = theirs.get("num_actual_tokens", "?")
    new = [n for n in wrote if n not in seen["wrote"]]
    seen["wrote"].update(dict.fromkeys(new, size))
    if new:
        _say(f"{owner}'s capture wrote {', '.join(new)} (size {size}); kept from "
             f"the other builders (backport of PR {PR})")  # fmt: skip
    elif seen["calls"] == 1:
        _say(f"{owner}'s capture, watched: it wrote no shared host value (size {size})")


def _say(message: str, warning: bool = False) -> None:
    with base.LOCK:
        if message in _said:
            return
        _said.add(message)
    (_log.warning if warning else _log.info)(f"vllm-capture-guard: {message}")


def guarded_call(capture: Any, owner: str, metadata: Any, *args: Any, **kw: Any) -> Any:
    """``capture(metadata, ...)`` with the shared host values kept."""
    if getattr(_state, "depth", 0):  # nested: the outer capture's copy is ours
        return capture(metadata, *args, **kw)
    try:
        own, copies = own_copy(metadata)
    except Exception as e:  # never stop vLLM: its own call, values put back
        _say(f"could not copy the metadata for {owner}'s capture ({e!r}); it ran "
             "on the shared metadata, whose host values were put back after it",
             warning=True)  # fmt: skip
        return _restoring(capture, metadata, args, kw)
    _state.depth = 1
    try:
        result = capture(own, *args, **kw)
    finally:
        _state.depth = 0
    try:
        _settle(metadata, own, copies, owner)
    except Exception as e:
        _say(f"could not compare {owner}'s capture ({e!r})", warning=True)
    return result


def _restoring(capture: Any, metadata: Any, args: tuple, kw: dict) -> Any:
    names = getattr(type(metadata), "__slots__", None) or vars(metadata)
    fields = {n: getattr(metadata, n, None) for n in names}
    on_device = getattr(fields.get("query_start_loc"), "is_cpu", True) is False
    torch = sys.modules["torch"]
    saved = [
        (v, v.clone())
        for n, v in fields.items()
        if isinstance(v, torch.Tensor) and (v.is_cpu if on_device else is_host_field(n))
    ]
    try:
        return capture(metadata, *args, **kw)
    finally:
        for tensor, before in saved:
            tensor.copy_(before)


def _class_guard(fn: Any) -> Any:
    def build_for_cudagraph_capture(self, common_attn_metadata, *args, **kwargs):
        bound = fn.__get__(self, type(self))
        owner = type(self).__name__
        return guarded_call(bound, owner, common_attn_metadata, *args, **kwargs)

    return build_for_cudagraph_capture


def guard_class(cls: type) -> None:
    if not base.is_guarded(vars(cls).get(METHOD)):
        base.wrap_method(cls, METHOD, _class_guard)


def guard_instance(builder: Any) -> None:
    """Guard ``builder``'s capture, resolved at each call: its own (set in
    ``__init__``), else its class's as it is then."""
    own = vars(builder).get(METHOD)
    if base.is_guarded(own):
        return
    cls = type(builder)

    def build_for_cudagraph_capture(common_attn_metadata, *args, **kwargs):
        capture = own or getattr(cls, METHOD).__get__(builder, cls)
        return guarded_call(
            capture, cls.__name__, common_attn_metadata, *args, **kwargs
        )

    setattr(build_for_cudagraph_capture, base.MARKER, own)
    builder.__dict__[METHOD] = build_for_cudagraph_capture


def builder_classes() -> list[type]:
    """Every builder class (vLLM's base included) with a capture of its own."""
    root = getattr(sys.modules.get(BASE), BUILDER, None)
    found = base.subclasses(root) if isinstance(root, type) else []
    return [c for c in found if METHOD in vars(c)]


def _making(make: Any) -> Any:
    def create_metadata_builders(self, *args, **kwargs):
        plugin = sys.modules.get("vllm_capture_guard.runtime.plugin")
        try:  # before the backend's get_builder_cls() is asked
            plugin and plugin.apply_all(when=" (before vLLM made its builders)")
        except Exception as e:
            _say(f"could not check the patches before {MAKE} ({e!r})", True)
        result = make(self, *args, **kwargs)
        try:
            for builder in getattr(self, "metadata_builders", None) or ():
                if hasattr(builder, "__dict__"):
                    guard_instance(builder)
                if METHOD in vars(type(builder)):
                    guard_class(type(builder))
        except Exception as e:
            _say(f"could not guard the builders {MAKE} made ({e!r})", True)
        return result

    return create_metadata_builders


DETAIL = (
    "every metadata builder's capture runs on its own copy of the host "
    f"metadata, as vLLM makes each builder and on every builder class "
    f"(backport of PR {PR})"
)


class RocmAttnCpuOffsets(base.Patch):
    name, pr = "rocm-attn-cpu-offsets", PR
    modules = (UTILS, BASE, ROCM, "vllm.v1.attention.backends.rocm_aiter_unified_attn")
    backends = ("ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN")
    targets = ((ROCM, "RocmAttentionMetadataBuilder"), (ROCM, "RocmAttentionBackend"))

    def plan(self, module: ModuleType) -> base.Outcome:
        group = getattr(sys.modules.get(UTILS), GROUP, None)
        make = vars(group).get(MAKE) if isinstance(group, type) else None
        classes = [c for c in builder_classes() if not base.is_guarded(vars(c)[METHOD])]
        todo = make is not None and not base.is_guarded(make)
        warning = None
        if UTILS in sys.modules and make is None:
            warning = (
                f"{UTILS} has no {GROUP}.{MAKE}: the builders vLLM makes are "
                "guarded only by their classes'"
            )
        status = base.Status.NEEDED if todo or classes else base.Status.ALREADY
        data = (group if todo else None, classes)
        return base.Outcome(self.name, status, DETAIL, warning, data)

    def install(self, plan: base.Outcome) -> str:
        group, classes = plan.data
        if group is not None:
            base.wrap_method(group, MAKE, _making)
        for cls in classes:
            guard_class(cls)
        return DETAIL

    def uninstall(self) -> bool:
        group = getattr(sys.modules.get(UTILS), GROUP, None)
        done = isinstance(group, type) and base.unwrap_method(group, MAKE)
        undone = [base.unwrap_method(c, METHOD) for c in reversed(builder_classes())]
        return any(undone) or done
