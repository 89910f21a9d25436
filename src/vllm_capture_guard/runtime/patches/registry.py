# SPDX-License-Identifier: Apache-2.0
"""The patches the plugin applies, in order."""

from vllm_capture_guard.runtime.patches import (
    rocm_aiter_unified_builder,
    rocm_attn_cpu_offsets,
)

PATCHES = (rocm_attn_cpu_offsets, rocm_aiter_unified_builder)
