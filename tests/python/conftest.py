import os
import subprocess
from pathlib import Path

import pytest
import torch

import kernmap  # noqa: F401  (registers torch.ops.kernmap)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def run_cli():
    """Runs the built `kernmap` command (scripts/kernmap ARGS...) and returns the finished process: returncode,
    stdout and stderr as text. `env` adds variables to this process's environment."""

    def run(*args, env=None, timeout=300):
        return subprocess.run([str(ROOT / "scripts" / "kernmap"), *map(str, args)], capture_output=True, text=True,
                              env=dict(os.environ, **(env or {})), timeout=timeout)

    return run


def poison():
    """Fills recently freed heap memory with NaN so a kernel that leaves an output element unwritten fails."""
    torch.full((1 << 20,), float("nan"))  # freed at once: the next allocations reuse this memory
