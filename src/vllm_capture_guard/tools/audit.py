# SPDX-License-Identifier: Apache-2.0
"""Audit every attention backend that the installed vLLM registers: does its
capture write into the metadata that other builders read?

During full-graph capture one ``CommonAttentionMetadata`` (views of the model
runner's persistent buffers, a shallow copy per KV-cache group) passes through
every metadata builder in turn (:mod:`vllm_capture_guard.runtime.contract`). For each
backend in vLLM's own registries (``AttentionBackendEnum``,
``MambaAttentionBackendEnum`` and any other enum with ``get_class`` that
``vllm.v1.attention.backends.registry`` defines), the audit

1. builds the backend's metadata builder on the CPU, with a real ``VllmConfig``
   (the tiny MiniMax-M3 of :mod:`vllm_capture_guard.tools.scenarios`) and the KV-cache
   spec the backend's layers would publish (Mamba spec for the Mamba registry,
   MLA spec for ``is_mla()`` backends, full attention otherwise, then
   ``customize_spec``, as the runner does); a backend that cannot be built
   here is *skipped*, with the exception that stopped it;
2. runs its ``build_for_cudagraph_capture`` on shared runner buffers and
   records which shared fields it wrote in place (CPU and device, old and new
   values) and which fields it rebound on its own copy;
3. runs the **sequenced check**: for each second builder (by default the
   MiniMax-M3 indexer, ``TRITON_ATTN`` and ``MAMBA2``), the metadata that the
   second builder builds *after* this backend's capture must equal what it
   builds *alone* on the same batch (:func:`freeze`, :func:`compare`).

How a difference is classed (:data:`SEVERITY`):

``fails``
    the second builder raises after this capture (and not alone): startup
    dies, as in the seed bug.
``host``
    a host value of the second builder's metadata differs: a Python scalar, a
    tensor's shape or dtype, or a tensor named ``*cpu*``/``*host*``. Host
    values are baked into the captured graph (grid sizes, kernel choice,
    split points), so the graph is captured for the wrong batch.
``device``
    only values of the second builder's device tensors differ. The graph reads
    device tensors by address and the runner rewrites them before every
    replay; the difference is seen only by kernels run during capture.
``builder``
    only the second builder's own persistent buffers differ, in parts its
    capture metadata does not reference.
``equal``
    no difference.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from copy import copy
from typing import Any

import numpy as np
import torch

from vllm_capture_guard.runtime.contract import CPU, DEVICE, FieldWrite, snapshot
from vllm_capture_guard.tools import scenarios as sc

REGISTRY_MODULE = "vllm.v1.attention.backends.registry"

#: The second builder that is no registry entry: MiniMax-M3's indexer, whose
#: ``decode_query_len`` the seed bug broke.
MINIMAX_M3_INDEXER = "MINIMAX_M3_INDEXER"
#: Builders run after each audited capture, in their own KV-cache group.
DEFAULT_SECONDS = (MINIMAX_M3_INDEXER, "TRITON_ATTN", "MAMBA2")

#: Capture batches: uniform decode, a padded tail of empty queries, and a
#: speculative-decode verify batch (needs a config with one draft token).
AUDIT_BATCHES = (
    sc.Batch(4),
    sc.Batch(3, padded_reqs=4),
    sc.Batch(2, query_len=2),
)

#: KV-cache blocks the runner has allocated by capture time (FlexAttention's
#: builder reads it); the tiny config leaves it unset.
NUM_GPU_BLOCKS = 64

#: Worst first.
SEVERITY = ("fails", "host", "device", "builder", "equal", "n/a")

#: Backend verdicts, worst first.
HAZARD = "HAZARD"
CAPTURE_TIME = "capture-time only"
CONTAINED = "contained"
CLEAN = "clean"
NOT_RUN = "not run"


# --------------------------------------------------------------------------
# Equality of built metadata
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FrozenTensor:
    """A tensor's values at one moment. ``side`` is ``host`` for tensors named
    ``*cpu*``/``*host*`` and numpy arrays, else ``device`` (by name, as
    :func:`vllm_capture_guard.runtime.contract.field_side`, so that the CPU tier
    reasons as a GPU host would)."""

    side: str
    dtype: str
    shape: tuple[int, ...]
    data: Any  # a CPU clone; compared bit for bit

    def same_values(self, other: FrozenTensor) -> bool:
        a, b = self.data, other.data
        if isinstance(a, np.ndarray):
            return a.tobytes() == b.tobytes()
        if a.dtype == torch.bool:
            return torch.equal(a, b)
        # bit for bit, so that uninitialised NaNs in a buffer compare equal
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    def describe(self, other: FrozenTensor | None = None, limit: int = 12) -> str:
        """Values, or for a long tensor compared with ``other``, the window
        ``[lo:hi]`` that holds the elements that differ."""
        values = _flat_values(self.data)
        if len(values) <= limit:
            return str(values)
        if other is not None:
            o = _flat_values(other.data)
            diff = [
                i for i, (x, y) in enumerate(zip(values, o, strict=False)) if x != y
            ]
            if diff:
                lo, hi = diff[0], min(diff[-1] + 1, diff[0] + limit)
                more = "" if hi > diff[-1] else "..."
                return f"[{lo}:{hi}]={values[lo:hi]}{more} of {len(values)}"
        return f"{values[:limit]}... of {len(values)}"


def _flat_values(data: Any) -> list[Any]:
    if isinstance(data, np.ndarray):
        return data.reshape(-1).tolist()
    if data.dtype in (torch.bfloat16, torch.float16):
        data = data.float()
    return data.reshape(-1).tolist()


@dataclasses.dataclass(frozen=True)
class Difference:
    """One place where two frozen metadata differ."""

    path: str
    severity: str  # "host" | "device" | "builder"
    alone: str
    sequenced: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return f"{self.path} ({self.severity}): {self.alone} -> {self.sequenced}"


_HOST_MARKERS = ("cpu", "host")
_MAX_DEPTH = 6


def _side_of(name: str, value: Any) -> str:
    if isinstance(value, np.ndarray):
        return "host"
    low = name.lower()
    return "host" if any(m in low for m in _HOST_MARKERS) else "device"


def freeze(obj: Any, name: str = "", _depth: int = 0, _seen: set | None = None) -> Any:
    """A comparable copy of built metadata, taken at once (views of shared
    buffers would change under us later).

    Dataclasses and plain objects become ``{"__type__": name, field: ...}``,
    tensors and arrays :class:`FrozenTensor`, enums their name, sequences and
    dicts are frozen element by element; anything deeper than a few levels,
    or seen before on the way down, becomes its type name."""
    seen = set() if _seen is None else _seen
    if obj is None or isinstance(obj, (bool, int, float, str, complex)):
        return obj
    if isinstance(obj, enum.Enum):
        return f"{type(obj).__name__}.{obj.name}"
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        flat = torch.empty(obj.numel(), dtype=obj.dtype)  # contiguous, stride 1
        flat.copy_(obj.detach().reshape(-1))
        return FrozenTensor(_side_of(name, obj), str(obj.dtype), tuple(obj.shape), flat)
    if isinstance(obj, np.ndarray):
        return FrozenTensor("host", str(obj.dtype), tuple(obj.shape), obj.copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if _depth >= _MAX_DEPTH or id(obj) in seen:
        return f"<{type(obj).__name__}>"
    seen = seen | {id(obj)}
    deeper = _depth + 1
    if isinstance(obj, (list, tuple)):
        return [freeze(v, name, deeper, seen) for v in obj]
    if isinstance(obj, dict):
        return {str(k): freeze(v, f"{name}[{k}]", deeper, seen) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]
    elif hasattr(obj, "__dict__") and not callable(obj):
        items = list(vars(obj).items())
    else:
        return f"<{type(obj).__name__}>"
    out: dict[str, Any] = {"__type__": type(obj).__qualname__}
    for key, value in items:
        out[key] = freeze(value, key, deeper, seen)
    return out


def _show(value: Any, other: Any = None) -> str:
    if isinstance(value, FrozenTensor):
        return value.describe(other if isinstance(other, FrozenTensor) else None)
    if isinstance(value, dict):
        return f"<{value.get('__type__', 'dict')}>"
    if isinstance(value, list):
        return f"<list of {len(value)}>"
    return repr(value)


def compare(alone: Any, sequenced: Any, path: str = "") -> list[Difference]:
    """Every difference between two :func:`freeze` results.

    Equal means: same Python type and value for scalars; same keys and equal
    values, recursively, for dataclasses/objects/dicts; same length and equal
    elements for sequences; same dtype, shape and bit-identical values for
    tensors. A tensor whose values differ counts as its ``side``; anything
    else that differs (scalars, shapes, dtypes, types) counts as ``host``."""
    diffs: list[Difference] = []
    here = path or "."
    if isinstance(alone, FrozenTensor) and isinstance(sequenced, FrozenTensor):
        if (alone.dtype, alone.shape) != (sequenced.dtype, sequenced.shape):
            diffs.append(
                Difference(
                    here,
                    "host",
                    f"{alone.dtype}{list(alone.shape)}",
                    f"{sequenced.dtype}{list(sequenced.shape)}",
                )
            )
        elif not alone.same_values(sequenced):
            diffs.append(
                Difference(
                    here,
                    alone.side,
                    alone.describe(sequenced),
                    sequenced.describe(alone),
                )
            )
        return diffs
    if isinstance(alone, dict) and isinstance(sequenced, dict):
        for key in list(alone) + [k for k in sequenced if k not in alone]:
            sub = f"{path}.{key}" if path else key
            if key not in alone or key not in sequenced:
                diffs.append(
                    Difference(
                        sub, "host", _show(alone.get(key)), _show(sequenced.get(key))
                    )
                )
            else:
                diffs += compare(alone[key], sequenced[key], sub)
        return diffs
    if isinstance(alone, list) and isinstance(sequenced, list):
        if len(alone) != len(sequenced):
            return [Difference(here, "host", _show(alone), _show(sequenced))]
        for i, (a, b) in enumerate(zip(alone, sequenced, strict=True)):
            diffs += compare(a, b, f"{path}[{i}]")
        return diffs
    if type(alone) is not type(sequenced) or alone != sequenced:
        diffs.append(
            Difference(here, "host", _show(alone, sequenced), _show(sequenced, alone))
        )
    return diffs


def freeze_built(metadata: Any, builder: Any) -> dict[str, Any]:
    """The metadata a builder returned, plus its own tensor buffers (named
    ``builder.<attr>``): a builder may write a value derived from the shared
    metadata into a persistent buffer that its kernels read later."""
    buffers = {k: v for k, v in vars(builder).items() if isinstance(v, torch.Tensor)}
    return {
        "metadata": freeze(metadata, "metadata"),
        "builder": {k: freeze(v, k) for k, v in buffers.items()},
    }


def classify(diffs: Iterable[Difference]) -> str:
    """The worst :data:`SEVERITY` among ``diffs`` (``equal`` if none)."""
    found = {
        ("builder" if d.path.startswith("builder.") else d.severity) for d in diffs
    }
    for level in SEVERITY:
        if level in found:
            return level
    return "equal"


def compare_built(alone: dict[str, Any], sequenced: dict[str, Any]) -> list[Difference]:
    diffs = compare(alone["metadata"], sequenced["metadata"], "metadata")
    for d in compare(alone["builder"], sequenced["builder"], "builder"):
        diffs.append(dataclasses.replace(d, severity="builder"))
    return diffs


def use_version_cache() -> str | None:
    """Give this process a vLLM cache directory of its own per vLLM version,
    unless ``VLLM_CACHE_ROOT`` is set. vLLM caches the model-class inspection
    that a ``ModelConfig`` needs (a subprocess that imports vLLM again, the
    slowest step of an audit) in one file per class, whatever the version, so
    auditing two versions in turn would redo it on every run. Call before
    importing vLLM; returns the directory chosen."""
    from importlib.metadata import version
    from pathlib import Path

    if os.environ.get("VLLM_CACHE_ROOT"):
        return None
    try:
        ver = version("vllm")
    except Exception:
        return None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    root = str(Path(base) / "vllm-capture-guard" / f"vllm-{ver}")
    os.environ["VLLM_CACHE_ROOT"] = root
    return root


# --------------------------------------------------------------------------
# The registry, specs and builders
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Registered:
    """One member of one of vLLM's backend registries."""

    registry: str
    name: str
    member: Any

    @property
    def is_mamba(self) -> bool:
        return "mamba" in self.registry.lower()


def registries() -> list[type]:
    """Every enum of vLLM's backend registry module that resolves classes."""
    mod = importlib.import_module(REGISTRY_MODULE)
    found = []
    for obj in vars(mod).values():
        if (
            isinstance(obj, type)
            and issubclass(obj, enum.Enum)
            and obj.__module__ == mod.__name__
            and callable(getattr(obj, "get_class", None))
        ):
            found.append(obj)
    return found


def registered_backends() -> list[Registered]:
    return [
        Registered(reg.__name__, member.name, member)
        for reg in registries()
        for member in reg
    ]


def _error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().rstrip(":")
    try:
        site, _ = sc._error_site(e)
    except Exception:
        return text
    return f"{text} (at {site})"


class Configs:
    """The audit's ``VllmConfig`` per number of speculative tokens: built once
    (the expensive part), then handed out as cheap private copies, so that
    what one backend's layer sets (a layer may change ``cache_config``, and
    registers itself in ``static_forward_context``) reaches neither the next
    backend nor the configs that :mod:`scenarios` caches for other callers."""

    def __init__(self) -> None:
        self._made: dict[int, Any] = {}
        self.seconds_spent = 0.0

    def get(self, num_speculative_tokens: int) -> Any:
        """A private copy of the config (shallow, with its own cache config,
        compilation config and an empty ``static_forward_context``)."""
        if num_speculative_tokens not in self._made:
            t0 = time.perf_counter()
            self._made[num_speculative_tokens] = sc.make_vllm_config(
                num_speculative_tokens
            )
            self.seconds_spent += time.perf_counter() - t0
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
    ctx.pop(sc.ATTN_LAYER, None)
    with set_current_vllm_config(vllm_config):
        if _is_mla(backend):
            from vllm.model_executor.layers.attention import MLAAttention
            from vllm.model_executor.layers.linear import ColumnParallelLinear

            kv_b_proj = ColumnParallelLinear(
                KV_LORA_RANK,
                NUM_HEADS * (QK_NOPE + V_HEAD),
                bias=False,
                params_dtype=torch.bfloat16,
                prefix=f"{sc.ATTN_LAYER}.kv_b_proj",
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
                prefix=sc.ATTN_LAYER,
                attn_backend=backend,
                use_sparse=bool(getattr(backend, "is_sparse", lambda: False)()),
            )
        from vllm.model_executor.layers.attention import Attention

        return Attention(
            num_heads=NUM_HEADS,
            head_size=sc.HEAD_SIZE,
            scale=sc.HEAD_SIZE**-0.5,
            num_kv_heads=1,
            cache_config=vllm_config.cache_config,
            prefix=sc.ATTN_LAYER,
            attn_backend=backend,
        )


def _is_mla(backend: Any) -> bool:
    return bool(getattr(backend, "is_mla", lambda: False)())


def _direct_spec(backend: Any) -> Any:
    """The spec written out, for when no layer can be built on this machine."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    block_size = sc.BLOCK_SIZE
    preferred = getattr(backend, "get_preferred_block_size", None)
    if callable(preferred):
        block_size = preferred(sc.BLOCK_SIZE)
    mla = _is_mla(backend)
    cls = MLAAttentionSpec if mla else FullAttentionSpec
    return cls(
        block_size=block_size,
        num_kv_heads=1,
        head_size=KV_LORA_RANK + QK_ROPE if mla else sc.HEAD_SIZE,
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
        vllm_config.compilation_config.static_forward_context.pop(sc.ATTN_LAYER, None)
        spec, problem = _direct_spec(backend), _error(e)
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


def make_builder(
    builder_cls: type, spec: Any, vllm_config: Any, layer: str = sc.ATTN_LAYER
) -> Any:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        return builder_cls(spec, [layer], vllm_config, torch.device("cpu"))


def _spec_tokens(batch: sc.Batch) -> int:
    return max(batch.query_len - 1, 0)


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
        raise _Skip(f"import: {_error(e)}") from e
    try:
        builder_cls = backend.get_builder_cls()
    except BaseException as e:
        raise _Skip(f"get_builder_cls(): {_error(e)}") from e
    builders: dict[int, Any] = {}
    spec = layer_problem = None
    for n in sorted(set(spec_tokens)):
        cfg = configs.get(n)
        try:
            spec, layer_problem = spec_for(entry, backend, cfg)
        except BaseException as e:
            raise _Skip(f"KV-cache spec: {_error(e)}") from e
        try:
            builders[n] = make_builder(builder_cls, spec, cfg)
        except BaseException as e:
            why = f"{builder_cls.__name__}(): {_error(e)}"
            if layer_problem:
                why += f"; its layer could not be built either: {layer_problem}"
            raise _Skip(why) from e
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


class _Skip(Exception):
    pass


# --------------------------------------------------------------------------
# Second builders
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Second:
    name: str
    builders: dict[int, Any]  # by speculative tokens
    problem: str | None = None


def build_second(name: str, configs: Configs, spec_tokens: Iterable[int]) -> Second:
    builders: dict[int, Any] = {}
    try:
        if name == MINIMAX_M3_INDEXER:
            for n in sorted(set(spec_tokens)):
                builders[n] = sc.indexer_builder(configs.get(n))
        else:
            entry = next((r for r in registered_backends() if r.name == name), None)
            if entry is None:
                return Second(name, {}, f"no backend named {name} is registered")
            builders = build_subject(entry, configs, spec_tokens).builders
    except BaseException as e:
        return Second(name, {}, str(e) if isinstance(e, _Skip) else _error(e))
    return Second(name, builders)


# --------------------------------------------------------------------------
# Running captures
# --------------------------------------------------------------------------


def _capture(builder: Any, cm: Any) -> Any:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(builder.vllm_config):
        return builder.build_for_cudagraph_capture(cm)


def rebound_fields(base: Any, cm: Any) -> list[str]:
    """Fields that a builder rebound on its copy: private to its KV-cache
    group's copy, but seen by later attention groups of the same KV-cache
    group, which the runner hands the same copy."""
    return [
        f.name
        for f in dataclasses.fields(base)
        if getattr(base, f.name, None) is not getattr(cm, f.name, None)
    ]


@dataclasses.dataclass
class CaptureOutcome:
    batch: str
    writes: list[FieldWrite]
    rebinds: list[str]
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "writes": [w.to_json() for w in self.writes],
            "rebinds": self.rebinds,
            "error": self.error,
        }


def capture_once(builder: Any, batch: sc.Batch) -> CaptureOutcome:
    """``builder``'s capture on fresh runner buffers holding ``batch``."""
    buffers = sc.RunnerBuffers()
    buffers.fill(batch)
    base = buffers.common_metadata(batch)
    seen = snapshot(base)
    cm = copy(base)  # the runner's per-group shallow copy
    error = None
    try:
        _capture(builder, cm)
    except BaseException as e:
        error = _error(e)
    return CaptureOutcome(batch.label(), seen.writes(), rebound_fields(base, cm), error)


def second_after(
    first: Any | None, second: Any, batch: sc.Batch
) -> tuple[dict[str, Any] | None, str | None]:
    """What ``second`` builds on ``batch`` after ``first``'s capture (or alone
    when ``first`` is None), each on its own copy of one shared metadata."""
    buffers = sc.RunnerBuffers()
    buffers.fill(batch)
    base = buffers.common_metadata(batch)
    if first is not None:
        try:
            _capture(first, copy(base))
        except BaseException as e:
            return None, f"the first capture raised: {_error(e)}"
    try:
        md = _capture(second, copy(base))
    except BaseException as e:
        return None, _error(e)
    return freeze_built(md, second), None


@dataclasses.dataclass
class Sequenced:
    """The sequenced check of one backend against one second builder."""

    second: str
    verdict: str  # one of SEVERITY
    per_batch: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class BackendReport:
    registry: str
    name: str
    status: str  # "built" | "skipped"
    reason: str | None = None
    backend_class: str | None = None
    builder_class: str | None = None
    spec: str | None = None
    spec_source: str | None = None
    cudagraph_support: str | None = None
    captures: list[CaptureOutcome] = dataclasses.field(default_factory=list)
    sequenced: list[Sequenced] = dataclasses.field(default_factory=list)

    @property
    def writes(self) -> list[tuple[str, FieldWrite]]:
        return [(c.batch, w) for c in self.captures for w in c.writes]

    def written_fields(self, side: str) -> list[str]:
        names: list[str] = []
        for _, w in self.writes:
            if w.side == side and w.field not in names:
                names.append(w.field)
        return names

    @property
    def rebinds(self) -> list[str]:
        names: list[str] = []
        for c in self.captures:
            names += [r for r in c.rebinds if r not in names]
        return names

    @property
    def captured(self) -> bool:
        return self.status == "built" and any(c.error is None for c in self.captures)

    @property
    def verdict(self) -> str:
        if not self.captured:
            return NOT_RUN
        levels = {s.verdict for s in self.sequenced}
        if levels & {"fails", "host"}:
            return HAZARD
        if "device" in levels:
            return CAPTURE_TIME
        if self.writes:
            return CONTAINED
        return CLEAN

    def to_json(self) -> dict[str, Any]:
        return {
            "registry": self.registry,
            "name": self.name,
            "status": self.status,
            "reason": self.reason,
            "backend_class": self.backend_class,
            "builder_class": self.builder_class,
            "spec": self.spec,
            "spec_source": self.spec_source,
            "cudagraph_support": self.cudagraph_support,
            "captured": self.captured,
            "cpu_writes": self.written_fields(CPU),
            "device_writes": self.written_fields(DEVICE),
            "rebinds": self.rebinds,
            "verdict": self.verdict,
            "captures": [c.to_json() for c in self.captures],
            "sequenced": [s.to_json() for s in self.sequenced],
        }


def _qualname(cls: Any) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _batches_for(support: str, batches: Sequence[sc.Batch]) -> list[sc.Batch]:
    """A builder that captures single-token decodes only is never captured
    for speculative batches: the runner does not ask it to."""
    if support == "UNIFORM_SINGLE_TOKEN_DECODE":
        return [b for b in batches if b.query_len == 1]
    return list(batches)


def audit_backend(
    entry: Registered,
    configs: Configs,
    seconds: Sequence[Second],
    alone: dict[tuple[str, str], tuple[dict[str, Any] | None, str | None]],
    batches: Sequence[sc.Batch] = AUDIT_BATCHES,
) -> BackendReport:
    report = BackendReport(entry.registry, entry.name, "built")
    try:
        subject = build_subject(entry, configs, [_spec_tokens(b) for b in batches])
    except _Skip as e:
        report.status, report.reason = "skipped", str(e)
        return report
    report.backend_class = _qualname(subject.backend)
    report.builder_class = _qualname(subject.builder_cls)
    report.spec = type(subject.spec).__name__
    report.spec_source = subject.spec_source
    report.cudagraph_support = subject.cudagraph_support
    run_batches = _batches_for(subject.cudagraph_support, batches)
    errors: dict[str, str | None] = {}
    for batch in run_batches:
        outcome = capture_once(subject.builders[_spec_tokens(batch)], batch)
        report.captures.append(outcome)
        errors[batch.label()] = outcome.error
    for second in seconds:
        if second.problem:
            continue
        rows = []
        for batch in run_batches:
            label = batch.label()
            first = subject.builders[_spec_tokens(batch)]
            sb = second.builders[_spec_tokens(batch)]
            base, base_error = alone[(second.name, label)]
            row: dict[str, Any] = {"batch": label, "differences": []}
            if errors[label]:
                row.update(verdict="n/a", note="this capture raised")
            elif base is None:
                row.update(verdict="n/a", note=f"second fails alone: {base_error}")
            else:
                after, error = second_after(first, sb, batch)
                if after is None:
                    row.update(verdict="fails", error=error)
                else:
                    diffs = compare_built(base, after)
                    row["verdict"] = classify(diffs)
                    row["differences"] = [d.to_json() for d in diffs]
            rows.append(row)
        verdict = min((r["verdict"] for r in rows), key=SEVERITY.index, default="n/a")
        report.sequenced.append(Sequenced(second.name, verdict, rows))
    return report


@dataclasses.dataclass
class AuditResult:
    vllm: str
    guard_mode: str
    guard: str | None
    backends: list[BackendReport]
    seconds: list[Second]
    batches: list[str]
    timings: dict[str, float]

    @property
    def registered(self) -> int:
        return len(self.backends)

    @property
    def built(self) -> int:
        return sum(b.status == "built" for b in self.backends)

    @property
    def captured(self) -> int:
        return sum(b.captured for b in self.backends)

    @property
    def cpu_writers(self) -> list[BackendReport]:
        return [b for b in self.backends if b.written_fields(CPU)]

    def to_json(self) -> dict[str, Any]:
        return {
            "vllm": self.vllm,
            "guard_mode": self.guard_mode,
            "guard": self.guard,
            "registered": self.registered,
            "built": self.built,
            "captured": self.captured,
            "cpu_writers": [b.name for b in self.cpu_writers],
            "batches": self.batches,
            "seconds": [{"name": s.name, "problem": s.problem} for s in self.seconds],
            "timings": self.timings,
            "vllm_cache_root": os.environ.get("VLLM_CACHE_ROOT"),
            "backends": [b.to_json() for b in self.backends],
        }


def run_audit(
    names: Sequence[str] | None = None,
    seconds: Sequence[str] = DEFAULT_SECONDS,
    batches: Sequence[sc.Batch] = AUDIT_BATCHES,
    guard_mode: str = "?",
    progress: Callable[[str], None] | None = None,
) -> AuditResult:
    """Audit vLLM as this process sees it (patched or not): every registered
    backend, or those in ``names``."""
    from vllm_capture_guard.runtime.plugin import report, vllm_version

    t0 = time.perf_counter()
    configs = Configs()
    spec_tokens = [_spec_tokens(b) for b in batches]
    entries = registered_backends()
    if names:
        wanted = set(names)
        entries = [e for e in entries if e.name in wanted]
    built_seconds = [build_second(n, configs, spec_tokens) for n in seconds]
    alone: dict[tuple[str, str], tuple[dict[str, Any] | None, str | None]] = {}
    for second in built_seconds:
        if second.problem:
            continue
        for batch in batches:
            sb = second.builders[_spec_tokens(batch)]
            alone[(second.name, batch.label())] = second_after(None, sb, batch)
    t1 = time.perf_counter()
    reports = []
    for entry in entries:
        if progress:
            progress(entry.name)
        reports.append(audit_backend(entry, configs, built_seconds, alone, batches))
    t2 = time.perf_counter()
    guard = report()
    return AuditResult(
        vllm=vllm_version(),
        guard_mode=guard_mode,
        guard=None if guard is None else guard.message,
        backends=reports,
        seconds=built_seconds,
        batches=[b.label() for b in batches],
        timings={
            "configs_s": round(configs.seconds_spent, 3),
            "setup_s": round(t1 - t0, 3),
            "backends_s": round(t2 - t1, 3),
        },
    )


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------

_SHORT = {
    "fails": "FAILS",
    "host": "HOST Δ",
    "device": "device Δ",
    "builder": "buffer Δ",
    "equal": "equal",
    "n/a": "n/a",
}
_STYLE = {
    "fails": "bold red",
    "host": "bold red",
    "device": "yellow",
    "builder": "cyan",
    "equal": "green",
    "n/a": "dim",
    HAZARD: "bold red",
    CAPTURE_TIME: "yellow",
    CONTAINED: "cyan",
    CLEAN: "green",
    NOT_RUN: "dim",
}


def coverage_line(result: AuditResult) -> str:
    return (
        f"coverage: built {result.built} of {result.registered} registered "
        f"backends on this machine; {result.captured} of them ran their capture"
    )


def guard_line(result: AuditResult) -> str:
    return (
        f"VLLM_CAPTURE_GUARD={result.guard_mode}; guard: {result.guard or 'not loaded'}"
    )


def _writes_cell(b: BackendReport) -> str:
    parts = []
    cpu, dev = b.written_fields(CPU), b.written_fields(DEVICE)
    if cpu:
        parts.append("[bold red]cpu: " + ", ".join(cpu) + "[/]")
    if dev:
        parts.append("dev: " + ", ".join(dev))
    if b.rebinds:
        parts.append("[dim]rebinds: " + ", ".join(b.rebinds) + "[/]")
    return "\n".join(parts) or "-"


def findings(result: AuditResult) -> list[str]:
    """Plain-text lines: each shared field a capture wrote (values from the
    first batch that wrote it) and, per second builder, each place where its
    metadata after this capture differs from its metadata alone."""
    lines = []
    for b in result.backends:
        by_field: dict[str, list[tuple[str, FieldWrite]]] = {}
        for batch, w in b.writes:
            by_field.setdefault(w.field, []).append((batch, w))
        for field, hits in by_field.items():
            batch, w = hits[0]
            lines.append(
                f"{b.name} wrote {field} ({w.side}) in {len(hits)}/"
                f"{len(b.captures)} batches; {batch}: {w.before} -> {w.after}"
            )
        for s in b.sequenced:
            lines += _sequenced_lines(b.name, s)
    return lines


def _sequenced_lines(name: str, s: Sequenced) -> list[str]:
    lines = []
    failed = [r for r in s.per_batch if r["verdict"] == "fails"]
    if failed:
        lines.append(
            f"{name} -> {s.second}: FAILS after this capture in {len(failed)}/"
            f"{len(s.per_batch)} batches: {failed[0].get('error')}"
        )
    paths: dict[str, tuple[str, dict[str, Any]]] = {}
    for row in s.per_batch:
        for d in row["differences"]:
            paths.setdefault(d["path"], (row["batch"], d))
    for path, (batch, d) in paths.items():
        lines.append(
            f"{name} -> {s.second}: {path} ({d['severity']}) differs; {batch}: "
            f"alone {d['alone']}, after {d['sequenced']}"
        )
    return lines


def print_report(result: AuditResult, file: Any = None) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional for the package; plain text then
        _print_plain(result, file)
        return
    out = file if file is not None else sys.stdout
    wide = None if out.isatty() else 180  # a pipe or file gets wide lines
    console = Console(file=out, width=wide)
    console.print(f"[bold]vllm-capture-guard audit[/] of vLLM {result.vllm}")
    console.print(guard_line(result), markup=False)
    console.print(
        "capture batches: "
        + ", ".join(result.batches)
        + "; second builders: "
        + ", ".join(
            s.name + (f" (unavailable: {s.problem})" if s.problem else "")
            for s in result.seconds
        ),
        markup=False,
    )
    seconds = [s for s in result.seconds if not s.problem]
    table = Table(title="Shared metadata written during capture", show_lines=True)
    for col in ("backend", "builder", "CG support", "shared writes"):
        table.add_column(col)
    for s in seconds:
        table.add_column(f"then {s.name}")
    table.add_column("verdict")
    for b in result.backends:
        if b.status != "built":
            continue
        errors = [c for c in b.captures if c.error]
        builder = (b.builder_class or "").rsplit(".", 1)[-1]
        if errors and not b.captured:
            builder += f"\n[dim]capture raised: {errors[0].error}[/]"
        cells = [b.name, builder, b.cudagraph_support or "?", _writes_cell(b)]
        by_second = {s.second: s.verdict for s in b.sequenced}
        for s in seconds:
            v = by_second.get(s.name, "n/a")
            cells.append(f"[{_STYLE[v]}]{_SHORT[v]}[/]")
        cells.append(f"[{_STYLE[b.verdict]}]{b.verdict}[/]")
        table.add_row(*cells)
    console.print(table)
    skipped = [b for b in result.backends if b.status != "built"]
    if skipped:
        st = Table(title=f"Skipped: cannot be built on this machine ({len(skipped)})")
        st.add_column("backend")
        st.add_column("reason")
        for b in skipped:
            st.add_row(b.name, b.reason or "?")
        console.print(st)
    lines = findings(result)
    if lines:
        console.print("[bold]Findings[/]")
        for line in lines:
            console.print("  " + line, markup=False, highlight=False)
    console.print(coverage_line(result), markup=False)
    _print_verdict(result, lambda s: console.print(s, markup=False))


def _print_verdict(result: AuditResult, say: Callable[[str], None]) -> None:
    writers = result.cpu_writers
    if writers:
        say(
            "FAIL: capture writes shared CPU metadata: "
            + "; ".join(
                f"{b.name} ({', '.join(b.written_fields(CPU))})" for b in writers
            )
        )
    else:
        say("OK: no built backend's capture writes shared CPU metadata")


def _print_plain(result: AuditResult, file: Any = None) -> None:
    def say(s: str) -> None:
        print(s, file=file)

    say(f"vllm-capture-guard audit of vLLM {result.vllm}")
    say(guard_line(result))
    for b in result.backends:
        if b.status != "built":
            say(f"  {b.name}: skipped ({b.reason})")
            continue
        seq = ", ".join(f"{s.second}: {s.verdict}" for s in b.sequenced)
        say(
            f"  {b.name}: {b.verdict}; cpu writes {b.written_fields(CPU) or '-'}; "
            f"device writes {b.written_fields(DEVICE) or '-'}; {seq}"
        )
    for line in findings(result):
        say("  " + line)
    say(coverage_line(result))
    _print_verdict(result, say)
