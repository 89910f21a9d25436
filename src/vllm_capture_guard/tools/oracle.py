# SPDX-License-Identifier: Apache-2.0
"""Differential oracle: does capture on a patched vLLM behave exactly as on
upstream's fixed release?

Our promise is "on an affected install, capture behaves exactly as in 0.29.0".
This module checks it against 0.29.0 itself instead of against our reading of
it. The same scenario runs in separate environments (one vLLM release each),
each one writes what happened as JSON, and :func:`compare` puts the records
side by side, field by field:

``record``
    Load the plugins the way a vLLM worker does
    (``vllm.plugins.load_general_plugins()``, so ``VLLM_CAPTURE_GUARD`` decides
    whether the guard acts; ``auto`` counts as ``on`` here, as in ``check``),
    then, for each ROCm backend x :data:`~vllm_capture_guard.tools.scenarios.
    DEFAULT_BATCHES` batch, run the runner's capture sequence
    (:func:`~vllm_capture_guard.tools.scenarios.capture_groups`: the backend's
    builder, then MiniMax-M3's indexer, on shallow copies of one shared
    ``CommonAttentionMetadata``). For each builder it records every field of
    that metadata (CPU and device, tensors as lists, scalars as values) before
    and after its capture, which fields it rebound on its own copy, the error
    it raised if any, and every dataclass field of the metadata it returned.
``compare``
    Match a candidate record (patched 0.27.1 or 0.28.0) against a reference
    record (unpatched 0.29.0). Fields that both releases have must be equal;
    fields that only one release declares are listed, not compared.
``run``
    ``record`` in each release's environment (``.envs/vllm-X`` put first on
    ``PYTHONPATH``, or the interpreter's own vLLM), then ``compare``.

Commands (exit 0 when every candidate matches, 1 when one differs)::

    python -m vllm_capture_guard.tools.oracle record --out 0.28.0.json
    python -m vllm_capture_guard.tools.oracle compare 0.29.0.json 0.28.0.json
    python -m vllm_capture_guard.tools.oracle run --reference 0.29.0 \\
        --candidate 0.28.0 --candidate 0.27.1
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SCHEMA = 1
REFERENCE = "0.29.0"
CANDIDATES = ("0.28.0", "0.27.1")
ENVS_VAR = "CAPTURE_GUARD_ENVS"
DEFAULT_ENVS = ".envs"
GUARD_ENV = "VLLM_CAPTURE_GUARD"

#: Sections of a group record whose fields are compared.
SECTIONS = ("before", "after", "rebound", "returned")


# --- encoding ---------------------------------------------------------------


def encode(value: Any) -> Any:
    """A JSON value that says everything comparable about ``value``: tensors
    and arrays as dtype + shape + values, dataclasses field by field."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return {
            "kind": "tensor",
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "values": value.detach().cpu().reshape(-1).tolist(),
        }
    if isinstance(value, np.ndarray):
        return {
            "kind": "ndarray",
            "dtype": str(value.dtype),
            "shape": list(value.shape),
            "values": value.reshape(-1).tolist(),
        }
    if isinstance(value, enum.Enum):
        return {"kind": "enum", "type": type(value).__name__, "name": value.name}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "kind": "dataclass",
            "type": type(value).__name__,
            "fields": {
                f.name: encode(getattr(value, f.name, None))
                for f in dataclasses.fields(value)
            },
        }
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    return {"kind": "object", "type": type(value).__qualname__}


def _field_names(metadata: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(metadata)]


class _Recorder:
    """Stands in for one builder inside ``capture_groups``: it hands the
    runner's per-group copy to the real builder's capture and records the
    shared metadata around it."""

    def __init__(self, builder: Any) -> None:
        self.builder = builder
        self.vllm_config = builder.vllm_config
        self.entry: dict[str, Any] = {"builder": type(builder).__name__}

    def build_for_cudagraph_capture(self, cm: Any) -> Any:
        names = _field_names(cm)
        held = {n: getattr(cm, n) for n in names}  # the shared objects
        self.entry["before"] = {n: encode(held[n]) for n in names}
        try:
            returned = self.builder.build_for_cudagraph_capture(cm)
        finally:
            # The shared effect: the objects every later builder reads, even
            # where this builder bound a private one on its copy.
            self.entry["after"] = {n: encode(held[n]) for n in names}
            self.entry["rebound"] = {
                n: encode(getattr(cm, n))
                for n in names
                if getattr(cm, n) is not held[n]
            }
        self.entry["returned"] = encode(returned)
        return returned


def record_case(backend: str, batch: Any, device: str = "cpu") -> dict[str, Any]:
    """One backend x batch: every builder's capture, recorded."""
    from vllm_capture_guard.tools import scenarios as sc

    config = sc.make_vllm_config(max(batch.query_len - 1, 0), device)
    recorders = [
        ("attention", _Recorder(sc.attention_builder(backend, config, device))),
        ("indexer", _Recorder(sc.indexer_builder(config, device))),
    ]
    run = sc.capture_groups(recorders, sc.RunnerBuffers(device=device), batch)
    groups = []
    for (group, recorder), result in zip(recorders, run.groups, strict=False):
        groups.append(
            {
                "group": group,
                **recorder.entry,
                "error": result.error,
                "error_site": result.error_site,
            }
        )
    return {"backend": backend, "batch": batch.label(), "groups": groups}


def record() -> dict[str, Any]:
    """Load the plugins as a worker does, then record every case."""
    from vllm_capture_guard.runtime import plugin
    from vllm_capture_guard.tools import scenarios as sc

    if os.environ.get(GUARD_ENV, "").strip().lower() in ("", "auto"):
        os.environ[GUARD_ENV] = "on"  # judge the ROCm code path on any host
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    guard = plugin.report()
    cases: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    for backend in sc.ROCM_BACKENDS:
        try:
            sc.backend_class(backend)
        except Exception as e:  # 0.33 asks the GPU for its arch at import
            unavailable[backend] = f"{type(e).__name__}: {e}"
            continue
        for batch in sc.DEFAULT_BATCHES:
            cases[f"{backend}/{batch.label()}"] = record_case(backend, batch)
    return {
        "schema": SCHEMA,
        "vllm": plugin.vllm_version(),
        "mode": os.environ[GUARD_ENV],
        "guard_action": None if guard is None else guard.action,
        "guard": None if guard is None else guard.message,
        "unavailable": unavailable,
        "cases": cases,
    }


# --- comparison -------------------------------------------------------------


@dataclasses.dataclass
class Comparison:
    """What :func:`compare` found. ``ok`` when nothing differs."""

    reference: str
    candidate: str
    compared: int = 0  # leaf values compared
    differences: list[str] = dataclasses.field(default_factory=list)
    #: "path" -> the release that alone has that field (paths without case)
    one_sided: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.differences

    def report(self, limit: int = 40) -> str:
        verdict = "MATCH" if self.ok else f"DIFFER ({len(self.differences)})"
        lines = [
            f"oracle: {self.candidate} vs reference {self.reference}: {verdict}; "
            f"{self.compared} values compared"
        ]
        lines += [f"  differs: {d}" for d in self.differences[:limit]]
        if len(self.differences) > limit:
            lines.append(f"  ... {len(self.differences) - limit} more")
        for path, only in sorted(self.one_sided.items()):
            lines.append(f"  not compared: {path} exists only in vLLM {only}")
        return "\n".join(lines)


def _label(rec: dict[str, Any]) -> str:
    return f"vLLM {rec.get('vllm')} (guard: {rec.get('guard_action')})"


def _short(value: Any) -> str:
    if isinstance(value, dict) and "values" in value:
        return f"{value['dtype']}{value['shape']} {value['values']}"
    text = json.dumps(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _walk(
    out: Comparison,
    where: str,
    generic: str,
    ref: Any,
    cand: Any,
    ref_name: str,
    cand_name: str,
) -> None:
    """Compare two encoded values; ``generic`` names the path without the case,
    for the list of one-sided fields."""
    ref_fields = isinstance(ref, dict) and ref.get("kind") == "dataclass"
    cand_fields = isinstance(cand, dict) and cand.get("kind") == "dataclass"
    if ref_fields and cand_fields:
        if ref["type"] != cand["type"]:
            out.differences.append(
                f"{where}: type {cand['type']} != {ref['type']} (reference)"
            )
        _walk_fields(
            out, where, generic, ref["fields"], cand["fields"], ref_name, cand_name
        )
        return
    out.compared += 1
    if ref != cand:
        out.differences.append(f"{where}: {_short(cand)} != {_short(ref)} (reference)")


def _walk_fields(
    out: Comparison,
    where: str,
    generic: str,
    ref: dict[str, Any],
    cand: dict[str, Any],
    ref_name: str,
    cand_name: str,
) -> None:
    for name in sorted(set(ref) | set(cand)):
        path, gpath = f"{where}.{name}", f"{generic}.{name}"
        if name not in cand:
            out.one_sided[gpath] = ref_name
        elif name not in ref:
            out.one_sided[gpath] = cand_name
        else:
            _walk(out, path, gpath, ref[name], cand[name], ref_name, cand_name)


def compare(reference: dict[str, Any], candidate: dict[str, Any]) -> Comparison:
    """Field by field: does ``candidate`` do what ``reference`` does?"""
    out = Comparison(_label(reference), _label(candidate))
    ref_name, cand_name = str(reference.get("vllm")), str(candidate.get("vllm"))
    if reference.get("schema") != SCHEMA or candidate.get("schema") != SCHEMA:
        out.differences.append(f"record schema is not {SCHEMA}")
        return out
    if reference.get("guard_action") == "patched":
        out.differences.append(
            f"the reference {out.reference} was patched; it must be upstream's own"
        )
    ref_cases, cand_cases = reference["cases"], candidate["cases"]
    for key in sorted(set(ref_cases) | set(cand_cases)):
        if key not in cand_cases:
            why = candidate.get("unavailable", {}).get(key.split("/")[0], "")
            out.differences.append(f"{key}: not recorded on {cand_name} {why}")
            continue
        if key not in ref_cases:
            why = reference.get("unavailable", {}).get(key.split("/")[0], "")
            out.differences.append(f"{key}: not recorded on {ref_name} {why}")
            continue
        ref_groups = ref_cases[key]["groups"]
        cand_groups = cand_cases[key]["groups"]
        n = max(len(ref_groups), len(cand_groups))
        for i in range(n):
            if i >= len(cand_groups) or i >= len(ref_groups):
                on_cand = i < len(cand_groups)
                group = (cand_groups if on_cand else ref_groups)[i]["group"]
                only = cand_name if on_cand else ref_name
                out.differences.append(f"{key} {group}: ran on vLLM {only} only")
                continue
            rg, cg = ref_groups[i], cand_groups[i]
            where = f"{key} {rg['group']}"
            for item in ("group", "builder", "error"):
                out.compared += 1
                if rg.get(item) != cg.get(item):
                    out.differences.append(
                        f"{where} {item}: {cg.get(item)!r} != {rg.get(item)!r} "
                        "(reference)"
                    )
            for section in SECTIONS:
                ref_s, cand_s = rg.get(section), cg.get(section)
                label = f"{rg['group']}.{section}"
                if section == "returned":
                    _walk(
                        out,
                        f"{where} {section}",
                        label,
                        ref_s,
                        cand_s,
                        ref_name,
                        cand_name,
                    )
                    continue
                _walk_fields(
                    out,
                    f"{where} {section}",
                    label,
                    ref_s or {},
                    cand_s or {},
                    ref_name,
                    cand_name,
                )
    return out


# --- running it in separate environments -------------------------------------


def _src_dir() -> Path:
    import vllm_capture_guard

    return Path(vllm_capture_guard.__file__).resolve().parents[1]


def env_dir(version: str, envs: str | os.PathLike | None = None) -> Path | None:
    """``<envs>/vllm-<version>`` if it exists, else None (the interpreter's
    own vLLM is meant)."""
    root = Path(envs or os.environ.get(ENVS_VAR) or DEFAULT_ENVS)
    path = root / f"vllm-{version}"
    return path.resolve() if path.is_dir() else None


def env_for(
    version: str, mode: str, envs: str | os.PathLike | None = None
) -> dict[str, str]:
    """The process environment that runs this package against ``version``."""
    env = dict(os.environ)
    path = [str(_src_dir())]
    target = env_dir(version, envs)
    if target is not None:
        path.append(str(target))
    env["PYTHONPATH"] = os.pathsep.join(path)
    env[GUARD_ENV] = mode
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    return env


def record_in(
    version: str,
    out: str | os.PathLike,
    mode: str,
    envs: str | os.PathLike | None = None,
    timeout: float = 600,
) -> dict[str, Any]:
    """``record`` in a fresh interpreter against vLLM ``version``."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_capture_guard.tools.oracle",
            "record",
            "--out",
            out,
        ],
        env=env_for(version, mode, envs),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"oracle record on vLLM {version} failed ({proc.returncode}):\n"
            + (proc.stdout + proc.stderr)[-4000:]
        )
    result = json.loads(Path(out).read_text())
    if result["vllm"] != version:
        raise RuntimeError(
            f"asked for vLLM {version} but the environment has {result['vllm']}; "
            f"build it (make envs) or point {ENVS_VAR} at a folder of vllm-X targets"
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_capture_guard.tools.oracle", description=__doc__
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_rec = sub.add_parser("record", help="record this vLLM's capture as JSON")
    p_rec.add_argument("--out", required=True)
    p_cmp = sub.add_parser("compare", help="candidates against a reference record")
    p_cmp.add_argument("reference")
    p_cmp.add_argument("candidates", nargs="+")
    p_run = sub.add_parser("run", help="record in each release's env, compare")
    p_run.add_argument("--reference", default=REFERENCE)
    p_run.add_argument("--candidate", action="append", dest="candidates")
    p_run.add_argument("--mode", default="on", help="guard mode on the candidates")
    p_run.add_argument("--envs", default=None, help=f"default ${ENVS_VAR} or .envs")
    p_run.add_argument("--keep", default=None, help="folder to keep the records in")
    args = parser.parse_args(argv)

    if args.command == "record":
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        result = record()
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(
            f"recorded {len(result['cases'])} cases on vLLM {result['vllm']} "
            f"(guard: {result['guard']}) -> {args.out}"
        )
        return 0
    if args.command == "compare":
        reference = json.loads(Path(args.reference).read_text())
        results = [
            compare(reference, json.loads(Path(c).read_text())) for c in args.candidates
        ]
    else:
        folder = Path(args.keep or tempfile.mkdtemp(prefix="capture-guard-oracle-"))
        folder.mkdir(parents=True, exist_ok=True)
        reference = record_in(
            args.reference, folder / f"{args.reference}-off.json", "off", args.envs
        )
        results = []
        for version in args.candidates or CANDIDATES:
            out = folder / f"{version}-{args.mode}.json"
            results.append(
                compare(reference, record_in(version, out, args.mode, args.envs))
            )
    for result in results:
        print(result.report())
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
