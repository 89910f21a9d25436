# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Full CUDA-graph capture must leave the host metadata it was given unchanged.

During full-graph capture the model runner builds one
``CommonAttentionMetadata`` over its persistent buffers and gives the metadata
builder of every KV-cache group a shallow copy of it, one after the other. A
host tensor or array that one builder's ``build_for_cudagraph_capture`` writes
in place is what every later builder reads: ``RocmAttentionMetadataBuilder``
zeroed ``query_start_loc_cpu`` there, and MiniMax-M3's indexer, which builds
next, split the batch into decodes of length 0 (#51585). Nothing in the
invariant is specific to a backend, so this test checks it for every
registered backend whose builder can be built here, on capture-shaped batches:

* the values of every host tensor and array that the shared metadata held
  before the call are unchanged after it;
* writes to device tensors are allowed (the ROCm builder zeroes the device
  ``query_start_loc``, #25985; the graph reads device buffers by address and
  the runner rewrites them before every replay) and are listed;
* rebinding a field (FlexAttention's ``max_seq_len``) and filling a lazy cache
  that was ``None`` are allowed: no other builder holds the new object.

On a GPU, host values are the tensors in host memory and numpy arrays. On the
CPU platform every tensor is in host memory, so the metadata is laid out as the
GPU runner lays it out: the fields in ``DEVICE_FIELDS`` are the device buffers,
every other tensor or array is a host value with storage of its own.

A backend that cannot be built here (its module, its builder or its KV-cache
spec needs hardware or packages this host lacks) skips with the reason, and so
does one whose capture cannot run here at all.
"""

import dataclasses
import json
from copy import copy

import numpy as np
import pytest
import torch

from tests.v1.attention.utils import (
    BatchSpec,
    create_common_attn_metadata,
    create_standard_kv_cache_spec,
    create_vllm_config,
)
from vllm.config import set_current_vllm_config
from vllm.distributed import (
    cleanup_dist_env_and_memory,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.registry import (
    AttentionBackendEnum,
    MambaAttentionBackendEnum,
)

pytestmark = [
    # one world for the module, torn down by its own fixture
    pytest.mark.skip_global_cleanup,
]

BLOCK_SIZE = 128
HEAD_DIM = 128
NUM_HEADS = 4
LAYER = "model.layers.0.self_attn.attn"
PAD_SLOT_ID = -1

#: The fields the runner keeps in device memory (the CPU platform's layout of
#: them; on a GPU the device decides).
DEVICE_FIELDS = frozenset(
    {
        "query_start_loc",
        "seq_lens",
        "block_table_tensor",
        "slot_mapping",
        "positions",
        "logits_indices_padded",
        "encoder_seq_lens",
        "dcp_local_seq_lens",
    }
)


@dataclasses.dataclass(frozen=True)
class CaptureBatch:
    """A batch as the runner captures it: ``seq_lens``/``query_lens`` of the
    real requests, padded to the graph's size with ``pad`` empty requests and
    their tokens (``query_len`` each in a uniform batch, else one), whose slots
    hold ``PAD_SLOT_ID``."""

    name: str
    seq_lens: list[int]
    query_lens: list[int]
    pad: int = 0

    @property
    def uniform(self) -> bool:
        return len(set(self.query_lens)) == 1

    @property
    def pad_tokens(self) -> int:
        return self.pad * (self.query_lens[0] if self.uniform else 1)


#: Uniform single-token decodes at a few sizes, two of them padded.
DECODE_BATCHES = [
    CaptureBatch("decode_1", [64], [1]),
    CaptureBatch("decode_3_pad_4", [64, 200, 17], [1] * 3, pad=1),
    CaptureBatch("decode_7_pad_8", [40] * 7, [1] * 7, pad=1),
    CaptureBatch("decode_16", [300] * 16, [1] * 16),
]
#: Prefills and decodes together, for backends that capture them in full
#: graphs (``AttentionCGSupport.ALWAYS``).
MIXED_BATCHES = [
    CaptureBatch("mixed_4", [5, 64, 40, 17], [5, 1, 3, 1]),
    CaptureBatch("mixed_3_pad_4", [70, 33, 129], [7, 1, 1], pad=1),
]

# A two-layer MiniMax-M3 (layer 0 full attention, layer 1 sparse with the
# lightning indexer, whose builder read the host offsets in #51585). Only its
# config is needed: no weights, no Hub access.
MINIMAX_M3_CONFIG = {
    "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
    "model_type": "minimax_m3_vl",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "minimax_m3_text",
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 128,
        "dense_intermediate_size": 256,
        "shared_intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 4096,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "moe_layer_freq": [0, 1],
        "sparse_attention_config": {
            "use_sparse_attention": True,
            "sparse_index_dim": HEAD_DIM,
            "sparse_num_index_heads": 4,
            "sparse_topk_blocks": 4,
            "sparse_block_size": BLOCK_SIZE,
            "sparse_disable_index_value": [0, 1],
            "sparse_score_type": "max",
            "sparse_init_block": 0,
            "sparse_local_block": 1,
            "sparse_attention_freq": [0, 1],
        },
    },
}

REGISTERED = [
    pytest.param(member, id=member.name) for member in AttentionBackendEnum
] + [
    pytest.param(member, id=f"mamba-{member.name}")
    for member in MambaAttentionBackendEnum
]


@pytest.fixture(scope="module")
def base_config(tmp_path_factory):
    """The tiny MiniMax-M3's VllmConfig, with a world of one."""
    path = tmp_path_factory.mktemp("minimax_m3")
    (path / "config.json").write_text(json.dumps(MINIMAX_M3_CONFIG))
    config = create_vllm_config(
        model_name=str(path), block_size=BLOCK_SIZE, max_model_len=4096
    )
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{path / 'dist_init'}",
            local_rank=0,
            backend=current_platform.dist_backend,
        )
        initialize_model_parallel(1, 1)
        yield config
        cleanup_dist_env_and_memory()


@pytest.fixture
def vllm_config(base_config):
    """A private copy for one backend: what its layer registers or changes
    reaches no other backend."""
    config = copy(base_config)
    config.cache_config = copy(base_config.cache_config)
    config.compilation_config = copy(base_config.compilation_config)
    config.compilation_config.static_forward_context = {}
    with set_current_vllm_config(config):
        yield config


@pytest.fixture
def device() -> torch.device:
    return torch.device(current_platform.device_type)


def _attention_layer(backend, vllm_config):
    """The layer a model would have for ``backend`` (an MLA one for MLA
    backends); it registers itself in the config's forward context, where
    some builders look it up."""
    from vllm.model_executor.layers.attention import Attention, MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    if not backend.is_mla():
        return Attention(
            num_heads=NUM_HEADS,
            head_size=HEAD_DIM,
            scale=HEAD_DIM**-0.5,
            num_kv_heads=1,
            cache_config=vllm_config.cache_config,
            prefix=LAYER,
            attn_backend=backend,
        )
    nope, rope, v_dim, rank = 64, 64, 64, 128
    kv_b_proj = ColumnParallelLinear(
        rank,
        NUM_HEADS * (nope + v_dim),
        bias=False,
        params_dtype=vllm_config.model_config.dtype,
        prefix=f"{LAYER}.kv_b_proj",
    )
    return MLAAttention(
        num_heads=NUM_HEADS,
        scale=(nope + rope) ** -0.5,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v_dim,
        q_lora_rank=None,
        kv_lora_rank=rank,
        kv_b_proj=kv_b_proj,
        cache_config=vllm_config.cache_config,
        prefix=LAYER,
        attn_backend=backend,
        use_sparse=backend.is_sparse(),
    )


def _written_out_spec(backend, vllm_config):
    """The layer's KV-cache spec, for when the layer cannot be built here."""
    if not backend.is_mla():
        return create_standard_kv_cache_spec(vllm_config)
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=128 + 64,  # kv_lora_rank + qk_rope_head_dim, as the layer's
        dtype=vllm_config.model_config.dtype,
    )


def _mamba_spec(member, vllm_config):
    from vllm.v1.kv_cache_interface import MambaSpec

    kwargs = dict(
        block_size=vllm_config.model_config.max_model_len,
        shapes=((3, 64), (4, 16, 16)),
        dtypes=(torch.bfloat16, torch.bfloat16),
    )
    if "mamba_type" in {f.name for f in dataclasses.fields(MambaSpec)}:
        kwargs["mamba_type"] = member
    return MambaSpec(**kwargs)


def _build(member, vllm_config, device):
    """``member``'s builder and its CUDA-graph support, or skip with why it
    cannot be built here."""
    name = member.name
    try:
        backend = member.get_class()
        builder_cls = backend.get_builder_cls()
    except Exception as e:
        pytest.skip(f"{name}: cannot be imported here: {type(e).__name__}: {e}")
    layer_problem = None
    if isinstance(member, MambaAttentionBackendEnum):
        spec = _mamba_spec(member, vllm_config)
    else:
        try:
            layer = _attention_layer(backend, vllm_config)
            spec = layer.get_kv_cache_spec(vllm_config)
        except Exception as e:
            layer_problem = f"{type(e).__name__}: {e}"
            spec = _written_out_spec(backend, vllm_config)
    try:
        builder = builder_cls(spec, [LAYER], vllm_config, device)
    except Exception as e:
        why = f"{name}: {builder_cls.__name__} cannot be built here: "
        why += f"{type(e).__name__}: {e}"
        if layer_problem:
            why += f" (its attention layer could not be built either: {layer_problem})"
        pytest.skip(why)
    return builder, builder_cls.get_cudagraph_support(vllm_config, spec)


def _is_host(name: str, value, device: torch.device) -> bool:
    if isinstance(value, np.ndarray):
        return True
    if device.type != "cpu":
        return value.device.type == "cpu"
    return name not in DEVICE_FIELDS


def _shared_metadata(batch: CaptureBatch, device: torch.device):
    """The metadata the runner shares between the groups' builders for
    ``batch``: padded requests have empty queries, their tokens
    ``PAD_SLOT_ID``; host fields have storage of their own."""
    spec = BatchSpec(
        seq_lens=batch.seq_lens + [0] * batch.pad,
        query_lens=batch.query_lens + [0] * batch.pad,
    )
    common = create_common_attn_metadata(
        spec, BLOCK_SIZE, device, arange_block_indices=True
    )
    num_tokens = common.num_actual_tokens + batch.pad_tokens
    slots = torch.full(
        (num_tokens,), PAD_SLOT_ID, dtype=common.slot_mapping.dtype, device=device
    )
    slots[: common.num_actual_tokens] = common.slot_mapping
    changes = dict(num_actual_tokens=num_tokens, slot_mapping=slots)
    fields = {f.name for f in dataclasses.fields(common) if f.init}
    if "is_prefilling" in fields:
        # the runner sets it for every batch, in host memory
        changes["is_prefilling"] = torch.tensor(
            [q > 1 and not batch.uniform for q in spec.query_lens]
        )
    common = dataclasses.replace(common, **changes)
    own = {
        f: v.copy() if isinstance(v, np.ndarray) else v.clone()
        for f in fields
        if isinstance(v := getattr(common, f), (torch.Tensor, np.ndarray))
        and _is_host(f, v, device)
    }
    return dataclasses.replace(common, **own)


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and a.tobytes() == b.tobytes()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # bit for bit, so that NaN equals NaN
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    return torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _values(v) -> list:
    if isinstance(v, np.ndarray):
        return v.reshape(-1).tolist()
    return v.detach().cpu().reshape(-1).tolist()


def _capture(builder, batch: CaptureBatch, device: torch.device):
    """``(host writes, device writes, error)`` of one capture on one shared
    metadata: ``{field: (before, after)}`` for each tensor or array whose
    values the call changed."""
    common = _shared_metadata(batch, device)
    held = []
    for f in dataclasses.fields(common):
        value = getattr(common, f.name)
        if isinstance(value, torch.Tensor):
            held.append((f.name, value, value.detach().clone()))
        elif isinstance(value, np.ndarray):
            held.append((f.name, value, value.copy()))
    error = None
    try:
        builder.build_for_cudagraph_capture(common)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    host, dev = {}, {}
    for name, value, before in held:
        if not _same(value, before):
            side = host if _is_host(name, value, device) else dev
            side[name] = (_values(before), _values(value))
    return host, dev, error


@pytest.mark.parametrize("member", REGISTERED)
def test_capture_keeps_host_metadata(member, vllm_config, device, request):
    builder, support = _build(member, vllm_config, device)
    # what it built and found, for a report (junit properties)
    record = request.node.user_properties.append
    record(("builder", type(builder).__name__))
    record(("cudagraph_support", support.name))
    if support == AttentionCGSupport.NEVER:
        pytest.skip(f"{member.name}: never captured in a full graph ({support})")
    batches = list(DECODE_BATCHES)
    if support == AttentionCGSupport.ALWAYS:
        batches += MIXED_BATCHES
    host_writes: dict[str, dict] = {}
    device_writes: dict[str, list[str]] = {}
    errors: dict[str, str] = {}
    for batch in batches:
        host, dev, error = _capture(builder, batch, device)
        for name, change in host.items():
            host_writes.setdefault(name, {})[batch.name] = change
        for name in dev:
            device_writes.setdefault(name, []).append(batch.name)
        if error:
            errors[batch.name] = error
    record(("host_writes", ",".join(sorted(host_writes))))
    record(("device_writes", ",".join(sorted(device_writes))))
    if device_writes:
        print(f"{member.name}: device writes (allowed): {device_writes}")
    assert not host_writes, (
        f"{member.name}: {type(builder).__name__}.build_for_cudagraph_capture "
        "changed host values of the shared CommonAttentionMetadata, which later "
        "builders read: "
        + "; ".join(
            f"{name} " + ", ".join(f"{b}: {x} -> {y}" for b, (x, y) in seen.items())
            for name, seen in host_writes.items()
        )
    )
    if len(errors) == len(batches):
        pytest.skip(
            f"{member.name}: its capture cannot run here: {next(iter(errors.values()))}"
        )
