# SPDX-License-Identifier: Apache-2.0
"""The guard's log: vLLM's logger and format, each message said once a process;
and :class:`Words`, what a status or a mode is, printed as its words."""

from __future__ import annotations

import enum
import logging
import threading

LOG = logging.getLogger("vllm.capture_guard")  # vLLM's handler and format
PREFIX = "vllm-capture-guard"
SHORT_ERROR = 120  # characters of an error shown in a log line

_lock = threading.Lock()
_said: set[str] = set()


def _first_time(message: str) -> bool:
    with _lock:
        if message in _said:
            return False
        _said.add(message)
        return True


def log_once(message: str) -> None:
    """Log ``message`` at INFO, once per process."""
    if _first_time(message):
        LOG.info(f"{PREFIX}: {message}")


def warn_once(message: str) -> None:
    """Log ``message`` at WARNING, once per process."""
    if _first_time(message):
        LOG.warning(f"{PREFIX}: {message}")


class Words(str, enum.Enum):
    """A string enum printed as its value (``enum.StrEnum`` before 3.11)."""

    __str__, __format__ = str.__str__, str.__format__


def short_error(error: BaseException) -> str:
    """An error in at most :data:`SHORT_ERROR` characters."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= SHORT_ERROR else text[: SHORT_ERROR - 3] + "..."
