"""Stopping on GPUs under torchrun with NCCL: group timeouts, preemption and resume (a check, not a benchmark).

What the CPU test suite cannot run: the mesh's NCCL groups carry the run's timeout (their options
are ``ProcessGroupNCCL.Options``), the per-step agreement all-gathers CUDA tensors, and a SIGTERM
to one rank stops every rank at one step with a checkpoint that resumes bitwise. Prints one line
per check and exits non-zero on a failure.

    torchrun --nproc-per-node 2 benchmarks/check_stopping_gpu.py [--tp 2] [--pp 1] [--dir /tmp/ckpt]
    torchrun --nproc-per-node 2 benchmarks/check_stopping_gpu.py --backend gloo     # a dry run on CPUs
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import threading
import time
from dataclasses import replace

import torch.distributed as dist

from modelpar._compat import group_timeout
from modelpar.checkpoint import latest_checkpoint
from modelpar.distributed import init_from_env
from modelpar.distributed.devices import require_gpus
from modelpar.model import ModelConfig
from modelpar.schedules import get_schedule
from modelpar.training import TrainConfig, train
from modelpar.training.setup import setup_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dir", default="/tmp/modelpar-check-stopping")
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"], help="gloo: a dry run on CPUs")
    args = parser.parse_args()
    if args.backend == "nccl":  # one line, before any process group, on a machine with too few GPUs
        need = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        try:
            require_gpus(need, f"check_stopping_gpu.py with {need} ranks on this machine")
        except ValueError as err:
            raise SystemExit(f"{err}; run it with --backend gloo for a dry run on CPUs") from None
    init_from_env(args.backend, timeout=23.0)
    rank = dist.get_rank()
    cfg = TrainConfig(model=ModelConfig(hidden=64, heads=4, layers=4, seq_len=32), tp=args.tp, pp=args.pp, dp=1,
                      steps=200, batch_size=8, microbatches=2, precision="fp64", eval_every=0, eval_batches=1,
                      checkpoint_dir=args.dir, checkpoint_every=2, timeout=23.0)
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.barrier()

    rs = setup_rank(cfg, get_schedule(cfg.schedule, ranks=cfg.pp, microbatches=cfg.microbatches), cfg.timeout)
    timeouts = {name: group_timeout(group)  # each group's own backend: NCCL on the GPU, gloo on the CPU
                for name, group in (("tp", rs.tp_group), ("dp", rs.dp_group), ("pp", rs.pp_group)) if group is not None}
    want = dict.fromkeys(timeouts, 23.0)
    if "pp" in want:
        want["pp"] = rs.pipeline_timeout
    report(rank, f"mesh group timeouts are the run's 23 s (the pipeline group's: {rs.pipeline_timeout:g} s, "
                 "a whole step)", timeouts, timeouts == want)

    if rank == dist.get_world_size() - 1:  # one rank only: the others learn it at the next step
        threading.Thread(target=signal_when_saved, args=(args.dir,), daemon=True).start()
    stopped = train(cfg)
    stop = stopped.stop
    ok = stop is not None and stop.reason == "preempt" and latest_checkpoint(args.dir).name == f"step_{stop.step:08d}"
    report(rank, "SIGTERM to one rank: all stop at one step with a checkpoint", stop and stop.message, ok)
    assert stop is not None

    resumed = train(replace(cfg, resume=True, exit_after=2))
    plain = train(replace(cfg, checkpoint_dir=None, checkpoint_every=0, exit_after=stop.step + 2))
    report(rank, "resume is bitwise the uninterrupted run", (len(resumed.losses), len(plain.losses)),
           resumed.losses == plain.losses)
    dist.destroy_process_group()


def signal_when_saved(folder: str) -> None:
    while latest_checkpoint(folder) is None:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)


def report(rank: int, check: str, value: object, ok: bool) -> None:
    if rank == 0:
        print(f"{'ok  ' if ok else 'FAIL'} {check}: {value}", flush=True)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
