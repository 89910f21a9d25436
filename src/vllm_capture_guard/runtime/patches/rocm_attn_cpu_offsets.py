# SPDX-License-Identifier: Apache-2.0
"""ROCM_ATTN capture must not zero the CPU query offsets.

What:
    ``build_for_cudagraph_capture`` of
    ``vllm.v1.attention.backends.rocm_attn.RocmAttentionMetadataBuilder`` and
    of every class vLLM may instantiate in its place: its subclasses, and
    whatever a backend's ``get_builder_cls()`` returns that derives from it.

Symptom:
    ``vllm serve`` of a mixed-attention model (MiniMax-M3) with
    ``--attention-backend ROCM_ATTN`` or ``ROCM_AITER_UNIFIED_ATTN`` and full
    CUDA-graph capture dies at startup::

        File "vllm/models/minimax_m3/common/indexer.py", line 317, in build
            assert decode_query_len > 0
        EngineCore failed to start.

Cause:
    The runner hands one ``CommonAttentionMetadata`` (views of its persistent
    buffers, shallow-copied per KV-cache group) to every builder in turn. This
    builder zeroes the device ``query_start_loc`` (a deliberate guard against an
    illegal memory access in the prefix-prefill kernel, vLLM issue #25985) and
    also the host ``query_start_loc_cpu``, which no ROCm kernel reads but every
    later builder does: the MiniMax-M3 indexer then computes a query length of 0.

Upstream:
    vllm-project/vllm PR #51585, released in 0.29.0: only the device offsets
    are zeroed.

Affected:
    0.27.0, 0.27.1, 0.28.0 and the ROCm nightlies built from them. In those
    releases ROCM_AITER_UNIFIED_ATTN uses this same builder class.

Detected:
    By behaviour (:mod:`vllm_capture_guard.runtime.probe`), class by class: the
    capture each class resolves through its MRO runs on a tiny metadata, on
    the CPU path and on a path whose tensors report a GPU. A class is left
    alone only if both runs completed and neither wrote
    ``query_start_loc_cpu``; otherwise (a write, or a probe that could not
    finish) it gets the wrapper.

How:
    The class gets its own ``build_for_cudagraph_capture``: the method it
    resolved before, run unchanged (the #25985 guard included), after which the
    values of the caller's ``query_start_loc_cpu`` are put back. That host
    buffer is briefly zeroed, as before; the device copy vLLM made of it just
    before capture is not affected in a way a later builder could see: the
    capture's own ``query_start_loc.zero_()`` runs after that copy on the same
    stream and zeroes the device offsets in any case, as 0.29.0 does. The device
    ``query_start_loc`` stays zeroed, as in 0.29.0. ``build()``, the serving
    hot path, is not touched. Where the base class needed the fix, a class
    derived from it later (a vendor backend module imported afterwards) is
    checked, and fixed if need be, when it is defined; registry backends'
    modules imported later are checked when vLLM imports them.

Delete when:
    The oldest vLLM this project supports is 0.29.0 or newer.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

from vllm_capture_guard.runtime.patches import (
    LOCK,
    MARKER,
    Outcome,
    Patch,
    Plan,
    Status,
    is_guarded,
    unwrap_method,
    wrap_method,
)

MODULE = "vllm.v1.attention.backends.rocm_attn"
CLASS = "RocmAttentionMetadataBuilder"
BACKEND = "RocmAttentionBackend"
METHOD = "build_for_cudagraph_capture"
SUBCLASS_HOOK = "__init_subclass__"
FIELD = "query_start_loc_cpu"
REGISTRY = "vllm.v1.attention.backends.registry"
#: Our own classes (the AITER backport) are never family members to wrap.
OURS = "vllm_capture_guard."

_inside = threading.local()


def _keep_cpu_offsets(original: Any) -> Any:
    from vllm_capture_guard.runtime.contract import preserved, shares_memory

    def build_for_cudagraph_capture(self, common_attn_metadata, *args, **kwargs):
        cm = common_attn_metadata
        if getattr(_inside, "active", False) or shares_memory(
            cm.query_start_loc, cm.query_start_loc_cpu
        ):
            # Inside another class's wrapper (a subclass calling super()), or
            # one buffer serving as both: nothing more to keep.
            return original(self, cm, *args, **kwargs)
        _inside.active = True
        try:
            with preserved(cm, FIELD):
                return original(self, cm, *args, **kwargs)
        finally:
            _inside.active = False

    return build_for_cudagraph_capture


def _ours(cls: type) -> bool:
    return cls.__module__.startswith(OURS)


def _subclasses(cls: type) -> list[type]:
    if _ours(cls):
        return []
    seen, order, todo = {cls}, [cls], [cls]
    while todo:
        for sub in todo.pop(0).__subclasses__():
            if sub not in seen and not _ours(sub):
                seen.add(sub)
                order.append(sub)
                todo.append(sub)
    return order


def registry_backends() -> list[type]:
    """Backend classes of vLLM's registry whose module is already imported
    (the registry is read only if vLLM imported it; nothing is imported)."""
    registry = sys.modules.get(REGISTRY)
    found: list[type] = []
    for enum_name in ("AttentionBackendEnum",):
        members = getattr(getattr(registry, enum_name, None), "__members__", {})
        for member in members.values():
            try:
                path = member.get_path()
            except Exception:
                continue
            module_name, _, cls_name = path.rpartition(".")
            cls = getattr(sys.modules.get(module_name), cls_name, None)
            if isinstance(cls, type):
                found.append(cls)
    return found


def registry_modules() -> list[str]:
    """Module names of the registry's backends that are not imported yet."""
    registry = sys.modules.get(REGISTRY)
    members = getattr(
        getattr(registry, "AttentionBackendEnum", None), "__members__", {}
    )
    names = set()
    for member in members.values():
        try:
            names.add(member.get_path().rpartition(".")[0])
        except Exception:
            continue
    return sorted(n for n in names if n and n not in sys.modules)


class RocmAttnCpuOffsets(Patch):
    name = "rocm-attn-cpu-offsets"
    pr = "#51585"
    modules = (MODULE,)
    backends = ("ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN")
    targets = ((MODULE, CLASS), (MODULE, BACKEND))

    def family(self) -> list[type]:
        """The ROCm builder and every class vLLM may instantiate in its place."""
        module = self.import_target()
        base = getattr(module, CLASS, None)
        backend = getattr(module, BACKEND, None)
        if base is None and backend is not None:
            base = backend.get_builder_cls()
        if not isinstance(base, type):
            raise ImportError(f"{MODULE} has neither {CLASS} nor {BACKEND}")
        family = _subclasses(base)
        for candidate in [backend, *vars(module).values(), *registry_backends()]:
            if not isinstance(candidate, type):
                continue
            get = getattr(candidate, "get_builder_cls", None)
            if get is None:
                continue
            try:
                returned = get()
            except Exception:
                continue
            if isinstance(returned, type) and issubclass(returned, base):
                family.extend(c for c in _subclasses(returned) if c not in family)
        return family

    def plan(self) -> Plan:
        from vllm_capture_guard.runtime.probe import probe

        wrap, unproven, clean, guarded = [], [], [], []
        for cls in self.family():
            if getattr(cls, METHOD, None) is None:
                continue
            if is_guarded(getattr(cls, METHOD)):
                guarded.append(cls.__name__)
                continue
            finding = probe(cls)
            if finding.proves_untouched(FIELD):
                clean.append(cls.__name__)
                continue
            wrap.append(cls)
            if not finding.complete:
                unproven.append(f"{cls.__qualname__}: {finding.reason}")
        if wrap:
            names = ", ".join(c.__name__ for c in wrap)
            warning = None
            if unproven:
                warning = (
                    f"could not prove that the capture of {'; '.join(unproven)} "
                    f"leaves {FIELD} alone, so it now keeps {FIELD} as vLLM "
                    f"0.29.0 does (backport of PR {self.pr})"
                )
            return Plan(Status.NEEDED, f"{names} capture writes {FIELD}", warning, wrap)
        if guarded:
            return Plan(Status.ALREADY, f"{', '.join(guarded)} keep {FIELD}")
        return Plan(
            Status.NOT_NEEDED,
            f"{', '.join(clean) or CLASS} capture leaves {FIELD} alone",
        )

    def fallback(self, error: Exception) -> Plan:
        module = sys.modules.get(MODULE)
        base = getattr(module, CLASS, None)
        if not isinstance(base, type):
            raise error
        return Plan(
            Status.NEEDED,
            f"could not check {CLASS}",
            f"could not check {CLASS} ({type(error).__name__}: {error}), so its "
            f"capture now keeps {FIELD} as vLLM 0.29.0 does",
            _subclasses(base),
        )

    def follow(self) -> list[str]:
        return registry_modules()

    def install(self, plan: Plan) -> str:
        base = getattr(sys.modules.get(MODULE), CLASS, None)
        if isinstance(base, type) and base in plan.data:
            self._watch_subclasses(base)
        done = []
        for cls in plan.data:  # base classes first: a subclass that only
            if not is_guarded(getattr(cls, METHOD)):  # inherits needs nothing
                wrap_method(cls, METHOD, _keep_cpu_offsets)
                done.append(cls.__name__)
        names = ", ".join(done)
        return f"{names}.{METHOD} keeps {FIELD} (backport of PR {self.pr})"

    def _watch_subclasses(self, base: type) -> None:
        """Check every subclass defined from now on (a vendor backend module
        imported later), when it is defined. Only where the base itself
        needed the fix: on a fixed vLLM its classes stay untouched."""
        current = base.__dict__.get(SUBCLASS_HOOK)
        if current is not None and is_guarded(current):
            return
        own = current
        patch = self

        def __init_subclass__(cls, **kwargs):  # noqa: N807
            if own is not None:
                own.__get__(None, cls)(**kwargs)
            else:
                super(base, cls).__init_subclass__(**kwargs)
            patch.adopt(cls)

        setattr(__init_subclass__, MARKER, own)
        setattr(base, SUBCLASS_HOOK, classmethod(__init_subclass__))

    def adopt(self, cls: type) -> None:
        """Check one class defined after the patch was installed. Never
        raises: this runs inside a ``class`` statement of vLLM or a vendor."""
        from vllm_capture_guard.runtime.probe import probe

        try:
            with LOCK:
                if self.reverted or _ours(cls):
                    return
                capture = getattr(cls, METHOD, None)
                if capture is None or is_guarded(capture):
                    return
                finding = probe(cls)
                if finding.proves_untouched(FIELD):
                    return
                wrap_method(cls, METHOD, _keep_cpu_offsets)
                warning = None
                if not finding.complete:
                    warning = (
                        f"could not prove that the capture of {cls.__qualname__} "
                        f"({finding.reason}) leaves {FIELD} alone, so it now keeps "
                        f"{FIELD} as vLLM 0.29.0 does"
                    )
                outcome = Outcome(
                    self.name,
                    Status.PATCHED,
                    f"{cls.__name__}.{METHOD} keeps {FIELD} (defined after "
                    f"{MODULE} was imported; backport of PR {self.pr})",
                    warning,
                )
            if self.notify is not None:
                self.notify(outcome)
        except Exception as e:
            if self.notify is not None:
                with contextlib.suppress(Exception):
                    self.notify(
                        Outcome(
                            self.name,
                            Status.FAILED,
                            f"could not check {cls.__qualname__}: "
                            f"{type(e).__name__}: {e}",
                        )
                    )

    def uninstall(self) -> bool:
        module = sys.modules.get(MODULE)
        base = getattr(module, CLASS, None)
        if base is None:
            return False
        hook = base.__dict__.get(SUBCLASS_HOOK)
        if hook is not None and is_guarded(hook):
            own = getattr(hook.__func__, MARKER)
            if own is None:
                delattr(base, SUBCLASS_HOOK)
            else:
                setattr(base, SUBCLASS_HOOK, own)
        undone = False
        for cls in reversed(_subclasses(base)):
            undone |= unwrap_method(cls, METHOD)
        return undone
