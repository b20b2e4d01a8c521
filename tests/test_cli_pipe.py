"""A reader that goes away (``python -m labkit ... | head``) costs no work and shows no traceback: the
command finishes, writes its files, and ends silently with 141 (128 + SIGPIPE, as a tool killed by SIGPIPE)."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOLUTION_01 = ROOT / "solutions" / "01_pipeline_bubble.ipynb"
SMALL_LAB = ["lab", "pipeline", "--schedule", "gpipe", "--world-size", "2", "--layers", "2", "--steps", "1",
             "--microbatches", "2", "--batch", "4", "--seq", "8", "--embd", "16", "--heads", "2"]


def _run_into_closed_pipe(args, cwd, stderr_too: bool, timeout: float) -> tuple[int, str]:
    """Run ``python -m labkit ARGS`` with stdout (and stderr when ``stderr_too``: ``2>&1``) into a pipe whose
    reader is closed before the command writes a byte; return its exit status and its stderr otherwise."""
    r, w = os.pipe()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "labkit", *args], cwd=cwd, env=env, stdout=w,
                            stderr=w if stderr_too else subprocess.PIPE, text=True)
    os.close(w)
    os.close(r)  # the reader has gone: every write the command makes gets EPIPE
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, err or ""


def test_grade_into_a_closed_pipe_writes_its_results(tmp_path):
    results = tmp_path / "X.json"
    code, err = _run_into_closed_pipe(["grade", str(SOLUTION_01), "--assignment", "01_pipeline_bubble",
                                       "--results", str(results)], tmp_path, stderr_too=True, timeout=300)
    assert code == 128 + signal.SIGPIPE
    obj = json.loads(results.read_text())
    assert obj["score"] == 4, obj


def test_grade_whose_stdout_reader_left_says_nothing_on_stderr(tmp_path):
    results = tmp_path / "X.json"
    code, err = _run_into_closed_pipe(["grade", str(SOLUTION_01), "--assignment", "01_pipeline_bubble",
                                       "--results", str(results)], tmp_path, stderr_too=False, timeout=300)
    assert "Traceback" not in err and "BrokenPipe" not in err and "integrity" not in err, err
    assert code == 128 + signal.SIGPIPE, err
    assert json.loads(results.read_text())["score"] == 4


def test_lab_into_a_closed_pipe_finishes_and_keeps_its_run_folder(tmp_path):
    out = tmp_path / "runs"
    code, err = _run_into_closed_pipe([*SMALL_LAB, "--out", str(out)], tmp_path, stderr_too=False, timeout=300)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert code == 128 + signal.SIGPIPE, err
    folders = [p for p in out.iterdir() if p.is_dir()]
    assert len(folders) == 1 and any(folders[0].iterdir()), folders
