# SPDX-License-Identifier: Apache-2.0
"""The one capture harness: builders' captures, driven as the model runner
drives them during full CUDA-graph capture.

:func:`capture` takes one shared ``CommonAttentionMetadata`` (views of
:class:`~vllm_capture_guard.tools.harness.runner.RunnerBuffers` holding a
:class:`~vllm_capture_guard.tools.harness.runner.Batch`, or the caller's
own), gives each ``(group, builder)`` a shallow copy of it in the runner's
order (``gpu_model_runner._build_attention_metadata``), calls its
``build_for_cudagraph_capture`` under its config, and records per builder:
what it returned, which shared fields it wrote in place (CPU and device, old
and new values, :mod:`vllm_capture_guard.tools.contract`), which fields it
rebound on its own copy, and the error it raised and where. ``check``, the
audit, the test helpers and the oracle all run captures through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import traceback
from collections.abc import Sequence
from copy import copy
from pathlib import Path
from typing import Any

from vllm_capture_guard.tools.contract import FieldWrite, encode, snapshot
from vllm_capture_guard.tools.harness.runner import (
    Batch,
    RunnerBuffers,
    shared_metadata,
)

#: An absolute path up to a package folder named ``vllm``.
_INSTALL_PREFIX = re.compile(r"(?:[A-Za-z]:)?[/\\][^\s'\"()]*?[/\\](?=vllm[/\\])")


def error_text(exc: BaseException) -> str:
    """``"Type: message"`` (``"Type"`` when the message is empty), with the
    install location cut from any path into vLLM (``vllm/...``), so that what
    is written down names no machine's folders."""
    text = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
    return _INSTALL_PREFIX.sub("", text)


def error_site(exc: BaseException) -> tuple[str, str]:
    """Where inside vLLM ``exc`` was raised: ``("vllm/...py:LINE", source)``
    (outside vLLM: the file's name only)."""
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if f"{os.sep}vllm{os.sep}" in f.filename]
    if not frames:
        return "?", ""
    frame = (inside or frames)[-1]
    parts = Path(frame.filename).parts
    # relative to the package, never the machine's folders
    rel = "/".join(parts[parts.index("vllm") :]) if "vllm" in parts else parts[-1]
    return f"{rel}:{frame.lineno}", (frame.line or "").strip()


def describe(exc: BaseException) -> str:
    """``"Type: message (at vllm/...py:LINE)"``."""
    return f"{error_text(exc)} (at {error_site(exc)[0]})"


@dataclasses.dataclass
class GroupCapture:
    """What one builder's capture did."""

    group: str
    builder: str  # the builder's class name
    writes: list[FieldWrite]
    rebinds: list[str]  # fields rebound on its own copy (private to its group)
    returned: Any = None  # what build_for_cudagraph_capture returned
    error: str | None = None
    error_site: str | None = None  # "vllm/...py:line" where it was raised
    error_line: str | None = None  # that line's source text
    #: With ``record=True``: every shared field encoded before and after, the
    #: rebound fields' new values and the returned metadata, encoded.
    record: dict[str, Any] | None = None


@dataclasses.dataclass
class CaptureRun:
    batch: Batch | None
    groups: list[GroupCapture]
    shared: Any  # the shared metadata every group's copy was made from

    @property
    def failed(self) -> GroupCapture | None:
        return next((g for g in self.groups if g.error), None)

    def values(self, field: str) -> list[Any]:
        """The shared field's values now."""
        return getattr(self.shared, field).detach().cpu().reshape(-1).tolist()


def _fields(metadata: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(metadata)]


def _config(builder: Any) -> Any:
    config = getattr(builder, "vllm_config", None)
    if config is None:
        return contextlib.nullcontext()
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(config)


def capture(
    builders: Sequence[tuple[str, Any]],
    batch: Batch | None = None,
    *,
    metadata: Any = None,
    buffers: RunnerBuffers | None = None,
    device: Any = "cpu",
    record: bool = False,
    raise_errors: bool = False,
) -> CaptureRun:
    """Run each ``(group, builder)``'s capture in order, each on a shallow
    copy of one shared metadata: ``metadata`` if given, else ``buffers``
    (fresh runner buffers if None) filled with ``batch``. Stops after the
    first builder that raises (startup would die there), or re-raises if
    ``raise_errors``."""
    if metadata is not None:
        base = metadata
    elif buffers is not None:
        buffers.fill(batch)
        base = buffers.common_metadata(batch)
    else:
        base = shared_metadata(batch, device)
    names = _fields(base)
    groups: list[GroupCapture] = []
    for group, builder in builders:
        cm = copy(base)  # the runner's per-group shallow copy
        seen = snapshot(base)
        held = {n: getattr(base, n) for n in names}
        result = GroupCapture(group, type(builder).__name__, [], [])
        if record:
            result.record = {"before": {n: encode(held[n]) for n in names}}
        try:
            with _config(builder):
                result.returned = builder.build_for_cudagraph_capture(cm)
        except Exception as e:
            if raise_errors:
                raise
            result.error = error_text(e)
            result.error_site, result.error_line = error_site(e)
        finally:
            result.writes = seen.writes()
            result.rebinds = [n for n in names if getattr(cm, n) is not held[n]]
        if record:
            result.record["after"] = {n: encode(held[n]) for n in names}
            result.record["rebound"] = {
                n: encode(getattr(cm, n)) for n in result.rebinds
            }
            result.record["returned"] = encode(result.returned)
        groups.append(result)
        if result.error:
            break
    return CaptureRun(batch, groups, base)
