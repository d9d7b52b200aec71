import pytest
import torch

import kernmap  # noqa: F401  (registers torch.ops.kernmap)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
