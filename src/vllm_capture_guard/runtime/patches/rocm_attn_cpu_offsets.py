# SPDX-License-Identifier: Apache-2.0
"""No builder's capture may change the host values other builders read
(backport of PR #51585, in 0.29.0; delete when 0.29.0 is the oldest supported).

Symptom: MiniMax-M3 with ``ROCM_ATTN`` or ``ROCM_AITER_UNIFIED_ATTN`` dies at
start-up in ``indexer.py``: ``assert decode_query_len > 0``. Cause: every
builder gets the same metadata, and the ROCm capture zeroes the host
``query_start_loc_cpu`` as well as the device offsets (vLLM #25985).
How: every ``build_for_cudagraph_capture`` runs guarded: on each builder that
``AttentionGroup.create_metadata_builders`` makes, and on every builder class
with its own. The host values (every CPU tensor where the device fields are on
an accelerator, by name where all is on the CPU; arrays, dicts and lists) are
saved before it; what it changed in place is put back after it, and said once.
Device writes, rebinds and lazily filled caches stay, as without the guard."""

from __future__ import annotations

import copy
import ctypes
import functools
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
BACKENDS = ("rocm_attn", "rocm_aiter_unified_attn")  # their import applies it too
#: Host fields whose names do not say so (the rule where all is on the CPU).
HOST_NAMES = frozenset({"is_prefilling", "rswa_prefix_lens", "req_idx"})
#: Per builder class: {"calls": n, "wrote": {field: size at the first write}}.
SEEN: dict[str, dict] = {}
_PLAIN = frozenset({type(None), bool, int, float, str})
_log = logging.getLogger("vllm.capture_guard")
_state = threading.local()  # .depth > 0 inside a guarded capture
_said: set[str] = set()


@functools.cache
def is_host_field(name: str) -> bool:
    """vLLM's naming of host values: ``*_cpu``, ``*_cpu_*``, ``*_np``,
    ``*_host``, ``cpu_*``, ``host_*``, or one of :data:`HOST_NAMES`."""
    n = name.lower()
    return (
        n.endswith(("_cpu", "_np", "_host"))
        or n.startswith(("cpu_", "host_"))
        or ("_cpu_" in n or n in HOST_NAMES)
    )


def save(metadata: Any) -> list[tuple[str, Any, Any]]:
    """``(field, value, copy)`` of each host value of ``metadata``, once per
    value; a dense host tensor's copy is its bytes (the cheapest copy)."""
    fields, torch = vars(metadata), sys.modules.get("torch")
    tensor, np = torch.Tensor if torch else (), sys.modules.get("numpy")
    containers = (dict, list, np.ndarray) if np else (dict, list)
    on_device = getattr(fields.get("query_start_loc"), "is_cpu", True) is False
    found: dict[int, tuple[str, Any]] = {}
    for n, v in fields.items():
        if type(v) in _PLAIN or id(v) in found:
            continue
        if isinstance(v, tensor):
            if v.is_cpu if on_device else is_host_field(n):
                found[id(v)] = (n, v)
        elif isinstance(v, containers):
            found[id(v)] = (n, v)
    return [(n, v, _copy(v)) for n, v in found.values()]


def _copy(value: Any) -> Any:
    if isinstance(value, (dict, list)) or not hasattr(value, "data_ptr"):
        return copy.deepcopy(value)  # a container or an array
    try:
        if value.is_cpu and value.is_contiguous():
            return ctypes.string_at(value.data_ptr(), value.nbytes)
    except RuntimeError:  # a sparse tensor, say
        pass
    return value.clone()


def _same(a: Any, b: Any) -> bool:
    if type(b) is bytes:  # a dense host tensor's
        return a.nbytes == len(b) and ctypes.string_at(a.data_ptr(), len(b)) == b
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    if hasattr(a, "data_ptr"):  # a tensor copied by torch
        return sys.modules["torch"].equal(a, b)
    if hasattr(a, "shape"):  # an array
        return a.shape == b.shape and bool((a == b).all())
    return bool(a == b)


def put_back(saved: list[tuple[str, Any, Any]]) -> list[str]:
    """Put back each saved value changed in place; the fields it changed."""
    changed = [(n, v, b) for n, v, b in saved if not _same(v, b)]
    for name, value, before in changed:  # all told first: fields share memory
        if type(before) is bytes:
            if value.nbytes != len(before) or not value.is_contiguous():
                raise ValueError(f"{name} changed its shape")
            ctypes.memmove(value.data_ptr(), before, len(before))
        elif isinstance(value, dict):
            value.clear()
            value.update(before)
        else:  # a list, a tensor or an array
            value[slice(None) if isinstance(value, list) else ...] = before
    return [name for name, _, _ in changed]


def _say(message: str, warning: bool = False) -> None:
    with base.LOCK:
        if message in _said:
            return
        _said.add(message)
    (_log.warning if warning else _log.info)(f"vllm-capture-guard: {message}")


def _note(owner: str, wrote: list[str], size: Any) -> None:
    seen = SEEN.get(owner) or SEEN.setdefault(owner, {"calls": 0, "wrote": {}})
    seen["calls"] += 1
    if new := [n for n in wrote if n not in seen["wrote"]]:
        seen["wrote"].update(dict.fromkeys(new, size))
        _say(f"{owner}'s capture wrote {', '.join(new)} (size {size}); kept from "
             f"the other builders (backport of PR {PR})")  # fmt: skip
    elif seen["calls"] == 1:
        _say(f"{owner}'s capture, watched: it wrote no shared host value (size {size})")


def guarded_call(capture: Any, owner: str, metadata: Any, *args: Any, **kw: Any) -> Any:
    """``capture(metadata, ...)``, then put back what it changed in place."""
    if getattr(_state, "depth", 0):  # nested: the outer call puts back
        return capture(metadata, *args, **kw)
    try:
        saved = save(metadata)
    except Exception as e:  # never stop vLLM: its own call, unguarded
        _say(f"could not save the metadata for {owner}'s capture ({e!r}); it ran "
             "unguarded, and may change what other builders read", True)  # fmt: skip
        return capture(metadata, *args, **kw)
    _state.depth = 1
    try:
        return capture(metadata, *args, **kw)
    finally:
        _state.depth = 0
        try:
            _note(owner, put_back(saved), getattr(metadata, "num_actual_tokens", "?"))
        except Exception as e:
            _say(f"could not put back what {owner}'s capture wrote ({e!r})", True)


def guard_class(cls: type) -> None:
    def make(fn: Any) -> Any:
        def build_for_cudagraph_capture(self, common_attn_metadata, *args, **kwargs):
            bound, owner = fn.__get__(self, type(self)), type(self).__name__
            return guarded_call(bound, owner, common_attn_metadata, *args, **kwargs)

        return build_for_cudagraph_capture

    if not base.is_guarded(vars(cls).get(METHOD)):
        base.wrap_method(cls, METHOD, make)


def guard_instance(builder: Any) -> None:
    """Guard ``builder``'s capture, resolved at each call: its own (set in
    ``__init__``), else its class's as it is then."""
    own, cls = vars(builder).get(METHOD), type(builder)
    if base.is_guarded(own):
        return

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
    "every metadata builder's capture puts back the host values it changed in "
    f"place, as vLLM makes each builder and on every builder class (backport "
    f"of PR {PR})"
)


class RocmAttnCpuOffsets(base.Patch):
    name, pr = "rocm-attn-cpu-offsets", PR
    modules = (UTILS, BASE, *(f"vllm.v1.attention.backends.{m}" for m in BACKENDS))

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
