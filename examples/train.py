"""An example training script that follows gpuguard's training-script contract (docs/templates.md), so that the
torchrun template can stop it before the time limit, requeue it, and resume it without losing work.

The contract, and where this script does each part:

1. Stop when asked, all ranks at the same step (`StopRequest`, `should_stop`). Before the time limit (and when
   `gpuguard monitor` requeues a hung job) every worker gets SIGTERM and has the whole window,
   TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (the template sets it from `requeue_grace_s`): torchrun forwards it and
   waits that long, or, where torchrun cannot be told the window (PyTorch before --shutdown-timeout), the
   template's node wrapper signals the workers itself and torchrun only afterwards. The handler only sets a flag;
   every step the ranks all-reduce the flag (MAX), so they all leave the loop after the same step even if the
   signal reached them at different moments, write one checkpoint and exit 0 (exit 0 matters: with the older
   torchrun a worker that exits non-zero is a failure torchrun reacts to). SIGUSR2 is gpuguard's own stop request
   to its wrapper: the workers start with it ignored.
2. Checkpoint atomically, completion marker last (`save_checkpoint`). Write into a temporary directory, fsync,
   rename it into place, then write the marker (`COMPLETE`). gpuguard resumes only from a checkpoint that has the
   marker (`checkpoint_marker: COMPLETE`, `checkpoint_glob: "step-*"`): a checkpoint cut short by SIGKILL is never
   resumed from. The whole save must fit in the shutdown window.
3. Resume from the path gpuguard passes (`--resume PATH`, the template's `resume_arg`; also exported as
   GPUGUARD_RESUME_FROM): model, optimizer, step and RNG state, so attempt N+1 continues where attempt N stopped.
4. Exit codes say what happened: 0 when finished or stopped as asked; EXIT_BAD_CONFIG (2) for an error that
   running again cannot fix: list it in `no_retry_exit_codes` and the job is not requeued (gpuguard reads each
   worker's own code from torchrun's report, since torchrun itself always exits 1); anything else is retried
   within `max_failures`.
5. `@record` on main: torchrun writes the exception of a failed worker to its error file, and gpuguard puts it in
   the attempt's ledger line (worker_error).

Run it with the template (job.yaml):

    command: [examples/train.py, --ckpt-dir, /fsx/ckpt/run1, --steps, "100000"]
    checkpoint_dir: /fsx/ckpt/run1
    checkpoint_glob: "step-*"
    checkpoint_marker: COMPLETE
    no_retry_exit_codes: [2]

CPU (gloo) or GPUs (NCCL), any number of nodes. The model is a toy; the contract is the point. A model sharded
across ranks (FSDP) would use torch.distributed.checkpoint with its own `.metadata` marker instead of rank 0's
torch.save.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

EXIT_BAD_CONFIG = 2  # a configuration error: retrying cannot help (put it in no_retry_exit_codes)
MARKER = "COMPLETE"


class StopRequest:
    """Remembers that SIGTERM came; the training loop decides when to act on it."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True  # no I/O in a signal handler: the loop checkpoints at a step boundary


def should_stop(stop: StopRequest, device: torch.device) -> bool:
    """True on every rank as soon as any rank was asked to stop (all-reduce MAX of the flag)."""
    flag = torch.tensor([1.0 if stop.requested else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def save_checkpoint(ckpt_dir: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    extra_seconds: float = 0.0) -> Path:
    """Rank 0 writes <ckpt_dir>/step-NNNNNNN atomically: temporary directory, fsync, rename, marker last."""
    final = ckpt_dir / f"step-{step:07d}"
    tmp = ckpt_dir / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
             "rng": torch.get_rng_state()}
    with open(tmp / "state.pt", "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    if extra_seconds:
        time.sleep(extra_seconds)  # --slow-checkpoint: rehearse a large model's checkpoint in the shutdown window
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    with open(final / MARKER, "w") as fh:  # last: its presence means everything before it is on disk
        fh.write(f"{step}\n")
        fh.flush()
        os.fsync(fh.fileno())
    dir_fd = os.open(ckpt_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself
    finally:
        os.close(dir_fd)
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    if not (path / MARKER).exists():
        raise FileNotFoundError(f"{path} has no {MARKER} marker: not a complete checkpoint")
    state = torch.load(path / "state.pt", map_location="cpu")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt-dir", required=True, help="where checkpoints go (the template's checkpoint_dir)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--checkpoint-every", type=int, default=50, help="steps between regular checkpoints")
    ap.add_argument("--step-time", type=float, default=0.0, help="pretend each step takes this long (demo)")
    ap.add_argument("--slow-checkpoint", type=float, default=0.0,
                    help="make the checkpoint written on a stop take this many more seconds (rehearse the window)")
    ap.add_argument("--resume", default=os.environ.get("GPUGUARD_RESUME_FROM") or "",
                    help="checkpoint to resume from (gpuguard passes it; default $GPUGUARD_RESUME_FROM)")
    return ap.parse_args(argv)


@record
def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.lr <= 0 or args.steps <= 0:
        print(f"bad configuration: --lr must be > 0 and --steps > 0 (got {args.lr}, {args.steps})", file=sys.stderr)
        return EXIT_BAD_CONFIG
    stop = StopRequest()  # before anything slow, so an early SIGTERM is not lost
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(1234)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    start = 0
    if args.resume:
        start = load_checkpoint(Path(args.resume), net, opt)
        print(f"rank {rank}: resumed at step {start} from {args.resume}", flush=True)
    model = torch.nn.parallel.DistributedDataParallel(net)
    ckpt_dir = Path(args.ckpt_dir)
    print(f"rank {rank}/{dist.get_world_size()}: training steps {start + 1}..{args.steps}", flush=True)
    step = start
    while step < args.steps:
        step += 1
        x = torch.randn(64, 32, device=device)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients
        opt.step()
        if args.step_time:
            time.sleep(args.step_time)
        stopping = should_stop(stop, device)
        if stopping or step % args.checkpoint_every == 0 or step == args.steps:
            if rank == 0:
                path = save_checkpoint(ckpt_dir, step, net, opt, args.slow_checkpoint if stopping else 0.0)
                print(f"rank 0: checkpoint {path}", flush=True)
            dist.barrier()  # nobody exits before the checkpoint is complete
        if stopping:
            print(f"rank {rank}: stopping at step {step} as asked (SIGTERM); checkpoint written", flush=True)
            break
    dist.destroy_process_group()
    if rank == 0 and step >= args.steps:
        print(f"rank 0: finished {args.steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
