"""How many examples the property tests (hypothesis) draw, from one switch: GPUGUARD_HYPOTHESIS.

- unset or `default`: a quarter of each test's nominal count (at least 10), for `make test` on CI's 2 cores;
- `thorough`: four times the nominal count, for a long run before a release (`GPUGUARD_HYPOTHESIS=thorough make
  unit`).

The properties are the same in both; only the number of generated inputs changes. Every example that ever failed is
replayed first from hypothesis' example database (.hypothesis/), whatever the profile, and the `@example`s a test
names always run. tests/conftest.py registers and loads the matching hypothesis profile (tests without a count of
their own: 25 or 400 examples instead of hypothesis' 100)."""

from __future__ import annotations

import os

PROFILES = {"default": 0.25, "thorough": 4.0}
MIN_EXAMPLES = 10


def profile() -> str:
    name = os.environ.get("GPUGUARD_HYPOTHESIS", "") or "default"
    if name not in PROFILES:
        raise ValueError(f"GPUGUARD_HYPOTHESIS={name!r}: one of {', '.join(PROFILES)}")
    return name


def examples(nominal: int) -> int:
    """A test's example count under the current profile (`nominal`: its count in a plain hypothesis run)."""
    return max(MIN_EXAMPLES, round(nominal * PROFILES[profile()]))
