"""pytest settings for the notebook phase of `make test` (nbval on solutions/ and notebooks/, one run).

A solution notebook's stored outputs are compared (``--nbval``, sanitized by .ci/nbval_sanitize.cfg) and its
kernel runs ``check`` strict (``LABKIT_STRICT=1``: a check that does not pass stops the notebook); a learner
notebook (notebooks/) is run as with ``--nbval-lax``: every cell to the end, no output compared, its checks
not strict (its stubs raise NotImplementedError). One run for both lets the three workers share the notebooks
instead of each set waiting for its slowest notebook.

A kernel that does not answer at start is started again, twice at most, with what it wrote to
stderr shown as a warning: once in a full run on 2 cores, one of three kernels starting together
stayed silent for nbval's 60 s and failed a whole notebook (nbval sends a kernel's stderr to
/dev/null, so nothing said why). The notebook's cells still run once, in a kernel that answered.
"""
from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import pytest

KERNEL_STARTS = 3
SOLUTIONS = Path(__file__).resolve().parent / "solutions"


def _solution(path) -> bool:
    return SOLUTIONS in Path(path).resolve().parents


def _start_new_kernel(start):
    def start_new_kernel(*args, **kwargs):
        if kwargs.get("cwd") is not None:  # nbval starts each notebook's kernel in the notebook's folder
            env = dict(kwargs.get("env") or os.environ)
            if Path(kwargs["cwd"]).resolve() == SOLUTIONS:
                env["LABKIT_STRICT"] = "1"
            else:
                env.pop("LABKIT_STRICT", None)
            kwargs["env"] = env
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


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    """A learner notebook's collector (nbval's IPyNbFile) compares no output, as ``--nbval-lax`` has it."""
    collectors = yield
    for c in collectors or []:
        if type(c).__name__ == "IPyNbFile" and not _solution(c.path):
            c.compare_outputs = False
    return collectors
