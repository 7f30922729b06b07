"""gpuguard on a real GPU: what NVML answers, what the checks make of it, and what the installed hooks cost there.

Run on a machine with an NVIDIA GPU and its driver (no Slurm needed: `scontrol` is a recording stand-in):

    python3 bench/real_gpu.py --out DIR [--runs 15] [--extra-path DIR]

It installs the hooks from this checkout into a temporary directory (gpuguard.env naming a venv that sees this
checkout's lib/ and the interpreter's own packages), then:
  1. NVML as gpuguard reads it (gpuguard.probes.nvml.read_nvml): every field, what was unsupported, what errored,
     nvmlInit's and the whole probe's time; nvidia-smi's answers beside it for the same fields.
  2. `gpuguard check --dry-run --json` for each run kind under the generic profile and under a profile an admin
     would write for this machine (derived from the stock profile of the same GPU, one node's GPUs).
  3. The installed prolog and health check run as slurmd runs them (`env -i`, SLURM_* only), in their own process
     and through the node agent, interleaved with NHC 1.4.3's 7 host checks (NHC_SRC) and `python -I -c pass`.
  4. The per-job monitor's one sample while a matrix-multiply load runs on the GPU (torch, when installed).
  5. The kernel log as the hooks see it, and `gpuguard xid scan` over it.
Everything lands in DIR (report.json, the check outputs, nvidia-smi -q) and the figures are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "lib"))
sys.path.insert(0, str(REPO))

SMI_FIELDS = ("name,driver_version,persistence_mode,ecc.mode.current,pcie.link.gen.current,pcie.link.gen.max,"
              "pcie.link.width.current,pcie.link.width.max,temperature.gpu,power.draw,memory.total,"
              "clocks_throttle_reasons.active,retired_pages.pending,remapped_rows.pending,remapped_rows.failure")
FAKE_SCONTROL = """#!/bin/sh
# records every call; answers like slurmctld for a node that is up and idle
echo "$*" >> "{log}"
case "$1" in
  --version) echo "slurm 22.05.8" ;;
  show) case "$2" in
          node) echo "NodeName=$3 State=IDLE Reason=(null) Partitions=gpu" ;;
          job) echo "JobId=$3 JobState=RUNNING NodeList=$(hostname -s) Partition=gpu" ;;
        esac ;;
esac
exit 0
"""


def sh(argv: list[str], timeout: float = 60, env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def say(text: str) -> None:
    print(text, flush=True)


def nvml_facts(out: Path) -> dict[str, Any]:
    from gpuguard.probes.nvml import read_nvml

    obs = read_nvml()
    data = asdict(obs)
    (out / "nvml_observation.json").write_text(json.dumps(data, indent=1, default=str))
    smi = sh(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv"])
    (out / "nvidia-smi-q.txt").write_text(sh(["nvidia-smi", "-q"]).stdout)
    say(f"[1] NVML through gpuguard's probe: init {obs.init_duration_s * 1000:.0f} ms, whole probe "
        f"{obs.status.duration_s * 1000:.0f} ms, complete={obs.status.complete}, driver {obs.driver_version}, "
        f"{obs.device_count} GPU(s), init_error={obs.init_error}, error={obs.status.error}")
    for gpu in data["gpus"]:
        skip = {"processes", "errors", "unsupported"}
        shown = {k: v for k, v in gpu.items() if k not in skip and v not in (None, [], {})}
        say(f"    GPU {gpu['index']}: {json.dumps(shown, default=str)}")
        say(f"    GPU {gpu['index']} unsupported: {gpu.get('unsupported')}; errors: {gpu.get('errors')}")
    say("    nvidia-smi for the same fields:\n      " + smi.stdout.strip().replace("\n", "\n      "))
    inits = []
    import pynvml

    for _ in range(10):
        t0 = time.perf_counter()
        pynvml.nvmlInit()
        inits.append(time.perf_counter() - t0)
        pynvml.nvmlShutdown()
    say(f"    nvmlInit alone, 10 times in one process: median {statistics.median(inits) * 1000:.1f} ms, "
        f"max {max(inits) * 1000:.1f} ms")
    say("    " + gpu_reads_at_once(pynvml, 8, 5))
    per_call = nvml_call_times(pynvml, read_nvml, 10)
    say("    where gpuguard's NVML probe spends its time (per probe, mean of 10; the slowest calls):")
    for name, (calls, ms) in sorted(per_call.items(), key=lambda kv: -kv[1][1])[:14]:
        say(f"      {name}: {calls:g} call(s), {ms:.2f} ms")
    return {"observation": data, "nvidia_smi": smi.stdout, "nvml_init_ms": [x * 1000 for x in inits]}


def gpu_reads_at_once(nv: Any, n: int, reps: int) -> str:
    """Whether the driver answers NVML queries for several GPUs at once: `n` full reads of GPU 0 one after the
    other vs in `n` threads at once (the shape of an 8-GPU node's probe, on the one GPU there is)."""
    import threading

    from gpuguard.probes import nvml as probe

    nv.nvmlInit()
    try:
        probe.read_gpu(nv, 0, None, True)  # warm
        seq, par = [], []
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(n):
                probe.read_gpu(nv, 0, None, True)
            seq.append(time.perf_counter() - t)
            threads = [threading.Thread(target=probe.read_gpu, args=(nv, 0, None, True)) for _ in range(n)]
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            par.append(time.perf_counter() - t)
    finally:
        nv.nvmlShutdown()
    return (f"{n} reads of GPU 0: one after the other {statistics.median(seq) * 1000:.1f} ms, in {n} threads at once "
            f"{statistics.median(par) * 1000:.1f} ms (medians of {reps})")


def nvml_call_times(nv: Any, read: Any, runs: int) -> dict[str, tuple[float, float]]:
    """{pynvml function: (calls per probe, ms per probe)} over `runs` probes, each function wrapped with a timer."""
    import functools

    acc: dict[str, list[float]] = {}
    originals = {n: f for n, f in vars(nv).items() if n.startswith("nvml") and callable(f)}

    def timed(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                slot = acc.setdefault(name, [0.0, 0.0])
                slot[0] += 1
                slot[1] += time.perf_counter() - t
        return wrapper

    for n, f in originals.items():
        setattr(nv, n, timed(n, f))
    try:
        t0 = time.perf_counter()
        for _ in range(runs):
            read()
        total = (time.perf_counter() - t0) / runs
    finally:
        for n, f in originals.items():
            setattr(nv, n, f)
    out = {n: (c / runs, ms / runs * 1000) for n, (c, ms) in acc.items()}
    out["(whole probe)"] = (1, total * 1000)
    return out


def machine_profile(root: Path, obs: dict[str, Any]) -> str:
    """The stock profile of this GPU model, cut down to this node's GPU count and no fabric: what an admin writes."""
    import yaml

    gpus = obs["gpus"]
    name = (gpus[0].get("name") or "") if gpus else ""
    stock = {"NVIDIA H200": "p5e.48xlarge", "NVIDIA H100 80GB HBM3": "p5.48xlarge"}.get(name, "generic")
    prof = yaml.safe_load((REPO / "lib/gpuguard/profiles" / f"{stock}.yaml").read_text())
    prof.update(name="this-machine", instance_types=[], gpu_count=len(gpus), efa_devices=0,
                description=f"{stock} cut to this machine's {len(gpus)} GPU(s), no EFA")
    for k in ("cpus", "memory_gib", "libfabric_provider"):
        prof.pop(k, None)
    pdir = root / "profiles"
    pdir.mkdir(exist_ok=True)
    (pdir / "this-machine.yaml").write_text(yaml.safe_dump(prof))
    return stock


def write_config(root: Path, profile: str, scontrol: Path) -> Path:
    cfg = root / f"config-{profile}.yaml"
    cfg.write_text(
        f"node:\n  profile: {profile}\n  profile_dir: {root / 'profiles'}\n"
        f"slurm:\n  scontrol: {scontrol}\n"
        f"store:\n  path: {root / 'state' / profile / 'state.db'}\n  runtime_dir: {root / 'run' / profile}\n"
        f"logging:\n  syslog: false\n  file: {root / 'hooks.log'}\n")
    return cfg


def run_checks(out: Path, venv_python: str, cfgs: dict[str, Path]) -> dict[str, Any]:
    say("[2] gpuguard check --dry-run --json on this machine's GPUs")
    results: dict[str, Any] = {}
    for prof, cfg in cfgs.items():
        for kind in ("prolog", "healthcheck", "epilog", "manual"):
            t0 = time.perf_counter()
            p = sh([venv_python, "-I", "-m", "gpuguard", "--config", str(cfg), "check", "--context", kind,
                    "--dry-run", "--json", "-v"], timeout=120)
            dt = time.perf_counter() - t0
            (out / f"check-{prof}-{kind}.json").write_text(p.stdout + "\n---stderr---\n" + p.stderr)
            try:
                doc = json.loads(p.stdout)
            except ValueError:
                say(f"    {prof}/{kind}: exit {p.returncode}, not JSON: {(p.stdout + p.stderr)[-600:]}")
                results[f"{prof}/{kind}"] = {"exit": p.returncode}
                continue
            findings = doc.get("findings", [])
            bad = [f"{f.get('check_id')}={f.get('severity')}: {f.get('message')}" for f in findings
                   if f.get("severity") not in ("ok", "skip")]
            oks = sum(1 for f in findings if f.get("severity") == "ok")
            say(f"    {prof}/{kind}: exit {p.returncode}, verdict {doc.get('verdict')}, {oks} ok, "
                f"{len(findings)} findings, {dt:.2f} s; reason {doc.get('reason')!r}")
            for line in bad:
                say(f"      {line}")
            results[f"{prof}/{kind}"] = {"exit": p.returncode, "verdict": doc.get("verdict"), "not_ok": bad,
                                         "wall_s": dt}
    return results


def timed_hooks(root: Path, libexec: Path, venv_python: str, runs: int) -> dict[str, Any]:
    from bench.nhc import find_nhc

    nhc, nhc_what = find_nhc(root / "nhc")
    gpus = ",".join(str(i) for i in range(int(sh(["nvidia-smi", "-L"]).stdout.count("GPU "))))
    node = os.uname().nodename.split(".")[0]
    base = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SLURMD_NODENAME": node, "SLURM_JOB_USER": "root",
            "SLURM_JOB_UID": "0", "SLURM_JOB_GPUS": gpus, "CUDA_VISIBLE_DEVICES": gpus}
    cmds: dict[str, list[str]] = {
        "prolog, own process": [str(libexec / "gpuguard-prolog")],
        "health check, own process": [str(libexec / "gpuguard-healthcheck")],
        "python -I -c pass": [venv_python, "-I", "-c", "pass"],
        "nvidia-smi -L": [shutil.which("nvidia-smi") or "nvidia-smi", "-L"],
    }
    if nhc:
        cmds[nhc_what] = nhc
    sig = ("import sys; print('|'.join(f'{s.encoding}:{s.errors}' for s in (sys.stdout, sys.stderr)))")
    say(f"    LANG={os.environ.get('LANG')!r} LC_ALL={os.environ.get('LC_ALL')!r}: stdout|stderr "
        f"{sh([venv_python, '-I', '-c', sig]).stdout.strip()} here, "
        f"{sh([venv_python, '-I', '-c', sig], env={'PATH': '/usr/bin:/bin'}).stdout.strip()} in slurmd's bare environment")
    say(f"[3] installed hooks as slurmd runs them, {runs} runs each, interleaved ({nhc_what if nhc else nhc_what})")
    times, codes = _interleave(cmds, runs, base)
    agent = subprocess.Popen([venv_python, "-I", "-m", "gpuguard.agent.server", "--state-dir", str(root / "hookstate")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sock = root / "hookstate" / "agent.sock"
    for _ in range(300):
        if sock.exists() or agent.poll() is not None:
            break
        time.sleep(0.05)
    for kind in ("prolog", "healthcheck"):
        p = subprocess.run([venv_python, "-I", __file__, "--out", str(root / "prof"), "--runs", "12",
                            "--profile-hook", kind], env=dict(base, SLURM_JOB_ID="999",
                                                              GPUGUARD_CONFIG=str(root / "config-this-machine.yaml"),
                                                              GPUGUARD_STATE_DIR=str(root / "hookstate"),
                                                              GPUGUARD_RUNTIME_DIR=str(root / "hookrun")),
                           capture_output=True, text=True, timeout=180, cwd="/")
        say(p.stdout.rstrip() or f"    profiling {kind} failed: {p.stderr[-1500:]}")
    if agent.poll() is None and sock.exists():
        t2, c2 = _interleave({"prolog, agent": cmds["prolog, own process"],
                              "health check, agent": cmds["health check, own process"],
                              "python -I -c pass (again)": cmds["python -I -c pass"]}, runs, base)
        times.update(t2)
        codes.update(c2)
        agent.terminate()
        agent_out = agent.communicate(timeout=10)[0]
        lines = agent_out.strip().splitlines()
        say(f"    the agent said ({len(lines)} lines): " + " / ".join(lines[:3] + ["..."] + lines[-2:]))
    else:
        say(f"    the node agent did not start: {agent.communicate(timeout=10)[0][-800:] if agent.poll() is not None else 'no socket'}")
        agent.kill()
    import re

    log = (root / "hooks.log").read_text(errors="replace") if (root / "hooks.log").exists() else ""
    for kind in ("prolog", "healthcheck"):
        runs = [ln for ln in log.splitlines() if f"{kind} node=" in ln and "took=" in ln]
        took = [float(m.group(1)) for ln in runs for m in [re.search(r"took=([0-9.]+)s", ln)] if m]
        say(f"    hook log: {len(runs)} {kind} runs, {sum('via=agent' in ln for ln in runs)} of them via the agent; "
            f"took= median {statistics.median(took) * 1000 if took else float('nan'):.0f} ms")
    rows = {}
    for name, ts in times.items():
        rows[name] = {"median_s": statistics.median(ts), "p90_s": sorted(ts)[int(0.9 * (len(ts) - 1))],
                      "exit_codes": sorted(set(codes[name]))}
        say(f"    {name}: median {rows[name]['median_s'] * 1000:.0f} ms, p90 {rows[name]['p90_s'] * 1000:.0f} ms, "
            f"exit {rows[name]['exit_codes']}")
    return rows


def _interleave(cmds: dict[str, list[str]], runs: int, base: dict[str, str]) -> tuple[dict, dict]:
    times: dict[str, list[float]] = {n: [] for n in cmds}
    codes: dict[str, list[int]] = {n: [] for n in cmds}
    for i in range(runs + 2):
        for name, argv in cmds.items():
            env = dict(base, SLURM_JOB_ID=str(1000 + i)) if "gpuguard-" in argv[0] else dict(base)
            t0 = time.perf_counter()
            p = subprocess.run(argv, env=env, capture_output=True, text=True, cwd="/", timeout=120)
            dt = time.perf_counter() - t0
            if i >= 2:
                times[name].append(dt)
                codes[name].append(p.returncode)
            if p.returncode != 0 and i == 2:
                say(f"    {name} exit {p.returncode}: {(p.stdout + p.stderr)[-600:]}")
    return times, codes


def leftover_on_gpu(root: Path, libexec: Path) -> dict[str, Any]:
    """A process of a finished job still holding GPU memory: the installed prolog of the next job and the epilog of
    the finished one, run as slurmd runs them (the epilog terminates it: it is the job user's, root here)."""
    say("[6] a process left on the GPU by a finished job: the next prolog, then the finished job's epilog")
    holder = subprocess.Popen([sys.executable, "-c", "import torch, time; x = torch.empty(4 << 30, dtype=torch.uint8, "
                               "device='cuda'); print('held', flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    line = holder.stdout.readline() if holder.stdout else ""
    say(f"    holder pid {holder.pid}: {line.strip()}")
    node = os.uname().nodename.split(".")[0]
    base = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SLURMD_NODENAME": node, "SLURM_JOB_USER": "root",
            "SLURM_JOB_UID": "0", "SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0"}
    log = root / "scontrol.log"
    before = log.read_text() if log.exists() else ""
    out: dict[str, Any] = {}
    for kind, job in (("prolog", "5001"), ("epilog", "5000")):
        t = time.perf_counter()
        p = subprocess.run([str(libexec / f"gpuguard-{kind}")], env=dict(base, SLURM_JOB_ID=job), capture_output=True,
                           text=True, timeout=120, cwd="/")
        out[kind] = {"exit": p.returncode, "stderr": p.stderr[-1500:], "wall_s": time.perf_counter() - t}
        say(f"    {kind} (job {job}): exit {p.returncode} in {out[kind]['wall_s']:.2f} s: {p.stderr.strip()[-700:]}")
    time.sleep(0.5)
    out["holder_alive"] = holder.poll() is None
    say(f"    holder still running after the epilog: {out['holder_alive']} (exit {holder.poll()})")
    after = log.read_text() if log.exists() else ""
    out["scontrol"] = after[len(before):]
    say(f"    scontrol calls: {out['scontrol'].strip() or 'none'}")
    if holder.poll() is None:
        holder.kill()
    holder.wait(30)
    return out


def monitor_under_load(root: Path, venv_python: str, cfg: Path) -> dict[str, Any]:
    say("[4] the per-job monitor's sample while the GPU multiplies matrices")
    load = ("import torch,time\na=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16)\nt=time.time()\n"
            "while time.time()-t<25:\n  b=a@a\ntorch.cuda.synchronize()\n")
    job_dir = root / "job"
    job_dir.mkdir(exist_ok=True)
    burner = subprocess.Popen([sys.executable, "-c", load], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    time.sleep(12)
    p = sh([venv_python, "-I", "-m", "gpuguard", "--config", str(cfg), "monitor", "--job-dir", str(job_dir),
            "--job-id", "77", "--once"], timeout=60)
    rc = burner.wait(60)
    burner_out = burner.stdout.read() if burner.stdout else ""
    say(f"    monitor exit {p.returncode}; load exit {rc} {burner_out[-300:]}")
    say("    " + (p.stdout.strip()[:3000] or p.stderr.strip()[-1500:]))
    return {"exit": p.returncode, "stdout": p.stdout[-20000:], "stderr": p.stderr[-3000:], "load_exit": rc}


def kernel_log(out: Path, venv_python: str, cfg: Path, forge: bool = False) -> dict[str, Any]:
    say("[5] the kernel log on this machine")
    res: dict[str, Any] = {}
    for argv in (["dmesg"], ["journalctl", "-k", "--no-pager", "-o", "short-monotonic"]):
        if shutil.which(argv[0]) is None:
            res[argv[0]] = "not installed"
            continue
        p = sh(argv, timeout=30)
        path = out / f"{argv[0]}.txt"
        path.write_text(p.stdout[-2_000_000:])
        scan = sh([venv_python, "-I", "-m", "gpuguard", "xid", "scan", "--file", str(path), "--json"], timeout=60)
        res[argv[0]] = {"exit": p.returncode, "lines": p.stdout.count("\n"), "nvrm_lines": p.stdout.count("NVRM"),
                        "err": p.stderr[-300:], "scan_exit": scan.returncode, "scan": scan.stdout[-1500:]}
        say(f"    {argv[0]}: exit {p.returncode}, {res[argv[0]]['lines']} lines, {res[argv[0]]['nvrm_lines']} NVRM "
            f"lines {p.stderr.strip()[-200:]}; xid scan exit {scan.returncode}: {scan.stdout.strip()[-400:]}")
    res["kmsg_readable"] = os.access("/dev/kmsg", os.R_OK)
    say(f"    /dev/kmsg readable: {res['kmsg_readable']}")
    # a user-space process (root here) writing an Xid-looking line to the real kernel log: never evidence. Only with
    # --forge-kmsg: every other health tool on the machine (NHC's check_cmd_dmesg, DCGM, gpud) would see it too
    forged = False
    if not forge:
        say("    no forged Xid line written to /dev/kmsg (--forge-kmsg does, where other tools will see it too)")
    else:
        try:
            with open("/dev/kmsg", "w") as kmsg:
                kmsg.write("NVRM: Xid (PCI:0000:00:06): 79, pid=1, name=forged, GPU has fallen off the bus.\n")
            forged = True
        except OSError as e:
            say(f"    could not write to /dev/kmsg: {e}")
    if forged:
        p = sh([venv_python, "-I", "-m", "gpuguard", "--config", str(cfg), "check", "--context", "healthcheck",
                "--dry-run", "--json"], timeout=120)
        doc = json.loads(p.stdout or "{}")
        xid = [f for f in doc.get("findings", []) if f.get("check_id") == "gpu.xid"]
        res["forged"] = {"verdict": doc.get("verdict"), "xid": xid}
        say(f"    after writing a forged Xid 79 line to /dev/kmsg: verdict {doc.get('verdict')}, gpu.xid "
            f"{[(f.get('severity'), f.get('message')) for f in xid]}")
    return res


def profile_hook(kind: str, runs: int) -> int:
    """(In the hook's environment, with the hook's interpreter.) Where a warm in-process hook run spends its time:
    cProfile over `runs` runs of gpuguard.cli.hooks.run_hook after two warm-ups."""
    import cProfile
    import io
    import pstats

    t0 = time.perf_counter()
    from gpuguard.cli import hooks
    import pynvml  # noqa: F401

    imported = time.perf_counter() - t0
    codes = [hooks.run_hook(kind, None, exit_process=lambda c: None) for _ in range(2)]
    prof = cProfile.Profile()
    walls = []
    for _ in range(runs):
        t = time.perf_counter()
        prof.enable()
        codes.append(hooks.run_hook(kind, None, exit_process=lambda c: None))
        prof.disable()
        walls.append(time.perf_counter() - t)
    print(f"    {kind} in-process: imports {imported * 1000:.0f} ms once; a warm run median "
          f"{statistics.median(walls) * 1000:.1f} ms (exit codes {sorted(set(codes))})")
    for order in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(22)
        lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
        start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
        print(f"    top by {order} (all {runs} runs together):")
        for ln in lines[start:]:
            print("      " + ln[:170])
    return 0


def cold_nvml(runs: int) -> int:
    """(A clean interpreter.) What a hook's first NVML probe costs in a fresh process and in a child forked from a
    parent that (b) only imported pynvml, as the node agent does, (c) also mapped libnvidia-ml.so.1 with ctypes,
    (d) also let pynvml load it. Medians of `runs` children each."""
    import ctypes

    import pynvml

    from gpuguard.probes.nvml import read_nvml

    def child_probe(w: int) -> None:
        per = nvml_call_times(pynvml, read_nvml, 1)
        os.write(w, json.dumps(per).encode())
        os._exit(0)

    def forked() -> dict[str, Any]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            child_probe(w)
        os.close(w)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        os.close(r)
        os.waitpid(pid, 0)
        return json.loads(data)

    results: dict[str, list[dict[str, Any]]] = {}
    results["(b) forked, parent imported pynvml"] = [forked() for _ in range(runs)]
    t = time.perf_counter()
    handle = ctypes.CDLL("libnvidia-ml.so.1")
    print(f"    ctypes.CDLL('libnvidia-ml.so.1') in the parent: {(time.perf_counter() - t) * 1000:.1f} ms")
    results["(c) forked, parent mapped libnvidia-ml"] = [forked() for _ in range(runs)]
    pynvml._LoadNvmlLibrary()
    results["(d) forked, pynvml loaded it in the parent"] = [forked() for _ in range(runs)]
    del handle
    for name, rows in results.items():
        whole = statistics.median(r["(whole probe)"][1] for r in rows)
        calls = {k: statistics.median(r.get(k, [0, 0])[1] for r in rows) for k in rows[0] if k != "(whole probe)"}
        top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1])[:5])
        print(f"    {name}: first probe median {whole:.1f} ms; slowest calls (ms): {top}")
    return 0


def setup(root: Path, extra_path: Optional[str]) -> tuple[str, Path, Path]:
    venv = root / "venv"
    sh([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], timeout=120)
    purelib = sh([str(venv / "bin/python"), "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"]).stdout
    import site

    # this interpreter's own packages too: when it is itself a venv, --system-site-packages would not see them
    paths = ([str(REPO / "lib")] + ([str(Path(extra_path).resolve())] if extra_path else [])
             + [p for p in site.getsitepackages() if Path(p).is_dir()])
    Path(purelib.strip(), "gpuguard-checkout.pth").write_text("\n".join(paths) + "\n")
    scontrol = root / "bin" / "scontrol"
    scontrol.parent.mkdir(parents=True)
    scontrol.write_text(FAKE_SCONTROL.format(log=root / "scontrol.log"))
    scontrol.chmod(0o755)
    return str(venv / "bin/python"), scontrol, root / "libexec"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--forge-kmsg", action="store_true",
                    help="write a forged Xid 79 line to the real /dev/kmsg and show it is ignored (every other tool "
                         "reading the kernel log on this machine will see it too)")
    ap.add_argument("--extra-path", help="a folder of pure-Python packages the machine lacks (e.g. hostlist.py)")
    ap.add_argument("--profile-hook", metavar="KIND", help=argparse.SUPPRESS)  # internal: see profile_hook
    ap.add_argument("--cold-nvml", action="store_true", help=argparse.SUPPRESS)  # internal: see cold_nvml
    ap.add_argument("--fresh-probe", action="store_true", help=argparse.SUPPRESS)  # internal: one cold probe
    args = ap.parse_args()
    if args.profile_hook:
        return profile_hook(args.profile_hook, args.runs)
    if args.cold_nvml:
        return cold_nvml(args.runs)
    if args.fresh_probe:
        t = time.perf_counter()
        import pynvml

        imported = (time.perf_counter() - t) * 1000
        from gpuguard.probes.nvml import read_nvml

        print(json.dumps(dict(nvml_call_times(pynvml, read_nvml, 1), **{"(import)": (1, imported)})))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="gpuguard-real-"))
    report: dict[str, Any] = {"host": os.uname().nodename, "kernel": os.uname().release}
    venv_python, scontrol, libexec = setup(root, args.extra_path)
    report["nvml"] = nvml_facts(out)
    fresh = []
    for _ in range(5):
        p = sh([venv_python, "-I", __file__, "--out", str(root / "cold"), "--runs", "1", "--fresh-probe"])
        fresh.append(json.loads(p.stdout or "{}"))
    say("    (a) a fresh process's first probe: median "
        f"{statistics.median(f.get('(whole probe)', [0, 0])[1] for f in fresh):.1f} ms; its import of pynvml "
        f"{statistics.median(f.get('(import)', [0, 0])[1] for f in fresh):.1f} ms")
    p = sh([venv_python, "-I", __file__, "--out", str(root / "cold"), "--runs", "7", "--cold-nvml"], timeout=300)
    say(p.stdout.rstrip() or p.stderr[-1500:])
    stock = machine_profile(root, report["nvml"]["observation"])
    cfgs = {p: write_config(root, p, scontrol) for p in ("generic", "this-machine")}
    say(f"    profile this-machine = {stock} cut to this machine")
    report["checks"] = run_checks(out, venv_python, cfgs)
    from gpuguard.cli.install import install_hooks

    install_hooks(libexec, venv_python, str(cfgs["this-machine"]), state_dir=str(root / "hookstate"),
                  runtime_dir=str(root / "hookrun"))
    report["hooks"] = timed_hooks(root, libexec, venv_python, args.runs)
    report["scontrol_calls"] = (root / "scontrol.log").read_text() if (root / "scontrol.log").exists() else ""
    say(f"    scontrol calls by the hooks: {report['scontrol_calls'].strip()[-1500:] or 'none'}")
    report["leftover"] = leftover_on_gpu(root, libexec)
    report["monitor"] = monitor_under_load(root, venv_python, cfgs["this-machine"])
    report["kernel_log"] = kernel_log(out, venv_python, cfgs["this-machine"], forge=args.forge_kmsg)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
