# SPDX-License-Identifier: Apache-2.0
"""``python -m ibpembed``: the ``ibpembed`` command, for an environment without its script."""

import sys

from ibpembed.cli import main

sys.exit(main())
