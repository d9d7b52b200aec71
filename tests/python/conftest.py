import os
import subprocess
import tempfile
from pathlib import Path

# torch.compile's on-disk caches (inductor's FX graph cache, AOTAutograd's cache) are keyed by the graph, not by
# the kernmap library behind its custom ops: a graph compiled against another build's Meta strides would be
# replayed with that build's stride assertions. Every test session (and the processes it starts) compiles afresh.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernmap-tests-inductor-")
# scripts/test runs the tests in a worker process per CPU (pytest-xdist), each with a thread per core: OpenMP threads
# that spin while they wait hold the core the other worker needs (a two-thread align test took 63 s beside
# another worker instead of 12 s alone). Waiting threads sleep instead; results are the same either way. Read
# by OpenMP when torch loads it, below; the processes the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

import kernmap  # noqa: F401  (registers torch.ops.kernmap)

ROOT = Path(__file__).resolve().parents[2]


def pytest_configure(config):
    config.addinivalue_line("markers", "families: kernelize on every causal-LM family of transformers (about 20 s; "
                                       "-m 'not families' leaves it out)")
    config.addinivalue_line("markers", "torchrun: starts processes under torchrun (two processes, gloo). scripts/test "
                                       "runs these one at a time before the others, which run in parallel workers: "
                                       "a DDP run beside another worker's tests aborted (SIGABRT) as it left its "
                                       "process group in 1 of 3 parallel suite runs, and in none of 32 runs of it "
                                       "alone under load (2026-12-03)")


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

