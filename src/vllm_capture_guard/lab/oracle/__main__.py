# SPDX-License-Identifier: Apache-2.0
import sys

from vllm_capture_guard.lab.oracle.cli import main

sys.exit(main())
