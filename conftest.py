"""pytest settings for the notebook phases of `make test` (nbval on solutions/ and notebooks/).

A kernel that does not answer at start is started again, twice at most, with what it wrote to
stderr shown as a warning: once in a full run on 2 cores, one of three kernels starting together
stayed silent for nbval's 60 s and failed a whole notebook (nbval sends a kernel's stderr to
/dev/null, so nothing said why). The notebook's cells still run once, in a kernel that answered.
"""
from __future__ import annotations

import tempfile
import warnings

KERNEL_STARTS = 3


def _start_new_kernel(start):
    def start_new_kernel(*args, **kwargs):
        for attempt in range(1, KERNEL_STARTS + 1):
            err = tempfile.TemporaryFile()
            try:
                return start(*args, **dict(kwargs, stderr=err))
            except RuntimeError as e:
                err.seek(0)
                said = err.read().decode(errors="replace").strip()[-2000:] or "(nothing on stderr)"
                if attempt == KERNEL_STARTS:
                    raise RuntimeError(f"{e}; {KERNEL_STARTS} kernels did not answer; the last wrote: {said}") from e
                warnings.warn(f"kernel start {attempt} of {KERNEL_STARTS} failed ({e}); it wrote: {said}",
                              stacklevel=2)
            finally:
                err.close()  # the kernel keeps its own copy of the descriptor

    return start_new_kernel


def pytest_configure(config):
    """Only in an nbval run: importing nbval (jupyter_client, zmq) elsewhere changed how the signal
    tests' processes took Ctrl-C."""
    if not (getattr(config.option, "nbval", False) or getattr(config.option, "nbval_lax", False)):
        return
    import nbval.kernel

    if not getattr(nbval.kernel.start_new_kernel, "labkit_retries", False):
        nbval.kernel.start_new_kernel = _start_new_kernel(nbval.kernel.start_new_kernel)
        nbval.kernel.start_new_kernel.labkit_retries = True
