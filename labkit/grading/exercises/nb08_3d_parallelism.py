"""Exercises of notebook 08_3d_parallelism: the process grid, the memory of one GPU, choosing
(t, p, d), and the bytes each axis moves.

* N_GPU = t * p * d, ranks ordered TP innermost, then DP, PP outermost (Megatron-LM,
  Narayanan et al. 2021 sec. 3): ``rank = pp * (d t) + dp * t + tp``.
* Model states (Rajbhandari et al. 2020, ZeRO sec. 3.1): 2 + 2 + 12 bytes per parameter in mixed
  precision, 4 + 4 + 8 in fp32; ZeRO-1/2/3 divide the optimizer state / + gradients / + parameters by d.
* Activations (Korthikanti et al. 2022, eq. 1-2, Table 2), first pipeline stage of 1F1B:
  min(p, M) microbatches of L/p layers.
* Megatron's rules (Narayanan et al. 2021 sec. 3.3): TP within a node; the smallest t p that fits;
  the rest is DP.
* Bytes on the wire per step (ring algorithms): TP 4 all-reduces of s b h per layer and microbatch;
  PP one send forward and one backward per microbatch and stage boundary; DP one all-reduce of the
  gradients per step.

Expected values come from :mod:`labkit.plan` (the planner that the tests check against measured runs).
"""
from __future__ import annotations

from ...plan.activations import korthikanti_layer_activation_bytes
from ...plan.memory import BYTES
from ..registry import CheckFailure, exercise, expect_close, expect_equal, expect_raises

NOTEBOOK = "08_3d_parallelism"


# ----------------------------------------------------------------------------- 8.1 / 8.2
def _coords(rank, t, p, d):
    return rank % t, rank // (t * d), (rank // t) % d


def _groups(rank, t, p, d):
    tp, pp, dp = _coords(rank, t, p, d)
    base = pp * d * t
    return {"tp": [base + dp * t + i for i in range(t)],
            "dp": [base + j * t + tp for j in range(d)],
            "pp": [k * d * t + dp * t + tp for k in range(p)]}


ex81 = exercise(
    "8.1", title="rank -> (tp, pp, dp) coordinates", notebook=NOTEBOOK, points=2,
    hint="TP is innermost: tp = rank % t. DP comes next: dp = (rank // t) % d. PP is outermost: "
         "pp = rank // (t * d). Raise ValueError for a rank outside 0..t*p*d-1.")


def _coords_case(t, p, d):
    def case(rank_coords):
        for r in range(t * p * d):
            got = rank_coords(r, t, p, d)
            if not isinstance(got, (tuple, list)) or len(got) != 3:
                raise CheckFailure(f"rank_coords({r}, t={t}, p={p}, d={d}): expected a tuple (tp, pp, dp), got {got!r}")
            expect_equal(tuple(int(x) for x in got), _coords(r, t, p, d), f"rank_coords({r}, t={t}, p={p}, d={d})")
    return case


ex81.case("t=2, p=2, d=2 (8 ranks)")(_coords_case(2, 2, 2))
ex81.case("t=4, p=2, d=1")(_coords_case(4, 2, 1))
ex81.case("t=2, p=1, d=3")(_coords_case(2, 1, 3))


@ex81.case("rank 8 of 2 x 2 x 2: ValueError")
def _(rank_coords):
    expect_raises(ValueError, rank_coords, 8, 2, 2, 2, what="rank_coords(8, t=2, p=2, d=2)")


ex81.case("t=8, p=4, d=2", hidden=True)(_coords_case(8, 4, 2))
ex81.case("t=1, p=3, d=2", hidden=True)(_coords_case(1, 3, 2))

ex82 = exercise(
    "8.2", title="the groups a rank belongs to", notebook=NOTEBOOK, points=2,
    hint="Keep two coordinates of the rank fixed and run the third over its range: the TP group varies tp "
         "(neighbouring ranks), the DP group varies dp (stride t), the PP group varies pp (stride t*d). "
         "Return the global ranks in increasing order.")


def _groups_case(t, p, d):
    def case(rank_groups):
        for r in range(t * p * d):
            got = rank_groups(r, t, p, d)
            if not isinstance(got, dict) or set(got) != {"tp", "dp", "pp"}:
                raise CheckFailure(f"rank_groups({r}, t={t}, p={p}, d={d}): expected a dict with keys 'tp', 'dp', "
                                   f"'pp', got {got!r}")
            want = _groups(r, t, p, d)
            for k in ("tp", "dp", "pp"):
                expect_equal([int(x) for x in got[k]], want[k], f"rank_groups({r}, t={t}, p={p}, d={d})[{k!r}]")
    return case


ex82.case("t=2, p=2, d=2")(_groups_case(2, 2, 2))
ex82.case("t=4, p=2, d=2 (16 ranks)")(_groups_case(4, 2, 2))
ex82.case("t=2, p=3, d=1", hidden=True)(_groups_case(2, 3, 1))
ex82.case("t=1, p=2, d=4", hidden=True)(_groups_case(1, 2, 4))


# ----------------------------------------------------------------------------- 8.3
def _states(P, t, p, d, zero, precision):
    pb, gb, ob = BYTES[precision]
    n = P / (t * p)
    return {"params": pb * n / (d if zero >= 3 else 1), "grads": gb * n / (d if zero >= 2 else 1),
            "optimizer": ob * n / (d if zero >= 1 else 1)}


ex83 = exercise(
    "8.3", title="model states of one GPU", notebook=NOTEBOOK, points=2,
    hint="One GPU holds P/(t p) parameters. Bytes per parameter: bf16 2 + 2 + 12 (weights, gradients, fp32 "
         "master weights and Adam's two moments), fp32 4 + 4 + 8. ZeRO-1 divides the optimizer state by d, "
         "ZeRO-2 also the gradients, ZeRO-3 also the parameters.")


def _states_case(P, t, p, d, zero, precision):
    def case(model_state_bytes):
        what = f"model_state_bytes(P={P:.3g}, t={t}, p={p}, d={d}, zero={zero}, precision={precision!r})"
        got = model_state_bytes(P, t, p, d, zero, precision)
        if not isinstance(got, dict) or set(got) != {"params", "grads", "optimizer"}:
            raise CheckFailure(f"{what}: expected a dict with keys 'params', 'grads', 'optimizer', got {got!r}")
        want = _states(P, t, p, d, zero, precision)
        for k in want:
            expect_close(float(got[k]), want[k], f"{what}[{k!r}] (bytes)", rtol=1e-9, atol=0)
    return case


ex83.case("GPT-3 175B, t=8 p=16 d=8, ZeRO-0, bf16")(_states_case(175e9, 8, 16, 8, 0, "bf16"))
ex83.case("t=8 p=35 d=16, ZeRO-1, bf16")(_states_case(530e9, 8, 35, 16, 1, "bf16"))
ex83.case("ZeRO-2 fp32")(_states_case(1e9, 2, 2, 4, 2, "fp32"))
ex83.case("ZeRO-3 bf16", hidden=True)(_states_case(70e9, 8, 1, 64, 3, "bf16"))
ex83.case("one GPU, fp32", hidden=True)(_states_case(1.2e8, 1, 1, 1, 0, "fp32"))

# ----------------------------------------------------------------------------- 8.4
ex84 = exercise(
    "8.4", title="activations of the first pipeline stage", notebook=NOTEBOOK, points=2,
    hint="Per layer and microbatch (16-bit, Korthikanti et al. 2022): TP sbh(10 + 24/t + 5as/(ht)); with SP "
         "everything / t: sbh(34 + 5as/h)/t; selective recompute drops the 5as/h term; full recompute keeps 2sbh "
         "(/t with SP). Under 1F1B the first stage holds min(p, M) microbatches of L/p layers.")


def _act(s, b, h, a, L, t, p, M, sp, rec):
    return min(p, M) * (L / p) * korthikanti_layer_activation_bytes(s, b, h, a, t, sp, rec)


def _act_case(s, b, h, a, L, t, p, M, sp, rec):
    def case(first_stage_activation_bytes):
        what = (f"first_stage_activation_bytes(s={s}, b={b}, h={h}, a={a}, L={L}, t={t}, p={p}, M={M}, "
                f"sequence_parallel={sp}, recompute={rec!r})")
        got = first_stage_activation_bytes(s, b, h, a, L, t, p, M, sp, rec)
        expect_close(float(got), _act(s, b, h, a, L, t, p, M, sp, rec), what + " (bytes)", rtol=1e-9, atol=0)
    return case


ex84.case("GPT-3: t=8, p=16, M=64, TP only")(_act_case(2048, 1, 12288, 96, 96, 8, 16, 64, False, "none"))
ex84.case("t=8, SP + selective recompute")(_act_case(2048, 1, 12288, 96, 96, 8, 16, 64, True, "selective"))
ex84.case("full recompute")(_act_case(2048, 1, 20480, 128, 105, 8, 35, 120, False, "full"))
ex84.case("fewer microbatches than stages: M=2 < p=4")(_act_case(1024, 2, 1024, 16, 8, 2, 4, 2, True, "none"))
ex84.case("no parallelism", hidden=True)(_act_case(512, 4, 768, 12, 12, 1, 1, 8, False, "none"))
ex84.case("SP + full", hidden=True)(_act_case(2048, 1, 8192, 64, 80, 8, 8, 32, True, "full"))

# ----------------------------------------------------------------------------- 8.5
ex85 = exercise(
    "8.5", title="choose t, p, d with Megatron's rules", notebook=NOTEBOOK, points=3,
    hint="Among the (t, p) in `memory` that fit (bytes <= gpu_memory) and divide n_gpus, with t <= gpus_per_node "
         "(rule 1), take the smallest model-parallel size t*p (rule 2); for that size prefer the largest t "
         "(TP inside the node before PP across nodes). d = n_gpus // (t*p). Raise ValueError when none fits.")


def _choose(n, g, mem, table):
    ok = [(t, p) for (t, p), need in table.items() if t <= g and n % (t * p) == 0 and need <= mem]
    if not ok:
        return None
    t, p = min(ok, key=lambda tp: (tp[0] * tp[1], -tp[0]))
    return t, p, n // (t * p)


def _table(model: str, n: int, g: int, recompute: str = "selective"):
    """(t, p) -> bytes of the most loaded GPU, from the planner (SP on with t > 1, ZeRO-1, bf16)."""
    from ...plan.memory import memory_per_rank
    from ...plan.spec import Layout, preset
    spec = preset(model)
    out = {}
    for t in (1, 2, 4, 8, 16):
        for p in (1, 2, 4, 8, 16, 32):
            if n % (t * p) or spec.n_layer % p or spec.n_head % t:
                continue
            d = n // (t * p)
            if spec.global_batch % d:
                continue
            lay = Layout(t=t, p=p, d=d, zero=1, sequence_parallel=t > 1, recompute=recompute)
            try:
                out[(t, p)] = max(r.total for r in memory_per_rank(spec, lay))
            except ValueError:          # e.g. t does not divide the key/value heads
                continue
    return out


def _choose_case(model, n, g, gb, recompute="selective"):
    def case(choose_layout):
        table = _table(model, n, g, recompute)
        mem = gb * 1e9
        what = f"choose_layout(n_gpus={n}, gpus_per_node={g}, gpu_memory={gb:g} GB, memory of {model})"
        want = _choose(n, g, mem, table)
        if want is None:
            expect_raises(ValueError, choose_layout, n, g, mem, dict(table), what=what + " (nothing fits)")
            return
        got = choose_layout(n, g, mem, dict(table))
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise CheckFailure(f"{what}: expected a tuple (t, p, d), got {got!r}")
        got = tuple(int(x) for x in got)
        if got != want:
            why = ""
            if got in [(t, p, n // (t * p)) for (t, p) in table] and table.get(got[:2], 0) > mem:
                why = f" ({got} needs {table[got[:2]] / 1e9:.1f} GB > {gb:g} GB)"
            elif got[0] > g:
                why = f" (t={got[0]} > {g} GPUs per node breaks rule 1)"
            elif got[0] * got[1] > want[0] * want[1]:
                why = f" (t*p={got[0] * got[1]} is larger than needed: rule 2)"
            raise CheckFailure(f"{what}: expected {want}, got {got}{why}")
    return case


ex85.case("GPT-3 175B on 1024 GPUs of 80 GB")(_choose_case("gpt3-175b", 1024, 8, 80))
ex85.case("GPT-3 175B on 1024 GPUs of 40 GB")(_choose_case("gpt3-175b", 1024, 8, 40))
ex85.case("Llama-3 70B on 256 GPUs of 80 GB")(_choose_case("llama3-70b", 256, 8, 80))
ex85.case("nothing fits: GPT-3 on 8 GPUs: ValueError")(_choose_case("gpt3-175b", 8, 8, 80))
ex85.case("Megatron 8.3B on 512 GPUs of 16 GB", hidden=True)(_choose_case("megatron-8.3b", 512, 8, 16))
ex85.case("Llama-3 70B on 512 GPUs of 40 GB, 4 per node, full recompute",
          hidden=True)(_choose_case("llama3-70b", 512, 4, 40, "full"))

# ----------------------------------------------------------------------------- 8.6
ex86 = exercise(
    "8.6", title="bytes each axis sends per step", notebook=NOTEBOOK, points=3,
    hint="Ring bytes sent by one GPU of a middle pipeline stage (p >= 3; no embedding or output layer), e bytes per "
         "value: TP 4 all-reduces (2 forward, 2 backward) of s*b*h per layer, L/p layers, M microbatches, each "
         "2(t-1)/t of the payload; PP one send of s*b*h forward and one backward per microbatch; DP one "
         "all-reduce of the GPU's gradients (n_params values): 2(d-1)/d of it.")


def _axis(s, b, h, L, t, p, d, M, n_params, e):
    act = s * b * h * e
    return {"tp": 4 * (L // p) * M * 2 * (t - 1) * act / t, "pp": 2 * M * act, "dp": 2 * (d - 1) * n_params * e / d}


def _axis_case(s, b, h, L, t, p, d, M, n_params, e):
    def case(axis_bytes):
        what = f"axis_bytes(s={s}, b={b}, h={h}, L={L}, t={t}, p={p}, d={d}, M={M}, n_params={n_params:.3g}, e={e})"
        got = axis_bytes(s, b, h, L, t, p, d, M, n_params, e)
        if not isinstance(got, dict) or set(got) != {"tp", "pp", "dp"}:
            raise CheckFailure(f"{what}: expected a dict with keys 'tp', 'pp', 'dp', got {got!r}")
        want = _axis(s, b, h, L, t, p, d, M, n_params, e)
        for k in want:
            expect_close(float(got[k]), want[k], f"{what}[{k!r}] (bytes)", rtol=1e-9, atol=0)
    return case


ex86.case("GPT-3 middle stage: t=8, p=16, d=8, M=192")(_axis_case(2048, 1, 12288, 96, 8, 16, 8, 192, 1.37e9, 2))
ex86.case("t=2, p=4, d=4, fp32")(_axis_case(512, 4, 1024, 16, 2, 4, 4, 8, 5.0e7, 4))
ex86.case("no TP, no DP: only the pipeline talks")(_axis_case(1024, 2, 2048, 24, 1, 8, 1, 16, 3.0e8, 2))
ex86.case("t=4, p=8, d=2", hidden=True)(_axis_case(4096, 1, 8192, 80, 4, 8, 2, 64, 2.2e9, 2))
ex86.case("p=4, d=16", hidden=True)(_axis_case(2048, 2, 4096, 32, 1, 4, 16, 32, 1.6e9, 2))


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case  # noqa: E402


def _draw_grid(r):
    return r.choice((1, 2, 4, 8)), r.randint(1, 4), r.randint(1, 4)


def _draw_states(r):
    return (r.randint(1, 2000) * 1e8, r.choice((1, 2, 4, 8)), r.randint(1, 16), r.randint(1, 64), r.randint(0, 3),
            r.choice(("bf16", "fp32")))


def _draw_act(r):
    t, p = r.choice((1, 2, 4, 8)), r.randint(1, 8)
    a = t * r.randint(1, 12)
    return (r.choice((512, 1024, 2048, 4096)), r.randint(1, 4), a * r.choice((64, 128)), a, p * r.randint(1, 12),
            t, p, r.randint(1, 64), r.random() < 0.5, r.choice(("none", "selective", "full")))


def _draw_axis(r):
    p = r.randint(3, 8)
    return (r.choice((512, 1024, 2048, 4096)), r.randint(1, 4), 128 * r.randint(4, 96), p * r.randint(1, 12),
            r.choice((1, 2, 4, 8)), p, r.randint(1, 32), r.randint(1, 256), r.randint(1, 100) * 1e8, r.choice((2, 4)))


fresh_case(ex81, "random t, p, d", _draw_grid, _coords_case)
fresh_case(ex82, "random t, p, d", _draw_grid, _groups_case)
fresh_case(ex83, "random P, layout, ZeRO stage, precision", _draw_states, _states_case)
fresh_case(ex84, "random model, layout, SP and recompute", _draw_act, _act_case)
fresh_case(ex86, "random model and layout", _draw_axis, _axis_case)
