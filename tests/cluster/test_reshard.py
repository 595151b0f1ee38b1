"""Checkpoints move between layouts: save at one (t, p, d, v), resume at another, export to one process.

Real gloo processes, float64: one c4 of 4 ranks for the module; a run of fewer ranks takes
the first ranks as a world of its own (``in_world``). The oracle is a plain single-process loop on
the whole model (torch's cross entropy and ``clip_grad_norm_``).
"""

import dataclasses
import datetime
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from oracle import plain_loop

from modelpar.checkpoint import Shard, ShardedState, latest_checkpoint, load_checkpoint, save_checkpoint
from modelpar.corpus import load_corpus
from modelpar.export import export_checkpoint, load_model
from modelpar.model import ModelConfig, build_stage
from modelpar.training import TrainConfig, train

pytestmark = pytest.mark.timeout(600)  # several whole runs per case: over 200 s seen on a crowded 2-core machine

STEPS = 4  # saved after STEPS, resumed for STEPS more
TINY = ModelConfig(hidden=32, heads=4, layers=4, seq_len=16)
DEEP = dataclasses.replace(TINY, layers=8)  # p·v = 8 stages
TIED = dataclasses.replace(TINY, tie_embeddings=True)
LLAMA = ModelConfig(arch="llama", hidden=32, heads=4, kv_heads=1, layers=4, seq_len=16)  # kv replicated at t = 2
BASE = TrainConfig(model=TINY, steps=2 * STEPS, batch_size=8, microbatches=2, precision="fp64", warmup=2, lr=1e-2,
                   clip=0.5, eval_every=0, eval_batches=1, tp=1, pp=1, dp=1)
TOL = 1e-9


def _stores(timeout):
    """Two TCPStores for the sub-world and the rejoin, hosted by rank 0 on ports it holds from now on (a port picked
    free in the parent and bound only after a whole training run was once taken meanwhile: EADDRINUSE)."""
    rank = dist.get_rank()
    masters = [dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False) for _ in range(2)] \
        if rank == 0 else []
    ports = [[s.port for s in masters]]
    dist.broadcast_object_list(ports, src=0)
    return masters or [dist.TCPStore("127.0.0.1", port, None, False, timeout) for port in ports[0]]


def in_world(n, fn, *args):
    """Run ``fn`` on the first ``n`` ranks as a world of their own (the others wait), then rejoin them all."""
    rank, size = dist.get_rank(), dist.get_world_size()
    timeout = datetime.timedelta(seconds=120)
    inner, rejoin = _stores(timeout)
    dist.destroy_process_group()
    try:
        if rank >= n:
            return None
        dist.init_process_group("gloo", store=inner, rank=rank, world_size=n, timeout=timeout)
        try:
            return fn(*args)
        finally:
            dist.destroy_process_group()
    finally:
        dist.init_process_group("gloo", store=rejoin, rank=rank, world_size=size, timeout=timeout)


def _train(cfg):
    torch.set_num_threads(1)  # up to 4 ranks share 2 cores
    r = train(cfg)
    return {"losses": r.losses, "val": r.val[-1][1], "start": r.start_step}


def run_at(c4, cfg):
    """``train(cfg)`` on t·p·d ranks of the c4; rank 0's result."""
    return c4.run(in_world, cfg.dims.world_size, _train, cfg)[0]


def val_loss(model, cfg):
    x, y = load_corpus().batch("val", 0, cfg.batch_size, cfg.model.seq_len, cfg.seed)
    with torch.no_grad():
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()


_ORACLES: dict = {}


def oracle(cfg):
    """Losses, final parameters and validation loss of 2·STEPS steps of a plain single-process loop."""
    if cfg.model not in _ORACLES:
        run = plain_loop(cfg)
        _ORACLES[cfg.model] = (run.losses, run.params, run.val)
    return _ORACLES[cfg.model]


def assert_layout_free(path, model_cfg):
    """The checkpoint holds each single-process tensor (and its AdamW state) once, whole, under its name."""
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    params = dict(build_stage(model_cfg, dtype=torch.float64).named_parameters())  # a tied head counts once
    want = {f"model.{n}": p.shape for n, p in params.items()}
    want |= {f"optim.{n}.{f}": p.shape for n, p in params.items() for f in ("exp_avg", "exp_avg_sq")}
    want |= {f"optim.{n}.step": () for n in params}
    assert set(stored) == set(want) | {"rng"}
    for name, shape in want.items():
        assert tuple(stored[name].size) == tuple(shape), name
        covered = sum(math.prod(c.sizes) for c in stored[name].chunks)  # DCP refuses overlaps: no twice-written box
        assert covered == math.prod(shape), name


def split(tp=1, pp=1, dp=1, schedule="1f1b", chunks=1, **changes):
    return dict(tp=tp, pp=pp, dp=dp, schedule=schedule, chunks=chunks, **changes)


PAIRS = [  # (saved, resumed): t, p, d and v each go up and down, the schedule, micro-batches and rank count change
    pytest.param(split(tp=2, pp=2), split(), id="(2,2,1)->(1,1,1)"),
    pytest.param(split(), split(pp=2, dp=2), id="(1,1,1)->(1,2,2)"),
    pytest.param(split(pp=4, schedule="interleaved", chunks=2, microbatches=4, model=DEEP), split(pp=2, model=DEEP),
                 id="(1,4,1)v2->(1,2,1)1f1b"),
    pytest.param(split(dp=2), split(tp=2, schedule="gpipe", microbatches=4), id="(1,1,2)->(2,1,1)gpipe"),
    pytest.param(split(tp=2, pp=2, schedule="zb-h1", model=TIED), split(dp=2, schedule="interleaved", chunks=2, model=TIED),
                 id="tied(2,2,1)zb-h1->(1,1,2)v2"),  # the head's copy saved once, loaded into both copies on one rank
    pytest.param(split(tp=2, pp=2, sequence_parallel=True, model=LLAMA), split(tp=1, pp=2, model=LLAMA),
                 id="llama(2,2,1)sp->(1,2,1)"),  # the key/value head both tp ranks hold, saved once
]


@pytest.mark.parametrize("saved, resumed", PAIRS)
def test_resume_at_another_split_continues_the_run(c4, tmp_path, saved, resumed):
    cfg = dataclasses.replace(BASE, checkpoint_dir=str(tmp_path / "ckpt"))
    first = run_at(c4, dataclasses.replace(cfg, exit_after=STEPS, **saved))
    cfg = dataclasses.replace(cfg, model=saved.get("model", cfg.model))
    assert_layout_free(latest_checkpoint(cfg.checkpoint_dir), cfg.model)
    second = run_at(c4, dataclasses.replace(cfg, resume=True, **resumed))
    want_losses, want_params, want_val = oracle(cfg)
    assert second["start"] == STEPS and len(second["losses"]) == 2 * STEPS
    assert first["losses"] == pytest.approx(want_losses[:STEPS], abs=TOL, rel=0)
    assert second["losses"] == pytest.approx(want_losses, abs=TOL, rel=0)  # AdamW's state came along too

    # export the final checkpoint: one process, no torch.distributed, the distributed evaluation's loss
    exported = export_checkpoint(cfg.checkpoint_dir, tmp_path / "model.safetensors")[0]
    umask = os.umask(0)
    os.umask(umask)
    assert exported.stat().st_mode & 0o777 == 0o666 & ~umask  # not safetensors' private 0600: it is meant to be shared
    model = load_model(exported)
    assert val_loss(model, cfg) == pytest.approx(second["val"], abs=TOL, rel=0)
    assert val_loss(model, cfg) == pytest.approx(want_val, abs=TOL, rel=0)
    for name, p in model.named_parameters():
        assert torch.allclose(p, want_params[name], rtol=0, atol=TOL), name


def _held_by_one_rank(root):
    """Rank r saves optimizer state p<r> alone and half of w; then asks for the other rank's state and all of w."""
    rank = dist.get_rank()
    state = ShardedState()
    state.add(f"optim.p{rank}.exp_avg", Shard.whole(torch.full((3,), rank + 1.0)))
    state.add("model.w", Shard.split(torch.full((2,), float(rank)), 0, rank, 2))
    path = save_checkpoint(root, 1, state, {"losses": []}, group=dist.group.WORLD)
    other, whole = torch.zeros(3), torch.zeros(4)
    wanted = ShardedState()
    wanted.add(f"optim.p{1 - rank}.exp_avg", Shard.whole(other))
    wanted.add("model.w", Shard.whole(whole))
    load_checkpoint(path, wanted, group=dist.group.WORLD)
    return other.tolist(), whole.tolist()


def test_a_tensor_saved_by_one_rank_loads_on_whichever_rank_asks(c4, tmp_path):
    # what ZeRO-1 needs: optimizer state held by one data-parallel rank, owned by another after resuming
    results = c4.run(in_world, 2, _held_by_one_rank, str(tmp_path))
    assert results[:2] == [([2.0] * 3, [0.0, 0.0, 1.0, 1.0]), ([1.0] * 3, [0.0, 0.0, 1.0, 1.0])]
