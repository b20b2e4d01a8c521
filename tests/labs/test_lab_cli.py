"""The lab/bench command lines: every bad input is ONE `error:` line, exit code 2, before any process
starts; --help shows defaults; the MoE lab's load plot is written from histories."""
import pytest
import torch

from labkit.__main__ import main as cli

BAD = [
    (["lab", "pipeline", "--data", "/nonexistent-labkit"], "--data /nonexistent-labkit: no such file or folder"),
    (["lab", "pipeline", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["lab", "pipeline", "--heads", "3"], "n_embd=64 must be divisible by n_head=3"),
    (["lab", "pipeline", "--heads", "0"], "--heads must be >= 1, got 0"),
    (["lab", "pipeline", "--world-size", "0"], "--world-size must be >= 1, got 0"),
    (["lab", "pipeline", "--microbatches", "0"], "--microbatches must be >= 1, got 0"),
    (["lab", "tensor", "--tp", "0"], "TP degree t=0 must be >= 1"),
    (["lab", "tensor", "--tp", "3"], "t=3 must divide"),
    (["lab", "tensor", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["lab", "tensor", "--heads", "3"], "n_embd=64 must be divisible by n_head=3"),
    (["lab", "tensor", "--data", "/nonexistent-labkit"], "--data /nonexistent-labkit: no such file or folder"),
    (["lab", "moe", "--ep", "0"], "--ep must be >= 1, got 0"),
    (["lab", "moe", "--top-k", "9"], "--top-k 9 must be in [1, --experts 8]"),
    (["lab", "moe", "--top-k", "0"], "--top-k 0 must be in [1, --experts 8]"),
    (["lab", "moe", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["lab", "moe", "--batch", "6"], "--batch 6 must be divisible by --ep 4"),
    (["lab", "moe", "--experts", "6"], "--experts 6 must be divisible by --ep 4"),
    (["lab", "moe", "--heads", "3"], "n_embd=64 must be divisible by n_head=3"),
    (["lab", "moe", "--moe-every", "5"], "--moe-every 5 > --n-layer 4 leaves no MoE layer"),
    (["lab", "moe", "--data", "/nonexistent-labkit"], "--data /nonexistent-labkit: no such file or folder"),
    (["lab", "nosuch"], "unknown lab 'nosuch'; choose one of pipeline, tensor, moe"),
    *[(["lab", lab, "--seed", "99999999999999999999"], "--seed must be in [0, 2**40), got 99999999999999999999")
      for lab in ("pipeline", "tensor", "moe")],
    *[(["lab", lab, "--lr", v], "--lr must be a finite number in (0, 10]")
      for lab in ("pipeline", "tensor", "moe") for v in ("inf", "1e308", "11")],
    *[(["lab", lab, "--tolerance", v], f"--tolerance must be a finite number > 0, got {float(v)}")
      for lab in ("pipeline", "tensor", "moe") for v in ("0", "-1", "nan")],
    *[(["lab", lab, "--data", "/dev/null"], "--data /dev/null: exists but is not a regular text file or folder")
      for lab in ("pipeline", "tensor", "moe")],
    (["lab", "moe", "--capacity-factor", "inf"], "--capacity-factor must be a finite number > 0, got inf"),
    (["lab", "moe", "--gamma", "nan"], "--gamma must be a finite number >= 0, got nan"),
    (["lab", "moe", "--aux-coeff", "-0.1"], "--aux-coeff must be a finite number >= 0, got -0.1"),
    (["lab", "pipeline", "--seq", "100000"], "TiB of memory"),
    (["lab", "tensor", "--embd", "65536"], "103,118,798,848 parameters"),
    (["lab", "moe", "--experts", "4096", "--n-embd", "1024"], "34,419,056,640 parameters"),
    (["doctor", "--world-size", "4", "0"], "--world-size must be >= 1, got 0"),
    (["bench", "nosuch"], "unknown bench 'nosuch'; choose one of pipeline, tensor, moe"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_error_line(argv, message, capsys):
    assert cli(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0]


def test_bad_files_are_one_error_line_before_any_rank(tmp_path, capsys):
    exe = tmp_path / "prog.bin"
    exe.write_bytes(bytes(range(256)) * 64)
    short = tmp_path / "short.txt"
    short.write_text("def f(x):\n    return x\n" * 100)  # 2500 bytes: the validation split has 256 tokens
    afile = tmp_path / "afile"
    afile.write_text("x")
    for lab in ("pipeline", "tensor", "moe"):
        for argv, message in ((["--data", str(exe)], "does not look like text"),
                              (["--data", str(short), "--seq", "400"], "the val split has 256 tokens, too few for "
                                                                       "sequences of 400 tokens"),
                              (["--out", str(afile)], f"--out {afile}: {afile} exists and is not a folder"),
                              (["--out", str(afile / "sub")], "exists and is not a folder")):
            assert cli(["lab", lab, *argv]) == 2, (lab, argv)
            out, err = capsys.readouterr()
            assert out == "" and err.startswith("error: ") and err.count("\n") == 1 and message in err, (lab, err)


def test_empty_data_folder(tmp_path, capsys):
    for lab in ("pipeline", "tensor", "moe"):
        assert cli(["lab", lab, "--data", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "holds no text files" in err and "\n" not in err


@pytest.mark.parametrize("cmd", ["lab", "bench"])
@pytest.mark.parametrize("name", ["pipeline", "tensor", "moe"])
def test_help_shows_defaults(cmd, name, capsys):
    with pytest.raises(SystemExit) as e:
        cli([cmd, name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.count("(default: ") >= 5, out


def test_top_level_help_is_plain_text(capsys):
    assert cli(["--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out and "lab NAME" in out


def test_moe_load_plot_from_histories(tmp_path):
    from labkit.labs import moe
    a = moe.build_parser().parse_args(["--experts", "4"])
    steps, g = 25, torch.Generator().manual_seed(0)
    runs = {mode: {"loads": [torch.randint(0, 20, (2, 4), generator=g) for _ in range(steps)],
                   "dropped": [[0.1, 0.2]] * steps, "balance": [[1.0, 1.1]] * steps, "lm": [3.0] * steps}
            for mode in moe.BALANCE_MODES}
    runs["none"]["loads"] = [torch.tensor([[0, 0, 30, 10], [40, 0, 0, 0]])] * steps  # collapsed
    ep_hist = [{"bytes": [{"forward": [32, 100, 100], "backward": [100, 100]}]}] * 2
    moe._plots(str(tmp_path), runs, ep_hist, a)
    for name in ("expert_load.png", "balance.png", "all_to_all_bytes.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_run_folders_are_never_shared(tmp_path):
    from labkit.labs import run_folder
    folders = [run_folder(tmp_path, "pipeline") for _ in range(3)]  # within one second
    assert len(set(folders)) == 3 and all(f.is_dir() for f in folders)
    assert folders[1].name == folders[0].name + "-2"


@pytest.mark.parametrize("argv", [["bench", "pipeline", "--schedule", "nope"], ["bench", "dp", "--nope"],
                                  ["bench", "tensor", "--nope"], ["bench", "moe", "--nope"],
                                  ["lab", "pipeline", "--schedule", "nope"], ["lab", "tensor", "--steps", "x"],
                                  ["lab", "moe", "--nope"], ["lab", "3d", "--tp", "x"], ["plan", "--gpus", "x"],
                                  ["doctor", "--world-size", "x"], ["grade"], ["build", "--nope"]])
def test_argparse_errors_are_one_line(argv, capsys):
    """Every labkit parser: one 'error:' line naming the option and the --help hint, exit 2, no usage block."""
    with pytest.raises(SystemExit) as e:
        cli(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert "usage:" not in err and err.rstrip().endswith("--help)"), err
