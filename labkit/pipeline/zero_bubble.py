"""Zero-bubble schedules: the backward split into ``I`` (input gradient) and ``W`` (weight
gradient), as data.

Why the split helps (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR, sec. 2): the
previous stage waits only for the gradient with respect to its output, i.e. this stage's
*input* gradient ``I``. The weight gradient ``W`` is needed by nobody until the optimizer
step, so a schedule may run it later, in time that 1F1B leaves idle.

Which "B"? The zero-bubble paper writes B for the input-gradient pass (our ``I``, torch's
``BACKWARD_INPUT``); the DualPipe README and the DeepSeek-V3 report write B for the *full*
backward chunk (our ``B`` = ``I`` + ``W``). So the same ZB-H1 bubble reads
(p-1)(T_F + T_B - T_W) in the paper and (PP-1)(F + B - 2W) in the DeepSeek-V3 report;
readers took one for a typo of the other (DeepSeek-V3 issue #724). In this module T_I and
T_W are always the two parts, T_B = T_I + T_W the full backward.

Builders (each returns ``{rank: [Action]}`` with sends/receives; all raise ScheduleError on
sizes they do not allow, before anything runs):

* :func:`zb_h1_schedule` (K, M): 1F1B with I/W; rank r postpones r of its W passes so that
  they fill the drain; one stage per rank, looped placement; peak in flight K per stage
  (1F1B's peak, reached on every stage). Bubble time (K-1)(T_F + T_I - T_W).
* :func:`zbv_schedule` (K, M): two chunks per rank in V placement (rank r holds stages r
  and 2K-1-r; Qi et al. 2024, sec. 6), torch's ``ScheduleZBVZeroBubble`` order.
* :func:`dualpipev_schedule` (K, M): DeepSeek's DualPipeV ("cut-in-half" DualPipe, the
  DualPipe README), torch's ``ScheduleDualPipeV`` order; needs M >= 2K.

Bubble formulas, time per rank with uniform stages (chunks for ZBV and DualPipeV), free
communication, and the simulator's bubble ``makespan - busy/K``: see :func:`bubble_time_formula`
(ZB-V for any T_F, T_I, T_W: :func:`zbv_bubble_terms`).
"""
from __future__ import annotations

from collections import deque

from .schedules import Action, ScheduleError, add_communication, check_pipeline_sizes

__all__ = ["zb_h1_schedule", "zbv_schedule", "dualpipev_schedule", "dualpipev_overlapped", "bubble_time_formula",
           "zbv_bubble_terms"]


def _zb_h1_order(K: int, M: int, r: int) -> list[Action]:
    """Rank r of ZB-H1: ``min(K-1-r, M)`` warm-up forwards; then each step one F (while
    forwards are left) and one I; a W (of the oldest microbatch whose I ran) follows an I
    only while more than r W passes are pending, so rank r keeps r W passes for the drain,
    where it would otherwise wait for the next output gradient (paper sec. 2.1: the start of
    W is delayed by the number of warm-up microbatches it lacks against the last rank)."""
    warm = min(K - 1 - r, M)
    order = [Action("F", r, m) for m in range(warm)]
    pending: deque = deque()
    next_f = warm
    for m in range(M):
        if next_f < M:
            order.append(Action("F", r, next_f))
            next_f += 1
        order.append(Action("I", r, m))
        pending.append(m)
        if len(pending) > r:
            order.append(Action("W", r, pending.popleft()))
    order += [Action("W", r, m) for m in pending]
    return order


def zb_h1_schedule(K: int, M: int) -> dict:
    """ZB-H1 (Qi et al. 2024, sec. 2.1): 1F1B whose backward is split into I and W, with rank
    r delaying r of its W passes into the drain.

    K ranks, one stage each (stage r on rank r), M microbatches. Peak in flight (F done, W
    not yet) ``min(M, K)`` on every stage: 1F1B's peak memory. Bubble time per rank
    ``(K-1)(T_F + T_I - T_W)`` against 1F1B's ``(K-1)(T_F + T_I + T_W)``, exact for
    ``T_W <= min(T_F, T_I)`` and ``M >= K``. In the
    DeepSeek-V3 report's notation (B = full backward) the same bubble is (K-1)(F + B - 2W).
    Raises ScheduleError for K < 1 or M < 1."""
    check_pipeline_sizes(K, M)
    return add_communication({r: _zb_h1_order(K, M, r) for r in range(K)}, K, placement="loop")


def _zbv_order(K: int, M: int, r: int) -> list[Action]:
    """Rank r of ZB-V, in the order of torch's ``ScheduleZBVZeroBubble``: chunk 0 is stage
    r, chunk 1 stage 2K-1-r. Warm-up ``2(K-r)-1`` forwards of chunk 0, then r pairs of
    (chunk 1, chunk 0) forwards, then K-r rounds of F, I, W on chunk 1; steady rounds of
    F I W on chunk 0 and on chunk 1; drain: I passes of both chunks, then the W passes."""
    c0, c1 = r, 2 * K - 1 - r
    n = max(2 * K - 1, M)  # built for at least 2K-1 microbatches, the extra ones dropped below
    out: list[Action] = []
    cnt = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}

    def fwd(chunk):
        out.append(Action("F", c0 if chunk == 0 else c1, cnt[f"f{chunk}"]))
        cnt[f"f{chunk}"] += 1

    def i_w(chunk):
        m = cnt[f"b{chunk}"]
        s = c0 if chunk == 0 else c1
        out.extend([Action("I", s, m), Action("W", s, m)])
        cnt[f"b{chunk}"] += 1

    for _ in range(2 * (K - r) - 1):
        fwd(0)
    for _ in range(r):
        fwd(1)
        fwd(0)
    for _ in range(K - r):
        fwd(1)
        i_w(1)
    while cnt["f1"] < cnt["f0"] or cnt["f0"] < n:
        if cnt["f0"] < n:
            fwd(0)
        i_w(0)
        fwd(1)
        i_w(1)
    w0, w1 = cnt["b0"], cnt["b1"]
    b0, b1 = w0, w1
    for _ in range(r):
        out += [Action("I", c0, b0), Action("I", c1, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(K - r):
        out += [Action("I", c0, b0), Action("W", c0, w0)]
        b0, w0 = b0 + 1, w0 + 1
    out += [Action("W", c1, m) for m in range(w1, b1)]
    out += [Action("W", c0, m) for m in range(w0, b0)]
    return [a for a in out if a.microbatch < M]


def zbv_schedule(K: int, M: int) -> dict:
    """ZB-V (Qi et al. 2024, sec. 6): each rank holds two model chunks in V placement (rank
    r holds stages r and 2K-1-r, so a microbatch goes down ranks 0..K-1 and back up), with
    I/W split; the order of torch's ``ScheduleZBVZeroBubble`` (any M >= 1; like torch, the
    order is laid out for max(M, 2K-1) microbatches and the ones beyond M are dropped).

    Memory: each chunk holds half of a rank's layers; the paper (sec. 6) gives ZB-V 1F1B's
    peak activation memory (see ``peak_in_flight`` per stage).

    Bubble (chunk costs T_F, T_I, T_W; free communication; bubble = ``makespan - busy/K``):

    * What the sources state: only the case T_F = T_I = T_W = t. The authors' playground
      (huggingface.co/spaces/sail/zero-bubble-pipeline-parallellism, "Comparison assuming
      T_F=T_B=T_W") gives ZB-V a bubble rate of 0, and torch's ``ScheduleZBVZeroBubble``
      docstring (citing the paper, sec. 6) says the "zero bubble" property holds only if time
      forward == time backward input == time backward weights. "Zero" is per rank: every rank
      is busy without a gap from its first action to its last. Counted over the step, rank r
      still waits r*t before its first forward and K-1-r chunk times after its last W, so the
      bubble time per rank is (K-1)t (a chunk is half a stage: half of ZB-H1's
      (K-1)(T_F + T_I - T_W) for the same model). No source gives a formula for other costs.
    * This order, any costs T_F, T_I, T_W >= 0 and M >= 2K-1 (derived here): the maximum of
      the eight terms of :func:`zbv_bubble_terms` (0 for K = 1), independent of M.
      Special cases with T_F = T_I = t: (K-1)t for
      t/2 <= T_W <= t (the paper's case included); 2(K-1)(t - T_W) for T_W < t/2;
      (K-1)t + (K-2)(T_W - t) for T_W > t. For M < 2K-1 (microbatches dropped from the
      layout) none of this is exact; simulate.

    Raises ScheduleError for K < 1 or M < 1."""
    check_pipeline_sizes(K, M)
    return add_communication({r: _zbv_order(K, M, r) for r in range(K)}, 2 * K, placement="v")


def _dualpipev_order(K: int, M: int, r: int) -> tuple[list[Action], list[int]]:
    """Rank r of DualPipeV in the order of torch's ``ScheduleDualPipeV`` (after the DualPipe
    repository's DualPipeV). Returns the actions and the indices of the F actions that run
    overlapped with the B right after them (DualPipe's F&B pairs, README).

    Steps: (1) 2(K-r-1) forwards of chunk 0; (2) r+1 pairs F chunk 0, F chunk 1; (3) K-r-1
    rounds I chunk 1, a pending W, F chunk 1; (4) M-2K+r+1 rounds of the overlapped pairs
    F0&B1 then F1&B0 (rank K-1 runs its first F0, B1 one after the other); (5) K-r-1 rounds
    B1 then F1&B0; (6) r+1 rounds of backward chunk 1, chunk 0, switching from B to I (W
    later) half way; (7) K-r-1 rounds of a pending W then backward chunk 0; (8) the
    remaining W passes."""
    c0, c1 = r, 2 * K - 1 - r
    out: list[Action] = []
    overlapped: list[int] = []
    nf = {c0: 0, c1: 0}
    nb = {c0: 0, c1: 0}
    w_queue: deque = deque()

    def F(s):
        out.append(Action("F", s, nf[s]))
        nf[s] += 1

    def back(s, split):
        m = nb[s]
        nb[s] += 1
        if split:
            out.append(Action("I", s, m))
            w_queue.append(Action("W", s, m))
        else:
            out.append(Action("B", s, m))

    def pending_w():
        if w_queue:
            out.append(w_queue.popleft())

    def f_and_b(fs, bs):
        overlapped.append(len(out))
        F(fs)
        back(bs, False)

    for _ in range(2 * (K - r - 1)):
        F(c0)
    for _ in range(r + 1):
        F(c0)
        F(c1)
    for _ in range(K - r - 1):
        back(c1, True)
        pending_w()
        F(c1)
    for i in range(M - 2 * K + r + 1):
        if i == 0 and r == K - 1:
            F(c0)
            back(c1, False)
        else:
            f_and_b(c0, c1)
        f_and_b(c1, c0)
    for _ in range(K - r - 1):
        back(c1, False)
        f_and_b(c1, c0)
    split = False
    steps = r + 1
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            split = True
        back(c1, split)
        if i == steps // 2 and r % 2 == 0:
            split = True
        back(c0, split)
    for _ in range(K - r - 1):
        pending_w()
        back(c0, split)
    for _ in range(r + 1):
        pending_w()
    while w_queue:
        pending_w()
    return out, overlapped


def dualpipev_schedule(K: int, M: int) -> dict:
    """DualPipeV (DeepSeek, DualPipe README "DualPipeV", the "cut-in-half" DualPipe of Sea AI
    Lab): two chunks per rank in V placement (rank r holds stages r and 2K-1-r) like ZB-V,
    with the steady state made of pairs "F of one chunk & B of the other" whose compute and
    communication DualPipe overlaps (README: "F&B"); order of torch's ``ScheduleDualPipeV``.
    Some backward passes are full B, some split into I and W.

    Rule (torch's, raised before any communication): M >= 2K (at least as many microbatches
    as stages). README numbers, with PP = 2K stages: bubble (PP/2 - 1)(F&B + B - 3W) =
    (K-1)(F&B + B - 3W), B = full backward chunk; parameters per device 2x (two chunks of a
    2K-stage model; DualPipe keeps two copies of the parameters), activations PP+1. The
    simulator (with the pairs of :func:`dualpipev_overlapped` and ``overlap`` = T_FB)
    reproduces the README bubble exactly for T_F = T_I >= T_W and T_FB = T_F + T_B, which
    includes the README figure's costs F = 1, B = 2, W = 1, F&B = 3; with a real overlap gain
    (T_FB < T_F + T_B) the formula is not exact for
    this order. Raises ScheduleError for K < 1, M < 1 or M < 2K."""
    check_pipeline_sizes(K, M)
    if M < 2 * K:
        raise ScheduleError(f"DualPipeV needs at least as many microbatches as stages: M >= 2K = {2 * K} "
                            f"(K={K} ranks, two stages each), got M={M}")
    return add_communication({r: _dualpipev_order(K, M, r)[0] for r in range(K)}, 2 * K, placement="v")


def dualpipev_overlapped(K: int, M: int) -> dict:
    """``{rank: [(F action, B action), ...]}``: the F&B pairs of :func:`dualpipev_schedule`
    that DualPipe runs overlapped (the F is directly followed by the B in the compute order)."""
    check_pipeline_sizes(K, M)
    out = {}
    for r in range(K):
        acts, idx = _dualpipev_order(K, M, r)
        out[r] = [(acts[i], acts[i + 1]) for i in idx]
    return out


def zbv_bubble_terms(K: int, T_F=1, T_I=1, T_W=1) -> list:
    """The eight linear terms whose maximum is the bubble time per rank of :func:`zbv_schedule`
    (K >= 2 ranks, M >= 2K-1 microbatches, chunk costs T_F, T_I, T_W >= 0 in seconds, free
    communication; for K = 1 the bubble is 0 and these terms do not apply).

    Derivation (ours; the paper and torch state only T_F = T_I = T_W): with each rank's order
    fixed and messages free, the step time is the longest path through the actions, whose
    edges are each rank's order, F(s, m) -> F(s+1, m), F(s, m) -> I(s, m), I(s+1, m) -> I(s, m)
    and I(s, m) -> W(s, m). Every path costs a*T_F + b*T_I + c*T_W, so the step time, and the
    bubble = step - 2M(T_F + T_I + T_W), is a maximum of linear terms. Enumerating the longest
    paths of this order for K = 2..6 and M = 2K..3K gives these eight (for K >= 3 each one is
    the only maximum at some costs; at K = 2 some coincide), with coefficients linear in K and no
    M."""
    n = K - 1
    return [T_I + (K - 2) * T_W,
            n * T_I,
            2 * n * (T_I - T_W),
            T_F + (K - 2) * T_W,
            (2 * K - 3) * T_F - (K - 2) * T_I,
            (2 * K - 3) * T_F + T_I - 2 * n * T_W,
            2 * n * T_F - n * T_I - T_W,
            2 * n * T_F - (2 * K - 1) * T_W]


def bubble_time_formula(schedule: str, K: int, T_F=1, T_I=1, T_W=1, T_FB=None):
    """Bubble time per rank (seconds; idle time of a rank in one step) from the formulas.

    ``schedule``: "1f1b" -> (K-1)(T_F + T_I + T_W) (Narayanan et al. 2021; T_B = T_I + T_W);
    "zb-h1" -> (K-1)(T_F + T_I - T_W) (Qi et al. 2024, sec. 2.1, their B is our I); "zbv" ->
    (K-1) T_F when T_F = T_I = T_W (the paper's case, sec. 6), for any costs the maximum of
    :func:`zbv_bubble_terms` (derived here for this order, M >= 2K-1; see :func:`zbv_schedule`);
    "dualpipev" -> (K-1)(T_FB + T_B - 3 T_W) (DualPipe README with PP = 2K stages; its B is
    the full backward T_I + T_W; T_FB, the time of an overlapped F&B pair, defaults to
    T_F + T_B: no overlap). Costs per stage (ZBV, DualPipeV: per chunk). Ints/Fractions give
    exact Fractions."""
    T_B = T_I + T_W
    if schedule == "1f1b":
        return (K - 1) * (T_F + T_B)
    if schedule == "zb-h1":
        return (K - 1) * (T_F + T_I - T_W)
    if schedule == "zbv":
        return 0 * T_F if K == 1 else max(zbv_bubble_terms(K, T_F, T_I, T_W))
    if schedule == "dualpipev":
        fb = T_F + T_B if T_FB is None else T_FB
        return (K - 1) * (fb + T_B - 3 * T_W)
    raise ValueError(f"unknown schedule {schedule!r}; choose one of 1f1b, zb-h1, zbv, dualpipev")

