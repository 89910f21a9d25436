# SPDX-License-Identifier: Apache-2.0
"""Where the guard is installed (on every builder ``AttentionGroup`` makes, on
every builder class with a capture of its own, and on each as Python makes it),
and the guarded call: save, follow the copies, wait for them, put back."""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

from vllm_capture_guard.runtime import base, guard
from vllm_capture_guard.runtime.base import LOCK, say, short
from vllm_capture_guard.runtime.guard import KEPT, SEEN, copies, keep

METHOD = "build_for_cudagraph_capture"
UTILS, GROUP = "vllm.v1.worker.utils", "AttentionGroup"
MAKE = "create_metadata_builders"
BASE, BUILDER = "vllm.v1.attention.backend", "AttentionMetadataBuilder"
BACKENDS = ("rocm_attn", "rocm_aiter_unified_attn")  # their import applies it too
_state = threading.local()  # .active: ids of the metadata guarded in this thread
CAPTURED = "{}'s capture ran inside an active stream capture: its host writes were "
CAPTURED += "put back at once (the graph reads the kept values at replay, as under "
CAPTURED += "0.29.0); a copy it captured into host memory writes there at every replay"
BLIND = "{}'s capture: the guard cannot see every copy of the saved memory ({}), so it "
BLIND += "waits for the stream after it"


def guarded_call(capture: Any, owner: str, metadata: Any, *args: Any, **kw: Any) -> Any:
    """``capture(metadata)``; once its copies of the saved bytes are done, put back."""
    active = _state.__dict__.setdefault("active", set())
    if id(metadata) in active:  # nested on the same metadata: the outer puts back
        return capture(metadata, *args, **kw)
    try:  # the guard's own torch calls: unseen by another guard's mode
        torch_off = sys.modules["torch"]._C.DisableTorchFunction
        with torch_off():
            saved, failed, watch, size = keep.save(metadata)
    except Exception as e:  # never stop vLLM: its own call, unguarded
        why = f"could not read the metadata for {owner}'s capture ({short(e)})"
        say(f"{why}; it ran unguarded, and may change what other builders read", True)
        return capture(metadata, *args, **kw)
    try:  # follow the copies; if it cannot, it waits for the stream instead
        mode = copies.follow(watch)
        mode and mode.__enter__()
    except Exception as e:
        mode, watch.blind = None, f"its copies could not be followed: {short(e)}"
    active.add(id(metadata))
    raised = True
    try:
        result = capture(metadata, *args, **kw)
        raised = False
        return result
    finally:
        active.discard(id(metadata))
        try:
            mode and mode.__exit__(None, None, None)
        except Exception as e:
            say(f"could not stop following {owner}'s copies ({short(e)})", True)
        with torch_off():
            _settle(owner, saved, failed, watch, size, raised)


def _settle(owner, saved, failed, watch, size, raised):  # noqa: ANN001, ANN202
    """After the capture: wait for the copies it queued, then tell and put back."""
    fault = None
    if watch is copies.CAPTURING:
        say(CAPTURED.format(owner), True)
    elif watch is not None:
        if watch.blind:
            say(BLIND.format(owner, watch.blind))
        try:
            copies.wait(watch)
        except Exception as e:  # a device error goes on to vLLM, after the put-back
            err = getattr(sys.modules["torch"], "AcceleratorError", RuntimeError)
            if isinstance(e, err) and "capturing" not in str(e) and not raised:
                fault = e
            else:  # the guard's own: told without waiting
                say(f"could not wait for {owner}'s capture ({short(e)})", True)
    try:
        changes, lost = keep.changed(saved)
        lost = failed + lost + keep.put_back(changes)
        with LOCK:
            seen = SEEN.setdefault(owner, {"calls": 0, "wrote": {}})
            seen["calls"] += 1
            new = [name for name, *_ in changes if name not in seen["wrote"]]
            seen["wrote"].update(dict.fromkeys(new, size))
        said = f"{owner}'s capture"
        if new:
            say(f"{said} wrote {', '.join(new)} (size {size}); {KEPT}")
        elif seen["calls"] == 1:
            say(f"{said}, watched: it wrote no shared host value (size {size})")
        if lost := ", ".join(lost):
            say(f"{said}: could not keep {lost} from the other builders", True)
    except Exception as e:
        say(f"could not put back what {owner}'s capture wrote ({short(e)})", True)
    if fault is not None:
        raise fault


def guard_class(cls: type) -> None:
    def make(fn: Any) -> Any:
        def build_for_cudagraph_capture(self, common_attn_metadata, *a, **kw):
            bound, owner = fn.__get__(self, type(self)), type(self).__name__
            return guarded_call(bound, owner, common_attn_metadata, *a, **kw)

        return build_for_cudagraph_capture

    if not base.is_guarded(vars(cls).get(METHOD)):
        base.wrap_method(cls, METHOD, make)


def guard_instance(builder: Any) -> None:
    """Its capture guarded, resolved at each call: its own, else its class's."""
    own, cls = vars(builder).get(METHOD), type(builder)
    if base.is_guarded(own):
        return

    def build_for_cudagraph_capture(common_attn_metadata, *a, **kw):
        call = own or getattr(cls, METHOD).__get__(builder, cls)
        return guarded_call(call, cls.__name__, common_attn_metadata, *a, **kw)

    setattr(build_for_cudagraph_capture, base.MARKER, own)
    builder.__dict__[METHOD] = build_for_cudagraph_capture


def _watch(root: type) -> None:
    """Each class later derived from ``root`` with a capture is guarded as made."""
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
            say(f"could not guard {cls.__name__} as made ({base.short(e)})", True)

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
            say(f"could not check the patches before {MAKE} ({e!r})", True)
        result = make(self, *args, **kwargs)
        try:
            for builder in getattr(self, "metadata_builders", None) or ():
                if hasattr(builder, "__dict__"):  # its class: as Python made it
                    guard_instance(builder)
        except Exception as e:
            say(f"could not guard the builders {MAKE} made ({e!r})", True)
        return result

    return create_metadata_builders


DETAIL = (
    "every metadata builder's capture puts back the host values it changed in place, "
    f"as vLLM makes each builder and on every builder class (backport of PR {guard.PR})"
)


class CaptureGuard(base.Patch):  # under the name operators know it by
    name, pr = "rocm-attn-cpu-offsets", guard.PR
    modules = (UTILS, BASE, *(f"vllm.v1.attention.backends.{m}" for m in BACKENDS))

    def plan(self, module: types.ModuleType) -> base.Outcome:
        group = getattr(sys.modules.get(UTILS), GROUP, None)
        make = vars(group).get(MAKE) if isinstance(group, type) else None
        classes = [c for c in builder_classes() if not base.is_guarded(vars(c)[METHOD])]
        todo = make is not None and not base.is_guarded(make)
        root = getattr(sys.modules.get(BASE), BUILDER, None)
        root = root if isinstance(root, type) else None
        hook = vars(root).get("__init_subclass__") if root else None
        watch = root is not None and not base.is_guarded(hook)
        warning = None
        if UTILS in sys.modules and make is None:
            warning = f"{UTILS} has no {GROUP}.{MAKE}: builders guarded by class only"
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
