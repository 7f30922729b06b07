"""The slurm.conf lines gpuguard needs, each with the reason it is there."""

from __future__ import annotations

import os

LINES = [
    ("Prolog={libexec}/gpuguard-prolog",
     "gpuguard's pre-flight runs on every node of a job before it starts; a failing node is drained with a "
     "precise reason and the prolog exits non-zero so Slurm requeues the job."),
    ("PrologFlags=Alloc",
     "run the prolog at allocation on every allocated node (not lazily at the first step), so a bad node is "
     "caught before the batch script starts anywhere."),
    ("SchedulerParameters=nohold_on_prolog_fail",
     "a job whose prolog failed is requeued without a hold, so it restarts on healthy nodes without a human "
     "(append to your existing SchedulerParameters with a comma)."),
    ("Epilog={libexec}/gpuguard-epilog",
     "after each job: leftover GPU processes and memory, Xids the job triggered."),
    ("PrologEpilogTimeout=60",
     "a backstop above gpuguard's own deadline (deadlines.prolog_s, 30 s by default), so a hung prolog can "
     "never hold a node forever (Slurm 25.05+ also has PrologTimeout/EpilogTimeout)."),
    ("HealthCheckProgram={libexec}/gpuguard-healthcheck",
     "periodic scan of all GPUs (Xid, ECC, row remapping, thermals, NVLink, fabric). Its exit code does "
     "nothing: gpuguard drains (and undrains only nodes it drained) itself."),
    ("HealthCheckInterval=300",
     "every 5 minutes; slurmd kills the program after 60 s, gpuguard stays within deadlines.healthcheck_s."),
    ("HealthCheckNodeState=ANY,CYCLE",
     "check every node whatever its state (so a node gpuguard drained can be undrained once healthy) and "
     "spread the runs over the interval instead of the whole cluster at once."),
    ("JobRequeue=1",
     "batch jobs are requeueable by default, so a job that lost a node restarts elsewhere."),
]


def recommended_lines(prefix: str = "/usr/local") -> str:
    libexec = os.path.join(prefix, "libexec", "gpuguard")
    out = [f"# --- gpuguard (installed under {prefix}) ---"]
    for line, why in LINES:
        out.append(f"# {why}")
        out.append(line.format(libexec=libexec))
    return "\n".join(out)
