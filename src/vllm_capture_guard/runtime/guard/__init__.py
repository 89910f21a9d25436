# SPDX-License-Identifier: Apache-2.0
"""The capture guard: no capture may change the host values that other builders
read (PR #51585's rule, on every release and every builder). By job: :mod:`.metadata`
(the fields), :mod:`.restore` (save and restore), :mod:`.copies` (follow the copies,
wait for them), :mod:`.guarded_call` (one capture), :mod:`.install` (where)."""
