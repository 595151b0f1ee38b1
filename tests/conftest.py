"""Every test starts from the same random state, so a failure reproduces with the same numbers."""

import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _seeded() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
