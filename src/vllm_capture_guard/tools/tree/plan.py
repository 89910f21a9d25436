# SPDX-License-Identifier: Apache-2.0
"""Every fix over one tree: what each file needs, and the bytes it would get.

:func:`inspect_bytes` is pure (file contents in, findings out), so the same
code judges the tree, checks our own result before anything is written (the
patched bytes must compile and be recognised as carrying the fix, which also
makes a second ``--apply`` a no-op), and checks, before ``--revert``, that a
file is still exactly what ``--apply`` made of its saved original.
"""

from __future__ import annotations

import dataclasses

from vllm_capture_guard.tools import fixes
from vllm_capture_guard.tools.tree import model
from vllm_capture_guard.tools.tree.locate import Tree
from vllm_capture_guard.tools.tree.source import Source, Unrecognised

#: The fixes with an in-tree form, in the runtime's order (each may read what
#: the ones before it found), and the files inside the vllm package they edit.
TREE_FIXES = tuple(m for m in fixes.modules() if m.TREE_FILES)
FILES = tuple(inside for fix in TREE_FIXES for inside in fix.TREE_FILES)


@dataclasses.dataclass(frozen=True)
class Sourceless:
    """A target module that the tree holds only as bytecode: Python may run it
    (a ``<name>.pyc`` beside the missing source), but its code can be neither
    read nor patched, so it is refused, never taken as absent."""

    found: tuple[str, ...]  # the bytecode files, relative to the tree's root

    def detail(self, rel: str) -> str:
        return (
            f"{rel} is missing but its bytecode is present ({', '.join(self.found)}):"
            f" a module shipped as bytecode only cannot be read or patched; ship "
            f"its source, or remove the bytecode if the module is really gone"
        )


Data = dict[str, "bytes | Sourceless | None"]


def sourceless(tree: Tree, inside: str) -> Sourceless | None:
    """The bytecode of ``inside`` when its source is missing: a sourceless
    ``<name>.pyc`` beside it, or ``__pycache__/<name>.*.pyc``."""
    path = tree.path(inside)
    stem = path.name.removesuffix(".py")
    found = [path.with_name(stem + ".pyc")]
    cache = path.parent / "__pycache__"
    if cache.is_dir():
        found += sorted(cache.glob(f"{stem}.*.pyc"))
    rels = tuple(p.relative_to(tree.root).as_posix() for p in found if p.exists())
    return Sourceless(rels) if rels else None


def read_tree(tree: Tree) -> Data:
    """The target files' bytes: None where a file does not exist at all,
    :class:`Sourceless` where only its bytecode does."""
    out: Data = {}
    for inside in FILES:
        path = tree.path(inside)
        out[inside] = path.read_bytes() if path.is_file() else sourceless(tree, inside)
    return out


def inspect_bytes(tree: Tree, data: Data) -> list[model.Finding]:
    sources: dict[str, Source | None] = {}
    broken: dict[str, str] = {}
    for inside, raw in data.items():
        if raw is None:
            sources[inside] = None
            continue
        if isinstance(raw, Sourceless):
            broken[inside] = raw.detail(tree.rel(inside))
            continue
        try:
            sources[inside] = Source.parse(tree.path(inside), tree.rel(inside), raw)
        except Unrecognised as e:
            broken[inside] = str(e)
    found: list[model.Finding] = []
    context: dict = {}  # what one fix's findings leave for the next
    for fix in TREE_FIXES:
        found += fix.tree_findings(sources, broken, tree, context)
    return found


def _inside(tree: Tree, finding: model.Finding) -> str:
    return next(f for f in FILES if tree.rel(f) == finding.rel)


def patched_bytes(
    tree: Tree, data: Data, findings: list[model.Finding]
) -> dict[str, bytes]:
    """The new bytes of every file that a finding says needs the fix."""
    out: dict[str, bytes] = {}
    for f in findings:
        if f.state != model.NEEDED:
            continue
        inside = _inside(tree, f)
        raw = data[inside]
        assert isinstance(raw, bytes)
        src = Source.parse(tree.path(inside), f.rel, raw)
        out[inside] = src.edited(f.edits)
    return out


@dataclasses.dataclass
class Plan:
    tree: Tree
    data: Data
    findings: list[model.Finding]
    new: dict[str, bytes]  # inside -> patched bytes, for files that need the fix

    @property
    def refused(self) -> list[model.Finding]:
        return [f for f in self.findings if f.state == model.UNRECOGNISED]

    @property
    def needed(self) -> list[model.Finding]:
        return [f for f in self.findings if f.state == model.NEEDED]

    @property
    def check_code(self) -> int:
        """``--check``: 2 refused, 1 needs the fix, 0 nothing to do."""
        return 2 if self.refused else 1 if self.needed else 0


class SelfCheckFailed(Exception):
    """Our own result did not pass our own checks (a bug of this tool)."""


def self_check(tree: Tree, data: Data, new: dict[str, bytes]):
    for inside, raw in new.items():
        try:
            compile(raw, tree.rel(inside), "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as e:
            raise SelfCheckFailed(f"{tree.rel(inside)} would not compile: {e}") from e
    after = inspect_bytes(tree, {**data, **new})
    for f in after:
        if f.state in (model.NEEDED, model.UNRECOGNISED):
            raise SelfCheckFailed(f"after the edit: {f}")


def make_plan(tree: Tree, data: Data | None = None) -> Plan:
    """Inspect ``tree`` (or ``data`` standing for its files). A plan that
    refuses nothing holds checked bytes for every file that needs the fix."""
    data = read_tree(tree) if data is None else data
    findings = inspect_bytes(tree, data)
    plan = Plan(tree, data, findings, {})
    if plan.refused or not plan.needed:
        return plan
    new = patched_bytes(tree, data, findings)
    try:
        self_check(tree, data, new)
    except SelfCheckFailed as e:
        plan.findings = [
            dataclasses.replace(
                f, state=model.UNRECOGNISED, detail=f"internal check failed: {e}"
            )
            if f.state == model.NEEDED
            else f
            for f in findings
        ]
        return plan
    plan.new = new
    return plan
