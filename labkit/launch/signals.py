"""Signals in the launcher: SIGTERM as an exception, the first Ctrl-C acted on and later ones held back,
and libc's ``prctl`` (the parent-death signal) for the processes of :mod:`labkit.launch`."""
from __future__ import annotations

import signal
import threading

# the signals that stop a labkit command: Ctrl-C, SIGTERM, and SIGHUP (the terminal closed), which acts as SIGTERM
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """Raised in the parent by SIGTERM while :func:`launch` (or a labkit command) runs, so that
    ``finally`` blocks stop the workers and remove temporary files. ``signum``: the signal.
    A BaseException, like KeyboardInterrupt: ``except Exception`` does not swallow it."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = int(signum)
        super().__init__(f"terminated by {signal.Signals(self.signum).name}")


def _raise_terminated(signum, frame):
    raise Terminated(signum)


class terminate_as_exception:
    """Context manager: while inside, SIGTERM raises :class:`Terminated` (main thread only, and
    only where SIGTERM still has its default action; otherwise it does nothing)."""

    def __enter__(self):
        import threading
        self._old = None
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._old = signal.signal(signal.SIGTERM, _raise_terminated)
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
        return False


class stop_on_first_signal:
    """Context manager (main thread only; elsewhere it does nothing): the FIRST SIGINT raises
    KeyboardInterrupt and the first SIGTERM or SIGHUP raises :class:`Terminated`; every later one is only
    recorded (``got``), so a second Ctrl-C 0.05 s after the first can never cut the clean-up
    short, wherever it lands (even between the raise and the ``finally`` that stops the workers).
    Installed only over Python's own handlers (default_int_handler, SIG_DFL, or an outer
    instance, which then stays in charge). On leaving, the previous handlers are back, unless
    ``ignore_after`` and a signal came: then SIGINT, SIGTERM and SIGHUP stay ignored (a command that is
    ending, :func:`labkit.labs.run_cli`)."""

    def __init__(self, ignore_after: bool = False):
        self.ignore_after, self.stopping, self.got, self._old = ignore_after, False, [], {}

    def _handler(self, signum, frame):
        if _HOLDING:  # inside _signals_deferred: recorded there, acted on when it ends
            _HOLDING[-1].append(signum)
            return
        if self.stopping:
            self.got.append(signum)
            return
        self.stopping = True
        self.got.append(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        ours = (signal.default_int_handler, signal.SIG_DFL, _raise_terminated)
        for sig in STOP_SIGNALS:
            current = signal.getsignal(sig)
            if current in ours:
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, signal.SIG_IGN if self.ignore_after and self.got else old)
        return False


def _stopping_handler_installed() -> bool:
    """True when a stop signal is handled by a :class:`stop_on_first_signal` (main thread)."""
    return any(isinstance(getattr(signal.getsignal(s), "__self__", None), stop_on_first_signal)
               for s in STOP_SIGNALS)


_HOLDING: list = []  # one list per open _signals_deferred under a stop_on_first_signal


class _signals_deferred:
    """While inside (main thread only): SIGINT, SIGTERM and SIGHUP are recorded, not acted on; on leaving,
    the previous handlers are back and the first recorded signal is acted on (KeyboardInterrupt,
    or :class:`Terminated`; under :class:`stop_on_first_signal`, its handler), unless an exception
    is already on its way out. A signal is delivered to whichever thread does not block it, and
    Python runs its handler in the main thread at the next bytecode, so blocking it in the main
    thread alone would not keep a Ctrl-C out of a few lines that must run together."""

    def __enter__(self):
        self._old, self._got, self._held = {}, [], False
        if threading.current_thread() is not threading.main_thread():
            return self
        if _stopping_handler_installed():
            _HOLDING.append(self._got)
            self._held = True
        else:
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, lambda signum, frame: self._got.append(signum))
        return self

    def __exit__(self, exc_type, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        if self._held:
            _HOLDING.remove(self._got)
            if self._got and exc_type is None:
                handler = signal.getsignal(self._got[0])
                if callable(handler):
                    handler(self._got[0], None)  # the stop_on_first_signal's: raises, or records a later one
            return False
        if self._got and exc_type is None:
            old = self._old[self._got[0]]
            if callable(old):
                old(self._got[0], None)  # e.g. Python's default SIGINT handler: KeyboardInterrupt
            elif self._got[0] == signal.SIGINT:
                raise KeyboardInterrupt
            else:
                raise Terminated(self._got[0])
        return False


_PRCTL = None


def _libc_prctl():
    """libc's ``prctl`` (Linux), looked up once."""
    global _PRCTL
    if _PRCTL is None:
        import ctypes
        _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
    return _PRCTL
