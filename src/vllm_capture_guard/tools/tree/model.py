# SPDX-License-Identifier: Apache-2.0
"""What the patcher found in one file for one fix."""

from __future__ import annotations

import dataclasses

from vllm_capture_guard.runtime.logs import Words
from vllm_capture_guard.tools.tree.source import Edit


class State(Words):
    """What one file is, for one fix."""

    #: The file has the bug and we recognise it: the fix applies.
    NEEDED = "needs the fix"
    #: The file carries our backport (marker comments and the fixed structure).
    APPLIED = "carries the in-tree fix"
    #: The file already behaves as upstream's fixed release: nothing to do.
    UPSTREAM = "fixed upstream"
    #: The file is not in this tree (the backend does not exist): nothing to do.
    ABSENT = "absent"
    #: The file is not one we recognise: we refuse, and write nothing.
    UNRECOGNISED = "not recognised"


NEEDED, APPLIED, UPSTREAM, ABSENT, UNRECOGNISED = State


@dataclasses.dataclass(frozen=True)
class Finding:
    fix: str  # the in-tree fix's name, e.g. "rocm-attn-cpu-offsets"
    pr: str  # "#51585"
    rel: str  # the file, relative to the tree's root
    state: State
    detail: str
    edits: tuple[Edit, ...] = ()

    def __str__(self) -> str:
        return f"{self.fix} (PR {self.pr}), {self.rel}: {self.state}: {self.detail}"


def combined(states: list[State]) -> State:
    """One state for a fix that spans several files: the first of refused,
    needed, applied, upstream, absent that any of its files is in."""
    for state in (UNRECOGNISED, NEEDED, APPLIED, UPSTREAM):
        if state in states:
            return state
    return ABSENT
