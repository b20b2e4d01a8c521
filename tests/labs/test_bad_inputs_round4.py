"""Issue 37: bad inputs of the options, environment variables and files touched in round 4, tried as
a user would. Each is ONE `error:` line naming the value and the rule, exit code 2, before any rank
or kernel starts: nothing on stdout, no traceback, nothing left in the temporary folder, /dev/shm or
the run folder. In-process (parse and checks only), so the whole table costs seconds. Also: what
each command says it stopped when a signal ends it, and the files a refused or interrupted command
leaves (none)."""
import os
import signal
import tempfile
from pathlib import Path

import pytest

from labkit.__main__ import main as cli

ROOT = Path(__file__).resolve().parents[2]
NB = str(ROOT / "notebooks" / "01_pipeline_bubble.ipynb")
GRADE = ["grade", NB, "--assignment", "01_pipeline_bubble"]
T3 = ["lab", "3d", "--steps", "1"]


def _deep(path, kind):
    path.write_text("[" * 100_000 + "]" * 100_000 if kind == "list" else '{"a":' * 100_000 + "1" + "}" * 100_000)


def _hidden(tmp, kind):
    """A hidden-case folder (or file) of ``kind``; returns its path."""
    folder = tmp / f"cases-{kind}"
    if kind == "file":
        folder.write_text("x = 1\n")
    elif kind != "missing":
        folder.mkdir()
        text = {"syntax": "def (\n", "raises": "raise RuntimeError('case file broke')\n", "empty": None}[kind]
        if text is not None:
            (folder / "c.py").write_text(text)
    return folder


# (id, argv (TMP is replaced by the test's folder), environment, setup(tmp) or None, words in the one line)
CASES = [
    # lab 3d: options without effect (the one rule), schedules and their sizes, MoE and CP options
    ("3d sp tp1", [*T3, "--sp", "--tp", "1"], {}, None, "--sp has no effect without --tp > 1"),
    ("3d cp-attention", [*T3, "--cp-attention", "allgather"], {}, None,
     "--cp-attention allgather has no effect without --cp > 1 (got --cp 1): set --cp"),
    ("3d cp-attention default", [*T3, "--cp-attention", "ring", "--cp", "1"], {}, None,
     "--cp-attention ring has no effect without --cp > 1"),
    ("3d no-load-balance", [*T3, "--cp", "1", "--cp-no-load-balance"], {}, None,
     "--cp-no-load-balance has no effect without --cp > 1"),
    ("3d experts no moe", [*T3, "--experts", "8"], {}, None, "--experts 8 has no effect without --moe: set --moe"),
    ("3d topk no moe", [*T3, "--topk", "1"], {}, None, "--topk 1 has no effect without --moe"),
    ("3d hsdp zero2", [*T3, "--hsdp", "2", "--zero", "2", "--dp", "4"], {}, None,
     "--hsdp 2 has no effect without --zero 3"),
    ("3d bucket zero3", [*T3, "--bucket-cap-mb", "1", "--zero", "3"], {}, None,
     "--bucket-cap-mb 1.0 has no effect without DDP buckets"),
    ("3d bucket zero1", [*T3, "--bucket-cap-mb", "1", "--zero", "1"], {}, None, "(got --zero 1, --dp 2, --cp 1)"),
    ("3d bucket dp1", [*T3, "--bucket-cap-mb", "1", "--dp", "1"], {}, None, "(got --zero 0, --dp 1, --cp 1)"),
    ("3d chunks zbv", [*T3, "--chunks", "2", "--schedule", "zbv"], {}, None,
     "--chunks 2 has no effect without --schedule interleaved"),
    ("3d chunks dualpipev", [*T3, "--chunks", "3", "--schedule", "dualpipev"], {}, None, "got --schedule dualpipev"),
    ("3d zbv pp1", [*T3, "--schedule", "zbv", "--pp", "1"], {}, None,
     "--schedule zbv runs 2 model chunks per rank in a V over the p ranks: it needs --pp > 1, got --pp 1"),
    ("3d dualpipev pp1", [*T3, "--schedule", "dualpipev", "--pp", "1"], {}, None,
     "--schedule dualpipev runs 2 model chunks per rank in a V over the p ranks: it needs --pp > 1"),
    ("3d zbv alias pp1", [*T3, "--schedule", "zb-v", "--pp", "1"], {}, None, "--schedule zbv runs 2 model chunks"),
    ("3d interleaved pp1", [*T3, "--schedule", "interleaved", "--pp", "1"], {}, None,
     "--schedule interleaved runs 2 model chunks per rank: it needs --pp > 1"),
    ("3d dualpipev rounds", [*T3, "--schedule", "dualpipev", "--microbatches", "5", "--batch", "10", "--tp", "1",
                             "--dp", "1"], {}, None, "which must divide --microbatches 5; e.g. --microbatches 4 or 6"),
    ("3d interleaved rounds", [*T3, "--schedule", "interleaved", "--microbatches", "5", "--batch", "10", "--tp", "1",
                               "--dp", "1"], {}, None, "rounds = max(1, M // p) = 2 equal rounds"),
    ("3d experts 0", [*T3, "--moe", "--experts", "0"], {}, None, "--experts must be >= 1, got 0"),
    ("3d experts -4", [*T3, "--moe", "--experts", "-4"], {}, None, "--experts must be >= 1, got -4"),
    ("3d topk 0", [*T3, "--moe", "--topk", "0"], {}, None, "--topk 0 must be between 1 and --experts 4"),
    ("3d topk 5", [*T3, "--moe", "--topk", "5"], {}, None, "--topk 5 must be between 1 and --experts 4"),
    ("3d ulysses heads", [*T3, "--tp", "2", "--cp", "4", "--cp-attention", "ulysses", "--heads", "4"], {}, None,
     "--heads 4 / --tp 2 = 2 heads per TP rank must be divisible by --cp 4"),
    ("3d ulysses odd heads", [*T3, "--tp", "1", "--cp", "2", "--cp-attention", "ulysses", "--heads", "3",
                              "--embd", "48"], {}, None, "--heads 3 / --tp 1 = 3 heads per TP rank"),
    ("3d hsdp 0", [*T3, "--zero", "3", "--hsdp", "0"], {}, None, "HSDP replicas R=0 must be an integer >= 1"),
    ("3d cp 0", [*T3, "--cp", "0"], {}, None, "--cp must be >= 1, got 0"),
    ("3d cp seq", [*T3, "--cp", "3", "--tp", "1", "--seq", "32", "--heads", "2", "--embd", "16"], {}, None,
     "--seq"),
    # lab pipeline and lab moe
    ("pipeline chunks gpipe", ["lab", "pipeline", "--schedule", "gpipe", "--chunks", "2"], {}, None,
     "--chunks 2 has no effect without --schedule interleaved (or all; got --schedule gpipe)"),
    ("pipeline chunks zero-bubble", ["lab", "pipeline", "--schedule", "zero-bubble", "--chunks", "3"], {}, None,
     "got --schedule zero-bubble"),
    ("pipeline chunks 1f1b zbv", ["lab", "pipeline", "--schedule", "1f1b", "zbv", "--chunks", "2"], {}, None,
     "got --schedule 1f1b zbv"),
    ("pipeline data broken link", ["lab", "pipeline", "--data", "TMP/data"], {},
     lambda t: ((t / "data").mkdir(), (t / "data" / "a.txt").write_text("x\n" * 999),
                (t / "data" / "b.txt").symlink_to(t / "nowhere")),
     "1 file(s) or folder(s) in it cannot be read (permission denied, or a link to nothing)"),
    ("pipeline data empty folder", ["lab", "pipeline", "--data", "TMP/data"], {}, lambda t: (t / "data").mkdir(),
     "folder holds no text files"),
    ("pipeline data binary only", ["lab", "pipeline", "--data", "TMP/data"], {},
     lambda t: ((t / "data").mkdir(), (t / "data" / "a.txt").write_bytes(b"\0" * 4096)), "has 0 bytes; need >= 1024"),
    ("moe device-coeff", ["lab", "moe", "--device-coeff", "0.1"], {}, None,
     "--device-coeff 0.1 has no effect without --eplb: set --eplb"),
    ("moe expert-groups", ["lab", "moe", "--expert-groups", "2"], {}, None, "--expert-groups 2 has no effect"),
    ("moe eplb redundant", ["lab", "moe", "--eplb", "--redundant-experts", "-1"], {}, None, "--redundant-experts -1"),
    ("moe eplb gpus-per-node", ["lab", "moe", "--eplb", "--gpus-per-node", "3"], {}, None,
     "--gpus-per-node 3 must divide --ep 4"),
    ("moe eplb groups", ["lab", "moe", "--eplb", "--expert-groups", "3"], {}, None,
     "--expert-groups 3 must divide --experts 8"),
    ("moe eplb capacity", ["lab", "moe", "--eplb", "--capacity-factor", "2"], {}, None,
     "--capacity-factor 2.0 has no effect without the standard lab (--eplb routes without a capacity limit): "
     "leave --eplb out, or leave --capacity-factor out"),
    ("moe eplb aux-coeff", ["lab", "moe", "--eplb", "--aux-coeff", "0.1"], {}, None, "--aux-coeff 0.1 has no effect"),
    ("moe eplb compare-mode", ["lab", "moe", "--eplb", "--compare-mode", "aux"], {}, None,
     "--compare-mode aux has no effect without the standard lab"),
    ("moe ep1 experts 0", ["lab", "moe", "--ep", "1", "--experts", "0"], {}, None, "--experts must be >= 1, got 0"),
    # bench
    ("bench dp pp", ["bench", "dp", "--iters3d", "0", "--pp", "2"], {}, None,
     "--pp 2 has no effect without the 3D comparison (got --iters3d 0, which skips it): set --iters3d > 0"),
    ("bench dp microbatches", ["bench", "dp", "--iters3d", "0", "--microbatches", "2"], {}, None, "--microbatches 2"),
    ("bench dp dp3", ["bench", "dp", "--iters3d", "0", "--dp3", "2"], {}, None, "--dp3 2 has no effect"),
    ("bench pipeline chunks", ["bench", "pipeline", "--schedule", "gpipe", "1f1b", "--chunks", "3"], {}, None,
     "--chunks 3 has no effect without --schedule interleaved (got --schedule gpipe 1f1b)"),
    ("bench pipeline chunks zbv", ["bench", "pipeline", "--schedule", "zbv", "--chunks", "2"], {}, None,
     "got --schedule zbv"),
    ("bench moe 1e12 tokens", ["bench", "moe", "--tokens", "1000000000000"], {}, None,
     "--tokens 1000000000000 --experts 8 --hidden 64: one measurement needs about"),
    ("bench moe 1e5 tokens 2 experts", ["bench", "moe", "--tokens", "200000", "--experts", "2"], {}, None,
     "use fewer tokens"),
    ("bench moe capacity", ["bench", "moe", "--capacity-factor", "1e12"], {}, None, "C = "),
    # plan
    ("plan empty layout", ["plan", "--model", "gpt3-175b", "--gpus", "64", "--layout", ""], {}, None,
     "--layout wants t=..,p=..,d=..[,v=..,ep=..,M=..], got ''"),
    ("plan blank layout", ["plan", "--model", "gpt3-175b", "--gpus", "64", "--layout", " "], {}, None,
     "--layout wants t="),
    ("plan recompute search", ["plan", "--model", "gpt3-175b", "--gpus", "64", "--recompute", "full"], {}, None,
     "--recompute full has no effect without --layout"),
    ("plan no-sp search", ["plan", "--model", "gpt3-175b", "--gpus", "64", "--no-sp"], {}, None,
     "--no-sp has no effect without --layout"),
    ("plan top layout", ["plan", "--model", "gpt3-175b", "--gpus", "64", "--layout", "t=8,p=8,d=1", "--top", "3"],
     {}, None, "--top 3 has no effect without the search"),
    ("plan deep list", ["plan", "--model", "TMP/deep.json", "--gpus", "8"], {},
     lambda t: _deep(t / "deep.json", "list"), "JSON nested too deeply"),
    ("plan deep object", ["plan", "--model", "TMP/deep.json", "--gpus", "8"], {},
     lambda t: _deep(t / "deep.json", "object"), "JSON nested too deeply"),
    # the grader's hidden cases (grade's variable and autograder's option: one check, the same words)
    *[(f"grade hidden {k}", GRADE, {"LABKIT_HIDDEN_CASES": f"TMP/cases-{k}"}, lambda t, k=k: _hidden(t, k), words)
      for k, words in (("missing", "no such folder"), ("file", "is not a folder (a file)"),
                       ("syntax", "do not load: SyntaxError: invalid syntax"),
                       ("raises", "do not load: RuntimeError: case file broke"),
                       ("empty", "the folder holds no .py case files"))],
    ("grade hidden only helpers", GRADE, {"LABKIT_HIDDEN_CASES": "TMP/cases-empty"},
     lambda t: (_hidden(t, "empty"), (t / "cases-empty" / "_helpers.py").write_text("x = 1\n")),
     "the folder holds no .py case files (files named _*.py are helpers, not run)"),
    ("grade hidden second missing", GRADE, {"LABKIT_HIDDEN_CASES": f"TMP/cases-empty{os.pathsep}TMP/cases-missing"},
     lambda t: (_hidden(t, "empty"), (t / "cases-empty" / "c.py").write_text("x = 1\n")),
     "cases-missing: no such folder"),
    *[(f"autograder hidden {k}", ["autograder", "01_pipeline_bubble", "--out", "TMP/ag.zip", "--hidden-cases",
                                  f"TMP/cases-{k}"], {}, lambda t, k=k: _hidden(t, k), words)
      for k, words in (("file", "is not a folder (a file)"), ("syntax", "do not load: SyntaxError"),
                       ("raises", "do not load: RuntimeError: case file broke"))],
    ("autograder out proc", ["autograder", "01_pipeline_bubble", "--out", "/proc/ag.zip"], {}, None,
     "--out /proc/ag.zip: cannot write in its folder /proc"),
    # notebooks and build
    ("notebooks solutions file", ["notebooks", "TMP/nb", "--solutions"], {},
     lambda t: ((t / "nb").mkdir(), (t / "nb" / "solutions").write_text("")),
     "solutions exists and is a file, not a folder"),
    ("notebooks place is a folder", ["notebooks", "TMP/nb"], {},
     lambda t: (t / "nb" / "01_pipeline_bubble.ipynb").mkdir(parents=True), "exists and is not a file"),
    ("build root elsewhere", ["build", "--root", "TMP"], {}, None, "found no solutions/ folder in"),
]


@pytest.mark.parametrize("kind", ["missing", "not json"])
def test_autograder_run_without_its_bundle_is_one_line(kind, tmp_path, monkeypatch, capsys):
    """The Gradescope side (run_autograder): LABKIT_AUTOGRADER_ROOT or --root that does not hold the
    unpacked bundle is one line naming the file, exit 2, not a traceback."""
    from labkit.grading.autograder import _run_main
    if kind == "not json":
        (tmp_path / "source").mkdir()
        (tmp_path / "source" / "labkit_assignment.json").write_text("{bad")
    monkeypatch.setenv("LABKIT_AUTOGRADER_ROOT", str(tmp_path))
    assert _run_main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'source' / 'labkit_assignment.json'} cannot be read") and \
        err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ([] if kind == "missing" else ["source"])


def _shm_of_this_process():
    return {n for n in os.listdir("/dev/shm") if str(os.getpid()) in n} if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("name,argv,env,setup,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_leaves_nothing(name, argv, env, setup, words, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    if setup is not None:
        setup(work)
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    for k, v in env.items():
        monkeypatch.setenv(k, v.replace("TMP", str(work)))
    argv = [a.replace("TMP", str(work)) for a in argv]
    if argv[0] == "lab" or argv[:2] == ["bench", "dp"]:
        argv += ["--out", str(tmp_path / "runs")]
    before = set(os.listdir(work))
    shm = _shm_of_this_process()
    assert len(CASES) >= 60
    try:
        rc = cli(argv)
    except SystemExit as e:   # an argparse-level error (labkit.cliparse.Parser.error): how `python -m labkit` exits
        rc = e.code
    assert rc == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (out, err)
    assert words in lines[0], lines[0]
    assert os.listdir(private) == [] and _shm_of_this_process() == shm
    assert not (tmp_path / "runs").exists() or os.listdir(tmp_path / "runs") == []
    assert set(os.listdir(work)) == before                     # nothing copied, written or half-written
    if (work / "nb").exists():
        assert sorted(p.name for p in (work / "nb").rglob("*") if p.suffix == ".ipynb" and p.is_file()) == []


def test_build_outside_a_checkout_refuses_and_leaves_the_checkout_alone(tmp_path, monkeypatch, capsys):
    """With an editable install (this venv's labkit is the checkout's), `build` run elsewhere must not
    rewrite the checkout's notebooks/: it works on the checkout it stands in, or refuses."""
    before = {p.name: p.stat().st_mtime_ns for p in (ROOT / "notebooks").glob("*.ipynb")}
    monkeypatch.chdir(tmp_path)
    assert cli(["build"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: found no solutions/ folder in {tmp_path} or above it") and err.count("\n") == 1
    assert {p.name: p.stat().st_mtime_ns for p in (ROOT / "notebooks").glob("*.ipynb")} == before
    assert not (tmp_path / "notebooks").exists()


def test_autograder_bundle_that_cannot_be_written_is_one_line_and_no_file(tmp_path, monkeypatch, capsys):
    """A full disk while the bundle is written: one line naming the file (exit 1), no temporary file."""
    from labkit.grading import autograder
    real = autograder._add

    def full(z, name, data, mode=0o644):
        if name.startswith("labkit/grading/"):
            raise OSError(28, "No space left on device")
        return real(z, name, data, mode)
    monkeypatch.setattr(autograder, "_add", full)
    assert cli(["autograder", "01_pipeline_bubble", "--out", str(tmp_path / "ag.zip")]) == 1
    err = capsys.readouterr().err
    assert err == f"error: cannot write {tmp_path / 'ag.zip'}: No space left on device\n", err
    assert os.listdir(tmp_path) == []
    if os.geteuid() != 0:   # a read-only folder (root writes there anyway)
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        assert cli(["autograder", "01_pipeline_bubble", "--out", str(ro / "ag.zip")]) == 2
        assert "cannot write in its folder" in capsys.readouterr().err


# each command, stopped by a signal, says what it stopped in its own words (a lab's line is not the grader's)
STOPPED = [("lab", "stopped; no rank is left running"), ("bench", "stopped; no rank is left running"),
           ("grade", "grading stopped; no kernel is left running and no results file is half-written"),
           ("autograder", "stopped; no half-written bundle is left"),
           ("build", "build stopped; each notebook is either written whole or untouched"),
           ("notebooks", "copy stopped; the notebooks copied so far are whole, the others not copied"),
           ("plan", "stopped (plan writes no file)")]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("cmd,words", STOPPED, ids=[c for c, _ in STOPPED])
def test_each_command_says_what_it_stopped(cmd, words, signum, monkeypatch, capsys):
    import time

    import labkit.__main__ as m

    def work(rest):
        os.kill(os.getpid(), signum)    # a real signal, through the command's own handler
        time.sleep(30)                  # never reached: the handler raises at once
        raise AssertionError("the signal did not stop the command")
    monkeypatch.setitem(m.COMMANDS, cmd, work)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        rc = cli([cmd])
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    head = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
    assert rc == 128 + signum and err == f"{head}: {words}\n", err
