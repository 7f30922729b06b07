"""How an attempt ended and what happens next (pure), on recorded job output, and `gpuguard job-attempt`
begin/end at the I/O edge: a fake scontrol that logs its argv, the real ledger file and the real SQLite file."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from gpuguard.templates.attempts import (AttemptFacts, Budget, DEFAULT_NO_RETRY, NodeInfo, Policy, WorkerExit,
                                         budget_from_ledger, decide, no_retry_match, node_failures_in_log)
from gpuguard.templates.exclusions import Excluded, nodes_needed, plan_exclusions, unschedulable
from gpuguard.templates.torchrun_report import parse_error_file, parse_torchrun_failures
from gpuguard.templates.jobattempt import CheckpointSpec, JobContext, begin, end, policy_from_args, slurm_requeued
from gpuguard.templates.jobfiles import requeue_asked, user_store_path, worker_exits
from gpuguard.templates.jobslurm import Scontrol

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
    (facts(budget=Budget(failures=3)), Policy(max_failures=3), ("app_error", "gave_up", False, ())),
    (facts(budget=Budget(failures=2)), Policy(max_failures=3), ("app_error", "requeued", True, ())),
    (facts(exit_code=2), Policy(no_retry_exit_codes=(2,)), ("no_retry", "gave_up", False, ())),
    (facts(nodes=nodes(node1="", node2="MIXED+DRAIN")), Policy(), ("node_failure", "requeued", True, ("node2",))),
    (facts(event="timelimit", exit_code=0), Policy(), ("time_limit", "requeued", True, ())),
    (facts(event="timelimit", exit_code=0, budget=Budget(continuations=1)), Policy(max_continuations=1),
     ("time_limit", "gave_up", False, ())),
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
    # issue 29 item 4: USR1 long before the time limit (event stop): the monitor's (hang) or a person's (manual)
    (facts(event="stop", exit_code=0, monitor_requeue="monitor.progress on node2"), Policy(),
     ("hang", "requeued", True, ())),
    (facts(event="stop", exit_code=0), Policy(), ("manual_stop", "requeued", True, ())),
    (facts(event="stop", exit_code=0, budget=Budget(failures=3)), Policy(max_failures=3),
     ("manual_stop", "requeued", True, ())),  # a continuation: it never uses the failure budget
])
def test_decide(f, policy, expect):
    d = decide(f, policy)
    assert (d.reason, d.action, d.requeue, d.exclude) == expect, d.detail


def test_exit_codes_for_the_batch_script():
    assert decide(facts(exit_code=0), Policy()).exit_code == 0
    assert decide(facts(exit_code=7, budget=Budget(failures=9)), Policy()).exit_code == 7
    gave_up = decide(facts(event="timelimit", exit_code=0, budget=Budget(continuations=50)), Policy())
    assert gave_up.action == "gave_up" and gave_up.exit_code == 1  # gave up: not success
    assert decide(facts(event="timelimit", exit_code=0), Policy()).signal == 10


# --------------------------------------------------------------------------- separate budgets


def test_time_limits_never_use_up_the_failure_budget():
    """Issue 10: a healthy job ended FAILED after 4 time limits because one budget counted everything."""
    ledger = [{"attempt": a, "reason": "time_limit", "action": "requeued", "ckpt_step": 100 * a}
              for a in range(1, 5)]
    b = budget_from_ledger(ledger, 5)
    assert (b.failures, b.continuations, b.best_step) == (0, 4, 400)
    d = decide(facts(attempt=5, event="timelimit", exit_code=0, budget=b, checkpointing=True, ckpt_step=500),
               Policy(max_failures=0))
    assert (d.reason, d.action, d.budget) == ("time_limit", "requeued", "continuation"), d.detail
    assert "continuation 5 of 50" in d.detail


def test_failures_count_in_a_row_and_reset_when_the_checkpoint_advances():
    ledger = [{"attempt": 1, "reason": "app_error", "action": "requeued", "ckpt_step": 100},
              {"attempt": 2, "reason": "app_error", "action": "requeued", "ckpt_step": 100},
              {"attempt": 3, "reason": "node_failure", "action": "requeued", "ckpt_step": 100}]
    b = budget_from_ledger(ledger, 4)
    assert b.failures == 3 and b.best_step == 100
    # a 4th failure without progress: over the budget of 3
    d = decide(facts(attempt=4, budget=b, checkpointing=True, ckpt_step=100), Policy(max_failures=3))
    assert d.action == "gave_up" and "3 failed attempt(s) in a row" in d.detail
    # the same failure after the checkpoint moved on: the count starts again
    d = decide(facts(attempt=4, budget=b, checkpointing=True, ckpt_step=150), Policy(max_failures=3))
    assert d.action == "requeued" and "failure 1 of 3" in d.detail
    ledger.append({"attempt": 4, "reason": "app_error", "action": "requeued", "ckpt_step": 150})
    assert budget_from_ledger(ledger, 5).failures == 1


def test_a_time_limit_without_checkpoint_progress_counts_as_a_failure():
    b = Budget(failures=0, continuations=2, best_step=300)
    d = decide(facts(event="timelimit", exit_code=0, budget=b, checkpointing=True, ckpt_step=300), Policy())
    assert (d.reason, d.action, d.budget) == ("time_limit", "requeued", "failure") and "no new checkpoint" in d.detail
    d = decide(facts(event="timelimit", exit_code=0, budget=Budget(failures=3, best_step=300), checkpointing=True,
                     ckpt_step=300), Policy(max_failures=3))
    assert d.action == "gave_up"  # a job that never gets anywhere does not loop forever
    # without a checkpoint directory there is no progress to judge: a plain continuation
    d = decide(facts(event="timelimit", exit_code=0, budget=b), Policy())
    assert d.budget == "continuation"


def test_a_superseded_record_and_prolog_requeues_do_not_count():
    ledger = [{"attempt": 1, "reason": "app_error", "action": "requeued"},
              {"attempt": 1, "reason": "app_error", "action": "gave_up"},  # requeue failed: superseded
              {"attempt": 3, "reason": "preempted", "action": "requeued", "budget": "continuation"}]
    # attempt 2 never reached the batch script (its prolog failed): no record, no budget used
    assert budget_from_ledger(ledger, 4) == Budget(failures=0, continuations=1, best_step=None)


# --------------------------------------------------------------------------- the worker's real exit code


def test_worker_exit_code_from_torchrun_report():
    text = (OUT / "torchrun_worker_exit_3.out").read_text()
    assert parse_torchrun_failures(text) == [WorkerExit(exit_code=3, rank=1, host="localhost")]
    labelled = "\n".join(f"1: {line}" for line in text.splitlines())  # srun --label
    assert parse_torchrun_failures(labelled)[0].exit_code == 3
    app = parse_torchrun_failures((OUT / "torchrun_app_error.out").read_text())
    assert [(w.rank, w.exit_code) for w in app] == [(0, 1)]


def test_worker_exit_code_in_the_no_retry_list_is_not_retried():
    """torchrun exits 1 whatever its worker's code: the recovered code is what no_retry_exit_codes match."""
    log = (OUT / "torchrun_worker_exit_3.out").read_text()
    f = facts(exit_code=1, log_tail=log, workers=tuple(parse_torchrun_failures(log)))
    d = decide(f, Policy(no_retry_exit_codes=(3,)))
    assert (d.reason, d.action, d.exit_code) == ("no_retry", "gave_up", 3)
    assert "rank 1 on localhost exited with code 3" in d.detail and d.worker.exit_code == 3
    # without the recovered code the same attempt is an ordinary, retried error (the bug in issue 10)
    assert decide(facts(exit_code=1, log_tail=log), Policy(no_retry_exit_codes=(3,))).action == "requeued"


def test_error_file_from_record():
    data = json.loads((OUT / "torchrun_error_file_record.json").read_text())
    w = parse_error_file(data, host="node2")
    assert (w.exit_code, w.host, w.source) == (1, "node2", "error_file")
    assert w.message == "ValueError: checkpoint /ck/step-000300 is corrupt"
    assert parse_error_file({"message": {"message": "x", "errorCode": 7}}).exit_code == 7
    assert parse_error_file("garbage") is None and parse_error_file({}) is None


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
    assert no_retry_match("1: [rank3]: ModuleNotFoundError: No module named 'x'\n", DEFAULT_NO_RETRY)
    assert no_retry_match("1: train.py: error: unrecognized arguments: --lr\n", DEFAULT_NO_RETRY)
    custom = policy_from_args(3, [], ["CUDA out of memory"])
    assert no_retry_match("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried", custom.no_retry_patterns)


# --------------------------------------------------------------------------- exclusions


def _info(name, flags="IDLE", boot="2026-11-20T10:00:00", reason=None):
    return NodeInfo(name, frozenset(flags.split("+")), reason, boot_time=boot)


def test_exclusions_are_reevaluated_at_each_requeue():
    current = ["node2", "node5", "node7", "node9"]
    ours = {"node2": Excluded(boot_time="2026-11-20T10:00:00", flagged=True),
            "node5": Excluded(boot_time="2026-11-20T10:00:00", flagged=True),
            "node7": Excluded(boot_time="2026-11-20T10:00:00", flagged=False)}
    infos = {"node2": _info("node2"),                                  # resumed by an admin: healthy again
             "node5": _info("node5", "IDLE+DRAIN", reason="gpuguard: XID79 gpu.xid: ..."),  # still drained
             "node7": _info("node7")}        # only srun's log said it failed, and it has not rebooted since
    plan = plan_exclusions(current, static=["node9"], ours=ours, nodes=infos, new_bad=["node3"])
    assert plan.exclude == ("node3", "node5", "node7", "node9") and plan.dropped == ("node2",)
    # node7 rebooted: trusted again
    infos["node7"] = _info("node7", boot="2026-11-21T08:00:00")
    assert "node7" in plan_exclusions(current, ["node9"], ours, infos, []).dropped
    # a node an admin excluded (not in the ledger) is never dropped
    assert plan_exclusions(["node4"], [], {}, {"node4": _info("node4")}, []).exclude == ("node4",)


def test_unschedulable_warning():
    parts = ["node1", "node2", "node3"]
    assert unschedulable(2, parts, ["node2"]) is None
    w = unschedulable(3, parts, ["node2"])
    assert "needs 3 node(s) but only 2" in w and "BadConstraints" in w
    assert unschedulable(3, [], ["node2"]) is None  # partition unknown: no guess


def test_nodes_needed_is_not_fooled_by_a_job_still_completing_after_a_node_failure():
    """Issue 29 item 2: Slurm showed NumNodes=1 for a 2-node job it had requeued after node2 failed (node1 still
    completing): the exclusion of node2 passed the check and the job pended forever."""
    assert nodes_needed("1", 2) == 2 and nodes_needed("2", 2) == 2 and nodes_needed("4", 2) == 4
    assert nodes_needed("2-4", 3) == 2  # a range: its lower bound
    assert nodes_needed("", 0) == 0 and nodes_needed("garbage", 2) == 2


# --------------------------------------------------------------------------- job-attempt at the I/O edge


FAKE_SCONTROL = r"""#!/bin/bash
printf '%s\n' "$*" >> "$FAKE_DIR/calls.log"
case "$1 $2" in
  "show job") cat "$FAKE_DIR/job.txt" ;;
  "show hostnames") for h in $(echo "$3" | tr ',' ' '); do
      case "$h" in "node[1-2]") printf 'node1\nnode2\n';; "node[1-3]") printf 'node1\nnode2\nnode3\n';; *) echo "$h";; esac
    done ;;
  "show node") cat "$FAKE_DIR/nodes.txt" ;;
  "show partition") [ -e "$FAKE_DIR/partition.txt" ] && cat "$FAKE_DIR/partition.txt" ;;
  "requeue "*) if [ -e "$FAKE_DIR/requeue_fails" ]; then
      # Slurm requeued the job itself a moment earlier (node failure): what `show job` says from now on
      [ -e "$FAKE_DIR/job_after.txt" ] && cp "$FAKE_DIR/job_after.txt" "$FAKE_DIR/job.txt"
      echo "slurm_requeue error: Job is no longer running" >&2; exit 1
    fi ;;
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
                               f"ExcNodeList=node9 NodeList=node[1-2] NumNodes=2 Partition=gpu StdOut={log}\n")
    (d / "nodes.txt").write_text("NodeName=node1 State=ALLOCATED Reason=\nNodeName=node2 State=ALLOCATED\n")
    monkeypatch.setenv("FAKE_DIR", str(d))
    ctx = JobContext(job_id="77", node="node1", nodelist="node[1-2]", restarts_at_start=0,
                     store_path=str(tmp_path / "user" / "attempts-alice.db"),
                     scontrol=Scontrol(str(d / "scontrol"), 10))
    return ctx, d, log, tmp_path / "job"


def _calls(d):
    return (d / "calls.log").read_text().splitlines()


def _store(ctx):
    with sqlite3.connect(ctx.store_path) as c:
        c.row_factory = sqlite3.Row
        return [dict(r) for r in c.execute("SELECT * FROM attempts ORDER BY id")]


def _ledger(job_dir):
    return [json.loads(x) for x in (job_dir / "attempts.jsonl").read_text().splitlines()]


def test_app_error_is_recorded_and_requeued(fake):
    ctx, d, log, job_dir = fake
    ckpt = job_dir.parent / "ckpt"
    (ckpt / "step-3").mkdir(parents=True)
    (ckpt / "step-3" / "m.pt").write_text("x")
    assert begin(ctx, job_dir, 1, str(ckpt), "glob", "step-*") == str(ckpt / "step-3")
    with log.open("a") as fh:
        fh.write("[rank0]: RuntimeError: NCCL communicator was aborted\n")
    dec = end(ctx, job_dir, 1, 1, "none", policy_from_args(3, [], []), CheckpointSpec(str(ckpt), "glob", "step-*"))
    assert (dec.reason, dec.action) == ("app_error", "requeued")  # the old SyntaxError line is not this attempt's
    assert "requeue 77" in _calls(d)
    ledger = _ledger(job_dir)
    assert ledger[0]["attempt"] == 1 and ledger[0]["nodes"] == "node[1-2]" and ledger[0]["exit_code"] == 1
    assert ledger[0]["resumed_from"] == str(ckpt / "step-3")
    assert (ledger[0]["ckpt_step"], ledger[0]["budget"]) == (3, "failure")
    row = _store(ctx)[0]
    assert (row["job_id"], row["attempt"], row["reason"], row["action"], row["exit_code"]) == \
        ("77", 1, "app_error", "requeued", 1)


def test_worker_exit_code_is_recovered_and_recorded(fake):
    """torchrun exits 1; the worker's own code 3 comes from torchrun's report, its message from the error file."""
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    (job_dir / "attempt-1").mkdir()
    (job_dir / "attempt-1" / "torchrun-node1.json").write_text(
        json.dumps({"message": {"message": "SystemExit: bad configuration", "errorCode": 3}}))
    with log.open("a") as fh:
        fh.write((OUT / "torchrun_worker_exit_3.out").read_text())
    dec = end(ctx, job_dir, 1, 1, "none", policy_from_args(3, [3], []))
    assert (dec.reason, dec.action, dec.exit_code) == ("no_retry", "gave_up", 3)
    rec = _ledger(job_dir)[0]
    assert (rec["worker_exit_code"], rec["worker_rank"], rec["worker_host"], rec["worker_exit_source"]) == \
        (3, 1, "localhost", "error_file")
    assert rec["worker_error"] == "SystemExit: bad configuration" and rec["exit_code"] == 1
    assert not any(c.startswith("requeue") for c in _calls(d))


def test_node_failure_requeues_and_excludes_the_node(fake):
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    (d / "nodes.txt").write_text("NodeName=node1 State=ALLOCATED\nNodeName=node2 State=MIXED+DRAIN "
                                 "BootTime=2026-11-20T10:00:00 "
                                 "Reason=gpuguard: XID79 gpu.xid: GPU fell off the bus [healthcheck reboot] "
                                 "[root@2026-11-22T04:00:00]\n")
    dec = end(ctx, job_dir, 1, 1, "none", policy_from_args(3, [], []))
    assert (dec.reason, dec.exclude) == ("node_failure", ("node2",))
    calls = _calls(d)
    # requeue first (ExcNodeList cannot change while the job runs), then add node2 to the existing exclusions
    assert calls.index("requeue 77") < calls.index("update JobId=77 ExcNodeList=node2,node9")
    assert "gpuguard: XID79 gpu.xid" in dec.detail
    rec = _ledger(job_dir)[0]
    assert rec["excluded_boot"] == {"node2": "2026-11-20T10:00:00"} and rec["exclusions"] == ["node2", "node9"]
    assert _store(ctx)[0]["excluded"] == "node2"


def test_a_repaired_node_is_dropped_from_the_exclusions_at_the_next_requeue(fake):
    ctx, d, log, job_dir = fake
    (job_dir).mkdir()
    (job_dir / "attempts.jsonl").write_text(json.dumps(
        {"attempt": 1, "reason": "node_failure", "action": "requeued", "excluded": ["node2"],
         "excluded_boot": {"node2": "2026-11-20T10:00:00"}, "excluded_flagged": {"node2": True}}) + "\n")
    ctx.nodelist = "node[1,3]"
    begin(ctx, job_dir, 2)
    (d / "job.txt").write_text(f"JobId=77 JobState=RUNNING Restarts=1 ExcNodeList=node2 NodeList=node[1,3] "
                               f"NumNodes=2 Partition=gpu StdOut={log}\n")
    (d / "nodes.txt").write_text("NodeName=node1 State=ALLOCATED\nNodeName=node3 State=ALLOCATED\n"
                                 "NodeName=node2 State=IDLE BootTime=2026-11-21T09:00:00\n")
    dec = end(ctx, job_dir, 2, 1, "none", policy_from_args(3, [], []))
    assert dec.action == "requeued"
    assert "update JobId=77 ExcNodeList=" in _calls(d)  # node2 is healthy again: the job may use it
    rec = _ledger(job_dir)[-1]
    assert rec["unexcluded"] == ["node2"] and rec["exclusions"] == []


def test_unschedulable_exclusions_warn(fake, capsys):
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    (d / "partition.txt").write_text("PartitionName=gpu AllowGroups=ALL Nodes=node[1-2] TotalNodes=2\n")
    (d / "nodes.txt").write_text("NodeName=node1 State=ALLOCATED\nNodeName=node2 State=IDLE+DRAIN Reason=bad\n")
    # the job's own `exclude` (never dropped by gpuguard) leaves too few nodes: only a warning is possible
    end(ctx, job_dir, 1, 1, "none", policy_from_args(3, [], []), keep_excluded=["node2"])
    rec = _ledger(job_dir)[0]
    assert "needs 2 node(s) but only 1" in rec["warning"]
    assert "WARNING the job needs 2 node(s)" in capsys.readouterr().err


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
    assert [(r["attempt"], r["reason"], r["action"], r["excluded"], r["budget"]) for r in _ledger(job_dir)] == \
        [(1, "node_failure", "requeued", ["node2"], "failure")]


def test_failed_requeue_gives_up_loudly(fake):
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    (d / "requeue_fails").touch()
    dec = end(ctx, job_dir, 1, 1, "none", policy_from_args(3, [], []))
    assert dec.action == "gave_up" and dec.exit_code == 1
    ledger = _ledger(job_dir)
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
    assert "not recorded in the job store" in capsys.readouterr().err


def test_the_user_side_never_writes_the_hooks_store(tmp_path, capsys):
    """Issue 9: job-attempt runs as the user; the root hooks' database must never need to be user-writable."""
    from gpuguard.config.schema import Config
    from gpuguard.config.sections.store import StoreConfig
    from gpuguard.config.sections.templates import TemplatesConfig

    def cfg(store_path):
        return Config(store=StoreConfig(path=str(tmp_path / "state" / "{node}.db")),
                      templates=TemplatesConfig(store_path=store_path))
    assert user_store_path(cfg(None), "node1", "alice") is None  # no default to the hooks' store any more
    assert user_store_path(cfg(str(tmp_path / "state" / "{node}.db")), "node1", "alice") is None
    assert "hooks' own store" in capsys.readouterr().err
    assert user_store_path(cfg(str(tmp_path / "state" / "x" / ".." / "node1.db")), "node1", "alice") is None
    mine = user_store_path(cfg("/shared/gg/attempts-{user}-{node}.db"), "node1", "alice")
    assert mine == "/shared/gg/attempts-alice-node1.db"


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
    assert (dec.reason, dec.action, dec.budget) == ("hang", "requeued", "failure")
    assert "monitor.progress (asked by node2)" in dec.detail
    assert _store(ctx)[0]["reason"] == "hang"


ASK = {"node": "node1", "kind": "requeue", "check": "monitor.progress", "stuck": ["node2"]}


@pytest.mark.parametrize("events, expected", [
    # intent, then outcome: the ask counts from the moment it is recorded, before the command returns (the stop it
    # causes may end the attempt first), and when the command gave no answer in time (it may have taken effect)
    ([{**ASK, "ts": 100.0, "phase": "asking"}], "monitor.progress, stuck: node2 (asked by node1)"),
    ([{**ASK, "ts": 100.0, "phase": "asking"}, {**ASK, "ts": 100.0, "phase": "done", "ok": True}],
     "monitor.progress, stuck: node2 (asked by node1)"),
    ([{**ASK, "ts": 100.0, "phase": "asking"}, {**ASK, "ts": 100.0, "phase": "done", "ok": None}],
     "monitor.progress, stuck: node2 (asked by node1)"),
    # the command failed: the USR1 that stopped the job was someone else's
    ([{**ASK, "ts": 100.0, "phase": "asking"}, {**ASK, "ts": 100.0, "phase": "done", "ok": False}], None),
    # an earlier attempt's ask does not count; an older monitor's single record does when it succeeded
    ([{**ASK, "ts": 10.0, "phase": "asking"}], None),
    ([{"ts": 100.0, "node": "node2", "kind": "requeue", "check": "monitor.gpu_idle", "ok": True}],
     "monitor.gpu_idle (asked by node2)"),
    ([{"ts": 100.0, "node": "node2", "kind": "requeue", "check": "monitor.gpu_idle", "ok": False}], None),
    ([{**ASK, "ts": "garbage", "phase": "asking"}, {"ts": 100.0, "kind": "hang", "node": "node1"}], None),
])
def test_which_monitor_requeue_the_stop_was(events, expected):
    assert requeue_asked(events, 50.0) == expected


def test_a_stop_that_overtakes_the_monitors_requeue_command_is_still_a_hang(fake):
    """The USR1 can end the attempt before the monitor's requeue command returns (a slow slurmctld, a command
    that times out although the signal went out): its intent, recorded before the command ran, is enough."""
    import time as _t

    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    (job_dir / "gpuguard").mkdir(parents=True, exist_ok=True)
    (job_dir / "gpuguard" / "events.jsonl").write_text(json.dumps({**ASK, "ts": _t.time(), "phase": "asking"}) + "\n")
    dec = end(ctx, job_dir, 1, 0, "stop", policy_from_args(3, [], []))
    assert (dec.reason, dec.action, dec.budget) == ("hang", "requeued", "failure")
    assert "gpuguard monitor requeued a hung job: monitor.progress, stuck: node2 (asked by node1)" in dec.detail


def test_worker_exits_merges_report_and_error_files(tmp_path):
    job = tmp_path / "job"
    (job / "attempt-2").mkdir(parents=True)
    data = (OUT / "torchrun_error_file_record.json").read_text()
    (job / "attempt-2" / "torchrun-node1.json").write_text(data)
    (job / "attempt-2" / "torchrun-node0.json").write_text("{not json")
    log = ("Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-24_20:38:36\n  host      : node2\n"
           "  rank      : 9 (local_rank: 1)\n  exitcode  : 1 (pid: 11602) \n  error_file: /tmp/x/error.json\n")
    ws = worker_exits(job, 2, log)
    assert [(w.rank, w.host, w.exit_code, w.source, w.message) for w in ws] == \
        [(9, "node2", 1, "error_file", "ValueError: checkpoint /ck/step-000300 is corrupt")]


# --------------------------------------------------------------------------- issue 16: requeue bookkeeping


def test_slurm_had_already_requeued_the_job_when_the_step_ended(fake):
    """Issue 16: the step ended by itself (event none) after a node failure, but Slurm had already requeued the
    job: recorded as Slurm's requeue with the node excluded, never gave_up (even with no failure budget left)."""
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    (d / "job.txt").write_text("JobId=77 JobState=PENDING Reason=BeginTime Restarts=1 ExcNodeList=(null) "
                               f"NodeList=(null) NumNodes=2 Partition=gpu StdOut={log}\n")
    (d / "nodes.txt").write_text("NodeName=node1 State=IDLE\nNodeName=node2 State=DOWN+NOT_RESPONDING "
                                 "Reason=Not responding [slurm@2026-11-22T04:07:37]\n")
    dec = end(ctx, job_dir, 1, 1, "none", policy_from_args(0, [], []))
    assert (dec.reason, dec.action, dec.requeue, dec.exclude) == ("node_failure", "requeued", False, ("node2",))
    calls = _calls(d)
    assert not any(c.startswith("requeue") for c in calls)
    assert "update JobId=77 ExcNodeList=node2" in calls
    assert [(r["action"], r["excluded"]) for r in _ledger(job_dir)] == [("requeued", ["node2"])]


def test_slurm_requeue_of_a_job_still_completing_never_excludes_the_last_nodes_it_needs(fake):
    """Issue 29 item 2: Slurm requeued a 2-node job after node2 failed; while node1 was still completing, scontrol
    said NumNodes=1, the check passed, ExcNodeList=node2 was set and the job pended forever on a 2-node partition.
    Also what the batch script asks at the SIGTERM (job-attempt end --if-requeued)."""
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    assert not slurm_requeued(ctx)
    (d / "job.txt").write_text("JobId=77 JobState=PENDING Reason=BeginTime Restarts=1 ExcNodeList=(null) "
                               f"NodeList=node1 NumNodes=1 Partition=gpu StdOut={log}\n")
    (d / "partition.txt").write_text("PartitionName=gpu AllowGroups=ALL Nodes=node[1-2] TotalNodes=2\n")
    (d / "nodes.txt").write_text("NodeName=node1 State=IDLE+COMPLETING\nNodeName=node2 State=DOWN+NOT_RESPONDING "
                                 "Reason=Not responding [slurm@2026-11-22T04:07:37]\n")
    assert slurm_requeued(ctx)
    dec = end(ctx, job_dir, 1, 143, "term", policy_from_args(3, [], []))
    assert (dec.reason, dec.action, dec.exclude) == ("node_failure", "requeued", ())
    assert not any(c.startswith("update") for c in _calls(d))
    rec = _ledger(job_dir)[0]
    assert (rec["exclusions"], rec["unexcluded"]) == ([], ["node2"]) and "2 needed of 2" in rec["exclusion_note"]


def test_a_requeue_refused_because_slurm_requeued_first_is_still_a_requeue(fake):
    """The race: job-attempt decided to requeue, but Slurm's own requeue (node failure) came first and
    `scontrol requeue` was refused. The job's real state is read again: requeued, node excluded."""
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    (d / "requeue_fails").touch()
    (d / "job_after.txt").write_text("JobId=77 JobState=PENDING Reason=BeginTime Restarts=1 ExcNodeList=node9 "
                                     f"NodeList=(null) NumNodes=2 Partition=gpu StdOut={log}\n")
    (d / "nodes.txt").write_text("NodeName=node1 State=ALLOCATED\nNodeName=node2 State=ALLOCATED\n")
    dec = end(ctx, job_dir, 1, 1, "none", policy_from_args(3, [], []))
    assert (dec.action, dec.exit_code) == ("requeued", 0)
    ledger = _ledger(job_dir)
    assert [r["action"] for r in ledger] == ["requeued", "requeued"]
    assert "Slurm had already requeued" in ledger[-1]["detail"]


def test_a_real_refused_requeue_still_gives_up(fake):
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    (d / "requeue_fails").touch()
    dec = end(ctx, job_dir, 1, 1, "none", policy_from_args(3, [], []))
    assert dec.action == "gave_up"


def test_a_job_never_pends_forever_on_its_own_exclusions(fake, capsys):
    """Issue 16: a 2-node job on a 2-node partition whose node2 failed: excluding node2 would leave it pending
    forever (BadConstraints) once node2 is back. node2 is not excluded (it is drained: Slurm will not use it until
    it is back), and the job's output and ledger say so."""
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    (d / "partition.txt").write_text("PartitionName=gpu AllowGroups=ALL Nodes=node[1-2] TotalNodes=2\n")
    (d / "job.txt").write_text(f"JobId=77 JobState=RUNNING Restarts=0 ExcNodeList=(null) NodeList=node[1-2] "
                               f"NumNodes=2 Partition=gpu StdOut={log}\n")
    (d / "nodes.txt").write_text("NodeName=node1 State=ALLOCATED\nNodeName=node2 State=IDLE+DRAIN Reason=bad\n")
    dec = end(ctx, job_dir, 1, 1, "none", policy_from_args(3, [], []))
    assert (dec.reason, dec.action) == ("node_failure", "requeued")
    assert not any(c.startswith("update JobId=77 ExcNodeList=node2") for c in _calls(d))
    rec = _ledger(job_dir)[-1]
    assert rec["exclusions"] == [] and rec["unexcluded"] == ["node2"]
    assert "node2" in rec["exclusion_note"] and "too few" in rec["exclusion_note"]
    assert "not excluding node2" in capsys.readouterr().err


def test_only_as_many_exclusions_are_dropped_as_needed_oldest_first():
    from gpuguard.templates.exclusions import ExclusionPlan, fit_exclusions

    plan = ExclusionPlan(exclude=("node3", "node4", "node9"), dropped=(), kept=("node3", "node4"))
    # node9 is the job's own exclude (kept whatever), node3 was excluded before node4
    part = ["node1", "node2", "node3", "node4"]
    fitted, dropped = fit_exclusions(plan, needed=3, partition=part, static=["node9"], oldest_first=["node3", "node4"])
    assert (fitted, dropped) == (("node4", "node9"), ("node3",))
    # room enough already: nothing dropped
    assert fit_exclusions(plan, needed=2, partition=part, static=["node9"], oldest_first=["node3", "node4"]) == \
        (plan.exclude, ())
    # the job's own exclude is never dropped: still too few, nothing of ours helps
    plan2 = ExclusionPlan(exclude=("node2",), dropped=(), kept=())
    assert fit_exclusions(plan2, needed=2, partition=["node1", "node2"], static=["node2"], oldest_first=[]) == \
        (("node2",), ())


def test_receivers_are_told_when_the_job_gives_up_after_a_hang(fake, tmp_path):
    """Issue 16: after a hang the monitor's "requeue requested" was the last word, even when the job then gave up.
    job-attempt end now sends "job GAVE UP" (a real webhook server receives it); a requeue sends nothing more."""
    import time as _t

    import yaml
    from notify_servers import WebhookServer

    from gpuguard.siteconfig import parse_config
    from gpuguard.templates.jobattempt import notify_outcome

    pytest.importorskip("apprise")
    hook = WebhookServer()
    try:
        cfg = parse_config(yaml.safe_dump({"store": {"path": str(tmp_path / "root" / "{node}.db")},
                                           "logging": {"syslog": False},
                                           "notify": {"urls": [hook.url("/pages")]}}), source="test")
        ctx, d, log, job_dir = fake
        begin(ctx, job_dir, 1)
        (job_dir / "gpuguard").mkdir(parents=True, exist_ok=True)
        (job_dir / "gpuguard" / "events.jsonl").write_text(json.dumps(
            {"ts": _t.time(), "node": "node2", "kind": "requeue", "check": "monitor.progress", "ok": True}) + "\n")
        dec = end(ctx, job_dir, 1, 0, "timelimit", policy_from_args(0, [], []))
        assert (dec.reason, dec.action) == ("hang", "gave_up")
        assert notify_outcome(cfg, ctx, job_dir, 1, dec) == "sent"
        body = hook.wait_for(1, 10)[0]["body"]
        assert "job GAVE UP" in body["title"] and "gave up after attempt 1 (hang)" in body["message"]
        # a requeue, a finished or a cancelled job: nothing to add
        requeued = end(ctx, job_dir, 2, 1, "none", policy_from_args(3, [], []))
        assert requeued.action == "requeued" and notify_outcome(cfg, ctx, job_dir, 2, requeued) is None
    finally:
        hook.close()


def test_a_preflight_blame_requeues_excluding_what_was_blamed_with_a_ledger_line(fake):
    """`gpuguard preflight` exits 10 before the training: the script ends the attempt as event preflight with the
    blamed nodes; the job is requeued without those of its own nodes (a failure of max_failures), the ledger says
    why. A switch's nodes are blamed without being drained: excluded all the same."""
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    dec = end(ctx, job_dir, 1, 10, "preflight", policy_from_args(3, [], []), blamed=["node2", "node7"])
    assert (dec.reason, dec.action, dec.exclude, dec.budget) == ("preflight", "requeued", ("node2",), "failure")
    calls = _calls(d)
    assert calls.index("requeue 77") < calls.index("update JobId=77 ExcNodeList=node2,node9")
    rec = _ledger(job_dir)[0]
    assert (rec["event"], rec["reason"], rec["excluded"], rec["exclusions"]) == \
        ("preflight", "preflight", ["node2"], ["node2", "node9"])
    assert "the pre-flight before training blamed node2; failure 1 of 3 in a row" in rec["detail"]


def test_a_preflight_blame_never_leaves_the_job_pending_forever(fake, capsys):
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    (d / "partition.txt").write_text("PartitionName=gpu AllowGroups=ALL Nodes=node[1-2] TotalNodes=2\n")
    dec = end(ctx, job_dir, 1, 10, "preflight", policy_from_args(3, [], []), blamed=["node2"])
    assert dec.action == "requeued" and dec.exclude == ()  # excluding node2 would leave 1 node for a 2-node job
    assert not any(c.startswith("update JobId=77 ExcNodeList=node2") for c in _calls(d))
    assert "not excluding node2" in _ledger(job_dir)[0]["exclusion_note"]


def test_a_manual_stop_is_recorded_as_one_not_as_the_time_limit(fake):
    """Issue 29 item 4: an admin's `scancel --batch --signal=USR1` long before the limit (event stop), with no
    monitor record in the job directory: the ledger line says event stop, reason manual_stop (a continuation)."""
    ctx, d, log, job_dir = fake
    begin(ctx, job_dir, 1)
    dec = end(ctx, job_dir, 1, 0, "stop", policy_from_args(3, [], []))
    assert (dec.reason, dec.action, dec.budget) == ("manual_stop", "requeued", "continuation")
    line = json.loads((job_dir / "attempts.jsonl").read_text().splitlines()[-1])
    assert (line["event"], line["reason"], line["signal"]) == ("stop", "manual_stop", 10), line


def test_an_attempt_that_went_on_without_the_blamed_nodes_says_so_in_its_ledger_line():
    """Issue 28 item 3: with min_nodes, the pre-flight's blame let the training go on without node3 in this
    allocation (the template passes --blamed with the attempt's own event): the ledger line of the attempt says so
    whatever ended it, and the verdict is the training's own (completed here, an application error there)."""
    done = decide(facts(exit_code=0, blamed=("node3",)), Policy())
    assert (done.reason, done.action, done.exclude) == ("completed", "finished", ())
    assert done.detail.endswith("; the pre-flight blamed node3: this attempt trained without them"), done.detail
    failed = decide(facts(blamed=("node3",)), Policy())
    assert (failed.reason, failed.action) == ("app_error", "requeued")
    assert "the pre-flight blamed node3: this attempt trained without them" in failed.detail
    assert "pre-flight" not in decide(facts(exit_code=0), Policy()).detail
    blamed = decide(facts(event="preflight", exit_code=10, blamed=("node2",)), Policy(max_failures=3))
    assert (blamed.reason, blamed.exclude) == ("preflight", ("node2",)) and "trained without" not in blamed.detail
