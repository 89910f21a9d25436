# SPDX-License-Identifier: Apache-2.0
"""Every metadata builder's capture must not change the host values other
builders read.

What:
    ``build_for_cudagraph_capture`` of every attention metadata builder: each
    builder vLLM makes (``AttentionGroup.create_metadata_builders`` in
    ``vllm/v1/worker/utils.py``, which makes them for V1's runner, Model
    Runner V2, the encoder-only model state and the speculative proposers),
    and, for callers that make builders themselves, every class derived from
    ``AttentionMetadataBuilder`` that has a capture of its own.

Symptom:
    ``vllm serve`` of MiniMax-M3 with ``--attention-backend ROCM_ATTN`` or
    ``ROCM_AITER_UNIFIED_ATTN`` and full CUDA-graph capture dies at startup::

        File "vllm/models/minimax_m3/common/indexer.py", line 317, in build
            assert decode_query_len > 0

Cause:
    The runner hands one ``CommonAttentionMetadata`` (views of its persistent
    buffers) to every builder in turn. The ROCm builder's capture zeroes the
    device ``query_start_loc`` (a guard against a fault in the prefix-prefill
    kernel, vLLM #25985) and also the host ``query_start_loc_cpu``, which
    later builders read: MiniMax-M3's indexer then finds a query length of 0.

Upstream:
    vllm-project/vllm PR #51585, in 0.29.0: only the device offsets are zeroed.

Affected:
    0.27.0, 0.27.1, 0.28.0 and the ROCm nightlies built from them; any
    builder, in any release, whose capture writes a host value in place.

Detected:
    Never by reading, never by running anything but vLLM's own call: every
    capture runs guarded, and the guard tells from its own copies what that
    capture wrote. The first capture of each builder class is logged once:
    what it wrote (kept from the other builders), or that it wrote nothing.

How:
    The capture runs on a shallow copy of the metadata whose host values are
    copies (pinned where the runner's are): every CPU tensor and array where
    the device fields are on an accelerator, by name (``*_cpu``, ...) where
    everything is on the CPU; and dicts and lists. Device writes reach the
    runner's buffers (the #25985 guard, as in 0.29.0). Every other change the
    capture makes to the metadata (a rebound field, a lazily filled cache)
    reaches the shared metadata, as without the guard. A capture nested in a
    guarded one (``super()``, a composite builder) runs as it is: the outer
    copy is its. ``build()`` is untouched. If the copy cannot be made, vLLM's
    own call runs on the shared metadata and the host values are put back,
    with one WARNING.

Delete when:
    The oldest vLLM this project supports is 0.29.0 or newer, and no builder
    this project knows of writes a host value at capture.
"""

from __future__ import annotations

import copy
import logging
import sys
import threading
from types import ModuleType
from typing import Any

from vllm_capture_guard.runtime import patches as base
from vllm_capture_guard.runtime.shape import is_host_field

METHOD = "build_for_cudagraph_capture"
UTILS, GROUP = "vllm.v1.worker.utils", "AttentionGroup"
BACKEND, BUILDER = "vllm.v1.attention.backend", "AttentionMetadataBuilder"
MAKE = "create_metadata_builders"
#: The ROCm backends' modules: their builder classes are guarded at import,
#: for callers that make builders themselves.
ROCM = (
    ("vllm.v1.attention.backends.rocm_attn", "RocmAttentionMetadataBuilder"),
    ("vllm.v1.attention.backends.rocm_aiter_unified_attn", None),
)
PR = "#51585"
_log = logging.getLogger("vllm.capture_guard")
_state = threading.local()  # .depth: inside a guarded capture
_said: set[tuple[str, str]] = set()  # (builder class, what was logged)
#: What the captures did, per builder class: {"calls": n, "wrote": {field:
#: size at its first write}}; read by the tools.
SEEN: dict[str, dict] = {}


def _host(name: str, value: Any, on_device: bool) -> str | None:
    """How to copy a host value: "tensor", "array", "container", or None."""
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    if isinstance(value, (dict, list)):
        return "container"
    if np is not None and isinstance(value, np.ndarray):
        return "array"
    tensor = torch is not None and isinstance(value, torch.Tensor)
    if tensor and (value.is_cpu if on_device else is_host_field(name)):
        return "tensor"
    return None


def _copy(value: Any, kind: str, on_device: bool) -> Any:
    if kind == "container":
        return copy.deepcopy(value)
    if kind == "array":
        return value.copy()
    if on_device and value.is_pinned():  # as the runner's pinned buffers
        return value.new_empty(value.shape).pin_memory().copy_(value)
    return value.clone()


def _same(a: Any, b: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # an array
        return a.shape == b.shape and bool((a == b).all())
    return bool(a == b)


def own_copy(metadata: Any) -> tuple[Any, dict[str, tuple[Any, Any]]]:
    """A shallow copy of ``metadata`` whose host values are copies, and
    ``{field: (shared value, the copy's)}``."""
    if hasattr(metadata, "__dict__"):  # vLLM's dataclass: a fast shallow copy
        own = object.__new__(type(metadata))
        own.__dict__.update(metadata.__dict__)
    else:
        own = copy.copy(metadata)
    fields = vars(own)
    qsl = fields.get("query_start_loc")
    on_device = getattr(qsl, "is_cpu", True) is False  # the probe
    copies = {}
    for name, value in fields.items():
        kind = None if value is None else _host(name, value, on_device)
        if kind is not None:
            copies[name] = (value, _copy(value, kind, on_device))
            fields[name] = copies[name][1]
    return own, copies


def _settle(shared: Any, own: Any, copies: dict, owner: str) -> None:
    """Bring what the capture did to its copy back, except its in-place host
    writes; log once what it wrote."""
    mine = vars(own)
    for name, value in mine.items():
        before = copies[name][1] if name in copies else vars(shared).get(name)
        if value is not before or name not in vars(shared):
            setattr(shared, name, value)  # rebound: as without the guard
    wrote = [n for n, (s, m) in copies.items() if mine.get(n) is m and not _same(s, m)]
    seen = SEEN.setdefault(owner, {"calls": 0, "wrote": {}})
    seen["calls"] += 1
    size = getattr(shared, "num_actual_tokens", "?")
    new = [n for n in wrote if n not in seen["wrote"]]
    for name in new:
        seen["wrote"][name] = size
    if new:
        _say(owner, f"{owner}'s capture wrote {', '.join(new)} (size {size}); "
             f"kept from the other builders (backport of PR {PR})")  # fmt: skip
    elif seen["calls"] == 1 and not wrote:
        _say(owner, f"{owner}'s capture, watched: it wrote no shared host value "
             f"(size {size})")  # fmt: skip


def _say(owner: str, message: str, warning: bool = False) -> None:
    with base.LOCK:
        if (owner, message) in _said:
            return
        _said.add((owner, message))
    (_log.warning if warning else _log.info)(f"vllm-capture-guard: {message}")


def guarded_call(capture: Any, owner: str, metadata: Any, *args: Any, **kw: Any):
    """``capture(metadata, ...)`` with the shared host values kept."""
    if getattr(_state, "depth", 0):  # nested: the outer capture's copy is ours
        return capture(metadata, *args, **kw)
    try:
        own, copies = own_copy(metadata)
    except Exception as e:  # never stop vLLM: its own call, values put back
        _say(owner, f"could not copy the metadata for {owner}'s capture ({e!r}); "
             "it ran on the shared metadata, whose host values were put back "
             "after it", warning=True)  # fmt: skip
        return _restoring(capture, metadata, args, kw)
    _state.depth = 1
    try:
        result = capture(own, *args, **kw)
    finally:
        _state.depth = 0
    try:
        _settle(metadata, own, copies, owner)
    except Exception as e:
        _say(owner, f"could not compare {owner}'s capture ({e!r})", warning=True)
    return result


def _restoring(capture: Any, metadata: Any, args: tuple, kw: dict) -> Any:
    """vLLM's own call on the shared metadata; its host tensors' values put
    back after it (the fallback when no copy can be made)."""
    names = getattr(type(metadata), "__slots__", None) or vars(metadata)
    fields = {n: getattr(metadata, n, None) for n in names}
    on_device = getattr(fields.get("query_start_loc"), "is_cpu", True) is False
    saved = [
        (v, v.clone())
        for n, v in fields.items()
        if v is not None and _host(n, v, on_device) == "tensor"
    ]
    try:
        return capture(metadata, *args, **kw)
    finally:
        for tensor, before in saved:
            tensor.copy_(before)


def _class_guard(fn: Any) -> Any:
    def build_for_cudagraph_capture(self, common_attn_metadata, *args, **kwargs):
        bound = fn.__get__(self, type(self))
        name = type(self).__name__
        return guarded_call(bound, name, common_attn_metadata, *args, **kwargs)

    return build_for_cudagraph_capture


def guard_instance(builder: Any) -> bool:
    """Guard ``builder``'s capture, resolved at each call (its own, set in
    ``__init__``, else its class's as it is then). False if it has no
    ``__dict__`` (its class guard stands)."""
    own = getattr(builder, "__dict__", {}).get(METHOD)
    if not hasattr(builder, "__dict__") or base.is_guarded(own):
        return False
    cls = type(builder)

    def build_for_cudagraph_capture(common_attn_metadata, *args, **kwargs):
        capture = own or getattr(cls, METHOD).__get__(builder, cls)
        name = cls.__name__
        return guarded_call(capture, name, common_attn_metadata, *args, **kwargs)

    setattr(build_for_cudagraph_capture, base.MARKER, own)
    builder.__dict__[METHOD] = build_for_cudagraph_capture
    return True


def builder_classes() -> list[type]:
    """Every builder class derived from vLLM's base (the base included) that
    defines a capture of its own, as imported now."""
    root = getattr(sys.modules.get(BACKEND), BUILDER, None)
    if not isinstance(root, type):
        return []
    return [c for c in base.subclasses(root) if METHOD in vars(c)]


def _making(make: Any) -> Any:
    def create_metadata_builders(self, *args, **kwargs):
        try:
            _apply()  # before the backend's get_builder_cls() is asked
        except Exception as e:
            _say(GROUP, f"could not check the patches before {MAKE} ({e!r})", True)
        result = make(self, *args, **kwargs)
        try:
            for builder in getattr(self, "metadata_builders", None) or ():
                guard_instance(builder)
                if METHOD in vars(type(builder)):
                    _guard_class(type(builder))
        except Exception as e:
            _say(GROUP, f"could not guard the builders {MAKE} made ({e!r})", True)
        return result

    return create_metadata_builders


def _apply() -> None:
    plugin = sys.modules.get("vllm_capture_guard.runtime.plugin")
    if plugin is not None:
        plugin.apply_all(when=" (before vLLM made its builders)")


def _guard_class(cls: type) -> bool:
    if base.is_guarded(vars(cls).get(METHOD)):
        return False
    base.wrap_method(cls, METHOD, _class_guard)
    return True


class RocmAttnCpuOffsets(base.Patch):
    name, pr = "rocm-attn-cpu-offsets", PR
    modules = (UTILS, BACKEND, *(m for m, _ in ROCM))
    backends = ("ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN")
    targets = (
        (ROCM[0][0], "RocmAttentionMetadataBuilder"),
        (ROCM[0][0], "RocmAttentionBackend"),
    )

    def plan(self, module: ModuleType) -> base.Outcome:
        group = getattr(sys.modules.get(UTILS), GROUP, None)
        make = vars(group).get(MAKE) if isinstance(group, type) else None
        classes = [c for c in builder_classes() if not base.is_guarded(vars(c)[METHOD])]
        todo = make is not None and not base.is_guarded(make)
        warning = None
        if UTILS in sys.modules and make is None:
            warning = (
                f"{UTILS} has no {GROUP}.{MAKE}: the builders it makes are "
                "guarded only by their classes'"
            )
        if not (todo or classes):
            return base.Outcome(self.name, base.Status.ALREADY, DETAIL, warning)
        data = (group if todo else None, classes)
        return base.Outcome(self.name, base.Status.NEEDED, DETAIL, warning, data)

    def install(self, plan: base.Outcome) -> str:
        group, classes = plan.data
        if group is not None:
            base.wrap_method(group, MAKE, _making)
        for cls in classes:
            _guard_class(cls)
        return DETAIL

    def uninstall(self) -> bool:
        group = getattr(sys.modules.get(UTILS), GROUP, None)
        done = isinstance(group, type) and base.unwrap_method(group, MAKE)
        undone = [base.unwrap_method(c, METHOD) for c in reversed(builder_classes())]
        return any(undone) or done


DETAIL = (
    "every metadata builder's capture runs on its own copy of the host metadata, "
    f"as vLLM makes each builder and on every builder class (backport of PR {PR})"
)
