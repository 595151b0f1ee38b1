"""The GPU/NCCL code paths, on CPUs: what a GPU run would do differently is tested through the same code.

- No host synchronisation in a stage's hot path: a device sync is the ``aten._local_scalar_dense`` op
  (``.item()``, ``bool(t)``, ``.tolist()``) on every device, so recording the ops a forward,
  loss and backward dispatch shows whether one would stall a GPU's host. Token ids are checked
  where a batch is made, on the host, instead.
- Device selection: ``rank_device`` under NCCL, ``device_id`` passed to ``init_process_group``, and
  the runner's guard against a stage on another device than its group's.
- The private torch uses of ``modelpar._compat`` on real gloo groups.
"""

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode  # test-only: the ops a computation dispatches

from modelpar import _compat
from modelpar.distributed import LocalCluster, ParallelDims
from modelpar.distributed import devices as D
from modelpar.model import LMLoss, ModelConfig, build_stage
from modelpar.pipeline import PipelineRunner
from modelpar.schedules import get_schedule
from modelpar.tensor_parallel import VocabParallelEmbedding, set_shape_checks, vocab_parallel_cross_entropy
from modelpar.text import Corpus

SYNC = "aten._local_scalar_dense.default"  # what .item(), bool(t) and .tolist() dispatch: a device sync
CFG = ModelConfig(hidden=32, heads=4, layers=2, seq_len=8, vocab_size=64)


class _Ops(TorchDispatchMode):
    """Records the name of every aten op dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _ids(rows=2, cols=CFG.seq_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (rows, cols), generator=g), torch.randint(
        0, CFG.vocab_size, (rows, cols), generator=g)


def _forward_backward_ops(model, loss_fn, x, y) -> list[str]:
    with _Ops() as ops:
        loss = loss_fn(model(x), y)
        loss.backward()
    return ops.names


# --- no host sync in the hot path ----------------------------------------------------------------
def test_forward_loss_backward_never_sync_once_checks_are_off():
    model, loss_fn = build_stage(CFG, seed=1, dtype=torch.float64), LMLoss(CFG.vocab_size)
    x, y = _ids()
    assert SYNC in _forward_backward_ops(model, loss_fn, x, y)  # checks on (a first step): ids read on the host
    set_shape_checks(model, False)
    loss_fn.check_shapes = False
    assert SYNC not in _forward_backward_ops(model, loss_fn, x, y)


def _tp_ops_without_checks():
    group = dist.group.WORLD
    model, loss_fn = build_stage(CFG, seed=1, group=group, dtype=torch.float64), LMLoss(CFG.vocab_size, group)
    set_shape_checks(model, False)
    loss_fn.check_shapes = False
    x, y = _ids()
    return SYNC in _forward_backward_ops(model, loss_fn, x, y)


def test_tensor_parallel_stage_never_syncs_once_checks_are_off(c2):
    assert c2.run(_tp_ops_without_checks) == [False, False]


def _pipeline_step_ops():
    schedule = get_schedule("1f1b", ranks=2, microbatches=2)
    rank = dist.get_rank()
    stage = build_stage(CFG, rank, 2, seed=1, dtype=torch.float64)
    set_shape_checks(stage, False)
    loss_fn = LMLoss(CFG.vocab_size)
    loss_fn.check_shapes = False
    runner = PipelineRunner(schedule, {rank: stage}, loss_fn, dist.group.WORLD, timeout=30, check_messages=False)
    x, y = _ids(rows=4)
    runner.step(x, y)  # the first step learns the shapes (collectives that read sizes on the host)
    with _Ops() as ops:
        runner.step(x, y)
    return [n for n in ops.names if n == SYNC]


def test_a_pipeline_step_never_syncs_after_the_first(c2):
    assert c2.run(_pipeline_step_ops) == [[], []]


# --- token ids: checked where the batch is made ----------------------------------------------------
def test_corpus_batch_refuses_ids_outside_the_vocabulary_in_one_line():
    train = np.arange(100, dtype=np.int64) % 10
    train[50] = 12  # a token file that does not match its vocabulary
    corpus = Corpus(train=train, val=train, vocab_size=10)
    with pytest.raises(ValueError, match=r"^the train tokens of batch \d+ hold id 12, outside the vocabulary \[0, 10\)"):
        for step in range(50):  # some batch reaches position 50
            corpus.batch("train", step, batch_size=8, seq_len=20)
    good = Corpus(train=np.arange(100, dtype=np.int64) % 10, val=train, vocab_size=10)
    x, y = good.batch("train", 0, batch_size=2, seq_len=5)
    assert int(x.max()) < 10 and torch.equal(x[:, 1:], y[:, :-1])


def test_layers_still_name_bad_ids_while_checks_are_on():
    emb = VocabParallelEmbedding(10, 4)
    with pytest.raises(ValueError, match=r"^ids must be in \[0, 10\), got 10$"):
        emb(torch.tensor([[1, 10]]))
    with pytest.raises(ValueError, match=r"^target must be in \[0, 10\) or -100, got -1$"):
        vocab_parallel_cross_entropy(torch.zeros(2, 10), torch.tensor([3, -1]))
    emb.check_shapes = False
    with pytest.raises(ValueError, match=r"^ids must be an integer tensor, got dtype torch.float32$"):
        emb(torch.tensor([[1.0]]))  # the dtype needs no sync: checked always


# --- device selection ------------------------------------------------------------------------------
def test_stage_device_guard_names_both_devices():
    D.check_stage_device(torch.device("cpu"), torch.device("cpu"))
    D.check_stage_device(torch.device("cuda", 1), torch.device("cpu"))  # gloo stages GPU tensors through the host
    D.check_stage_device(torch.device("cuda", 1), torch.device("cuda", 1))
    with pytest.raises(ValueError, match=r"^stage 0's parameters are on cuda:0 but this rank's process group "
                                         r"communicates on cuda:1: move the stage to cuda:1"):
        D.check_stage_device(torch.device("cuda", 0), torch.device("cuda", 1), "stage 0's parameters")
    with pytest.raises(ValueError, match=r"are on meta but .* communicates on cpu"):
        D.check_stage_device(torch.device("meta"), torch.device("cpu"))


def _runner_on_meta():
    rank = dist.get_rank()
    with torch.device("meta"):
        stage = nn.Linear(3, 3)
    try:
        PipelineRunner(get_schedule("gpipe", ranks=2, microbatches=1), {rank: stage}, nn.functional.mse_loss,
                       dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return None


def test_runner_refuses_a_stage_off_its_groups_device(c2):
    assert c2.run(_runner_on_meta) == [
        f"stage {r}'s parameters are on meta but this rank's process group communicates on cpu: move the stage to "
        "cpu (torch.cuda.set_device(local_rank) at start-up, build the model on that device)" for r in (0, 1)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without GPUs")
def test_nccl_without_gpus_is_one_line_before_any_process():
    assert D.rank_device("gloo", 3) is None
    with pytest.raises(ValueError, match=r"^NCCL rank with local rank 0 needs 1 GPU \(one per rank\), this machine has 0$"):
        D.rank_device("nccl", 0)
    with pytest.raises(ValueError, match=r"^LocalCluster\(backend='nccl'\) with 2 ranks needs 2 GPUs"):
        LocalCluster(2, backend="nccl")


def test_torchrun_rank_sets_its_gpu_and_binds_the_group_to_it(monkeypatch):
    """Under NCCL ``init_from_env`` makes cuda:LOCAL_RANK current and passes it as device_id (faked CUDA)."""
    import importlib

    L = importlib.import_module("modelpar.distributed.launch")  # the module, not the function of that name
    calls = {}
    monkeypatch.setattr(D, "gpu_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("current", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.setdefault("init", (backend, kw)))
    for var, value in {"LOCAL_RANK": "2", "RANK": "6", "WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    L.init_from_env("nccl", timeout=5.0)
    assert calls["current"] == torch.device("cuda", 2)
    assert calls["init"] == ("nccl", {"timeout": datetime.timedelta(seconds=5), "device_id": torch.device("cuda", 2)})


# --- _compat on real groups --------------------------------------------------------------------------
def _mesh_timeouts():
    mesh = ParallelDims(pp=2).build_mesh("cpu", timeout=7.5)
    pp = mesh["pp"].get_group()
    out = torch.empty(2, dtype=torch.int64)
    _compat.all_gather_single(out, torch.tensor([dist.get_rank() + 10]), group=pp)
    return _compat.group_timeout(pp), str(_compat.backend_device(pp)), out.tolist()


def test_group_timeout_reads_the_mesh_groups_timeout(c2):
    assert c2.run(_mesh_timeouts) == [(7.5, "cpu", [10, 11])] * 2


def test_backend_options_carry_the_timeout():
    options = _compat.backend_options("gloo", 12.0)
    assert options.backend == "gloo" and options._timeout == datetime.timedelta(seconds=12)


# --- the NCCL watchdog versus receives posted at a step's start ------------------------------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_critical_path_is_2_m_plus_p_minus_1_actions(name):
    from modelpar.pipeline.bounded_comm import critical_path

    for p in (1, 2, 3, 4):
        for m in (1, 2, 5, 8):
            assert critical_path(get_schedule(name, ranks=p, microbatches=m)) == 2 * (m + p - 1)


def test_step_timeout_hand_checked():
    from modelpar.pipeline.bounded_comm import critical_path, step_timeout

    # GPipe, p = 2, M = 1: F on stage 0, F on stage 1, B on stage 1, B on stage 0, one after the other
    assert critical_path(get_schedule("gpipe", ranks=2, microbatches=1)) == 4
    assert step_timeout(get_schedule("gpipe", ranks=2, microbatches=1), 10.0) == 50.0
    assert step_timeout(get_schedule("1f1b", ranks=4, microbatches=8), 300.0) == 300.0 * 23


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]), p=st.integers(1, 4), m=st.integers(1, 8),
       forward=st.floats(0.01, 1.0), backward=st.floats(0.01, 1.0), share=st.floats(0.0, 1.0))
def test_a_step_whose_actions_and_messages_fit_in_the_timeout_fits_in_the_step_timeout(name, p, m, forward, backward,
                                                                                          share):
    """The rule's premise → its conclusion, on the simulator: every action plus the message it sends takes
    at most T (= 1 here), so the whole step lasts at most critical_path × T."""
    from modelpar.pipeline.bounded_comm import critical_path
    from modelpar.simulate import simulate
    from modelpar.simulate.costs import Costs

    chunks = 2 if name == "interleaved" else 1
    if name == "interleaved" and m % p:
        m = p
    schedule = get_schedule(name, ranks=p, microbatches=m, **({"chunks": chunks} if chunks > 1 else {}))
    longest = max(forward, backward) / chunks  # the longest action (F, or B = I + W)
    costs = Costs(forward=forward, backward=backward, transfer=max(0.0, share * (1.0 - longest)))
    assert simulate(schedule, costs).step_time <= critical_path(schedule) + 1e-9


def test_mesh_gives_the_step_timeout_to_nccl_pipeline_groups_only():
    from modelpar.distributed.mesh import dim_settings

    assert dim_settings("nccl", None, 30.0, 690.0) == {"pp": ("nccl", 690.0), "dp": ("nccl", 30.0),
                                                       "cp": ("nccl", 30.0), "tp": ("nccl", 30.0)}
    assert dim_settings("nccl", "gloo", 30.0, 690.0)["pp"] == ("gloo", 30.0)  # gloo: every wait is the runtime's own
    assert dim_settings("gloo", None, 30.0, 690.0)["pp"] == ("gloo", 30.0)
    assert dim_settings("gloo", None, None, None)["tp"] == ("gloo", None)


class _Event:
    """A fake CUDA event that completes at a given time of a fake clock."""

    def __init__(self, clock, at):
        self.clock, self.at = clock, at

    def query(self):
        return self.clock.now >= self.at


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += max(seconds, 0.01)


def test_gpu_step_wait_bounds_each_action_not_the_whole_step():
    from modelpar.pipeline.timing import wait_for_events

    clock = _Clock()
    events = [_Event(clock, 0.9 * k) for k in range(1, 11)]  # a 9 s step, one action every 0.9 s
    wait_for_events(events, 1.0, lambda: TimeoutError("stuck"), clock, clock.sleep)
    assert clock.now >= 9.0
    clock = _Clock()
    stuck = [_Event(clock, 0.5), _Event(clock, float("inf"))]
    with pytest.raises(TimeoutError, match="stuck"):
        wait_for_events(stuck, 1.0, lambda: TimeoutError("stuck"), clock, clock.sleep)
    assert 1.5 <= clock.now <= 1.6  # the last completion (0.5 s) + the timeout, in the fake clock's steps
