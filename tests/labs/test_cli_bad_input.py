"""Issue 21's bad inputs of bench, plan, lab and grade, and the torchrun variables: each is ONE
`error:` line naming the option (or file, or variable) and the rule, exit code 2, before any rank
starts (nothing on stdout, no traceback)."""
import json
import os
import socket
import subprocess
import sys

import pytest

from labkit.__main__ import main as cli

BENCH = [
    (["bench", "pipeline", "--world-size", "0"], "--world-size must be >= 1, got 0"),
    (["bench", "pipeline", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["bench", "pipeline", "--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["bench", "pipeline", "--microbatches", "0"], "--microbatches must be >= 1, got 0"),
    (["bench", "pipeline", "--microbatches", "3"], "--batch 32 is not divisible by --microbatches 3"),
    (["bench", "pipeline", "--layers", "6", "--schedule", "gpipe"], "n_layer=6 layers cannot be split evenly"),
    (["bench", "pipeline", "--batch", "12"], "--batch 12 is not divisible by --microbatches 8"),
    (["bench", "tensor", "--tp", "0"], "--tp must be >= 1, got 0"),
    (["bench", "tensor", "--iters", "0"], "--iters must be >= 1, got 0"),
    (["bench", "tensor", "--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["bench", "moe", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["bench", "moe", "--experts", "0"], "--experts must be >= 1, got 0"),
    (["bench", "moe", "--top-k", "9"], "--top-k 9 must be in [1, --experts 8]"),
    (["bench", "moe", "--repeat", "0"], "--repeat must be >= 1, got 0"),
    (["bench", "moe", "--tokens", "-5"], "--tokens must be >= 1, got -5"),
    (["bench", "moe", "--capacity-factor", "nan"], "--capacity-factor must be a finite number > 0, got nan"),
    (["bench", "dp", "--iters3d", "-1"], "--iters3d must be >= 0, got -1"),
    (["bench", "dp", "--microbatches", "0"], "--microbatches must be >= 1, got 0"),
]
LAB = [
    (["lab"], "lab needs a NAME, one of pipeline, tensor, moe, 3d"),
    (["bench"], "bench needs a NAME, one of pipeline, tensor, moe, dp"),
    (["lab", "moe", "--eplb", "--device-coeff", "inf"], "--device-coeff must be a finite number > 0, got inf"),
    (["lab", "moe", "--redundant-experts", "3"], "--redundant-experts 3 has no effect without --eplb: set --eplb"),
    (["lab", "moe", "--gpus-per-node", "2"], "--gpus-per-node 2 has no effect without --eplb"),
    (["lab", "3d", "--schedule", "gpipe", "--chunks", "3"], "--chunks 3 has no effect without --schedule interleaved"),
    (["lab", "pipeline", "--cost-model", "inf,0,0"], "--cost-model takes three numbers >= 0 in milliseconds, finite"),
    (["lab", "pipeline", "--cost-model", "-1,0,0"], "--cost-model takes three numbers >= 0 in milliseconds, finite"),
    (["lab", "pipeline", "--cost-model", "1e7,0,0"], "more than half the 60 s a rank waits for a peer"),
    (["lab", "pipeline", "--data", ""], "--data '': an empty path"),
    (["lab", "moe", "--data", " "], "--data ' ': an empty path"),
    # a folder that cannot be made (even by root): refused before the run, not after it trained
    (["lab", "3d", "--out", "/proc/labkit-out"], "--out /proc/labkit-out: cannot write there"),
    (["lab", "pipeline", "--out", "/proc/labkit-out/a"], "--out /proc/labkit-out/a: cannot write there"),
    (["notebooks", "/proc/labkit-notebooks"], "cannot write /proc/labkit-notebooks/"),
]
PLAN = [
    (["--model", "gpt3-175b", "--gpus", "64", "--kv-heads", "0"], "--kv-heads must be an integer >= 1, got 0"),
    (["--model", "gpt3-175b", "--gpus", "64", "--ffn", "-5"], "--ffn must be an integer >= 1, got -5"),
    (["--model", "gpt3-175b", "--gpus", "64", "--layers", "1000000000"], "--layers must be at most 10,000"),
    (["--model", "gpt3-175b", "--gpus", "64", "--layers", "1000000000000"], "--layers must be at most 10,000"),
    (["--model", "gpt3-175b", "--gpus", "64", "--efficiency", "5"], "--efficiency is the share of peak"),
    (["--model", "gpt3-175b", "--gpus", "80", "--layout", "t=8,p=5,d=2,v=4"], "p*v = 20 equal chunks"),
    (["--model", "gpt3-175b", "--gpus", "64", "--layout", "t=0,p=5,d=2"], "--layout t=0 must be >= 1"),
]
SPEC = {"n_layer": 4, "hidden": 64, "n_head": 4, "vocab_size": 100, "seq_len": 16, "global_batch": 8}
JSON_BAD = [
    ({"n_kv_head": 0}, "field n_kv_head must be an integer >= 1, got 0"),
    ({"n_layer": 24.5}, "field n_layer must be an integer >= 1, got 24.5"),
    ({"n_layer": True}, "field n_layer must be an integer >= 1, got true"),
    ({"dropout": "high"}, 'field dropout must be a probability in [0, 1), got "high"'),
    ({"ffn": -4}, "field ffn must be an integer >= 1, got -4"),
    ({"hidden": "64"}, 'field hidden must be an integer >= 1, got "64"'),
    ({"n_layer": 10**9}, "field n_layer must be at most 10,000"),
]


def _one_error_line(rc, capsys, message):
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert message in lines[0], err


@pytest.mark.parametrize("argv,message", BENCH + LAB, ids=[" ".join(a) for a, _ in BENCH + LAB])
def test_bench_and_lab(argv, message, capsys):
    _one_error_line(cli(argv), capsys, message)


@pytest.mark.parametrize("argv,message", PLAN, ids=[" ".join(a) for a, _ in PLAN])
def test_plan_options(argv, message, capsys):
    _one_error_line(cli(["plan", *argv]), capsys, message)


@pytest.mark.parametrize("fields,message", JSON_BAD, ids=[m.split(" must")[0] for _, m in JSON_BAD])
def test_plan_json_fields(fields, message, tmp_path, capsys):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**SPEC, **fields}))
    rc = cli(["plan", "--model", str(path), "--gpus", "8"])
    _one_error_line(rc, capsys, f"--model {path}: {message}")


def test_plan_binary_json_names_the_file_and_the_byte(tmp_path, capsys):
    path = tmp_path / "m.json"
    path.write_bytes(b'{"n_layer": \xff\xfe}')
    _one_error_line(cli(["plan", "--model", str(path), "--gpus", "8"]), capsys,
                    f"--model {path}: not a JSON text file (byte 0xff at offset 12 is not UTF-8)")


def test_grade_on_a_fifo_and_a_non_python_kernel(tmp_path, capsys):
    fifo = tmp_path / "sub.ipynb"
    os.mkfifo(fifo)
    _one_error_line(cli(["grade", str(fifo)]), capsys, f"{fifo} is a FIFO (named pipe)")
    nb = tmp_path / "r.ipynb"
    nb.write_text(json.dumps({"cells": [], "metadata": {"kernelspec": {"name": "ir", "language": "R",
                                                                       "display_name": "R"}},
                              "nbformat": 4, "nbformat_minor": 5}))
    _one_error_line(cli(["grade", str(nb)]), capsys, "declares the kernel 'ir' (language R)")


def test_data_folder_that_cannot_be_read(tmp_path, monkeypatch, capsys):
    """A folder whose text files cannot be read is named so, not "holds no text files". The tests run
    as root, who reads everything: the permission checks are simulated (os.access, os.scandir)."""
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("hello\n" * 1000)
    (data / "sub" / "b.txt").write_text("hello\n" * 1000)
    real_access, real_scandir = os.access, os.scandir
    monkeypatch.setattr(os, "access", lambda p, mode, **k: str(p) != str(data / "a.txt") and real_access(p, mode, **k))

    def scandir(path="."):
        if str(path) == str(data / "sub"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)
    monkeypatch.setattr(os, "scandir", scandir)
    _one_error_line(cli(["lab", "pipeline", "--data", str(data)]), capsys,
                    f"--data {data}: 2 file(s) or folder(s) in it cannot be read (permission denied")
    monkeypatch.setattr(os, "access", real_access)  # a.txt readable again, sub/ still not: refused, not trained on
    _one_error_line(cli(["lab", "pipeline", "--data", str(data)]), capsys,   # part of the folder without a word
                    f"--data {data}: 1 file(s) or folder(s) in it cannot be read (permission denied")
    monkeypatch.setattr(os, "scandir", real_scandir)
    from labkit.data import text_files
    assert text_files(data) == [data / "a.txt", data / "sub" / "b.txt"]
    (data / "gone.txt").symlink_to(tmp_path / "nowhere")   # a link to nothing is named too
    _one_error_line(cli(["lab", "pipeline", "--data", str(data)]), capsys, f"e.g. {data / 'gone.txt'}")


def _lab_with_env(env):
    code = "import sys; from labkit.__main__ import main; sys.exit(main(sys.argv[1:]))"
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")}
    return subprocess.run([sys.executable, "-c", code, "lab", "pipeline", "--steps", "1"], capture_output=True,
                          text=True, timeout=60, env={**clean, **env})


def test_torchrun_variables_without_torchrun():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cases = [({"RANK": "1"}, "RANK=1 set but WORLD_SIZE, LOCAL_RANK not"),
                 ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "MASTER_ADDR and MASTER_PORT not"),
                 ({"RANK": "0", "WORLD_SIZE": "four", "LOCAL_RANK": "0"}, "WORLD_SIZE='four' is not an integer"),
                 ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "need 0 <= RANK < WORLD_SIZE"),
                 ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": port}, f"MASTER_PORT={port} on MASTER_ADDR=127.0.0.1 is taken")]
        for env, message in cases:
            r = _lab_with_env(env)
            assert r.returncode == 2 and r.stdout == "", (env, r)
            assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and message in r.stderr, (env, r)


@pytest.mark.parametrize("cmd", ["lab", "bench"])
def test_lab_and_bench_help_list_the_names(cmd, capsys):
    assert cli([cmd, "--help"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "NAME is one of" in out and ("3d" in out if cmd == "lab" else "dp" in out), out
