# SPDX-License-Identifier: Apache-2.0
"""Read a capture's source, never run it: does it have upstream's fixed shape?

The tools' reader (``status``, the version matrix): the runtime guards every
capture whatever this says. It says "fixed" only when :func:`fixed_shape`
finds nothing wrong with the capture; everything that cannot be shown by
reading is "in doubt":

* the function must be a plain, undecorated ``def`` whose source can be read
  and whose names match the code that runs (a file changed after import does
  not), taking ``(self, metadata)`` and nothing more;
* the shared metadata may only be handed to ``self.build(...)`` or, where the
  patch allows it, have a *device* field read or written in place
  (``metadata.query_start_loc.zero_()``, the #25985 guard): a field that the
  metadata class its annotation names declares as a plain tensor, not host;
* no host field is touched anywhere (:func:`is_host_field`), whatever the
  object, conditionally or not; no nested function, lambda or class; none of
  ``eval``, ``exec``, ``locals``, ``vars``, ``globals``, ``setattr``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from collections.abc import Callable

try:
    from vllm_capture_guard.runtime.guard.metadata import HOST_NAMES, is_host_field
except ImportError:  # an older runtime (the GPU start-up comparison's baseline)
    from vllm_capture_guard.runtime.guard import HOST_NAMES, is_host_field

__all__ = ["HOST_NAMES", "fixed_shape", "is_host_field"]

_FORBIDDEN = frozenset({"eval", "exec", "locals", "vars", "globals", "setattr"})


def fixed_shape(
    fn: object,
    device_fields: bool = True,
    forbidden: Callable[[str], bool] = is_host_field,
) -> str | None:
    """None when ``fn`` has the fixed shape, else why it is in doubt.

    ``device_fields``: may the metadata's device fields be used directly?
    ``forbidden``: attribute names that must not appear at all."""
    if not isinstance(fn, types.FunctionType):
        return f"{type(fn).__name__} is not a plain function"
    if hasattr(fn, "__wrapped__"):  # getsource would read the wrapped one
        return "it is decorated or not a def"
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError) as e:
        return f"its source cannot be read ({type(e).__name__})"
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef) or node.decorator_list:
        return "it is decorated or not a def"
    a, code = node.args, fn.__code__
    if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or len(a.args) != 2:
        return "its signature is not (self, metadata)"
    meta = a.args[1].arg
    if a.args[0].arg != "self" or code.co_varnames[:2] != ("self", meta):
        return "its signature is not (self, metadata)"
    devices = _device_fields(fn, meta) if device_fields else frozenset()
    builds: set[int] = set()  # ids of Name nodes handed to self.build(...)
    fields: set[int] = set()  # ids of Name nodes used as metadata.<device field>
    names: set[str] = set()
    for sub in ast.walk(node):
        if sub is not node and isinstance(
            sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
        ):
            return "it defines a nested function or class"
        if isinstance(sub, ast.Call) and _is_self_build(sub.func):
            args = [*sub.args, *(k.value for k in sub.keywords)]
            builds.update(id(x) for x in args if _is_name(x, meta))
        if isinstance(sub, ast.Attribute):
            names.add(sub.attr)
            if forbidden(sub.attr):
                return f"it touches {sub.attr}"
            if sub.attr.startswith("__"):
                return f"it uses {sub.attr}"
            load = isinstance(sub.ctx, ast.Load)
            if load and sub.attr in devices and _is_name(sub.value, meta):
                fields.add(id(sub.value))
        if isinstance(sub, ast.Name):
            if sub.id in _FORBIDDEN:
                return f"it calls {sub.id}"
            if sub.id == "self" and not isinstance(sub.ctx, ast.Load):
                return "it rebinds self"
            if sub.id != meta and sub.id not in fn.__code__.co_varnames:
                names.add(sub.id)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and not _is_self_build(sub.func):
            f = sub.func  # metadata.<field>(...) is a method call: not a field
            if isinstance(f, ast.Attribute) and _is_name(f.value, meta):
                return f"it calls metadata.{f.attr}()"
        if _is_name(sub, meta) and id(sub) not in builds | fields:
            return (
                f"the metadata goes somewhere other than self.build (line {sub.lineno})"
            )
    if not set(fn.__code__.co_names) <= names:
        return "its source does not match the code that runs"
    return None


def _device_fields(fn: types.FunctionType, meta: str) -> frozenset[str]:
    """The metadata's tensor fields that are not host fields, from the class
    the capture's annotation names (none if it cannot be found)."""
    cls = fn.__annotations__.get(meta)
    cls = fn.__globals__.get(cls) if isinstance(cls, str) else cls
    fields = getattr(cls, "__dataclass_fields__", {}).values()
    return frozenset(
        f.name
        for f in fields
        if "Tensor" in str(f.type)
        and "|" not in str(f.type)
        and not is_host_field(f.name)
    )


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _is_self_build(func: ast.AST) -> bool:
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "build"
        and _is_name(func.value, "self")
    )
