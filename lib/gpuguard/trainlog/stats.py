"""Small robust-statistics helpers for the analysis. Pure."""

from __future__ import annotations

import statistics
from typing import Sequence

MAD_TO_SIGMA = 1.4826  # the MAD of a normal distribution times this is its standard deviation


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def mad(values: Sequence[float], center: float) -> float:
    """Median absolute deviation around `center`, scaled to a standard deviation (robust to the spikes being
    looked for, unlike the mean and standard deviation)."""
    return MAD_TO_SIGMA * statistics.median(abs(v - center) for v in values)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted, non-empty sequence."""
    return sorted_values[min(len(sorted_values) - 1, int(round(q * (len(sorted_values) - 1))))]


def runs(indices: Sequence[int]) -> list[list[int]]:
    """[3, 4, 5, 9, 10] -> [[3, 4, 5], [9, 10]]: consecutive positions grouped into episodes."""
    groups: list[list[int]] = []
    for i in indices:
        if groups and i == groups[-1][-1] + 1:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
