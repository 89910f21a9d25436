# SPDX-License-Identifier: Apache-2.0
"""The capture guard: no metadata builder's capture may change the host values
other builders read. Every ``build_for_cudagraph_capture`` vLLM can call runs
guarded, on every release and backend: its host values are saved
(:mod:`.keep`), the copies it queues on them followed (:mod:`.copies`), and
once those are done what it changed is put back in place; what it wrote is
said once. Where it is installed: :mod:`.install`. It began as the backport of
PR #51585 and keeps that name for operators (``rocm-attn-cpu-offsets``), but
it is no backport: nothing in it depends on a release."""

from __future__ import annotations

import sys
import threading
from typing import Any

from vllm_capture_guard.runtime.base import LOCK, say, short
from vllm_capture_guard.runtime.guard import copies, keep

PR = "#51585"
#: Per builder class: {"calls": n, "wrote": {field: size at the first write}}.
SEEN: dict[str, dict] = {}
_state = threading.local()  # .active: ids of the metadata guarded in this thread
#: Said once per builder class whose capture runs inside a stream capture.
CAPTURED = (
    "{}'s capture ran inside an active stream capture (a CUDA or HIP graph being "
    "recorded): its host writes were put back at once, so the graph's copies from "
    "them read the kept values at replay, as under 0.29.0's; a copy it captured "
    "into host memory writes there at every replay, unseen by the guard (no vLLM "
    "caller from 0.27.1 to 0.33.0 does this)"
)
#: Said once per builder class and reason where the guard waits for the stream.
BLIND = (
    "{}'s capture: the guard cannot see every copy of the shared pinned host "
    "memory ({}), so it waits for the stream after it"
)


def guarded_call(capture: Any, owner: str, metadata: Any, *args: Any, **kw: Any) -> Any:
    """``capture(metadata, ...)``; then, once the copies it queued on the saved
    host memory are done, put back what it changed in place."""
    active = _state.__dict__.setdefault("active", set())
    if id(metadata) in active:  # nested on the same metadata: the outer puts back
        return capture(metadata, *args, **kw)
    try:
        saved, failed, watch, size = keep.save(metadata)
    except Exception as e:  # never stop vLLM: its own call, unguarded
        why = f"could not read the metadata for {owner}'s capture ({short(e)})"
        say(f"{why}; it ran unguarded, and may change what other builders read", True)
        return capture(metadata, *args, **kw)
    mode = _enter(watch)
    active.add(id(metadata))
    raised = True
    try:
        result = capture(metadata, *args, **kw)
        raised = False
        return result
    finally:
        active.discard(id(metadata))
        if mode is not None:
            _leave(mode, owner)
        _settle(owner, saved, failed, watch, size, raised)


def _enter(watch: Any) -> Any:
    """The mode that follows the capture's copies, entered; None if there is
    nothing to follow, or it could not be (then the guard waits for the stream)."""
    if type(watch) is not copies.Watch:
        return None
    try:
        mode = copies.follow(watch)
        if mode is not None:
            mode.__enter__()
        return mode
    except Exception as e:
        watch.blind = f"its copies could not be followed: {short(e)}"
        return None


def _leave(mode: Any, owner: str) -> None:
    try:
        mode.__exit__(None, None, None)
    except Exception as e:
        say(f"could not stop following {owner}'s copies ({short(e)})", True)


def _settle(owner, saved, failed, watch, size, raised):  # noqa: ANN001, ANN202
    """After the capture: wait for the copies it queued, then tell and put back."""
    fault = None
    if watch is copies.CAPTURING:
        say(CAPTURED.format(owner), True)
    elif watch is not None:
        if watch.blind:
            say(BLIND.format(owner, watch.blind))
        try:
            copies.wait(watch)
        except Exception as e:  # a device error goes on to vLLM, after the put-back
            err = getattr(sys.modules["torch"], "AcceleratorError", RuntimeError)
            if isinstance(e, err) and "capturing" not in str(e) and not raised:
                fault = e
            else:  # the guard's own: told without waiting
                say(f"could not wait for {owner}'s capture ({short(e)})", True)
    try:
        changes, lost = keep.changed(saved)
        lost += keep.put_back(changes)
        _tell(owner, [name for name, *_ in changes], failed + lost, size)
    except Exception as e:
        say(f"could not put back what {owner}'s capture wrote ({short(e)})", True)
    if fault is not None:
        raise fault


def _tell(owner: str, wrote: list[str], lost: list[str], size: Any) -> None:
    with LOCK:
        seen = SEEN.setdefault(owner, {"calls": 0, "wrote": {}})
        seen["calls"] += 1
        new = [n for n in wrote if n not in seen["wrote"]]
        seen["wrote"].update(dict.fromkeys(new, size))
    if new:
        say(
            f"{owner}'s capture wrote {', '.join(new)} (size {size}); kept "
            f"from the other builders (backport of PR {PR})"
        )
    elif seen["calls"] == 1:
        say(f"{owner}'s capture, watched: it wrote no shared host value (size {size})")
    if lost:
        say(
            f"{owner}'s capture: could not keep {', '.join(lost)} from the "
            "other builders",
            True,
        )
