"""An autouse fixture for the engine suites (unit and integration): one torch thread."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models: one intra-op thread is fastest, and other suites share the cores.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
