# SPDX-License-Identifier: Apache-2.0
"""One capture, guarded: save the host values, follow the copies while it runs,
wait for those copies, then restore what it changed and log what it wrote."""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any

from vllm_capture_guard.runtime.guard import copies, restore
from vllm_capture_guard.runtime.logs import log_once, short_error, warn_once
from vllm_capture_guard.runtime.patching import LOCK

PR = "#51585"
KEPT = f"kept from the other builders (backport of PR {PR})"
CAPTURED = (
    "{}'s capture ran inside an active stream capture: its host writes were "
    "put back at once (the graph reads the kept values at replay, as under "
    "0.29.0); a copy it captured into host memory writes there at every replay"
)
UNFOLLOWED = (
    "{}'s capture: the guard cannot see every copy of the saved memory ({}), so it "
    "waits for the stream after it"
)


@dataclasses.dataclass
class BuilderSeen:  # what one builder class's captures did in this process
    calls: int = 0
    wrote: dict[str, Any] = dataclasses.field(default_factory=dict)  # field -> size


SEEN: dict[str, BuilderSeen] = {}  # builder class name -> what its captures did
_thread = threading.local()  # .active: ids of the metadata guarded in this thread


def run(capture: Any, owner: str, metadata: Any, *args: Any, **kw: Any) -> Any:
    """``capture(metadata)``; what it changed restored once its copies are done."""
    active = _thread.__dict__.setdefault("active", set())
    if id(metadata) in active:  # nested on the same metadata: the outer restores
        return capture(metadata, *args, **kw)
    try:
        torch_off = sys.modules["torch"]._C.DisableTorchFunction
        with torch_off():  # the guard's own torch calls: unseen by another's mode
            saved = restore.save(metadata)
    except Exception as e:  # never stop vLLM: its own call, unguarded
        why = f"could not read the metadata for {owner}'s capture ({short_error(e)})"
        warn_once(f"{why}; it ran unguarded, and may change what other builders read")
        return capture(metadata, *args, **kw)
    try:  # follow the copies; where it cannot, it waits for the stream instead
        mode = copies.follow(saved.watch)
        if mode is not None:
            mode.__enter__()
    except Exception as e:
        mode = None  # not entered, so never exited
        saved.watch.unfollowed = f"its copies could not be followed: {short_error(e)}"
    active.add(id(metadata))
    raised = True
    try:
        result = capture(metadata, *args, **kw)
        raised = False
        return result
    finally:
        active.discard(id(metadata))
        try:
            if mode is not None:
                mode.__exit__(None, None, None)
        except Exception as e:
            warn_once(f"could not stop following {owner}'s copies ({short_error(e)})")
        with torch_off():
            _after_capture(owner, saved, raised)


def _after_capture(owner: str, saved: restore.Saved, raised: bool) -> None:
    """Wait for the copies the capture queued, then restore and log. A device
    error met while waiting goes on to vLLM, after the restore."""
    device_error = _wait_for_copies(owner, saved.watch, raised)
    try:
        changes, not_compared = restore.changed(saved.values)
        not_kept = saved.unsaved + not_compared + restore.restore(changes)
        _log_what_it_wrote(owner, changes, not_kept, saved.num_actual_tokens)
    except Exception as e:
        warn_once(f"could not put back what {owner}'s capture wrote ({short_error(e)})")
    if device_error is not None:
        raise device_error


def _wait_for_copies(owner: str, watch: Any, raised: bool) -> Exception | None:
    """Wait for the copies of the saved bytes; a device error to raise, or None."""
    if watch is copies.CAPTURING:
        warn_once(CAPTURED.format(owner))
        return None
    if watch is None:
        return None
    if watch.unfollowed:
        log_once(UNFOLLOWED.format(owner, watch.unfollowed))
    try:
        copies.wait(watch)
    except Exception as e:
        device_error = getattr(sys.modules["torch"], "AcceleratorError", RuntimeError)
        if isinstance(e, device_error) and "capturing" not in str(e) and not raised:
            return e
        warn_once(f"could not wait for {owner}'s capture ({short_error(e)})")
    return None


def _log_what_it_wrote(
    owner: str, changes: list[restore.SavedValue], not_kept: list[str], tokens: Any
) -> None:
    with LOCK:
        seen = SEEN.setdefault(owner, BuilderSeen())
        seen.calls += 1
        new = [c.field for c in changes if c.field not in seen.wrote]
        seen.wrote.update(dict.fromkeys(new, tokens))
        first_call = seen.calls == 1
    capture = f"{owner}'s capture"  # size: the batch's num_actual_tokens
    if new:
        log_once(f"{capture} wrote {', '.join(new)} (size {tokens}); {KEPT}")
    elif first_call:
        log_once(f"{capture}, watched: it wrote no shared host value (size {tokens})")
    if not_kept:
        fields = ", ".join(not_kept)
        warn_once(f"{capture}: could not keep {fields} from the other builders")
