"""A full disk (issue 21): the lab trains, prints its table and its verdict first, then a failed
write is ONE line naming the file and the errno (exit 1), and no partial file is left. On a real
tmpfs of 64 KiB (mounted when the tests run as root and mounting works here), else a simulated
ENOSPC from os.write."""
import errno
import os
import subprocess

import pytest

from labkit.__main__ import main as cli

SMALL = ["lab", "pipeline", "--schedule", "gpipe", "--world-size", "2", "--layers", "2", "--steps", "1",
         "--microbatches", "2", "--batch", "4", "--seq", "8", "--embd", "16", "--heads", "2"]


@pytest.fixture(params=[0, 8192], ids=["0 B free", "8 KiB free"])
def full_folder(request, tmp_path, monkeypatch):
    """A folder where writes fail with ENOSPC: a 64 KiB tmpfs with 0 or 8 KiB free (a filler file,
    outside the folder the lab writes to: a PNG does not fit) or, where no tmpfs can be mounted,
    os.write raising ENOSPC for files under it."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                                                   capture_output=True).returncode == 0
    if mounted:
        with open(mnt / "filler", "wb") as f:
            try:
                f.write(b"\0" * (64 * 1024 - request.param))
                f.flush()
            except OSError:
                pass
        (mnt / "out").mkdir()
    else:
        (mnt / "out").mkdir()
        real_write, real_open = os.write, os.open
        fds = set()

        def fake_open(path, flags, *a, **k):
            fd = real_open(path, flags, *a, **k)
            if str(path).startswith(str(mnt)):
                fds.add(fd)
            return fd

        def fake_write(fd, data):
            if fd in fds:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, data)
        monkeypatch.setattr(os, "open", fake_open)
        monkeypatch.setattr(os, "write", fake_write)
    yield mnt / "out"
    if mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def _files(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def test_full_disk_prints_the_verdict_then_one_line(full_folder, capsys):
    rc = cli([*SMALL, "--out", str(full_folder)])
    out, err = capsys.readouterr()
    assert rc == 1, (out, err)
    assert "single device" in out and "gpipe" in out            # the table
    assert "OK: every run (gpipe) equals single-device training at every step" in out  # the verdict
    assert err.count("\n") == 1 and err.startswith("error: cannot write ") and "Traceback" not in err, err
    assert "timelines.png: No space left on device (ENOSPC)" in err, err
    assert _files(full_folder) == []                              # no partial file, no temporary one


def test_write_bytes_atomic_leaves_the_old_file_or_nothing(full_folder):
    from labkit.labs import OutputError, write_bytes_atomic
    path = full_folder / "losses.csv"
    with pytest.raises(OutputError, match=f"cannot write {path}: No space left on device \\(ENOSPC\\)"):
        write_bytes_atomic(path, b"x" * (1 << 20))
    assert _files(full_folder) == []
