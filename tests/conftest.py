"""Every test starts from the same random state, so a failure reproduces with the same numbers.

Every pipeline runner of the suite (its ranks inherit the environment) checks each message's
sequence number on receipt: a message that meets the wrong receive fails loudly.
"""

import os
import random

import numpy as np
import pytest
import torch

from modelpar.pipeline.runner import CHECK_MESSAGES_ENV

os.environ.setdefault(CHECK_MESSAGES_ENV, "1")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
