# SPDX-License-Identifier: Apache-2.0
"""Modified vLLM files for the in-tree patcher, derived at test time from an
installed release's own files (text edits located by ``ast``; nothing of
vLLM's is stored here).

Each variation maps the installed ``{inside-package path: bytes}`` to a
modified copy. :data:`ACCEPTED` are vendor-style changes the patcher must
still fix; :data:`REFUSED` are writes it must not guess about, each with a
piece of the message that must name what was not recognised.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

from vllm_capture_guard.tools.fixes import builder_capture_guard as co
from vllm_capture_guard.tools.fixes import rocm_aiter_unified_builder as ab

Files = dict[str, bytes]
ATTN, AITER = co.FILE, ab.FILE
CPU_ZERO = "common_attn_metadata.query_start_loc_cpu.zero_()"
DEVICE_ZERO = "common_attn_metadata.query_start_loc.zero_()"


def _replace(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"the installed file changed: {old!r}"
    return text.replace(old, new)


def edit(inside: str, old: str, new: str) -> Callable[[Files], Files]:
    def apply(files: Files) -> Files:
        text = files[inside].decode()
        return {**files, inside: _replace(text, old, new).encode()}

    return apply


def _capture_lines(text: str) -> tuple[int, int]:
    cls = next(
        n
        for n in ast.parse(text).body
        if isinstance(n, ast.ClassDef) and n.name == co.CLASS
    )
    fn = next(n for n in cls.body if getattr(n, "name", "") == co.METHOD)
    return fn.lineno - 1, fn.end_lineno or fn.lineno


def rename_param(files: Files) -> Files:
    """The capture's metadata parameter is called ``cm``."""
    text = files[ATTN].decode()
    start, end = _capture_lines(text)
    lines = text.splitlines(keepends=True)
    for i in range(start, end):
        lines[i] = lines[i].replace("common_attn_metadata", "cm")
    return {**files, ATTN: "".join(lines).encode()}


def crlf(inside: str) -> Callable[[Files], Files]:
    def apply(files: Files) -> Files:
        return {**files, inside: files[inside].replace(b"\n", b"\r\n")}

    return apply


def chain(*steps: Callable[[Files], Files]) -> Callable[[Files], Files]:
    def apply(files: Files) -> Files:
        for step in steps:
            files = step(files)
        return files

    return apply


#: Vendor-style changes that keep the bug recognisable: fixed, then checked.
ACCEPTED: dict[str, Callable[[Files], Files]] = {
    "fill0-docstring-logging-renamed-crlf": chain(
        edit(ATTN, CPU_ZERO, CPU_ZERO.replace("zero_()", "fill_(0)")),
        edit(ATTN, DEVICE_ZERO, f"{DEVICE_ZERO}\n        logger.debug('capture')"),
        edit(
            ATTN,
            "        attn_metadata = self.build(0, common_attn_metadata)\n",
            '        """Vendor: capture metadata."""\n\n'
            "        attn_metadata = self.build(0, common_attn_metadata)\n",
        ),
        rename_param,
        crlf(AITER),
    ),
}

#: Changes the patcher must refuse; value: (variation, text in the message).
REFUSED: dict[str, tuple[Callable[[Files], Files], str]] = {
    "slice-assign": (
        edit(ATTN, CPU_ZERO, "common_attn_metadata.query_start_loc_cpu[:] = 0"),
        "`query_start_loc_cpu` is used outside",
    ),
    "alias": (
        edit(
            ATTN,
            CPU_ZERO,
            "cpu = common_attn_metadata.query_start_loc_cpu\n        cpu.zero_()",
        ),
        "`query_start_loc_cpu` is used outside",
    ),
    "helper-call": (
        edit(ATTN, CPU_ZERO, "self._reset_offsets(common_attn_metadata)"),
        "hands common_attn_metadata to",
    ),
    "conditional": (
        edit(ATTN, CPU_ZERO, f"if self.block_size:\n            {CPU_ZERO}"),
        "`query_start_loc_cpu` is used outside",
    ),
    "no-device-guard": (
        edit(ATTN, DEVICE_ZERO, "pass"),
        "zeroes query_start_loc_cpu but not query_start_loc",
    ),
    "same-line": (
        edit(ATTN, f"{DEVICE_ZERO}\n        {CPU_ZERO}", f"{DEVICE_ZERO}; {CPU_ZERO}"),
        "shares its line",
    ),
    "class-renamed": (
        edit(
            ATTN,
            f"class {co.CLASS}(",
            "class VendorRocmAttentionMetadataBuilder(",
        ),
        f"no class {co.CLASS}",
    ),
    "syntax-error": (
        edit(ATTN, CPU_ZERO, f"{CPU_ZERO} +"),
        "does not parse",
    ),
    "other-builder": (
        edit(
            AITER,
            "        return RocmAttentionMetadataBuilder\n",
            "        return VendorBuilder\n",
        ),
        "get_builder_cls returns VendorBuilder",
    ),  # fmt: skip
    "stray-marker": (
        edit(
            AITER,
            "logger = init_logger(__name__)\n",
            "logger = init_logger(__name__)\n"
            "# vllm-capture-guard: backport of vllm PR #53821\n",
        ),
        "still returns RocmAttentionMetadataBuilder",
    ),
    "name-taken": (
        edit(
            AITER,
            "logger = init_logger(__name__)\n",
            "logger = init_logger(__name__)\n"
            f"{ab.BUILDER} = RocmAttentionMetadataBuilder\n",
        ),
        f"the name {ab.BUILDER} is already used",
    ),
}
