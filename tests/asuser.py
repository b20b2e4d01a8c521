"""Run a command as a fresh non-root uid, the way a non-root instructor's grader runs (root only).

``NonRoot(tmp).wrap(argv)`` returns the argv that starts ``argv`` as a uid leased for this test
(labkit's own ``UidLease``), in a private mount namespace where Python, the kit and ``tmp`` are
reachable (the grader's jail, ``labkit/grading/_jail.py``); ``close()`` kills every process of
the uids it leased (any state), removes their files and releases the leases.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from labkit.grading.contain import UidLease, kill_uid, remove_files_of

ROOT = os.geteuid() == 0


class NonRoot:
    def __init__(self, tmp: Path):
        self.tmp = str(tmp)
        os.chmod(tmp, 0o777)
        self.leases: list[UidLease] = []

    @property
    def uid(self) -> int:
        return self.leases[-1].uid

    def wrap(self, argv: list[str]) -> tuple[list[str], dict]:
        """(argv run as a fresh uid, extra keyword arguments for ``subprocess.run``)."""
        lease = UidLease()
        self.leases.append(lease)
        jail = str(Path(__file__).parents[1] / "labkit" / "grading" / "_jail.py")
        import labkit

        needed = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)),
                  os.path.dirname(os.path.dirname(os.path.abspath(labkit.__file__)))}
        needed |= {p for p in sys.path if p and os.path.isdir(p)}
        return ["unshare", "--mount", "--propagation", "private", "--", sys.executable, "-S", "-I", jail,
                str(lease.uid), str(lease.gid), *sorted(needed), self.tmp, "--", *argv], {}

    def close(self) -> None:
        for lease in self.leases:
            kill_uid(lease.uid, 5)
            remove_files_of(lease.uid, [self.tmp, "/tmp", "/var/tmp", "/dev/shm"])
            lease.release()
        self.leases.clear()
