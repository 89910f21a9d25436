# SPDX-License-Identifier: Apache-2.0
"""Where the guard is installed: on every builder vLLM's ``AttentionGroup``
makes (its capture resolved at each call), on every builder class with a
capture of its own, and on each such class as Python makes it."""

from __future__ import annotations

import sys
import types
from typing import Any

from vllm_capture_guard.runtime import base, guard
from vllm_capture_guard.runtime.base import say

METHOD = "build_for_cudagraph_capture"
UTILS, GROUP = "vllm.v1.worker.utils", "AttentionGroup"
MAKE = "create_metadata_builders"
BASE, BUILDER = "vllm.v1.attention.backend", "AttentionMetadataBuilder"
BACKENDS = ("rocm_attn", "rocm_aiter_unified_attn")  # their import applies it too


def guard_class(cls: type) -> None:
    def make(fn: Any) -> Any:
        def build_for_cudagraph_capture(self, common_attn_metadata, *args, **kwargs):
            bound, owner = fn.__get__(self, type(self)), type(self).__name__
            return guard.guarded_call(
                bound, owner, common_attn_metadata, *args, **kwargs
            )

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
        return guard.guarded_call(
            capture, cls.__name__, common_attn_metadata, *args, **kw
        )

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
            why = f"could not guard {cls.__name__} as it was made ({base.short(e)})"
            say(why, True)

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
                if hasattr(builder, "__dict__"):
                    guard_instance(builder)
                if METHOD in vars(type(builder)):
                    guard_class(type(builder))
        except Exception as e:
            say(f"could not guard the builders {MAKE} made ({e!r})", True)
        return result

    return create_metadata_builders


DETAIL = (
    "every metadata builder's capture puts back the host values it changed in place, "
    f"as vLLM makes each builder and on every builder class (backport of PR {guard.PR})"
)


class CaptureGuard(base.Patch):
    """The guard's installation, under the name operators know it by."""

    name, pr = "rocm-attn-cpu-offsets", guard.PR
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
        warning = None
        if UTILS in sys.modules and make is None:
            warning = (
                f"{UTILS} has no {GROUP}.{MAKE}: the builders vLLM makes are "
                "guarded only by their classes'"
            )
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
