# SPDX-License-Identifier: Apache-2.0
"""Is the installed vLLM one this project supports? Decided by structure (the
files the installed vLLM has), never by its version string: vendor builds
carry versions such as ``0.27.2rc1.dev77+g...rocm723``.

``check``'s capture sequence ends with MiniMax-M3's indexer (the builder that
asserts ``decode_query_len > 0``), and ``check`` and ``audit`` both run on a
real config of a tiny MiniMax-M3. A vLLM without the indexer is older than
the oldest release this project supports (:func:`problem`); one whose
MiniMax-M3 cannot be set up on this host (0.26.0 needs vLLM's compiled ops
just to inspect the model class) is told the same in one line
(:func:`cannot_set_up`). Either way the commands point at what still applies.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: What this project supports, in words (docs/releases.md).
SUPPORTED = (
    "supported: vLLM 0.27.0 to 0.28.0 (affected: the guard fixes capture) and "
    "0.29.0 and later (fixed upstream: the guard changes nothing)"
)
#: What still applies on a release outside that range (``check`` and
#: ``audit`` both build a tiny MiniMax-M3 config).
STILL = (
    "still available: `vllm-capture-guard status` (each patch, judged from "
    "vLLM's source) and `vllm-capture-guard patch --check` (the in-tree fix)"
)
#: MiniMax-M3's indexer, inside the vllm package.
INDEXER = ("models", "minimax_m3", "common", "indexer")


def vllm_package() -> Path | None:
    """The installed vllm package's folder (no import of vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def module_exists(name: str) -> bool:
    """Does the installed vLLM have module ``name``? (by its files; a parent
    package that is gone counts as no)"""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def _module_file(package: Path, parts: tuple[str, ...]) -> Path | None:
    """The module's source or sourceless bytecode, if the tree has it."""
    base = package.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base.with_suffix(".pyc")):
        if candidate.is_file():
            return candidate
    if base.is_dir() and (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def cannot_set_up(error: str) -> str:
    """One line for a vLLM on which the tiny MiniMax-M3 config fails to build.
    A requirement of vLLM's Model Runner V2 is said as such: it is no sign of
    a release outside the supported range."""
    first = " ".join(error.split())
    if len(first) > 240:
        first = first[:237] + "..."
    if "Model Runner V2" in first:
        return (
            f"vLLM could not make MiniMax-M3's config for its Model Runner V2 "
            f"({first}); on a host without a GPU, check runs Model Runner V2's "
            "Triton kernels in Triton's interpreter, which needs the triton "
            "package in this Python; -v shows vLLM's own log"
        )
    return (
        f"could not set up MiniMax-M3 on this vLLM ({first}); this is how "
        f"releases outside the supported range fail here; {SUPPORTED}. {STILL}; "
        "-v shows vLLM's own log"
    )


def problem() -> str | None:
    """Why the installed vLLM is outside the supported range (one line), or
    None if it is inside it."""
    package = vllm_package()
    if package is None:
        return None  # no vLLM at all is reported by the caller
    if _module_file(package, INDEXER) is None:
        where = "vllm/" + "/".join(INDEXER) + ".py"
        return (
            f"this vLLM has no MiniMax-M3 indexer ({where}), so it is older than "
            f"the oldest release this project supports; {SUPPORTED}. {STILL}"
        )
    return None
