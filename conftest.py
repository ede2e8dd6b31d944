# SPDX-License-Identifier: Apache-2.0
"""Settings for every test folder (tests/, benchmarks/tests/, reliability/tests/): the
hypothesis profiles (``HYPOTHESIS_PROFILE=thorough`` for long runs)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", parent=settings.get_profile("ci"), max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
