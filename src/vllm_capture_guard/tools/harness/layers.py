# SPDX-License-Identifier: Apache-2.0
"""MiniMax-M3's attention layers as a model that vLLM's own loader makes, for
driving a whole model runner (Model Runner V2) on its own code.

A model runner loads its model through vLLM's model loader and registry, and
reads the attention layers from the forward context that the layers register
in as they are made. :class:`MiniMaxM3Layers` is registered with vLLM's
``ModelRegistry`` (the interface for models outside vLLM's tree) under
:data:`ARCHITECTURE`, and holds what MiniMax-M3 holds that capture touches:

* vLLM's ``Attention`` layer (``model.layers.0.self_attn.attn``) with the
  configured backend (``--attention-backend``), as a ROCm server makes it;
* MiniMax-M3's own indexer cache layer (``MiniMaxM3IndexerCache``,
  ``model.layers.1.self_attn.indexer.index_cache``), whose builder asserts
  ``decode_query_len > 0``.

So the KV-cache specs, their grouping, the attention groups and their
builders are vLLM's own, made by vLLM from these layers. What the model does
not have is weights and kernels: its forward returns hidden states of zeros
and its logits are zeros. Nothing the metadata builders read comes from the
forward.

Where vLLM's ``Attention`` cannot be made on this host (its backend's
implementation imports a compiled extension: AITER's on a CPU), the layer is
:func:`written_out_layer`'s, which publishes what that layer publishes (the
backend and a full-attention spec of the same sizes) and says why
(:data:`MiniMaxM3Layers.written_out`). The builders are made from the
backend, as for the real layer; only the layer's kernels are missing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from vllm_capture_guard.tools.harness.model import ATTN_LAYER, INDEXER_LAYER
from vllm_capture_guard.tools.harness.models import HEAD_SIZE

#: The name the harness registers the model under, and writes into the
#: tiny model's ``config.json`` for the runner drive.
ARCHITECTURE = "CaptureGuardMiniMaxM3Layers"


@functools.cache
def written_out_layer() -> type:
    """:class:`WrittenOutLayer`'s class: vLLM's ``AttentionLayerBase`` (what the
    runner collects, with the attributes every such layer has), holding the
    backend and the spec (see the module). Made once vLLM is imported."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class WrittenOutLayer(nn.Module, AttentionLayerBase):
        """The attention layer's spec and backend, for a host where vLLM's own
        layer cannot be made. It registers in the forward context under the
        layer's name, as vLLM's layer does."""

        def __init__(self, backend: type, spec: Any, prefix: str, vllm_config: Any):
            super().__init__()
            self.backend, self.spec, self.prefix = backend, spec, prefix
            self.kv_cache = torch.tensor([])
            context = vllm_config.compilation_config.static_forward_context
            context[prefix] = self

        def get_attn_backend(self) -> type:
            return self.backend

        def get_kv_cache_spec(self, vllm_config: Any) -> Any:
            return self.spec

    return WrittenOutLayer


class MiniMaxM3Layers(nn.Module):
    """MiniMax-M3's attention and indexer-cache layers (see the module)."""

    #: Why vLLM's ``Attention`` could not be made here, if it could not.
    written_out: str | None = None

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        from vllm.model_executor.layers.attention import Attention
        from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerCache

        text = vllm_config.model_config.hf_text_config
        self.hidden_size = text.hidden_size
        self.vocab_size = text.vocab_size
        self.dtype = vllm_config.model_config.dtype
        backend = vllm_config.attention_config.backend
        backend_cls = None if backend is None else backend.get_class()
        try:
            self.attn = Attention(
                num_heads=text.num_attention_heads,
                head_size=HEAD_SIZE,
                scale=HEAD_SIZE**-0.5,
                num_kv_heads=text.num_key_value_heads,
                cache_config=vllm_config.cache_config,
                prefix=ATTN_LAYER,
                attn_backend=backend_cls,
            )
        except ImportError as e:  # the backend's kernels are not on this host
            from vllm.v1.kv_cache_interface import FullAttentionSpec

            from vllm_capture_guard.tools.harness.capture import describe

            context = vllm_config.compilation_config.static_forward_context
            context.pop(ATTN_LAYER, None)
            spec = FullAttentionSpec(
                block_size=vllm_config.cache_config.block_size,
                num_kv_heads=text.num_key_value_heads,
                head_size=HEAD_SIZE,
                dtype=self.dtype,
            )
            layer = written_out_layer()
            self.attn = layer(backend_cls, spec, ATTN_LAYER, vllm_config)
            self.written_out = describe(e)
        self.index_cache = MiniMaxM3IndexerCache(
            HEAD_SIZE, INDEXER_LAYER, vllm_config.cache_config
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._zeros(input_ids, self.hidden_size, self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        tokens = positions if positions is not None else input_ids
        assert tokens is not None
        return self._zeros(tokens, self.hidden_size, self.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._zeros(hidden_states, self.vocab_size, torch.float32, dim=0)

    @staticmethod
    def _zeros(like: torch.Tensor, width: int, dtype: Any, dim: int = -1) -> Any:
        """Zeros of one row per token of ``like`` (its last dimension, or
        ``dim``), on its device: what the layers would compute, without
        weights."""
        return torch.zeros(like.shape[dim], width, dtype=dtype, device=like.device)

    def load_weights(self, weights: Any) -> set[str]:
        for _ in weights:
            pass
        return set()


def register() -> None:
    """Register :class:`MiniMaxM3Layers` with vLLM's ``ModelRegistry`` (once)."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MiniMaxM3Layers)
