"""What a batch of the outbox becomes centrally (gpuguard.fleet.shipbatch), without a database: healthy runs as
per-day counts, a repeated problem as one row with a count (the same node and kind, the same UTC day, the same
verdict and problem findings), `already drained` records counted on the drain they repeat; streaks carried
from batch to batch give what one batch gives. The Python healthy rule is the store's SQL rule."""

from __future__ import annotations

import pytest

pytest.importorskip("psycopg")

from gpuguard.fleet.shipbatch import is_healthy, plan_drains, plan_runs  # noqa: E402
from gpuguard.model import Finding, Severity  # noqa: E402
from gpuguard.store.sqlite import Store  # noqa: E402

DAY = 1795478400.0  # 2026-11-24T00:00:00Z
ORIGIN = "7b0c6a4e-8f3e-4b8e-9d1a-0c9f2e6b5a11"
XID = "gpuguard: XID79 gpu.xid: GPU has fallen off the bus [healthcheck reboot]"


def run(i, t, verdict="pass", kind="healthcheck", reason=None, node="n1"):
    return {"id": i, "node": node, "started": t, "duration_ms": 10.0, "kind": kind, "job_id": None,
            "restart_count": None, "profile": None, "verdict": verdict, "action": None, "reason": reason,
            "exit_code": 0, "error": None, "boot_id": "b"}


def xid(gpu=3, message="Xid 79"):
    return [{"check_id": "gpu.xid", "severity": "fail", "keyword": "XID79", "gpu": gpu, "action": "reboot",
             "message": message, "remediation": "", "evidence": "{}"}]


def test_a_drained_nodes_health_checks_are_one_row_a_day():
    rows = [run(1, DAY + 60)] + [run(i, DAY + 36000 + i * 300, "drain", reason=XID) for i in range(2, 200)]
    problems = {i: xid(message=f"Xid 79 (seen {i} times)") for i in range(2, 200)}  # messages differ
    streaks: dict = {}
    plan = plan_runs(ORIGIN, rows, problems, streaks)
    assert plan.healthy_days == {("n1", DAY)}
    assert len(plan.inserts["runs"]) == 2  # 10:10 day 1, and the first of the next UTC day
    assert len(plan.inserts["findings"]) == 2
    counts = sorted(v[0] for v in plan.repeats.values())
    assert sum(counts) + 2 == 198 and len(counts) == 2


def test_a_healthy_run_another_gpu_or_verdict_ends_a_streak_other_kinds_do_not():
    rows = [run(1, DAY + 100, "drain", reason=XID), run(2, DAY + 400, "pass", kind="prolog"),
            run(3, DAY + 700, "drain", reason=XID), run(4, DAY + 1000), run(5, DAY + 1300, "drain", reason=XID),
            run(6, DAY + 1600, "drain", reason=XID), run(7, DAY + 1900, "warn")]
    problems = {1: xid(), 3: xid(), 5: xid(), 6: xid(gpu=4), 7: xid()}
    plan = plan_runs(ORIGIN, rows, problems, {})
    assert [p[1] for p in plan.inserts["runs"]] == [1, 5, 6, 7]  # 3 repeats 1 (a prolog in between is no break)
    assert list(plan.repeats.values()) == [(1, DAY + 700, 3)]


@pytest.mark.parametrize("cut", [1, 7, 50, 120, 198])
def test_streaks_carried_across_batches_give_what_one_batch_gives(cut):
    rows = [run(i, DAY + 80000 + i * 300, "drain", reason=XID) for i in range(1, 200)]
    problems = {i: xid() for i in range(1, 200)}
    whole = plan_runs(ORIGIN, rows, problems, {})
    streaks: dict = {}
    first = plan_runs(ORIGIN, rows[:cut], problems, streaks)
    second = plan_runs(ORIGIN, rows[cut:], problems, streaks)
    assert first.inserts["runs"] + second.inserts["runs"] == whole.inserts["runs"]
    assert {**first.repeats, **second.repeats} == whole.repeats


def drain(i, t, op="drain", outcome="already", reason=XID, check="gpu.xid"):
    return {"id": i, "ts": t, "node": "n1", "op": op, "outcome": outcome, "reason": reason, "check_id": check,
            "action": "reboot", "run_id": i, "detail": ""}


def test_already_drained_records_count_on_the_drain_they_repeat():
    flap = "gpuguard: FLAPPING gpu.xid: drained again after 2 undrains in 24h: x [healthcheck replace]"
    rows = [drain(1, DAY + 10, outcome="done"), drain(2, DAY + 20), drain(3, DAY + 30),
            drain(4, DAY + 40, outcome="failed"), drain(5, DAY + 50), drain(6, DAY + 60),
            drain(7, DAY + 70, reason=flap), drain(8, DAY + 80, op="undrain", outcome="done"), drain(9, DAY + 90)]
    streaks: dict = {}
    plan = plan_drains(ORIGIN, rows, streaks)
    assert [p[1] for p in plan.inserts["drains"]] == [1, 4, 5, 7, 8, 9]
    assert plan.repeats == {("drains", 1, DAY + 10): (2, DAY + 30, 3), ("drains", 5, DAY + 50): (1, DAY + 60, 6)}
    assert [p[8] for p in plan.inserts["drains"]] == ["XID79", "XID79", "XID79", "FLAPPING", "XID79", "XID79"]
    assert "n1" in streaks and streaks["n1"]["id"] == 9


def test_the_python_healthy_rule_is_the_stores_sql_rule(tmp_path):
    cases = [("pass", None, None, []), ("pass", None, None, [Finding("gpu.count", Severity.OK, "8")]),
             ("pass", None, None, [Finding("gpu.temperature", Severity.WARN, "warm", "THERMAL")]),
             ("pass", "x", None, []), ("pass", None, "boom", []), ("warn", None, None, []),
             ("drain", XID, None, [Finding("gpu.xid", Severity.FAIL, "x", "XID79")]),
             ("pass", None, None, [Finding("gpu.ecc", Severity.INCOMPLETE, "?")]),
             ("pass", None, None, [Finding("gpu.ecc", Severity.SKIP, "-")])]
    with Store(str(tmp_path / "s.db")) as st:
        ids = [st.record_run(started=DAY + i, duration_ms=1.0, node="n1", kind="healthcheck", job_id=None,
                             profile=None, verdict=v, action=None, reason=r, exit_code=0, error=e, boot_id="b",
                             findings=f) for i, (v, r, e, f) in enumerate(cases)]
        sql = {i for (i,) in st.conn.execute(f"SELECT r.id FROM runs r WHERE {Store.HEALTHY_RUN}")}
        problems: dict = {}
        for p in st.problem_findings(ids[0], ids[-1]):
            problems.setdefault(p["run_id"], []).append(p)
        python = {r["id"] for r in st.rows_after("runs", 0, 100) if is_healthy(r, problems.get(r["id"], []))}
        assert sql == python == {ids[0], ids[1], ids[8]}
        day = st.healthy_day("n1", DAY, ids[-1])
        assert day["runs"] == 3 and day["kinds"] == {"healthcheck": 3} and day["hour_runs"][0] == 3
