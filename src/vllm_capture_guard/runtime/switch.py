# SPDX-License-Identifier: Apache-2.0
"""The switches, read here only: ``VLLM_CAPTURE_GUARD`` is ``auto`` (default: on
ROCm only), ``on`` (``1``, ``true``, ``yes``) or ``off`` (``0``, ``false``, ``no``);
``VLLM_CAPTURE_GUARD_DISABLE``: patch names, comma separated, to leave out."""

from __future__ import annotations

import os
from collections.abc import Mapping

from vllm_capture_guard.runtime.logs import Words

ENV, DISABLE_ENV = "VLLM_CAPTURE_GUARD", "VLLM_CAPTURE_GUARD_DISABLE"
ECHO_LIMIT = 64  # at most this many characters of a bad value are echoed
_SPACE = " \t\n\r\x0b\x0c"  # what str.strip() removes, less non-ASCII spaces


class Mode(Words):
    AUTO, ON, OFF = "auto", "on", "off"


_WORDS = {"auto": Mode.AUTO, **dict.fromkeys(("on", "1", "true", "yes"), Mode.ON)}
_WORDS.update(dict.fromkeys(("off", "0", "false", "no"), Mode.OFF))


def read_mode(environ: Mapping[str, str] | None = None) -> tuple[Mode, str | None]:
    """``(mode, problem)``: a bad value means ``auto``, and ``problem`` says so."""
    raw = (os.environ if environ is None else environ).get(ENV)
    mode = _WORDS.get((raw or "auto").strip(_SPACE).lower() or "auto")
    if mode is not None:
        return mode, None
    shown = repr(raw)
    shown = shown if len(shown) <= ECHO_LIMIT else shown[: ECHO_LIMIT - 3] + "..."
    words = "auto, on (1, true, yes), off (0, false, no)"
    return Mode.AUTO, f"{ENV}={shown} is not one of {words}; using 'auto'"


def disabled_patches(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The patch names listed in ``VLLM_CAPTURE_GUARD_DISABLE``."""
    raw = (os.environ if environ is None else environ).get(DISABLE_ENV, "")
    return frozenset(n for n in (p.strip(_SPACE).lower() for p in raw.split(",")) if n)
