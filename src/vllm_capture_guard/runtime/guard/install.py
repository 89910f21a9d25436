# SPDX-License-Identifier: Apache-2.0
"""Where the guard is installed: on every builder that ``AttentionGroup`` makes, on
every builder class with a capture of its own, and on each as Python makes it."""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

from vllm_capture_guard.runtime import patching
from vllm_capture_guard.runtime.guard import guarded_call
from vllm_capture_guard.runtime.logs import short_error, warn_once

METHOD = "build_for_cudagraph_capture"
UTILS, GROUP = "vllm.v1.worker.utils", "AttentionGroup"
MAKE = "create_metadata_builders"
BASE, BUILDER = "vllm.v1.attention.backend", "AttentionMetadataBuilder"
BACKENDS = ("rocm_attn", "rocm_aiter_unified_attn")  # their import applies it too
ROCM = "vllm.v1.attention.backends.rocm_attn"
PLUGIN = "vllm_capture_guard.runtime.plugin"
DETAIL = (
    "every metadata builder's capture puts back the host values it changed in place, "
    "as vLLM makes each builder and on every builder class "
    f"(backport of PR {guarded_call.PR})"
)


def guard_class(cls: type) -> None:
    """``cls``'s own capture, guarded."""

    def make(fn: Any) -> Any:
        def build_for_cudagraph_capture(self, common_attn_metadata, *a, **kw):
            bound, owner = fn.__get__(self, type(self)), type(self).__name__
            return guarded_call.run(bound, owner, common_attn_metadata, *a, **kw)

        return build_for_cudagraph_capture

    if not patching.is_guarded(vars(cls).get(METHOD)):
        patching.wrap_method(cls, METHOD, make)


def guard_instance(builder: Any) -> None:
    """Its capture guarded, resolved at each call: its own, else its class's."""
    own, cls = vars(builder).get(METHOD), type(builder)
    if patching.is_guarded(own):
        return

    def build_for_cudagraph_capture(common_attn_metadata, *a, **kw):
        call = own if own is not None else getattr(cls, METHOD).__get__(builder, cls)
        return guarded_call.run(call, cls.__name__, common_attn_metadata, *a, **kw)

    setattr(build_for_cudagraph_capture, patching.MARKER, own)
    builder.__dict__[METHOD] = build_for_cudagraph_capture


def _guard_subclasses_as_made(root: type) -> None:
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
            warn_once(f"could not guard {cls.__name__} as made ({short_error(e)})")

    setattr(__init_subclass__, patching.MARKER, previous)
    root.__init_subclass__ = classmethod(__init_subclass__)


def builder_classes() -> list[type]:
    """Every builder class (vLLM's base included) with a capture of its own."""
    root = getattr(sys.modules.get(BASE), BUILDER, None)
    if not isinstance(root, type):
        return []
    return [c for c in patching.subclasses(root) if METHOD in vars(c)]


def _guarding_the_builders_made(make: Any) -> Any:
    """``AttentionGroup.create_metadata_builders``: every patch applied before it
    asks ``get_builder_cls()``, and each builder it made guarded after."""

    def create_metadata_builders(self, *args, **kwargs):
        plugin = sys.modules.get(PLUGIN)
        try:
            if plugin is not None:
                plugin.apply_all(when=" (before vLLM made its builders)")
        except Exception as e:
            warn_once(f"could not check the patches before {MAKE} ({e!r})")
        result = make(self, *args, **kwargs)
        try:
            for builder in getattr(self, "metadata_builders", None) or ():
                if hasattr(builder, "__dict__"):  # its class: as Python made it
                    guard_instance(builder)
        except Exception as e:
            warn_once(f"could not guard the builders {MAKE} made ({e!r})")
        return result

    return create_metadata_builders


@dataclasses.dataclass(frozen=True)
class GuardPlan:  # what is left to guard: None or empty where guarded already
    group: type | None  # AttentionGroup, to guard the builders it makes
    classes: list[type]  # builder classes whose own capture is not guarded
    root: type | None  # vLLM's builder base, to guard classes as Python makes them


class CaptureGuard(patching.Patch):
    name, former_names = "builder-capture-guard", ("rocm-attn-cpu-offsets",)
    pr, backends = guarded_call.PR, ("ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN")
    modules = (UTILS, BASE, *(f"vllm.v1.attention.backends.{m}" for m in BACKENDS))
    targets = ((ROCM, "RocmAttentionMetadataBuilder"), (ROCM, "RocmAttentionBackend"))

    def plan(self, module: types.ModuleType) -> patching.Outcome:
        group = getattr(sys.modules.get(UTILS), GROUP, None)
        make = vars(group).get(MAKE) if isinstance(group, type) else None
        root = getattr(sys.modules.get(BASE), BUILDER, None)
        hook = vars(root).get("__init_subclass__") if isinstance(root, type) else None
        guarded = patching.is_guarded
        todo = GuardPlan(
            group=group if make is not None and not guarded(make) else None,
            classes=[c for c in builder_classes() if not guarded(vars(c)[METHOD])],
            root=root if isinstance(root, type) and not guarded(hook) else None,
        )
        warning = None
        if UTILS in sys.modules and make is None:
            warning = f"{UTILS} has no {GROUP}.{MAKE}: builders guarded by class only"
        needed = todo.group or todo.classes or todo.root
        status = patching.Status.NEEDED if needed else patching.Status.ALREADY
        return patching.Outcome(self.name, status, DETAIL, warning, todo)

    def install(self, plan: patching.Outcome) -> str:
        todo: GuardPlan = plan.data
        if todo.root is not None:
            _guard_subclasses_as_made(todo.root)
        if todo.group is not None:
            patching.wrap_method(todo.group, MAKE, _guarding_the_builders_made)
        for cls in todo.classes:
            guard_class(cls)
        return DETAIL
