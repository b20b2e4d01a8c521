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
from ..registry import (
    CheckFailure,
    _shown,
    as_int,
    exercise,
    expect_close,
    expect_equal,
    expect_named,
    expect_raises,
    type_name,
)

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
    hint=("Section 1 (the grid): ranks are numbered TP innermost, then DP, then PP outermost, so neighbouring ranks "
          "differ in tp. How many ranks does one step in dp skip, and one step in pp?"))
ex81.hint2 = ("Write the 8 ranks of t=2, p=2, d=2 as a table, tp changing fastest: in which rows does dp change, and "
              "in which pp? Mind the return order (tp, pp, dp) and the ValueError for a rank outside the grid.")
ex81.hint_review = ("leads: asks for the stride of each axis; the modular arithmetic is the learner's; reviewed "
                    "2026-12-06")


_AXES = ("tp", "pp", "dp")


def _coords_in_order(rank, t, p, d, order):
    """(tp, pp, dp) when the grid's axes are laid out in ``order``, innermost first (e.g. "tp", "dp", "pp")."""
    size = {"tp": t, "pp": p, "dp": d}
    out, stride = {}, 1
    for axis in order:
        out[axis] = (rank // stride) % size[axis]
        stride *= size[axis]
    return tuple(out[a] for a in _AXES)


def _explain_coords(got_all, t, p, d):
    """Why the learner's coordinates (one tuple per rank) are wrong: a reordered tuple, another axis order,
    or the first wrong coordinate by name."""
    import itertools

    n = t * p * d
    want_all = [_coords(r, t, p, d) for r in range(n)]
    found = []
    for perm in itertools.permutations(range(3)):
        if perm != (0, 1, 2) and all(tuple(g[i] for i in perm) == w for g, w in zip(got_all, want_all)):
            names = ", ".join(_AXES[perm.index(j)] for j in range(3))
            found.append(f"the right coordinates in the wrong order (your tuple reads ({names}); return "
                         "(tp, pp, dp))")
            break
    for order in itertools.permutations(_AXES):
        if order != ("tp", "dp", "pp") and all(g == _coords_in_order(r, t, p, d, order)
                                               for r, g in enumerate(got_all)):
            found.append(f"the coordinates of a grid ordered {order[0].upper()} innermost, then "
                         f"{order[1].upper()}, {order[2].upper()} outermost, not the grid of this notebook (which "
                         "axis talks in every layer, and which only once per microbatch?)")
            break
    if found:
        return "these are " + " or ".join(found) + (" (on this grid both look the same)" if len(found) > 1 else "")
    r = next(r for r in range(n) if got_all[r] != want_all[r])
    axis = next(i for i in range(3) if got_all[r][i] != want_all[r][i])
    return (f"rank_coords({r}, t={t}, p={p}, d={d}): coordinate {_AXES[axis]} (item {axis} of (tp, pp, dp)): "
            f"expected {want_all[r][axis]}, got {got_all[r][axis]}{_malformed_order(got_all, axis, t, p, d)}")


def _malformed_order(got_all, axis, t, p, d):
    """What a wrong coordinate does (issue 36): the rank stride at which it changes, when that is another axis's
    stride on this grid or a stride of no grid order, and whether two ranks now share coordinates."""
    size = {"tp": t, "pp": p, "dp": d}
    right = {"tp": 1, "dp": t, "pp": t * d}
    name, n = _AXES[axis], t * p * d
    col = [g[axis] for g in got_all]
    out = ""
    import itertools

    # the strides name's coordinate has in some ordering of the axes (1, or the sizes of the axes inside it)
    orders = {}
    for order in itertools.permutations(_AXES):
        stride = 1
        for a in order[:order.index(name)]:
            stride *= size[a]
        orders.setdefault(stride, order)
    for stride in sorted({1, t, p, d, t * p, t * d, p * d, n}):
        if stride != right[name] and all(c == (r // stride) % size[name] for r, c in enumerate(col)):
            other = [a for a in ("tp", "dp", "pp") if a != name and right[a] == stride and size[a] > 1]
            if other:
                like = f", as {other[0]} does on this grid: two axes stepping together is no ordering of the axes"
            elif stride in orders:
                like = (f", as in a grid ordered {', '.join(orders[stride]).upper()} (innermost first), while your "
                        "other coordinates follow another order")
            else:
                like = (f": no ordering of the axes gives {name} that stride (a step in an axis skips the ranks of "
                        "the axes inside it: 1, or the product of their sizes)")
            out = f"; your {name} changes every {stride} rank{'s' if stride > 1 else ''}{like}"
            break
    seen = {}
    for r, g in enumerate(got_all):
        if g in seen:
            return out + f"; ranks {seen[g]} and {r} both get {g}: each rank needs its own place in the grid"
        seen[g] = r
    return out


def _coords_case(t, p, d):
    def case(rank_coords):
        got_all = []
        for r in range(t * p * d):
            got = rank_coords(r, t, p, d)
            if not isinstance(got, (tuple, list)) or len(got) != 3:
                raise CheckFailure(f"rank_coords({r}, t={t}, p={p}, d={d}): expected a tuple (tp, pp, dp), "
                                   f"got {_shown(got)}")
            bad = [x for x in got if as_int(x) is None]
            if bad:  # int() would truncate 1.5 to a right-looking 1
                raise CheckFailure(f"rank_coords({r}, t={t}, p={p}, d={d}): coordinates are ints, got "
                                   f"{type_name(bad[0])}")
            got_all.append(tuple(as_int(x) for x in got))
        if any(g != _coords(r, t, p, d) for r, g in enumerate(got_all)):
            raise CheckFailure(f"t={t}, p={p}, d={d}: {_explain_coords(got_all, t, p, d)}")
    return case


ex81.case("t=2, p=3, d=2 (12 ranks: p and d differ)")(_coords_case(2, 3, 2))
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
    hint=("Section 1: a rank's group along one axis is the ranks that differ from it only in that axis's coordinate. "
          "Which global ranks are those, in increasing order?"))
ex82.hint2 = ("Which coordinates stay fixed within one group, and how do you get from a triple of coordinates back to "
              "a global rank (the inverse of 8.1)?")
ex82.hint_review = ("leads: defines the group and asks for the inverse of 8.1; no enumeration is spelled out; "
                    "reviewed 2026-12-06")


def _groups_case(t, p, d):
    def case(rank_groups):
        for r in range(t * p * d):
            got = rank_groups(r, t, p, d)
            if not isinstance(got, dict) or set(got) != {"tp", "dp", "pp"}:
                raise CheckFailure(f"rank_groups({r}, t={t}, p={p}, d={d}): expected a dict with keys 'tp', 'dp', "
                                   f"'pp', got {_shown(got)}")
            want = _groups(r, t, p, d)
            for k in ("tp", "dp", "pp"):
                what = f"rank_groups({r}, t={t}, p={p}, d={d})[{k!r}]"
                members = got[k]
                if not isinstance(members, (list, tuple, range)) or any(as_int(x) is None for x in members):
                    raise CheckFailure(f"{what}: expected a list of ints (global ranks), got {_shown(members)}")
                members = [as_int(x) for x in members]
                if members != want[k]:
                    why = _group_mistake(r, k, members, want[k], t, p, d)
                    if why:
                        raise CheckFailure(f"{what}: expected {want[k]}, got {members} ({why})")
                expect_equal(members, want[k], what)
    return case


def _group_mistake(rank, axis, got, want, t, p, d) -> str:
    """Which coordinates the members of a wrong group differ in (issue 36: the two stride mistakes gave one
    line): a group along ``axis`` keeps the other two coordinates of ``rank`` fixed."""
    n = t * p * d
    if any(not 0 <= g < n for g in got):
        return f"ranks outside 0..{n - 1}"
    if rank not in got:
        return f"rank {rank} itself is not in its own group"
    if sorted(got) == want:
        return "the right ranks, not in increasing order"
    names = ("tp", "pp", "dp")
    mine = _coords(rank, t, p, d)
    varied = sorted({names[i] for g in got for i, c in enumerate(_coords(g, t, p, d)) if c != mine[i]})
    wrong = [v for v in varied if v != axis]
    size = {"tp": t, "pp": p, "dp": d}[axis]
    if wrong:
        return (f"these ranks differ from rank {rank} in {' and '.join(wrong)}: a {axis.upper()} group's ranks "
                f"share every coordinate but {axis}")
    if len(got) != size:
        return f"{len(got)} ranks: a {axis.upper()} group has one rank per value of {axis}, {size} of them"
    return ""


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
    hint=("Section 3 (ZeRO sec. 3.1): one GPU holds the share of the P parameters that TP and PP leave it. Which of "
          "the three kinds of state does each ZeRO stage divide over d?"))
ex83.hint2 = ("Make a table: one row per kind of state with its bytes per parameter in each precision (what does "
              "mixed precision keep in fp32?), one column per ZeRO stage.")
ex83.hint_review = ("leads: asks which state each stage shards and suggests a table; the bytes come from the section; "
                    "reviewed 2026-12-06")


def _states_case(P, t, p, d, zero, precision):
    def case(model_state_bytes):
        what = f"model_state_bytes(P={P:.3g}, t={t}, p={p}, d={d}, zero={zero}, precision={precision!r})"
        got = model_state_bytes(P, t, p, d, zero, precision)
        if not isinstance(got, dict) or set(got) != {"params", "grads", "optimizer"}:
            raise CheckFailure(f"{what}: expected a dict with keys 'params', 'grads', 'optimizer', got {_shown(got)}")
        want = _states(P, t, p, d, zero, precision)
        for k in want:
            value = float(got[k])
            mistakes = [(want[k] * p, "not divided by p: a pipeline stage holds 1/p of the layers"),
                        (want[k] * t, "not divided by t: a tensor-parallel rank holds 1/t of each layer"),
                        (want[k] * t * p, "the whole model's: t and p each split it")]
            for z in range(4):
                if z != zero:
                    mistakes.append((_states(P, t, p, d, z, precision)[k], f"that is ZeRO-{z}'s {k}"))
            expect_named(value, want[k], f"{what}[{k!r}] (bytes)", mistakes)
    return case


ex83.case("GPT-3 175B, t=8 p=16 d=8, ZeRO-0, bf16")(_states_case(175e9, 8, 16, 8, 0, "bf16"))
ex83.case("t=8 p=35 d=16, ZeRO-1, bf16")(_states_case(530e9, 8, 35, 16, 1, "bf16"))
ex83.case("ZeRO-2 fp32")(_states_case(1e9, 2, 2, 4, 2, "fp32"))
ex83.case("ZeRO-3 bf16", hidden=True)(_states_case(70e9, 8, 1, 64, 3, "bf16"))
ex83.case("one GPU, fp32", hidden=True)(_states_case(1.2e8, 1, 1, 1, 0, "fp32"))

# ----------------------------------------------------------------------------- 8.4
ex84 = exercise(
    "8.4", title="activations of the first pipeline stage", notebook=NOTEBOOK, points=2,
    hint=("Section 3 (Korthikanti et al. 2022, Table 2): which row of the table is the case at hand? Then: how many "
          "layers does the first stage hold, and how many microbatches does it keep alive under 1F1B?"))
ex84.hint2 = ("Check the case with fewer microbatches than stages, and check which terms sequence parallelism divides "
              "by t that TP alone leaves whole.")
ex84.hint_review = ("leads: asks which table row applies and how many layers and microbatches the first stage holds; "
                    "the cases are the learner's to code; reviewed 2026-12-06")


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
ex84.case("t=8, TP only (no SP), selective recompute")(
    _act_case(2048, 1, 12288, 96, 96, 8, 16, 64, False, "selective"))
ex84.case("full recompute")(_act_case(2048, 1, 20480, 128, 105, 8, 35, 120, False, "full"))
# the table's last row (full recompute with SP: the stored layer input is split by t too) had only a hidden case;
# an answer that leaves it whole under SP passed every public one
ex84.case("t=8, SP + full recompute")(_act_case(2048, 1, 12288, 96, 96, 8, 16, 64, True, "full"))
ex84.case("fewer microbatches than stages: M=2 < p=4")(_act_case(1024, 2, 1024, 16, 8, 2, 4, 2, True, "none"))
ex84.case("no parallelism", hidden=True)(_act_case(512, 4, 768, 12, 12, 1, 1, 8, False, "none"))
ex84.case("SP + full", hidden=True)(_act_case(2048, 1, 8192, 64, 80, 8, 8, 32, True, "full"))

# ----------------------------------------------------------------------------- 8.5
ex85 = exercise(
    "8.5", title="choose t, p, d with Megatron's rules", notebook=NOTEBOOK, points=3,
    hint=("Section 4 (Megatron's rules): which (t, p) in the table are allowed at all by rule 1, by the memory and by "
          "the number of GPUs? Among the allowed ones, which does rule 2 prefer, and which wins a tie?"))
ex85.hint2 = ("Cross out, one rule at a time, each (t, p) that breaks a rule, and compare what is left by "
              "model-parallel size. What should happen when nothing is left?")
ex85.hint_review = ("leads: turns the rules of section 4 into questions; the filter and the ordering are the "
                    "learner's; reviewed 2026-12-06")


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


# A hand-made memory table (GB) for 12 GPUs, 4 per node: (4, 2) fits in 20 GB with t*p = 8 < 12, but 8
# GPUs per model copy cannot tile 12 GPUs; only (4, 3) both fits and divides.
_NON_DIVIDING = {(1, 1): 160e9, (2, 1): 85e9, (4, 1): 45e9, (2, 2): 45e9, (1, 4): 46e9, (2, 3): 30e9,
                 (4, 2): 18e9, (2, 4): 19e9, (4, 3): 14e9, (2, 6): 15e9}


def _literal_choose_case(n, g, gb, table):
    def case(choose_layout):
        _judge_choice(choose_layout, n, g, gb, dict(table),
                      f"choose_layout(n_gpus={n}, gpus_per_node={g}, gpu_memory={gb:g} GB, memory={{...}})")
    return case


def _choose_case(model, n, g, gb, recompute="selective"):
    def case(choose_layout):
        _judge_choice(choose_layout, n, g, gb, _table(model, n, g, recompute),
                      f"choose_layout(n_gpus={n}, gpus_per_node={g}, gpu_memory={gb:g} GB, memory of {model})")
    return case


def _judge_choice(choose_layout, n, g, gb, table, what):
    """Run the learner's choice on ``table`` ((t, p) -> bytes) and name the rule a wrong choice breaks."""
    mem = gb * 1e9
    want = _choose(n, g, mem, table)
    if want is None:
        expect_raises(ValueError, choose_layout, n, g, mem, dict(table), what=what + " (nothing fits)")
        return
    got = choose_layout(n, g, mem, dict(table))
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        raise CheckFailure(f"{what}: expected a tuple (t, p, d), got {_shown(got)}")
    if any(as_int(x) is None for x in got):  # int() would truncate a float to a right-looking degree
        raise CheckFailure(f"{what}: t, p and d are ints, got {type_name(next(x for x in got if as_int(x) is None))}")
    got = tuple(as_int(x) for x in got)
    if got == want:
        return
    t, p, d = got
    why = ""
    if (t, p) in table and table[(t, p)] > mem:
        why = f" ({got} needs {table[(t, p)] / 1e9:.1f} GB > {gb:g} GB: it does not fit)"
    elif t > g:
        why = f" (t={t} > {g} GPUs per node breaks rule 1: TP stays inside a node)"
    elif t * p > 0 and n % (t * p):
        why = (f" (t*p={t * p} does not divide {n} GPUs: the GPUs must split into d whole copies of the model, "
               f"and {n}/{t * p} is not a whole number)")
    elif t * p * d != n:
        why = f" (t*p*d = {t * p * d}, not the {n} GPUs there are)"
    elif t * p > want[0] * want[1]:
        why = f" (t*p={t * p} is larger than needed: rule 2)"
    elif t * p == want[0] * want[1] and t < want[0]:
        why = f" (same model-parallel size t*p={t * p}, but a smaller t: for that size TP goes before PP)"
    raise CheckFailure(f"{what}: expected {want}, got {got}{why}")


ex85.case("GPT-3 175B on 1024 GPUs of 80 GB")(_choose_case("gpt3-175b", 1024, 8, 80))
ex85.case("GPT-3 175B on 1024 GPUs of 40 GB")(_choose_case("gpt3-175b", 1024, 8, 40))
ex85.case("Llama-3 70B on 256 GPUs of 80 GB")(_choose_case("llama3-70b", 256, 8, 80))
ex85.case("a table that also lists (t, p) whose t*p does not divide 12 GPUs")(
    _literal_choose_case(12, 4, 20, _NON_DIVIDING))
ex85.case("nothing fits: GPT-3 on 8 GPUs: ValueError")(_choose_case("gpt3-175b", 8, 8, 80))
ex85.case("Megatron 8.3B on 512 GPUs of 16 GB", hidden=True)(_choose_case("megatron-8.3b", 512, 8, 16))
ex85.case("Llama-3 70B on 512 GPUs of 40 GB, 4 per node, full recompute",
          hidden=True)(_choose_case("llama3-70b", 512, 4, 40, "full"))

# ----------------------------------------------------------------------------- 8.6
ex86 = exercise(
    "8.6", title="bytes each axis sends per step", notebook=NOTEBOOK, points=3,
    hint=("Section 2 (the table of what each axis communicates): for each axis, how many collectives or sends does "
          "one GPU take part in per step, and how many bytes does each send from this GPU in a ring (notebook 00, "
          "section 5)?"))
ex86.hint2 = ("Check each axis on its own with small numbers: take M = 1 and one layer on this stage, then double one "
              "of them. Does each axis's count grow as the 'how often' column of section 2 says? Is the payload in "
              "values or in bytes?")
ex86.hint_review = ("leads: points at the section 2 table and the ring's cost and suggests a scaling check; no count "
                    "per axis is given; reviewed 2026-12-06")


def _axis(s, b, h, L, t, p, d, M, n_params, e):
    act = s * b * h * e
    return {"tp": 4 * (L // p) * M * 2 * (t - 1) * act / t, "pp": 2 * M * act, "dp": 2 * (d - 1) * n_params * e / d}


def _axis_case(s, b, h, L, t, p, d, M, n_params, e):
    def case(axis_bytes):
        what = f"axis_bytes(s={s}, b={b}, h={h}, L={L}, t={t}, p={p}, d={d}, M={M}, n_params={n_params:.3g}, e={e})"
        got = axis_bytes(s, b, h, L, t, p, d, M, n_params, e)
        if not isinstance(got, dict) or set(got) != {"tp", "pp", "dp"}:
            raise CheckFailure(f"{what}: expected a dict with keys 'tp', 'pp', 'dp', got {_shown(got)}")
        want = _axis(s, b, h, L, t, p, d, M, n_params, e)
        named = {"tp": [(want["tp"] * p, "all L layers: this stage holds L/p of them"),
                        (want["tp"] / 2, "forward only: backward all-reduces as often"),
                        (want["tp"] * t / (t - 1) if t > 1 else -1.0, "the whole payload per all-reduce: a ring sends "
                                                                       "2 (t-1)/t of it")],
                 "pp": [(want["pp"] / 2, "forward only: the gradients come back across the boundary in backward"),
                        (want["pp"] / M, "one microbatch: all M cross the boundary")],
                 "dp": [(want["dp"] * d / (d - 1) if d > 1 else -1.0, "the whole gradient: a ring all-reduce sends "
                                                                      "2 (d-1)/d of it"),
                        (want["dp"] * M, "an all-reduce per microbatch: the gradients are reduced once per step")]}
        for k in want:
            expect_named(float(got[k]), want[k], f"{what}[{k!r}] (bytes)", named[k])
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

_FRESH_MODELS = ("megatron-8.3b", "gpt3-175b", "mt-nlg-530b", "llama3-70b", "llama3-405b", "bloom-176b",
                 "korthikanti-22b", "korthikanti-175b", "mixtral-8x7b")


def _fresh_choice_case(kind, *args):
    """8.5's fresh draws: the planner's table of a random model and cluster, or a random literal table."""
    return (_choose_case if kind == "model" else _literal_choose_case)(*args)


def _draw_choice(r):
    g = r.choice((2, 4, 8))
    if r.random() < 0.5:
        return ("model", r.choice(_FRESH_MODELS), 2 ** r.randint(3, 12), g, r.choice((16, 24, 40, 80, 96, 141)),
                r.choice(("selective", "full")))
    n = r.choice((4, 6, 8, 12, 16, 24, 32, 48, 64))
    pairs = [(t, p) for t in (1, 2, 4, 8) for p in (1, 2, 3, 4, 6, 8) if r.random() < 0.7]
    table = {tp: r.randint(1, 200) * 1e9 for tp in pairs}
    return "literal", n, g, r.randint(5, 160), table


fresh_case(ex85, "random model, cluster and memory tables", _draw_choice, _fresh_choice_case)
