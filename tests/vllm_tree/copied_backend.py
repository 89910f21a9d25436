# SPDX-License-Identifier: Apache-2.0
"""A new attention backend that carries a copy of the pre-#51585 capture,
made at test time: the shape of the next instance of the bug (an open
upstream PR, #46742, adds a ROCm builder whose capture zeroes
``query_start_loc_cpu`` again).

:func:`derive` reads a *fixed* tree (one whose ROCm capture zeroes the device
offsets only: 0.29.0 and later, or 0.27/0.28 after the in-tree patch) and an
*affected* one (0.27/0.28 as released), and returns the fixed tree's files
changed:

* its ``rocm_attn.py`` with two classes appended: a builder that subclasses
  its ``RocmAttentionMetadataBuilder`` and whose
  ``build_for_cudagraph_capture`` is the affected tree's capture, its text
  copied as it is (found with ``ast``; it must zero both offsets), and a
  backend that names it (:data:`NAME`);
* its ``registry.py`` with that backend registered after ``ROCM_ATTN``.

So the new backend is the only thing in that tree with the bug.
:func:`write_into` puts the files into a patchable overlay
(``tests/tools/overlay.py``: a symbolic link is replaced by the file, never
written through); the installed releases are never written.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests import variants as vv

NAME = "ROCM_COPY_ATTN"
BUILDER = "RocmCopyAttentionMetadataBuilder"
BACKEND = "RocmCopyAttentionBackend"
REGISTRY = "v1/attention/backends/registry.py"
ENUM = "AttentionBackendEnum"


def _copied_classes(affected_rocm_attn: str) -> str:
    """The two new classes; the capture is the affected file's, verbatim."""
    _, fn, zeroing = vv.rocm_capture(affected_rocm_attn)  # both offsets zeroed
    assert vv.CPU_FIELD in zeroing
    method = vv.Editor(affected_rocm_attn).segment(fn)
    return (
        f"\n\nclass {BUILDER}({vv.BUILDER}):\n"
        f'    """A new builder whose capture is a copy of the pre-#51585 one."""\n\n'
        f"{method}"
        f"\n\nclass {BACKEND}({vv.BACKEND}):\n"
        "    @staticmethod\n"
        "    def get_name() -> str:\n"
        f'        return "{NAME}"\n\n'
        "    @staticmethod\n"
        f"    def get_builder_cls() -> type[{BUILDER}]:\n"
        f"        return {BUILDER}\n"
    )


def _registered(registry: str) -> str:
    """``registry.py`` with :data:`NAME` after ``ROCM_ATTN`` in the enum."""
    cls = vv.find_class(ast.parse(registry), ENUM, REGISTRY)
    found = [
        node
        for node in cls.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "ROCM_ATTN" for t in node.targets)
    ]
    if len(found) != 1:
        raise vv.VariantMismatch(f"vllm/{REGISTRY}: {ENUM} has no ROCM_ATTN member")
    ed = vv.Editor(registry)
    pad = vv.indent_of(ed.lines[found[0].lineno - 1])
    path = f"{vv.ROCM_MODULE}.{BACKEND}"
    ed.insert(found[0].end_lineno, f'{pad}{NAME} = "{path}"\n')
    return ed.text()


def derive(fixed_vllm: Path, affected_vllm: Path) -> dict[str, str]:
    """``{path under vllm/: text}`` for the fixed tree with the new backend.
    Raises :class:`tests.variants.VariantMismatch` where a file lacks what is
    changed, and if the fixed tree's own capture is not fixed."""
    fixed = vv.read_installed(vv.ROCM_ATTN, fixed_vllm)
    try:
        vv.rocm_capture(fixed)
    except vv.VariantNotApplicable:
        pass  # the fixed capture: zeroes the device offsets only
    else:
        raise vv.VariantMismatch(f"{fixed_vllm}: its own ROCm capture is not fixed")
    rocm_attn = (
        fixed.rstrip("\n")
        + "\n"
        + _copied_classes(vv.read_installed(vv.ROCM_ATTN, affected_vllm))
    )
    registry = _registered(vv.read_installed(REGISTRY, fixed_vllm))
    out = {vv.ROCM_ATTN: rocm_attn, REGISTRY: registry}
    for rel, text in out.items():
        compile(text, f"<derived vllm/{rel}>", "exec")
    return out


def write_into(overlay_vllm: Path, files: dict[str, str]) -> None:
    """Write ``files`` into an overlay's ``vllm/`` folder, whose entries are
    real folders on the way to them, and files or links to the installed
    release: a link is removed first, so the installed file stays as it is."""
    for rel, text in files.items():
        path = overlay_vllm / rel
        if not path.parent.is_dir() or path.parent.is_symlink():
            raise vv.VariantMismatch(f"{path.parent} is not a real folder")
        if path.is_symlink():
            path.unlink()
        path.write_text(text)
