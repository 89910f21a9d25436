# SPDX-License-Identifier: Apache-2.0
"""One vLLM source file, its ``ast`` and whole-line edits of it.

Everything works on bytes: ``ast.parse`` of the bytes gives line numbers and
UTF-8 byte columns, and ``bytes.splitlines`` breaks lines exactly where the
tokenizer does (``\\n``, ``\\r\\n``, ``\\r``). An edit replaces whole lines, so
every byte outside the edited lines stays as it was, and the new lines use the
file's own line ending.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

PROJECT = "vllm-capture-guard"

#: Finds our one-line marker comments; group 1 is the upstream PR number.
MARKER_RE = re.compile(rb"#\s*vllm-capture-guard: backport of vllm PR #(\d+)\b")


def marker(pr: str, note: str = "") -> bytes:
    """The marker comment for upstream PR ``pr`` (``"#51585"``)."""
    text = f"# {PROJECT}: backport of vllm PR {pr}"
    return (text + (f" ({note})" if note else "")).encode()


class Unrecognised(Exception):
    """The file is not one we recognise; the message names what was not found."""


@dataclasses.dataclass(frozen=True)
class Edit:
    """Replace lines ``start`` to ``end`` (0-based, end excluded) by ``lines``
    (without line endings; the file's own ending is added)."""

    start: int
    end: int
    lines: tuple[bytes, ...]


@dataclasses.dataclass
class Source:
    path: Path
    rel: str  # as in the diff, relative to the tree's root
    data: bytes
    lines: list[bytes]
    module: ast.Module

    @classmethod
    def parse(cls, path: Path, rel: str, data: bytes) -> Source:
        try:
            module = ast.parse(data, filename=rel)
        except (SyntaxError, ValueError) as e:
            raise Unrecognised(f"{rel} does not parse as Python ({e})") from e
        return cls(path, rel, data, data.splitlines(keepends=True), module)

    @property
    def newline(self) -> bytes:
        for line in self.lines:
            for end in (b"\r\n", b"\n", b"\r"):
                if line.endswith(end):
                    return end
        return b"\n"

    # --- finding things -----------------------------------------------------

    def top_class(self, name: str) -> ast.ClassDef:
        found = [
            n
            for n in self.module.body
            if isinstance(n, ast.ClassDef) and n.name == name
        ]
        if len(found) != 1:
            what = "no" if not found else f"{len(found)} definitions of"
            raise Unrecognised(f"{self.rel}: {what} class {name} at module level")
        return found[0]

    def method(self, cls: ast.ClassDef, name: str) -> ast.FunctionDef:
        found = [
            n
            for n in cls.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
        ]
        if len(found) != 1 or not isinstance(found[0], ast.FunctionDef):
            what = "no" if not found else "an unexpected"
            raise Unrecognised(
                f"{self.rel}: {what} method {cls.name}.{name} "
                f"(a plain def in the class body)"
            )
        return found[0]

    def markers(self, start: int, end: int) -> list[tuple[int, str]]:
        """``(lineno, "#PR")`` for our marker comments on lines ``start`` to
        ``end`` (1-based, inclusive)."""
        out = []
        for i in range(max(start, 1) - 1, min(end, len(self.lines))):
            m = MARKER_RE.search(self.lines[i])
            if m:
                out.append((i + 1, "#" + m.group(1).decode()))
        return out

    def all_markers(self) -> list[tuple[int, str]]:
        return self.markers(1, len(self.lines))

    def first_line(self, node: ast.stmt) -> int:
        """1-based first line of ``node``, decorators included."""
        decorators = getattr(node, "decorator_list", [])
        return min([node.lineno, *(d.lineno for d in decorators)])

    def indent(self, node: ast.stmt) -> bytes:
        prefix = self.lines[node.lineno - 1][: node.col_offset]
        if prefix.strip():
            raise Unrecognised(
                f"{self.rel}:{node.lineno}: the statement shares its line with "
                f"other code before it"
            )
        return prefix

    def own_lines(self, node: ast.stmt) -> tuple[int, int]:
        """0-based ``(start, end)`` of the whole lines that hold ``node`` and
        nothing else (a trailing comment is allowed)."""
        self.indent(node)
        assert node.end_lineno is not None and node.end_col_offset is not None
        rest = self.lines[node.end_lineno - 1][node.end_col_offset :].strip()
        if rest and not rest.startswith(b"#"):
            raise Unrecognised(
                f"{self.rel}:{node.lineno}: the statement shares its line with "
                f"other code ({rest[:40]!r})"
            )
        return node.lineno - 1, node.end_lineno

    def text(self, node: ast.AST) -> str:
        return ast.unparse(node)[:80]

    # --- editing ------------------------------------------------------------

    def edited(self, edits: Iterable[Edit]) -> bytes:
        out: list[bytes] = []
        at = 0
        for edit in sorted(edits, key=lambda e: e.start):
            if edit.start < at:
                raise ValueError(f"{self.rel}: overlapping edits")
            out += self.lines[at : edit.start]
            if edit.start > 0 and not out[-1].endswith((b"\n", b"\r")):
                out[-1] += self.newline  # the file had no final newline
            out += [line + self.newline for line in edit.lines]
            at = edit.end
        out += self.lines[at:]
        return b"".join(out)


# --- ast helpers ---------------------------------------------------------------


def walk_with_parents(root: ast.AST) -> Iterator[tuple[ast.AST, ast.AST | None]]:
    """Every node under ``root`` with its parent."""
    stack: list[tuple[ast.AST, ast.AST | None]] = [(root, None)]
    while stack:
        node, parent = stack.pop()
        yield node, parent
        stack.extend((child, node) for child in ast.iter_child_nodes(node))


def mentions(root: ast.AST, name: str) -> list[ast.AST]:
    """Attribute accesses ``x.name`` and string constants ``"name"`` (as in
    ``getattr(x, "name")``) under ``root``."""
    return [
        n
        for n in ast.walk(root)
        if (isinstance(n, ast.Attribute) and n.attr == name)
        or (isinstance(n, ast.Constant) and n.value == name)
    ]


def contains(outer: ast.AST, inner: ast.AST) -> bool:
    return any(n is inner for n in ast.walk(outer))


def is_name(node: ast.AST | None, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def is_int(node: ast.AST | None, value: int) -> bool:
    return (
        isinstance(node, ast.Constant)
        and type(node.value) is int
        and node.value == value
    )


def body_without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        return body[1:]
    return body


def binds(module: ast.Module, name: str) -> list[ast.AST]:
    """Every place ``name`` is bound or used anywhere in ``module``."""
    out: list[ast.AST] = []
    for node in ast.walk(module):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            bound = node.name
        elif isinstance(node, ast.Name):
            bound = node.id
        elif isinstance(node, ast.alias):
            bound = node.asname or node.name
        else:
            continue
        if bound == name:
            out.append(node)
    return out
