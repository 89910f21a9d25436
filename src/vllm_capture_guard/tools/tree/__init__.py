# SPDX-License-Identifier: Apache-2.0
"""The in-tree form: the same backports, written into a vLLM tree.

For image builders who would rather ship a patched vLLM than load a plugin:
``vllm-capture-guard patch --check | --diff | --apply | --revert [--tree PATH]``
(:mod:`.command`). What the patched tree does is what the runtime patches
(:mod:`vllm_capture_guard.runtime.patches`) make it do, and what vLLM 0.29.0
does:

* ``rocm-attn-cpu-offsets`` (vLLM PR #51585; the in-tree form of the capture
  guard, :mod:`..fixes.builder_capture_guard`): ``RocmAttentionMetadataBuilder``'s
  capture stops zeroing the shared ``query_start_loc_cpu``; it still zeroes the
  device ``query_start_loc`` (the #25985 guard);
* ``rocm-aiter-unified-builder`` (vLLM PR #53821,
  :mod:`..fixes.rocm_aiter_unified_builder`): ``RocmAiterUnifiedAttentionBackend``
  gets its own ``RocmAiterUnifiedAttentionMetadataBuilder``, whose capture sets
  ``seq_lens`` to 1 and leaves ``query_start_loc`` alone;
* ``graph-capture-stream`` (vLLM PR #53818, :mod:`..fixes.graph_capture_stream`):
  the three ``torch.cuda.graph(...)``
  calls of Model Runner V2's, the encoder's and Gemma4's capture pass
  ``stream=current_stream()``.

Each change carries a one-line marker comment,
``# vllm-capture-guard: backport of vllm PR #N``, which ``--check`` and
``vllm-capture-guard status`` read.

Why ``ast`` and not libcst: the patcher must run in a bare image-build stage,
so it uses the standard library only. We never print code back from a tree:
``ast`` finds the statements (``lineno``/``end_lineno``/``col_offset``), and
an edit removes, replaces or inserts *whole lines* (:mod:`.source`). Every other
byte of the file, comments and formatting included, stays exactly as it was,
which is all libcst's round-tripping would add. What we insert is our own code.
The result is compiled and recognised again before anything is written.

Found by structure, not by stored text, and strict: a file whose capture we
do not recognise, or that the tree holds only as bytecode, is refused
(``--check`` exits 2, the message names what was not found) and nothing is
written.

Modules: :mod:`.locate` (which tree), :mod:`.source` (a file, its ``ast``,
line edits, markers), :mod:`.plan` (every fix over a tree; each fix's own
reading and edit is in its module of :mod:`vllm_capture_guard.tools.fixes`),
:mod:`.files` (all-or-nothing atomic writes, originals, bytecode, the lock),
:mod:`.command` (the subcommand).
"""
