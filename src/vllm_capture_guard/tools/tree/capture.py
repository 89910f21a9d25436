# SPDX-License-Identifier: Apache-2.0
"""Reading a metadata builder's capture in a file, for the fixes of both ROCm
builders (:mod:`..fixes.builder_capture_guard`,
:mod:`..fixes.rocm_aiter_unified_builder`): its metadata parameter, what it
does with it, and the host fields it names."""

from __future__ import annotations

import ast

from vllm_capture_guard.tools.tree.source import (
    Source,
    Unrecognised,
    is_int,
    is_name,
    walk_with_parents,
)

try:
    from vllm_capture_guard.runtime.guard.metadata import is_host_field
except ImportError:  # an older runtime (the GPU start-up comparison's baseline)
    from vllm_capture_guard.runtime.guard import is_host_field


def zeroes(stmt: ast.stmt, param: str, field: str) -> bool:
    """``<param>.<field>.zero_()`` or ``<param>.<field>.fill_(0)``."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return False
    call = stmt.value
    func = call.func
    if not isinstance(func, ast.Attribute) or call.keywords:
        return False
    if func.attr == "zero_":
        ok_args = not call.args
    elif func.attr == "fill_":
        ok_args = len(call.args) == 1 and is_int(call.args[0], 0)
    else:
        return False
    target = func.value
    return (
        ok_args
        and isinstance(target, ast.Attribute)
        and target.attr == field
        and is_name(target.value, param)
    )


def _is_self_build(node: ast.AST | None) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "build"
        and is_name(node.func.value, "self")
    )


def check_param_use(src: Source, fn: ast.FunctionDef, param: str) -> None:
    """The metadata parameter may be read from and handed to ``self.build``
    only (see the module docstring)."""
    for node, parent in walk_with_parents(fn):
        if not is_name(node, param):
            continue
        assert isinstance(node, ast.Name)
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            raise Unrecognised(
                f"{src.rel}:{node.lineno}: {fn.name} rebinds its parameter {param}"
            )
        if isinstance(parent, ast.Attribute):
            continue
        if _is_self_build(parent):
            continue
        raise Unrecognised(
            f"{src.rel}:{node.lineno}: {fn.name} hands {param} to "
            f"`{src.text(parent or node)}`; cannot tell whether that writes the "
            f"offsets"
        )


def host_fields_named(fn: ast.FunctionDef) -> list[ast.Attribute]:
    """Each ``<anything>.<host field>`` in ``fn`` (the runtime's rule of what a
    host field is, :func:`is_host_field`)."""
    return [
        node
        for node in ast.walk(fn)
        if isinstance(node, ast.Attribute) and is_host_field(node.attr)
    ]


def capture_params(src: Source, fn: ast.FunctionDef) -> str:
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    if len(positional) < 2 or positional[0].arg != "self":
        raise Unrecognised(
            f"{src.rel}:{fn.lineno}: {fn.name} does not take (self, metadata)"
        )
    return positional[1].arg
