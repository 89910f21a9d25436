# SPDX-License-Identifier: Apache-2.0
"""The capture guard: no capture may change the host values that other builders
read (PR #51585's rule, on every release and every builder). By job:
:mod:`.metadata` reads a metadata's fields, :mod:`.restore` saves and restores
its host values, :mod:`.copies` follows the copies and waits for them,
:mod:`.guarded_call` runs one capture guarded, :mod:`.install` says where."""
