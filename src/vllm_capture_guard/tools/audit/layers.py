# SPDX-License-Identifier: Apache-2.0
"""Each backend's real layer, from the model its family serves.

Which family serves a backend is read from the installed code, never from a
list of names:

* the Mamba registry, and every backend that is not MLA: the MiniMax-M3
  (full attention, MiniMax-M3's indexer and Mamba beside it);
* an MLA backend that is not sparse: DeepSeek-V3 (``MLAAttention``);
* a sparse MLA backend whose class lives in vLLM's DeepSeek-V4 (or V4.1)
  package: that model, with the attention layer class of that package whose
  ``backend_cls`` is the backend;
* any other sparse MLA backend: DeepSeek-V3.2 (its ``DeepseekV32Attention``,
  with the lightning indexer inside).

The layer registers itself in the config's forward context, as a model's
does (builders look it up there), and its KV-cache spec is what the runner
collects. Where the layer cannot be built on this host, the spec is written
out as that layer would publish it, and the reason is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
from collections.abc import Iterator
from copy import copy
from typing import Any

import torch

from vllm_capture_guard.tools.harness import ATTN_LAYER, HEAD_SIZE, describe
from vllm_capture_guard.tools.harness.models import (
    DEEPSEEK_V3,
    DEEPSEEK_V4,
    DEEPSEEK_V32,
    DEEPSEEK_V41,
    MINIMAX_M3,
)

MLA_LAYER = "model.layers.0.self_attn"
#: DeepSeek-V4's layer 1 compresses by 4 and has the indexer.
V4_LAYER = "model.layers.1.self_attn"
V4_PACKAGES = {
    DEEPSEEK_V41: "vllm.models.deepseek_v41",
    DEEPSEEK_V4: "vllm.models.deepseek_v4",
}
#: Where a DeepSeek-V4 package keeps its platforms' attention layer classes.
V4_LAYER_MODULES = (
    "nvidia.flashmla",
    "nvidia.flashinfer_sparse",
    "nvidia.flash_mla_mega_attn",
    "amd.rocm",
)
#: Block sizes tried, in turn, for one every backend of a group supports.
BLOCK_SIZES = (128, 64, 256, 32, 16, 1)


def is_mla(backend: Any) -> bool:
    return bool(getattr(backend, "is_mla", lambda: False)())


def is_sparse(backend: Any) -> bool:
    return bool(getattr(backend, "is_sparse", lambda: False)())


def v4_family(backend: Any) -> str | None:
    module = getattr(backend, "__module__", "")
    for family, package in V4_PACKAGES.items():
        if module == package or module.startswith(package + "."):
            return family
    return None


def family_of(backend: Any, mamba: bool) -> str:
    """The family whose model serves ``backend`` (see the module's text)."""
    if mamba or not is_mla(backend):
        return MINIMAX_M3
    if not is_sparse(backend):
        return DEEPSEEK_V3
    return v4_family(backend) or DEEPSEEK_V32


def kv_cache_dtype(backend: Any) -> str:
    """``auto`` where the backend takes it, else the first KV-cache dtype it
    declares (an FP8 one for backends that require FP8)."""
    supports = getattr(backend, "supports_kv_cache_dtype", None)
    declared = list(getattr(backend, "supported_kv_cache_dtypes", None) or [])
    if not declared or not callable(supports) or supports("auto"):
        return "auto"
    return str(declared[0])


def block_size(*backends: Any, default: int = 128) -> int:
    """A kernel block size every one of ``backends`` supports: the block
    size the runner gives their builders' specs."""
    for size in (default, *BLOCK_SIZES):
        if all(_kernel_takes(b, size) for b in backends):
            return size
    return default


def _kernel_takes(backend: Any, size: int) -> bool:
    sizes = getattr(backend, "get_supported_kernel_block_sizes", None)
    try:
        found = list(sizes()) if callable(sizes) else []
    except Exception:
        found = []
    if not found:
        return True
    for s in found:
        base = getattr(s, "base", None)
        if (size % base == 0) if base is not None else size == s:
            return True
    return False


@contextlib.contextmanager
def without_workspace() -> Iterator[None]:
    """vLLM's workspace manager hidden while a DeepSeek-V3 MLA layer and
    builder are made: Triton MLA sizes its scratch there with Triton's own
    helpers, which vLLM disables on a host without a GPU driver, and skips
    the sizing where no manager exists, as vLLM's own tests make it."""
    try:
        from vllm.v1.worker import workspace
    except ImportError:
        yield
        return
    held = getattr(workspace, "_manager", None)
    workspace._manager = None
    try:
        yield
    finally:
        workspace._manager = held


@dataclasses.dataclass
class Layer:
    """What a built layer publishes: its name and spec; ``problem``: why no
    layer could be built here (the spec is then written out)."""

    name: str
    spec: Any
    problem: str | None = None

    @property
    def source(self) -> str:
        if self.problem is None:
            return "layer"
        return f"written out (no layer here: {self.problem})"


def _kwargs(fn: Any, **given: Any) -> dict[str, Any]:
    """``given`` less the parameters ``fn`` does not name (releases differ;
    a ``**kwargs`` of ``fn`` may forward them where they do not belong)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in given.items() if k in params}


def _forget(vllm_config: Any, prefix: str) -> None:
    """A layer that failed half-way may have registered parts of itself."""
    ctx = vllm_config.compilation_config.static_forward_context
    for name in [n for n in ctx if n == prefix or n.startswith(prefix + ".")]:
        ctx.pop(name, None)


def prefill_backend(vllm_config: Any) -> Any:
    """The MLA dense-prefill backend: vLLM's own choice for this platform;
    where none of the platform's can be imported here (they need GPU
    extensions), vLLM's CPU one, set as a user sets it
    (``attention_config.mla_prefill_backend``) on this config only: the
    decode-only capture never runs a prefill. None where the release has
    no prefill backends of their own."""
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
        if cpu is None or not hasattr(
            vllm_config.attention_config, "mla_prefill_backend"
        ):
            return None
        vllm_config.attention_config = copy(vllm_config.attention_config)
        vllm_config.attention_config.mla_prefill_backend = cpu
        return get_mla_prefill_backend(vllm_config)


def attention_layer(backend: Any, vllm_config: Any) -> Any:
    from vllm.model_executor.layers.attention import Attention

    return Attention(
        num_heads=4,
        head_size=HEAD_SIZE,
        scale=HEAD_SIZE**-0.5,
        num_kv_heads=1,
        cache_config=vllm_config.cache_config,
        prefix=ATTN_LAYER,
        attn_backend=backend,
    )


def mla_layer(backend: Any, vllm_config: Any) -> Any:
    """DeepSeek-V3's ``MLAAttention``, with the model's dimensions."""
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    h = vllm_config.model_config.hf_text_config
    kv_b_proj = ColumnParallelLinear(
        h.kv_lora_rank,
        h.num_attention_heads * (h.qk_nope_head_dim + h.v_head_dim),
        bias=False,
        params_dtype=vllm_config.model_config.dtype,
        prefix=f"{MLA_LAYER}.kv_b_proj",
    )
    kwargs = _kwargs(
        MLAAttention.__init__,
        num_heads=h.num_attention_heads,
        scale=(h.qk_nope_head_dim + h.qk_rope_head_dim) ** -0.5,
        qk_nope_head_dim=h.qk_nope_head_dim,
        qk_rope_head_dim=h.qk_rope_head_dim,
        v_head_dim=h.v_head_dim,
        q_lora_rank=h.q_lora_rank,
        kv_lora_rank=h.kv_lora_rank,
        kv_b_proj=kv_b_proj,
        cache_config=vllm_config.cache_config,
        prefix=f"{MLA_LAYER}.attn",
        attn_backend=backend,
        use_sparse=False,
        prefill_backend_cls=prefill_backend(vllm_config),
    )
    return MLAAttention(**kwargs)


def topk_buffer(vllm_config: Any) -> Any:
    """The model's shared top-k indices buffer (one row per batched token)."""
    hf = vllm_config.model_config.hf_text_config
    rows = vllm_config.scheduler_config.max_num_batched_tokens
    return torch.empty((rows, hf.index_topk), dtype=torch.int32)


def sparse_mla_layer(backend: Any, vllm_config: Any) -> Any:
    """DeepSeek-V3.2's attention layer (MLA with its lightning indexer)."""
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention

    hf = vllm_config.model_config.hf_text_config
    kwargs = _kwargs(
        DeepseekV32Attention.__init__,
        topk_indices_buffer=topk_buffer(vllm_config),
        attn_backend=backend,
    )
    return DeepseekV32Attention(vllm_config, hf, MLA_LAYER, **kwargs)


def v4_layer_class(backend: Any, family: str) -> type:
    """The attention layer class of ``family``'s package whose
    ``backend_cls`` is ``backend``."""
    package = V4_PACKAGES[family]
    base = importlib.import_module(f"{package}.attention").DeepseekV4Attention
    problems = []
    for name in (backend.__module__, *(f"{package}.{m}" for m in V4_LAYER_MODULES)):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            module = importlib.import_module(name)
        except Exception as e:
            problems.append(describe(e))
            continue
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, base)
                and obj.__dict__.get("backend_cls") is backend
            ):
                return obj
    why = f"; {problems[0]}" if problems else ""
    raise LookupError(f"no layer of {package} has backend_cls {backend.__name__}{why}")


def v4_layer(backend: Any, family: str, vllm_config: Any) -> Any:
    cls = v4_layer_class(backend, family)
    kwargs = _kwargs(cls.__init__, topk_indices_buffer=topk_buffer(vllm_config))
    return cls(vllm_config, V4_LAYER, **kwargs)


def build_layer(backend: Any, family: str, vllm_config: Any) -> Layer:
    """``backend``'s layer of ``family``'s model, under ``vllm_config``."""
    from vllm.config import set_current_vllm_config

    if family != MINIMAX_M3:
        prefill_backend(vllm_config)
    with set_current_vllm_config(vllm_config):
        if family == MINIMAX_M3:
            layer, name = attention_layer(backend, vllm_config), ATTN_LAYER
        elif family == DEEPSEEK_V3:
            layer, name = mla_layer(backend, vllm_config), f"{MLA_LAYER}.attn"
        elif family == DEEPSEEK_V32:
            layer, name = sparse_mla_layer(backend, vllm_config), f"{MLA_LAYER}.attn"
        else:
            layer, name = v4_layer(backend, family, vllm_config), V4_LAYER
        ctx = vllm_config.compilation_config.static_forward_context
        name = next((k for k, v in ctx.items() if v is layer), name)
        return Layer(name, layer.get_kv_cache_spec(vllm_config))


def layer_name(family: str) -> str:
    if family == MINIMAX_M3:
        return ATTN_LAYER
    if family in (DEEPSEEK_V3, DEEPSEEK_V32):
        return f"{MLA_LAYER}.attn"
    return V4_LAYER


def written_out(backend: Any, family: str, vllm_config: Any) -> Any:
    """The spec ``family``'s layer would publish for ``backend``, written out,
    for when that layer cannot be built on this host."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    size = vllm_config.cache_config.block_size
    if family == MINIMAX_M3:
        return FullAttentionSpec(
            block_size=size, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16
        )
    hf = vllm_config.model_config.hf_text_config
    fields = {f.name for f in dataclasses.fields(MLAAttentionSpec)}
    extra: dict[str, Any] = {}
    if family in (DEEPSEEK_V3, DEEPSEEK_V32):
        head = hf.kv_lora_rank + hf.qk_rope_head_dim
    else:
        head = hf.head_dim
        ratios = getattr(hf, "compress_ratios", None) or [
            hf.compress_rates.get(t, 0) for t in hf.layer_types
        ]
        extra = {"tokens_per_state": max(1, ratios[1]), "model_version": "deepseek_v4"}
    return MLAAttentionSpec(
        block_size=size,
        num_kv_heads=1,
        head_size=head,
        dtype=torch.bfloat16,
        **{k: v for k, v in extra.items() if k in fields},
    )


def runner_spec(backend: Any, spec: Any, vllm_config: Any) -> Any:
    """The backend's adjustments the runner applies to a layer's spec."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        try:  # vLLM >= 0.33: the runner's own function
            from vllm.v1.worker.utils import customize_attention_spec
        except ImportError:
            names = {f.name for f in dataclasses.fields(spec)}
            if "indexes_kv_by_block_stride" in names and hasattr(
                backend, "indexes_kv_by_block_stride"
            ):
                spec = dataclasses.replace(
                    spec,
                    indexes_kv_by_block_stride=backend.indexes_kv_by_block_stride(),
                )
            if hasattr(backend, "customize_spec"):
                spec = backend.customize_spec(spec)
            return spec
        return customize_attention_spec(backend, spec)


def backend_layer(backend: Any, family: str, vllm_config: Any) -> Layer:
    """The layer and spec the runner collects, or the spec written out (with
    why no layer) where the layer cannot be built here."""
    try:
        found = build_layer(backend, family, vllm_config)
    except Exception as e:
        _forget(vllm_config, layer_name(family).rsplit(".attn", 1)[0])
        spec = written_out(backend, family, vllm_config)
        found = Layer(layer_name(family), spec, describe(e))
    found.spec = runner_spec(backend, found.spec, vllm_config)
    return found
