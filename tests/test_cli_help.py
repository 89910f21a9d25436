# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard --help`` is plain text for a terminal, and every
command's help names its exit codes; ``status --json`` is one JSON object."""

from __future__ import annotations

import json

import pytest

from vllm_capture_guard.tools import cli


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_is_plain_text_with_exit_codes(capsys):
    out = _help(capsys)
    assert "``" not in out and ":mod:" not in out
    assert "Exit codes:" in out
    for code in ("0", "1", "2"):
        assert f"\n  {code}  " in out, out
    for command in cli.COMMANDS:
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(command))
        assert "exit" in line, line


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_each_command_help_names_its_exit_codes(capsys, command):
    out = " ".join(_help(capsys, command).split())
    assert "``" not in out
    assert "Exit codes: 0 " in out and "; 2 " in out, out
    if command != "status":  # status has no "1"
        assert "; 1 " in out, out
    assert "--json" in out


def test_status_json_is_one_object(capsys, monkeypatch, vllm_version):
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.delenv("VLLM_CAPTURE_GUARD", raising=False)
    assert cli.main(["status", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is True
    assert result["vllm"] == vllm_version
    assert result["mode"] == "auto"
    assert {p["name"] for p in result["patches"]} == {
        "rocm-attn-cpu-offsets",
        "rocm-aiter-unified-builder",
        "graph-capture-stream",
    }


def test_patch_help_is_plain_text_with_exit_codes(capsys):
    out = _help(capsys, "patch")
    assert "``" not in out and "Exit codes:" in out
    flat = " ".join(out.split())
    assert "--check 0 nothing to do" in flat and "1 the tree needs the fix" in flat
    assert "2 refused" in flat
    top = " ".join(_help(capsys).split())
    entry = top.split(" patch ", 1)[1].split(" options:", 1)[0]
    assert "exit 0" in entry and "2 not recognised" in entry, entry
