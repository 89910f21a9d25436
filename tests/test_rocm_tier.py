# SPDX-License-Identifier: Apache-2.0
"""CPU checks of what the ROCm tier (tests/rocm/) hands vLLM, so that a run on
an MI325 fails only for reasons a GPU can show.

* The tiny MiniMax-M3 of :mod:`tests.rocm.tiny_model` against the installed
  vLLM's own classes: the architecture resolves to the text-only model, the
  fused QKV + indexer projection builds, head sizes and block sizes are ones
  the MiniMax-M3 sparse backends accept, and the shapes divide for TP=4.
* The arguments :mod:`tests.rocm.engine_run` passes to ``vllm.LLM`` and
  ``SamplingParams`` exist in the installed vLLM and validate.
* The harness's own parts that need no GPU: ``--host-info`` (run for real:
  it decides "affected" by running vLLM's unguarded capture on the CPU),
  and the process-group kill on timeout.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import time
from pathlib import Path

import pytest

from tests.conftest import run_fresh
from tests.rocm import engine_run, test_engine_startup
from tests.rocm.tiny_model import engine_config, write_engine_model
from vllm_capture_guard.tools import harness as sc

TP_SIZES = (1, 4)
LAYER_LISTS = ("sparse_attention_freq", "sparse_disable_index_value")


def text_config(tp: int) -> dict:
    return engine_config(tp)["text_config"]


@pytest.fixture(scope="module", params=TP_SIZES, ids=lambda tp: f"tp{tp}")
def model_config(request, tmp_path_factory):
    from vllm.config import ModelConfig

    folder = tmp_path_factory.mktemp(f"engine-model-tp{request.param}")
    config = ModelConfig(
        model=str(write_engine_model(folder, request.param)),
        skip_tokenizer_init=True,
        max_model_len=1024,
        dtype="bfloat16",
    )
    return request.param, config


def test_architecture_is_the_text_model(model_config):
    tp, config = model_config
    assert config.architectures == ["MiniMaxM3SparseForCausalLM"]
    assert not config.is_multimodal_model
    cls, arch = config.registry.resolve_model_cls(
        config.architectures, model_config=config
    )
    assert (cls.__name__, arch) == ("MiniMaxM3SparseForCausalLM",) * 2
    text = config.hf_text_config
    if type(text).__name__ == "MiniMaxM3VLTextConfig":
        pytest.skip(
            "this vLLM reads MiniMax-M3's text config with transformers' "
            "MiniMaxM3VLTextConfig, whose keys differ (no sparse_attention_config "
            "nor moe_layer_freq); the ROCm tier's tiny model is written for vLLM's "
            "own MiniMaxM3TextConfig (0.27.0 to 0.33.0)"
        )
    assert type(text).__name__ == "MiniMaxM3TextConfig"
    for key, value in text_config(tp).items():
        if key != "model_type":
            assert getattr(text, key) == value, key


def fused_qkv_indexer(text: dict):
    """vLLM's fused q/k/v/index_q/index_k projection, as the sparse layer
    builds it (``MiniMaxM3SparseAttention.__init__``), in a world of one."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import (
        MinimaxM3QKVParallelLinearWithIndexer,
    )

    sparse = text["sparse_attention_config"]
    with set_current_vllm_config(sc.make_vllm_config()):
        return MinimaxM3QKVParallelLinearWithIndexer(
            text["hidden_size"],
            text["head_dim"],
            text["num_attention_heads"],
            text["num_key_value_heads"],
            sparse["sparse_num_index_heads"],
            sparse["sparse_index_dim"],
        )


@pytest.mark.parametrize("tp", TP_SIZES)
def test_sparse_layer_projection_builds(tp):
    text = text_config(tp)
    layer = fused_qkv_indexer(text)
    heads, kv, dim = (
        text[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")
    )
    assert layer.output_sizes == [heads * dim, kv * dim, kv * dim, kv * dim, dim]


def test_the_builder_scenario_config_could_not_build_the_model():
    """Why the engine needs its own config: the builder scenarios' tiny config
    has 1 KV head and 4 index heads, which this projection refuses."""
    with pytest.raises(AssertionError, match="total_num_index_heads"):
        fused_qkv_indexer(sc.TINY_MINIMAX_M3["text_config"])


@pytest.mark.parametrize("tp", TP_SIZES)
def test_sizes_the_sparse_backends_accept(tp):
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerBackend
    from vllm.models.minimax_m3.common.sparse_attention import MiniMaxM3SparseBackend

    text = text_config(tp)
    sparse = text["sparse_attention_config"]
    for backend in (MiniMaxM3SparseBackend, MiniMaxM3IndexerBackend):
        assert text["head_dim"] in backend.get_supported_head_sizes()
        assert sparse["sparse_index_dim"] in backend.get_supported_head_sizes()
        assert sparse["sparse_block_size"] in backend.get_supported_kernel_block_sizes()
    assert sparse["sparse_block_size"] == engine_run.BLOCK_SIZE


@pytest.mark.parametrize("tp", TP_SIZES)
def test_layer_layout_and_per_rank_shapes(tp):
    text = text_config(tp)
    sparse = text["sparse_attention_config"]
    n = text["num_hidden_layers"]
    assert len(text["moe_layer_freq"]) == n
    for key in LAYER_LISTS:
        assert len(sparse[key]) == n, key
    # Layer 0 dense (the backend under test captures first), layer 1 sparse.
    assert sparse["sparse_attention_freq"] == [0, 1]
    # Per rank, as the model code divides (amd/model.py, common/indexer.py):
    # one rank of the checkpoint at TP=4 has 16 query, 1 KV and 1 index head.
    heads, kv = text["num_attention_heads"], text["num_key_value_heads"]
    index_heads = sparse["sparse_num_index_heads"]
    assert heads % tp == 0 and heads // tp == 16
    assert kv % tp == 0 and kv // tp == 1
    assert index_heads == kv and max(1, index_heads // tp) == kv // tp
    assert text["num_local_experts"] >= tp
    for key in ("intermediate_size", "dense_intermediate_size"):
        assert text[key] % tp == 0 and text[key] // tp >= 128, key
    if tp == 4:  # the checkpoint's own head layout
        assert (heads, kv, index_heads) == (64, 4, 4)


def llm_init_parameters() -> set[str]:
    """``vllm.LLM.__init__``'s parameter names, read from its source: importing
    ``vllm.entrypoints.llm`` needs packages (llguidance, ...) that the CPU tier
    does not install."""
    origin = importlib.util.find_spec("vllm.entrypoints.llm").origin
    tree = ast.parse(Path(origin).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLM")
    init = next(
        n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    a = init.args
    return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs} - {"self"}


def test_engine_arguments_exist_and_validate(tmp_path):
    from vllm.config import AttentionConfig, CompilationConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    accepted = llm_init_parameters() | {f.name for f in dataclasses.fields(EngineArgs)}
    assert {"attention_config", "compilation_config", "model"} <= accepted
    for backend in engine_run.BACKENDS:
        for mode in engine_run.CUDAGRAPH_MODES:
            kwargs = engine_run.llm_kwargs(str(tmp_path), backend, mode, tp=4)
            assert not set(kwargs) - accepted, set(kwargs) - accepted
            assert AttentionConfig(**kwargs["attention_config"]).backend.name == backend
            compilation = CompilationConfig(**kwargs["compilation_config"])
            assert compilation.cudagraph_mode.name == mode
    params = SamplingParams(**engine_run.sampling_kwargs())
    assert params.max_tokens == engine_run.MAX_TOKENS and not params.detokenize
    for prompt in engine_run.PROMPTS:
        TokensPrompt(prompt_token_ids=prompt)
        assert all(0 < t < engine_run.VOCAB for t in prompt)


def test_host_info_on_this_host(vllm_version, zeroes_cpu_offsets):
    # a warm child: what the tier's own runner adds (a process group, killed
    # on timeout) is tested below; this is the host report
    proc = run_fresh(
        ["-m", "tests.rocm.engine_run", "--host-info"], VLLM_CAPTURE_GUARD="off"
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    info = test_engine_startup._last_json(out, engine_run.HOST_PREFIX)
    import torch

    assert info["hip"] == torch.version.hip
    if torch.version.hip is None:
        assert info["gpus"] == 0
    assert info["vllm"] == vllm_version
    assert info["entry_point"] == "vllm_capture_guard.runtime.plugin:register"
    # The same answer as vLLM's unguarded capture in this process.
    host = test_engine_startup.Host(info)
    assert host.affected is zeroes_cpu_offsets


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.once  # the tier's own runner; no vLLM in it
def test_run_kills_the_whole_process_group_on_timeout(tmp_path):
    """A hung engine (here: a process whose child sleeps) must not outlive
    its timeout, children included."""
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; "
        "time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(120)\n"
    )
    start = time.monotonic()
    status, out, timed_out = test_engine_startup._run(
        ["-c", code], dict(os.environ), timeout=3
    )
    assert timed_out and status != 0 and "started" in out
    assert time.monotonic() - start < 60
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(child)
