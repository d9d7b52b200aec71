import os
import subprocess
import tempfile
from pathlib import Path

# torch.compile's on-disk caches of whole graphs (inductor's FX graph cache, AOTAutograd's cache) are keyed by the
# graph, not by the kernmap library behind its custom ops: a graph compiled against another build's Meta strides
# would be replayed with that build's stride assertions. Those two are off for the tests (and the processes they
# start); the cache of inductor's compiled C++ kernels, keyed by their source and compiler command, is kept across
# sessions in $KERNMAP_HOME (scripts/env.sh): its g++ runs were most of the compile tests' time (5 of 10 s in the
# bench test).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _home = os.environ.get("KERNMAP_HOME")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = (os.path.join(_home, "inductor-tests") if _home
                                             else tempfile.mkdtemp(prefix="kernmap-tests-inductor-"))
os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
# scripts/test runs the tests in a worker process per CPU (pytest-xdist), each with a thread per core: OpenMP threads
# that spin while they wait hold the core the other worker needs (a two-thread align test took 63 s beside
# another worker instead of 12 s alone). Waiting threads sleep instead; results are the same either way. Read
# by OpenMP when torch loads it, below; the processes the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# And each worker takes its share of the CPUs as its default thread count (tests of several threads ask for them
# by number): N workers of N threads each on N CPUs ran the tiny-model align tests 5x slower than one thread,
# every parallel region waking sleeping threads (qwen2-moe-tiny, 20 steps: 34 s, one thread 6 s).
_WORKERS = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))  # 1 outside pytest-xdist
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cpus // _WORKERS))

import pytest  # noqa: E402
import torch  # noqa: E402

import kernmap  # noqa: F401  (registers torch.ops.kernmap)

ROOT = Path(__file__).resolve().parents[2]


def pytest_configure(config):
    config.addinivalue_line("markers", "families: kernelize on every causal-LM family of transformers (about 20 s; "
                                       "-m 'not families' leaves it out)")
    config.addinivalue_line("markers", "slow: takes 4 s or more on 2 cores (most start Python processes or compile "
                                       "with inductor); run first, and -m 'not slow' leaves them out")
    config.addinivalue_line("markers", "torchrun: starts processes under torchrun (two processes, gloo). scripts/test "
                                       "runs these one at a time before the others, which run in parallel workers: "
                                       "a DDP run beside another worker's tests aborted (SIGABRT) as it left its "
                                       "process group in 1 of 3 parallel suite runs, and in none of 32 runs of it "
                                       "alone under load (2026-12-03)")


def pytest_collection_modifyitems(config, items):
    """The slow tests first in each worker's share. scripts/test runs pytest-xdist's worksteal scheduler, which
    gives worker k the k-th contiguous 1/n of this list and, when a worker runs dry, moves half of the longest
    queue's tail to it: with every worker's slow tests at the front of its share, the run ends on short tests on
    every worker, not on one worker's 20 s test while the others have nothing left (the slow tests all in the
    first share ran on one worker for the whole run)."""
    slow = [item for item in items if item.get_closest_marker("slow")]
    rest = [item for item in items if not item.get_closest_marker("slow")]
    n = _WORKERS
    items[:] = [item for k in range(n) for item in slow[k::n] + rest[k * len(rest) // n:(k + 1) * len(rest) // n]]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _threads():
    """Each test starts with the process's thread count: in-process align and ablate runs apply --threads to the
    whole process, and a later test would run on one thread (and compile for one: inductor's cached graphs are
    per thread count)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def run_cli():
    """Runs the built `kernmap` command (scripts/kernmap ARGS...) and returns the finished process: returncode,
    stdout and stderr as text. `env` adds variables to this process's environment."""

    def run(*args, env=None, timeout=300):
        return subprocess.run([str(ROOT / "scripts" / "kernmap"), *map(str, args)], capture_output=True, text=True,
                              env=dict(os.environ, **(env or {})), timeout=timeout)

    return run

