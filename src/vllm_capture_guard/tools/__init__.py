# SPDX-License-Identifier: Apache-2.0
"""The tools wing: the command line, the capture harness, the audit, the
oracle, the in-tree patcher and the test helpers. None of it is loaded by
vLLM; it is what we (and image builders) run to check the runtime wing.
"""
