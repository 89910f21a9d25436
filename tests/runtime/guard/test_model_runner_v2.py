# SPDX-License-Identifier: Apache-2.0
"""The guard under Model Runner V2 (``vllm/v1/worker/gpu/``), on its own code.

``check`` drives vLLM's real Model Runner V2 (``tools.harness.v2``): the
runner a worker makes, its KV cache planned by vLLM's engine core (one
KV-cache group holding MiniMax-M3's attention layer and its indexer cache,
as vLLM groups them), and its own ``capture_model()`` at every FULL
descriptor of its ``CudaGraphManager``, warm-up and capture, each through
``build_attn_metadata(..., for_cudagraph_capture=True)``: one
``CommonAttentionMetadata`` per KV-cache group, handed to every attention
group's builder in turn. Here it runs with Model Runner V2 chosen as an
operator chooses it (``VLLM_USE_V2_MODEL_RUNNER=1``) where the release still
has the V1 runner, and as it is on 0.34.0, its only runner.

Whether the release is affected is decided by running vLLM's own ROCm
capture in this process, where the guard never loads (``zeroes_cpu_offsets``
in ``tests/conftest.py``), never by the guard.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import guard_lines, run_cli, run_snippet
from vllm_capture_guard.tools.harness import runners

INDEXER = "vllm/models/minimax_m3/common/indexer.py:"
ASSERTION = "assert decode_query_len > 0"
#: Model Runner V2 chosen where the release also has the V1 runner (0.34.0
#: raises on =0 and warns on =1: left unset there).
V2 = {"VLLM_USE_V2_MODEL_RUNNER": "1" if runners.present(runners.V1) else None}

pytestmark = pytest.mark.skipif(
    not runners.present(runners.V2), reason="this vLLM has no Model Runner V2"
)


def _check(mode: str) -> tuple[dict, int, str]:
    """``check --trace -v`` on Model Runner V2 with the guard ``mode``: its
    JSON, exit status and log (the guard's lines among vLLM's)."""
    proc = run_cli("check", "--trace", "-v", VLLM_CAPTURE_GUARD=mode, **V2)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout), proc.returncode, proc.stderr


@pytest.fixture(scope="module")
def unguarded() -> tuple[dict, int, str]:
    return _check("off")


@pytest.fixture(scope="module")
def guarded() -> tuple[dict, int, str]:
    return _check("on")


def _runs(result: dict, backend: str = "ROCM_ATTN") -> list[dict]:
    return [r for r in result["runs"] if r["backend"] == backend]


def test_check_drives_model_runner_v2_at_its_own_sizes(guarded):
    result, _, _ = guarded
    assert result["runner"].startswith("Model Runner V2 "), result["runner"]
    assert result["stops_at_first_failure"] is True
    # the runner's CudaGraphManager holds vLLM's derived sizes, largest first
    from vllm_capture_guard.tools import harness

    config = harness.make_vllm_config(0, graphs=True)
    derived = sorted(config.compilation_config.cudagraph_capture_sizes, reverse=True)
    assert result["sizes"] == derived and derived[0] == 512, result["sizes"]
    assert [r["num_tokens"] for r in _runs(result)] == derived
    assert any("Model Runner V2" in line for line in result["set_up"])


def test_unguarded_it_fails_as_vllm_fails(unguarded, zeroes_cpu_offsets):
    """Off: where the release's ROCm capture zeroes the host offsets, the
    indexer's assertion stops the runner's capture at its first size, as it
    stops vLLM's start-up; elsewhere every size passes on its own."""
    result, rc, _ = unguarded
    runs = _runs(result)
    if zeroes_cpu_offsets:
        assert rc == 1
        (run,) = runs  # Model Runner V2 stops at the first failure
        assert not run["ok"] and run["num_tokens"] == result["sizes"][0]
        assert run["error"].startswith("AssertionError")
        assert run["error_site"].startswith(INDEXER)
        assert run["error_line"] == ASSERTION
        assert run["query_start_loc_cpu_after"] == [0] * len(
            run["query_start_loc_cpu_before"]
        )
    else:
        assert len(runs) == len(result["sizes"]) and all(r["ok"] for r in runs)


def test_guarded_the_indexer_reads_the_offsets_the_batch_had(guarded):
    """On: every size of the runner's own capture passes, the shared host
    offsets (a numpy view of the runner's dummy batch) hold the batch's
    values after every builder, and the indexer computes the uniform query
    length from them."""
    result, rc, _ = guarded
    assert rc == 0 and result["ok"], result["checks"]
    runs = _runs(result)
    assert len(runs) == len(result["sizes"])
    for run in runs:
        assert run["ok"], (run["num_tokens"], run["error"])
        assert run["decode_query_len"] == 1, run["num_tokens"]
        assert run["query_start_loc_cpu_after"] == run["query_start_loc_cpu_before"]
        # the device offsets are zeroed, as 0.29.0's capture zeroes them
        assert set(run["query_start_loc_after"]) == {0}, run["num_tokens"]


def test_the_guard_says_what_the_real_capture_wrote(guarded, zeroes_cpu_offsets):
    _, _, log = guarded
    lines = guard_lines(log)
    wrote = "RocmAttentionMetadataBuilder's capture wrote query_start_loc_cpu"
    if zeroes_cpu_offsets:
        assert any(wrote in line for line in lines), lines
    else:
        assert not any(wrote in line for line in lines), lines
        assert any(
            "RocmAttentionMetadataBuilder's capture, watched: it wrote no shared"
            in line
            for line in lines
        ), lines
    watched = "MiniMaxM3IndexerTritonMetadataBuilder's capture, watched"
    assert any(watched in line for line in lines), lines


UBATCHES = """
import json, torch, vllm.plugins
vllm.plugins.load_general_plugins()
from vllm.config import set_current_vllm_config
from vllm.v1.worker.utils import AttentionGroup
from vllm_capture_guard.runtime import patching
from vllm_capture_guard.tools import harness
config = harness.make_vllm_config(0)
spec = harness.attention_builder("ROCM_ATTN", config).kv_cache_spec
group = AttentionGroup(harness.backend_class("ROCM_ATTN"), ["l"], spec, 0)
with set_current_vllm_config(config):
    group.create_metadata_builders(config, torch.device("cpu"),
                                   num_metadata_builders=2)
own = [vars(b).get("build_for_cudagraph_capture") for b in group.metadata_builders]
print(json.dumps({"builders": len(own),
                  "guarded": [patching.is_guarded(f) for f in own]}))
"""


def test_every_ubatch_builder_is_guarded():
    """Model Runner V2's micro-batching asks ``AttentionGroup`` for one
    builder per micro-batch (``num_metadata_builders``); each is guarded as
    vLLM makes it."""
    out, logs = run_snippet(UBATCHES, VLLM_CAPTURE_GUARD="on")
    assert out == {"builders": 2, "guarded": [True, True]}, logs[-2000:]


CHOICE = """
import json
import vllm.config.vllm as cv
from vllm_capture_guard.tools import harness
from vllm_capture_guard.tools.harness import runners
from vllm_capture_guard.tools.harness.models import DEEPSEEK_V4
V4 = "DeepseekV4ForCausalLM"
config = harness.make_vllm_config(0, family=DEEPSEEK_V4)
host = config.use_v2_model_runner
rocm = runners.choose(config).runner
kept = V4 in getattr(cv, "ROCM_DEFAULT_MRV1_ARCHITECTURES", ())  # 0.29 on
default = getattr(cv, "default_v2_model_runner_architectures", None)  # 0.28
if default is not None:
    with runners._as_rocm():
        kept = kept or V4 not in default()
print(json.dumps({"host": host, "rocm": rocm, "kept_on_v1": kept}))
"""


@pytest.mark.skipif(
    not runners.present(runners.V1), reason="this vLLM has one GPU runner only"
)
def test_the_runner_is_the_one_vllm_chooses_on_rocm():
    """vLLM keeps some architectures on the V1 runner on ROCm only (0.28.0's
    default set for ROCm leaves DeepSeek-V4 out; 0.29.0 lists it among the
    architectures kept on V1 on ROCm); check judges the ROCm path, so the
    choice is read with the platform answering as ROCm, whatever this host is.
    Where vLLM keeps the model on V1 on ROCm, the choice is V1 even where
    this host's answer is Model Runner V2."""
    out, logs = run_snippet(CHOICE)
    if out["kept_on_v1"]:
        assert out["rocm"] == runners.V1, (out, logs[-2000:])
    else:
        assert out["rocm"] == (runners.V2 if out["host"] else runners.V1), out


def test_minimax_m3s_own_model_state_builds_metadata_as_the_default_one():
    """The drive makes its runner with the harness's model, so the runner's
    model state is vLLM's DefaultModelState. Where the release gives
    MiniMax-M3 a model state of its own (0.33.0 on, for its ROCm model), that
    one must build capture metadata as the default one does: it may not
    define prepare_attn or prepare_dummy_inputs of its own. If a release
    does, the drive no longer runs what MiniMax-M3 runs, and must make that
    model state."""
    import importlib
    import pkgutil

    from vllm_capture_guard.tools.support import module_exists

    if not module_exists("vllm.v1.worker.gpu.model_states.default"):
        pytest.skip("this vLLM's Model Runner V2 has no default model state")
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    package = importlib.import_module("vllm.models.minimax_m3")
    names = [
        m.name
        for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
        if m.name.rsplit(".", 1)[-1] == "model_state"
    ]
    states = []
    for name in names:
        module = importlib.import_module(name)
        states += [
            cls
            for cls in vars(module).values()
            if isinstance(cls, type)
            and issubclass(cls, DefaultModelState)
            and cls is not DefaultModelState
        ]
    for cls in states:
        for base in cls.__mro__[: cls.__mro__.index(DefaultModelState)]:
            own = set(vars(base)) & {"prepare_attn", "prepare_dummy_inputs"}
            assert not own, (cls, base, own)
