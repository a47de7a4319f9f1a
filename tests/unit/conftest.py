"""Fixtures of the unit tier.

    one_torch_thread    module scope: torch at one intra-op thread while a module runs (small tensors: one
                        thread avoids OpenMP barriers on a shared, loaded CPU); use it with
                        ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``
"""

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
