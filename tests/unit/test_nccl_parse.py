"""nccl-tests parsers on recorded outputs (tests/fixtures/nccl, sources in README.md) and on the layout
variants seen in the wild: prefixes, legacy columns, INFO lines inside the table, lost '#', N/A, JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuguard.nccl.parse import parse_nccl, parse_nccl_json
from gpuguard.nccl.result import NcclParseError
from gpuguard.nccl.table import nccl_version_string, parse_nccl_text, parse_size

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nccl"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("name,rows,peak,avg,oob,layout,prefix", [
    ("p5_2node_srun_label.txt", 32, 487.09, None, None, "modern", "srun"),
    ("p4de_2node_srun_label.txt", 29, 78.33, None, None, "modern", "srun"),
    ("p4d_2node_legacy_format.txt", 6, 42.61, 25.6327, 0, "legacy", None),
    ("mpirun_tag_output_p4d_legacy.txt", 28, 32.71, 7.80081, 0, "legacy", "mpirun"),
    ("alltoall_redop_none_na_wrong.txt", 28, 4.61, 2.06935, 0, "modern", None),
    ("legacy_alltoall_blank_redop.txt", 2, 0.51, 0.507636, 0, "legacy", None),
    ("gb200_nvl72_modern_no_prefix.txt", 5, 839.16, 745.53, 0, "modern", None),
    ("gb200_nvl72_json_v3.json", 5, 839.16, 745.53, 0, "json", None),
])
def test_fixture_figures(name, rows, peak, avg, oob, layout, prefix):
    res = parse_nccl(fixture(name))
    s = res.summary()
    assert s["rows"] == rows
    assert s["peak_busbw_gbps"] == pytest.approx(peak)
    assert s["avg_busbw_gbps"] == (pytest.approx(avg, abs=1e-3) if avg is not None else None)
    assert s["out_of_bounds"] == oob
    assert res.layout == layout and res.prefix == prefix
    assert s["footer"] is (avg is not None)


def test_fixtures_name_their_source():
    for path in sorted(FIXTURES.glob("*.*")):
        if path.name == "README.md":
            continue
        assert path.read_text().startswith("# source: "), path.name


def test_p5_srun_rows_keep_every_column():
    res = parse_nccl_text(fixture("p5_2node_srun_label.txt"))
    first, last = res.rows[0], res.rows[-1]
    assert (first.size_bytes, first.count, first.dtype, first.redop, first.root) == (8, 2, "float", "sum", -1)
    assert (last.size_bytes, last.oop_time_us, last.oop_algbw, last.oop_busbw, last.oop_wrong) == \
        (17179869184, 66132.0, 259.78, 487.09, 0.0)
    assert (last.ip_time_us, last.ip_busbw, last.ip_wrong) == (66109.0, 487.26, 0.0)
    assert res.large_busbw(1 << 30) == (17179869184, 487.09)
    assert res.busbw_at(1073741824) == 436.95
    assert "no footer" in res.warnings[0]


def test_missing_footer_is_reported_not_invented():
    res = parse_nccl_text(fixture("p4de_2node_srun_label.txt"))
    assert res.avg_busbw_gbps is None and res.out_of_bounds is None and not res.complete


def test_legacy_error_column_is_not_a_wrong_count():
    res = parse_nccl_text(fixture("p4d_2node_legacy_format.txt"))
    assert res.rows[0].oop_error == 5e-07 and res.rows[0].oop_wrong is None
    assert res.wrong_total is None  # a float max-error is not "wrong elements"
    assert res.rows[0].root is None and res.rows[0].redop == "sum"


def test_mpirun_prefixes_and_info_lines_of_other_ranks_inside_the_table():
    res = parse_nccl_text(fixture("mpirun_tag_output_p4d_legacy.txt"))
    assert res.rows[0].size_bytes == 8 and res.rows[-1].size_bytes == 1073741824
    assert not res.warnings and not res.errors


def _indented_rank0_rows() -> str:
    """The fixture's rank-0 data rows only (no header, no INFO lines), each indented as when a log is pasted into
    a ticket: `  [1,0]<stdout>:           8  2  float  sum ...`."""
    rows = [ln for ln in fixture("mpirun_tag_output_p4d_legacy.txt").splitlines()
            if ln.startswith("[1,0]<stdout>:") and ln.split(":", 1)[1].strip()[:1].isdigit()]
    return "\n".join("  " + ln for ln in rows) + "\n"


def test_indented_mpirun_prefixes_without_a_header():
    text = _indented_rank0_rows()
    assert text.startswith("  [1,0]<stdout>:           8")
    res = parse_nccl_text(text)
    assert res.prefix == "mpirun" and res.layout == "legacy"
    assert len(res.rows) == 28 and res.rows[0].size_bytes == 8 and res.rows[-1].size_bytes == 1073741824
    assert res.rows[-1].busbw == parse_nccl_text(fixture("mpirun_tag_output_p4d_legacy.txt")).rows[-1].busbw
    srun = "\n".join("   0: " + ln.split(":", 1)[1] for ln in text.splitlines())
    assert len(parse_nccl_text(srun).rows) == 28
    ray = "\n".join("  (head, rank=0, pid=42) " + ln.split(":", 1)[1] for ln in text.splitlines())
    assert len(parse_nccl_text(ray).rows) == 28


def test_json_nested_too_deeply_is_a_clear_error_not_a_recursion_error():
    from gpuguard.config.yamlutil import NestingError

    deep = '{"results": ' + "[" * 100000
    with pytest.raises(NestingError, match="nested too deeply"):
        parse_nccl_json(deep)
    with pytest.raises(NestingError):
        parse_nccl(deep, strict=True)
    res = parse_nccl(deep)  # a probe or sweep reading tool output gets a result with the error, no exception
    assert not res.rows and "nested too deeply" in res.errors[0]


def test_alltoall_none_redop_and_na_wrong():
    res = parse_nccl_text(fixture("alltoall_redop_none_na_wrong.txt"))
    r = res.rows[-1]
    assert r.redop == "none" and r.oop_wrong == 0 and r.ip_wrong is None
    assert res.rows[0].size_bytes == 0  # size-0 rows are data too
    assert res.wrong_total == 0


def test_legacy_alltoall_with_blank_redop_column():
    res = parse_nccl_text(fixture("legacy_alltoall_blank_redop.txt"))
    assert [r.redop for r in res.rows] == [None, None]
    assert res.rows[0].oop_time_us == 520935 and res.rows[1].ip_error == 1.0


def test_header_without_hash_and_no_rows():
    res = parse_nccl_text(fixture("g5_header_only_no_hash.txt"))
    assert res.rows == [] and res.layout == "modern" and res.peak_busbw_gbps is None
    assert res.ranks == 1 and res.params["ngpus"] == 1 and res.params["max_bytes"] == 16777216


def test_lost_hash_everywhere_still_parses_rows_and_footer():
    text = "\n".join(line.lstrip("#") for line in fixture("gb200_nvl72_modern_no_prefix.txt").splitlines()
                     if not line.startswith("# source") and not line.startswith("# note"))
    res = parse_nccl_text(text)
    assert len(res.rows) == 5 and res.avg_busbw_gbps == 745.53 and res.out_of_bounds == 0


def test_version_header_collective_and_device_lines():
    text = ("# nccl-tests version 2.17.6 nccl-headers=22602 nccl-library=22703\n"
            "# Collective test starting: all_reduce_perf\n"
            "# nThread 1 nGpus 1 minBytes 1024 maxBytes 8589934592 step: 2(factor) warmup iters: 1 iters: 20 agg iters: 1 "
            "validation: 1 graph: 0 unalign: 0\n#\n# Using devices\n"
            "#  Rank  0 Group  0 Pid    653 on gpu-11 device  0 [0000:06:00] NVIDIA H100 80GB HBM3\n"
            "#  Rank  1 Group  0 Pid    654 on gpu-12 device  0 [0000:06:00] NVIDIA H100 80GB HBM3\n"
            + fixture("gb200_nvl72_modern_no_prefix.txt").split("#  Rank 71", 1)[1].split("\n", 1)[1])
    res = parse_nccl_text(text)
    assert res.nccl_tests_version == "2.17.6" and res.nccl_version == "2.27.3"
    assert res.collective == "all_reduce_perf" and res.ranks == 2 and res.hosts == ["gpu-11", "gpu-12"]
    assert res.params["iters"] == 20 and len(res.rows) == 5


def test_blank_lines_trailing_whitespace_and_ray_prefix():
    body = fixture("alltoall_redop_none_na_wrong.txt").splitlines()[2:]
    text = "\n".join(f"(head, rank=0, pid=3808) [1,0]<stdout>:{line}   \n" for line in body)
    res = parse_nccl_text(text)
    assert res.prefix == "mpirun" and len(res.rows) == 28 and res.avg_busbw_gbps == 2.06935


def test_wrong_values_and_failed_footer():
    text = ("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n"
            "   536870912     134217728     float     sum      -1   1200.5  447.21  447.21      3   1190.2  451.08  451.08      5\n"
            "# Out of bounds values : 8 FAILED\n# Avg bus bandwidth    : 449.14\n")
    res = parse_nccl_text(text)
    assert res.wrong_total == 8 and res.out_of_bounds == 8 and res.errors == []


def test_ncc_warn_lines_are_errors_and_no_table_means_no_rows():
    text = ("node1:123:456 [0] NCCL INFO NET/OFI Selected Provider is efa\n"
            "node1:123:456 [0] NCCL WARN NET/OFI Unable to find a usable provider\n"
            "node1: Test NCCL failure common.cu:1005 'unhandled system error'\n")
    res = parse_nccl_text(text)
    assert res.rows == [] and len(res.errors) == 2 and "NCCL WARN" in res.errors[0]


def test_several_tables_from_ranks_without_mpi_warn_and_use_rank_0():
    table = fixture("legacy_alltoall_blank_redop.txt").splitlines()[2:]
    text = "\n".join(f"0: {ln}" for ln in table) + "\n" + "\n".join(f"1: {ln}" for ln in table) + "\n"
    res = parse_nccl_text(text)
    assert len(res.rows) == 2 and any("result tables" in w for w in res.warnings)


def test_malformed_row_is_counted_not_fatal():
    text = fixture("gb200_nvl72_modern_no_prefix.txt") + "  1073741824     268435456     float     sum      -1   3108.8  junk\n"
    res = parse_nccl_text(text)
    assert len(res.rows) == 5 and "could not be read" in res.warnings[0]


def test_json_details_and_nan_and_null_blocks():
    res = parse_nccl_json(fixture("gb200_nvl72_json_v3.json"))
    assert res.nccl_version == "2.25.2" and res.hosts == ["slurm-gb200-207-171"] and res.params["iters"] == 20
    assert res.rows[0].root == -1 and res.rows[0].ip_busbw == 576.74
    doc = json.loads(fixture("gb200_nvl72_json_v3.json").split("\n", 4)[4])
    doc["results"][0]["out_of_place"] = None  # trace replay rows
    doc["results"][1]["in_place"]["bus_bw"] = "nan"
    del doc["average_bus_bandwidth"]
    res = parse_nccl_json(json.dumps(doc))
    assert res.rows[0].oop_busbw is None and res.rows[0].busbw == 576.74
    assert res.rows[1].ip_busbw is None and not res.footer and "no average_bus_bandwidth" in res.warnings[0]


def test_json_errors_are_clear():
    with pytest.raises(NcclParseError, match="not valid nccl-tests JSON"):
        parse_nccl_json('{"results": [')
    with pytest.raises(NcclParseError, match="no results list"):
        parse_nccl_json('{"results": 3}')


def test_parse_nccl_picks_the_format():
    assert parse_nccl(fixture("gb200_nvl72_json_v3.json")).format == "json"
    assert parse_nccl(fixture("gb200_nvl72_modern_no_prefix.txt")).format == "text"


def test_small_helpers():
    assert nccl_version_string(22703) == "2.27.3" and nccl_version_string(2708) == "2.7.8"
    assert parse_size("512M") == 536870912 and parse_size("4G") == 4294967296 and parse_size("8") == 8
    with pytest.raises(ValueError):
        parse_size("lots")
