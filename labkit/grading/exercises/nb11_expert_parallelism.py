"""Exercises of notebook 11_expert_parallelism: the all-to-all splits and their bytes.

P ranks, rank p holds experts p*E/P .. (p+1)*E/P - 1 (GShard, Lepikhin et al. 2020, sec. 3;
Switch, Fedus et al. 2021, sec. 2.2). Each rank routes its own tokens.

* 11.1 the split sizes of the dispatch all-to-all: ``input_split_sizes[q]`` = slots this rank
  sends to rank q, ``output_split_sizes[s]`` = slots rank s sends to this rank.
* 11.2 the bytes one rank sends in the three all-to-alls of an MoE layer's forward pass
  (counts, dispatch, combine), checked against :class:`labkit.comm.CommLog` on 4 real ranks
  running :class:`labkit.moe.expert_parallel.ExpertParallelMoE`.
"""
from __future__ import annotations

import torch

from ...comm import CommLog
from ...dist import launch
from ...moe.expert_parallel import ExpertParallelMoE, all_to_all_uneven
from ...moe.experts import MoEConfig, MoELayer
from ..registry import CheckFailure, _shown, as_int, exercise, expect_equal, type_name


def _true_splits(indices_per_rank, experts_per_rank):
    P = len(indices_per_rank)
    send = [[int(((idx // experts_per_rank) == q).sum()) for q in range(P)] for idx in indices_per_rank]
    return [(send[p], [send[s][p] for s in range(P)]) for p in range(P)]


def _random_routing(P, T, E, k, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(P):
        if skew:   # most tokens want the first experts: some (rank, rank) pairs exchange nothing
            logits = torch.randn(T, E, generator=g) - torch.arange(E).float() * 3
        else:
            logits = torch.randn(T, E, generator=g)
        out.append(logits.topk(k, dim=-1).indices)
    return out


def _as_int_list(x, what: str, P: int) -> list:
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if not isinstance(x, (list, tuple)) or len(x) != P:
        raise CheckFailure(f"{what}: expected a list of {P} ints (one per rank), got {_shown(x)}")
    bad = [v for v in x if as_int(v) is None]
    if bad:
        raise CheckFailure(f"{what}: expected ints, got {type_name(bad[0])} among them")
    return [as_int(v) for v in x]


def _get_splits(dispatch_splits, indices_per_rank, experts_per_rank):
    P = len(indices_per_rank)
    got = dispatch_splits([i.clone() for i in indices_per_rank], experts_per_rank)
    if not isinstance(got, (list, tuple)) or len(got) != P:
        raise CheckFailure(f"dispatch_splits: expected a list of {P} pairs (one per rank), got {type(got).__name__}"
                           f" of length {len(got) if hasattr(got, '__len__') else '?'}")
    out = []
    for p, pair in enumerate(got):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise CheckFailure(f"dispatch_splits: entry {p} must be a pair (input_split_sizes, output_split_sizes)")
        out.append((_as_int_list(pair[0], f"rank {p} input_split_sizes", P),
                    _as_int_list(pair[1], f"rank {p} output_split_sizes", P)))
    return out


def _splits_case(indices_per_rank, experts_per_rank, label):
    def case(dispatch_splits):
        got = _get_splits(dispatch_splits, indices_per_rank, experts_per_rank)
        want = _true_splits(indices_per_rank, experts_per_rank)
        for p, ((gi, go), (wi, wo)) in enumerate(zip(got, want)):
            expect_equal(gi, wi, f"{label}, rank {p}: input_split_sizes (slots it SENDS to ranks 0..P-1)")
            expect_equal(go, wo, f"{label}, rank {p}: output_split_sizes (slots it RECEIVES from ranks 0..P-1)")
    return case


def _a2a_worker(ctx, indices_per_rank, experts_per_rank, splits, H):
    """Each rank sends one row per slot (the row holds its source rank and expert) with the
    learner's splits through the validated uneven all-to-all; returns what arrived."""
    idx = indices_per_rank[ctx.rank].reshape(-1)
    order = torch.argsort(idx, stable=True)
    rows = torch.zeros(len(idx), H)
    rows[:, 0], rows[:, 1] = float(ctx.rank), idx[order].float()
    send, recv = splits[ctx.rank]
    got = all_to_all_uneven(rows, send, recv, ctx.group)
    return got[:, 1].long()


ex111 = exercise(
    "11.1", title="all-to-all split sizes", notebook="11_expert_parallelism", points=3,
    hint=("Section 1: a slot goes to the rank that holds its expert. Which rank holds expert e? A rank's input splits "
          "count what it sends to each rank, its output splits what it receives from each: whose input splits hold "
          "the numbers of its output splits?"))
ex111.hint2 = ("Check the invariant on your result: for every pair of ranks, what p receives from s must equal what s "
               "sends to p. Does it hold?")
ex111.hint_review = ("leads: asks which rank holds an expert and states the send/receive invariant; the table is the "
                     "learner's; reviewed 2026-12-06")

ex111.case("P=2 ranks, 2 experts each, 3 tokens, k=1")(
    _splits_case([torch.tensor([[0], [3], [1]]), torch.tensor([[2], [2], [0]])], 2, "P=2, E=4, k=1"))
ex111.case("P=4 ranks, 1 expert each, k=2 (some splits are 0)")(
    _splits_case([torch.tensor([[0, 1], [0, 2]]), torch.tensor([[1, 0], [1, 0]]),
                  torch.tensor([[0, 1], [2, 1]]), torch.tensor([[0, 2], [1, 0]])], 1, "P=4, E=4, k=2"))
ex111.case("random routing P=4, E=8, k=2, 6 tokens per rank", hidden=True)(
    _splits_case(_random_routing(4, 6, 8, 2, 111), 2, "P=4, E=8, k=2"))
ex111.case("skewed routing P=3, E=6, k=2", hidden=True)(
    _splits_case(_random_routing(3, 5, 6, 2, 112, skew=True), 2, "P=3, E=6, k=2, skewed"))


@ex111.case("the splits drive a real all-to-all on 4 gloo ranks", timeout=20)
def _(dispatch_splits):
    indices, epr = _random_routing(4, 5, 8, 2, 113, skew=True), 2
    splits = _get_splits(dispatch_splits, indices, epr)
    arrived = launch(_a2a_worker, 4, indices, epr, splits, 4, timeout=10)
    for p, experts in enumerate(arrived):
        wrong = [int(e) for e in experts if int(e) // epr != p]
        if wrong:
            raise CheckFailure(f"rank {p} holds experts {p * epr}..{p * epr + epr - 1} but received slots for "
                               f"experts {sorted(set(wrong))}")


# ----------------------------------------------------------------------------- 11.2
ex112 = exercise(
    "11.2", title="bytes of the three all-to-alls", notebook="11_expert_parallelism", points=3,
    hint=("Section 3: what does this rank's input tensor hold in each of the three forward all-to-alls, and how many "
          "bytes is one of its elements? Rows a rank sends to itself count too."))
ex112.hint2 = ("For each of them ask: which of the split lists describes the rows this rank sends (not the ones it "
               "receives), and how many values is one row?")
ex112.hint_review = ("leads: asks what each all-to-all's input holds and which split list describes it; no product is "
                     "given; reviewed 2026-12-06")

_EP_CFG = dict(n_embd=8, n_routed_experts=8, n_activated_experts=2, moe_ffn_dim=8, capacity_factor=1.0)


def _ep_bytes_worker(ctx, cfg, T, seed=5):
    torch.manual_seed(seed - 5)
    dense = MoELayer(cfg)
    layer = ExpertParallelMoE.from_dense(dense, ctx.group, ctx.rank, ctx.world_size)
    x = torch.randn(ctx.world_size * T, cfg.n_embd, generator=torch.Generator().manual_seed(seed))
    with CommLog() as log:
        _, stats = layer(x[ctx.rank * T:(ctx.rank + 1) * T])
    r = stats.router
    kept = r.indices[r.keep]
    El = cfg.n_routed_experts // ctx.world_size
    send = [int(((kept // El) == q).sum()) for q in range(ctx.world_size)]
    return {"send": send, "bytes": [rec.nbytes for rec in log.of("all_to_all")]}


def _bytes_mistake(a2a_bytes, key, got, measured, send, recv, cfg) -> str:
    """The mistake behind a wrong byte count, when it is one of the known ones (issue 36: counts as one
    int64 per rank and counts as int32 gave one line). When two explanations give the same number here
    (8 P = 4 E), ``a2a_bytes`` is asked once more with twice the experts, where they differ."""
    E, H, P = cfg.n_routed_experts, cfg.n_embd, len(send)
    want = measured[key]
    if got == want:
        return ""
    if key == "counts":
        per_rank, int32 = got == 8 * P, got == 4 * E
        if per_rank and int32:
            again = a2a_bytes(list(send), list(recv), 2 * E, H)
            again = as_int(again.get("counts")) if isinstance(again, dict) else None
            per_rank, int32 = again == 8 * P, again == 8 * E
        if int32 and not per_rank:
            return "the counts were taken as 4-byte ints: the counts tensor is int64"
        if per_rank and not int32:
            return "one count per rank: the counts all-to-all carries one count per expert"
        if got == 8 * E * P:
            return "the counts of all P ranks: this rank sends one count per expert, once"
        return ""
    rows = sum(send) if key == "dispatch" else sum(recv)
    other = sum(recv) if key == "dispatch" else sum(send)
    if got == rows * H:
        return "a number of values, not bytes: each value is elem_bytes bytes"
    if got == rows * H * 2:
        return "2 bytes per value: these activations are fp32 here"
    if got == rows:
        return "a number of rows: each row is hidden values of elem_bytes bytes"
    if other != rows and got == other * H * 4:
        return ("the rows this rank dispatched: the combine returns the rows its experts computed, which it "
                "received" if key == "combine" else
                "the rows this rank received: the dispatch sends the rows this rank's tokens route elsewhere")
    return ""


def _bytes_case(T, cfg_kw, P=4, seed=5):
    def case(a2a_bytes):
        cfg = MoEConfig(**cfg_kw)
        res = launch(_ep_bytes_worker, P, cfg, T, seed, timeout=10)
        for p in range(P):
            send = res[p]["send"]
            recv = [res[s]["send"][p] for s in range(P)]
            got = a2a_bytes(send, recv, cfg.n_routed_experts, cfg.n_embd)
            if not isinstance(got, dict) or set(got) != {"counts", "dispatch", "combine"}:
                raise CheckFailure("a2a_bytes must return a dict with keys 'counts', 'dispatch', 'combine', got "
                                   f"{_shown(got)}")
            measured = dict(zip(("counts", "dispatch", "combine"), res[p]["bytes"]))
            for key in ("counts", "dispatch", "combine"):
                value = got[key]
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                if as_int(value) is None:
                    raise CheckFailure(f"rank {p} of {P}: {key} bytes must be a whole number, got {type_name(value)}")
                why = _bytes_mistake(a2a_bytes, key, as_int(value), measured, send, recv, cfg)
                if why:
                    raise CheckFailure(f"rank {p} of {P} (sends {send}, receives {recv}; E={cfg.n_routed_experts}, "
                                       f"H={cfg.n_embd}): {key} bytes (measured by CommLog): expected "
                                       f"{measured[key]}, got {as_int(value)} ({why})")
                expect_equal(as_int(value), measured[key],
                             f"rank {p} of {P} (sends {send}, receives {recv}; E={cfg.n_routed_experts}, "
                             f"H={cfg.n_embd}): {key} bytes (measured by CommLog)")
    return case


ex112.case("4 ranks, E=8, k=2, H=8, 6 tokens per rank, capacity factor 1.0", timeout=20)(_bytes_case(6, _EP_CFG))
ex112.case("4 ranks, E=4, k=1, H=16, 5 tokens per rank", hidden=True, timeout=20)(
    _bytes_case(5, dict(n_embd=16, n_routed_experts=4, n_activated_experts=1, moe_ffn_dim=8)))


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case, seed  # noqa: E402


def _draw_routing(r):
    P, per = r.randint(1, 5), r.randint(1, 3)
    E = P * per
    k, T = r.randint(1, min(E, 3)), r.randint(1, 8)
    return _random_routing(P, T, E, k, seed(r), skew=r.random() < 0.3), per, f"P={P}, E={E}, k={k}, T={T}"


fresh_case(ex111, "random routing", _draw_routing, _splits_case)


def _draw_ep(r):
    P = r.choice((2, 3, 4))      # one rank alone makes no all-to-all for CommLog to measure
    E = P * r.randint(1, 3)
    kw = dict(n_embd=r.choice((4, 8, 16, 24)), n_routed_experts=E, n_activated_experts=r.randint(1, min(E, 3)),
              moe_ffn_dim=8)
    if r.random() < 0.5:
        kw["capacity_factor"] = r.choice((0.5, 1.0, 1.5))
    return r.randint(1, 8), kw, P, 5 + seed(r)


fresh_case(ex112, "random ranks, experts, k, hidden size and tokens", _draw_ep, _bytes_case, n=2)
