# SPDX-License-Identifier: Apache-2.0
"""Vendor-modified copies of vLLM's ROCm attention files, made at test time.

ROCm nightly images ship modified copies of vLLM. The guard must hold on them
too, so the tests derive such copies from the *installed* vLLM (never from
source kept in this repository) and run them in a fresh interpreter:

* :func:`installed_vllm_dir` finds the installed package without importing
  anything below ``vllm`` (``find_spec(...).submodule_search_locations``), so it
  follows ``PYTHONPATH`` (the version matrix puts each release first);
* each transformation below takes the installed files' text and returns the
  changed file(s). It locates what it changes by structure (``ast``: class,
  method, the ``<arg>.query_start_loc[_cpu].zero_()`` statements) and splices
  text at those lines, so the rest of the file keeps its comments. It raises
  :class:`VariantMismatch` (an ``AssertionError``: the test fails loudly) when
  the installed file lacks what it changes, and :class:`VariantNotApplicable`
  (the test skips, with the reason) on releases whose capture does not zero the
  CPU offsets at all (0.29.0 and later, upstream PR #51585): a vendor copy of a
  fixed capture is not affected, so there is nothing to prove there;
* :func:`make_overlay` lays the changed files out as a ``vllm/`` package tree
  whose entries are symlinks to the installed package, except the folders on
  the way to a changed file (real folders, recursively) and the changed file
  itself (a real file). With the overlay first on ``PYTHONPATH``
  (:func:`overlay_env`) a new process (:mod:`tests.warm`) imports the
  modified module in front of the installed one, while
  ``importlib.metadata.version("vllm")`` still reads the installed dist-info
  (:func:`verify_overlay` checks both).

Entry points for other tools (e.g. an in-tree patcher's tests):
``derive(name)`` -> ``{relative path: new text}``, ``VARIANTS`` (name ->
:class:`Variant`), ``make_overlay(files, dest)``, ``overlay_env(dest)``,
``verify_overlay(dest, files)``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]

ROCM_ATTN = "v1/attention/backends/rocm_attn.py"
AITER_UNIFIED = "v1/attention/backends/rocm_aiter_unified_attn.py"
ROCM_MODULE = "vllm.v1.attention.backends.rocm_attn"
AITER_MODULE = "vllm.v1.attention.backends.rocm_aiter_unified_attn"
BUILDER = "RocmAttentionMetadataBuilder"
BACKEND = "RocmAttentionBackend"
AITER_BACKEND = "RocmAiterUnifiedAttentionBackend"
CAPTURE = "build_for_cudagraph_capture"
DEVICE_FIELD = "query_start_loc"
CPU_FIELD = "query_start_loc_cpu"

#: Names the variants introduce (the tests read them back from the check).
MIXIN = "RocmVendorCaptureMixin"
VENDOR_BUILDER = "RocmVendorAttentionMetadataBuilder"
AITER_VENDOR_BUILDER = "RocmAiterUnifiedAttentionMetadataBuilder"
HELPER = "_vendor_reset_query_start_locs"
MARKER = "_VLLM_CAPTURE_GUARD_TEST_VARIANT"


class VariantMismatch(AssertionError):
    """The installed file lacks the structure a transformation changes."""


class VariantNotApplicable(Exception):
    """The variant makes no sense on this release (its capture is fixed)."""


# --- the installed vLLM ------------------------------------------------------


def installed_vllm_dir() -> Path:
    """The folder of the ``vllm`` package this interpreter would import, found
    without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise VariantMismatch("vllm is not installed here")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def read_installed(rel: str, vllm_dir: Path | None = None) -> str:
    path = (vllm_dir or installed_vllm_dir()) / rel
    if not path.is_file():
        raise VariantMismatch(f"vllm/{rel} not found under {path.parent}")
    return path.read_text()


class Installed(dict):
    """``{relative path: text}`` of the installed files, read on first use."""

    def __init__(self, vllm_dir: Path | None = None) -> None:
        super().__init__()
        self.vllm_dir = vllm_dir or installed_vllm_dir()

    def __missing__(self, rel: str) -> str:
        text = self[rel] = read_installed(rel, self.vllm_dir)
        return text


# --- structure ---------------------------------------------------------------


def find_class(tree: ast.Module, name: str, rel: str = ROCM_ATTN) -> ast.ClassDef:
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    if len(found) != 1:
        raise VariantMismatch(f"vllm/{rel}: {len(found)} classes named {name}")
    return found[0]


def find_method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    found = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(found) != 1:
        raise VariantMismatch(f"{cls.name} has no method {name} of its own")
    return found[0]


def span(node: ast.AST) -> tuple[int, int]:
    """0-based ``[start, end)`` line range of ``node``, decorators included."""
    decorators = getattr(node, "decorator_list", [])
    start = min([node.lineno] + [d.lineno for d in decorators]) - 1
    return start, node.end_lineno


def zeroing_statements(fn: ast.FunctionDef) -> dict[str, ast.Expr]:
    """``{field: statement}`` for each ``<metadata arg>.<field>.zero_()``
    statement of ``fn``, for the two query offset fields."""
    arg = fn.args.args[1].arg  # (self, common_attn_metadata)
    return zeroing_in(fn.body, arg)


def zeroing_in(body: list[ast.stmt], arg: str) -> dict[str, ast.Expr]:
    """``{field: statement}`` for each ``<arg>.<field>.zero_()`` in ``body``."""
    found: dict[str, ast.Expr] = {}
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
            continue
        call = node.value.func
        if not (isinstance(call, ast.Attribute) and call.attr == "zero_"):
            continue
        target = call.value
        if (
            isinstance(target, ast.Attribute)
            and target.attr in (DEVICE_FIELD, CPU_FIELD)
            and isinstance(target.value, ast.Name)
            and target.value.id == arg
        ):
            if target.attr in found:
                raise VariantMismatch(f"{target.attr} is zeroed twice")
            found[target.attr] = node
    return found


def rocm_capture(text: str) -> tuple[ast.Module, ast.FunctionDef, dict]:
    """The ROCm builder's capture and its two zeroing statements; raises
    :class:`VariantNotApplicable` on a release that zeroes only the device
    offsets (the upstream fix), :class:`VariantMismatch` on anything else."""
    tree = ast.parse(text)
    fn = find_method(find_class(tree, BUILDER), CAPTURE)
    zeroing = zeroing_statements(fn)
    if DEVICE_FIELD not in zeroing:
        raise VariantMismatch(
            f"{BUILDER}.{CAPTURE} has no `{fn.args.args[1].arg}.{DEVICE_FIELD}"
            ".zero_()`: the installed file is not shaped as the variants expect"
        )
    if CPU_FIELD not in zeroing:
        raise VariantNotApplicable(
            f"this vLLM's {BUILDER}.{CAPTURE} zeroes {DEVICE_FIELD} but not "
            f"{CPU_FIELD} (the upstream fix, PR #51585, vLLM 0.29.0+): a vendor "
            "copy of this capture is not affected"
        )
    return tree, fn, zeroing


class Editor:
    """Line edits on a text, applied bottom-up so that earlier line numbers
    stay valid; overlapping edits are refused."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines(keepends=True)
        self.edits: list[tuple[int, int, str]] = []

    def replace(self, start: int, end: int, new: str) -> None:
        self.edits.append((start, end, new))

    def insert(self, at: int, new: str) -> None:
        self.edits.append((at, at, new))

    def text(self) -> str:
        lines = list(self.lines)
        last = None
        for start, end, new in sorted(self.edits, key=lambda e: (e[0], e[1]))[::-1]:
            if last is not None and end > last:
                raise VariantMismatch(f"overlapping edits at line {start + 1}")
            lines[start:end] = [new]
            last = start
        return "".join(lines)

    def segment(self, node: ast.AST) -> str:
        start, end = span(node)
        return "".join(self.lines[start:end])


def indent_of(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _marked(text: str, name: str) -> str:
    """Every derived file says which variant it is; checked by
    :func:`verify_overlay` and compiled here, so a bad splice fails now."""
    out = text.rstrip("\n") + f"\n\n{MARKER} = {name!r}\n"
    compile(out, f"<variant {name}>", "exec")
    return out


def _return_builder(ed: Editor, tree: ast.Module, backend: str, new: str) -> None:
    """Make ``backend.get_builder_cls()`` return ``new`` instead of ``BUILDER``."""
    fn = find_method(find_class(tree, backend), "get_builder_cls")
    returns = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Return)
        and isinstance(n.value, ast.Name)
        and n.value.id == BUILDER
    ]
    if len(returns) != 1:
        raise VariantMismatch(f"{backend}.get_builder_cls does not return {BUILDER}")
    ret = returns[0]
    line = ed.lines[ret.lineno - 1]
    ed.replace(ret.lineno - 1, ret.end_lineno, f"{indent_of(line)}return {new}\n")


# --- the transformations -----------------------------------------------------
# Each takes the installed files and returns {relative path: new text}.


def capture_in_mixin(src: Mapping[str, str]) -> dict[str, str]:
    """The capture moves, unchanged, from the ROCm builder into a mixin that
    the builder lists first among its bases (found through the MRO; the class
    itself no longer has one)."""
    text = src[ROCM_ATTN]
    tree, fn, _ = rocm_capture(text)
    cls = find_class(tree, BUILDER)
    ed = Editor(text)
    method = ed.segment(fn)
    start, end = span(fn)
    ed.replace(start, end, "")
    base = cls.bases[0]
    header = ed.lines[base.lineno - 1]
    ed.replace(
        base.lineno - 1,
        base.lineno,
        header[: base.col_offset] + f"{MIXIN}, " + header[base.col_offset :],
    )
    mixin = f'class {MIXIN}:\n    """Vendor: capture shared by ROCm builders."""\n\n'
    cls_start, _ = span(cls)
    ed.insert(cls_start, mixin + method + "\n\n")
    return {ROCM_ATTN: _marked(ed.text(), "capture-in-mixin")}


def builder_subclass(src: Mapping[str, str]) -> dict[str, str]:
    """``RocmAttentionBackend.get_builder_cls()`` returns a vendor subclass of
    the ROCm builder with its own copy of the zeroing capture; the base class
    keeps its capture (and ROCM_AITER_UNIFIED_ATTN still returns the base)."""
    text = src[ROCM_ATTN]
    tree, fn, _ = rocm_capture(text)
    cls = find_class(tree, BUILDER)
    ed = Editor(text)
    subclass = (
        f"\n\nclass {VENDOR_BUILDER}({BUILDER}):\n"
        '    """Vendor: the ROCm builder with its own capture."""\n\n' + ed.segment(fn)
    )
    _, cls_end = span(cls)
    ed.insert(cls_end, subclass)
    _return_builder(ed, tree, BACKEND, VENDOR_BUILDER)
    return {ROCM_ATTN: _marked(ed.text(), "builder-subclass")}


def probe_needs_init(src: Mapping[str, str]) -> dict[str, str]:
    """``build()`` and the capture read attributes that only ``__init__`` sets
    (``self.num_heads_kv``, ``self.block_size``, ``self.vllm_config``), as a
    vendor build that sizes its own scheduler metadata would."""
    text = src[ROCM_ATTN]
    tree, fn, _ = rocm_capture(text)
    cls = find_class(tree, BUILDER)
    init = find_method(cls, "__init__")
    assigned = {
        t.attr
        for n in ast.walk(init)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute)
    }
    if not {"num_heads_kv", "block_size"} <= assigned:
        raise VariantMismatch(f"{BUILDER}.__init__ no longer sets num_heads_kv")
    build = find_method(cls, "build")
    cm = build.args.args[2].arg  # (self, common_prefix_len, common_attn_metadata)
    ed = Editor(text)
    first = build.body[0]
    pad = indent_of(ed.lines[first.lineno - 1])
    ed.insert(
        first.lineno - 1,
        f"{pad}# vendor: per-KV-head scheduling, sized once per build\n"
        f"{pad}_vendor_kv_heads = self.num_heads_kv\n"
        f"{pad}_vendor_blocks = {cm}.max_seq_len // self.block_size\n",
    )
    first = fn.body[0]
    pad = indent_of(ed.lines[first.lineno - 1])
    ed.insert(
        first.lineno - 1,
        f"{pad}_vendor_max_tokens = (\n"
        f"{pad}    self.vllm_config.scheduler_config.max_num_batched_tokens\n"
        f"{pad})\n",
    )
    return {ROCM_ATTN: _marked(ed.text(), "probe-needs-init")}


def zeroing_only_on_gpu(src: Mapping[str, str]) -> dict[str, str]:
    """The zeroing runs only when the offsets live on the GPU: the device
    offsets under ``if <cm>.query_start_loc.is_cuda:``, the CPU offsets under
    ``if <cm>.query_start_loc.device.type != "cpu":``. On CPU tensors the
    capture writes nothing; on a ROCm GPU (HIP reports ``cuda``) it writes both
    as before."""
    text = src[ROCM_ATTN]
    _, fn, zeroing = rocm_capture(text)
    arg = fn.args.args[1].arg
    tests = {
        DEVICE_FIELD: f"{arg}.{DEVICE_FIELD}.is_cuda",
        CPU_FIELD: f'{arg}.{DEVICE_FIELD}.device.type != "cpu"',
    }
    ed = Editor(text)
    for field, stmt in zeroing.items():
        lines = ed.lines[stmt.lineno - 1 : stmt.end_lineno]
        pad = indent_of(lines[0])
        body = "".join("    " + line for line in lines)
        ed.replace(stmt.lineno - 1, stmt.end_lineno, f"{pad}if {tests[field]}:\n{body}")
    return {ROCM_ATTN: _marked(ed.text(), "zeroing-only-on-gpu")}


def zeroing_through_helper(src: Mapping[str, str]) -> dict[str, str]:
    """The capture calls a module-level helper that zeroes the offsets with
    ``fill_(0)`` (device) and slice assignment (CPU) instead of ``zero_()``."""
    text = src[ROCM_ATTN]
    tree, fn, zeroing = rocm_capture(text)
    arg = fn.args.args[1].arg
    ed = Editor(text)
    first, *rest = sorted(zeroing.values(), key=lambda s: s.lineno)
    pad = indent_of(ed.lines[first.lineno - 1])
    ed.replace(first.lineno - 1, first.end_lineno, f"{pad}{HELPER}({arg})\n")
    for stmt in rest:
        ed.replace(stmt.lineno - 1, stmt.end_lineno, "")
    helper = textwrap.dedent(
        f'''\
        def {HELPER}(metadata) -> None:
            """Vendor: one place that resets the capture offsets."""
            metadata.{DEVICE_FIELD}.fill_(0)
            metadata.{CPU_FIELD}[:] = 0


        '''
    )
    ed.insert(span(find_class(tree, BUILDER))[0], helper)
    return {ROCM_ATTN: _marked(ed.text(), "zeroing-through-helper")}


def aiter_vendor_builder(src: Mapping[str, str]) -> dict[str, str]:
    """``RocmAiterUnifiedAttentionBackend.get_builder_cls()`` returns a vendor
    subclass of the ROCm builder, defined in the AITER module with its own copy
    of the installed ROCm capture (a fork of the class from before PR #53821):
    the ROCm builder's capture is not on its path at all."""
    _, fn, _ = rocm_capture(src[ROCM_ATTN])
    method = Editor(src[ROCM_ATTN]).segment(fn)
    text = src[AITER_UNIFIED]
    tree = ast.parse(text)
    imported = {
        a.asname or a.name
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and n.module == ROCM_MODULE
        for a in n.names
    }
    missing = {BUILDER, "RocmAttentionMetadata"} - imported
    if missing:
        raise VariantMismatch(f"vllm/{AITER_UNIFIED} does not import {missing}")
    backend = find_class(tree, AITER_BACKEND, AITER_UNIFIED)
    ed = Editor(text)
    # the copied capture's annotation names it; the AITER module may not import it
    header = "from vllm.v1.attention.backend import CommonAttentionMetadata\n"
    subclass = (
        header
        + f"\n\nclass {AITER_VENDOR_BUILDER}({BUILDER}):\n"
        + '    """Vendor: AITER unified builder (fork of the ROCm capture)."""\n\n'
        + method
        + "\n\n"
    )
    ed.insert(span(backend)[0], subclass)
    _return_builder(ed, tree, AITER_BACKEND, AITER_VENDOR_BUILDER)
    return {AITER_UNIFIED: _marked(ed.text(), "aiter-vendor-builder")}


# --- variants: named sets of transformations --------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """One overlay: the transformations it applies (each to its own file) and
    the builder class each backend's ``get_builder_cls()`` returns there."""

    name: str
    transforms: tuple[Callable[[Mapping[str, str]], dict[str, str]], ...]
    builders: Mapping[str, str]
    doc: str = ""


_DEFAULT_BUILDERS = {"ROCM_ATTN": BUILDER, "ROCM_AITER_UNIFIED_ATTN": BUILDER}

VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "capture-in-mixin",
            (capture_in_mixin,),
            _DEFAULT_BUILDERS,
            "capture inherited from a mixin (review finding 1)",
        ),
        Variant(
            "builder-subclass",
            (builder_subclass,),
            {"ROCM_ATTN": VENDOR_BUILDER, "ROCM_AITER_UNIFIED_ATTN": BUILDER},
            "ROCM_ATTN returns a subclass with its own capture (finding 2)",
        ),
        Variant(
            "probe-needs-init",
            (probe_needs_init,),
            _DEFAULT_BUILDERS,
            "build()/capture read attributes only __init__ sets (finding 3)",
        ),
        Variant(
            "zeroing-only-on-gpu",
            (zeroing_only_on_gpu,),
            _DEFAULT_BUILDERS,
            "zeroing only when the offsets are on the GPU (finding 4)",
        ),
        # Two changes that do not interfere: ROCM_ATTN runs the helper-zeroing
        # capture, ROCM_AITER_UNIFIED_ATTN its own forked builder (the ROCm
        # capture is not on its path), so one overlay proves both.
        Variant(
            "helper-zeroing+aiter-vendor-builder",
            (zeroing_through_helper, aiter_vendor_builder),
            {"ROCM_ATTN": BUILDER, "ROCM_AITER_UNIFIED_ATTN": AITER_VENDOR_BUILDER},
            "zeroing through a helper with fill_/slice assignment; AITER unified "
            "returns a vendor subclass with its own capture",
        ),
    )
}


def derive(name: str, installed: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{relative path under vllm/: new text}`` for variant ``name``, derived
    from the installed vLLM (or from ``installed``, e.g. another release's
    files read as text)."""
    src = Installed() if installed is None else installed
    out: dict[str, str] = {}
    for transform in VARIANTS[name].transforms:
        for rel, text in transform(src).items():
            if rel in out:
                raise VariantMismatch(f"{name}: two transformations change {rel}")
            out[rel] = text
    return out


def applicability(vllm_dir: Path | None = None) -> tuple[bool, str]:
    """``(True, "")`` where the installed ROCm capture zeroes both offsets
    (0.27.x, 0.28.0), else ``(False, why)``; read from the file, no import."""
    try:
        rocm_capture(read_installed(ROCM_ATTN, vllm_dir))
    except VariantNotApplicable as e:
        return False, str(e)
    return True, ""


# --- the overlay -------------------------------------------------------------


def make_overlay(
    files: Mapping[str, str], dest: str | os.PathLike, vllm_dir: Path | None = None
) -> Path:
    """Write ``dest/vllm``: the installed package by symlinks, except the
    folders on the way to each changed file and the files themselves. Returns
    ``dest``, the entry to put first on ``PYTHONPATH``.

    Unchanged modules in the real folders also get their installed bytecode
    linked (``__pycache__``), so the overlay costs no recompilation."""
    source = vllm_dir or installed_vllm_dir()
    dest = Path(dest)
    changed = {PurePosixPath(rel): text for rel, text in files.items()}
    for rel in changed:
        if not (source / rel).is_file():
            raise VariantMismatch(f"vllm/{rel} is not in the installed package")
    on_path = {p for rel in changed for p in rel.parents if p != PurePosixPath(".")}

    def mirror(src: Path, dst: Path, rel_dir: PurePosixPath) -> None:
        dst.mkdir(parents=True)
        modules_changed = {r.stem for r in changed if r.parent == rel_dir}
        for entry in sorted(src.iterdir()):
            rel = rel_dir / entry.name
            target = dst / entry.name
            if rel in changed:
                target.write_text(changed[rel])
            elif entry.name == "__pycache__":
                target.mkdir()
                for pyc in entry.iterdir():
                    if pyc.name.split(".")[0] not in modules_changed:
                        (target / pyc.name).symlink_to(pyc)
            elif rel in on_path:
                mirror(entry, target, rel)
            else:
                target.symlink_to(entry)

    mirror(source, dest / "vllm", PurePosixPath("."))
    return dest


def overlay_env(
    dest: str | os.PathLike, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """A process environment with the overlay first on ``PYTHONPATH``, then the
    repository root (``tests`` importable), then what was there before."""
    env = dict(os.environ if base is None else base)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(dest), str(ROOT), *rest])
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


_VERIFY = """
import importlib, importlib.metadata, json, sys
mods = json.loads(sys.argv[1])
print(json.dumps({
    "version": importlib.metadata.version("vllm"),
    "files": {m: importlib.import_module(m).__file__ for m in mods},
}))
"""


def module_name(rel: str) -> str:
    return "vllm." + rel.removesuffix(".py").replace("/", ".")


def verify_overlay(
    dest: str | os.PathLike, files: Mapping[str, str], expected_version: str
) -> dict:
    """In a new process (a warm child, as the tests run the overlay): each
    changed module imports from the overlay, as the derived text, and
    ``importlib.metadata.version("vllm")`` is still ``expected_version``."""
    from tests import warm

    dest = Path(dest)
    mods = [module_name(rel) for rel in files]
    proc = warm.python(
        ["-c", _VERIFY, json.dumps(mods)], overlay_env(dest), timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == expected_version, out
    for rel in files:
        origin = Path(out["files"][module_name(rel)])
        assert origin == dest / "vllm" / rel, out
        assert not origin.is_symlink()
        assert origin.read_text() == files[rel]
    return out
