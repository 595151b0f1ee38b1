"""StageWorkers: per-stage threads, grad mode / autocast carried over, exceptions unchanged, clean close."""

from __future__ import annotations

import gc
import threading
import traceback

import pytest
import torch
from _wait import join

from modelpar.pipeline import StageWorkers


def test_results_come_back_in_submit_order_per_stage():
    with StageWorkers(["cpu", "cpu"]) as workers:
        for k in range(5):
            workers.submit(k % 2, lambda k=k: k * k)
        assert [workers.receive(0), workers.receive(1), workers.receive(0)] == [0, 1, 4]
        assert [workers.receive(1), workers.receive(0)] == [9, 16]


def test_each_stage_runs_on_its_own_thread():
    with StageWorkers(["cpu"] * 3) as workers:
        for j in range(3):
            workers.submit(j, threading.current_thread)
        ran_on = [workers.receive(j) for j in range(3)]
        assert ran_on == workers.threads
        assert threading.main_thread() not in ran_on
        assert [t.name for t in ran_on] == ["modelpar-stage-0", "modelpar-stage-1", "modelpar-stage-2"]


def test_plain_thread_ignores_callers_no_grad_but_workers_do_not():
    """Pitfall 1 of §3.3: grad mode is thread-local."""
    seen = {}
    with torch.no_grad():
        raw = threading.Thread(target=lambda: seen.setdefault("raw", torch.is_grad_enabled()))
        raw.start()
        join(raw)
    assert seen["raw"] is True  # the bug a naive worker has

    w = torch.ones(3, requires_grad=True)
    with StageWorkers(["cpu"]) as workers:
        with torch.no_grad():
            workers.submit(0, lambda: (torch.is_grad_enabled(), w * 2))
        grad_enabled, out = workers.receive(0)
        assert grad_enabled is False
        assert out.grad_fn is None and not out.requires_grad
        workers.submit(0, lambda: (torch.is_grad_enabled(), w * 2))  # and back on afterwards
        grad_enabled, out = workers.receive(0)
        assert grad_enabled is True and out.grad_fn is not None


def test_autocast_state_is_carried_to_the_worker():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with StageWorkers(["cpu"]) as workers:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            workers.submit(0, lambda: a @ b)
        assert workers.receive(0).dtype == torch.bfloat16
        workers.submit(0, lambda: a @ b)
        assert workers.receive(0).dtype == torch.float32


@pytest.mark.cuda
def test_cuda_worker_uses_its_device_and_the_callers_cuda_autocast():
    last = torch.cuda.device_count() - 1
    a = torch.randn(8, 8, device=f"cuda:{last}")
    with StageWorkers(["cpu", f"cuda:{last}"]) as workers:
        with torch.autocast("cuda", dtype=torch.float16):
            workers.submit(1, lambda: (torch.cuda.current_device(), a @ a))
        device, out = workers.receive(1)
        assert device == last and out.dtype == torch.float16
        workers.submit(1, lambda: a @ a)
        assert workers.receive(1).dtype == torch.float32


def test_num_threads_sets_intra_op_threads_in_each_worker():
    want = torch.get_num_threads() + 1  # not this thread's: the workers' count comes from num_threads
    with StageWorkers(["cpu", "cpu"], num_threads=want) as workers:
        for j in range(2):
            workers.submit(j, torch.get_num_threads)
        assert [workers.receive(0), workers.receive(1)] == [want, want]


def failing_stage():
    raise KeyError("stage 1 has no such key")


def test_exception_is_reraised_unchanged_with_worker_traceback():
    """Pitfall 2 of §3.3: same object (type, message), the stage's frame in the traceback."""
    workers = StageWorkers(["cpu", "cpu"])
    with pytest.raises(KeyError) as excinfo, workers:
        workers.submit(0, lambda: 1)
        workers.submit(1, failing_stage)
        assert workers.receive(0) == 1
        workers.receive(1)
    assert type(excinfo.value) is KeyError and excinfo.value.args == ("stage 1 has no such key",)
    frames = [f.name for f in traceback.extract_tb(excinfo.value.__traceback__)]
    assert "failing_stage" in frames and "_worker_loop" in frames
    assert not any(t.is_alive() for t in workers.threads)


def test_worker_survives_a_failing_function_and_base_exceptions():
    with StageWorkers(["cpu"]) as workers:
        workers.submit(0, failing_stage)
        workers.submit(0, lambda: (_ for _ in ()).throw(SystemExit(3)))
        workers.submit(0, lambda: "still alive")
        with pytest.raises(KeyError):
            workers.receive(0)
        with pytest.raises(SystemExit) as excinfo:
            workers.receive(0)
        assert excinfo.value.code == 3
        assert workers.receive(0) == "still alive"


def test_receive_without_submit_raises_instead_of_hanging():
    with StageWorkers(["cpu"]) as workers, pytest.raises(RuntimeError, match=r"receive\(0\) without a pending"):
        workers.receive(0)


def test_close_joins_every_thread_and_is_idempotent():
    workers = StageWorkers(["cpu"] * 3)
    threads = workers.threads
    assert all(t.is_alive() and t.daemon for t in threads)
    workers.submit(2, lambda: 5)
    workers.close()
    workers.close()
    assert not any(t.is_alive() for t in threads)
    assert "closed" in repr(workers)
    with pytest.raises(RuntimeError, match="closed"):
        workers.submit(0, lambda: 1)


def test_forgotten_workers_are_stopped_when_collected():
    workers = StageWorkers(["cpu", "cpu"])
    threads = workers.threads
    del workers
    gc.collect()
    assert not any(t.is_alive() for t in threads)


@pytest.mark.parametrize(
    ("devices", "match"),
    [
        ([], "devices must name at least one"),
        ("cpu", "devices must be a list"),
        (["cpu", "tpu:0"], r"devices\[1\] must be"),
        (["cpu", 3.5], r"devices\[1\] must be a torch device"),
        ([f"cuda:{torch.cuda.device_count()}"], r"devices\[0\] is 'cuda:\d+', but this machine has"),
    ],
)
def test_bad_devices(devices, match):
    with pytest.raises(ValueError, match=match):
        StageWorkers(devices)


def test_bad_submit_arguments():
    with StageWorkers(["cpu", "cpu"]) as workers:
        with pytest.raises(ValueError, match="stage must be <= 1, got 2"):
            workers.submit(2, lambda: 1)
        with pytest.raises(ValueError, match="stage must be >= 0, got -1"):
            workers.receive(-1)
        with pytest.raises(ValueError, match="fn must be callable"):
            workers.submit(0, 42)
    with pytest.raises(ValueError, match="num_threads must be >= 1, got 0"):
        StageWorkers(["cpu"], num_threads=0)
