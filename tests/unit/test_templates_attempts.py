"""How an attempt ended and what happens next (pure), on recorded job output, and `gpuguard job-attempt`
begin/end at the I/O edge: a fake scontrol that logs its argv, the real ledger file and the real SQLite store."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from gpuguard.templates.attempts import (AttemptFacts, DEFAULT_NO_RETRY, NodeInfo, Policy, decide,
                                         no_retry_match, node_failures_in_log)
from gpuguard.templates.jobattempt import JobContext, Scontrol, begin, end, policy_from_args

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "templates" / "output"
OK = frozenset({"ALLOCATED"})


def nodes(**flags):
    return {n: NodeInfo(n, frozenset(f.split("+")) if f else OK, None) for n, f in flags.items()}


def facts(**kw):
    base = dict(attempt=1, exit_code=1, event="none", restarts_at_start=0, restarts_now=0, job_state="RUNNING",
                nodes=nodes(node1="", node2=""))
    base.update(kw)
    return AttemptFacts(**base)


@pytest.mark.parametrize("f,policy,expect", [
    (facts(exit_code=0), Policy(), ("completed", "finished", False, ())),
    (facts(), Policy(), ("app_error", "requeued", True, ())),
    (facts(attempt=4), Policy(max_requeues=3), ("app_error", "gave_up", False, ())),
    (facts(attempt=3), Policy(max_requeues=3), ("app_error", "requeued", True, ())),
    (facts(exit_code=2), Policy(no_retry_exit_codes=(2,)), ("no_retry", "gave_up", False, ())),
    (facts(nodes=nodes(node1="", node2="MIXED+DRAIN")), Policy(), ("node_failure", "requeued", True, ("node2",))),
    (facts(event="timelimit", exit_code=0), Policy(), ("time_limit", "requeued", True, ())),
    (facts(event="timelimit", exit_code=0, attempt=2), Policy(max_requeues=1), ("time_limit", "gave_up", False, ())),
    # SIGTERM after Slurm itself requeued the job (slurmd lost): record, exclude, do not requeue again
    (facts(event="term", restarts_now=1, nodes=nodes(node1="", node2="DOWN+NOT_RESPONDING")), Policy(),
     ("node_failure", "requeued", False, ("node2",))),
    (facts(event="term", restarts_now=1, preempted=True), Policy(), ("preempted", "requeued", False, ())),
    (facts(event="term", restarts_now=1), Policy(), ("requeued_externally", "requeued", False, ())),
    (facts(event="term", job_state="CANCELLED"), Policy(), ("cancelled", "gave_up", False, ())),
    (facts(event="term", job_state="COMPLETING", preempted=True), Policy(), ("preempted", "requeued", True, ())),
    (facts(event="term", job_state="TIMEOUT"), Policy(), ("time_limit", "requeued", True, ())),
    # USR1 sent by gpuguard monitor (scancel --batch --signal=USR1) for a hung job, not by the time limit
    (facts(event="timelimit", exit_code=0, monitor_requeue="monitor.progress on node2"), Policy(),
     ("hang", "requeued", True, ())),
])
def test_decide(f, policy, expect):
    d = decide(f, policy)
    assert (d.reason, d.action, d.requeue, d.exclude) == expect, d.detail


def test_exit_codes_for_the_batch_script():
    assert decide(facts(exit_code=0), Policy()).exit_code == 0
    assert decide(facts(exit_code=7, attempt=9), Policy()).exit_code == 7
    assert decide(facts(event="timelimit", exit_code=0, attempt=9), Policy()).exit_code == 1  # gave up: not success
    assert decide(facts(event="timelimit", exit_code=0), Policy()).signal == 10


def test_recorded_outputs_are_classified():
    app = (OUT / "torchrun_app_error.out").read_text()
    assert no_retry_match(app, DEFAULT_NO_RETRY) is None  # a RuntimeError may well pass next time
    assert decide(facts(log_tail=app), Policy()).reason == "app_error"
    syntax = (OUT / "torchrun_syntax_error.out").read_text()
    line, why = no_retry_match(syntax, DEFAULT_NO_RETRY)
    assert line == "SyntaxError: invalid syntax" and "every attempt" in why
    d = decide(facts(log_tail=syntax), Policy())
    assert (d.reason, d.action) == ("no_retry", "gave_up")
    nf = (OUT / "srun_node_failure.out").read_text()
    assert node_failures_in_log(nf) == {"node2"}
    d = decide(facts(log_tail=nf, exit_code=143), Policy())  # node2 looks fine now, srun saw it fail
    assert (d.reason, d.exclude) == ("node_failure", ("node2",))


def test_warnings_that_mention_import_errors_are_not_fatal():
    text = ("/opt/venv/lib/python3.11/site-packages/apex/__init__.py:12: UserWarning: ImportError: fused kernels "
            "unavailable, falling back\n[rank0]: RuntimeError: NCCL error: remote process exited\n")
    assert no_retry_match(text, DEFAULT_NO_RETRY) is None
    assert no_retry_match("[rank3]: ModuleNotFoundError: No module named 'flash_attn'\n", DEFAULT_NO_RETRY)
    assert no_retry_match("1: train.py: error: unrecognized arguments: --lr\n", DEFAULT_NO_RETRY)
    custom = policy_from_args(3, [], ["CUDA out of memory"])
    assert no_retry_match("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried", custom.no_retry_patterns)


# --------------------------------------------------------------------------- job-attempt at the I/O edge


FAKE_SCONTROL = r"""#!/bin/bash
printf '%s\n' "$*" >> "$FAKE_DIR/calls.log"
case "$1 $2" in
  "show job") cat "$FAKE_DIR/job.txt" ;;
  "show hostnames") for h in $(echo "$3" | tr ',' ' '); do
      case "$h" in "node[1-2]") printf 'node1\nnode2\n';; "node[1-3]") printf 'node1\nnode2\nnode3\n';; *) echo "$h";; esac
    done ;;
  "show node") cat "$FAKE_DIR/nodes.txt" ;;
  "requeue "*) [ -e "$FAKE_DIR/requeue_fails" ] && { echo "slurm_requeue error: Access denied" >&2; exit 1; }; true ;;
esac
"""


@pytest.fixture
def fake(tmp_path, monkeypatch):
    d = tmp_path / "fake"
    d.mkdir()
    (d / "scontrol").write_text(FAKE_SCONTROL)
    (d / "scontrol").chmod(0o755)
    log = tmp_path / "job.out"
    log.write_text("old output of an earlier attempt: SyntaxError: not this attempt's\n")
    (d / "job.txt").write_text(f"JobId=77 JobName=train JobState=RUNNING Reason=None Requeue=1 Restarts=0 "
                               f"ExcNodeList=node9 NodeList=node[1-2] StdOut={log}\n")
    (d / "nodes.txt").write_text("NodeName=node1 State=ALLOCATED Reason=\nNodeName=node2 State=ALLOCATED\n")
    monkeypatch.setenv("FAKE_DIR", str(d))
    ctx = JobContext(job_id="77", node="node1", nodelist="node[1-2]", restarts_at_start=0,
                     store_path=str(tmp_path / "state" / "node1.db"), scontrol=Scontrol(str(d / "scontrol"), 10))
    return ctx, d, log, tmp_path / "job"


def _calls(d):
    return (d / "calls.log").read_text().splitlines()


def _store(ctx):
    with sqlite3.connect(ctx.store_path) as c:
        c.row_factory = sqlite3.Row
        return [dict(r) for r in c.execute("SELECT * FROM attempts ORDER BY id")]


def test_app_error_is_recorded_and_requeued(fake):
    ctx, d, log, job_dir = fake
    ckpt = job_dir.parent / "ckpt"
    (ckpt / "step-3").mkdir(parents=True)
    (ckpt / "step-3" / "m.pt").write_text("x")
    assert begin(ctx, job_dir, 1, str(ckpt), "glob", "step-*") == str(ckpt / "step-3")
    with log.open("a") as fh:
        fh.write("[rank0]: RuntimeError: NCCL communicator was aborted\n")
    dec = end(ctx, job_dir, 1, 1, "none", policy_from_args(3, [], []))
    assert (dec.reason, dec.action) == ("app_error", "requeued")  # the old SyntaxError line is not this attempt's
    assert "requeue 77" in _calls(d)
    ledger = [json.loads(x) for x in (job_dir / "attempts.jsonl").read_text().splitlines()]
    assert ledger[0]["attempt"] == 1 and ledger[0]["nodes"] == "node[1-2]" and ledger[0]["exit_code"] == 1
    assert ledger[0]["resumed_from"] == str(ckpt / "step-3")
    row = _store(ctx)[0]
    assert (row["job_id"], row["attempt"], row["reason"], row["action"], row["exit_code"]) == \
        ("77", 1, "app_error", "requeued", 1)


def test_node_failure_requeues_and_excludes_the_node(fake):
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    (d / "nodes.txt").write_text("NodeName=node1 State=ALLOCATED\nNodeName=node2 State=MIXED+DRAIN "
                                 "Reason=gpuguard: XID79 gpu.xid: GPU fell off the bus [healthcheck reboot] "
                                 "[root@2026-11-22T04:00:00]\n")
    dec = end(ctx, job_dir, 1, 1, "none", policy_from_args(3, [], []))
    assert (dec.reason, dec.exclude) == ("node_failure", ("node2",))
    calls = _calls(d)
    # requeue first (ExcNodeList cannot change while the job runs), then add node2 to the existing exclusions
    assert calls.index("requeue 77") < calls.index("update JobId=77 ExcNodeList=node2,node9")
    assert "gpuguard: XID79 gpu.xid" in dec.detail
    assert _store(ctx)[0]["excluded"] == "node2"


def test_slurm_requeued_after_node_loss_only_excludes(fake):
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    (d / "job.txt").write_text("JobId=77 JobState=COMPLETING Reason=None Restarts=1 ExcNodeList=(null) "
                               f"NodeList=node1 StdOut={log}\n")
    (d / "nodes.txt").write_text("NodeName=node1 State=IDLE\nNodeName=node2 State=DOWN+NOT_RESPONDING "
                                 "Reason=Not responding [slurm@2026-11-22T04:07:37]\n")
    dec = end(ctx, job_dir, 1, 143, "term", policy_from_args(3, [], []))
    assert (dec.reason, dec.action, dec.requeue) == ("node_failure", "requeued", False)
    calls = _calls(d)
    assert not any(c.startswith("requeue") for c in calls)
    assert "update JobId=77 ExcNodeList=node2" in calls


def test_lost_attempt_is_recorded_by_the_next_one(fake):
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)  # attempt 1 starts, then its batch host dies: no end record
    ctx2 = JobContext(job_id="77", node="node3", nodelist="node[1,3]", restarts_at_start=1,
                      store_path=ctx.store_path, scontrol=ctx.scontrol)
    (d / "nodes.txt").write_text("NodeName=node1 State=ALLOCATED\nNodeName=node2 State=DOWN\n")
    begin(ctx2, job_dir, 2)
    ledger = [json.loads(x) for x in (job_dir / "attempts.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["reason"], r["action"], r["excluded"]) for r in ledger] == \
        [(1, "node_failure", "requeued", ["node2"])]


def test_failed_requeue_gives_up_loudly(fake):
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    (d / "requeue_fails").touch()
    dec = end(ctx, job_dir, 1, 1, "none", policy_from_args(3, [], []))
    assert dec.action == "gave_up" and dec.exit_code == 1
    ledger = [json.loads(x) for x in (job_dir / "attempts.jsonl").read_text().splitlines()]
    assert [r["action"] for r in ledger] == ["requeued", "gave_up"]
    assert "scontrol requeue failed" in ledger[1]["detail"]


def test_unwritable_store_still_writes_the_ledger(fake, capsys):
    ctx, d, log, job_dir = fake
    blocker = job_dir.parent / "not-a-dir"
    blocker.write_text("")
    ctx.store_path = str(blocker / "x.db")
    begin(ctx, job_dir, 1)
    dec = end(ctx, job_dir, 1, 0, "none", policy_from_args(3, [], []))
    assert dec.action == "finished"
    assert len((job_dir / "attempts.jsonl").read_text().splitlines()) == 1
    assert "not recorded in the history store" in capsys.readouterr().err


def test_a_monitor_requeue_is_recorded_as_a_hang(fake):
    """The monitor's requeue reaches the batch shell as USR1, like the time limit: the ledger still says hang."""
    import time as _t

    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    (job_dir / "gpuguard").mkdir(parents=True, exist_ok=True)
    with open(job_dir / "gpuguard" / "events.jsonl", "a") as f:
        f.write(json.dumps({"ts": _t.time() - 3600, "kind": "requeue", "check": "old", "ok": True}) + "\n")
        f.write("not json\n")
        f.write(json.dumps({"ts": _t.time(), "node": "node2", "kind": "requeue", "check": "monitor.progress",
                            "ok": True, "detail": "scancel --batch --signal=USR1 77"}) + "\n")
    dec = end(ctx, job_dir, 1, 0, "timelimit", policy_from_args(3, [], []))
    assert (dec.reason, dec.action) == ("hang", "requeued") and "monitor.progress on node2" in dec.detail
    assert _store(ctx)[0]["reason"] == "hang"
