"""Exercises of notebook 17_from_labkit_to_torch: labkit's names in PyTorch's own APIs.

* 17.1 the collective a DTensor ``redistribute`` issues between two placements (``Shard(d)``,
  ``Replicate()``, ``Partial()``): Megatron's f and g, and sequence parallelism's all-gather and
  reduce-scatter, as placements. Wrong answers named: a gather for a Partial (addends, not pieces),
  a collective where each rank already holds what it keeps, an all-reduce where the pieces are
  disjoint, an all-reduce + slice where one reduce-scatter does it.
* 17.2 the TP (+ SP) plan of one GPT block as a table ``{module: style}`` (torch's
  ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel``, optionally
  ``PrepareModuleInput`` on attn and mlp), checked against labkit's split (its
  ``ColumnParallelLinear`` / ``RowParallelLinear`` layers and the ``sequence_parallel`` marks).
* 17.3 the global ranks of the sub-mesh ``mesh[dims]`` that holds a rank (row-major
  ``init_device_mesh``: the last dimension innermost), for 3-D and 4-D (HSDP) meshes.
* 17.4 the elements of a unit one rank holds under FSDP2 (each parameter ``torch.chunk``-ed along
  dim 0, not one flat buffer as notebook 15's ZeRO-3).
* 17.5 the compute actions one rank runs under torch's ``Schedule1F1B``, in torch's notation
  (``"1F0"``: stage 1 forward of microbatch 0).

Ground truth: torch's own rules (``torch.chunk``; the order ``Schedule1F1B`` runs), labkit's TP
layers for the plan.
"""
from __future__ import annotations

import math
import re

import torch

from ..registry import CheckFailure, _shown, exercise

NB = "17_from_labkit_to_torch"

# ----------------------------------------------------------------------------- 17.1
ex171 = exercise(
    "17.1", title="the collective behind a redistribute", notebook=NB, points=2,
    hint="Section 1: what does each rank hold under each placement: the whole tensor, a disjoint piece of it, "
         "or an addend of it? What must a rank receive from the others to end with what the target placement "
         "asks of it, and when does it already have that?")
ex171.hint2 = ("Take one pair at a time and write the whole tensor twice: from what the source's ranks hold, and "
               "as what each rank must end with. Which of notebook 00's collectives (section 4) gets from the "
               "first to the second, and of those that do, which leaves each rank no more than it keeps?")
ex171.hint_review = ("leads: asks what each placement holds (whole, piece, addend), what a rank must receive and "
                     "which of notebook 00's collectives does it with the least; which collective goes with which "
                     "pair, and the pairs that need none, stay the learner's; reviewed 2026-12-06")

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", None)
_PLACEMENT = re.compile(r"^(Replicate\(\)|Partial\(\)|Shard\((-?\d+)\))$")


def _collective(src: str, dst: str):
    """torch's collective for redistributing ``src`` -> ``dst`` on one mesh dimension (None: local)."""
    if src == dst or src == "Replicate()":
        return None
    if src == "Partial()":
        return "all_reduce" if dst == "Replicate()" else "reduce_scatter"
    return "all_gather" if dst == "Replicate()" else "all_to_all"


def _why_171(src, dst, got):
    if src == "Partial()" and got == "all_gather":
        return (" (under Partial() every rank holds an addend of the whole tensor, not a piece of it: gathering "
                "addends does not add them)")
    if src == "Partial()" and dst.startswith("Shard") and got == "all_reduce":
        return (" (an all-reduce and then keeping one's own chunk gives the right values but moves twice the "
                "bytes of the one collective that sums and scatters at once)")
    if src == "Replicate()" and got is not None:
        return " (under Replicate() every rank already holds the whole tensor: what must it receive?)"
    if src.startswith("Shard") and got == "all_reduce":
        return (" (Shard pieces are disjoint parts of the tensor, not addends: summing them is not how they are "
                "put together)")
    if src.startswith("Shard") and dst.startswith("Shard") and got == "all_gather":
        return (" (gathering the whole tensor and slicing it moves t times more than needed: each rank only "
                "needs its new piece, a part from every rank)")
    if src == dst and got is not None:
        return " (source and target are the same placement)"
    return ""


def _redistribute_case(pairs, what):
    def case(fn):
        for src, dst in pairs:
            got = fn(src, dst)
            if got is not None and got not in COLLECTIVES:
                raise CheckFailure(f"{what}: redistribute {src} -> {dst}: expected one of "
                                   f"'all_reduce', 'all_gather', 'reduce_scatter', 'all_to_all' or None, got "
                                   f"{_shown(got)}")
            want = _collective(src, dst)
            if got != want:
                raise CheckFailure(f"{what}: redistribute {src} -> {dst}: the answer is not the collective torch "
                                   f"issues{_why_171(src, dst, got)}")
    return case


ex171.case("Megatron's g: Partial() -> Replicate()")(
    _redistribute_case([("Partial()", "Replicate()")], "row-parallel output"))
ex171.case("sequence parallelism: Partial() -> Shard(1), Shard(1) -> Replicate()")(
    _redistribute_case([("Partial()", "Shard(1)"), ("Shard(1)", "Replicate()")], "SP"))
ex171.case("Replicate() -> Shard(1) and Replicate() -> Replicate()")(
    _redistribute_case([("Replicate()", "Shard(1)"), ("Replicate()", "Replicate()")], "local"))
ex171.case("Shard(1) -> Shard(2) (Ulysses' head/sequence swap)")(
    _redistribute_case([("Shard(1)", "Shard(2)")], "re-shard"))
ex171.case("other dimensions", hidden=True)(
    _redistribute_case([("Shard(0)", "Replicate()"), ("Partial()", "Shard(0)"), ("Shard(2)", "Shard(0)"),
                        ("Shard(0)", "Shard(0)"), ("Partial()", "Partial()")], "hidden"))


# ----------------------------------------------------------------------------- 17.2
ex172 = exercise(
    "17.2", title="the TP plan of a GPT block as a table", notebook=NB, points=3,
    hint="Section 2: notebook 06's split, written with torch's styles. For each linear of the block, what does "
         "its input hold on every rank, and what must its output hold for the layer after it? With sequence "
         "parallelism, which modules see only S/t tokens and hold weights of their own?",
    references=["labkit.parallel.torch_native:tp_plan", "labkit.parallel.torch_native:plan_table"])
ex172.hint2 = ("Follow the hidden state through one block as notebook 06 drew f and g: after which linears is it "
               "split across the ranks, after which is it a partial sum, and where must it be whole again? Which "
               "of the block's modules have no matrix to split at all, and what do they see without SP and "
               "with it?")
ex172.hint_review = ("leads: asks what each linear's input and output hold on a rank (notebook 06's f and g) and "
                     "what the modules without a matrix see with and without SP; which style goes on which module "
                     "stays the learner's; reviewed 2026-12-06")

STYLES = ("colwise", "rowwise", "sequence_parallel", "prepare_input")
_LINEARS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def _block_plan(sequence_parallel: bool) -> dict:
    """The plan of labkit's ParallelBlock in torch's styles (its q/k/v and fc1 are ColumnParallelLinear,
    out_proj and fc2 RowParallelLinear; under SP ln1 and ln2 are marked sequence_parallel)."""
    plan = {n: "colwise" for n in _LINEARS}
    plan["attn.out_proj"] = plan["mlp.fc2"] = "rowwise"
    if sequence_parallel:
        plan["ln1"] = plan["ln2"] = "sequence_parallel"
    return plan


def _plan_case(sequence_parallel, what):
    def case(fn):
        got = fn(sequence_parallel)
        if not isinstance(got, dict) or any(not isinstance(k, str) for k in got):
            raise CheckFailure(f"{what}: expected a dict {{module name: style}}, got {_shown(got)}")
        want = _block_plan(sequence_parallel)
        optional = {"attn": "prepare_input", "mlp": "prepare_input"}
        extra = sorted(k for k in got if k not in want and k not in optional)
        if extra:
            names = extra if all(k in ("ln1", "ln2", "attn", "mlp", "head", "embedding") for k in extra) else None
            raise CheckFailure(f"{what}: {len(extra)} module name(s) that are not a block's linears or norms"
                               + (f": {', '.join(names)}" if names else "")
                               + (" (without SP the LayerNorms see every token on every rank: nothing to plan)"
                                  if names and set(names) <= {"ln1", "ln2"} else ""))
        for k, style in optional.items():
            if k in got and got[k] != style:
                raise CheckFailure(f"{what}: {k}: the only style that belongs on attn / mlp themselves prepares "
                                   f"their input (one input-gradient reduction for q, k and v)")
        missing = sorted(k for k in want if k not in got)
        if missing:
            why = (" (with SP the LayerNorms run on S/t tokens: their weights need a style too)"
                   if set(missing) <= {"ln1", "ln2"} else "")
            raise CheckFailure(f"{what}: no style for {', '.join(missing)}{why}")
        for k in want:
            if got[k] not in STYLES:
                raise CheckFailure(f"{what}: {k}: expected one of {', '.join(STYLES)}, got {_shown(got[k])}")
        wrong = [k for k in want if got[k] != want[k]]
        if wrong:
            k = wrong[0]
            why = {
                "attn.out_proj": "out_proj's input is this rank's heads (a slice of the features): it must "
                                 "leave a partial sum",
                "mlp.fc2": "fc2's input is this rank's FFN columns after GeLU: it must leave a partial sum",
                "mlp.fc1": "fc1 takes the whole hidden state; GeLU needs whole elements, not partial sums",
                "ln1": "a LayerNorm has no matrix to split", "ln2": "a LayerNorm has no matrix to split",
            }.get(k, "q, k and v take the whole hidden state and leave this rank's heads")
            raise CheckFailure(f"{what}: {len(wrong)} module(s) with the wrong style, first {k} ({why})")
    return case


ex172.case("tensor parallelism, no SP")(_plan_case(False, "block_plan(False)"))
ex172.case("tensor + sequence parallelism")(_plan_case(True, "block_plan(True)"))
ex172.case("both again, in the grader", hidden=True)(
    lambda fn: (_plan_case(True, "hidden: block_plan(True)")(fn), _plan_case(False, "hidden: block_plan(False)")(fn)))


# ----------------------------------------------------------------------------- 17.3
ex173 = exercise(
    "17.3", title="the ranks of a sub-mesh", notebook=NB, points=2,
    hint="Section 3: in which order does init_device_mesh number the ranks: which dimension varies fastest? "
         "Where does `rank` sit in the mesh, and what do the ranks of mesh[dims] that hold it have in common "
         "with it?",
    references=["labkit.grid:Mesh", "labkit.grid:ProcessGrid", "labkit.grid:make_grid"])
ex173.hint2 = ("Do the (pp, dp, tp) = (2, 2, 2) mesh by hand: lay its 8 ranks out in init_device_mesh's "
               "order, find rank 5, and read off the ranks of mesh['tp'] and of mesh['dp'] that hold it. What did "
               "you keep fixed each time, and what did you let vary?")
ex173.hint_review = ("leads: asks for the numbering order and where the rank sits, then a worked-by-hand mesh with "
                     "the question of what stays fixed; the coordinates and the enumeration stay the learner's; "
                     "reviewed 2026-12-06")


def _submesh_ranks(shape, names, rank, dims):
    grid = torch.arange(math.prod(shape)).reshape(shape)
    dims = (dims,) if isinstance(dims, str) else tuple(dims)
    coord = [int(c) for c in torch.nonzero(grid == rank)[0]]
    index = tuple(slice(None) if n in dims else coord[i] for i, n in enumerate(names))
    return sorted(int(r) for r in grid[index].flatten())


def _column_major(shape, names, rank, dims):
    rev = tuple(reversed(shape))
    grid = torch.arange(math.prod(shape)).reshape(rev).permute(*reversed(range(len(shape))))
    dims = (dims,) if isinstance(dims, str) else tuple(dims)
    coord = [int(c) for c in torch.nonzero(grid == rank)[0]]
    index = tuple(slice(None) if n in dims else coord[i] for i, n in enumerate(names))
    return sorted(int(r) for r in grid[index].flatten())


def _mesh_case(shape, names, dims, ranks, what):
    def case(fn):
        for rank in ranks:
            got = fn(tuple(shape), tuple(names), rank, dims)
            if isinstance(got, torch.Tensor):
                got = got.tolist()
            if not isinstance(got, (list, tuple)) or any(isinstance(r, bool) or not isinstance(r, int) for r in got):
                raise CheckFailure(f"{what}: expected a list of global ranks, got {_shown(got)}")
            want = _submesh_ranks(shape, names, rank, dims)
            if sorted(got) != want:
                why = ""
                if sorted(got) == _column_major(shape, names, rank, dims):
                    why = (" (these are the ranks of a column-major layout, first dimension innermost: in "
                           "init_device_mesh the LAST dimension varies fastest)")
                elif rank not in got:
                    why = " (the sub-mesh that holds this rank must contain it)"
                elif len(got) != len(want):
                    why = f" ({len(got)} ranks: mesh[{dims!r}] has as many as the named dimensions' sizes multiply to)"
                raise CheckFailure(f"{what}: rank {rank}, mesh[{dims!r}]: got {_shown(sorted(got))}{why}")
    return case


ex173.case("(pp, dp, tp) = (2, 2, 2): mesh['tp']")(_mesh_case((2, 2, 2), ("pp", "dp", "tp"), "tp", [0, 5], "8 ranks"))
ex173.case("(pp, dp, tp) = (2, 2, 2): mesh['dp'] and mesh['pp']")(
    lambda fn: (_mesh_case((2, 2, 2), ("pp", "dp", "tp"), "dp", [0, 3, 6], "8 ranks")(fn),
                _mesh_case((2, 2, 2), ("pp", "dp", "tp"), "pp", [1, 6], "8 ranks")(fn)))
ex173.case("HSDP (pp, dp_replicate, dp_shard, tp) = (1, 2, 2, 2): mesh['dp_replicate', 'dp_shard']")(
    _mesh_case((1, 2, 2, 2), ("pp", "dp_replicate", "dp_shard", "tp"), ("dp_replicate", "dp_shard"), [0, 3, 7],
               "HSDP"))
ex173.case("(pp, dp, tp) = (4, 2, 4) and a 4-D mesh", hidden=True)(
    lambda fn: (_mesh_case((4, 2, 4), ("pp", "dp", "tp"), "dp", [0, 13, 31], "32 ranks")(fn),
                _mesh_case((2, 3, 2, 2), ("pp", "dp_replicate", "dp_shard", "tp"), "dp_shard", [5, 17],
                           "24 ranks")(fn)))


# ----------------------------------------------------------------------------- 17.4
ex174 = exercise(
    "17.4", title="what one rank holds of an FSDP2 unit", notebook=NB, points=2,
    hint="Section 4: FSDP2 does not flatten a unit into one buffer as notebook 15 did: each parameter is "
         "sharded on its own along dim 0. When d does not divide a parameter's first dimension, which ranks "
         "get more of it, which less, and can a rank get nothing?")
ex174.hint2 = ("Section 4's demo shows how 16 splits over 3 ranks: what would 2 over 4 give, or 10 over 4? "
               "Check your guess on a tensor in a cell of your own. And how many elements does one index along "
               "dim 0 carry?")
ex174.hint_review = ("leads: names the per-parameter dim-0 split and asks which ranks get more, less or nothing, "
                     "then to try small splits; the share's size, its bounds and the element count stay the "
                     "learner's; reviewed 2026-12-06")


def _local_numel(shapes, d, rank):
    total = 0
    for s in shapes:
        chunks = torch.empty(tuple(s), device="meta").chunk(d, 0)
        total += chunks[rank].numel() if rank < len(chunks) else 0
    return total


def _fsdp_case(shapes, d, what):
    def case(fn):
        for rank in range(d):
            got = fn([tuple(s) for s in shapes], d, rank)
            if isinstance(got, torch.Tensor) and got.numel() == 1:
                got = int(got)
            if isinstance(got, bool) or not isinstance(got, int):
                raise CheckFailure(f"{what}: expected an int (elements), got {_shown(got)}")
            want = _local_numel(shapes, d, rank)
            if got != want:
                n = sum(math.prod(s) for s in shapes)
                flat = {-(-n // d), n // d}  # rounded up or down: either way one flat buffer
                padded = sum(-(-s[0] // d) * math.prod(s[1:]) for s in shapes)
                floor = sum(s[0] // d * math.prod(s[1:]) for s in shapes)
                why = (" (one flat buffer split in d equal parts: that is notebook 15's ZeRO-3; FSDP2 shards each "
                       "parameter on its own)" if got in flat else
                       " (ceil(n/d) rows of every parameter: that is the padded size every rank sends in the "
                       "all-gather, not what the last ranks hold)" if got == padded else
                       " (n // d rows of each parameter: the rows left over must live on some rank)"
                       if got == floor else
                       " (compare one parameter at a time: for which of them does your count for this rank differ?)")
                raise CheckFailure(f"{what}: rank {rank} of d={d}: got {got} elements{why}")
    return case


_BLOCK = [(48, 16), (48,), (16, 16), (16,), (64, 16), (64,), (16, 64), (16,), (16,), (16,), (16,), (16,)]
ex174.case("shapes that d = 2 divides")(_fsdp_case([(64, 16), (64,), (16, 64)], 2, "three linears"))
ex174.case("d = 3 does not divide 16 or 64")(_fsdp_case(_BLOCK, 3, "a block's parameters"))
ex174.case("a bias of 2 elements over d = 4")(_fsdp_case([(2,), (8, 3)], 4, "tiny bias"))
ex174.case("a GPT-2 block over d = 6", hidden=True)(
    _fsdp_case([(2304, 768), (2304,), (768, 768), (768,), (3072, 768), (3072,), (768, 3072), (768,)], 6,
               "GPT-2 block"))


# ----------------------------------------------------------------------------- 17.5
ex175 = exercise(
    "17.5", title="one rank's actions in torch's Schedule1F1B", notebook=NB, points=3,
    hint="Section 5: notebook 03's 1F1B in torch's notation. What must have happened on the later stages "
         "before rank r's first backward can start, and how many forwards has rank r run by then?",
    references=["labkit.pipeline.schedules:one_f_one_b_schedule"])
ex175.hint2 = ("Exercise 3.1 wrote this order as Actions; only the notation differs. Draw p = 2, M = 4 by "
               "hand: how many forwards does each rank run before its first backward, what follows each "
               "backward while microbatches are left to start, and what is left at the end?")
ex175.hint_review = ("leads: asks what must precede rank r's first backward and points at exercise 3.1 and a "
                     "drawn timeline; the counts and the order stay the learner's; reviewed 2026-12-06")


def _torch_1f1b(rank, p, M):
    """The compute actions ``Schedule1F1B._step_microbatches`` runs on stage ``rank``: min(M, p - rank)
    forwards (the last of them sent together with the first backward's receive), then a backward and a
    forward in turn, then the backwards left (torch 2.13's ``pipeline_order`` IR of Schedule1F1B
    numbers the last stage's forwards from 1: the runtime, not that IR, is the truth here)."""
    w = min(M, p - rank)
    out, f = [f"{rank}F{m}" for m in range(w)], w
    for b in range(M):
        out.append(f"{rank}B{b}")
        if f < M:
            out.append(f"{rank}F{f}")
            f += 1
    return out


def _gpipe(rank, p, M):
    return [f"{rank}F{m}" for m in range(M)] + [f"{rank}B{m}" for m in range(M)]


def _schedule_case(p, M, ranks, what):
    def case(fn):
        for rank in ranks:
            got = fn(rank, p, M)
            if not isinstance(got, (list, tuple)) or any(not isinstance(a, str) for a in got):
                raise CheckFailure(f"{what}: expected a list of action strings like '0F0', got {_shown(got)}")
            got = list(got)
            want = _torch_1f1b(rank, p, M)
            if got != want:
                bad = [a for a in got if not re.fullmatch(r"\d+[FB]\d+", a)]
                fs = [a for a in got if "F" in a]
                why = (" (an action is written stage, F or B, microbatch: '1F0', '1B0')" if bad else
                       " (every forward before the first backward: that is GPipe, which keeps M microbatches "
                       "in flight)" if got == _gpipe(rank, p, M) else
                       f" (expected M={M} forwards and M backwards)" if len(got) != 2 * M else
                       " (each rank runs its own stage: the stage index is the rank's)"
                       if any(not a.startswith(str(rank)) for a in got) else
                       " (forwards and backwards are out of order: how many forwards fill the pipeline "
                       "before rank r's first backward?)" if sorted(got) == sorted(want) and len(fs) == M else "")
                raise CheckFailure(f"{what}: rank {rank}, p={p}, M={M}: not torch's order{why}")
    return case


ex175.case("p = 2, M = 4")(_schedule_case(2, 4, [0, 1], "1F1B"))
ex175.case("p = 4, M = 4")(_schedule_case(4, 4, [0, 2, 3], "1F1B"))
ex175.case("p = 4, M = 8, every rank", hidden=True)(_schedule_case(4, 8, [0, 1, 2, 3], "1F1B"))


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case  # noqa: E402


def _pairs_draw(r):
    places = ["Replicate()", "Partial()"] + [f"Shard({k})" for k in range(3)]
    pairs = []
    for _ in range(4):
        src = r.choice(places)
        dst = r.choice([q for q in places if q != "Partial()" or src in ("Partial()", "Replicate()")])
        pairs.append((src, dst))
    return pairs, "random placements"


def _mesh_draw(r):
    n = r.choice([3, 4])
    shape = tuple(r.randint(1, 4) for _ in range(n))
    names = ("pp", "dp", "tp") if n == 3 else ("pp", "dp_replicate", "dp_shard", "tp")
    k = r.randint(1, 2)
    dims = tuple(sorted(r.sample(range(n), k)))
    dims = names[dims[0]] if k == 1 else tuple(names[i] for i in dims)
    ranks = [r.randrange(math.prod(shape)) for _ in range(2)]
    return shape, names, dims, ranks, "random mesh"


def _fsdp_draw(r):
    shapes = [tuple(r.randint(1, 40) for _ in range(r.randint(1, 2))) for _ in range(r.randint(1, 5))]
    return shapes, r.randint(1, 8), "random shapes"


def _schedule_draw(r):
    p = r.randint(1, 6)
    M = r.randint(p, 3 * p)
    return p, M, [r.randrange(p)], "1F1B (random p, M)"


fresh_case(ex171, "random placements", _pairs_draw, _redistribute_case)
fresh_case(ex172, "random SP flag", lambda r: (r.random() < 0.5, "block_plan(random)"), _plan_case)
fresh_case(ex173, "random meshes", _mesh_draw, _mesh_case)
fresh_case(ex174, "random shapes and d", _fsdp_draw, _fsdp_case)
fresh_case(ex175, "random p and M", _schedule_draw, _schedule_case)
