"""Pipe: the §3.1 call order, transparency vs sequential (§3.2), the three pitfalls of §3.3, bad input."""

from __future__ import annotations

import copy
import threading
import traceback

import pytest
import torch
from torch import nn

from modelpar.pipeline import Pipe, StageWorkers

pytestmark = pytest.mark.numerics  # float64 against the plain model at 1e-12

CPU = ["cpu"] * 3
CUDA_2 = pytest.param(["cuda:0", "cuda:1", "cuda:0"], marks=[pytest.mark.cuda, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices")], id="cuda2")
MIXED = pytest.param(["cpu", "cuda:0", "cpu"], marks=pytest.mark.cuda, id="cpu-cuda")


def make_stages(num_stages: int, width: int = 5, seed: int = 0) -> list[nn.Module]:
    """Small float64 stages: Linear + Tanh each, so gradients reach every parameter."""
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()).double() for _ in range(num_stages)]


def run_sequential(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x.to(next(stage.parameters()).device))
    return x


class RecordingWorkers:
    """Wraps StageWorkers and logs every call, like HW5's grader."""

    def __init__(self, workers: StageWorkers) -> None:
        self.inner, self.devices, self.calls = workers, workers.devices, []

    def submit(self, stage, fn):
        self.calls.append(f"submit({stage})")
        self.inner.submit(stage, fn)

    def receive(self, stage):
        self.calls.append(f"receive({stage})")
        return self.inner.receive(stage)


class Tagged(nn.Module):
    """Stage j: records (microbatch id in column 0, j), adds j to column 1."""

    def __init__(self, j: int, log: list) -> None:
        super().__init__()
        self.j, self.log, self.lock = j, log, threading.Lock()

    def forward(self, x):
        with self.lock:
            self.log.append((int(x[0, 0]), self.j))
        return x + torch.tensor([0.0, float(self.j)])


def test_call_order_for_three_microbatches_and_three_stages():
    log: list = []
    with Pipe([Tagged(j, log) for j in range(3)], split_size=1) as pipe:
        recorder = pipe.workers = RecordingWorkers(pipe.workers)
        out = pipe(torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]]))
        pipe.workers = recorder.inner
    waves = [["submit(0)", "receive(0)"],
             ["submit(0)", "submit(1)", "receive(0)", "receive(1)"],
             ["submit(0)", "submit(1)", "submit(2)", "receive(0)", "receive(1)", "receive(2)"],  # §3.1's wave 2
             ["submit(1)", "submit(2)", "receive(1)", "receive(2)"],
             ["submit(2)", "receive(2)"]]
    assert recorder.calls == [c for wave in waves for c in wave]
    # Waves are barriers: the stage calls between them are exactly clock_cycles(3, 3).
    sizes = [1, 2, 3, 2, 1]
    groups = [set(log[sum(sizes[:k]):sum(sizes[:k + 1])]) for k in range(5)]
    assert groups == [{(0, 0)}, {(1, 0), (0, 1)}, {(2, 0), (1, 1), (0, 2)}, {(2, 1), (1, 2)}, {(2, 2)}]
    torch.testing.assert_close(out, torch.tensor([[0.0, 3.0], [1.0, 3.0], [2.0, 3.0]]), rtol=0, atol=0)


@pytest.mark.parametrize("devices", [CPU, CUDA_2, MIXED])
@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("split_size", [1, 3, 4, 10, 16])
def test_transparency_outputs_and_every_gradient(devices, num_stages, split_size):
    stages = make_stages(num_stages)
    reference = copy.deepcopy(stages)
    for stage, device in zip(reference, devices):
        stage.to(device)
    x = torch.randn(10, 5, dtype=torch.float64)
    x_ref, x_pipe = x.clone().requires_grad_(), x.clone().requires_grad_()
    with Pipe(stages, devices=devices[:num_stages], split_size=split_size) as pipe:
        y = pipe(x_pipe)
        y_ref = run_sequential(reference, x_ref)
        (y * torch.arange(3.0, 8.0, dtype=torch.float64, device=y.device)).sum().backward()
        (y_ref * torch.arange(3.0, 8.0, dtype=torch.float64, device=y.device)).sum().backward()
    tol = {"rtol": 0, "atol": 0} if split_size >= 10 else {"rtol": 1e-12, "atol": 1e-14}  # M = 1: same ops
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(x_pipe.grad, x_ref.grad, **tol)
    for p, q in zip(pipe.parameters(), (q for s in reference for q in s.parameters())):
        assert p.grad is not None and p.grad.abs().sum() > 0
        torch.testing.assert_close(p.grad, q.grad, **tol)


@pytest.mark.parametrize("devices", [CPU, CUDA_2])
def test_three_optimizer_steps_stay_equal(devices):
    stages = make_stages(3, seed=1)
    reference = [copy.deepcopy(s).to(d) for s, d in zip(stages, devices)]
    pipe = Pipe(stages, devices=devices, split_size=3)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD([q for s in reference for q in s.parameters()], lr=0.1, momentum=0.9)
    torch.manual_seed(2)
    with pipe:
        for _ in range(3):
            x, target = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 5, dtype=torch.float64)
            for model, optimizer in ((pipe, opt), (lambda v: run_sequential(reference, v), opt_ref)):
                optimizer.zero_grad()
                loss = ((model(x) - target.to(devices[-1])) ** 2).mean()
                loss.backward()
                optimizer.step()
    for p, q in zip(pipe.parameters(), (q for s in reference for q in s.parameters())):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_sequential_with_balance_and_children_as_stages():
    torch.manual_seed(3)
    seq = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2)).double()
    x = torch.randn(7, 4, dtype=torch.float64)
    expected = seq(x)
    with Pipe(seq, split_size=2, balance=[2, 2, 1]) as pipe:
        assert [len(s) for s in pipe.stages] == [2, 2, 1]
        assert pipe.devices == [torch.device("cpu")] * 3 and len(pipe.workers.threads) == 3
        torch.testing.assert_close(pipe(x), expected, rtol=1e-12, atol=1e-14)
    with Pipe(seq, split_size=3) as pipe:
        assert len(pipe.stages) == 5
        torch.testing.assert_close(pipe(x), expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("devices", [CPU, CUDA_2])
def test_no_grad_builds_no_graph_in_any_worker(devices):
    """Pitfall 1 of §3.3."""
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(torch.is_grad_enabled())
            return x

    stages = [s for pair in zip(make_stages(3), [Probe(), Probe(), Probe()]) for s in pair][:5]
    with Pipe([nn.Sequential(*stages[i:i + 2]) for i in (0, 2, 4)], devices=devices, split_size=2) as pipe:
        x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
        with torch.no_grad():
            y = pipe(x)
        assert y.grad_fn is None and not y.requires_grad
        assert seen == [False] * 6  # two Probes, three micro-batches
        assert pipe(x).grad_fn is not None


class Exploding(nn.Module):
    def __init__(self, error: BaseException, at_row: float) -> None:
        super().__init__()
        self.error, self.at_row = error, at_row

    def forward(self, x):
        if (x[:, 0] == self.at_row).any():
            raise self.error
        return x


def test_stage_exception_is_reraised_unchanged_and_no_thread_is_left():
    """Pitfall 2 of §3.3."""
    error = ValueError("stage 1 cannot take micro-batch 2")
    pipe = Pipe([nn.Identity(), Exploding(error, at_row=2.0), nn.Identity()], split_size=1)
    x = torch.arange(4.0).repeat(2, 1).T.contiguous()
    with pytest.raises(ValueError) as excinfo, pipe:
        pipe(x)
    assert excinfo.value is error
    assert "forward" in [f.name for f in traceback.extract_tb(excinfo.value.__traceback__)]
    assert pipe.workers.threads and not any(t.is_alive() for t in pipe.workers.threads)


def test_pipe_is_usable_after_a_stage_raised():
    """The whole wave is received before re-raising, so no stale result is left in a queue."""
    with Pipe([nn.Identity(), Exploding(RuntimeError("once"), at_row=1.0)], split_size=1) as pipe:
        with pytest.raises(RuntimeError, match="once"):
            pipe(torch.tensor([[0.0], [1.0], [2.0]]))
        torch.testing.assert_close(pipe(torch.tensor([[5.0], [6.0]])), torch.tensor([[5.0], [6.0]]))


class _HeldWorkers(StageWorkers):
    """Starts nothing until the caller receives: every function of a wave runs after the whole wave
    was submitted, when loop variables read late would hold the wave's last (i, j)."""

    def __init__(self, devices) -> None:
        super().__init__(devices)
        self.held: list = []

    def submit(self, stage, fn):
        self.held.append((stage, fn))

    def receive(self, stage):
        for held in self.held:
            super().submit(*held)
        self.held = []
        return super().receive(stage)


class _Tagging(nn.Module):
    """Records which micro-batch (its first value) reached this stage, then adds 10 ** stage."""

    def __init__(self, index: int, seen: list) -> None:
        super().__init__()
        self.index, self.seen = index, seen

    def forward(self, x):
        self.seen.append((self.index, int(x[0, 0].item()) % 10))
        return x + 10 ** (self.index + 1)


def test_each_submitted_function_binds_its_stage_and_microbatch():
    """Pitfall 3 of §3.3: with the workers held until a wave is fully submitted, every stage still
    sees each micro-batch exactly once, in order, and the output is the sequential one."""
    seen: list = []
    stages = [_Tagging(j, seen) for j in range(3)]
    x = torch.arange(4.0).repeat(2, 1).T.contiguous()  # micro-batch i starts with the value i
    with Pipe(stages, split_size=1) as pipe, torch.no_grad():
        pipe.workers.close()
        pipe.workers = _HeldWorkers(["cpu"] * 3)
        out = pipe(x)
    assert [[i for j, i in seen if j == stage] for stage in range(3)] == [[0, 1, 2, 3]] * 3
    assert torch.equal(out, x + 10 + 100 + 1000)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split_size": 0}, "split_size must be >= 1, got 0"),
        ({"split_size": 2.5}, "split_size must be an integer, got 2.5"),
        ({"devices": ["cpu"]}, r"devices must have one entry per stage \(2\), got 1"),
        ({"devices": "cpu"}, "devices must be a list"),
        ({"balance": [1, 1]}, "balance needs stages to be an nn.Sequential"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Pipe([nn.Identity(), nn.Identity()], **kwargs)


@pytest.mark.parametrize(
    ("stages", "match"),
    [
        ([nn.Identity(), lambda x: x], r"stages\[1\] must be an nn.Module, got function"),
        ([], "stages must hold at least one module"),
        (nn.Linear(2, 2), "stages must be a list of modules or an nn.Sequential, got Linear"),
    ],
)
def test_bad_stages(stages, match):
    with pytest.raises(ValueError, match=match):
        Pipe(stages)


def test_bad_inputs_and_balance():
    with Pipe([nn.Identity()]) as pipe:
        with pytest.raises(ValueError, match=r"inputs must have at least one row.*\(0, 3\)"):
            pipe(torch.empty(0, 3))
        with pytest.raises(ValueError, match="inputs must have at least one row"):
            pipe(torch.tensor(1.0))
        with pytest.raises(ValueError, match="inputs must be a tensor, got list"):
            pipe([1.0, 2.0])
    with pytest.raises(ValueError, match=r"balance must add up to the number of layers \(2\)"):
        Pipe(nn.Sequential(nn.Identity(), nn.Identity()), balance=[1, 2])
