# SPDX-License-Identifier: Apache-2.0
"""``vllm-capture-guard --help`` is plain text for a terminal, names both
start-up failures, and every command's help names its exit codes; an unknown
option is named; ``--json`` is taken wherever the help says so."""

from __future__ import annotations

import json

import pytest
import tomllib

from tests.conftest import run_fresh
from tests.variants import ROOT
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
    listed = out.split("\npositional arguments:", 1)[1].splitlines()
    for command in cli.COMMANDS:
        line = next(ln for ln in listed if ln.strip().startswith(command))
        assert "exit" in line, line


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_each_command_help_names_its_exit_codes(capsys, command):
    out = " ".join(_help(capsys, command).split())
    assert "``" not in out
    assert "Exit codes: 0 " in out and "; 1 " in out and "; 2 " in out, out
    assert "--json" in out


#: Both start-up failures, in the words an operator searches for.
CRASHES = ("decode_query_len > 0", "splitk workspace not initialized")


def test_help_and_package_metadata_name_both_failures(capsys):
    top = " ".join(_help(capsys).split())
    for crash in CRASHES:
        assert crash in top, top
    assert "#53818" in top and "#51585" in top
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for crash in CRASHES:
        assert crash in project["description"], project["description"]
    urls = " ".join(project["urls"].values())
    for pr in ("51585", "53821", "53818"):
        assert f"/pull/{pr}" in urls
    # every extra lists what something here uses: none is for a rich CLI
    assert "cli" not in project["optional-dependencies"]
    assert not any(
        "rich" in r for deps in project["optional-dependencies"].values() for r in deps
    )


@pytest.mark.parametrize(
    "argv", [["--frobnicate"], ["check", "--frobnicate"], ["--frobnicate", "status"]]
)
def test_an_unknown_option_is_named(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --frobnicate" in err, err


def test_a_missing_command_or_patch_mode_is_said(capsys):
    for argv, said in (([], "a COMMAND is required"), (["patch"], "one of --check")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2
        assert said in capsys.readouterr().err


def test_json_is_taken_where_the_help_says(capsys):
    top = " ".join(_help(capsys).split())
    said = top.split("--json (one JSON object on stdout) is taken by ", 1)[1]
    assert said.startswith("status, check, audit and patch --check."), said
    code = cli.main(["patch", "--check", "--json"])
    out = capsys.readouterr()
    found = json.loads(out.out)
    assert code == found["exit"] and code in (0, 1), out
    assert found["ok"] is True and found["findings"], found
    assert {f["fix"] for f in found["findings"]} == {
        "rocm-attn-cpu-offsets",
        "rocm-aiter-unified-builder",
        "graph-capture-stream",
    }
    with pytest.raises(SystemExit) as exit_:
        cli.main(["patch", "--diff", "--json"])
    assert exit_.value.code == 2
    assert "--json goes with --check only" in capsys.readouterr().err


def test_status_json_is_one_object(vllm_version):
    """In a new process: status loads the plugins as check does."""
    proc = run_fresh(
        ["-m", "vllm_capture_guard", "status", "--json"],
        VLLM_CAPTURE_GUARD=None,
        VLLM_PLUGINS=None,
        VLLM_LOGGING_STREAM="ext://sys.stderr",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["ok"] is True and result["exit"] == 0
    assert result["vllm"] == vllm_version
    assert result["mode"] == "auto"
    assert result["protected"] in ("yes", "not affected"), result
    assert [p["name"] for p in result["patches"]] == [
        "builder-capture-guard",
        "rocm-aiter-unified-builder",
        "graph-capture-stream",
    ]
    # renamed after 0.1.0: both names, for monitoring that matches either
    assert result["former_names"] == {"rocm-attn-cpu-offsets": "builder-capture-guard"}
    assert result["patches"][0]["former_names"] == ["rocm-attn-cpu-offsets"]


def test_patch_help_is_plain_text_with_exit_codes(capsys):
    out = _help(capsys, "patch")
    assert "``" not in out and "Exit codes:" in out
    flat = " ".join(out.split())
    assert "--check 0 nothing to do" in flat and "1 the tree needs the fix" in flat
    assert "2 refused" in flat
    top = " ".join(_help(capsys).split())
    entry = top.split(" patch ", 1)[1].split(" options:", 1)[0]
    assert "exit 0" in entry and "2 not recognised" in entry, entry
