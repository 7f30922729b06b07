"""The torchrun template's per-node wrapper (gpuguard_node), run by bash exactly as rendered, with fake torchruns
that behave like the two kinds of real one (their workers are child processes, as torchrun's are):

- a torchrun whose --help lists --shutdown-timeout (PyTorch with pytorch/pytorch#172596): a stop request
  (SIGUSR2 from the batch script) is passed to torchrun as SIGTERM; torchrun forwards it and waits the window;
- an older torchrun: it would SIGKILL its workers 30 s after forwarding SIGTERM, so the wrapper signals the
  workers themselves and torchrun only after the whole window (TORCH_ELASTIC_SHUTDOWN_TIMEOUT).

And which node hosts the c10d store (issue 16: torchrun's own guess fails where the host name maps to 127.0.1.1).
The real thing, with real torchruns of the oldest and newest supported PyTorch, is tests/integration/test_torchrun.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gpuguard.templates import render_template

# A worker: marks that it started, and on SIGTERM takes `CKPT_S` seconds to "checkpoint", then exits 0.
# HUNG workers ignore SIGTERM (a hang): only torchrun's SIGKILL ends them.
FAKE_TORCHRUN = r"""#!/bin/bash
if [ "$1" = --help ]; then echo "usage: torchrun [--nnodes NNODES] $HELP_EXTRA"; exit 0; fi
printf '%s\0' "$@" > "$OUT/torchrun.args"
worker() {
  if [ -n "${HUNG:-}" ]; then trap '' TERM; else trap 'echo "$(date +%s.%N)" > "$OUT/w$1.term"; sleep "$CKPT_S"; echo done > "$OUT/w$1.saved"; exit 0' TERM; fi
  echo started > "$OUT/w$1.started"
  while :; do sleep 0.05; done
}
worker 0 & w0=$!
worker 1 & w1=$!
# like torchrun: SIGTERM is forwarded to the workers, which are SIGKILLed after the shutdown timeout
on_term() {
  echo "$(date +%s.%N)" > "$OUT/torchrun.term"
  kill -TERM "$w0" "$w1" 2>/dev/null
  local end=$((SECONDS + ${KILL_AFTER:-30}))
  while { kill -0 "$w0" || kill -0 "$w1"; } 2>/dev/null && [ "$SECONDS" -lt "$end" ]; do sleep 0.05; done
  if kill -0 "$w0" 2>/dev/null || kill -0 "$w1" 2>/dev/null; then
    kill -KILL "$w0" "$w1" 2>/dev/null
    echo killed > "$OUT/torchrun.killed"
  fi
  exit 1
}
trap on_term TERM
echo "$$" > "$OUT/torchrun.pid"
while kill -0 "$w0" 2>/dev/null || kill -0 "$w1" 2>/dev/null; do sleep 0.05; done
exit 0
"""


def _node_script(tmp: Path) -> Path:
    text = render_template("torchrun.sbatch.j2", {"nodes": 2, "command": ["t.py"], "local_dir": str(tmp / "local"),
                                                  "gpus_per_node": 0, "requeue_grace_s": 10})
    funcs = text[text.index("gpuguard_node() {"):text.index("gpuguard_is_loopback()")]
    script = tmp / "node.sh"
    script.write_text(funcs + '\ngpuguard_node "$@"\n')
    return script


def _default_signals() -> None:
    """As slurmstepd starts a task: default dispositions (an ignored signal is inherited, and bash cannot trap a
    signal that was ignored when it started; a test process may have ignored one)."""
    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


_STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_leftovers():
    """Whatever a test leaves running (a timeout, a failed assertion) is killed with its process group."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate(timeout=10)


def _start(tmp: Path, help_extra: str, node: str = "node1", window: int = 3, fake_text: str = FAKE_TORCHRUN,
           **env: str) -> subprocess.Popen[str]:
    (tmp / "local").mkdir(exist_ok=True)
    fake = tmp / "torchrun"
    fake.write_text(fake_text)
    fake.chmod(0o755)
    proc = subprocess.Popen(
        ["bash", str(_node_script(tmp)), str(fake), "--nnodes=2", "t.py"], cwd=tmp, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_default_signals,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp), "HELP_EXTRA": help_extra, "SLURM_JOB_ID": "7",
             "SLURMD_NODENAME": node, "SLURM_NODEID": "0" if node == "node1" else "1", "SLURM_STEP_ID": "3",
             "GPUGUARD_RDZV_HEAD": "node1", "ATTEMPT_DIR": str(tmp), "GPUGUARD_LOCAL_ROOT": str(tmp / "local"),
             "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(window), "CKPT_S": "0", **env})
    _STARTED.append(proc)
    return proc


def _wait_file(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _stop(proc: subprocess.Popen[str], tmp: Path) -> None:
    """What `scancel --signal=USR2 <job>.<step>` does: SIGUSR2 to every process of the step; sent once both
    workers run and the fake torchrun has set its trap (it writes torchrun.pid after `trap`): a SIGTERM forwarded
    before that would kill it by default and leave its workers looping with the pipes open (a 60 s hang here on a
    loaded machine)."""
    _wait_file(tmp / "w0.started")
    _wait_file(tmp / "w1.started")
    _wait_file(tmp / "torchrun.pid")
    os.killpg(proc.pid, signal.SIGUSR2)


def test_old_torchrun_the_workers_get_the_whole_window(tmp_path):
    """torchrun without --shutdown-timeout: it is not signalled, so it cannot SIGKILL a checkpoint at 30 s (here
    KILL_AFTER=1 s stands for its 30 s); the workers take 3 s and finish."""
    proc = _start(tmp_path, "", window=20, CKPT_S="3", KILL_AFTER="1")
    _stop(proc, tmp_path)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert (tmp_path / "w0.saved").exists() and (tmp_path / "w1.saved").exists()
    assert not (tmp_path / "torchrun.term").exists() and not (tmp_path / "torchrun.killed").exists()
    assert "this torchrun has no --shutdown-timeout" in err
    assert (tmp_path / "train-step").read_text().strip() == "3"  # where the batch script sends its SIGUSR2


def test_old_torchrun_a_hung_worker_is_ended_by_torchrun_after_the_window(tmp_path):
    proc = _start(tmp_path, "", window=2, HUNG="1", KILL_AFTER="1")
    _stop(proc, tmp_path)
    stopped = time.time()
    proc.communicate(timeout=60)
    assert (tmp_path / "torchrun.killed").exists()
    # torchrun was asked to stop only after the window (2 s), then ended the hung workers itself
    assert float((tmp_path / "torchrun.term").read_text()) - stopped >= 1.9


def test_new_torchrun_gets_the_stop_itself(tmp_path):
    """torchrun with --shutdown-timeout: SIGTERM to torchrun, which forwards it (and waits the window the
    template configured through TORCH_ELASTIC_SHUTDOWN_TIMEOUT)."""
    proc = _start(tmp_path, "[--shutdown-timeout SHUTDOWN_TIMEOUT]", CKPT_S="1", KILL_AFTER="5")
    _stop(proc, tmp_path)
    _, err = proc.communicate(timeout=60)
    assert (tmp_path / "torchrun.term").exists()
    assert (tmp_path / "w0.saved").exists() and not (tmp_path / "torchrun.killed").exists()
    assert "no --shutdown-timeout" not in err


@pytest.mark.parametrize("node,is_host", [("node1", "1"), ("node2", "0")])
def test_only_the_first_node_hosts_the_rendezvous_store(tmp_path, node, is_host):
    proc = _start(tmp_path, "[--shutdown-timeout S]", node=node)
    _stop(proc, tmp_path)
    proc.communicate(timeout=60)
    argv = (tmp_path / "torchrun.args").read_bytes().split(b"\0")[:-1]
    assert argv[0].decode() == f"--rdzv-conf=is_host={is_host}" and argv[1].decode() == "--nnodes=2"


def test_old_torchrun_gets_the_flight_recorder_under_its_old_names(tmp_path):
    """PyTorch from before pytorch/pytorch#152563 reads only TORCH_NCCL_TRACE_BUFFER_SIZE and
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE: on an older torchrun the wrapper sets them from the preset's new names."""
    fake = FAKE_TORCHRUN.replace('printf \'%s\\0\' "$@"', 'env > "$OUT/env"; printf \'%s\\0\' "$@"', 1)
    assert fake != FAKE_TORCHRUN
    for extra, old_names in (("", True), ("[--shutdown-timeout S]", False)):
        proc = _start(tmp_path, extra, fake_text=fake, TORCH_FR_BUFFER_SIZE="2000",
                      TORCH_FR_DUMP_TEMP_FILE="/j/fr/rank_")
        _stop(proc, tmp_path)
        proc.communicate(timeout=60)
        env = (tmp_path / "env").read_text()
        assert ("TORCH_NCCL_TRACE_BUFFER_SIZE=2000" in env) is old_names
        assert ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE=/j/fr/rank_" in env) is old_names
        for f in tmp_path.glob("w*.started"):
            f.unlink()


@pytest.mark.parametrize("left,expect,event", [
    ("1:30", "time limit in <= 100 s", "timelimit"),              # Slurm's warning: the limit is near
    ("2:40", "time limit in <= 100 s", "timelimit"),              # ... up to a minute early
    ("1-02:00:00", "a requeue was asked for, not the time limit (93600 s left", "stop"),  # the monitor's / a person's
    ("45:00", "a requeue was asked for, not the time limit (2700 s left", "stop"),
    ("UNLIMITED", "a requeue was asked for, not the time limit (unlimited s left", "stop"),
    ("", "time limit in <= 100 s", "timelimit"),                  # squeue failed: the default wording
])
def test_a_stop_request_is_called_what_it_is(tmp_path, left, expect, event):
    """Issue 16: a hang-triggered requeue (gpuguard monitor's USR1) was announced as the time limit."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "squeue").write_text(f"#!/bin/bash\n[ -n '{left}' ] && echo '{left}'\n")
    (stubs / "scancel").write_text("#!/bin/bash\nexit 0\n")
    for f in stubs.iterdir():
        f.chmod(0o755)
    text = render_template("torchrun.sbatch.j2", {"nodes": 2, "command": ["t.py"], "requeue_grace_s": 100})
    funcs = text[text.index("gpuguard_on_usr1() {"):text.index("gpuguard_on_term() {")]
    (tmp_path / "usr1.sh").write_text(f"ATTEMPT=1\nGPUGUARD_STOP_FILE={tmp_path}/stop\nATTEMPT_DIR={tmp_path}\n"
                                      + funcs + "\nEVENT=none\ngpuguard_on_usr1\necho \"EVENT=$EVENT\"\n")
    p = subprocess.run(["bash", str(tmp_path / "usr1.sh")], capture_output=True, text=True, timeout=30,
                       env={"PATH": f"{stubs}:/usr/bin:/bin", "SLURM_JOB_ID": "5"})
    assert expect in p.stderr, p.stderr
    assert f"EVENT={event}" in p.stdout  # what job-attempt end is told (issue 29 item 4: stop is not the limit)


@pytest.mark.parametrize("has_option", [True, False])
def test_the_stop_mode_is_read_from_torchs_source_without_starting_torchrun(tmp_path: Path, has_option: bool):
    """`torchrun --help` imports torch: seconds on every node at every attempt (minutes of CPU in this suite). The
    template reads torch/distributed/run.py of the torchrun's own interpreter instead (found without importing
    torch), and asks --help only when it cannot tell."""
    import venv

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    (site,) = (env_dir / "lib").glob("python*/site-packages")
    (site / "torch" / "distributed").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("raise SystemExit('torch must not be imported to ask')\n")
    option = '"--shutdown-timeout",' if has_option else '"--max-restarts",'
    (site / "torch" / "distributed" / "run.py").write_text(f"parser.add_argument(\n    {option}\n)\n")
    torchrun = env_dir / "bin" / "torchrun"
    torchrun.write_text(f"#!{env_dir / 'bin' / 'python'}\nopen({str(tmp_path / 'started')!r}, 'w').close()\n")
    torchrun.chmod(0o755)
    text = render_template("torchrun.sbatch.j2", {"nodes": 2, "command": ["t.py"], "gpus_per_node": 0})
    funcs = text[text.index("gpuguard_torchrun_lists() {"):text.index("gpuguard_node_stop() {")]
    p = subprocess.run(["bash", "-c", funcs + f'\ngpuguard_stop_mode {torchrun} 2>/dev/null; echo "$GPUGUARD_STOP_MODE"'],
                       capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == ("torchrun" if has_option else "workers"), p.stderr
    assert not (tmp_path / "started").exists()  # torchrun was never started to ask
