"""Property tests: hostile values in a rendered torchrun script never execute. The rendered script is run by
bash with stub srun/scontrol/gpuguard that record exactly what they were given."""

from __future__ import annotations

import subprocess
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
  "show node") echo "NodeName=node1 NodeAddr=127.0.0.1 State=IDLE" ;;
esac
""",
    "srun": """#!/bin/bash
case " $* " in *" monitor "*) exit 0 ;; esac
printf '%s\\0' "$@" > "$STUB_OUT/srun.args"
printf '%s' "$MY_VAR" > "$STUB_OUT/env.MY_VAR"
printf '%s' "$TRITON_CACHE_DIR" > "$STUB_OUT/env.TRITON_CACHE_DIR"
printf '%s' "$GPUGUARD_RESUME_FROM" > "$STUB_OUT/env.RESUME"
""",
    "gg": """#!/bin/bash
if [ "$2" = begin ]; then printf '%s' "$STUB_RESUME"; exit 0; fi
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


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(hostile, min_size=1, max_size=4), env_value=hostile, resume=hostile, ckpt=hostile,
       local=hostile, pattern=st.sampled_from(["x", "a b", "$(touch MARK)", "'\"`"]))
def test_hostile_values_never_execute(tmp_path_factory, args, env_value, resume, ckpt, local, pattern):
    tmp = tmp_path_factory.mktemp("run")
    stubs, env = _setup(tmp)
    values = {"nodes": 2, "command": ["train.py", *args], "env": {"MY_VAR": env_value}, "checkpoint_dir": ckpt or "c",
              "local_dir": local or "l", "gpuguard": str(stubs / "gg"), "torchrun": str(stubs / "torchrun x"),
              "no_retry_patterns": [pattern], "job_root": "jobs", "preset": "p5.48xlarge"}
    script = tmp / "job.sbatch"
    script.write_text(render_template("torchrun.sbatch.j2", values))
    p = subprocess.run(["bash", str(script)], cwd=tmp, env={**env, "STUB_RESUME": resume}, capture_output=True,
                       text=True, timeout=30)
    assert not (tmp / "MARK").exists(), "a hostile value was executed"
    assert p.returncode == 0, p.stderr
    argv = (tmp / "srun.args").read_bytes().split(b"\0")[:-1]
    argv = [a.decode() for a in argv]
    # the resume path comes back through $(...), which drops trailing newlines (gpuguard never prints a path with
    # control characters: find_checkpoint skips them)
    resume = resume.rstrip("\n")
    expected_tail = ["train.py", *args] + (["--resume", resume] if resume else [])
    assert argv[:4] == ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", str(stubs / "torchrun x")]
    assert argv[-len(expected_tail):] == expected_tail  # every argument arrived exactly as given
    assert (tmp / "env.MY_VAR").read_text() == env_value
    assert (tmp / "env.TRITON_CACHE_DIR").read_text() == f"{local or 'l'}/gpuguard-42/triton-cache"
    end = [a.decode() for a in (tmp / "end.args").read_bytes().split(b"\0")[:-1]]
    assert end[end.index("--no-retry-pattern") + 1] == pattern


@given(st.text(max_size=40).filter(lambda s: "\x00" not in s))
@settings(max_examples=200, deadline=None)
def test_shell_word_round_trips_through_bash(value):
    out = subprocess.run(["bash", "-c", f"printf %s {shell_word(value)}"], capture_output=True, timeout=10)
    assert out.stdout.decode("utf-8", errors="surrogateescape") == value
