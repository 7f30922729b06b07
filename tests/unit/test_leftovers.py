"""Epilog cleanup on real processes: the job user's leftovers die (SIGTERM, then SIGKILL), a process that
ignores SIGTERM is killed after the grace period, another user's process is never touched."""

import os
import signal
import subprocess
import sys
import time

from gpuguard.pipeline.leftovers import cleanup_leftovers
from gpuguard.model import GpuInfo, GpuProcess, NvmlObservation


def spawn(ignore_term: bool = False) -> subprocess.Popen:
    code = "import signal,sys,time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "") + \
           "print('ready', flush=True)\ntime.sleep(120)\n"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    # wait until the interpreter is up (and its handler installed): a process still starting under a loaded machine
    # can sit in uninterruptible I/O and take SIGTERM late, which is not what these tests are about
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def nvml(*pids_per_gpu):
    return NvmlObservation(gpus=[GpuInfo(index=i, processes=[GpuProcess(pid) for pid in pids])
                                 for i, pids in enumerate(pids_per_gpu)])


def test_kills_job_leftovers_and_leaves_other_gpus_alone():
    a, b, other = spawn(), spawn(ignore_term=True), spawn()
    try:
        t0 = time.monotonic()
        # a grace long enough for a loaded 2-core CI machine to schedule the dying process (it has to run to exit)
        out = cleanup_leftovers(nvml([a.pid], [b.pid], [other.pid]), job_gpus=(0, 1), job_id="7",
                                job_uid=os.getuid(), grace_s=3.0)
        took = time.monotonic() - t0
        assert sorted(p.pid for p in out.killed) == sorted([a.pid, b.pid]) and not out.survivors
        assert a.wait(5) == -signal.SIGTERM and b.wait(5) == -signal.SIGKILL
        assert other.poll() is None  # GPU 2 is not the job's
        assert 3.0 <= took < 6
    finally:
        for p in (a, b, other):
            p.kill()
            p.wait()


def test_other_users_process_is_foreign_and_untouched():
    p = spawn()
    try:
        out = cleanup_leftovers(nvml([p.pid]), job_gpus=None, job_id="7", job_uid=os.getuid() + 4242, grace_s=0.1)
        assert [x.pid for x in out.foreign] == [p.pid] and not out.killed
        assert p.poll() is None
        out = cleanup_leftovers(nvml([p.pid]), job_gpus=None, job_id="7", job_uid=os.getuid(), grace_s=0.1, kill=False)
        assert [x.pid for x in out.not_killed] == [p.pid] and p.poll() is None
    finally:
        p.kill()
        p.wait()


def test_never_kills_pid_1_or_itself_and_survives_vanished_pids():
    out = cleanup_leftovers(nvml([1, os.getpid(), 4_000_000]), job_gpus=None, job_id="7", job_uid=0, grace_s=0.1)
    assert {p.pid for p in out.foreign} == {1, os.getpid()} and not out.killed
