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

Each backend is built as the model it serves would build it: the real
attention layer of a tiny model of its family (the test writes each
``config.json``: no weights, no Hub), that layer's KV-cache spec, and the
KV-cache dtype the backend requires:

* MiniMax-M3 (full attention, and its lightning indexer in the second layer)
  for every backend that is not MLA, and for the Mamba registry;
* DeepSeek-V3 (``MLAAttention``) for the MLA backends that are not sparse;
* DeepSeek-V3.2 (MLA with its indexer) for the other sparse MLA backends;
* DeepSeek-V4 and V4.1 for the sparse MLA backends of their own packages,
  with the attention layer of that package that uses the backend.

On a GPU, host values are the tensors in host memory and numpy arrays. On the
CPU platform every tensor is in host memory, so the metadata is laid out as the
GPU runner lays it out: the fields in ``DEVICE_FIELDS`` are the device buffers,
every other tensor or array is a host value with storage of its own.

A backend that cannot be built here skips, naming the hardware, compiled
extension or package it needs; so does one whose capture cannot run here at
all, after its host values were checked.
"""

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
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
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import (
    cleanup_dist_env_and_memory,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.registry import (
    AttentionBackendEnum,
    MambaAttentionBackendEnum,
)

pytestmark = [
    # one world for the module, torn down by its own fixture
    pytest.mark.skip_global_cleanup,
]

HEAD_DIM = 128
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

# Tiny models, one per attention family. Only their configs are needed: no
# weights, no Hub access. What the layers and builders read is as released
# (head sizes, latent ranks, the indexers' sizes); the other widths are small.

# A two-layer MiniMax-M3 (layer 0 full attention, layer 1 sparse with the
# lightning indexer, whose builder read the host offsets in #51585).
MINIMAX_M3 = {
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
            "sparse_block_size": 128,
            "sparse_disable_index_value": [0, 1],
            "sparse_score_type": "max",
            "sparse_init_block": 0,
            "sparse_local_block": 1,
            "sparse_attention_freq": [0, 1],
        },
    },
}
# DeepSeek-V3's MLA: 576 = 512 latent + 64 rope per token.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "torch_dtype": "bfloat16",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
# DeepSeek-V3.2: V3's MLA with the lightning indexer (DeepSeek Sparse
# Attention), at the released indexer's sizes.
DEEPSEEK_V32 = {
    **DEEPSEEK_V3,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 2048,
    "index_n_heads": 64,
    "index_head_dim": 128,
}
# DeepSeek-V4: 512-wide heads (448 NoPE + 64 RoPE), one KV head; layer 0
# slides a window, layer 1 compresses by 4 (with the indexer), layer 2 by
# 128. The schedule is spelled both ways releases read it.
DEEPSEEK_V4 = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "torch_dtype": "bfloat16",
    "vocab_size": 1024,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_groups": 8,
    "o_lora_rank": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    "compress_rates": {
        "compressed_sparse_attention": 4,
        "heavily_compressed_attention": 128,
    },
    "compress_ratios": [0, 4, 128],
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "sliding_window": 128,
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
}
# DeepSeek-V4.1: the text model under ``text_config``; its compressed layers
# compress by 2 and name the layer that holds their KV and indexer.
DEEPSEEK_V41 = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "torch_dtype": "bfloat16",
    "text_config": {
        **{
            k: v
            for k, v in DEEPSEEK_V4.items()
            if k
            not in (
                "architectures",
                "model_type",
                "torch_dtype",
                "layer_types",
                "compress_rates",
            )
        },
        "mlp_layer_types": ["sparse"] * 3,
        "compress_ratios": [0, 2, 2],
        "kv_source_layer_ids": [1],
        "index_source_layer_ids": [1],
    },
}


@dataclasses.dataclass(frozen=True)
class Family:
    """A tiny model, the block size its KV cache starts from, and the layer
    whose builder is tested."""

    config: dict
    block_size: int
    layer: str


FAMILIES = {
    "minimax_m3": Family(MINIMAX_M3, 128, "model.layers.0.self_attn.attn"),
    "deepseek_v3": Family(DEEPSEEK_V3, 64, "model.layers.0.self_attn.attn"),
    "deepseek_v32": Family(DEEPSEEK_V32, 64, "model.layers.0.self_attn.attn"),
    "deepseek_v4": Family(DEEPSEEK_V4, 256, "model.layers.1.self_attn"),
    "deepseek_v41": Family(DEEPSEEK_V41, 256, "model.layers.1.self_attn"),
}
#: The packages whose sparse MLA backends serve their own model only, and
#: where they keep each platform's attention layer.
V4_PACKAGES = {
    "deepseek_v41": "vllm.models.deepseek_v41",
    "deepseek_v4": "vllm.models.deepseek_v4",
}
V4_LAYER_MODULES = (
    "nvidia.flashmla",
    "nvidia.flashinfer_sparse",
    "nvidia.flash_mla_mega_attn",
    "amd.rocm",
)

REGISTERED = [
    pytest.param(member, id=member.name) for member in AttentionBackendEnum
] + [
    pytest.param(member, id=f"mamba-{member.name}")
    for member in MambaAttentionBackendEnum
]


@pytest.fixture(scope="module")
def family_config(tmp_path_factory):
    """Each family's VllmConfig, made on first use; with a world of one."""
    made: dict[str, VllmConfig] = {}

    def get(family: str) -> VllmConfig:
        if family not in made:
            path = tmp_path_factory.mktemp(family)
            (path / "config.json").write_text(json.dumps(FAMILIES[family].config))
            made[family] = create_vllm_config(
                model_name=str(path),
                block_size=FAMILIES[family].block_size,
                max_model_len=4096,
            )
        return made[family]

    first = get("minimax_m3")
    with set_current_vllm_config(first):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{tmp_path_factory.mktemp('dist')}/init",
            local_rank=0,
            backend=current_platform.dist_backend,
        )
        initialize_model_parallel(1, 1)
        yield get
        cleanup_dist_env_and_memory()


@pytest.fixture
def device() -> torch.device:
    return torch.device(current_platform.device_type)


def _family(member, backend) -> str:
    """The family whose model serves ``backend``."""
    if isinstance(member, MambaAttentionBackendEnum) or not backend.is_mla():
        return "minimax_m3"
    if not backend.is_sparse():
        return "deepseek_v3"
    for family, package in V4_PACKAGES.items():
        if backend.__module__.startswith(package + "."):
            return family
    return "deepseek_v32"


def _kv_cache_dtype(backend) -> str:
    """``auto``, or the first KV-cache dtype of a backend that requires
    another (an FP8 one)."""
    declared = list(getattr(backend, "supported_kv_cache_dtypes", None) or [])
    if not declared or backend.supports_kv_cache_dtype("auto"):
        return "auto"
    return str(declared[0])


def _block_size(backend, size: int) -> int:
    """``size`` if the backend's kernels take it, else a size they take."""
    sizes = backend.get_supported_kernel_block_sizes()
    for s in sizes:
        if s == size or (not isinstance(s, int) and size % s.base == 0):
            return size
    return next((s for s in sizes if isinstance(s, int)), size)


def _private_config(base, backend, family: str):
    """A copy of the family's config for one backend: what its layer registers
    or changes reaches no other backend."""
    config = copy(base)
    config.cache_config = copy(base.cache_config)
    config.cache_config.cache_dtype = _kv_cache_dtype(backend)
    config.cache_config.block_size = _block_size(backend, FAMILIES[family].block_size)
    config.attention_config = copy(base.attention_config)
    config.compilation_config = copy(base.compilation_config)
    config.compilation_config.static_forward_context = {}
    return config


def _given(fn, **kwargs):
    """The keyword arguments that ``fn`` takes."""
    names = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in names}


def _mla_prefill_backend(vllm_config):
    """The MLA layers' dense prefill: the platform's; where none of the
    platform's can be imported here, vLLM's CPU one, set as a user sets it
    (the decode-only capture never runs a prefill)."""
    try:
        from vllm.v1.attention.backends.mla.prefill.registry import (
            MLAPrefillBackendEnum,
        )
        from vllm.v1.attention.backends.mla.prefill.selector import (
            get_mla_prefill_backend,
        )
    except ImportError:
        return None
    try:
        return get_mla_prefill_backend(vllm_config)
    except Exception:
        cpu = getattr(MLAPrefillBackendEnum, "CPU", None)
        if cpu is None:
            raise
        vllm_config.attention_config.mla_prefill_backend = cpu
        return get_mla_prefill_backend(vllm_config)


def _topk_buffer(vllm_config, device):
    """The model's top-k indices buffer, shared by its sparse layers."""
    rows = vllm_config.scheduler_config.max_num_batched_tokens
    topk = vllm_config.model_config.hf_text_config.index_topk
    return torch.empty((rows, topk), dtype=torch.int32, device=device)


def _v4_layer_class(backend, package: str):
    """The attention layer class of ``package`` whose backend is ``backend``."""
    base = importlib.import_module(f"{package}.attention").DeepseekV4Attention
    problem: Exception | None = None
    for name in (backend.__module__, *(f"{package}.{m}" for m in V4_LAYER_MODULES)):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            module = importlib.import_module(name)
        except Exception as e:  # a platform's module this host cannot import
            problem = problem or e
            continue
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, base)
                and obj.__dict__.get("backend_cls") is backend
            ):
                return obj
    if problem is not None:
        raise problem
    raise LookupError(f"no layer of {package} uses {backend.__name__}")


def _layer(backend, family: str, vllm_config, device):
    """The layer ``family``'s model has for ``backend``; it registers itself in
    the config's forward context, where some builders look it up."""
    from vllm.model_executor.layers.attention import Attention, MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    layer = FAMILIES[family].layer
    hf = vllm_config.model_config.hf_text_config
    if family == "minimax_m3":
        return Attention(
            num_heads=hf.num_attention_heads,
            head_size=HEAD_DIM,
            scale=HEAD_DIM**-0.5,
            num_kv_heads=hf.num_key_value_heads,
            cache_config=vllm_config.cache_config,
            prefix=layer,
            attn_backend=backend,
        )
    prefill = _mla_prefill_backend(vllm_config)
    prefix = layer.removesuffix(".attn")
    if family == "deepseek_v3":
        kv_b_proj = ColumnParallelLinear(
            hf.kv_lora_rank,
            hf.num_attention_heads * (hf.qk_nope_head_dim + hf.v_head_dim),
            bias=False,
            params_dtype=vllm_config.model_config.dtype,
            prefix=f"{prefix}.kv_b_proj",
        )
        kwargs = _given(
            MLAAttention.__init__,
            num_heads=hf.num_attention_heads,
            scale=(hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5,
            qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim,
            v_head_dim=hf.v_head_dim,
            q_lora_rank=hf.q_lora_rank,
            kv_lora_rank=hf.kv_lora_rank,
            kv_b_proj=kv_b_proj,
            cache_config=vllm_config.cache_config,
            prefix=layer,
            attn_backend=backend,
            prefill_backend_cls=prefill,
        )
        return MLAAttention(**kwargs)
    topk = _topk_buffer(vllm_config, device)
    if family == "deepseek_v32":
        from vllm.models.deepseek_v32.attention import DeepseekV32Attention

        kwargs = _given(
            DeepseekV32Attention.__init__,
            topk_indices_buffer=topk,
            attn_backend=backend,
        )
        return DeepseekV32Attention(vllm_config, hf, prefix, **kwargs)
    cls = _v4_layer_class(backend, V4_PACKAGES[family])
    return cls(vllm_config, layer, **_given(cls.__init__, topk_indices_buffer=topk))


def _written_out_spec(family: str, vllm_config):
    """The layer's KV-cache spec, for when the layer cannot be built here."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if family == "minimax_m3":
        return create_standard_kv_cache_spec(vllm_config)
    hf = vllm_config.model_config.hf_text_config
    head_size = getattr(hf, "kv_lora_rank", 0) + hf.qk_rope_head_dim
    if family in V4_PACKAGES:
        head_size = hf.head_dim
    return MLAAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=1,
        head_size=head_size,
        dtype=vllm_config.model_config.dtype,
    )


def _runner_spec(backend, spec):
    """The layer's spec as the runner hands it to the backend's builder."""
    try:
        from vllm.v1.worker.utils import customize_attention_spec
    except ImportError:
        customize = getattr(backend, "customize_spec", None)
        return customize(spec) if customize else spec
    return customize_attention_spec(backend, spec)


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


def _cannot_run_here(name: str, why: str):
    """Skip, with the error that names what the backend needs here."""
    if not HAS_TRITON:  # vLLM's stand-in for Triton fails in other ways
        why += " (vLLM has Triton off on this host)"
    pytest.skip(f"{name}: {why}")


def _build(member, family_config, device):
    """``member``'s builder, its family, its KV-cache block size and its
    CUDA-graph support, or skip with why it cannot be built here."""
    name = member.name
    try:
        backend = member.get_class()
        builder_cls = backend.get_builder_cls()
    except Exception as e:
        _cannot_run_here(name, f"cannot be imported here: {type(e).__name__}: {e}")
    family = _family(member, backend)
    vllm_config = _private_config(family_config(family), backend, family)
    layer_name, layer_problem = FAMILIES[family].layer, None
    if isinstance(member, MambaAttentionBackendEnum):
        spec = _mamba_spec(member, vllm_config)
    else:
        try:
            with set_current_vllm_config(vllm_config):
                layer = _layer(backend, family, vllm_config, device)
                spec = layer.get_kv_cache_spec(vllm_config)
            context = vllm_config.compilation_config.static_forward_context
            layer_name = next((k for k, v in context.items() if v is layer), layer_name)
        except Exception as e:
            layer_problem = f"{type(e).__name__}: {e}"
            vllm_config.compilation_config.static_forward_context.clear()
            spec = _written_out_spec(family, vllm_config)
        spec = _runner_spec(backend, spec)
    with set_current_vllm_config(vllm_config):
        try:
            builder = builder_cls(spec, [layer_name], vllm_config, device)
        except Exception as e:
            why = f"{builder_cls.__name__} cannot be built here: "
            why += f"{type(e).__name__}: {e}"
            if layer_problem:  # what stopped the layer stops its builder
                why = f"its layer cannot be built here: {layer_problem}; nor {why}"
            _cannot_run_here(name, why)
        support = builder_cls.get_cudagraph_support(vllm_config, spec)
    return builder, family, vllm_config.cache_config.block_size, support


def _is_host(name: str, value, device: torch.device) -> bool:
    if isinstance(value, np.ndarray):
        return True
    if device.type != "cpu":
        return value.device.type == "cpu"
    return name not in DEVICE_FIELDS


def _shared_metadata(batch: CaptureBatch, block_size: int, device: torch.device):
    """The metadata the runner shares between the groups' builders for
    ``batch``: padded requests have empty queries, their tokens
    ``PAD_SLOT_ID``; host fields have storage of their own."""
    spec = BatchSpec(
        seq_lens=batch.seq_lens + [0] * batch.pad,
        query_lens=batch.query_lens + [0] * batch.pad,
    )
    common = create_common_attn_metadata(
        spec, block_size, device, arange_block_indices=True
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


def _capture(builder, batch: CaptureBatch, block_size: int, device: torch.device):
    """``(host writes, device writes, error)`` of one capture on one shared
    metadata: ``{field: (before, after)}`` for each tensor or array whose
    values the call changed."""
    common = _shared_metadata(batch, block_size, device)
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
    host: dict[str, tuple[list, list]] = {}
    dev: dict[str, tuple[list, list]] = {}
    for name, value, before in held:
        if not _same(value, before):
            side = host if _is_host(name, value, device) else dev
            side[name] = (_values(before), _values(value))
    return host, dev, error


@contextlib.contextmanager
def _workspace(device: torch.device):
    """The workspace manager, set up as the GPU worker sets it up before it
    makes the model (sparse MLA layers reserve their scratch there)."""
    try:
        from vllm.v1.worker import workspace
    except ImportError:
        yield
        return
    if workspace.is_workspace_manager_initialized():
        yield
        return
    workspace.init_workspace_manager(device)
    try:
        yield
    finally:
        workspace.reset_workspace_manager()


@pytest.mark.parametrize("member", REGISTERED)
def test_capture_keeps_host_metadata(member, family_config, device, request):
    with _workspace(device):
        builder, family, block_size, support = _build(member, family_config, device)
        # what it built and found, for a report (junit properties)
        record = request.node.user_properties.append
        record(("builder", type(builder).__name__))
        record(("family", family))
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
            host, dev, error = _capture(builder, batch, block_size, device)
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
        error = next(iter(errors.values()))
        _cannot_run_here(member.name, f"its capture cannot run here: {error}")
