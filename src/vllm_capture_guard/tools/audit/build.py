# SPDX-License-Identifier: Apache-2.0
"""Building what the audit runs: for a registered backend, its metadata
builder on the CPU, with a real ``VllmConfig`` of the tiny model its family
serves (:mod:`.layers`), the KV-cache spec its real layer publishes (a Mamba
spec for the Mamba registry), the KV-cache dtype it requires, then the
backend's own adjustments, as the runner does. A backend that cannot be
built here raises :class:`Skip`, with the exception that stopped it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable
from copy import copy
from typing import Any

import torch

from vllm_capture_guard.tools.audit import layers
from vllm_capture_guard.tools.audit.registry import Registered
from vllm_capture_guard.tools.harness import describe, make_builder, make_vllm_config
from vllm_capture_guard.tools.harness.models import (
    DEEPSEEK_V3,
    DEEPSEEK_V4,
    DEEPSEEK_V32,
    DEEPSEEK_V41,
    MINIMAX_M3,
)

#: KV-cache blocks the runner has allocated by capture time (FlexAttention's
#: builder reads it); the tiny config leaves it unset.
NUM_GPU_BLOCKS = 64

#: The block size each family's groups start from (the runner then picks
#: one every backend of the model supports).
FAMILY_BLOCK = {
    MINIMAX_M3: 128,
    DEEPSEEK_V3: 64,
    DEEPSEEK_V32: 64,
    DEEPSEEK_V4: 256,
    DEEPSEEK_V41: 256,
}


class Configs:
    """The audit's ``VllmConfig`` per family, KV-cache dtype and number of
    speculative tokens: built once (the expensive part), then handed out as
    cheap private copies, so that what one backend's layer sets (a layer may
    change ``cache_config``, and registers itself in
    ``static_forward_context``) reaches neither the next backend nor the
    configs that the harness caches for other callers."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, str, str], Any] = {}
        self.time_spent = 0.0

    def get(
        self,
        num_speculative_tokens: int,
        family: str = MINIMAX_M3,
        kv_cache_dtype: str = "auto",
        block_size: int | None = None,
    ) -> Any:
        """A private copy of the config (shallow, with its own cache config,
        compilation config and an empty ``static_forward_context``)."""
        key = (num_speculative_tokens, family, kv_cache_dtype)
        if key not in self._made:
            t0 = time.perf_counter()
            self._made[key] = make_vllm_config(
                num_speculative_tokens, family=family, kv_cache_dtype=kv_cache_dtype
            )
            self.time_spent += time.perf_counter() - t0
        base = self._made[key]
        cfg = copy(base)
        cfg.cache_config = copy(base.cache_config)
        cfg.compilation_config = copy(base.compilation_config)
        cfg.compilation_config.static_forward_context = {}
        if cfg.cache_config.num_gpu_blocks is None:
            cfg.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
        if block_size is not None:
            cfg.cache_config.block_size = block_size
        return cfg


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
    family: str = MINIMAX_M3
    kv_cache_dtype: str = "auto"


class Skip(Exception):
    """The backend cannot be built on this machine; the message says why."""

    def __init__(self, message: str, error: BaseException | None = None):
        super().__init__(message)
        #: The exception that stopped it, for telling its cause.
        self.error = error


def backend_class(entry: Registered) -> Any:
    try:
        return entry.member.get_class()
    except BaseException as e:  # ImportError, a GPU query at import, ...
        raise Skip(f"import: {describe(e)}", e) from e


def group_setup(backend: Any, family: str, companions: Iterable[Any] = ()) -> dict:
    """The family, KV-cache dtype and block size a backend's group gets."""
    return dict(
        family=family,
        kv_cache_dtype=layers.kv_cache_dtype(backend),
        block_size=layers.block_size(
            backend, *companions, default=FAMILY_BLOCK[family]
        ),
    )


def _one_builder(
    entry: Registered, backend: Any, builder_cls: type, family: str, cfg: Any
) -> tuple[Any, str, Any]:
    """(spec, where it came from, the builder) under one config."""
    name, problem, source = layers.ATTN_LAYER, None, "mamba"
    try:
        if entry.is_mamba:
            spec = _mamba_spec(entry.member, cfg)
        else:
            found = layers.backend_layer(backend, family, cfg)
            spec, source, name, problem = (
                found.spec,
                found.source,
                found.name,
                found.problem,
            )
    except BaseException as e:
        raise Skip(f"KV-cache spec: {describe(e)}", e) from e
    try:
        return spec, source, make_builder(builder_cls, spec, cfg, layer=name)
    except BaseException as e:
        why = f"{builder_cls.__name__}(): {describe(e)}"
        if problem:
            why += f"; its layer could not be built either: {problem}"
        raise Skip(why, e) from e


def build_subject(
    entry: Registered,
    configs: Configs,
    spec_tokens: Iterable[int],
    companions: dict[str, list[Any]] | None = None,
) -> Subject:
    """Raises :class:`Skip` when the backend cannot be built on this machine;
    the message is the reason. ``companions``: per family, the backends of
    the later builders that share its block size."""
    backend = backend_class(entry)
    try:
        builder_cls = backend.get_builder_cls()
    except BaseException as e:
        raise Skip(f"get_builder_cls(): {describe(e)}", e) from e
    family = layers.family_of(backend, entry.is_mamba)
    setup = group_setup(backend, family, (companions or {}).get(family, ()))
    builders: dict[int, Any] = {}
    spec, source = None, "mamba"
    for n in sorted(set(spec_tokens)):
        try:
            cfg = configs.get(n, **setup)
        except BaseException as e:
            raise Skip(f"the {family} config: {describe(e)}", e) from e
        hide = family == DEEPSEEK_V3
        with layers.without_workspace() if hide else contextlib.nullcontext():
            spec, source, builders[n] = _one_builder(
                entry, backend, builder_cls, family, cfg
            )
    support = "?"
    try:
        from vllm.config import set_current_vllm_config

        first = builders[min(builders)]
        with set_current_vllm_config(first.vllm_config):  # FlashInfer's reads it
            found = builder_cls.get_cudagraph_support(first.vllm_config, spec)
        support = str(found.name)
    except BaseException:
        support = str(
            getattr(getattr(builder_cls, "_cudagraph_support", None), "name", "?")
        )
    return Subject(
        entry,
        backend,
        builder_cls,
        spec,
        builders,
        support,
        source,
        family,
        setup["kv_cache_dtype"],
    )
