# SPDX-License-Identifier: Apache-2.0
"""What ``status`` needs to read vLLM's imported code: a :class:`Reading` per
fix site, the import as ``check`` does it on a host without a GPU, and a
builder's capture read as the fixed shape or not. Each fix's reader is in its
module of :mod:`.fixes` (``readings()``); the tools' view, never the runtime's
(the runtime guards every call).

Read before the plugin patches this process (``status`` does): a patched
backend returns the backport's builder, which reads as fixed.

Reading can say "needs the fix"; where it says "fixed", the runtime still
guards (a write through an alias, a capture bound per instance, a stream that
is ``None`` at run time all read as fixed).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from vllm_capture_guard.tools.failure import one_line

METHOD = "build_for_cudagraph_capture"


@dataclasses.dataclass(frozen=True)
class Reading:
    where: str
    needed: bool | None  # None: could not be read, or not importable here
    why: str
    #: False: the module does not import on this host (a dependency of vLLM
    #: missing here), so nothing was read
    importable: bool = True


def import_to_read(module: str) -> Any:
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


def capture_reading(label: str, builder: type, why: str | None, kept: str) -> Reading:
    """A builder's capture as read by :func:`.shape.fixed_shape`: a field it
    touches (needed), nothing wrong (not needed), or in doubt (None)."""
    name = builder.__name__
    if why is None:
        return Reading(label, False, f"{name}'s capture leaves {kept} alone")
    if why.startswith("it touches "):
        field = why.removeprefix("it touches ")
        return Reading(label, True, f"{name}'s capture uses {field}")
    return Reading(label, None, f"cannot tell by reading {name}'s capture ({why})")
