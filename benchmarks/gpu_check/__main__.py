# SPDX-License-Identifier: Apache-2.0
"""python -m benchmarks.gpu_check: see the package docstring."""

import sys

from benchmarks.gpu_check.driver import main

sys.exit(main())
