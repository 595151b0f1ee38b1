"""The process helper and the (pp, dp, tp) grid, on real gloo processes."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from _signals import CTRL_C_DEFAULT
from _wait import pid_alive, wait_gone

from modelpar.distributed import LocalCluster, ParallelDims, RankError, coordinates, launch, rank_groups


def _rank_and_sum():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on(rank):
    if dist.get_rank() == rank:
        raise KeyError(f"boom on {rank}")
    dist.barrier()  # the others wait in a collective the failed rank never joins
    return "unreachable"


def _die_on(rank):
    if dist.get_rank() == rank:
        os._exit(7)
    time.sleep(60)


def _hang_on(rank):
    if dist.get_rank() == rank:
        time.sleep(60)
    return dist.get_rank()


def _mesh_groups(pp, dp, tp, pipeline_backend=None):
    mesh = ParallelDims(pp=pp, dp=dp, tp=tp).build_mesh("cpu", pipeline_backend=pipeline_backend)
    return {name: dist.get_process_group_ranks(mesh[name].get_group()) for name in ("pp", "dp", "tp")}


def _send_messages(n):
    from modelpar.distributed import to_launcher

    send = to_launcher()
    for i in range(n):
        send({"rank": dist.get_rank(), "i": i})
    return dist.get_rank()


def test_messages_reach_the_launcher_in_order_before_the_result(c4):
    got = []
    c4.on_message = got.append
    try:
        assert c4.run(_send_messages, 3) == [0, 1, 2, 3]
    finally:
        c4.on_message = None
    for rank in range(4):  # every message arrived by the time run returned, each rank's in its order
        assert [m["i"] for m in got if m["rank"] == rank] == [0, 1, 2]
    from modelpar.distributed import to_launcher

    assert to_launcher() is None  # not a rank of a LocalCluster


def test_results_in_rank_order_and_collectives_work(c4):
    assert c4.run(_rank_and_sum) == [(r, 10.0) for r in range(4)]


def test_child_exception_reraised_with_rank_and_type(c4):
    with pytest.raises(KeyError, match=r"\[rank 2\] .*boom on 2") as info:
        c4.run(_fail_on, 2)
    assert info.value.rank == 2
    assert "_fail_on" in str(info.value.__cause__)  # the child's traceback is chained
    assert c4.run(_rank_and_sum)[3] == (3, 10.0)  # restarted for the next run


def test_dead_rank_ends_the_group(c4):
    with pytest.raises(RankError, match=r"rank 1 died \(exit code 7\)"):
        c4.run(_die_on, 1)


def test_hung_rank_ends_the_group_within_timeout():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[0\] did not finish within run_timeout=3 s"):
        launch(_hang_on, 2, 0, timeout=3, run_timeout=3)
    assert time.monotonic() - start < 20


def test_device_mesh_matches_the_pure_function(c4):
    groups = rank_groups(pp=2, dp=1, tp=2)
    for backend in (None, "gloo"):  # "gloo": the pipeline groups an NCCL run uses
        for rank, got in enumerate(c4.run(_mesh_groups, 2, 1, 2, backend)):
            for dim in ("pp", "dp", "tp"):
                assert got[dim] in groups[dim] and rank in got[dim]


def test_rank_groups_hand_checked():
    g = rank_groups(pp=2, dp=2, tp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert coordinates(5, 2, 2, 2) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}


def test_rank_groups_with_context_parallelism_hand_checked():
    """(pp, dp, cp, tp) = (1, 2, 2, 2): cp between dp and tp; gradients reduce over dp × cp."""
    g = rank_groups(pp=1, dp=2, tp=2, cp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert coordinates(6, 1, 2, 2, 2) == {"pp": 0, "dp": 1, "cp": 1, "tp": 0}


@pytest.mark.parametrize("pp,dp,tp", [(1, 1, 1), (3, 1, 2), (2, 4, 1), (4, 3, 2)])
def test_rank_groups_partition_the_world(pp, dp, tp):
    world = pp * dp * tp
    for dim, size in (("pp", pp), ("dp", dp), ("tp", tp)):
        groups = rank_groups(pp=pp, dp=dp, tp=tp)[dim]
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
    assert [coordinates(r, pp, dp, tp)["tp"] for r in range(tp)] == list(range(tp))


def test_bad_dims_name_the_argument():
    with pytest.raises(ValueError, match="tp must be >= 1, got 0"):
        ParallelDims(tp=0)
    with pytest.raises(ValueError, match=r"tp \* pp \* dp = 2 \* 2 \* 1 = 4 must equal .*world size 3"):
        ParallelDims(pp=2, tp=2).check_world(3)


def test_unpicklable_function_is_refused_before_anything_runs(c4):
    with pytest.raises(ValueError, match=r"fn and its arguments must be picklable .*<lambda>"):
        c4.run(lambda: 1)
    assert c4.run(_rank_and_sum)[0] == (0, 10.0)


def test_run_timeout_none_waits_but_a_dead_rank_is_still_seen():
    with pytest.raises(RankError, match=r"rank 1 died \(exit code 7\)"):
        launch(_die_on, 2, 1, timeout=5, run_timeout=None)


def test_background_start_then_run():
    with LocalCluster(2).start() as c:
        assert [r for r, _ in c.run(_rank_and_sum)] == [0, 1]


_BUSY_SCRIPT = """
import os, sys, time
from modelpar.distributed import LocalCluster
def work(folder):
    announced = False
    while True:  # a rank at work, writing until it is ended
        with open(os.path.join(folder, str(os.getpid())), "a") as f:
            f.write("x")
        if not announced:  # one write: the two ranks' lines never interleave
            announced = os.write(1, f"{os.getpid()}\\n".encode())
        time.sleep(0.01)
if __name__ == "__main__":
    with LocalCluster(2) as cluster:
        cluster.run(work, sys.argv[1])
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill -9", "Ctrl-C"])
def test_busy_ranks_end_with_their_launcher_and_write_nothing_after(tmp_path, sig):
    script = tmp_path / "parent.py"
    script.write_text(_BUSY_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              **CTRL_C_DEFAULT)
    try:
        ranks = [int(parent.stdout.readline()) for _ in range(2)]  # both ranks are writing
    finally:  # here, or on a parent that died without a word (readline: '')
        parent.send_signal(sig)  # kill -9: no chance to stop its ranks; Ctrl-C: it ends them itself
        parent.wait(timeout=60)
    wait_gone(ranks, "the ranks of a launcher that is gone")  # so nothing can write after this
    assert all((tmp_path / str(p)).stat().st_size > 0 for p in ranks)


def test_kill_and_signal_reach_every_rank(c4):
    import threading

    pids = c4.pids
    threading.Timer(0.5, c4.signal, (signal.SIGUSR1,)).start()  # the ranks start with the default: death
    with pytest.raises(RankError, match=r"rank \d \(pid \d+\) was killed by signal 10 \(SIGUSR1\)$"):
        c4.run(_hang_on, 0)
    assert not any(map(pid_alive, pids)) and c4.pids == []
    assert c4.run(_rank_and_sum)[1] == (1, 10.0)  # started again
