# SPDX-License-Identifier: Apache-2.0
"""What the installed code needs, by reading it: the tools' view (``status``,
the version matrix), never the runtime's (the runtime guards every call).

* :func:`host_writers`: the ROCm backends' builders whose capture touches a
  host field (the reader in :mod:`.shape`);
* :func:`offset_writers`: the AITER unified backend's builder, whose capture
  must leave ``query_start_loc`` alone (PR #53821);
* :func:`stream_sites`: each capture site of PR #53818 and whether every
  ``torch.cuda.graph(...)`` call in it passes a stream that is not ``None``.

Read before the plugin patches this process (``status`` does): a patched
backend returns the backport's builder, which reads as fixed.

Reading can say "needs the fix"; where it says "fixed", the runtime still
guards (a write through an alias, a capture bound per instance, a stream that
is ``None`` at run time all read as fixed).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
from typing import Any

from vllm_capture_guard.runtime.patches import graph_capture_stream as stream
from vllm_capture_guard.runtime.patches import rocm_aiter_unified_builder as aiter
from vllm_capture_guard.runtime.patching import original_of
from vllm_capture_guard.tools.failure import one_line
from vllm_capture_guard.tools.shape import fixed_shape, is_host_field
from vllm_capture_guard.tools.support import module_exists

ROCM = (
    ("vllm.v1.attention.backends.rocm_attn", "RocmAttentionBackend", "ROCM_ATTN"),
    (
        "vllm.v1.attention.backends.rocm_aiter_unified_attn",
        "RocmAiterUnifiedAttentionBackend",
        "ROCM_AITER_UNIFIED_ATTN",
    ),
)
METHOD = "build_for_cudagraph_capture"


@dataclasses.dataclass(frozen=True)
class Reading:
    where: str
    needed: bool | None  # None: could not be read, or not importable here
    why: str
    #: False: the module does not import on this host (a dependency of vLLM
    #: missing here), so nothing was read
    importable: bool = True


def _import(module: str) -> Any:
    """The module, imported as ``check`` and the audit import it on a host
    without a GPU (0.33's AITER module asks the GPU's architecture at import:
    an MI300X's is answered, :func:`.simulate.rocm_platform_answered`); or
    why it does not import here."""
    from vllm_capture_guard.tools.simulate import rocm_platform_answered

    try:
        with rocm_platform_answered():
            return importlib.import_module(module)
    except Exception as e:  # a dependency of vLLM that is missing here
        return f"cannot import {module} ({one_line(e)[:160]})"


def host_writers() -> list[Reading]:
    """Per ROCm backend: does its builder's capture touch a host field?"""
    found = []
    for module, name, label in ROCM:
        mod = _import(module)
        if isinstance(mod, str):
            found.append(Reading(label, None, mod, importable=False))
            continue
        backend = getattr(mod, name, None)
        if not isinstance(backend, type):
            found.append(Reading(label, None, f"{module} has no {name}"))
            continue
        builder = backend.get_builder_cls()
        why = fixed_shape(original_of(getattr(builder, METHOD)))
        found.append(_reading(label, builder, why, "the host fields"))
    return found


def _reading(label: str, builder: type, why: str | None, kept: str) -> Reading:
    """A builder's capture as read: a field it touches (needed), nothing
    wrong (not needed), or in doubt (None)."""
    name = builder.__name__
    if why is None:
        return Reading(label, False, f"{name}'s capture leaves {kept} alone")
    if why.startswith("it touches "):
        field = why.removeprefix("it touches ")
        return Reading(label, True, f"{name}'s capture uses {field}")
    return Reading(label, None, f"cannot tell by reading {name}'s capture ({why})")


def _offsets_or_host(name: str) -> bool:
    return name.startswith("query_start_loc") or is_host_field(name)


def offset_writers() -> list[Reading]:
    """The AITER unified backend (and each derived backend with a builder of
    its own): does its builder's capture touch ``query_start_loc``?"""
    mod = _import(aiter.MODULE)
    if isinstance(mod, str):
        return [Reading(ROCM[1][2], None, mod, importable=False)]
    if not isinstance(getattr(mod, aiter.BACKEND, None), type):
        return [Reading(ROCM[1][2], None, f"{aiter.MODULE} has no {aiter.BACKEND}")]
    found = []
    for backend in aiter.backends():
        builder = backend.get_builder_cls()
        why = fixed_shape(
            original_of(getattr(builder, METHOD, None)),
            device_fields=False,
            forbidden=_offsets_or_host,
        )
        label = ROCM[1][2] if backend.__name__ == aiter.BACKEND else backend.__name__
        found.append(_reading(label, builder, why, "query_start_loc"))
    return found


def _given(node: ast.AST | None) -> bool:
    return node is not None and not (
        isinstance(node, ast.Constant) and node.value is None
    )


def stream_calls(fn: Any) -> list[bool]:
    """Does each ``torch.cuda.graph(...)`` call in ``fn`` pass a stream (not a
    literal ``None``)?"""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.cuda.graph"
    ]
    return [
        _given(c.args[2] if len(c.args) >= 3 else None)
        or any(k.arg == "stream" and _given(k.value) for k in c.keywords)
        for c in calls
    ]


def stream_sites() -> list[Reading]:
    """Per capture site of PR #53818 that this vLLM has, in vLLM's order (a
    site whose module the release no longer has is no site of it)."""
    found = []
    for module, cls_name, name in stream.SITES:
        if not module_exists(module):
            continue
        where = f"{cls_name}.{name}"
        mod = _import(module)
        if isinstance(mod, str):
            found.append(Reading(where, None, mod, importable=False))
            continue
        cls = getattr(mod, cls_name, None)
        fn = original_of(vars(cls).get(name)) if isinstance(cls, type) else None
        if fn is None:
            found.append(Reading(where, None, f"{module} has no {where}"))
            continue
        try:
            calls = stream_calls(fn)
        except (OSError, TypeError, SyntaxError) as e:
            found.append(
                Reading(where, None, f"source unreadable ({type(e).__name__})")
            )
            continue
        if not calls:
            found.append(Reading(where, None, "no torch.cuda.graph(...) call to read"))
        elif all(calls):
            found.append(Reading(where, False, "passes a stream to torch.cuda.graph"))
        else:
            found.append(Reading(where, True, "calls torch.cuda.graph with no stream"))
    return found
