# SPDX-License-Identifier: Apache-2.0
"""The switches, read once: modes, booleans, whitespace, bad values, the
per-patch switch and vLLM's own plugin allowlist."""

from __future__ import annotations

import pytest

from vllm_capture_guard.runtime import switch
from vllm_capture_guard.runtime.switch import Mode
from vllm_capture_guard.tools import guard


@pytest.mark.parametrize(
    "raw, mode",
    [
        (None, Mode.AUTO),
        ("", Mode.AUTO),
        ("  ", Mode.AUTO),
        ("auto", Mode.AUTO),
        ("Auto", Mode.AUTO),
        ("on", Mode.ON),
        (" OFF\t", Mode.OFF),
        ("1", Mode.ON),
        ("true", Mode.ON),
        ("TRUE", Mode.ON),
        ("yes", Mode.ON),
        ("0", Mode.OFF),
        ("false", Mode.OFF),
        ("No", Mode.OFF),
    ],
)
def test_read_mode(raw, mode):
    env = {} if raw is None else {switch.ENV: raw}
    assert switch.read_mode(env) == (mode, None)


def test_only_ascii_whitespace_is_trimmed():
    # A no-break space is not whitespace to a shell user: the value is bad.
    mode, problem = switch.read_mode({switch.ENV: "\u00a0on"})
    assert mode is Mode.AUTO
    assert problem is not None


def test_bad_value_names_the_allowed_values_and_is_echoed_short():
    raw = "please-" + "x" * 500
    mode, problem = switch.read_mode({switch.ENV: raw})
    assert mode is Mode.AUTO
    for word in ("auto", "on", "off", "true", "false", "0", "1"):
        assert word in problem
    echoed = problem.split("=", 1)[1].split(" is not one of", 1)[0]
    assert len(echoed) <= switch.ECHO_LIMIT
    wide = switch.read_mode({switch.ENV: "\u2603" * 100})[1]  # repr may grow
    assert len(wide.split("=", 1)[1].split(" is not one of", 1)[0]) <= 64


def test_disabled_patches():
    env = {switch.DISABLE_ENV: " rocm-aiter-unified-builder , ,Other "}
    assert switch.disabled_patches(env) == {"rocm-aiter-unified-builder", "other"}
    assert switch.disabled_patches({}) == frozenset()


@pytest.mark.parametrize(
    "raw, loaded",
    [
        (None, True),
        ("capture_guard", True),
        ("foo,capture_guard", True),
        ("foo, capture_guard", False),  # vLLM does not trim: never loaded
        ("capture_guard ", False),
        ("", False),
        ("foo", False),
    ],
)
def test_vllm_plugins_read_as_vllm_reads_it(raw, loaded):
    env = {} if raw is None else {guard.PLUGINS_ENV: raw}
    assert guard.loaded_by_vllm(env) is loaded


def test_vllm_plugins_rule_matches_vllms_own_parser(monkeypatch):
    """Same answers as vLLM's envs module, whatever its version."""
    import vllm.envs as envs

    for raw in ("foo, capture_guard", "foo,capture_guard", "", "capture_guard"):
        monkeypatch.setenv("VLLM_PLUGINS", raw)
        allowed = envs.environment_variables["VLLM_PLUGINS"]()
        theirs = allowed is None or guard.ENTRY_POINT_NAME in allowed
        assert guard.loaded_by_vllm() is theirs, raw
