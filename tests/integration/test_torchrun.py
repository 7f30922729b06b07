"""The torchrun template end to end on a real local Slurm cluster (devtools.devsite: munge, slurmctld, one
slurmd per node, gpuguard's prolog) with a real torchrun (CPU PyTorch, its c10d rendezvous, 2 nodes x 1 process).
What is under test here is the template's orchestration, so the workers are a torch-free stand-in that checkpoints
every step (tests/fixtures/templates/stand_in_train.py: the command line, control files and output of
tiny_train.py, without its ~2.4 s of CPU per rank and attempt for importing torch); workers that really train
together over gloo are in test_torchrun_debian.py and test_example_train.py. Faults are injected through files
the training reads, and through gpuguard's own health check draining a node with simulated Xid 79. Each job plays
several scenarios (a torchrun start on two nodes is the expensive part): the first one the requeue, the node
exclusions and the private scratch. The last one runs `gpuguard monitor` beside the training (`monitor: true`): a
rank that stops making progress is paged by name and the monitor's requeue is recorded as a hang.

What a user would notice is asserted: the job's final state and restart count (scontrol show job), where each
attempt ran, the ledger in the job directory, the `attempts` table in the user-side store (templates.store_path,
never the hooks' store), the training output (resumed from which step) and the node-local scratch directory.

These run on the dev cluster as it is by default (every node at 127.0.0.1, this machine's host name); a job that
needs every node of its partition is in test_torchrun_exclusions.py; the shutdown window on the newest and the
oldest supported PyTorch, containers, and the rendezvous on a host laid out like a stock Debian node are in
test_torchrun_debian.py and test_torchrun_oldest.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml
from torchjob import NEEDS_TORCH, STAND_IN, Job, configure

pytestmark = NEEDS_TORCH

@pytest.mark.slow(45)  # three attempts, each starting torchrun on two nodes
def test_a_failed_node_is_excluded_on_requeue_and_the_job_resumes_from_its_checkpoint_in_private_scratch(
        site_factory):
    """gpuguard's health check drains node2 (GPU 3 fell off the bus) and the rank there dies: attempt 1 is
    requeued without node2. node2 is repaired before attempt 2 starts, which still stays off it; attempt 2 fails
    too (an application error), and at that requeue node2, healthy again, is no longer excluded. Each attempt
    resumes from the newest complete checkpoint the previous one left.

    Also issue 9: TRITON_CACHE_DIR under a predictable /tmp/gpuguard-<jobid> could be pre-created by another user.
    Here another user planted gpuguard-1 (this cluster's first job id): each node of each attempt makes a fresh
    private mktemp directory instead (0700, the job user's), gpuguard's epilog removes the job's directories and
    leaves the squatter's alone. (The predictable name itself, when free: the no-retry test below.)"""
    site = site_factory(nodes=3, epilog=True)
    local = configure(site)
    squatted = local / "gpuguard-1"
    squatted.mkdir()
    squatted.chmod(0o777)
    os.chown(squatted, 65534, 65534)
    (squatted / "planted.py").write_text("print('owned')\n")
    t0 = time.monotonic()
    hold = site.cluster.jobs_dir / "control" / "hold-step-5"  # attempt 1 still trains when the fault comes
    hold.parent.mkdir(exist_ok=True)
    hold.touch()
    job = Job(site, train=STAND_IN, steps=12, step_time=0.5, max_requeues=2)
    assert job.id == "1"
    job.wait_for(lambda: (job.ckpt / "step-000002" / "COMPLETE").exists(), "the first checkpoints")
    assert job.info()["NodeList"] == "node[1-2]"
    # GPU 3 of node2 falls off the bus: gpuguard's health check drains node2, the rank there dies
    site.set_scenario("node2", "xid79")
    hc = site.run_hook("healthcheck", "node2")
    assert "DRAIN" in site.cluster.node_flags("node2"), (hc.stdout, hc.stderr)
    assert site.cluster.node_info("node2")["Reason"].startswith("gpuguard: XID79 gpu.xid")
    (job.control / "fault-node2").touch()
    hold.unlink()
    job.wait_for(lambda: len(job.ledger()) >= 1, "attempt 1 to be recorded")
    first = job.ledger()[0]
    assert (first["reason"], first["action"], first["excluded"]) == ("node_failure", "requeued", ["node2"]), first
    assert "gpuguard: XID79 gpu.xid" in first["detail"]
    job.wait_for(lambda: job.info().get("ExcNodeList") == "node2", "ExcNodeList=node2 on the requeued job")
    # node2's epilog of attempt 1 is over (it may drain again on what it still sees) before node2 is repaired, as
    # slurmctld sees it: the epilog logs its verdict before it exits, and its non-zero exit (it drained) makes
    # slurmctld drain the node ("Epilog error") when it hears of it. A resume in between was undone by that drain.
    job.wait_for(lambda: site.log_lines("epilog node=node2 job=1 ")
                 and "COMPLETING" not in site.cluster.node_flags("node2"), "node2's epilog of attempt 1 to be over")
    # The node is repaired (a GPU that fell off the bus needs a reboot: the scenario's new boot id is that reboot;
    # a plain resume without it would be re-drained, issue 27) and back before attempt 2 starts: the job still
    # stays off it for this attempt
    site.write_scenario("node2", "healthy-p5", boot_id="00000000-0000-4000-8000-0000000b0072")
    (job.control / "fault-node2").unlink()
    site.cluster.resume("node2")
    # attempt 2 fails too, once both of its ranks run: at that requeue the exclusions are re-evaluated and node2,
    # healthy again, is dropped
    job.wait_for(lambda: job.output().count(": attempt 2 training steps") == 2, "attempt 2's ranks to start")
    (job.control / "fault-node3").touch()
    job.wait_for(lambda: len(job.ledger()) >= 2, "attempt 2 to be recorded")
    (job.control / "fault-node3").unlink()
    second = job.ledger()[1]
    assert (second["nodes"], second["reason"], second["action"]) == ("node[1,3]", "app_error", "requeued"), second
    assert second["unexcluded"] == ["node2"] and second["exclusions"] == [], second
    info = job.wait()
    out = job.output()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", job.why(info)
    assert info.get("ExcNodeList") in (None, "(null)", ""), job.why(info)
    ledger = job.ledger()
    assert [(r["attempt"], r["reason"], r["action"]) for r in ledger] == [
        (1, "node_failure", "requeued"), (2, "app_error", "requeued"), (3, "completed", "finished")], ledger
    assert ledger[0]["exit_code"] != 0 and ledger[1]["exit_code"] != 0 and ledger[2]["exit_code"] == 0
    # each attempt got the newest complete checkpoint the previous one left on its command line, and went on
    for prev, nxt in zip(ledger, ledger[1:]):
        step = prev["ckpt_step"]
        assert nxt["resumed_from"].endswith(f"step-{step:06d}") and f"resumed from step {step} " in out, ledger
    assert "finished 12 steps" in out and (job.ckpt / "DONE").read_text() == "12"
    rows = job.store_attempts()
    assert [(r["attempt"], r["reason"], r["action"], r["nodes"]) for r in rows] == [
        (r["attempt"], r["reason"], r["action"], r["nodes"]) for r in ledger]
    assert rows[0]["excluded"] == "node2" and rows[0]["exit_code"] == ledger[0]["exit_code"]
    # the scratch: never the squatter's directory, a private one per node and attempt, gone after the job
    assert "is not a private directory" in out
    seen = [line.split("LOCAL_DIR ")[1].split() for line in out.splitlines() if "LOCAL_DIR " in line]
    assert len(seen) == 6, out[-3000:]  # one line per node and attempt
    for path, _mode_kw, mode, _uid_kw, uid, *_ in seen:
        assert Path(path).parent == local and Path(path).name.startswith("gpuguard-1.") and mode == "0o700"
        assert uid == str(os.getuid())
    assert len({p[0] for p in seen}) == 6
    job.wait_for(lambda: not any(Path(p[0]).exists() for p in seen), "the epilog to remove the scratch", 30)
    assert squatted.is_dir() and (squatted / "planted.py").exists()  # someone else's: left alone
    print(f"fail -> exclude -> fail -> unexclude -> resume -> finish: {time.monotonic() - t0:.1f}s")


@pytest.mark.slow(18)
def test_a_worker_exit_code_in_the_no_retry_list_is_not_retried(site_factory):
    """Issue 10: torchrun exits 1 whatever its worker's code, so no_retry_exit_codes never matched. The worker's
    own code (3, from torchrun's root-cause report) is recorded and matched.

    Also issue 9, the predictable scratch name when nobody took it: gpuguard-<jobid>, private, removed by the
    epilog after the job."""
    site = site_factory(nodes=2, epilog=True)
    local = configure(site)
    job = Job(site, train=STAND_IN, max_failures=3, no_retry_exit_codes=[3])
    (job.control / "exit-3-rank-1").touch()
    info = job.wait()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", job.why(info)
    assert info["ExitCode"].startswith("3:"), job.why(info)
    ledger = job.ledger()
    assert [(r["reason"], r["action"]) for r in ledger] == [("no_retry", "gave_up")], job.why(info)
    rec = ledger[0]
    # srun's own code is 1 (torchrun's), 143 or 137 (the other node's torchrun stopped by SIGTERM / SIGKILL),
    # whichever srun reports: exactly why the worker's code has to come from torchrun's report
    assert (rec["worker_exit_code"], rec["worker_rank"]) == (3, 1) and rec["exit_code"] in (1, 137, 143), rec
    assert "rank 1" in rec["detail"] and "exited with code 3" in rec["detail"]
    # rank 1 printed its scratch before exiting (rank 0 may be stopped before it prints)
    out = job.output()
    assert "is not a private directory" not in out
    assert f"LOCAL_DIR {local}/gpuguard-{job.id} mode 0o700" in out, out[-3000:]
    job.wait_for(lambda: not (local / f"gpuguard-{job.id}").exists(), "the epilog to remove the scratch", 30)
    assert any("job scratch: removed" in line for line in site.log_lines(f"job {job.id}"))


@pytest.mark.slow(12)
def test_syntax_error_is_not_retried(site_factory, tmp_path):
    """A script that cannot even be compiled fails the same way on every attempt: given up at once. One node (a
    torchrun start, ~2.5 s of CPU here, per node): how many nodes fail does not change the verdict."""
    site = site_factory(nodes=1)
    broken = site.cluster.jobs_dir / "broken_train.py"
    broken.write_text("import torch\ndef main(:\n    pass\n")
    job = Job(site, command=[str(broken)], max_requeues=3, nodes=1)
    info = job.wait()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", job.why(info)
    ledger = job.ledger()
    assert [(r["reason"], r["action"]) for r in ledger] == [("no_retry", "gave_up")], ledger
    assert "SyntaxError" in ledger[0]["detail"]


@pytest.mark.slow(55)  # two attempts; attempt 1 waits out the monitor's hang limit (15 s without progress)
def test_a_hung_node_is_paged_by_name_and_the_monitor_requeues_the_job_which_resumes(site_factory, hook, tmp_path):
    """Issue 29 item 4: the monitor's requeue of a hung job is a hang in the ledger (a failure against the budget),
    not the time limit nor a manual stop. `monitor: true` puts `gpuguard monitor` beside the training on both nodes;
    it follows the job's output for progress (rank 0's `step: N` lines). The rank on node2 stops making progress
    (control file stall-node2: a stuck data loader, say); rank 0 waits for it, as in a collective, so the whole job
    stops stepping. After monitor.hang_minutes one monitor pages once, naming node2, and asks for the requeue
    (`scancel --batch --signal=USR1`, its default requeue_command); the template's USR1 trap has the training
    checkpoint and stop, and `job-attempt end` finds the monitor's record: attempt 1 is a hang. Attempt 2 resumes
    from that checkpoint and finishes.

    The page names the stuck node from the nodes' reports in the job directory: node2's (simulated) GPUs are idle
    while node1's are busy, what a rank stuck outside a collective looks like while its peers spin in one. The fake
    NVML reads its scenario when the monitor starts, so those GPU states hold from the start; monitor.idle_minutes is
    set far off so that the idleness alone never counts as a hang here: the missing progress does."""
    site = site_factory(nodes=2)
    busy = tmp_path / "busy.yaml"
    busy.write_text(yaml.safe_dump({"instance_type": "p5.48xlarge", "gpus": {
        "defaults": {"utilization_pct": 97, "power_w": 650}}}))
    site.set_scenario("node1", str(busy))  # node2 keeps the healthy scenario's idle GPUs
    configure(site, notify={"urls": [hook.url("/alerts")]},
              monitor={"hang_minutes": 0.25, "idle_minutes": 60, "requeue_on_hang": True, "py_spy": None})
    t0 = time.monotonic()
    job = Job(site, train=STAND_IN, steps=40, step_time=0.3, monitor=True, monitor_interval_s=1)
    events = site.cluster.jobs_dir / "runs" / job.id / "gpuguard" / "events.jsonl"

    def monitor_events() -> list[dict]:
        return [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []

    job.wait_for(lambda: (job.ckpt / "step-000002" / "COMPLETE").exists(), "the first checkpoints")
    (job.control / "stall-node2").touch()  # attempt 1 only
    (job.control / "finish-after-resume").touch()
    job.wait_for(lambda: len(job.ledger()) >= 1, "the monitor to requeue the hung job", timeout=120)
    info = job.wait()
    out = job.output()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.why(info)
    ledger = job.ledger()
    assert [(r["attempt"], r["reason"], r["event"], r["action"], r["budget"]) for r in ledger] == [
        (1, "hang", "stop", "requeued", "failure"), (2, "completed", "none", "finished", None)], job.why(info)
    assert "gpuguard monitor requeued a hung job: monitor.progress, stuck: node2 (asked by node" in ledger[0]["detail"]
    assert "failure 1 of 3 in a row" in ledger[0]["detail"]
    assert [(r["reason"], r["signal"]) for r in job.store_attempts()] == [("hang", 10), ("completed", None)]
    # the stop path checkpointed the stalled attempt; attempt 2 resumed from that checkpoint and finished
    step = ledger[0]["ckpt_step"]
    assert "stalled (injected)" in out and "stop request while stalled" in out and "SIGTERM: checkpointed" in out
    assert ledger[1]["resumed_from"].endswith(f"step-{step:06d}") and f"resumed from step {step} " in out
    assert "finished 40 steps" not in out and (job.ckpt / "DONE").read_text() == str(step + 2)
    assert "a requeue was asked for, not the time limit" in out and "SignalException" not in out
    # the monitor: the hang seen on both nodes, reported by one, which asked for one requeue (its intent recorded
    # before the command ran, the outcome after)
    mon = [e for e in monitor_events() if e.get("kind") in ("hang", "requeue") and e.get("state") != "resolved"]
    hangs = [e for e in mon if e["kind"] == "hang"]
    assert {e["node"] for e in hangs} == {"node1", "node2"} and [e["reported"] for e in hangs].count(True) == 1, mon
    reporter = next(e for e in hangs if e["reported"])
    assert reporter["stuck"] == ["node2"], mon
    assert [(e["phase"], e.get("ok"), e["node"], e["stuck"]) for e in mon if e["kind"] == "requeue"] == [
        ("asking", None, reporter["node"], ["node2"]), ("done", True, reporter["node"], ["node2"])], mon
    # what the on-call person got: one hang page and the requeue, both about node2 (whichever node sent them)
    pages = [r["body"] for r in hook.wait_for(2)]
    firing = [p["title"] for p in pages if "RESOLVED" not in p["title"]]
    assert sorted(firing) == ["gpuguard: job hang node2 monitor.progress",
                              "gpuguard: job requeue requested node2 monitor.progress"], firing
    hang_page = next(p["message"] for p in pages if p["title"] == "gpuguard: job hang node2 monitor.progress")
    assert "stuck: node2: every GPU idle" in hang_page and "while node1 are busy" in hang_page, hang_page
    assert f"reported by {reporter['node']}" in hang_page
    print(f"stall -> hang page -> monitor requeue -> checkpoint -> resume -> finish: {time.monotonic() - t0:.1f}s")
