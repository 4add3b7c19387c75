"""Hypothesis profiles of the fuzz tests: ``ci`` (the default: a few dozen cases per test,
derandomized, so that ``make test`` stays short and repeatable) and ``full`` (10,000 cases per test,
or ``KVARN_FUZZ_EXAMPLES``; random seeds), chosen by ``KVARN_FUZZ_PROFILE``; ``tools/fuzz.py`` runs the full profile.

Every property says: a generated input is served correctly (checked against the reference) or
refused with an error whose message names the bad value; anything else (another exception, a
crash of the process, a hang) fails.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

from tests.fixtures import _one_thread  # noqa: F401  (autouse)

PROFILE_ENV = "KVARN_FUZZ_PROFILE"
FULL_EXAMPLES = int(os.environ.get("KVARN_FUZZ_EXAMPLES", "10000"))  # tools/fuzz.py --examples

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, suppress_health_check=_QUIET)
settings.register_profile(
    "full", max_examples=FULL_EXAMPLES, deadline=None, suppress_health_check=_QUIET, print_blob=True
)
settings.load_profile(os.environ.get(PROFILE_ENV, "ci"))
