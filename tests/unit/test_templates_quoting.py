"""Property tests: hostile values in a rendered torchrun script never execute. The rendered script is run by
bash with stub srun/scontrol/gpuguard that record exactly what they were given."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from propbudget import examples

from gpuguard.templates import render_template
from gpuguard.templates.quoting import shell_word

PAYLOADS = ["$(touch MARK)", "`touch MARK`", "'; touch MARK; '", '"; touch MARK; "', "\ntouch MARK\n",
            "${IFS}$(touch${IFS}MARK)", "$((1+1))", "a\\", "-n", "*", "~root", "=x", "!!", "\\$(touch MARK)"]
hostile = st.one_of(st.sampled_from(PAYLOADS),
                    st.lists(st.sampled_from(list("ab $`'\"\\;|&()<>{}*?~!#=\n\t-/") + ["MARK", "touch "]),
                             max_size=16).map("".join))

STUBS = {
    "scontrol": """#!/bin/bash
case "$1 $2" in
  "show hostnames") printf 'node1\\nnode2\\n' ;;
  "show node") echo "NodeName=node1 NodeAddr=192.0.2.10 State=IDLE" ;;
esac
""",
    # like srun: record the options, then run the command (the per-node function) as node 0 would
    "srun": """#!/bin/bash
case " $* " in *" monitor "*) exit 0 ;; esac
printf '%s\\0' "$@" > "$STUB_OUT/srun.args"
while [ $# -gt 0 ] && [ "$1" != bash ]; do shift; done
export SLURM_NODEID=0 SLURMD_NODENAME=node1
exec "$@"
""",
    "torchrun x": """#!/bin/bash
if [ "$1" = --help ]; then exit 0; fi
printf '%s\\0' "$@" > "$STUB_OUT/torchrun.args"
printf '%s' "$MY_VAR" > "$STUB_OUT/env.MY_VAR"
printf '%s' "$TRITON_CACHE_DIR" > "$STUB_OUT/env.TRITON_CACHE_DIR"
printf '%s' "$GPUGUARD_RESUME_FROM" > "$STUB_OUT/env.RESUME"
echo "a line on stderr" >&2
""",
    "gg": """#!/bin/bash
if [ "$2" = begin ]; then printf '%s' "$STUB_RESUME"; exit 0; fi
if [ "$2" = fabric ]; then exit 0; fi
printf '%s\\0' "$@" > "$STUB_OUT/end.args"
echo "finished 0"
""",
}


def _setup(tmp: Path) -> tuple[Path, dict[str, str]]:
    stubs = tmp / "stubs"
    stubs.mkdir(exist_ok=True)
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]",
           "STUB_OUT": str(tmp), "HOME": str(tmp)}
    return stubs, env


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(hostile, min_size=1, max_size=4), env_value=hostile, resume=hostile, ckpt=hostile,
       local=hostile, pattern=st.sampled_from(["x", "a b", "$(touch MARK)", "'\"`"]))
def test_hostile_values_never_execute(tmp_path_factory, args, env_value, resume, ckpt, local, pattern):
    tmp = tmp_path_factory.mktemp("run")
    stubs, env = _setup(tmp)
    local_root = tmp / "scratch" / (local.replace("/", "_") or "l")
    local_root.mkdir(parents=True)
    values = {"nodes": 2, "command": ["train.py", *args], "env": {"MY_VAR": env_value}, "checkpoint_dir": ckpt or "c",
              "local_dir": str(local_root), "gpuguard": str(stubs / "gg"), "torchrun": str(stubs / "torchrun x"),
              "no_retry_patterns": [pattern], "job_root": "jobs", "preset": "p5.48xlarge"}
    script = tmp / "job.sbatch"
    script.write_text(render_template("torchrun.sbatch.j2", values))
    p = subprocess.run(["bash", str(script)], cwd=tmp, env={**env, "STUB_RESUME": resume}, capture_output=True,
                       text=True, timeout=60)
    assert not (tmp / "MARK").exists(), "a hostile value was executed"
    assert p.returncode == 0, p.stderr
    srun = [a.decode() for a in (tmp / "srun.args").read_bytes().split(b"\0")[:-1]]
    assert srun[:4] == ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label"]
    argv = [a.decode() for a in (tmp / "torchrun.args").read_bytes().split(b"\0")[:-1]]
    # the resume path comes back through $(...), which drops trailing newlines (gpuguard never prints a path with
    # control characters: find_checkpoint skips them)
    resume = resume.rstrip("\n")
    expected_tail = ["train.py", *args] + (["--resume", resume] if resume else [])
    assert argv[-len(expected_tail):] == expected_tail  # every argument arrived exactly as given
    # node1 is the job's first node: it hosts the c10d store (issue 16)
    assert argv[0] == "--rdzv-conf=is_host=1" and argv[1] == "--nnodes=2" and "--tee=3" in argv
    assert (tmp / "env.MY_VAR").read_text() == env_value
    # node-local caches: in the private directory the node function created (0700, ours)
    private = local_root / "gpuguard-42"
    assert (tmp / "env.TRITON_CACHE_DIR").read_text() == f"{private}/triton-cache"
    assert private.is_dir() and (private.stat().st_mode & 0o777) == 0o700
    assert "a line on stderr" in p.stdout + p.stderr  # torchrun's stderr passes through the filter
    end = [a.decode() for a in (tmp / "end.args").read_bytes().split(b"\0")[:-1]]
    assert end[end.index("--no-retry-pattern") + 1] == pattern


def _run_node_function(tmp: Path, local_root: Path, extra: str = "") -> subprocess.CompletedProcess[str]:
    """Render a job, then run only its per-node function the way srun would, with a stub torchrun."""
    stubs, env = _setup(tmp)
    text = render_template("torchrun.sbatch.j2", {"nodes": 1, "command": ["t.py"], "local_dir": str(local_root),
                                                  "torchrun": str(stubs / "torchrun x")})
    funcs = text[text.index("gpuguard_node() {"):text.index("gpuguard_is_loopback()")]
    script = tmp / "node.sh"
    script.write_text(funcs + extra + '\ngpuguard_node "$@"\n')
    return subprocess.run(["bash", str(script), str(stubs / "torchrun x"), "t.py"], cwd=tmp, capture_output=True,
                          text=True, timeout=30, env={**env, "SLURMD_NODENAME": "node1",
                                                      "ATTEMPT_DIR": str(tmp), "GPUGUARD_LOCAL_ROOT": str(local_root)})


def test_a_planted_scratch_directory_is_never_used(tmp_path):
    """Issue 9: the predictable /tmp/gpuguard-<jobid> could be pre-created by another user to plant modules."""
    import os

    root = tmp_path / "tmp"
    root.mkdir()
    planted = root / "gpuguard-42"
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    if os.geteuid() == 0:
        os.chown(planted, 65534, 65534)  # another user's
    p = _run_node_function(tmp_path, root)
    assert p.returncode == 0, p.stderr
    used = Path((tmp_path / "env.TRITON_CACHE_DIR").read_text()).parent
    assert used != planted and used.name.startswith("gpuguard-42.") and (used.stat().st_mode & 0o777) == 0o700
    assert "is not a private directory" in p.stderr
    # a link at the predictable path is refused too, even one pointing at our own directory
    planted.rmdir()
    target = root / "elsewhere"
    target.mkdir(mode=0o700)
    planted.symlink_to(target)
    p = _run_node_function(tmp_path, root)
    assert p.returncode == 0 and Path((tmp_path / "env.TRITON_CACHE_DIR").read_text()).parent != planted
    # our own 0700 directory from an earlier step of the job is reused
    planted.unlink()
    planted.mkdir(mode=0o700)
    p = _run_node_function(tmp_path, root)
    assert Path((tmp_path / "env.TRITON_CACHE_DIR").read_text()).parent == planted and "WARNING" not in p.stderr


def test_a_planned_stop_prints_one_line_instead_of_the_traceback(tmp_path):
    traceback = ("Traceback (most recent call last):\n  File \"/v/bin/torchrun\", line 8, in <module>\n"
                 "    sys.exit(main())\n"
                 "torch.distributed.elastic.multiprocessing.api.SignalException: Process 4242 got signal: 15\n")
    fake = tmp_path / "fake_torchrun"
    fake.write_text(f"#!/bin/bash\necho '[rank0]: worker line'\nprintf %s '{traceback}' >&2\nexit 1\n")
    fake.chmod(0o755)
    root = tmp_path / "tmp"
    root.mkdir()
    stop = tmp_path / "stop-requested"

    def run():
        stubs, env = _setup(tmp_path)
        text = render_template("torchrun.sbatch.j2", {"nodes": 1, "command": ["t.py"]})
        funcs = text[text.index("gpuguard_node() {"):text.index("gpuguard_is_loopback()")]
        (tmp_path / "node.sh").write_text(funcs + '\ngpuguard_node "$@"\n')
        return subprocess.run(["bash", str(tmp_path / "node.sh"), str(fake)], capture_output=True, text=True,
                              timeout=30, env={**env, "SLURMD_NODENAME": "node1", "ATTEMPT_DIR": str(tmp_path),
                                               "GPUGUARD_LOCAL_ROOT": str(root), "GPUGUARD_STOP_FILE": str(stop)})
    p = run()  # not asked to stop: the traceback is kept as it is
    assert p.returncode == 1 and "SignalException" in p.stderr and "Traceback" in p.stderr
    stop.touch()
    p = run()
    assert p.returncode == 1 and "Traceback" not in p.stderr and "SignalException" not in p.stderr
    assert "node1: torchrun stopped its workers for a planned checkpoint-and-requeue (signal 15)" in p.stderr
    assert "[rank0]: worker line" in p.stdout


@given(st.text(max_size=40).filter(lambda s: "\x00" not in s))
@settings(max_examples=examples(200), deadline=None)
def test_shell_word_round_trips_through_bash(value):
    out = subprocess.run(["bash", "-c", f"printf %s {shell_word(value)}"], capture_output=True, timeout=10)
    assert out.stdout.decode("utf-8", errors="surrogateescape") == value


HEAD_STUBS = {
    "scontrol": """#!/bin/bash
case "$1 $2" in
  "show hostnames") printf 'node1\\nnode2\\n' ;;
  "show node") if [ "$4" = node1 ]; then echo "NodeName=node1 NodeAddr=$ADDR1 State=ALLOCATED";
               else printf 'NodeName=node1 NodeAddr=%s State=ALLOCATED\\nNodeName=node2 NodeAddr=%s State=ALLOCATED\\n' "$ADDR1" "$ADDR2"; fi ;;
esac
""",
    "getent": "#!/bin/bash\necho \"$RESOLVED STREAM $3\"\n",            # /etc/hosts: 127.0.1.1 node1
    "hostname": "#!/bin/bash\n[ \"$1\" = -I ] && echo '10.9.8.7 172.17.0.1' || echo node1\n",
    "srun": "#!/bin/bash\necho '10.9.8.8'\n",                             # `hostname -I` run on the head node
}


@pytest.mark.parametrize("addr1,addr2,resolved,batch_host,expect", [
    ("10.0.0.1", "10.0.0.2", "-", "node1", "10.0.0.1"),           # NodeAddr is an address: used as is
    ("node1", "node2", "10.0.0.1", "node1", "10.0.0.1"),           # a name: resolved
    ("node1", "node2", "127.0.1.1", "node1", "10.9.8.7"),          # resolved to loopback: the head's real address
    ("node1", "node2", "127.0.1.1", "node2", "10.9.8.8"),          # ... asked through srun when we are not the head
    ("127.0.0.1", "127.0.0.1", "-", "node1", "127.0.0.1"),         # every node configured on this one host
    ("127.0.0.1", "10.0.0.2", "127.0.0.1", "node1", "10.9.8.7"),   # a loopback head in a multi-host job: never
])
def test_the_rendezvous_address_is_never_a_resolved_loopback(tmp_path, addr1, addr2, resolved, batch_host, expect):
    """Issue 10: a head node whose name resolves to 127.0.1.1 (Debian's /etc/hosts) made the other nodes dial
    themselves."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, text in HEAD_STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    text = render_template("torchrun.sbatch.j2", {"nodes": 2, "command": ["t.py"]})
    part = text[text.index("gpuguard_is_loopback()"):text.index("RDZV_PORT=")]
    (tmp_path / "rdzv.sh").write_text(part + 'echo "HEAD_ADDR=$HEAD_ADDR"\n')
    p = subprocess.run(["bash", str(tmp_path / "rdzv.sh")], capture_output=True, text=True, timeout=30,
                       env={"PATH": f"{stubs}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node[1-2]", "ADDR1": addr1,
                            "ADDR2": addr2, "RESOLVED": resolved, "SLURMD_NODENAME": batch_host})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == f"HEAD_ADDR={expect}"


@pytest.mark.parametrize("finished_first", [True, False])
def test_a_time_limit_warning_after_the_training_finished_is_not_a_time_limit(tmp_path, finished_first):
    """Issue 29: the time-limit warning (USR1) came while the step was winding down after the training had finished:
    the attempt was recorded as a time limit and the job requeued once more for nothing. Now a USR1 that reached no
    running torchrun leaves the event `none` (the attempt finished); one that stopped a running training is still
    the time limit."""
    stubs, env = _setup(tmp_path)
    # srun runs the node's part, then the warning reaches the batch shell (its parent) while srun is still there
    (stubs / "srun").write_text("#!/bin/bash\ncase \" $* \" in *\" monitor \"*) exit 0 ;; esac\n"
                                "while [ $# -gt 0 ] && [ \"$1\" != bash ]; do shift; done\n"
                                "export SLURM_NODEID=0 SLURMD_NODENAME=node1\n"
                                "\"$@\" &\nnode=$!\n"
                                + ("wait $node\nkill -USR1 $PPID\nsleep 1\n" if finished_first else
                                   "sleep 1\nkill -USR1 $PPID\nsleep 0.5\nkill -USR2 $node\nwait $node\n"))
    (stubs / "scancel").write_text("#!/bin/bash\nexit 0\n")
    (stubs / "scancel").chmod(0o755)
    (stubs / "torchrun x").write_text("#!/bin/bash\nif [ \"$1\" = --help ]; then exit 0; fi\n"
                                      "trap 'exit 0' TERM\nsleep " + ("0" if finished_first else "5 & wait") + "\n")
    values = {"nodes": 1, "command": ["train.py"], "checkpoint_dir": "c", "local_dir": str(tmp_path),
              "gpuguard": str(stubs / "gg"), "torchrun": str(stubs / "torchrun x"), "job_root": "jobs"}
    script = tmp_path / "job.sbatch"
    script.write_text(render_template("torchrun.sbatch.j2", values))
    p = subprocess.run(["bash", str(script)], cwd=tmp_path, env={**env, "SLURM_JOB_NUM_NODES": "1"},
                       capture_output=True, text=True, timeout=60)
    end = [a.decode() for a in (tmp_path / "end.args").read_bytes().split(b"\0")[:-1]]
    assert end[end.index("--event") + 1] == ("none" if finished_first else "timelimit"), p.stderr
    assert ("had finished before the time-limit warning" in p.stderr) == finished_first, p.stderr
