# SPDX-License-Identifier: Apache-2.0
"""ROCm capture must not change the shared host metadata.

What:
    ``build_for_cudagraph_capture`` of ``vllm.v1.attention.backends.rocm_attn
    .RocmAttentionMetadataBuilder``, of every class derived from it, and of the
    builders that the ROCm and AITER unified backends return.

Symptom:
    ``vllm serve`` of MiniMax-M3 with ``--attention-backend ROCM_ATTN`` or
    ``ROCM_AITER_UNIFIED_ATTN`` and full CUDA-graph capture dies at startup::

        File "vllm/models/minimax_m3/common/indexer.py", line 317, in build
            assert decode_query_len > 0

Cause:
    The runner hands one ``CommonAttentionMetadata`` (views of its persistent
    buffers) to every builder in turn. This capture zeroes the device
    ``query_start_loc`` (a guard against a fault in the prefix-prefill kernel,
    vLLM #25985) and also the host ``query_start_loc_cpu``, which later
    builders read: MiniMax-M3's indexer then finds a query length of 0.

Upstream:
    vllm-project/vllm PR #51585, in 0.29.0: only the device offsets are zeroed.

Affected:
    0.27.0, 0.27.1, 0.28.0 and the ROCm nightlies built from them.

Detected:
    By reading, never running (:mod:`..shape`): a class is left alone only if
    the capture it resolves has upstream's fixed shape. Anything else gets the
    fix; one that is in doubt, rather than plainly touching a host field, with
    a WARNING.

How:
    The class gets its own capture, which runs the one it resolved before on a
    shallow copy of the metadata whose host fields (tensors, arrays) are
    copies: device writes still reach the runner's buffers (the #25985 guard,
    as in 0.29.0); host writes reach nothing another builder reads, and the
    runner's pinned host buffers are never written. ``build()`` is untouched.

Delete when:
    The oldest vLLM this project supports is 0.29.0 or newer.
"""

from __future__ import annotations

import copy
import logging
import sys
from types import ModuleType
from typing import Any

from vllm_capture_guard.runtime import patches as base
from vllm_capture_guard.runtime.shape import fixed_shape, is_host_field

MODULE = "vllm.v1.attention.backends.rocm_attn"
AITER = "vllm.v1.attention.backends.rocm_aiter_unified_attn"
CLASS, METHOD = "RocmAttentionMetadataBuilder", "build_for_cudagraph_capture"
BACKENDS = (
    (MODULE, "RocmAttentionBackend"),
    (AITER, "RocmAiterUnifiedAttentionBackend"),
)
_log = logging.getLogger("vllm.capture_guard")


def _own_copy(metadata: Any) -> Any:
    """A shallow copy of ``metadata`` whose host fields (by name) and mutable
    containers (dicts, lists) are copies too."""
    if hasattr(metadata, "__dict__"):  # the dataclass vLLM uses: a fast copy
        own = object.__new__(type(metadata))
        own.__dict__.update(metadata.__dict__)
        items = list(own.__dict__.items())
    else:
        own = copy.copy(metadata)
        items = [(n, getattr(own, n, None)) for n in own.__dataclass_fields__]
    for name, value in items:
        if value is None or isinstance(value, (bool, int, float, str)):
            continue
        if isinstance(value, (dict, list)):
            setattr(own, name, copy.deepcopy(value))
        elif is_host_field(name) and hasattr(value, "clone"):  # a tensor
            setattr(own, name, value.clone())
        elif is_host_field(name) and hasattr(value, "copy"):  # an array
            setattr(own, name, value.copy())
    return own


def _isolated(capture: Any) -> Any:
    def build_for_cudagraph_capture(self, common_attn_metadata, *args, **kwargs):
        try:
            own = _own_copy(common_attn_metadata)
        except Exception as e:  # never stop vLLM: keep the values instead
            _log.warning(f"vllm-capture-guard: no own copy ({e!r}); restoring")
            try:
                saved = [(t, t.clone()) for t in _host_tensors(common_attn_metadata)]
            except Exception:
                saved = []
            try:
                return capture(self, common_attn_metadata, *args, **kwargs)
            finally:
                for tensor, values in saved:
                    tensor.copy_(values)
        return capture(self, own, *args, **kwargs)

    return build_for_cudagraph_capture


def _host_tensors(metadata: Any) -> list[Any]:
    fields = getattr(metadata, "__dataclass_fields__", None)
    fields = fields or getattr(metadata, "__slots__", None) or vars(metadata)
    values = [getattr(metadata, n, None) for n in fields if is_host_field(n)]
    return [v for v in values if hasattr(v, "clone") and hasattr(v, "copy_")]


def family() -> list[type]:
    """The ROCm builder, the builders the ROCm backends return, and every class
    derived from them, as imported now."""
    roots = [getattr(sys.modules.get(MODULE), CLASS, None)]
    for module, name in BACKENDS:
        backend = getattr(sys.modules.get(module), name, None)
        roots.append(backend.get_builder_cls() if backend is not None else None)
    found: list[type] = []
    for root in roots:
        if isinstance(root, type):
            found += [c for c in base.subclasses(root) if c not in found]
    return found


class RocmAttnCpuOffsets(base.Patch):
    name, pr = "rocm-attn-cpu-offsets", "#51585"
    modules = (MODULE, AITER)
    backends = ("ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN")
    targets = ((MODULE, CLASS), BACKENDS[0])

    def plan(self, module: ModuleType) -> base.Outcome:
        classes = family()
        if not classes:
            raise LookupError(f"{MODULE} has no {CLASS} and no backend builder")
        wrap, doubts, kept = [], [], []
        for cls in classes:
            capture = getattr(cls, METHOD, None)
            why = None if capture is None else fixed_shape(capture)
            if capture is not None and base.is_guarded(capture):
                kept.append(cls.__name__)
            elif why is not None:
                wrap.append(cls)
                if not why.startswith("it touches"):
                    doubts.append(f"{cls.__qualname__} ({why})")
        if not wrap:
            status = base.Status.ALREADY if kept else base.Status.NOT_NEEDED
            return base.Outcome(self.name, status, f"{CLASS} capture keeps host fields")
        warning = doubts and (
            f"could not show by reading that the capture of {'; '.join(doubts)} "
            f"leaves the host metadata alone, so it now runs on its own copy of "
            f"the host fields as in vLLM 0.29.0 (backport of PR {self.pr})"
        )
        names = ", ".join(c.__name__ for c in wrap)
        detail = f"{names} capture may write host fields"
        return base.Outcome(
            self.name, base.Status.NEEDED, detail, warning or None, wrap
        )

    def install(self, plan: base.Outcome) -> str:
        done = []
        for cls in plan.data:  # base classes first: a subclass that only
            if not base.is_guarded(getattr(cls, METHOD)):  # inherits needs none
                base.wrap_method(cls, METHOD, _isolated)
                done.append(cls.__name__)
        fields = "runs on its own copy of the host fields"
        return f"{', '.join(done)}.{METHOD} {fields} (backport of PR {self.pr})"

    def uninstall(self) -> bool:
        return any([base.unwrap_method(c, METHOD) for c in reversed(family())])
