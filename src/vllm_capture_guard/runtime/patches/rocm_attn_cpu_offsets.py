# SPDX-License-Identifier: Apache-2.0
"""ROCm capture must not change the shared host metadata.

What:
    ``build_for_cudagraph_capture`` of
    ``vllm.v1.attention.backends.rocm_attn.RocmAttentionMetadataBuilder``, of
    every class derived from it, and of the builders that the ROCm and AITER
    unified backends return.

Symptom:
    ``vllm serve`` of MiniMax-M3 with ``--attention-backend ROCM_ATTN`` or
    ``ROCM_AITER_UNIFIED_ATTN`` and full CUDA-graph capture dies at startup::

        File "vllm/models/minimax_m3/common/indexer.py", line 317, in build
            assert decode_query_len > 0
        EngineCore failed to start.

Cause:
    The runner hands one ``CommonAttentionMetadata`` (views of its persistent
    buffers, shallow-copied per KV-cache group) to every builder in turn. This
    capture zeroes the device ``query_start_loc`` (a guard against an illegal
    memory access in the prefix-prefill kernel, vLLM issue #25985) and also the
    host ``query_start_loc_cpu``, which no ROCm kernel reads but every later
    builder does: the MiniMax-M3 indexer then computes a query length of 0.

Upstream:
    vllm-project/vllm PR #51585, in 0.29.0: only the device offsets are zeroed.

Affected:
    0.27.0, 0.27.1, 0.28.0 and the ROCm nightlies built from them.

Detected:
    By reading, never running: a class is left alone only if the capture it
    resolves has upstream's fixed shape (:func:`..shape.fixed_shape`: the
    metadata goes only to ``self.build`` or to a device field, no host field
    is touched). Anything else, readable or not, gets the guard; a capture that
    is in doubt rather than plainly writing a host field gets a WARNING too.

How:
    The class gets its own ``build_for_cudagraph_capture``, which runs the one
    it resolved before on a shallow copy of the metadata whose host fields
    (tensors, arrays) are copies: the capture's device writes reach the
    runner's buffers (the #25985 guard kept, as in 0.29.0), its host writes
    reach nothing that another builder reads, and the runner's pinned host
    buffers are never written (no window, no race with a pending copy to the
    device). ``build()``, the serving path, is not touched.

Delete when:
    The oldest vLLM this project supports is 0.29.0 or newer.
"""

from __future__ import annotations

import copy
import sys
from types import ModuleType
from typing import Any

from vllm_capture_guard.runtime.patches import (
    Patch,
    Plan,
    Status,
    is_guarded,
    subclasses,
    unwrap_method,
    wrap_method,
)
from vllm_capture_guard.runtime.shape import fixed_shape, is_host_field

MODULE = "vllm.v1.attention.backends.rocm_attn"
AITER_MODULE = "vllm.v1.attention.backends.rocm_aiter_unified_attn"
CLASS = "RocmAttentionMetadataBuilder"
BACKENDS = (
    (MODULE, "RocmAttentionBackend"),
    (AITER_MODULE, "RocmAiterUnifiedAttentionBackend"),
)
METHOD = "build_for_cudagraph_capture"
#: Host field names per metadata class, found once.
_HOST: dict[type, tuple[str, ...]] = {}


def _own_copy(metadata: Any) -> Any:
    """A shallow copy of ``metadata`` whose host fields are copies too."""
    cls = type(metadata)
    names = _HOST.get(cls)
    if names is None:
        fields = getattr(cls, "__dataclass_fields__", None) or vars(metadata)
        names = _HOST[cls] = tuple(n for n in fields if is_host_field(n))
    own = copy.copy(metadata)
    for name in names:
        value = getattr(own, name, None)
        if hasattr(value, "clone"):  # a tensor
            setattr(own, name, value.clone())
        elif hasattr(value, "copy"):  # an array, a list, a dict
            setattr(own, name, value.copy())
    return own


def _isolated(capture: Any) -> Any:
    def build_for_cudagraph_capture(self, common_attn_metadata, *args, **kwargs):
        own = _own_copy(common_attn_metadata)
        return capture(self, own, *args, **kwargs)

    return build_for_cudagraph_capture


def family() -> list[type]:
    """The ROCm builder, the builders the ROCm backends return, and every
    class derived from them, as imported now."""
    roots = [getattr(sys.modules.get(MODULE), CLASS, None)]
    for module, backend in BACKENDS:
        get = getattr(
            getattr(sys.modules.get(module), backend, None), "get_builder_cls", None
        )
        roots.append(get() if callable(get) else None)
    found: list[type] = []
    for root in roots:
        if isinstance(root, type):
            found += [c for c in subclasses(root) if c not in found]
    return found


class RocmAttnCpuOffsets(Patch):
    name = "rocm-attn-cpu-offsets"
    pr = "#51585"
    modules = (MODULE, AITER_MODULE)
    backends = ("ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN")
    targets = ((MODULE, CLASS), BACKENDS[0])

    def plan(self, module: ModuleType) -> Plan:
        classes = family()
        if not classes:
            raise LookupError(f"{MODULE} has no {CLASS} and no backend builder")
        wrap, doubts, kept = [], [], []
        for cls in classes:
            capture = getattr(cls, METHOD, None)
            if capture is None or is_guarded(capture):
                kept += [cls.__name__] if capture is not None else []
                continue
            why = fixed_shape(capture)
            if why is None:
                continue
            wrap.append(cls)
            if not why.startswith("it touches"):  # not a plain host write
                doubts.append(f"{cls.__qualname__} ({why})")
        if wrap:
            names = ", ".join(c.__name__ for c in wrap)
            warning = None
            if doubts:
                warning = (
                    f"could not show by reading that the capture of "
                    f"{'; '.join(doubts)} leaves the host metadata alone, so it "
                    f"now runs on its own copy of the host fields as in vLLM "
                    f"0.29.0 (backport of PR {self.pr})"
                )
            return Plan(
                Status.NEEDED, f"{names} capture may write host fields", warning, wrap
            )
        if kept:
            return Plan(Status.ALREADY, f"{', '.join(kept)} capture on own host copies")
        return Plan(Status.NOT_NEEDED, f"{CLASS} capture leaves host fields alone")

    def install(self, plan: Plan) -> str:
        done = []
        for cls in plan.data:  # base classes first: a subclass that only
            if not is_guarded(getattr(cls, METHOD)):  # inherits needs nothing
                wrap_method(cls, METHOD, _isolated)
                done.append(cls.__name__)
        return (
            f"{', '.join(done)}.{METHOD} runs on its own copy of the host "
            f"fields (backport of PR {self.pr})"
        )

    def uninstall(self) -> bool:
        undone = False
        for cls in reversed(family()):
            undone |= unwrap_method(cls, METHOD)
        return undone
