"""The node agent (gpuguard.agent) with real processes: the installed hook scripts, a real agent, a real Slurm where a
drain is at stake. The agent must give the verdicts the hook's own process gives, and a hung, stopped, dead or
outdated agent, or a child killed mid-run, must never hang a hook, fail it or run it twice.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml

from devtools.devsite import DevSite, agent_listening, scenario_path, start_agent, stop_agent
from gpuguard.agent import EXIT_CONFINED
from gpuguard.agent.client import ACK_TIMEOUT_S
from gpuguard.slurm.reason import parse_reason
from gpuguard.util.fs import atomic_write


class Hook:
    def __init__(self, site: DevSite, kind: str, node: str = "node1", **env: str) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([str(site.libexec / f"gpuguard-{kind}")], env=site.hook_env(node, kind, **env),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        self.client_pid = self.proc.pid  # the script execs Python: the hook process keeps the script's pid
        self.err = ""
        self.took = 0.0

    def wait(self, timeout: float = 90) -> "Hook":
        _, self.err = self.proc.communicate(timeout=timeout)
        self.took = time.monotonic() - self.t0
        return self

    @property
    def code(self) -> Optional[int]:
        return self.proc.returncode

    def ran_in(self) -> set[int]:
        """The pids that logged this hook's result line (gpuguard[PID] ... verdict=)."""
        return {int(m) for m in re.findall(r"gpuguard\[(\d+)\] \w+: \w+ node=", self.err)}


def run(site: DevSite, kind: str, node: str = "node1", **env: str) -> Hook:
    return Hook(site, kind, node, **env).wait()


def prolog_env(job: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": job, "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7", "SLURM_JOB_USER": "root", "SLURM_JOB_UID": "0"}


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def runs_of(site: DevSite, job: str) -> int:
    return len([r for r in site.runs("node1", "prolog") if r["job_id"] == job])


def slow_nvml(site: DevSite, node: str, seconds: int) -> None:
    data: dict[str, Any] = yaml.safe_load(scenario_path("healthy-p5").read_text())
    data["nvml"] = {"hang": {"nvmlInitWithFlags": seconds, "nvmlInit_v2": seconds}}
    atomic_write(site.scenarios / f"{node}.yaml", yaml.safe_dump(data))


@pytest.fixture
def quiet_site(tmp_path: Path) -> Any:
    """One simulated node and its agent; no Slurm needed (a healthy node passes without asking slurmctld)."""
    site = DevSite(nodes=1, workdir=tmp_path / "site", agent=True)
    yield site
    if site.agent is not None:
        stop_agent(site.agent)


def test_the_agent_gives_the_verdicts_the_hooks_own_process_gives(site_factory: Any):
    site = site_factory(nodes=3, agent=True, config={"deadlines": {"scontrol_s": 5.0}})
    for node in ("node2", "node3"):
        site.set_scenario(node, "xid79")
    healthy = run(site, "prolog", "node1", **prolog_env("11"))
    broken = run(site, "prolog", "node2", **prolog_env("12"))
    job = site.cluster.sbatch("#!/bin/sh\ntrue\n", "-N1", "-w", "node1", "--gres=gpu:8")  # slurmd runs the prolog
    assert site.cluster.wait_job(job, timeout=60)["JobState"] == "COMPLETED"
    assert [line for line in site.log_lines(f"prolog node=node1 job={job} ") if "verdict=pass" in line and
            line.endswith("via=agent")], site.log_lines(f"job={job}")
    assert site.agent is not None
    agent_pid = site.agent.pid
    stop_agent(site.agent)  # the same fault without an agent: the hook runs in its own process
    alone = run(site, "prolog", "node3", **prolog_env("13"))

    assert healthy.code == 0, healthy.err
    assert broken.code == alone.code == 1, (broken.err, alone.err)
    assert healthy.client_pid not in healthy.ran_in() and broken.client_pid not in broken.ran_in()  # the agent's child
    assert "via=agent" in healthy.err and "via=agent" not in alone.err
    assert alone.ran_in() == {alone.client_pid}
    r2, r3 = parse_reason(site.cluster.node_info("node2")["Reason"]), parse_reason(site.cluster.node_info("node3")["Reason"])
    assert r2 is not None and r3 is not None
    assert (r2.keyword, r2.check_id, r2.detail) == (r3.keyword, r3.check_id, r3.detail)
    assert r2.keyword == "XID79"
    v2, v3 = site.runs("node2", "prolog")[0], site.runs("node3", "prolog")[0]
    assert {f["check_id"]: f["severity"] for f in v2["findings"]} == {f["check_id"]: f["severity"] for f in v3["findings"]}
    assert agent_pid != os.getpid()


def test_an_agent_with_the_services_locale_serves_hooks_from_slurmds_bare_environment(tmp_path: Path):
    """Seen on a real H200 machine (bench/real_gpu.py, LC_ALL=en_US.UTF-8): the agent's stdout encoded with errors
    'strict', the hooks slurmd starts with no locale with 'surrogateescape', and the agent refused every hook as
    'another interpreter setup': each prolog paid the round trip and then its own start-up. systemd gives the agent
    unit LANG from /etc/locale.conf, so that is most nodes. The hook is served; its output is encoded as its own
    process would have."""
    loc = tmp_path / "locale"
    loc.mkdir()
    built = subprocess.run(["localedef", "-i", "en_US", "-f", "UTF-8", str(loc / "en_US.UTF-8")],
                           capture_output=True, text=True, timeout=120)
    assert built.returncode in (0, 1) and (loc / "en_US.UTF-8" / "LC_CTYPE").exists(), built.stderr  # `make deps`
    site = DevSite(nodes=1, workdir=tmp_path / "site", agent=False)
    env = {**os.environ, "LOCPATH": str(loc), "LC_ALL": "en_US.UTF-8"}
    probe = subprocess.run([site.python, "-I", "-c", "import sys; print(sys.stdout.errors)"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "strict"  # the agent's locale really differs from the hook's
    agent = start_agent(site.python, site.workdir / "state", env=env)
    try:
        hook = run(site, "prolog", **prolog_env("21"))
        assert hook.code == 0 and "via=agent" in hook.err, hook.err
        assert hook.client_pid not in hook.ran_in()
    finally:
        stop_agent(agent)


def test_a_stopped_agent_costs_a_bounded_wait_and_never_a_second_run(quiet_site: DevSite):
    assert quiet_site.agent is not None
    first = run(quiet_site, "prolog", **prolog_env("100"))
    assert first.code == 0 and first.client_pid not in first.ran_in()
    os.kill(quiet_site.agent.pid, signal.SIGSTOP)  # hung: the kernel still queues connections
    try:
        hung = run(quiet_site, "prolog", **prolog_env("101"))
    finally:
        os.kill(quiet_site.agent.pid, signal.SIGCONT)
    assert hung.code == 0, hung.err
    assert hung.ran_in() == {hung.client_pid}  # ran in its own process, after ACK_TIMEOUT_S (tests/unit: the bound)
    assert hung.took < ACK_TIMEOUT_S + 15.0  # far inside the prolog's deadline, even on a loaded CI machine
    time.sleep(3)  # the agent, resumed, finds the abandoned request: its child must not run it
    assert runs_of(quiet_site, "101") == 1
    again = run(quiet_site, "prolog", **prolog_env("103"))
    assert again.code == 0 and again.client_pid not in again.ran_in()  # and it serves the next hook


def test_a_burst_of_prologs_is_served_by_the_agent_and_counted(quiet_site: DevSite, tmp_path: Path):
    """Issue 30: a job array starting on a node sends it a burst of prologs while every process waits for a CPU.
    With a flat 0.5 s bound, 182 of a 200-job burst's prologs fell back to their own processes (each a whole
    interpreter start-up more, at the worst moment) and nothing counted them. A busy agent is waited for; the
    node's metrics count how each hook ran."""
    quiet_site.write_config({"metrics": {"textfile_dir": str(tmp_path / "prom")}})
    # the rest of the burst: the other nodes' prologs on a shared test machine, busy loops here
    hogs = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.monotonic() + 30\n"
                              "while time.monotonic() < t: pass"]) for _ in range(4 * (os.cpu_count() or 1))]
    try:
        burst = [Hook(quiet_site, "prolog", **prolog_env(str(300 + i))) for i in range(12)]
        done = [h.wait() for h in burst]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert [h.code for h in done] == [0] * len(done), [h.err[-500:] for h in done if h.code]
    fell_back = [h.err[-300:] for h in done if h.client_pid in h.ran_in()]
    assert not fell_back  # every one ran in a child of the agent
    # a child of the agent answers with its verdict and writes the metrics after: on a loaded machine the last ones
    # land after the hooks have exited
    served = 'gpuguard_hook_runs_via_total{kind="prolog",node="node1",via="agent"} 12'
    prom_file, until = tmp_path / "prom" / "gpuguard_node.prom", time.monotonic() + 60
    while served not in (prom := prom_file.read_text() if prom_file.exists() else "") and time.monotonic() < until:
        time.sleep(0.1)
    assert served in prom, prom
    assert 'gpuguard_hook_runs_via_total{kind="prolog",node="node1",via="agent_busy"} 0' in prom


def test_a_dead_agent_means_the_hook_runs_itself(quiet_site: DevSite):
    assert quiet_site.agent is not None
    quiet_site.agent.kill()  # SIGKILL: its socket file stays behind, nobody listens
    quiet_site.agent.wait()
    assert (quiet_site.workdir / "state" / "agent.sock").exists()
    h = run(quiet_site, "prolog", **prolog_env("200"))
    assert h.code == 0 and h.ran_in() == {h.client_pid}
    quiet_site.agent = start_agent(quiet_site.python, quiet_site.workdir / "state")  # replaces the stale socket
    h = run(quiet_site, "prolog", **prolog_env("201"))
    assert h.code == 0 and h.client_pid not in h.ran_in()


def test_a_child_killed_mid_run_means_the_hook_runs_again_itself(quiet_site: DevSite):
    assert quiet_site.agent is not None
    slow_nvml(quiet_site, "node1", 4)  # NVML takes 4 s to start: slow, not broken (deadlines.nvml_s is 10)
    h = Hook(quiet_site, "prolog", **prolog_env("300"))
    time.sleep(1.5)  # it is in nvmlInit by now (a start-up probe's short-lived child has ended)
    kids = [pid for pid in children_of(quiet_site.agent.pid) if _alive(pid)]
    assert kids, "the agent forked no child for the hook"
    for pid in kids:
        os.kill(pid, signal.SIGKILL)  # the OOM killer, say
    h.wait()
    assert h.code == 0, h.err
    assert h.ran_in() == {h.client_pid}


def test_the_child_runs_as_the_hook_process_would(quiet_site: DevSite, tmp_path: Path):
    """Its environment, working directory, umask, priority, resource limits, OOM score and standard streams are
    the hook process's, not the agent's."""
    assert quiet_site.agent is not None
    slow_nvml(quiet_site, "node1", 3)
    env = quiet_site.hook_env("node1", "prolog", **prolog_env("350"))
    script = str(quiet_site.libexec / "gpuguard-prolog")
    out = (tmp_path / "hook.out").open("w")
    shell = f"cd {tmp_path} && umask 027 && exec nice -n 7 prlimit --nofile=777:888 --memlock=65536:131072 {script}"
    proc = subprocess.Popen(["sh", "-c", shell], env=env, stdout=out, stderr=subprocess.STDOUT)
    time.sleep(1.5)  # the child is in nvmlInit now
    kids = [pid for pid in children_of(quiet_site.agent.pid) if _alive(pid)]
    assert len(kids) == 1, kids
    child = kids[0]
    status = Path(f"/proc/{child}/status").read_text()
    limits = Path(f"/proc/{child}/limits").read_text()
    facts = {"cwd": os.readlink(f"/proc/{child}/cwd"), "stdout": os.readlink(f"/proc/{child}/fd/1"),
             "nice": int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[16]),
             "oom": Path(f"/proc/{child}/oom_score_adj").read_text().strip()}
    assert proc.wait(60) == 0
    out.close()
    assert facts["cwd"] == str(tmp_path) and facts["stdout"] == str(tmp_path / "hook.out")
    assert re.search(r"^Umask:\s+0027$", status, re.M)
    assert facts["nice"] == 7
    assert facts["oom"] == Path("/proc/self/oom_score_adj").read_text().strip()
    assert re.search(r"^Max open files\s+777\s+888\s", limits, re.M)
    assert re.search(r"^Max locked memory\s+65536\s+131072\s", limits, re.M)
    # its log line went to the hook's stderr, for the job of the hook's environment (/proc/PID/environ shows only what
    # a process was exec'd with, so the child's own environment is seen through what it did)
    assert "job=350 verdict=pass" in (tmp_path / "hook.out").read_text()


def test_a_hostile_environment_is_judged_as_in_the_hooks_own_process(quiet_site: DevSite):
    env = {**prolog_env("400"), "SLURM_JOB_GPUS": "0,1;reboot", "SLURM_JOB_USER": "$(id)"}
    through_agent = run(quiet_site, "prolog", **env)
    assert quiet_site.agent is not None
    stop_agent(quiet_site.agent)
    alone = run(quiet_site, "prolog", **{**env, "SLURM_JOB_ID": "401"})
    assert through_agent.client_pid not in through_agent.ran_in() and alone.ran_in() == {alone.client_pid}
    assert through_agent.code == alone.code

    def warnings(h: Hook) -> list[str]:
        return [line.split(": ", 1)[1] for line in h.err.splitlines() if "malformed environment" in line]

    assert warnings(through_agent) == warnings(alone) != []
    assert "SLURM_JOB_GPUS" in warnings(alone)[0] and "SLURM_JOB_USER" in warnings(alone)[0]


def test_the_agent_refuses_to_run_where_hooks_would_not_run_alike(tmp_path: Path):
    p = subprocess.run(["setpriv", "--no-new-privs", sys.executable, "-I", "-m", "gpuguard.agent.server",
                        "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=60)
    assert p.returncode == EXIT_CONFINED, p.stderr
    assert "NoNewPrivileges" in p.stderr
    assert not (tmp_path / "state" / "agent.sock").exists()


def _unit(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_the_agent_unit_keeps_the_agent_running_and_stops_it(quiet_site: DevSite):
    """gpuguard-watch-agent.service's ExecStart= as systemd runs it (nothing but the EnvironmentFile `make install`
    writes): the watch daemon starts the agent, starts it again when it dies, stops it on SIGTERM."""
    assert quiet_site.agent is not None
    stop_agent(quiet_site.agent)
    unit = _unit(Path(__file__).resolve().parents[2] / "healthcheck" / "gpuguard-watch-agent.service")
    assert unit["EnvironmentFile"] == ["/usr/local/libexec/gpuguard/gpuguard.env"]
    assert unit["Conflicts"] == ["gpuguard-watch.service"] and unit["RuntimeDirectoryPreserve"] == ["yes"]
    assert not {"ProtectSystem", "PrivateTmp", "CapabilityBoundingSet", "NoNewPrivileges", "MemoryMax"} & set(unit)
    env = {"PATH": "/usr/bin:/bin", "SLURMD_NODENAME": "node1"}
    for line in (quiet_site.libexec / "gpuguard.env").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = shlex.split(value)[0]
    state = Path(env["GPUGUARD_STATE_DIR"])
    watch = subprocess.Popen(shlex.split(unit["ExecStart"][0]), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        first = _agent_pid(watch.pid, state)
        h = run(quiet_site, "prolog", **prolog_env("500"))
        assert h.code == 0 and h.client_pid not in h.ran_in()
        os.kill(first, signal.SIGKILL)
        second = _agent_pid(watch.pid, state, other_than=first, timeout=20)  # started again after its back-off
        h = run(quiet_site, "prolog", **prolog_env("501"))
        assert h.code == 0 and h.client_pid not in h.ran_in()
        watch.send_signal(signal.SIGTERM)
        assert watch.wait(30) == 0
        assert not _alive(second)
        assert not (state / "agent.sock").exists()
    finally:
        if watch.poll() is None:
            watch.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _agent_pid(watch_pid: int, state: Path, other_than: int = 0, timeout: float = 30) -> int:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        agents = [p for p in children_of(watch_pid) if p != other_than and _alive(p)]
        if agents and agent_listening(state / "agent.sock"):
            return agents[0]
        time.sleep(0.1)
    raise AssertionError("gpuguard watch --agent started no agent")
