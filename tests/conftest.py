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


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Every test leaves SIGINT and SIGTERM as it found them. A command that ends after a signal
    ignores later ones (``stop_on_first_signal(ignore_after=True)``, right for a process about to
    exit); run in-process by a test, that would leave the test worker ignoring Ctrl-C, and every
    subprocess it starts later would inherit the ignored disposition."""
    import signal
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        if signal.getsignal(s) is not h and h is not None:
            signal.signal(s, h)
