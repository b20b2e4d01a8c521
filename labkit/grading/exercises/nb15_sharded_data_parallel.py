"""Exercises of notebook 15_sharded_data_parallel: flat shards, ZeRO memory and traffic, FSDP's peak.

* 15.1 split a flat parameter into d equal shards, zero-padded at the end (what every ZeRO stage
  and FSDP do before a reduce-scatter / all-gather). Named mistakes: uneven pieces (``chunk`` /
  ``tensor_split``), padding in front, elements dropped.
* 15.2 model-state bytes of one GPU per ZeRO stage with mixed-precision Adam (2 + 2 + 12 bytes per
  parameter; ZeRO sec. 3.1, 5): 16 Psi, 4 Psi + 12 Psi/d, 2 Psi + 14 Psi/d, 16 Psi/d. Named: a
  stage that shards one state too many or too few, fp32-only Adam moments (K = 8).
* 15.3 elements one GPU sends per step per ZeRO stage under the ring algorithms (ZeRO sec. 7):
  2 (d-1)/d Psi for stages 0-2, 3 (d-1)/d Psi for stage 3. Named: stage 3 like DP, the (d-1)/d
  factor forgotten.
* 15.4 FSDP's peak of gathered parameters: the largest sum of two neighbouring units' padded sizes
  (the current unit and the prefetched next one), all units without resharding. Named: one unit
  only (no prefetch), sizes without padding, the two largest units anywhere, the last unit paired
  with the first (a ring of units).
* 15.5 (section 1, after 15.1) the inverse of 15.1: the d shards in rank order (what an all-gather
  returns) concatenated and the padding dropped. Named mistakes: padding kept, shards joined in the
  wrong order (reversed, or interleaved element by element), padding taken off the front, the
  ``[:-pad]`` slice that empties the tensor when there is no padding, padding told apart by value (every
  zero dropped, or trailing zeros stripped: a parameter can hold zeros of its own).

Ground truth: :mod:`labkit.data_parallel.flat`, :func:`labkit.plan.memory.zero3_gathered_peak`.
"""
from __future__ import annotations

import torch

from ...data_parallel.flat import padded_numel
from ...data_parallel.flat import shard_flat as _shard
from ...data_parallel.flat import unshard_flat as _unshard
from ...plan.memory import zero3_gathered_peak
from ..fresh import fresh_case
from ..registry import CheckFailure, as_int, exercise, type_name

NB = "15_sharded_data_parallel"

# ----------------------------------------------------------------------------- 15.1
ex151 = exercise(
    "15.1", title="shard a flat parameter, with padding", notebook=NB, points=2,
    references=["labkit.data_parallel.flat:shard_flat", "labkit.data_parallel.flat:unshard_flat"],
    hint=("Section 1: the collectives need d shards of the same length, and laying them in rank order must give back "
          "the parameter followed only by padding. How long must a shard be for n elements to fit?"))
ex151.hint2 = ("Check on n = 10 and d = 4: are all four shards the same length, is that length as short as possible, "
               "and does rank order give back the 10 elements first?")
ex151.hint_review = ("leads: states the invariant of section 1 and asks for the shard length; no operation named; "
                     "reviewed 2026-12-06")


def _shard_case(n, d, what):
    def case(shard_flat):
        flat = torch.arange(1, n + 1, dtype=torch.float32)
        got = shard_flat(flat.clone(), d)
        if isinstance(got, torch.Tensor) and got.dim() == 2:
            got = list(got)
        if not isinstance(got, (list, tuple)) or len(got) != d or not all(isinstance(s, torch.Tensor) for s in got):
            raise CheckFailure(f"{what}: expected a list of {d} tensors (one shard per rank), got "
                               f"{type(got).__name__} of length {len(got) if hasattr(got, '__len__') else '?'}")
        size = padded_numel(n, d) // d
        sizes = [s.numel() for s in got]
        if sizes != [size] * d:
            why = ""
            if sum(sizes) == n:
                why = (" (the pieces hold the n elements but are not all the same size: a reduce-scatter and "
                       "an all-gather need equal pieces, so pad first)")
            elif sizes == [n // d] * d:
                why = " (rounded down: the last elements were dropped)"
            raise CheckFailure(f"{what}: every shard must hold {size} elements, got sizes {sizes}{why}")
        want = [_shard(flat, d, r) for r in range(d)]
        for r, (g, w) in enumerate(zip(got, want)):
            if not torch.equal(g.reshape(-1).float(), w):
                pad = padded_numel(n, d) - n
                front = torch.cat([torch.zeros(pad), flat])
                strided = torch.cat([flat, torch.zeros(pad)]).view(-1, d).t()
                why = ""
                if all(torch.equal(s.reshape(-1).float(), strided[q]) for q, s in enumerate(got)):
                    why = (" (every d-th element: rank r's shard must be one contiguous piece of the buffer, so that "
                           "the all-gather lays the pieces end to end)")
                if not why and pad and torch.equal(torch.cat([s.reshape(-1).float() for s in got]), front):
                    why = (" (the zeros went in front: then rank 0's shard no longer starts at the first "
                           "element, and dropping the padding after the all-gather cuts off real values)")
                raise CheckFailure(f"{what}: shard of rank {r} is {g.reshape(-1).tolist()}, expected "
                                   f"{w.tolist()}{why}")
    return case


ex151.case("n = 10 over d = 4 (2 zeros of padding)")(_shard_case(10, 4, "shard_flat(arange 1..10, d=4)"))
ex151.case("n = 12 over d = 4 (no padding)")(_shard_case(12, 4, "shard_flat(arange 1..12, d=4)"))
ex151.case("n = 7 over d = 3")(_shard_case(7, 3, "shard_flat(arange 1..7, d=3)"))
ex151.case("n = 3 over d = 8 (most shards all padding)", hidden=True)(_shard_case(3, 8, "shard_flat(3 elements, d=8)"))
fresh_case(ex151, "n = 3 over d = 8 (most shards all padding)",
           lambda r: (r.randint(1, 200), r.choice((2, 3, 4, 5, 8, 16))),
           lambda n, d: _shard_case(n, d, f"shard_flat({n} elements, d={d})"))


# ----------------------------------------------------------------------------- 15.2
ex152 = exercise(
    "15.2", title="model-state memory of one GPU per ZeRO stage", notebook=NB, points=2,
    hint=("Section 2: mixed-precision Adam keeps three kinds of state per parameter: bf16 weights, bf16 gradients and "
          "K bytes of fp32 optimizer state. Which of them does each stage split over the d ranks, and which stay "
          "whole on every GPU?"))
ex152.hint2 = ("Make a table with one row per kind of state and one column per stage: in which cells is the state "
               "divided over the d ranks? Is the fp32 copy of the weights part of the optimizer state or of the "
               "weights?")
ex152.hint_review = ("leads: asks which state each stage splits and suggests a table; the conditions are the "
                     "learner's; reviewed 2026-12-06")


def _zero_bytes(psi, d, stage, p=2, g=2, k=12):
    return (p / d if stage >= 3 else p) * psi + (g / d if stage >= 2 else g) * psi + (k / d if stage >= 1 else k) * psi


def _memory_case(psi, d, stages, what):
    def case(zero_memory):
        for stage in stages:
            got = zero_memory(psi, d, stage)
            want = _zero_bytes(psi, d, stage)
            try:
                got = float(got)
            except (TypeError, ValueError):
                raise CheckFailure(f"{what}, stage {stage}: expected a number of bytes, got "
                                   f"{type(got).__name__}") from None
            if not abs(got - want) <= 1e-9 * max(1.0, want):  # NaN fails too
                why = ""
                for s in range(4):
                    if s != stage and abs(got - _zero_bytes(psi, d, s)) <= 1e-9 * want:
                        sharded = ["nothing", "the optimizer state", "the optimizer state and the gradients",
                                   "all three"][stage]
                        why = f" (that is stage {s}'s memory: stage {stage} shards {sharded})"
                if not why and abs(got - _zero_bytes(psi, d, stage, k=8)) <= 1e-9 * want:
                    why = " (K = 8 counts only Adam's two fp32 moments; the fp32 master weights are part of it too)"
                if not why:
                    why = _units_mistake(psi, d, stage, got)
                raise CheckFailure(f"{what}, stage {stage}: expected {want:.6g} bytes, got {got:.6g}{why}")
    return case


_PARTS = ("the bf16 weights", "the bf16 gradients", "the fp32 optimizer state")


def _units_mistake(psi, d, stage, got):
    """" (...)" when ``got`` is stage ``stage``'s memory with some of its three parts in GB or GiB, else ""."""
    want = _zero_bytes(psi, d, stage)
    parts = [_zero_bytes(psi, d, stage, p=2, g=0, k=0), _zero_bytes(psi, d, stage, p=0, g=2, k=0),
             _zero_bytes(psi, d, stage, p=0, g=0, k=12)]
    for unit, scale in (("GB", 1e9), ("GiB", 2 ** 30)):
        for mask in range(1, 8):
            mixed = sum(v / scale if mask >> i & 1 else v for i, v in enumerate(parts))
            if abs(got - mixed) <= 1e-9 * max(1e-12, abs(mixed)):
                named = [name for i, name in enumerate(_PARTS) if mask >> i & 1]
                if mask == 7:
                    return f" (that is the memory in {unit}: the number of bytes is asked)"
                return (f" ({' and '.join(named)} counted in {unit}, the rest in bytes: every part in bytes, "
                        "before they are added)")
    return ""


ex152.case("the ZeRO paper's Figure 1: 7.5B parameters, d = 64")(
    _memory_case(7.5e9, 64, (0, 1, 2, 3), "zero_memory(7.5e9, d=64)"))
ex152.case("1000 parameters, d = 4")(_memory_case(1000, 4, (0, 1, 2, 3), "zero_memory(1000, d=4)"))
ex152.case("175B parameters, d = 1024", hidden=True)(
    _memory_case(175e9, 1024, (0, 1, 2, 3), "zero_memory(175e9, 1024)"))
fresh_case(ex152, "175B parameters, d = 1024", lambda r: (r.randint(1, 1000) * 1e8, r.choice((2, 4, 8, 16, 64, 256))),
           lambda psi, d: _memory_case(psi, d, (0, 1, 2, 3), f"zero_memory({psi:g}, d={d})"))


# ----------------------------------------------------------------------------- 15.3
ex153 = exercise(
    "15.3", title="communication volume per ZeRO stage", notebook=NB, points=2,
    hint=("Section 4: count the collectives of one step and what each sends per rank in a ring. A ring all-reduce is "
          "a reduce-scatter followed by an all-gather; what does stage 3 gather that the others do not?"))
ex153.hint2 = ("Count, for one step of each stage, the collectives that move the whole model: which are "
               "reduce-scatters, which all-gathers, and which all-reduces? Then ask how much one ring collective of "
               "that size sends per rank, compared with another.")
ex153.hint_review = ("leads: asks for the collectives of each stage and their ring cost; the section's own statement "
                     "of all-reduce is repeated, no count given; reviewed 2026-12-06")


def _volume(psi, d, stage):
    return (3 if stage == 3 else 2) * (d - 1) / d * psi


def _volume_case(psi, d, what):
    def case(comm_volume):
        for stage in range(4):
            got = comm_volume(psi, d, stage)
            want = _volume(psi, d, stage)
            try:
                got = float(got)
            except (TypeError, ValueError):
                raise CheckFailure(f"{what}, stage {stage}: expected a number of elements, got "
                                   f"{type(got).__name__}") from None
            if not abs(got - want) <= 1e-9 * max(1.0, want):  # NaN fails too
                why = ""
                if stage == 3 and abs(got - _volume(psi, d, 0)) <= 1e-9 * want:
                    why = (" (this is plain DP's volume: stage 3 gathers the parameters again for backward, "
                           "because forward freed them)")
                elif stage in (1, 2) and abs(got - _volume(psi, d, 3)) <= 1e-9 * want:
                    why = (f" (that is stage 3's volume: stage {stage} keeps whole parameters on every rank, so it "
                           f"never gathers them)")
                elif stage in (1, 2) and abs(got - want / 2) <= 1e-9 * want:
                    why = (" (half: a reduce-scatter of the gradients alone; the updated parameter shards must also "
                           "reach every rank)")
                elif abs(got - want * d / (d - 1)) <= 1e-9 * want * d:
                    why = " (each rank sends (d-1)/d of the data in a ring collective, not all of it)"
                raise CheckFailure(f"{what}, stage {stage}: expected {want:.6g} elements sent per GPU, got "
                                   f"{got:.6g}{why}")
    return case


ex153.case("Psi = 1e9, d = 8")(_volume_case(1e9, 8, "comm_volume(1e9, d=8)"))
ex153.case("Psi = 1200, d = 4")(_volume_case(1200, 4, "comm_volume(1200, d=4)"))
ex153.case("Psi = 7.5e9, d = 64", hidden=True)(_volume_case(7.5e9, 64, "comm_volume(7.5e9, d=64)"))
fresh_case(ex153, "Psi = 7.5e9, d = 64", lambda r: (r.randint(1, 1000) * 1e7, r.choice((2, 3, 4, 8, 64))),
           lambda psi, d: _volume_case(psi, d, f"comm_volume({psi:g}, d={d})"))


# ----------------------------------------------------------------------------- 15.4
ex154 = exercise(
    "15.4", title="FSDP's peak of gathered parameters", notebook=NB, points=2,
    references=["labkit.plan.memory:zero3_gathered_peak"],
    hint=("Section 3: look at the measured timeline. While one unit computes, which other unit's parameters are "
          "already gathered, and how long is each unit's gathered buffer on d ranks?"))
ex154.hint2 = ("Read the timeline in section 3 at its busiest moment: how many units' buffers exist at the same time, "
               "how long is each buffer once padded, and what does keeping the gathered parameters until backward "
               "change about when they are freed?")
ex154.hint_review = ("leads: asks what is gathered at the same time and how long each buffer is; no expression given; "
                     "reviewed 2026-12-06")


_WRAPPED = (" (the last unit was paired with the first: units run in order and nothing is prefetched after the "
            "last one; forward does not wrap around)")
_LARGEST = " (the two largest units, but only units that run one after the other are gathered together)"


def _wrap_or_largest(gathered_peak, got, wrapped, largest) -> str:
    """Which of two mistakes gave ``got`` when the case's units cannot tell them apart (the first and the last
    unit are also the two largest): ask the answer once more, on units where the two differ."""
    if got == wrapped and got != largest:
        return _WRAPPED
    if got == largest and got != wrapped:
        return _LARGEST
    probe = [500, 10, 600, 12, 400]  # d = 2, no padding: right 612, wrapped 900, two largest 1100
    again = gathered_peak(list(probe), 2, True)
    again = as_int(again) if as_int(again) is not None else again
    if again == 900:
        return _WRAPPED
    if again == 1100:
        return _LARGEST
    return ""


def _peak_case(units, d, reshard, what):
    def case(gathered_peak):
        got = gathered_peak(list(units), d, reshard)
        want = zero3_gathered_peak(list(units), d, reshard)
        if isinstance(got, float) and got.is_integer():
            got = int(got)
        if as_int(got) is None:
            raise CheckFailure(f"{what}: expected a whole number of elements, got {type_name(got)}")
        got = as_int(got)
        if got != want:
            pads = [padded_numel(n, d) for n in units]
            wrapped = max((pads[i] + pads[(i + 1) % len(pads)] for i in range(len(pads))), default=0)
            why = ""
            if got == max(pads):
                why = " (one unit only: the prefetched next unit is gathered while this one computes)"
            elif reshard and got == zero3_gathered_peak(list(units), 1, True):
                why = " (the sizes were not padded: each unit's buffer is a multiple of d)"
            elif got in (wrapped, sum(sorted(pads)[-2:])):
                why = _wrap_or_largest(gathered_peak, got, wrapped, sum(sorted(pads)[-2:]))
            elif reshard and got == sum(pads):
                why = " (every unit: with reshard_after_forward=True each unit is freed after its forward)"
            raise CheckFailure(f"{what}: expected {want} elements, got {got}{why}")
    return case


ex154.case("4 units [4224, 3136, 3136, 4128], d = 3, resharded")(
    _peak_case([4224, 3136, 3136, 4128], 3, True, "gathered_peak([4224, 3136, 3136, 4128], d=3, reshard=True)"))
ex154.case("5 units, the largest two far apart, d = 2")(
    _peak_case([901, 10, 11, 12, 899], 2, True, "gathered_peak([901, 10, 11, 12, 899], d=2, reshard=True)"))
ex154.case("units [10, 21, 5], d = 4, padding decides")(
    _peak_case([10, 21, 5], 4, True, "gathered_peak([10, 21, 5], d=4, reshard=True)"))
ex154.case("5 units [500, 10, 600, 12, 400], d = 2")(
    _peak_case([500, 10, 600, 12, 400], 2, True, "gathered_peak([500, 10, 600, 12, 400], d=2, reshard=True)"))
ex154.case("not resharded: [100, 50, 75], d = 2")(
    _peak_case([100, 50, 75], 2, False, "gathered_peak([100, 50, 75], d=2, reshard=False)"))
ex154.case("one unit", hidden=True)(_peak_case([77], 4, True, "gathered_peak([77], d=4, reshard=True)"))
fresh_case(ex154, "one unit", lambda r: ([r.randint(1, 5000) for _ in range(r.randint(1, 8))], r.choice((2, 3, 4, 8)),
                                         r.random() < 0.7),
           lambda u, d, rs: _peak_case(u, d, rs, f"gathered_peak({len(u)} units, d={d}, reshard={rs})"))


# ----------------------------------------------------------------------------- 15.5
ex155 = exercise(
    "15.5", title="unshard a flat parameter, dropping the padding", notebook=NB, points=2,
    references=["labkit.data_parallel.flat:unshard_flat"],
    hint=("Section 1: an all-gather gives every rank the d shards, shard r from rank r. Which order gives the padded "
          "buffer back, and where in it is the padding that 15.1 added?"))
ex155.hint2 = ("Try your function with n = 8 and d = 4, where there is no padding at all: does it still return all 8 "
               "elements? And with n = 10, is the padding gone and the order 1..10?")
ex155.hint_review = ("leads: asks for the order and where the padding sits, with checks; no operation named; reviewed "
                     "2026-12-06")


def _unshard_case(n, d, what, values=None):
    def case(unshard_flat):
        flat = (torch.arange(1, n + 1, dtype=torch.float32) if values is None
                else torch.tensor(values, dtype=torch.float32))
        shards = [_shard(flat, d, r) for r in range(d)]
        got = unshard_flat([s.clone() for s in shards], n)
        if not isinstance(got, torch.Tensor):
            raise CheckFailure(f"{what}: expected one 1-D tensor, got {type(got).__name__}")
        got = got.reshape(-1).float()
        if torch.equal(got, _unshard(shards, n)):
            return
        padded = torch.cat(shards)
        why = ""
        if got.numel() == padded.numel() and torch.equal(got, padded):
            why = (f" (the padding is still there: the buffer has {padded.numel()} elements, the parameter "
                   f"{n}; drop the zeros after the last real element)")
        elif got.numel() == 0 and padded.numel() == n:
            why = (" (empty: with no padding a slice that ends 'minus the padding' ends at minus zero, which "
                   "keeps nothing; slice by the number of real elements instead)")
        elif got.numel() == n and d > 1 and any(torch.equal(got, rev) for rev in (
                torch.cat(shards[::-1])[:n], torch.cat(shards[::-1])[-n:])):
            why = " (the shards were joined in reverse order: shard r comes from rank r and goes r-th)"
        elif got.numel() == n and d > 1 and torch.equal(got, torch.stack(shards, 1).reshape(-1)[:n]):
            why = (" (the shards were interleaved element by element: each shard is a contiguous piece of "
                   "the buffer, so lay them end to end)")
        elif got.numel() < n and torch.equal(got, flat[flat != 0]):
            why = (" (the parameter's own zeros were dropped too: a real element can be 0, so the padding is "
                   "told apart by position, not by value)")
        elif got.numel() < n and torch.equal(got, flat[:int(flat.nonzero().max()) + 1] if flat.any() else flat[:0]):
            why = (" (the zeros at the end of the parameter itself were stripped with the padding: a real element "
                   "can be 0, so the padding is told apart by position, not by value)")
        elif got.numel() == n and torch.equal(got, padded[-n:]):
            why = (" (the first elements were dropped instead of the last: 15.1 put the zeros at the end, "
                   "so the padding is cut off the end)")
        raise CheckFailure(f"{what}: expected {flat.tolist()}, got {got.tolist()}{why}")
    return case


ex155.case("n = 10 from d = 4 shards (2 zeros of padding)")(
    _unshard_case(10, 4, "unshard_flat(4 shards of arange 1..10, n=10)"))
ex155.case("n = 12 from d = 4 shards (no padding)")(
    _unshard_case(12, 4, "unshard_flat(4 shards of arange 1..12, n=12)"))
ex155.case("n = 7 from d = 3 shards")(_unshard_case(7, 3, "unshard_flat(3 shards of arange 1..7, n=7)"))
ex155.case("n = 6 from d = 4 shards, a parameter with zeros of its own")(
    _unshard_case(6, 4, "unshard_flat(4 shards of [1, 0, 2, 0, 3, 0], n=6)", values=[1, 0, 2, 0, 3, 0]))
ex155.case("n = 5 from d = 2 shards, all of it zeros", hidden=True)(
    _unshard_case(5, 2, "unshard_flat(2 shards of 5 zeros, n=5)", values=[0] * 5))
ex155.case("n = 3 from d = 8 shards (most shards all padding)", hidden=True)(
    _unshard_case(3, 8, "unshard_flat(8 shards of 3 elements, n=3)"))
fresh_case(ex155, "n = 3 from d = 8 shards (most shards all padding)",
           lambda r: (r.randint(1, 200), r.choice((2, 3, 4, 5, 8, 16))),
           lambda n, d: _unshard_case(n, d, f"unshard_flat({d} shards of {n} elements, n={n})"))
