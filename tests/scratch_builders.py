# SPDX-License-Identifier: Apache-2.0
"""Scratch backends for the audit and the pytest helpers: real vLLM classes,
subclassed to misbehave on purpose."""

from __future__ import annotations

from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionMetadataBuilder,
)

#: Where vLLM's ``register_backend`` finds the misbehaving backend.
LEAKY_BACKEND_PATH = "tests.scratch_builders.LeakyTritonBackend"


class LeakyTritonMetadataBuilder(TritonAttentionMetadataBuilder):
    """vLLM's Triton builder, except that its capture zeroes the shared CPU
    query offsets, as ``RocmAttentionMetadataBuilder`` did on 0.27/0.28."""

    def build_for_cudagraph_capture(self, common_attn_metadata):
        metadata = super().build_for_cudagraph_capture(common_attn_metadata)
        common_attn_metadata.query_start_loc_cpu.zero_()
        return metadata


class LeakyTritonBackend(TritonAttentionBackend):
    @staticmethod
    def get_builder_cls():
        return LeakyTritonMetadataBuilder
