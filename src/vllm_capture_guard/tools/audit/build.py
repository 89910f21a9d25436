# SPDX-License-Identifier: Apache-2.0
"""Building what the audit runs: for a registered backend, its metadata
builder on the CPU, with a real ``VllmConfig`` (the harness's tiny
MiniMax-M3) and the KV-cache spec the backend's layers would publish (Mamba
spec for the Mamba registry, MLA spec for ``is_mla()`` backends, full
attention otherwise, then the backend's own adjustments, as the runner does);
and the *later* builders run after each audited capture. A backend that
cannot be built here raises :class:`Skip`, with the exception that stopped
it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from copy import copy
from typing import Any

import torch

from vllm_capture_guard.tools.audit.registry import Registered, find
from vllm_capture_guard.tools.harness import (
    ATTN_LAYER,
    BLOCK_SIZE,
    HEAD_SIZE,
    describe,
    indexer_builder,
    make_builder,
    make_vllm_config,
)

#: The later builder that is no registry entry: MiniMax-M3's indexer, whose
#: ``decode_query_len`` the seed bug broke.
MINIMAX_M3_INDEXER = "MINIMAX_M3_INDEXER"

#: KV-cache blocks the runner has allocated by capture time (FlexAttention's
#: builder reads it); the tiny config leaves it unset.
NUM_GPU_BLOCKS = 64


class Configs:
    """The audit's ``VllmConfig`` per number of speculative tokens: built once
    (the expensive part), then handed out as cheap private copies, so that
    what one backend's layer sets (a layer may change ``cache_config``, and
    registers itself in ``static_forward_context``) reaches neither the next
    backend nor the configs that the harness caches for other callers."""

    def __init__(self) -> None:
        self._made: dict[int, Any] = {}
        self.time_spent = 0.0

    def get(self, num_speculative_tokens: int) -> Any:
        """A private copy of the config (shallow, with its own cache config,
        compilation config and an empty ``static_forward_context``)."""
        if num_speculative_tokens not in self._made:
            t0 = time.perf_counter()
            self._made[num_speculative_tokens] = make_vllm_config(
                num_speculative_tokens
            )
            self.time_spent += time.perf_counter() - t0
        base = self._made[num_speculative_tokens]
        cfg = copy(base)
        cfg.cache_config = copy(base.cache_config)
        cfg.compilation_config = copy(base.compilation_config)
        cfg.compilation_config.static_forward_context = {}
        if cfg.cache_config.num_gpu_blocks is None:
            cfg.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
        return cfg


NUM_HEADS = 4
KV_LORA_RANK, QK_NOPE, QK_ROPE, V_HEAD = 128, 64, 64, 64


def _layer(backend: Any, vllm_config: Any) -> Any:
    """A real vLLM attention layer for ``backend`` (``MLAAttention`` if the
    backend is MLA, else ``Attention``), registered in the audit config's own
    ``static_forward_context`` as a model's layer is; some builders read it."""
    from vllm.config import set_current_vllm_config

    ctx = vllm_config.compilation_config.static_forward_context
    ctx.pop(ATTN_LAYER, None)
    with set_current_vllm_config(vllm_config):
        if _is_mla(backend):
            from vllm.model_executor.layers.attention import MLAAttention
            from vllm.model_executor.layers.linear import ColumnParallelLinear

            kv_b_proj = ColumnParallelLinear(
                KV_LORA_RANK,
                NUM_HEADS * (QK_NOPE + V_HEAD),
                bias=False,
                params_dtype=torch.bfloat16,
                prefix=f"{ATTN_LAYER}.kv_b_proj",
            )
            return MLAAttention(
                num_heads=NUM_HEADS,
                scale=(QK_NOPE + QK_ROPE) ** -0.5,
                qk_nope_head_dim=QK_NOPE,
                qk_rope_head_dim=QK_ROPE,
                v_head_dim=V_HEAD,
                q_lora_rank=None,
                kv_lora_rank=KV_LORA_RANK,
                kv_b_proj=kv_b_proj,
                cache_config=vllm_config.cache_config,
                prefix=ATTN_LAYER,
                attn_backend=backend,
                use_sparse=bool(getattr(backend, "is_sparse", lambda: False)()),
            )
        from vllm.model_executor.layers.attention import Attention

        return Attention(
            num_heads=NUM_HEADS,
            head_size=HEAD_SIZE,
            scale=HEAD_SIZE**-0.5,
            num_kv_heads=1,
            cache_config=vllm_config.cache_config,
            prefix=ATTN_LAYER,
            attn_backend=backend,
        )


def _is_mla(backend: Any) -> bool:
    return bool(getattr(backend, "is_mla", lambda: False)())


def _direct_spec(backend: Any) -> Any:
    """The spec written out, for when no layer can be built on this machine."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    block_size = BLOCK_SIZE
    preferred = getattr(backend, "get_preferred_block_size", None)
    if callable(preferred):
        block_size = preferred(BLOCK_SIZE)
    mla = _is_mla(backend)
    cls = MLAAttentionSpec if mla else FullAttentionSpec
    return cls(
        block_size=block_size,
        num_kv_heads=1,
        head_size=KV_LORA_RANK + QK_ROPE if mla else HEAD_SIZE,
        dtype=torch.bfloat16,
    )


def _as_runner_sees_it(backend: Any, spec: Any, vllm_config: Any) -> Any:
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


def _attention_spec(backend: Any, vllm_config: Any) -> tuple[Any, str | None]:
    """``(spec, layer_problem)``: the spec that a real layer of ``backend``
    publishes, as the runner collects it; or, if no layer can be built here,
    the spec written out, and why the layer could not be built."""
    try:
        layer = _layer(backend, vllm_config)
        spec = layer.get_kv_cache_spec(vllm_config)
        problem = None
    except BaseException as e:
        # a layer that failed half-way may have registered itself already
        vllm_config.compilation_config.static_forward_context.pop(ATTN_LAYER, None)
        spec, problem = _direct_spec(backend), describe(e)
    return _as_runner_sees_it(backend, spec, vllm_config), problem


def _mamba_spec(member: Any, vllm_config: Any) -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    kwargs: dict[str, Any] = dict(
        block_size=vllm_config.model_config.max_model_len,
        shapes=((3, 64), (4, 16, 16)),
        dtypes=(torch.bfloat16, torch.bfloat16),
    )
    names = {f.name for f in dataclasses.fields(MambaSpec)}
    if "mamba_type" in names:
        kwargs["mamba_type"] = member
    if "num_speculative_blocks" in names:
        kwargs["num_speculative_blocks"] = vllm_config.num_speculative_tokens or 0
    return MambaSpec(**kwargs)


def spec_for(
    entry: Registered, backend: Any, vllm_config: Any
) -> tuple[Any, str | None]:
    if entry.is_mamba:
        return _mamba_spec(entry.member, vllm_config), None
    return _attention_spec(backend, vllm_config)


@dataclasses.dataclass
class Subject:
    """A built backend: its builder class and one builder per config."""

    entry: Registered
    backend: Any
    builder_cls: type
    spec: Any
    builders: dict[int, Any]
    cudagraph_support: str
    spec_source: str = "layer"


def build_subject(
    entry: Registered, configs: Configs, spec_tokens: Iterable[int]
) -> Subject:
    """Raises when the backend cannot be built on this machine; the message
    is the skip reason."""
    try:
        backend = entry.member.get_class()
    except BaseException as e:  # ImportError, a GPU query at import, ...
        raise Skip(f"import: {describe(e)}") from e
    try:
        builder_cls = backend.get_builder_cls()
    except BaseException as e:
        raise Skip(f"get_builder_cls(): {describe(e)}") from e
    builders: dict[int, Any] = {}
    spec = layer_problem = None
    for n in sorted(set(spec_tokens)):
        cfg = configs.get(n)
        try:
            spec, layer_problem = spec_for(entry, backend, cfg)
        except BaseException as e:
            raise Skip(f"KV-cache spec: {describe(e)}") from e
        try:
            builders[n] = make_builder(builder_cls, spec, cfg)
        except BaseException as e:
            why = f"{builder_cls.__name__}(): {describe(e)}"
            if layer_problem:
                why += f"; its layer could not be built either: {layer_problem}"
            raise Skip(why) from e
    support = "?"
    try:
        first = builders[min(builders)]
        support = str(builder_cls.get_cudagraph_support(first.vllm_config, spec).name)
    except BaseException:
        support = str(
            getattr(getattr(builder_cls, "_cudagraph_support", None), "name", "?")
        )
    source = "mamba" if entry.is_mamba else "layer"
    if layer_problem:
        source = f"written out (no layer here: {layer_problem})"
    return Subject(entry, backend, builder_cls, spec, builders, support, source)


class Skip(Exception):
    """The backend cannot be built on this machine; the message says why."""


@dataclasses.dataclass
class Later:
    """A builder run after each audited capture, in its own KV-cache group:
    one instance per number of speculative tokens, or why it cannot be built."""

    name: str
    builders: dict[int, Any]
    problem: str | None = None


def build_later(name: str, configs: Configs, spec_tokens: Iterable[int]) -> Later:
    builders: dict[int, Any] = {}
    try:
        if name == MINIMAX_M3_INDEXER:
            for n in sorted(set(spec_tokens)):
                builders[n] = indexer_builder(configs.get(n))
        else:
            entry = find(name)
            if entry is None:
                return Later(name, {}, f"no backend named {name} is registered")
            builders = build_subject(entry, configs, spec_tokens).builders
    except BaseException as e:
        return Later(name, {}, str(e) if isinstance(e, Skip) else describe(e))
    return Later(name, builders)
