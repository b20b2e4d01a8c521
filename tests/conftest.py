"""Fixtures shared by the test files."""
import signal

import pytest
import torch

# A non-interactive shell starts a background job (`make test &`, a CI step run so) with SIGINT ignored, and
# every process under it inherits that: the Ctrl-C tests would send Ctrl-C to ranks that cannot receive it.
# The suite restores Python's own handler, which its subprocesses then start with as the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
    """Every test leaves SIGINT, SIGTERM and SIGHUP, and the signal mask, as it found them. A command that
    ends after a signal ignores later ones (``stop_on_first_signal(ignore_after=True)``, right for a
    process about to exit); run in-process by a test, that would leave the test worker ignoring
    Ctrl-C, and every subprocess it starts later would inherit the ignored disposition (a blocked
    signal, too: the mask survives fork and exec). A change is undone and reported as a warning
    naming the test, so that the test that leaks it can be found."""
    import signal
    import threading
    import warnings
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    threads = {t.name for t in threading.enumerate()}
    yield
    for s, h in saved.items():
        if signal.getsignal(s) is not h and h is not None:
            signal.signal(s, h)
    now = signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if now != mask:
        warnings.warn(f"the test left signals {sorted(now ^ mask)} blocked/unblocked; restored", stacklevel=1)
    new = {t.name for t in threading.enumerate()} - threads
    if any(n.startswith("labkit-") for n in new):
        warnings.warn(f"the test left labkit threads running: {sorted(new)}", stacklevel=1)


@pytest.fixture(scope="session")
def references_imported():
    """Each exercise case runs in a child forked from the test process, which tripwires the exercise's withheld
    references, importing their modules (the explorer, the benches, torch_native's DTensor) in every case's
    child. Imported once here, the children inherit them; the verdicts are the same."""
    from labkit.grading.assignments import ANSWERS
    from labkit.grading.kernel import _Tripwires
    from labkit.grading.runner import _withheld_calls

    for exercise_id in ANSWERS:
        _Tripwires(_withheld_calls(exercise_id))  # resolves the names (imports), swaps nothing
