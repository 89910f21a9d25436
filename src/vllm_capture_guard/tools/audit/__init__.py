# SPDX-License-Identifier: Apache-2.0
"""Audit every attention backend that the installed vLLM registers: does its
capture write into the metadata that other builders read?

``registry`` which backends vLLM registers;
``build``    their builders on the CPU (configs, layers, KV-cache specs) and
             the later builders of the sequenced check;
``run``      the captures and the sequenced check (through the harness);
``schema``   the result as data (``audit --json``), statuses as enums;
``render``   the result as plain text;
``command``  ``vllm-capture-guard audit``.

Importing this package imports neither vLLM nor torch.
"""
