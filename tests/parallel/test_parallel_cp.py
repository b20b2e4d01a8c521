"""Context parallelism composed with TP, PP and DP (labkit.parallel.ParallelGPT on a grid with cp):
every parameter gradient (gathered to full shape) at every step and the parameters after 3
plain-SGD steps equal one device's; the communication of every axis, CP's K/V traffic included,
equals the planner's formula exactly. Layouts: t = 2, cp = 2, p = 2 on 8 ranks (ring), and
cp = 2 with d = 2 on 4 ranks (all-gather, Ulysses); ZeRO 1, 2, 3 over the d cp ranks (one with
p = 2 and d = 1: ZeRO over the CP ranks alone); HSDP (R = 2 replicas x (d/R) cp shard ranks);
selective recompute of the all-gather and Ulysses cores; t = 2 with sequence parallelism. Injected
bugs (the gradients averaged, or ZeRO-2's shards reduce-scattered, over DP only, not over the d cp
ranks; HSDP's shards averaged over the shard ranks alone) must be caught. ``lab 3d --cp``
per attention kind on 4 ranks: measured activations = the planner's within 2 %; per CP rank the
attention work = :func:`labkit.context_parallel.attention_work`."""
import dataclasses

import pytest
import torch

from labkit.comm import CommLog
from labkit.dist import launch, make_grid
from labkit.model import GPT, GPTConfig
from labkit.parallel import ParallelGPT
from labkit.parallel.gpt import check_cp_layout

B, S, STEPS = 4, 16, 3


def cfg_for():
    return GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, block_size=S, bias=False, vocab_size=64)


def batches(cfg):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, cfg.vocab_size, (B, S), generator=g),
             torch.randint(0, cfg.vocab_size, (B, S), generator=g)) for _ in range(STEPS)]


def reference(cfg, lr=0.1):
    model = GPT(cfg, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for x, y in batches(cfg):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: q.grad.clone() for n, q in model.named_parameters()})
        opt.step()
    return losses, grads, {n: q.detach().clone() for n, q in model.named_parameters()}


def _worker(ctx, cfg, t, p, d, cp, method, bug, zero, sp, hsdp=1, recompute="none"):
    grid = make_grid(ctx, tp=t, pp=p, dp=d, cp=cp)
    import labkit.parallel.gpt as gpt_mod
    if bug == "dp_only":       # injected: DDP over the DP group alone (CP ranks' gradients never meet)
        orig = gpt_mod.DistributedDataParallel
        gpt_mod.DistributedDataParallel = lambda m, group, cap, **kw: orig(m, grid.dp_group, cap, **kw)
    if bug == "zero_dp_only":  # injected: ZeRO-2 reduce-scatters over the DP group alone
        class DPOnly(gpt_mod.ZeroStage2):
            def __init__(self, m, cls, group, cap, **kw):
                super().__init__(m, cls, grid.dp_group, cap, **kw)
        gpt_mod.ZeroStage2 = DPOnly
    pg = ParallelGPT(GPT(cfg, seed=0), grid, "1f1b", 2, bucket_cap_mb=0.002, cp_attention=method, zero=zero,
                     sequence_parallel=sp, hsdp=hsdp, recompute=recompute)
    if bug == "hsdp_shard_dp_only":   # injected: each shard's gradient averaged over the d/R shard ranks alone
        for w in pg.sharded:
            w.replicas = 1
    pg.make_optimizer("sgd", 0.1)
    out = {"losses": [], "grads": [], "comm": [], "expected": pg.expected_comm(B, S), "last": pg.has_last_stage,
           "keep": grid.tp_rank == 0}
    for x, y in batches(cfg):
        pg.zero_grad()
        with CommLog() as log:
            out["losses"].append(pg.train_step(x, y))
            if zero == 1:
                pg.optimizer.reduce_gradients()
        if zero == 1:
            pg.optimizer.gather_gradients()      # inspection only, not counted
        grads = pg.gather_full("grad")           # ZeRO-2/3: the shards all-gathered, not counted
        out["grads"].append(grads if out["keep"] else None)
        with CommLog() as log2:
            pg.optimizer.step()
        out["comm"].append(pg.comm_by_axis(log.records + log2.records))
    params = pg.gather_full("param")
    out["params"] = params if out["keep"] else None
    return out


def run(t, p, d, cp, method, bug=None, zero=0, sp=False, hsdp=1, recompute="none"):
    cfg = cfg_for()
    return cfg, launch(_worker, t * p * d * cp, cfg, t, p, d, cp, method, bug, zero, sp, hsdp, recompute, timeout=60)


def _mismatches(cfg, ranks):
    ref_losses, ref_grads, ref_params = reference(cfg)
    bad = []
    for i, r in enumerate(ranks):
        if not r["keep"]:
            continue
        for step in range(STEPS):
            for n, g in r["grads"][step].items():
                if not torch.allclose(g, ref_grads[step][n], rtol=1e-5, atol=1e-6):
                    bad.append((i, step, n))
        for n, prm in r["params"].items():
            if not torch.allclose(prm, ref_params[n], rtol=1e-5, atol=1e-6):
                bad.append((i, "param", n))
    losses = [sum(r["losses"][s] for r in ranks if r["last"]) / sum(1 for r in ranks if r["last"])
              for s in range(STEPS)]
    return bad, losses, ref_losses


LAYOUTS = {"t2 cp2 p2 ring": (2, 2, 1, 2, "ring"), "cp2 d2 allgather": (1, 1, 2, 2, "allgather"),
           "cp2 d2 ulysses": (1, 1, 2, 2, "ulysses"),
           # ZeRO over the d cp ranks of a stage; d = 1: over the CP ranks alone (the same ranks as CP's K/V)
           "cp2 d2 zero1 ring": (1, 1, 2, 2, "ring", None, 1),
           "cp2 p2 zero2 allgather": (1, 2, 1, 2, "allgather", None, 2),
           "cp2 d2 zero3 ulysses": (1, 1, 2, 2, "ulysses", None, 3),
           # TP + SP inside each CP rank: [b, S/(cp t), H] between the blocks
           "t2 cp2 sp allgather": (2, 1, 1, 2, "allgather", None, 0, True),
           # HSDP: R = 2 replicas (of the DP coordinate) x (d/R) cp = 2 shard ranks; R = d, the CP ranks shard
           "cp2 d2 zero3 hsdp2 ring": (1, 1, 2, 2, "ring", None, 3, False, 2),
           # selective recompute: the all-gather / Ulysses core recomputed in backward (its s x s scores again)
           "cp2 d2 selective allgather": (1, 1, 2, 2, "allgather", None, 0, False, 1, "selective"),
           "cp2 p2 selective ulysses": (1, 2, 1, 2, "ulysses", None, 0, False, 1, "selective")}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def outcome(request):
    return request.param, run(*LAYOUTS[request.param])


def test_equals_one_device(outcome):
    name, (cfg, ranks) = outcome
    bad, losses, ref = _mismatches(cfg, ranks)
    assert not bad, f"{name}: mismatches {bad[:8]}"
    assert losses == pytest.approx(ref, rel=1e-5, abs=1e-6)
    held = set().union(*(r["grads"][0] for r in ranks if r["keep"]))
    assert held == set(n for n, _ in GPT(cfg, seed=0).named_parameters())   # every parameter checked


def test_bytes_per_axis_equal_the_planner(outcome):
    name, (cfg, ranks) = outcome
    for r in ranks:
        for step in range(1, STEPS):      # step 0 also sends the pipeline's shape messages
            assert r["comm"][step] == r["expected"], (name, step, r["comm"][step], r["expected"])
        assert "cp" in r["expected"] and "dp" in r["expected"]


@pytest.mark.parametrize("bug, zero, hsdp", [("dp_only", 0, 1), ("zero_dp_only", 2, 1), ("hsdp_shard_dp_only", 3, 2)])
def test_injected_bug_is_caught(bug, zero, hsdp):
    cfg, ranks = run(1, 1, 2, 2, "allgather", bug=bug, zero=zero, hsdp=hsdp)
    bad, _, _ = _mismatches(cfg, ranks)
    assert any(n == "embedding.wte.weight" for *_, n in bad)


@pytest.mark.parametrize("kw, message", [
    (dict(tp=2, cp=2, cp_attention="ulysses"), "n_kv_head=1 must both be divisible by cp=2"),
    (dict(tp=1, cp=2, cp_attention="flash"), "must be one of ring | allgather | ulysses"),
    (dict(tp=4, cp=2, cp_attention="ring", sequence_parallel=True, seq_len=12),
     "each CP rank's S/cp = 12/2 = 6 tokens must be divisible by t=4"),
    (dict(tp=1, cp=2, cp_attention="ring", zero=3, hsdp=2), None),          # HSDP over (d/R) cp shard ranks
    (dict(tp=1, cp=2, cp_attention="allgather", recompute="selective"), None),
    (dict(tp=1, cp=2, cp_attention="ulysses", recompute="selective"), None),
    (dict(tp=1, cp=2, cp_attention="ring", recompute="selective"), None),
    (dict(tp=1, cp=2, cp_attention="ring", seq_len=6, load_balance=False), None),
    (dict(tp=1, cp=3, cp_attention="ring", seq_len=16), "S=16 must be divisible by 2 * cp"),
])
def test_bad_cp_layouts(kw, message):
    if message is None:                       # allowed: the contiguous split needs cp | S only
        check_cp_layout(cfg_for(), **kw)
        return
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        check_cp_layout(cfg_for(), **{"tp": 1, **kw})


def test_lab_3d_with_cp(tmp_path, capsys):
    """``lab 3d --cp 2`` (t = 2, cp = 2: 4 ranks) trains, prints a CP row equal to its formula and says OK."""
    from labkit.labs.threed import main
    rc = main(["--tp", "2", "--cp", "2", "--pp", "1", "--dp", "1", "--steps", "2", "--batch", "4",
               "--microbatches", "1", "--seq", "16", "--no-plots", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "CP (cp=2)   send" in out and "OK: every run (t2 cp2 ring p1 d1 1f1b)" in out
    # per CP rank: 68 query-key pairs per sequence and head (balanced), x 4 layers x M = 1 x 2 heads per TP rank,
    # measured by the ring
    assert "[68, 68]; a contiguous split would give [36, 100]" in out
    assert "work 544, 544 (formula x 4 layers x M=1, 2 heads: 544, 544)" in out


@pytest.mark.parametrize("method, layout", [
    ("ring", ["--tp", "1", "--cp", "4", "--dp", "1"]),
    ("allgather", ["--tp", "1", "--cp", "2", "--dp", "2"]),
    ("ulysses", ["--tp", "1", "--cp", "4", "--dp", "1"]),
])
def test_lab_3d_cp_activations_equal_the_planner(tmp_path, capsys, method, layout):
    """On 4 ranks, per CP attention kind: the activations measured with saved_tensors_hooks in the
    last step are compared with the planner's (within 2 %, else the lab fails), every rank."""
    from labkit.labs.threed import main
    rc = main([*layout, "--pp", "1", "--cp-attention", method, "--steps", "2", "--batch", "4",
               "--microbatches", "1", "--seq", "16", "--no-plots", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.split("communication bytes per axis (planner)\n")[1].splitlines()[1:5]
    for line in lines:                      # rank ... activations (planner) diff
        measured, planned, diff = line.split()[7:10]
        assert diff.endswith("%") and abs(int(planned) / int(measured) - 1) <= 0.02, line
    assert "not compared" not in out


def test_lab_3d_cp_ring_with_selective_recompute_equals_one_device_and_the_planner(tmp_path, capsys):
    """(t, cp, p, d) = (1, 2, 2, 1), ring attention, selective recompute: the CP core checkpointed (its
    inputs kept; its forward's K/V sends run again in backward), equal to one device, bytes per axis
    and activations equal to the planner's. Injected bug: the planner told there is no recompute
    misses the repeated sends and the activations it saves."""
    from labkit.labs import threed
    argv = ["--tp", "1", "--pp", "2", "--dp", "1", "--cp", "2", "--cp-attention", "ring", "--steps", "2", "--batch",
            "4", "--microbatches", "2", "--seq", "16", "--no-plots", "--recompute", "selective"]
    rc = threed.main([*argv, "--out", str(tmp_path)])
    cap = capsys.readouterr()
    assert rc == 0 and "OK   t1 cp2 ring p2 d1 1f1b" in cap.out and "FAIL" not in cap.err, cap.out + cap.err
    out = threed.LAB.result
    assert threed._planner_table(threed.parse_args(argv), out)[1] == []
    bad = threed._planner_table(threed.parse_args(argv[:-2]), out)[1]
    assert any("cp send" in b for b in bad) and any("activations" in b for b in bad), bad


def test_lab_3d_bad_cp_is_one_line(tmp_path, capsys):
    from labkit.labs.threed import main
    for argv, msg in ((["--cp-no-load-balance"], "--cp-no-load-balance has no effect without --cp > 1"),
                      (["--cp", "2", "--seq", "6", "--cp-no-load-balance"], "--seq 6 must be divisible by 2 * --cp"),
                      (["--cp", "2", "--zero", "3", "--hsdp", "3", "--dp", "4"],
                       "HSDP replicas R=3 must be an integer >= 1 that divides d=4")):
        assert main([*argv, "--heads", "2", "--embd", "16", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0], err
    assert main(["--cp", "2", "--cp-attention", "ulysses", "--heads", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --cp-attention ulysses splits each TP rank's heads over the --cp 2 ranks: --heads 2 / "
                   "--tp 2 = 1 heads per TP rank must be divisible by --cp 2"]


def test_attention_work_formula():
    """Per CP rank, query-key pairs per sequence summed over the heads it computes (S = 8, cp = 2)."""
    from labkit.context_parallel import attention_work
    # contiguous: queries 0-3 see 1+2+3+4 = 10 keys, 4-7 see 5+..+8 = 26; balanced chunks {0,1,6,7}, {2,3,4,5}: 18 each
    assert attention_work(8, 2, "ring", 1, load_balance=False) == [10, 26]
    assert attention_work(8, 2, "allgather", 3) == [54, 54]
    # Ulysses: 2 of 4 heads on the whole triangle (36 pairs) each, whatever the placement
    assert attention_work(8, 2, "ulysses", 4) == attention_work(8, 2, "ulysses", 4, load_balance=False) == [72, 72]
    with pytest.raises(ValueError, match="heads=3 must be divisible by cp=2"):
        attention_work(8, 2, "ulysses", 3)
    with pytest.raises(ValueError, match="must be one of ring"):
        attention_work(8, 2, "flash", 2)


@pytest.mark.parametrize("method, work", [
    ("allgather", "work 288, 800 (formula x 2 layers x M=1, 4 heads: 288, 800)"),     # 4 heads x 2 x [36, 100]
    ("ulysses", "work 544, 544 (formula x 2 layers x M=1, 4 heads: 544, 544)"),       # 2 of 4 heads x 2 x 136
])
def test_lab_3d_cp_work_per_rank_contiguous(tmp_path, capsys, monkeypatch, method, work):
    """The naive (contiguous) split on cp = 2, t = 1: equal to one device; the work each CP rank's
    attention measured = :func:`attention_work` exactly (all-gather: unbalanced, Ulysses: balanced by
    heads), the compute time only reported. Injected bug: the work counted without the causal mask
    (dense pairs) must fail the lab."""
    from labkit.labs.threed import main
    argv = ["--tp", "1", "--cp", "2", "--pp", "1", "--dp", "1", "--cp-attention", method, "--cp-no-load-balance",
            "--steps", "2", "--batch", "2", "--microbatches", "1", "--seq", "16", "--layers", "2", "--no-plots",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert work in out and "compute ms" in out and "contiguous split, --cp-no-load-balance): [36, 100]" in out
    import labkit.context_parallel.allgather as ag
    import labkit.context_parallel.ulysses as ul
    mod = ag if method == "allgather" else ul
    monkeypatch.setattr(mod, "block_work", lambda q_pos, k_pos, causal: q_pos.numel() * k_pos.numel())
    assert main(argv) == 1
    assert "FAIL: CP attention work per rank measured" in capsys.readouterr().err


@pytest.mark.parametrize("zero, layout, method", [
    ("1", ["--dp", "2", "--pp", "1"], "ulysses"),
    ("2", ["--dp", "1", "--pp", "2"], "ring"),        # ZeRO over the CP ranks alone, two pipeline stages
    ("3", ["--dp", "2", "--pp", "1"], "allgather"),
])
def test_lab_3d_cp_with_zero(tmp_path, capsys, monkeypatch, zero, layout, method):
    """``lab 3d --cp 2 --zero 1|2|3`` (t = 1, 4 ranks): equal to one device by the lab's verdict and
    the planner = measured per rank (model states and ZeRO-3's gathered peak exact over the d cp
    shard ranks, bytes per axis exact), else the lab fails. Injected bug: a planner that shards the
    model states over d alone (not d cp) must fail the planner check."""
    from labkit.labs import threed
    argv = ["--tp", "1", "--cp", "2", *layout, "--zero", zero, "--cp-attention", method, "--steps", "2",
            "--batch", "4", "--microbatches", "2", "--seq", "16", "--layers", "2", "--no-plots"]
    rc = threed.main([*argv, "--out", str(tmp_path)])
    cap = capsys.readouterr()
    assert rc == 0 and "FAIL" not in cap.err, cap.out + cap.err
    assert f"ZeRO-{zero}," in cap.out and "OK: every run" in cap.out and "DP (d*cp=" in cap.out
    rows = [ln.split() for ln in cap.out.split("communication bytes per axis (planner)\n")[1].splitlines()[1:5]]
    for row in rows:                                       # params, grads, optimizer: measured == planner
        assert row[1] == row[2] and row[3] == row[4] and row[5] == row[6], row
    a, out = threed.parse_args(argv), threed.LAB.result
    a.dp = int(layout[1])
    assert threed._planner_table(a, out)[1] == []
    from labkit.plan import memory
    orig = memory._zero_shard
    monkeypatch.setattr(memory, "_zero_shard", lambda n, d: orig(n, d // 2))     # shards over d, not d * cp
    bad = threed._planner_table(a, out)[1]
    assert any(b.startswith("rank 0 optimizer: measured") for b in bad), bad


def test_lab_3d_cp_with_sequence_parallelism(tmp_path, capsys, monkeypatch):
    """``lab 3d --tp 2 --cp 2 --sp`` (Ulysses, 4 ranks): equal to one device by the lab's verdict, the
    planner = measured per rank (model states and bytes per axis exact, activations within 2 %,
    else the lab fails). Injected bug: every TP rank adds the positions of TP rank 0's S/(cp t)
    tokens (the CP positions not sliced per SP shard) must fail the verdict."""
    from labkit.labs import threed
    argv = ["--tp", "2", "--cp", "2", "--pp", "1", "--dp", "1", "--sp", "--cp-attention", "ulysses", "--steps", "2",
            "--batch", "4", "--microbatches", "2", "--seq", "16", "--layers", "2", "--no-plots", "--out", str(tmp_path)]
    rc = threed.main(argv)
    cap = capsys.readouterr()
    assert rc == 0 and "FAIL" not in cap.err, cap.out + cap.err
    assert ", SP, " in cap.out and "OK: every run (t2 cp2 ulysses p1 d1 1f1b)" in cap.out
    rows = [ln.split() for ln in cap.out.split("communication bytes per axis (planner)\n")[1].splitlines()[1:5]]
    for row in rows:
        assert row[1] == row[2] and row[3] == row[4] and row[5] == row[6], row
        assert abs(float(row[9].rstrip("%"))) <= 2.0 and row[10:13] == ["cp", row[11], f"({row[11]}),"], row
    import labkit.tensor_parallel.model as tp_model
    monkeypatch.setattr(tp_model, "tp_rank", lambda group: 0)
    assert threed.main(argv) == 1
    assert "FAIL t2 cp2 ulysses p1 d1 1f1b" in capsys.readouterr().out


def test_lab_3d_cp_with_hsdp_equals_one_device_and_the_planner(tmp_path, capsys, monkeypatch):
    """``lab 3d --cp 2 --dp 2 --zero 3 --hsdp 2`` (t = 1, 4 ranks): R = d = 2 replicas, each sharding
    over its (d/R) cp = 2 CP ranks; equal to one device by the lab's verdict, model states, ZeRO-3's
    gathered peak and the DP bytes (all-gathers and reduce-scatter over the shard ranks, the
    all-reduce across the replicas) equal to the planner's. Injected bug: a planner whose HSDP
    shard group leaves out cp (d/R ranks) must fail the planner check."""
    from labkit.labs import threed
    argv = ["--tp", "1", "--cp", "2", "--dp", "2", "--pp", "1", "--zero", "3", "--hsdp", "2", "--cp-attention", "ring",
            "--steps", "2", "--batch", "4", "--microbatches", "2", "--seq", "16", "--layers", "2", "--no-plots"]
    rc = threed.main([*argv, "--out", str(tmp_path)])
    cap = capsys.readouterr()
    assert rc == 0 and "FAIL" not in cap.err, cap.out + cap.err
    assert "HSDP R=2" in cap.out and "OK: every run" in cap.out and "DP (d*cp=4)" in cap.out
    a, out = threed.parse_args(argv), threed.LAB.result
    assert threed._planner_table(a, out)[1] == []
    assert all("all_reduce" in r.comm[-1]["dp"] and "all_gather" in r.comm[-1]["dp"] for r in out.ranks)
    import labkit.parallel.gpt as gpt_mod
    orig = gpt_mod.hsdp_dp_comm
    monkeypatch.setattr(gpt_mod, "hsdp_dp_comm", lambda spec, lay, R, r, *x, **kw: orig(spec, dataclasses.replace(
        lay, cp=1), R, r, *x, **kw))                                  # shards over d/R = 1 rank: nothing gathered
    bad = threed._planner_table(a, out)[1]
    assert any(" dp all_gather" in b or " dp reduce_scatter" in b for b in bad), bad


@pytest.mark.parametrize("method, extra", [
    ("allgather", ["--seq", "32", "--microbatches", "1"]),
    # ZB-H1: I keeps the graph, so the re-run Ulysses core's s x s scores come on top of the stash
    ("ulysses", ["--seq", "64", "--embd", "16", "--microbatches", "2", "--schedule", "zb-h1"]),
])
def test_lab_3d_cp_selective_recompute_equals_one_device_and_the_planner(tmp_path, capsys, monkeypatch, method,
                                                                         extra):
    """(t, cp, p, d) = (1, 2, 2, 1), selective recompute with the all-gather / Ulysses core: equal to
    one device by the lab's verdict; bytes per axis exact and activations within 2 % of the
    planner's, whose peak includes the rise while a backward re-runs the core (its s'/s x s scores
    next to the stash). Injected bug: a planner without that rise must fail the activations."""
    from labkit.labs import threed
    from labkit.plan import memory
    argv = ["--tp", "1", "--pp", "2", "--dp", "1", "--cp", "2", "--cp-attention", method, "--steps", "2", "--batch",
            "4", *extra, "--layers", "4", "--no-plots", "--recompute", "selective"]
    rc = threed.main([*argv, "--out", str(tmp_path)])
    cap = capsys.readouterr()
    assert rc == 0 and "FAIL" not in cap.err and "OK: every run" in cap.out, cap.out + cap.err
    a, out = threed.parse_args(argv), threed.LAB.result
    assert threed._planner_table(a, out)[1] == []
    monkeypatch.setattr(memory, "cp_core_recompute_bytes", lambda spec, lay: 0)
    monkeypatch.setattr(memory, "_selective_cp_transient", lambda spec, lay, device: 0)
    bad = threed._planner_table(a, out)[1]
    assert any("activations" in b for b in bad), bad
