import pytest
import torch

import kernmap  # noqa: F401  (registers torch.ops.kernmap)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def poison():
    """Fills recently freed heap memory with NaN so a kernel that leaves an output element unwritten fails."""
    torch.full((1 << 20,), float("nan"))  # freed at once: the next allocations reuse this memory
