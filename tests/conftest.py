"""Every test starts from the same random state, so a failure reproduces with the same numbers.

Every pipeline runner of the suite (its ranks inherit the environment) checks each message's
sequence number on receipt: a message that meets the wrong receive fails loudly.
"""

import atexit
import json
import os
import random
import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from _order import longest_first, module_of
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
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)
os.environ[NO_CALIBRATE_ENV] = "1"

# No per-example deadline: on a crowded machine hypothesis's 200 ms fails a correct test (seen: 589 ms for
# an example of test_microbatch_sizes_match_tensor_split); pytest-timeout bounds each test instead.
settings.register_profile("modelpar", deadline=None)
settings.load_profile("modelpar")

# The order pytest-xdist (pyproject's addopts) hands whole modules to its workers in: longest first, from the
# seconds each module took in a whole run (tests/durations.json; `--record-durations` rewrites it), so both
# workers end together. A module not in the file goes first: it may be long, and short ones fill the end.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-durations", action="store_true",
                     help="at the end of the run, write each test module's seconds to tests/durations.json")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    items[:] = longest_first(items, seconds)
    if not torch.cuda.is_available():  # one rule for every GPU-only test: marked `cuda`, skipped here
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if item.get_closest_marker("cuda"):
                item.add_marker(skip)


class _DurationRecorder:
    """Adds up each module's setup, call and teardown seconds (on xdist's controller: every worker's reports)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = module_of(report.nodeid)
        self.seconds[module] = self.seconds.get(module, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        DURATIONS.write_text(json.dumps({m: round(s, 1) for m, s in ranked}, indent=1) + "\n")


# The CPU flags torch checks for each ATEN_CPU_CAPABILITY (compute_cpu_capability, ATen/native/DispatchStub.cpp).
_CAPABILITY_FLAGS = {"avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}


def pytest_configure(config: pytest.Config) -> None:
    """Record durations when asked (on the controller only); refuse, in one line, a capability this CPU lacks:
    torch would take it and die of SIGILL mid-suite."""
    if config.getoption("--record-durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_DurationRecorder(), "duration-recorder")
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


@pytest.fixture
def python_ctrl_c():
    """Ctrl-C with Python's own handler, as in a rank, for a test that sends SIGINT to this process: a pytest
    started as a background job ignores SIGINT, and modelpar keeps an ignored signal ignored (tests/_signals.py)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
