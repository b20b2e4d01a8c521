"""Time a schedule without running it: per-rank timelines, bubble, activations in flight.

Model (the runtime's semantics, see :mod:`labkit.pipeline.schedules`): each rank runs its
actions in list order, one at a time. An F/B starts when the rank is free and its input is
there: the output of the previous stage (forward) or the gradient from the next stage
(backward), locally or as a message that arrives ``comm`` seconds after the matching SEND.
SEND and RECV take no time on the rank (asynchronous); they appear in the timeline as
zero-length entries.

Bubble fraction = idle compute time / total: ``1 - sum(F, B durations) / (K * makespan)``,
where makespan is when the last rank finishes. With backward = forward per stage
(``b = f``) and free communication this is exactly (GPipe, Huang et al. 2019 sec. 2.2;
interleaving, Narayanan et al. 2021 sec. 2.2.2):

* GPipe and 1F1B:        (K-1) / (M+K-1)
* interleaved, v chunks: (K-1) / (vM+K-1)

The classic convention behind the formula is b = f per stage (chunk). For GPipe and 1F1B
it holds for any ratio b/f (e.g. b = 2f, the usual FLOP count): the critical path is
(M+K-1)(f+b) and each rank computes M(f+b). For our interleaved schedule it also holds
for b/f in {1/2, 1, 2, 3}. With communication cost > 0 or uneven stages the bubble is
larger. Pass ints or ``fractions.Fraction`` costs to get exact ``Fraction`` results.

Zero-bubble schedules (:mod:`.zero_bubble`) split B into I and W with costs T_I and T_W;
``SimResult.bubble_time`` (idle time per rank) is what their formulas give, e.g. ZB-H1's
(K-1)(T_F + T_I - T_W) (Qi et al. 2024, sec. 2.1), checked on a grid by the tests.

Peak in flight on stage s: the most microbatches whose F(s) ran but whose B(s) (or W(s)) has not,
which depends only on the order of actions: M on every stage for GPipe, ``min(M, K - s)``
for 1F1B (PipeDream-Flush, Narayanan et al. 2021 sec. 2.2.1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from numbers import Rational
from typing import Callable, NamedTuple, Sequence, Union

from .rules import check_schedule
from .schedules import COMPUTE, Action, Schedule, ScheduleError, infer_sizes  # noqa: F401 (infer_sizes: re-exported)
from .symbolic import execute

__all__ = ["TimedAction", "SimResult", "simulate", "bubble_formula", "peak_in_flight", "peak_waiting_for_w",
           "bubble_fraction", "infer_sizes"]

Cost = Union[float, int, Fraction, Sequence, Callable[[int], float]]


class TimedAction(NamedTuple):
    """An action with its ``start`` and ``end`` time in seconds (simulated or measured,
    relative to the step's common start)."""

    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    """What :func:`simulate` returns.

    ``timeline``: ``{rank: [TimedAction, ...]}`` in execution order; ``makespan`` (s);
    ``busy``: total F/B time over all ranks (s); ``bubble_fraction``: idle/total in [0, 1];
    ``peak_in_flight``: list indexed by stage; ``K``, ``M``, ``n_stages``."""

    timeline: dict
    makespan: float
    busy: float
    bubble_fraction: float
    peak_in_flight: list
    K: int
    M: int
    n_stages: int
    extra: dict = field(default_factory=dict)

    @property
    def bubble_time(self):
        """Idle time per rank, averaged over ranks: ``makespan - busy / K`` (seconds). With one
        stage per rank this is the bubble of the formulas ``(K-1)(T_F + T_B)`` and kin."""
        return self.makespan - _ratio(self.busy, self.K)


def bubble_formula(K: int, M: int, v: int = 1) -> Fraction:
    """(K-1)/(vM+K-1): idle fraction of a GPipe/1F1B (v=1) or interleaved (v chunks)
    step with uniform stages and b = f (Narayanan et al. 2021, sec. 2.2.2: bubble time
    (K-1)(t_f+t_b)/v against ideal time M(t_f+t_b)). With fewer microbatches than ranks
    (M < K, which torch's ScheduleInterleaved1F1B runs in one round) a microbatch comes back
    to rank 0 before the last one has left it only when M >= K, so each of the v loops costs
    K steps: ``(v(K-M) + M - 1)/(vK + M - 1)`` (the same as above when M = K or v = 1)."""
    if M < K:
        return Fraction(v * (K - M) + M - 1, v * K + M - 1)
    return Fraction(K - 1, v * M + K - 1)


def _exact(x) -> bool:
    return isinstance(x, Rational)


def _ratio(a, b):
    if b == 0:
        return 0 if not _exact(a) else Fraction(0)
    return Fraction(a) / Fraction(b) if _exact(a) and _exact(b) else a / b


def _cost_fn(spec: Cost, what: str):
    if callable(spec):
        return spec
    if isinstance(spec, (int, float, Fraction)):
        if spec < 0:
            raise ValueError(f"{what} cost must be >= 0, got {spec}")
        return lambda s: spec
    seq = list(spec)

    def f(s):
        if s >= len(seq):
            raise ValueError(f"{what} costs given for {len(seq)} stages, schedule has stage {s}")
        return seq[s]
    return f


def peak_in_flight(schedule: dict, n_stages: int | None = None) -> list:
    """Most microbatches in flight per stage, from the action order: F done and B (or W, for a
    split backward) not yet; a microbatch's activations stay alive until its W, which needs
    them (Qi et al. 2024, sec. 3)."""
    S = Schedule.of(schedule, n_stages=n_stages).n_stages
    peak, live = [0] * S, [0] * S
    for r in schedule:
        for kind, stage, _ in schedule[r]:
            if kind == "F":
                live[stage] += 1
                peak[stage] = max(peak[stage], live[stage])
            elif kind in ("B", "W"):
                live[stage] -= 1
    return peak


def peak_waiting_for_w(schedule: dict, n_stages: int | None = None) -> list:
    """Most microbatches per stage whose I ran and whose W has not: they hold only what W
    needs (each layer's input and output gradient), no longer what the input gradient needs."""
    S = Schedule.of(schedule, n_stages=n_stages).n_stages
    peak, live = [0] * S, [0] * S
    for r in schedule:
        for kind, stage, _ in schedule[r]:
            if kind == "I":
                live[stage] += 1
                peak[stage] = max(peak[stage], live[stage])
            elif kind == "W":
                live[stage] -= 1
    return peak


def _busy(timeline: dict):
    """Total compute time over all ranks; intervals that overlap on a rank (an overlapped
    F&B pair, or actions on two streams) count once."""
    total = 0
    for r in timeline:
        spans = sorted((t.start, t.end) for t in timeline[r] if t.action.kind in COMPUTE)
        cur_s = cur_e = None
        for a, b in spans:
            if cur_e is None or a > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = a, b
            else:
                cur_e = max(cur_e, b)
        if cur_e is not None:
            total += cur_e - cur_s
    return total


def bubble_fraction(timeline: dict, K: int | None = None):
    """``1 - sum(F, B durations) / (K * makespan)`` of a timeline ``{rank: [TimedAction]}``
    (simulated or measured); makespan = latest end of any entry, times start at 0."""
    K = len(timeline) if K is None else K
    busy = _busy(timeline)
    makespan = max((t.end for r in timeline for t in timeline[r]), default=0)
    return 1 - _ratio(busy, K * makespan) if makespan else 0


def simulate(schedule: dict, forward: Cost = 1, backward: Cost | None = None, comm: Cost = 0,
             n_microbatches: int | None = None, n_stages: int | None = None,
             validate: bool = True, backward_input: Cost | None = None, backward_weight: Cost | None = None,
             placement: str | None = None, overlapped: dict | None = None, overlap=None) -> SimResult:
    """Time ``schedule`` (``{rank: [Action]}``) with the given costs (seconds).

    Costs (each one number for every stage, a sequence indexed by stage, or a function
    ``stage -> cost``): ``forward`` T_F; ``backward`` T_B of a full backward ``B``;
    ``backward_input`` T_I and ``backward_weight`` T_W of the split backward (``I``, ``W``;
    Qi et al. 2024, sec. 2). Defaults: T_B = T_I + T_W when both are given, else 1; T_I and
    T_W = T_B / 2 each when not given. ``comm``: time from a SEND to the arrival of its
    message (number or function of the sending stage). ``placement``: "loop" or "v" (None:
    inferred, :func:`~.schedules.infer_placement`). The schedule is validated first (raises
    :class:`ScheduleError`, e.g. on a deadlock) unless ``validate=False``; a deadlock found
    while simulating also raises ScheduleError.

    ``overlapped``: ``{rank: [(F action, B action), ...]}``, pairs that run together as one
    overlapped "F&B" (DualPipe; :func:`~.zero_bubble.dualpipev_overlapped`) taking ``overlap``
    seconds (a number, default T_F + T_B: no gain); a pair starts when both inputs are there,
    and both entries of the timeline span the pair's time (busy time counts it once).

    Dependencies: F(s, m) after F(s-1, m); B(s, m) and I(s, m) after F(s, m) and after the
    B or I of (s+1, m); W(s, m) after I(s, m). A message arrives ``comm`` after its SEND.
    """
    if validate:  # also turns plain (kind, stage, microbatch) tuples into Actions
        schedule = check_schedule(schedule, n_microbatches=n_microbatches, n_stages=n_stages, placement=placement)
    else:
        schedule = Schedule.of(schedule, n_microbatches, n_stages, placement)
    K, M, S = schedule.K, schedule.M, schedule.n_stages
    if backward is None:
        if backward_input is not None and backward_weight is not None:
            bi, bw = _cost_fn(backward_input, "backward_input"), _cost_fn(backward_weight, "backward_weight")
            backward = lambda s: bi(s) + bw(s)  # noqa: E731
        else:
            backward = 1
    bwd = _cost_fn(backward, "backward")
    half = (lambda s: _ratio(bwd(s), 2))
    costs = {"F": _cost_fn(forward, "forward"), "B": bwd,
             "I": _cost_fn(backward_input, "backward_input") if backward_input is not None else half,
             "W": _cost_fn(backward_weight, "backward_weight") if backward_weight is not None else half}
    com = _cost_fn(comm, "comm")
    pair_of = {}  # (rank, F action) -> its B partner, for overlapped F&B pairs
    ran_with_pair: set = set()
    for r_, pairs in (overlapped or {}).items():
        for fa, ba in pairs:
            pair_of[(r_, Action(*fa))] = Action(*ba)

    rk = schedule.rank_of
    done: dict = {}      # (kind, stage, mb) -> end time of a compute action; ("G", s, m): input grad ready
    arrival: dict = {}   # message key -> arrival time
    t = {r: 0 for r in schedule}
    timeline = {r: [] for r in schedule}

    def ready(a, r, partner=None):
        """Time at which the inputs of compute action ``a`` on rank r are there, or None."""
        s, m = a.stage, a.microbatch
        deps = []
        if a.kind == "F" and s > 0:
            deps.append(("F", s - 1, m) if rk(s - 1) == r else ("msg", ("F", s - 1, m)))
        if a.kind in ("B", "I"):
            deps.append(("F", s, m))
            if s < S - 1:
                deps.append(("G", s + 1, m) if rk(s + 1) == r else ("msg", ("B", s + 1, m)))
        if a.kind == "W":
            deps.append(("I", s, m))
        times = [0]
        for d in deps:
            tt = arrival.get(d[1]) if d[0] == "msg" else done.get(d)
            if tt is None:
                return None
            times.append(tt)
        return max(times)

    def finish(a, r, start, end):
        done[(a.kind, a.stage, a.microbatch)] = end
        if a.kind in ("B", "I"):
            done[("G", a.stage, a.microbatch)] = end
        timeline[r].append(TimedAction(a, start, end))
        t[r] = end

    def step(r, i, a, idx):
        """One action of rank r, timed; False while it waits for an input."""
        s = a.stage
        if (r, a) in ran_with_pair:  # the B of an overlapped pair, timed with its F
            return True
        if a.kind in COMPUTE and (r, a) in pair_of:  # an overlapped F&B pair
            b = pair_of[(r, a)]
            nxt = next((x for x in schedule[r][i + 1:] if x.kind in COMPUTE), None)
            if nxt != b:
                raise ScheduleError(f"rank {r}, action {i} ({a!r}): overlapped with {b!r}, which must "
                                    f"be the next compute action")
            ta, tb = ready(a, r), ready(b, r)
            if ta is None or tb is None:
                return False
            start = max(t[r], ta, tb)
            end = start + (overlap if overlap is not None else costs[a.kind](s) + costs[b.kind](b.stage))
            for x in (a, b):
                finish(x, r, start, end)
            ran_with_pair.add((r, b))
            return True
        if a.kind in COMPUTE:
            ta = ready(a, r)
            if ta is None:
                return False  # blocked on a dependency
            start = max(t[r], ta)
            finish(a, r, start, start + costs[a.kind](s))
            return True
        if a.kind.startswith("SEND"):
            arrival[schedule.message(a).key] = t[r] + com(a.stage)
        timeline[r].append(TimedAction(a, t[r], t[r]))
        return True
    idx = execute(schedule, step)
    stuck = [r for r in schedule if idx[r] < len(schedule[r])]
    if stuck:
        r = stuck[0]
        raise ScheduleError(f"deadlock: rank {r}, action {idx[r]} ({schedule[r][idx[r]]!r}) waits for an input "
                            f"that never comes (ranks blocked: {stuck})")
    busy = _busy(timeline)
    makespan = max((x.end for r in timeline for x in timeline[r]), default=0)
    bubble = 1 - _ratio(busy, K * makespan) if makespan else 0
    return SimResult(timeline, makespan, busy, bubble, peak_in_flight(schedule, S), K, M, S)
