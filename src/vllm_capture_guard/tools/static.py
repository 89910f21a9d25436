# SPDX-License-Identifier: Apache-2.0
"""What the installed code needs, by reading it: the tools' view (``status``,
the version matrix), never the runtime's (the runtime guards every call).

* :func:`host_writers`: the ROCm backends' builders whose capture touches a
  host field (``runtime.shape``'s reader, which the AITER backport uses too);
* :func:`stream_sites`: each capture site of PR #53818 and whether every
  ``torch.cuda.graph(...)`` call in it passes a stream that is not ``None``.

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
from vllm_capture_guard.runtime.patches import original_of
from vllm_capture_guard.runtime.shape import fixed_shape

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
    needed: bool | None  # None: could not be read
    why: str


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except Exception as e:  # 0.33's AITER module asks the GPU at import
        return f"cannot import {module} ({type(e).__name__})"


def host_writers() -> list[Reading]:
    """Per ROCm backend: does its builder's capture touch a host field?"""
    found = []
    for module, name, label in ROCM:
        mod = _import(module)
        if isinstance(mod, str):
            found.append(Reading(label, None, mod))
            continue
        builder = getattr(mod, name).get_builder_cls()
        why = fixed_shape(original_of(getattr(builder, METHOD)))
        touches = why is not None and why.startswith("it touches")
        text = f"{builder.__name__}'s capture: {why or 'keeps the host fields'}"
        needed = True if touches else (False if why is None else None)
        found.append(Reading(label, needed, text))
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
    """Per capture site of PR #53818 (all three, in vLLM's order)."""
    found = []
    for module, cls_name, name in stream.SITES:
        where = f"{cls_name}.{name}"
        mod = _import(module)
        cls = None if isinstance(mod, str) else getattr(mod, cls_name, None)
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
            found.append(Reading(where, False, "passes a stream"))
        else:
            found.append(Reading(where, True, "passes no stream"))
    return found
