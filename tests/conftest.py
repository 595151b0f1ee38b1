"""Every test starts from the same random state, so a failure reproduces with the same numbers.

Every pipeline runner of the suite (its ranks inherit the environment) checks each message's
sequence number on receipt: a message that meets the wrong receive fails loudly.
"""

import os
import random
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import settings

import modelpar.training.start  # noqa: F401  (before any cluster starts: ranks are born with the training stack)
from modelpar.calibrate.cache import NO_CALIBRATE_ENV
from modelpar.pipeline.runner import CHECK_MESSAGES_ENV

os.environ.setdefault(CHECK_MESSAGES_ENV, "1")

# One compute thread per process (this one, and through the environment every process it starts that does
# not set its own): the suite's tensors are tiny, and two OpenMP threads on a shared core wait on each other
# at every op (docs/testing.md: a generation test took 79.5 s with two threads and 10.1 s with one, under load).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# No run of the suite writes to the user's cache or pays a calibration (modelpar.calibrate.cache): the cache is a
# directory of the session's own, and `modelpar train` measures nothing for its prediction (memory only; the tests
# of the cache itself lift this with monkeypatch). Set here, before any process starts, so every rank inherits them.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="modelpar-test-cache-")
os.environ[NO_CALIBRATE_ENV] = "1"

# No per-example deadline: on a crowded machine hypothesis's 200 ms fails a correct test (seen: 589 ms for
# an example of test_microbatch_sizes_match_tensor_split); pytest-timeout bounds each test instead.
settings.register_profile("modelpar", deadline=None)
settings.load_profile("modelpar")

# The modules that take longest (they start processes most often), first: pytest-xdist (pyproject's addopts) hands
# whole modules to its two workers in collection order, so with the long ones started first both end together.
_LONGEST_FIRST = ("test_train", "test_zero", "test_checkpoint_safety_cli", "test_stopping_torchrun", "test_autoplan",
                  "test_lint", "test_launcher", "test_stopping")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.stem, len(order)))  # stable: the others keep their order


# The CPU flags torch checks for each ATEN_CPU_CAPABILITY (compute_cpu_capability, ATen/native/DispatchStub.cpp).
_CAPABILITY_FLAGS = {"avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}


def pytest_configure(config: pytest.Config) -> None:
    """Refuse, in one line, a capability this CPU lacks: torch would take it and die of SIGILL mid-suite."""
    wanted = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if wanted not in _CAPABILITY_FLAGS or not os.path.exists("/proc/cpuinfo"):
        return
    with open("/proc/cpuinfo") as f:
        flags = set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    missing = sorted(_CAPABILITY_FLAGS[wanted] - flags)
    if missing:
        raise pytest.UsageError(f"ATEN_CPU_CAPABILITY={wanted} needs CPU flags this machine lacks ({', '.join(missing)}): "
                                "torch would run its kernels anyway and die of an illegal instruction; use default or a "
                                "capability the CPU has")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # as set above, whatever an earlier test chose
    torch.set_default_dtype(torch.float32)  # likewise the default dtype
