"""Fixtures shared by the test files."""
import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models run on one thread, as each rank does (the first multi-threaded CPU kernels
    of a process take seconds to warm up)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
