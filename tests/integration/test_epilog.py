"""The epilog on a real Slurm cluster: leftover GPU processes are terminated, a hardware Xid raised during the
job drains the node while an application Xid (13) is recorded against the job, and a job that died by a
signal gets the deeper node checks."""

from __future__ import annotations

import json
import os
import sys
import time

from gpuguard.slurm.reason import parse_reason


def _gg(site) -> str:
    return f"{sys.executable} -m gpuguard"


def epilog_run(site, node, job):
    for _ in range(50):
        runs = [r for r in site.runs(node, "epilog") if r["job_id"] == job]
        if runs:
            return runs[0]
        time.sleep(0.1)
    raise AssertionError(f"no epilog run for job {job} on {node}: {site.log_lines()[-5:]}")


def test_epilog_terminates_a_leftover_process(site_factory, tmp_path):
    site = site_factory(nodes=1, epilog=True)
    pidfile = tmp_path / "leftover.pid"
    scen = site.scenarios / "node1.yaml"
    # The job leaves a detached process behind on GPU 0 (it escapes Slurm's process tracking like a daemonised
    # dataloader worker would) and the simulated GPU lists it while it runs.
    job = site.cluster.sbatch(f"""#!/bin/sh
( setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $! > {pidfile} )
sleep 0.2
{_gg(site)} simulate inject {scen} --process 0:$(cat {pidfile})
""", "-N1", "--gres=gpu:8")
    assert site.cluster.wait_job(job, timeout=30)["JobState"] == "COMPLETED"
    run = epilog_run(site, "node1", job)
    pid = int(pidfile.read_text())
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"
    left = [f for f in run["findings"] if f["check_id"] == "gpu.leftovers"][0]
    assert left["severity"] == "ok" and left["message"].startswith("terminated 1 leftover process")
    assert run["verdict"] == "pass" and "DRAIN" not in site.cluster.node_flags("node1")


def test_hardware_xid_during_the_job_drains_application_xid_does_not(site_factory):
    site = site_factory(nodes=1, epilog=True)
    scen = site.scenarios / "node1.yaml"
    line13 = "NVRM: Xid (PCI:0000:53:00): 13, pid=4242, name=python, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address"
    job = site.cluster.sbatch(f"#!/bin/sh\n{_gg(site)} simulate inject {scen} --kernel-line '{line13}'\n",
                              "-N1", "--gres=gpu:8")
    assert site.cluster.wait_job(job, timeout=30)["JobState"] == "COMPLETED"
    run = epilog_run(site, "node1", job)
    xid = [f for f in run["findings"] if f["check_id"] == "gpu.xid"][0]
    assert run["verdict"] == "pass" and xid["severity"] == "ok"
    assert "Xid 13 during the job" in xid["message"] and json.loads(xid["evidence"])["xids"][0]["code"] == 13
    assert "DRAIN" not in site.cluster.node_flags("node1")

    line79 = "NVRM: Xid (PCI:0000:97:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    job = site.cluster.sbatch(f"#!/bin/sh\n{_gg(site)} simulate inject {scen} --kernel-line \"{line79}\"\n",
                              "-N1", "--gres=gpu:8")
    site.cluster.wait_job(job, timeout=30)
    run = epilog_run(site, "node1", job)
    assert run["verdict"] == "drain"
    r = parse_reason(site.cluster.node_info("node1")["Reason"])
    assert (r.check_id, r.keyword, r.context, r.action) == ("gpu.xid", "XID79", "epilog", "reboot")


def test_signal_death_gets_the_deeper_checks(site_factory):
    site = site_factory(nodes=2, epilog=True)
    for node, die in (("node1", False), ("node2", True)):
        scen = site.scenarios / f"{node}.yaml"
        # an NVLink goes down during the job; the job then exits normally, or dies by SIGSEGV
        script = f"#!/bin/sh\n{_gg(site)} simulate inject {scen} --set '2:nvlink_down=[5]'\n" + \
                 ("kill -SEGV $$\n" if die else "")
        job = site.cluster.sbatch(script, "-N1", f"--nodelist={node}", "--gres=gpu:8")
        site.cluster.wait_job(job, timeout=30)
        run = epilog_run(site, node, job)
        checks = {f["check_id"] for f in run["findings"]}
        if die:
            assert "gpu.nvlink" in checks and run["verdict"] == "drain"
            r = parse_reason(site.cluster.node_info(node)["Reason"])
            assert (r.check_id, r.keyword, r.context) == ("gpu.nvlink", "NVLINK", "epilog")
        else:
            assert "gpu.nvlink" not in checks and run["verdict"] == "pass"
            assert "DRAIN" not in site.cluster.node_flags(node)  # the health check will find it later
