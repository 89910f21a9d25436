# SPDX-License-Identifier: Apache-2.0
"""No builder's capture may change the host values other builders read
(backport of PR #51585, in 0.29.0; delete when 0.29.0 is the oldest supported).
Symptom: MiniMax-M3 with ``ROCM_ATTN`` or ``ROCM_AITER_UNIFIED_ATTN`` dies at
start-up (``indexer.py``: ``assert decode_query_len > 0``): the ROCm capture
zeroes the shared host ``query_start_loc_cpu`` with the device offsets. How:
every ``build_for_cudagraph_capture`` runs guarded: its host values are saved,
and what it changed is put back once its device work is done; said once."""

from __future__ import annotations

import copy
import ctypes
import functools
import logging
import os
import sys
import threading
import types
from typing import Any

from vllm_capture_guard.runtime import patches as base

PR, METHOD = "#51585", "build_for_cudagraph_capture"
UTILS, GROUP = "vllm.v1.worker.utils", "AttentionGroup"
MAKE = "create_metadata_builders"
BASE, BUILDER = "vllm.v1.attention.backend", "AttentionMetadataBuilder"
BACKENDS = ("rocm_attn", "rocm_aiter_unified_attn")  # their import applies it too
#: Host fields whose names do not say so (the rule where all is on the CPU).
HOST_NAMES = frozenset({"is_prefilling", "rswa_prefix_lens", "req_idx"})
#: Per builder class: {"calls": n, "wrote": {field: size at the first write}}.
SEEN: dict[str, dict] = {}
_PLAIN = frozenset({type(None), bool, int, float, str})
_log = logging.getLogger("vllm.capture_guard")
_state = threading.local()  # .active: ids of the metadata guarded in this thread
_said: set[str] = set()
string_at = ctypes.string_at
EXCHANGE = "ThreadExchangeStreamCaptureMode"  # of the CUDA driver, or HIP
CAPTURING = "inside a stream capture"  # save()'s wait: nothing has run yet
#: Said once per builder class whose capture runs inside a stream capture.
CAPTURED = (
    "{}'s capture ran inside an active stream capture (a CUDA or HIP graph being "
    "recorded): its host writes were put back at once, so the graph's copies from "
    "them read the kept values at replay, as under 0.29.0's; a copy it captured "
    "into host memory writes there at every replay, unseen by the guard (no vLLM "
    "caller from 0.27.1 to 0.33.0 does this)"
)


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


@functools.cache  # (name, descriptor) of each slot of cls and its bases
def _slots(cls: type) -> tuple:
    return tuple((name, d) for c in reversed(cls.__mro__) for name, d in vars(c).items()
                 if type(d) is types.MemberDescriptorType)  # fmt: skip


def fields_of(metadata: Any) -> dict[str, Any]:
    """What ``metadata`` holds, as a dataclass holds it: its instance dict and
    its slots across the class hierarchy; no property is ever read."""
    own, slots = getattr(metadata, "__dict__", None), _slots(type(metadata))
    if not slots:  # the common case: the instance dict itself (or a TypeError)
        return vars(metadata)
    fields = dict(own) if isinstance(own, dict) else {}
    for name, slot in slots:
        try:  # noqa: SIM105 (a context manager per slot costs more)
            fields[name] = slot.__get__(metadata)
        except AttributeError:  # a slot never set
            pass
    return fields


def save(metadata: Any) -> tuple[list, list[str], Any, Any]:
    """``([(field, value, copy, pointer)], [fields not saved], wait, size)`` for
    each host value, also in containers (a dense tensor's copy is its bytes);
    wait: the device whose stream may still copy a pinned one, or ``CAPTURING``."""
    fields, torch = fields_of(metadata), sys.modules.get("torch")
    device = getattr(fields.get("query_start_loc"), "device", None)
    on_device = getattr(device, "type", "cpu") != "cpu"
    wait = None
    if on_device and device.type == "cuda" and torch.cuda.is_initialized():
        wait = CAPTURING if torch.cuda.is_current_stream_capturing() else device
    pinned = wait is CAPTURING
    saved, failed, seen = [], [], set()
    todo = [(n, v) for n, v in fields.items() if type(v) not in _PLAIN  # grows
            and getattr(v, "is_cpu", 1) is not False]  # no device tensors  # fmt: skip
    top, tensor = len(todo), torch.Tensor if torch is not None else ()
    for i, (name, value) in enumerate(todo):
        if type(value) in _PLAIN or id(value) in seen:
            continue  # a scalar, or a value another field holds
        seen.add(id(value))
        try:
            if isinstance(value, tensor):
                if value.is_cpu and (on_device or i >= top or is_host_field(name)):
                    dense = type(value) is tensor and value.layout is torch.strided
                    if dense and value.is_contiguous() and (ptr := value.data_ptr()):
                        saved.append((name, value, string_at(ptr, value.nbytes), ptr))
                    else:  # not one dense block of memory: a copy by torch
                        saved.append((name, value, value.clone(), None))
                    pinned = pinned or (wait is not None and _pinned(value, torch))
            elif isinstance(value, (dict, list, tuple)):
                items = value.items() if isinstance(value, dict) else enumerate(value)
                todo += [(f"{name}[{k!r}]", v) for k, v in items]
                if not isinstance(value, tuple):
                    saved.append((name, value, copy.copy(value), None))
            elif hasattr(value, "__array__") and hasattr(value, "copy"):  # numpy
                saved.append((name, value, value.copy(), None))
                pinned = pinned or (wait is not None and _pinned(value, torch))
        except Exception as e:  # that value alone goes unsaved
            failed.append(f"{name} ({_short(e)})")
    return saved, failed, wait if pinned else None, fields.get("num_actual_tokens", "?")


def _pinned(value: Any, torch: Any) -> bool:
    """Is this host tensor's or array's memory pinned? Yes where torch cannot tell."""
    try:
        if not isinstance(value, torch.Tensor):  # an array: over torch's memory?
            value = torch.from_numpy(value) if value.flags.writeable else None
        return value is None or value.is_pinned()
    except Exception:
        return True


def wait_for(device: Any) -> None:
    """Until ``device``'s current stream has done what is queued (one event, never
    the device), relaxed meanwhile: no graph capture elsewhere is invalidated."""
    torch, events = sys.modules["torch"], _state.__dict__.setdefault("events", {})
    event = events.get(device) or events.setdefault(device, torch.cuda.Event())
    exchange, mode = _exchange(), ctypes.c_int(2)  # 2: the relaxed mode
    relaxed = exchange(ctypes.byref(mode)) == 0
    try:
        event.record(torch.cuda.current_stream(device.index))
        event.synchronize()
    finally:
        if relaxed:  # back to the mode this thread had
            exchange(ctypes.byref(mode))


@functools.cache
def _exchange() -> Any:
    """The capture-mode exchange of the CUDA driver or HIP torch loaded, or a no-op."""
    hip = sys.modules["torch"].version.hip
    lib = f"libamdhip64.so.{hip.split('.')[0]}" if hip else "libcuda.so.1"
    try:
        found = ctypes.CDLL(lib, mode=os.RTLD_NOLOAD)
        found = getattr(found, ("hip" if hip else "cu") + EXCHANGE)
        found.argtypes, found.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int
        return found
    except (OSError, AttributeError) as e:
        _say(f"{lib} has no {EXCHANGE} ({_short(e)}): a graph captured in another "
             "thread while the guard waits would be invalidated", True)  # fmt: skip
        return lambda mode: 1


def _same(a: Any, b: Any, ptr: int | None) -> bool:
    if ptr is not None:  # bytes; the memory moved if the pointer did
        if a.data_ptr() != ptr or a.nbytes != len(b):
            raise ValueError("its memory moved or changed size")
        return string_at(ptr, len(b)) == b
    if isinstance(a, dict):  # the very same objects, or equal scalars
        return a.keys() == b.keys() and all(_kept(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_kept, a, b))
    if a.shape != b.shape:
        return False
    return bool(((a == b) | ((a != a) & (b != b))).all())  # NaN for NaN: no write


def _kept(x: Any, y: Any) -> bool:
    return x is y or (type(x) in _PLAIN and type(x) is type(y) and x == y)


def changed(saved: list) -> tuple[list, list[str]]:
    """The values changed in place, and the fields that could not be told."""
    out, failed = [], []
    for entry in saved:  # all told before any is put back: values share memory
        try:
            if not _same(entry[1], entry[2], entry[3]):
                out.append(entry)
        except Exception as e:
            failed.append(f"{entry[0]} ({_short(e)})")
    return out, failed


def put_back(changes: list) -> list[str]:
    """Put back each changed value in place: the fields that could not be."""
    failed = []
    for name, value, before, ptr in changes:
        try:
            if ptr is not None:
                ctypes.memmove(ptr, before, len(before))
            elif isinstance(value, dict):
                value.clear()
                value.update(before)
            else:  # a list, a tensor or an array
                value[slice(None) if isinstance(value, list) else ...] = before
        except Exception as e:
            failed.append(f"{name} ({_short(e)})")
    return failed


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 120 else text[:117] + "..."


def _say(message: str, warning: bool = False) -> None:
    with base.LOCK:
        if message in _said:
            return
        _said.add(message)
    (_log.warning if warning else _log.info)(f"vllm-capture-guard: {message}")


def guarded_call(capture: Any, owner: str, metadata: Any, *args: Any, **kw: Any) -> Any:
    """``capture(metadata, ...)``; then, once the device work it queued is
    done, put back what it changed in place."""
    active = _state.__dict__.setdefault("active", set())
    if id(metadata) in active:  # nested on the same metadata: the outer puts back
        return capture(metadata, *args, **kw)
    try:
        saved, failed, wait, size = save(metadata)
    except Exception as e:  # never stop vLLM: its own call, unguarded
        why = f"could not read the metadata for {owner}'s capture ({_short(e)})"
        _say(f"{why}; it ran unguarded, and may change what other builders read", True)
        return capture(metadata, *args, **kw)
    active.add(id(metadata))
    raised = True
    try:
        result = capture(metadata, *args, **kw)
        raised = False
        return result
    finally:
        active.discard(id(metadata))
        _settle(owner, saved, failed, wait, size, raised)


def _settle(owner, saved, failed, wait, size, raised):  # noqa: ANN001, ANN202
    """After the capture: wait for its device work, then tell and put back."""
    fault = None
    if wait is CAPTURING:
        _say(CAPTURED.format(owner), True)
    elif wait is not None:
        try:
            wait_for(wait)
        except Exception as e:  # a device error goes on to vLLM, after the put-back
            err = getattr(sys.modules["torch"], "AcceleratorError", RuntimeError)
            if isinstance(e, err) and "capturing" not in str(e) and not raised:
                fault = e
            else:  # the guard's own: told without waiting
                _say(f"could not wait for {owner}'s capture ({_short(e)})", True)
    try:
        changes, lost = changed(saved)
        lost += put_back(changes)
        wrote = [name for name, *_ in changes]
        with base.LOCK:
            seen = SEEN.setdefault(owner, {"calls": 0, "wrote": {}})
            seen["calls"] += 1
            new = [n for n in wrote if n not in seen["wrote"]]
            seen["wrote"].update(dict.fromkeys(new, size))
        if new:
            _say(f"{owner}'s capture wrote {', '.join(new)} (size {size}); kept "
                 f"from the other builders (backport of PR {PR})")  # fmt: skip
        elif seen["calls"] == 1:
            _say(f"{owner}'s capture, watched: it wrote no shared host value "
                 f"(size {size})")  # fmt: skip
        if lost := failed + lost:
            _say(f"{owner}'s capture: could not keep {', '.join(lost)} from the "
                 "other builders", True)  # fmt: skip
    except Exception as e:
        _say(f"could not put back what {owner}'s capture wrote ({_short(e)})", True)
    if fault is not None:
        raise fault


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

    def build_for_cudagraph_capture(common_attn_metadata, *args, **kw):
        capture = own or getattr(cls, METHOD).__get__(builder, cls)
        return guarded_call(capture, cls.__name__, common_attn_metadata, *args, **kw)

    setattr(build_for_cudagraph_capture, base.MARKER, own)
    builder.__dict__[METHOD] = build_for_cudagraph_capture


def _watch(root: type) -> None:
    """Every class derived from ``root`` later, with a capture of its own, is
    guarded as Python makes it (so also one made late and built directly)."""
    previous = vars(root).get("__init_subclass__")  # a classmethod, or None

    def __init_subclass__(cls, **kwargs):
        if previous is None:
            super(root, cls).__init_subclass__(**kwargs)
        else:
            previous.__get__(None, cls)(**kwargs)
        try:
            if METHOD in vars(cls):
                guard_class(cls)
        except Exception as e:
            _say(f"could not guard {cls.__name__} as it was made ({_short(e)})", True)

    setattr(__init_subclass__, base.MARKER, previous)
    root.__init_subclass__ = classmethod(__init_subclass__)


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
    "every metadata builder's capture puts back the host values it changed in place, "
    f"as vLLM makes each builder and on every builder class (backport of PR {PR})"
)


class RocmAttnCpuOffsets(base.Patch):
    name, pr = "rocm-attn-cpu-offsets", PR
    modules = (UTILS, BASE, *(f"vllm.v1.attention.backends.{m}" for m in BACKENDS))

    def plan(self, module: types.ModuleType) -> base.Outcome:
        group = getattr(sys.modules.get(UTILS), GROUP, None)
        make = vars(group).get(MAKE) if isinstance(group, type) else None
        classes = [c for c in builder_classes() if not base.is_guarded(vars(c)[METHOD])]
        todo = make is not None and not base.is_guarded(make)
        root = getattr(sys.modules.get(BASE), BUILDER, None)
        root = root if isinstance(root, type) else None
        watch = root is not None and not base.is_guarded(
            vars(root).get("__init_subclass__")
        )
        warning = (
            f"{UTILS} has no {GROUP}.{MAKE}: the builders vLLM makes are "
            "guarded only by their classes'"
        ) if UTILS in sys.modules and make is None else None  # fmt: skip
        needed = todo or classes or watch
        status = base.Status.NEEDED if needed else base.Status.ALREADY
        data = (group if todo else None, classes, root if watch else None)
        return base.Outcome(self.name, status, DETAIL, warning, data)

    def install(self, plan: base.Outcome) -> str:
        group, classes, root = plan.data
        if root is not None:
            _watch(root)
        if group is not None:
            base.wrap_method(group, MAKE, _making)
        for cls in classes:
            guard_class(cls)
        return DETAIL
