# SPDX-License-Identifier: Apache-2.0
"""The switches, read in one place: everything else calls this module.

``VLLM_CAPTURE_GUARD`` chooses the mode:

``auto`` (default)
    act on a ROCm platform only; elsewhere set no hook at all.
``on`` (also ``1``, ``true``, ``yes``)
    act on any platform (CPU tests, ``vllm-capture-guard check``).
``off`` (also ``0``, ``false``, ``no``)
    do nothing.

``VLLM_CAPTURE_GUARD_DISABLE`` is a comma-separated list of patch names (see
``vllm-capture-guard status``) to leave out, so that one backport can be
dropped without dropping the others.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping

ENV = "VLLM_CAPTURE_GUARD"
DISABLE_ENV = "VLLM_CAPTURE_GUARD_DISABLE"
#: At most this many characters of a bad value are echoed back.
ECHO_LIMIT = 64
#: What ``str.strip()`` would remove, less the non-ASCII spaces.
_ASCII_SPACE = " \t\n\r\x0b\x0c"


class Mode(str, enum.Enum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"

    def __str__(self) -> str:
        return self.value


DEFAULT_MODE = Mode.AUTO
_WORDS = {
    **dict.fromkeys(("auto",), Mode.AUTO),
    **dict.fromkeys(("on", "1", "true", "yes"), Mode.ON),
    **dict.fromkeys(("off", "0", "false", "no"), Mode.OFF),
}


def _echo(raw: str) -> str:
    """``repr(raw)``, cut to at most ECHO_LIMIT characters."""
    shown = repr(raw)
    return shown if len(shown) <= ECHO_LIMIT else shown[: ECHO_LIMIT - 3] + "..."


def read_mode(environ: Mapping[str, str] | None = None) -> tuple[Mode, str | None]:
    """``(mode, problem)``: an invalid value falls back to ``auto`` and
    ``problem`` says so, naming the allowed values."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV)
    if raw is None:
        return DEFAULT_MODE, None
    value = raw.strip(_ASCII_SPACE).lower()
    if value == "":
        return DEFAULT_MODE, None
    mode = _WORDS.get(value)
    if mode is not None:
        return mode, None
    return DEFAULT_MODE, (
        f"{ENV}={_echo(raw)} is not one of auto, on (1, true, yes), "
        f"off (0, false, no); using {DEFAULT_MODE.value!r}"
    )


def disabled_patches(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The patch names listed in ``VLLM_CAPTURE_GUARD_DISABLE``."""
    env = os.environ if environ is None else environ
    raw = env.get(DISABLE_ENV, "")
    names = (n.strip(_ASCII_SPACE).lower() for n in raw.split(","))
    return frozenset(n for n in names if n)
