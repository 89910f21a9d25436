# SPDX-License-Identifier: Apache-2.0
"""Model Runner V2 (``vllm/v1/worker/gpu/``), driven on its own code.

Nothing of the runner's steps is re-enacted here. The harness makes what a
worker makes, with vLLM's own classes and functions, and then calls the
runner's own capture:

1. vLLM's ``GPUModelRunner`` of ``vllm/v1/worker/gpu/model_runner.py``, and
   its own ``load_model``, which loads :class:`.layers.MiniMaxM3Layers`
   through vLLM's model loader and registry (MiniMax-M3's attention layer
   with the configured backend and its indexer cache layer; no weights);
2. the KV cache as the engine core plans it: vLLM's
   ``EngineCore._initialize_kv_caches`` asks an in-process executor (vLLM's
   ``Executor``, whose calls reach vLLM's own GPU ``Worker`` through vLLM's
   ``WorkerWrapperBase``) for the specs and the layouts, groups the layers,
   and has the worker call the runner's ``initialize_kv_cache``, which makes
   the attention groups, their builders (``AttentionGroup
   .create_metadata_builders``) and the runner's ``CudaGraphManager``. Only
   the device's free memory is an answer of the harness
   (:data:`KV_CACHE_BYTES`: there is no device memory to profile here);
3. the runner's own ``capture_model()``: for every FULL descriptor its
   ``CudaGraphManager`` holds, the warm-up and the capture, each building the
   metadata through ``prepare_inputs_to_capture`` -> the model state's
   ``prepare_attn`` -> ``build_attn_metadata(..., for_cudagraph_capture=True)``
   -> each attention group's builder in the runner's order.

For a whole start-up, step by step: :func:`load_runner` is step 1 alone (a
vendor's subclass of the runner may stand in for vLLM's), and
:func:`initialize_kv_cache` takes ``profile``, which runs where vLLM's worker
profiles its memory (the executor's ``determine_available_memory``, after the
engine core resolved the KV-cache layout): there the worker calls the
runner's own ``profile_cudagraph_memory``. After capture,
:func:`execute_dummy_batch` is an idle data-parallel rank's step at serving
time, through vLLM's worker's own ``execute_dummy_batch``. The runner's own
calls run under :func:`driving` (:func:`capture` and
:func:`execute_dummy_batch` enter it themselves; a ``profile`` that captures
needs it around :func:`initialize_kv_cache`).

What each metadata build did is read at the model state's ``prepare_attn``
(:func:`observe`, on the instance: the batch vLLM's dummy batch made before
the builders ran, and the shared offsets after them). The capture sizes are
the manager's own descriptors. Where vLLM stops (the first capture that
raises) the drive stops too.

On a host without a GPU (:func:`cpu_setup`) the runner runs as vLLM's own
CPU worker runs Model Runner V2: vLLM's CPU shims
(``vllm.v1.worker.cpu.shm``: stream, event and pinned-memory stand-ins,
host buffers instead of UVA views), Triton's kernels in Triton's interpreter
(set up before vLLM is imported, :func:`vllm_capture_guard.tools.simulate
.use_triton_interpreter`), and ``torch.cuda.graph`` recorded instead of
captured (:mod:`.streams`). A platform vLLM does not recognise answers no
memory question: the memory in use is 0 and there is no graph pool.
"""

from vllm_capture_guard.tools.harness.v2.make import (
    CPU_SHIMS,
    KV_CACHE_BYTES,
    V2_ENV,
    chosen,
    cpu_setup,
    initialize_kv_cache,
    load_runner,
    make_config,
    make_runner,
    worker,
)
from vllm_capture_guard.tools.harness.v2.watch import (
    Build,
    Descriptor,
    V2Capture,
    capture,
    driving,
    execute_dummy_batch,
    full_descriptors,
    observe,
)

__all__ = [
    "CPU_SHIMS",
    "KV_CACHE_BYTES",
    "V2_ENV",
    "Build",
    "Descriptor",
    "V2Capture",
    "capture",
    "chosen",
    "cpu_setup",
    "driving",
    "execute_dummy_batch",
    "full_descriptors",
    "initialize_kv_cache",
    "load_runner",
    "make_config",
    "make_runner",
    "observe",
    "worker",
]
