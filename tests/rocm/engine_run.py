# SPDX-License-Identifier: Apache-2.0
"""Start vLLM's engine on the tiny MiniMax-M3 and generate a few tokens.

One engine per process, so that a failed startup cannot poison the caller:
``tests/rocm/test_engine_startup.py`` runs this module in a fresh interpreter
for every engine it starts. By hand, from the repository root::

    python -m tests.rocm.engine_run --backend ROCM_ATTN \\
        --cudagraph-mode FULL_AND_PIECEWISE --tp 1
    python -m tests.rocm.engine_run --host-info

On success the last line printed is ``ENGINE_RESULT {json}`` and the exit
status is 0. A failed startup raises out of ``vllm.LLM(...)``: vLLM prints the
engine core's traceback and the exit status is not 0.

Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.rocm.tiny_model import SPARSE_BLOCK_SIZE, VOCAB_SIZE, write_engine_model

RESULT_PREFIX = "ENGINE_RESULT "
HOST_PREFIX = "HOST_INFO "

BACKENDS = ("ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN")
CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")
#: Batch sizes to capture: small, and covering the padded decode batch (3 -> 4).
CAPTURE_SIZES = [1, 2, 4, 8]
MAX_TOKENS = 8
BLOCK_SIZE = SPARSE_BLOCK_SIZE
VOCAB = VOCAB_SIZE

#: Token-id prompts (no tokenizer): a short one, one just over a KV block and
#: one over three blocks. Their decode steps run 3 requests in the full graph
#: captured for 4, i.e. with one padded request.
PROMPTS: list[list[int]] = [
    [1, 2, 3, 4, 5, 6, 7, 8],
    [(7 * i) % (VOCAB - 1) + 1 for i in range(BLOCK_SIZE + 3)],
    [(13 * i) % (VOCAB - 1) + 1 for i in range(3 * BLOCK_SIZE - 5)],
]


def llm_kwargs(
    model_dir: str, backend: str, cudagraph_mode: str, tp: int
) -> dict[str, Any]:
    """What ``vllm.LLM`` gets: random weights, no tokenizer, full-graph capture
    with ``backend`` for the dense attention layer."""
    return dict(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        tensor_parallel_size=tp,
        # Both MiniMax-M3 sparse backends support only kernel block size 128.
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        max_num_seqs=8,
        kv_cache_memory_bytes=1 << 30,
        seed=0,
        enforce_eager=False,
        attention_config={"backend": backend},
        compilation_config={
            "cudagraph_mode": cudagraph_mode,
            "cudagraph_capture_sizes": CAPTURE_SIZES,
        },
    )


def sampling_kwargs() -> dict[str, Any]:
    """Greedy, exactly ``MAX_TOKENS`` tokens, token ids only."""
    return dict(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False
    )


def run_engine(model_dir: str, backend: str, cudagraph_mode: str, tp: int) -> dict:
    from importlib.metadata import version

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_capture_guard.runtime import plugin

    start = time.monotonic()
    llm = LLM(**llm_kwargs(model_dir, backend, cudagraph_mode, tp))
    started = time.monotonic()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
        SamplingParams(**sampling_kwargs()),
        use_tqdm=False,
    )
    done = time.monotonic()
    report = plugin.report()
    # Stop the engine core (and its workers) now rather than at interpreter
    # exit; best effort, the caller also ends the whole process group.
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    return {
        "vllm": version("vllm"),
        "backend": backend,
        "cudagraph_mode": cudagraph_mode,
        "tp": tp,
        "guard": None
        if report is None
        else {
            "mode": report.mode,
            "action": report.action,
            "message": report.message,
        },
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        "startup_s": round(started - start, 1),
        "generate_s": round(done - started, 2),
    }


def host_info() -> dict:
    """What the ROCm tests need to know about this host, from a clean process:
    ROCm torch?, GPUs, vLLM, whether the guard is installed as a vLLM plugin,
    and whether this vLLM is affected, decided by running vLLM's own ROCm
    capture and the MiniMax-M3 indexer on shared buffers, on the CPU, with no
    guard loaded (never by asking the guard)."""
    from importlib.metadata import entry_points, version

    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "hip": torch.version.hip,
        "gpus": torch.cuda.device_count() if torch.version.hip else 0,
    }
    if info["gpus"]:
        info["gpu_name"] = torch.cuda.get_device_name(0)
    info["vllm"] = version("vllm")
    eps = entry_points(group="vllm.general_plugins")
    info["entry_point"] = next(
        (ep.value for ep in eps if ep.name == "capture_guard"), None
    )
    import vllm_capture_guard
    from vllm_capture_guard.tools import harness as sc

    info["guard_module"] = str(Path(vllm_capture_guard.__file__).resolve().parent)
    batch = sc.Batch(4)
    run = sc.run_capture("ROCM_ATTN", batch)
    failed = run.failed
    info["capture"] = {
        "affected": run.values("query_start_loc_cpu") != batch.offsets(),
        "detail": f"ROCM_ATTN capture left query_start_loc_cpu "
        f"{run.values('query_start_loc_cpu')} (was {batch.offsets()}); "
        f"{'failed: ' + failed.error if failed else 'indexer built'}",
    }
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-info", action="store_true")
    parser.add_argument("--backend", choices=BACKENDS, default=BACKENDS[0])
    parser.add_argument(
        "--cudagraph-mode", choices=CUDAGRAPH_MODES, default=CUDAGRAPH_MODES[0]
    )
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--model-dir", help="default: a new temporary folder")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.host_info:
        print(HOST_PREFIX + json.dumps(host_info()), flush=True)
        return 0
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="capture-guard-engine-")
    write_engine_model(model_dir, args.tp)
    result = run_engine(model_dir, args.backend, args.cudagraph_mode, args.tp)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
