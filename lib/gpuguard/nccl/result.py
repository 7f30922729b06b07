"""What nccl-tests measured, as plain data: one row per message size and the run's figures. The parsers
(gpuguard.nccl.table for the text table, gpuguard.nccl.parse for `-J` JSON and either) produce it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass
class NcclRow:
    """One message size. Bandwidths in GB/s as nccl-tests prints them (1e9 bytes/s); None = not reported."""

    size_bytes: int
    count: int
    dtype: str
    redop: Optional[str] = None
    root: Optional[int] = None
    oop_time_us: Optional[float] = None
    oop_algbw: Optional[float] = None
    oop_busbw: Optional[float] = None
    oop_wrong: Optional[float] = None  # modern `#wrong` (element count); None = N/A
    ip_time_us: Optional[float] = None
    ip_algbw: Optional[float] = None
    ip_busbw: Optional[float] = None
    ip_wrong: Optional[float] = None
    oop_error: Optional[float] = None  # legacy `error` column: max relative error, not a count
    ip_error: Optional[float] = None

    @property
    def busbw(self) -> Optional[float]:
        """Out-of-place bus bandwidth, the figure health decisions use (in-place when only that was run)."""
        return self.oop_busbw if self.oop_busbw is not None else self.ip_busbw


@dataclass
class NcclResult:
    format: str = "text"  # text | json
    rows: list[NcclRow] = field(default_factory=list)
    avg_busbw_gbps: Optional[float] = None  # the footer's "Avg bus bandwidth" (mean over all sizes)
    out_of_bounds: Optional[int] = None  # the footer's "Out of bounds values"
    layout: Optional[str] = None  # modern | legacy (text only)
    prefix: Optional[str] = None  # srun | mpirun | None
    collective: Optional[str] = None  # all_reduce_perf, AllReduce, ...
    nccl_tests_version: Optional[str] = None
    nccl_version: Optional[str] = None
    ranks: Optional[int] = None
    hosts: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)  # nThread, nGpus, minBytes, maxBytes, iters, ...
    footer: bool = False  # the run reached its summary lines
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # NCCL WARN / test failure lines, "# error:" lines

    # ------------------------------------------------------------------ figures
    @property
    def peak_busbw_gbps(self) -> Optional[float]:
        """Maximum out-of-place bus bandwidth over the data rows."""
        values = [r.oop_busbw for r in self.rows if r.oop_busbw is not None]
        return max(values) if values else None

    @property
    def largest(self) -> Optional[NcclRow]:
        return max(self.rows, key=lambda r: r.size_bytes) if self.rows else None

    def busbw_at(self, size_bytes: int) -> Optional[float]:
        for r in self.rows:
            if r.size_bytes == size_bytes:
                return r.busbw
        return None

    def large_busbw(self, min_bytes: int = 0) -> tuple[Optional[int], Optional[float]]:
        """(size, busbw) of the largest message measured, if it is at least `min_bytes`: the bandwidth plateau,
        which is what a slow link or GPU pulls down. (None, None) when no row is large enough."""
        row = self.largest
        if row is None or row.size_bytes < min_bytes or row.busbw is None:
            return None, None
        return row.size_bytes, row.busbw

    @property
    def wrong_total(self) -> Optional[float]:
        """Sum of the `#wrong` columns (None when the layout has none or every value was N/A)."""
        values = [v for r in self.rows for v in (r.oop_wrong, r.ip_wrong) if v is not None]
        return sum(values) if values else None

    @property
    def complete(self) -> bool:
        return bool(self.rows) and self.footer

    def summary(self) -> dict[str, Any]:
        """The report shape `gpuguard nccl parse --json` prints (and the torch probe reproduces)."""
        size, large = self.large_busbw()
        return {
            "rows": len(self.rows),
            "peak_busbw_gbps": _round(self.peak_busbw_gbps),
            "avg_busbw_gbps": _round(self.avg_busbw_gbps),
            "out_of_bounds": self.out_of_bounds,
            "largest_size_bytes": size,
            "busbw_at_largest_gbps": _round(large),
            "wrong_total": self.wrong_total,
            "format": self.format,
            "layout": self.layout,
            "prefix": self.prefix,
            "collective": self.collective,
            "nccl_tests_version": self.nccl_tests_version,
            "nccl_version": self.nccl_version,
            "ranks": self.ranks,
            "hosts": list(self.hosts),
            "footer": self.footer,
            "warnings": list(self.warnings),
            "errors": list(self.errors),
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _round(v: Optional[float], nd: int = 3) -> Optional[float]:
    return None if v is None else round(v, nd)


class NcclParseError(ValueError):
    """The input is not nccl-tests output at all (nothing recognisable)."""
