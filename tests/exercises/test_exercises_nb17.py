"""Exercises of notebook 17_from_labkit_to_torch: the solutions pass, plausible wrong answers fail a public
case with a message that names the mistake; the plan's truth is labkit's own TP split."""
import math

import pytest
import torch

from labkit.grading.testing import assert_check_fails, assert_check_passes, assert_public_case_fails


def redistribute_collective(src, dst):
    if src == dst or src == "Replicate()":
        return None
    if src == "Partial()":
        return "all_reduce" if dst == "Replicate()" else "reduce_scatter"
    return "all_gather" if dst == "Replicate()" else "all_to_all"


def block_plan(sequence_parallel):
    plan = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
            "attn.out_proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
    if sequence_parallel:
        plan.update({"ln1": "sequence_parallel", "ln2": "sequence_parallel"})
    return plan


def submesh_ranks(shape, names, rank, dims):
    grid = torch.arange(math.prod(shape)).reshape(shape)
    dims = (dims,) if isinstance(dims, str) else dims
    coord = [int(c) for c in torch.nonzero(grid == rank)[0]]
    idx = tuple(slice(None) if n in dims else coord[i] for i, n in enumerate(names))
    return sorted(grid[idx].flatten().tolist())


def fsdp2_local_numel(shapes, d, rank):
    total = 0
    for s in shapes:
        rows = -(-s[0] // d)
        mine = max(0, min(rows, s[0] - rank * rows))
        total += mine * math.prod(s[1:])
    return total


def torch_1f1b_actions(rank, p, M):
    warm = p - 1 - rank
    out = [f"{rank}F{m}" for m in range(warm)]
    for m in range(M - warm):
        out += [f"{rank}F{warm + m}", f"{rank}B{m}"]
    return out + [f"{rank}B{m}" for m in range(M - warm, M)]


def test_solutions_pass():
    assert_check_passes("17.1", redistribute_collective)
    assert_check_passes("17.2", block_plan)
    assert_check_passes("17.2", lambda sp: {**block_plan(sp), "attn": "prepare_input", "mlp": "prepare_input"})
    assert_check_passes("17.3", submesh_ranks)
    assert_check_passes("17.4", fsdp2_local_numel)
    assert_check_passes("17.5", torch_1f1b_actions)


def test_block_plan_truth_is_labkits_split():
    """The 17.2 table is what labkit's ParallelBlock builds: Column/RowParallelLinear, SP marks on the norms."""
    from labkit.dist import launch

    def worker(ctx):
        from labkit.grading.exercises.nb17_from_labkit_to_torch import _block_plan
        from labkit.model import Block, GPTConfig
        from labkit.tensor_parallel import ParallelBlock
        from labkit.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        out = []
        for sp in (False, True):
            blk = ParallelBlock(Block(GPTConfig(n_embd=16, n_head=2)), ctx.group, sequence_parallel=sp)
            got = {n: "colwise" if isinstance(m, ColumnParallelLinear) else "rowwise"
                   for n, m in blk.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
            got.update({n: "sequence_parallel" for n in ("ln1", "ln2")
                        if getattr(blk.get_submodule(n).weight, "sequence_parallel", False)})
            out.append(got == _block_plan(sp))
        return out
    assert launch(worker, 1, backend="gloo")[0] == [True, True]


def test_torch_1f1b_truth_is_the_order_torch_runs():
    from labkit.grading.exercises.nb17_from_labkit_to_torch import _torch_1f1b
    assert _torch_1f1b(1, 2, 4) == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]
    assert _torch_1f1b(0, 2, 4) == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
    assert all(_torch_1f1b(r, p, M) == torch_1f1b_actions(r, p, M) for p in (1, 2, 4) for M in (p, 2 * p + 1)
               for r in range(p))


@pytest.mark.parametrize("wrong, case, contains", [
    (lambda s, d: "all_gather" if s == "Partial()" else redistribute_collective(s, d), "Megatron's g",
     "every rank holds an addend"),
    (lambda s, d: "all_reduce" if s == "Partial()" else redistribute_collective(s, d), "sequence parallelism",
     "moves twice the bytes"),
    (lambda s, d: "all_reduce" if s.startswith("Shard") else redistribute_collective(s, d), "sequence parallelism",
     "disjoint parts of the tensor, not addends"),
    (lambda s, d: "reduce_scatter" if s == "Replicate()" and s != d else redistribute_collective(s, d),
     "Replicate() -> Shard(1)",
     "already holds the whole tensor"),
    (lambda s, d: "all_gather" if s.startswith("Shard") else redistribute_collective(s, d), "Shard(1) -> Shard(2)",
     "moves t times more than needed"),
])
def test_redistribute_mistakes_are_named(wrong, case, contains):
    assert_public_case_fails("17.1", wrong, case, contains=contains)


def _swap(sp, **changes):
    return {**block_plan(sp), **changes}


@pytest.mark.parametrize("wrong, case, contains", [
    (lambda sp: _swap(sp, **{"attn.out_proj": "colwise"}), "tensor parallelism",
     "out_proj's input is this rank's heads"),
    (lambda sp: _swap(sp, **{"mlp.fc1": "rowwise", "mlp.fc2": "colwise"}), "tensor parallelism",
     "GeLU needs whole elements"),
    (lambda sp: _swap(sp, **{"mlp.fc2": "colwise"}), "tensor parallelism", "fc2's input is this rank's FFN columns"),
    (lambda sp: _swap(sp, **{"attn.q_proj": "rowwise"}), "tensor parallelism", "q, k and v take the whole"),
    (lambda sp: {k: v for k, v in block_plan(sp).items() if not k.startswith("ln")}, "tensor + sequence",
     "the LayerNorms run on S/t tokens"),
    (lambda sp: {**block_plan(sp), "ln1": "sequence_parallel", "ln2": "sequence_parallel"}, "tensor parallelism",
     "without SP the LayerNorms see every token"),
    (lambda sp: _swap(sp, ln1="colwise", ln2="colwise") if sp else block_plan(sp), "tensor + sequence",
     "a LayerNorm has no matrix to split"),
])
def test_plan_mistakes_are_named(wrong, case, contains):
    assert_public_case_fails("17.2", wrong, case, contains=contains)


def column_major(shape, names, rank, dims):
    """Wrong: the FIRST dimension innermost (rank = pp + p * (dp + d * tp))."""
    grid = torch.arange(math.prod(shape)).reshape(tuple(reversed(shape))).permute(*reversed(range(len(shape))))
    dims = (dims,) if isinstance(dims, str) else dims
    coord = [int(c) for c in torch.nonzero(grid == rank)[0]]
    idx = tuple(slice(None) if n in dims else coord[i] for i, n in enumerate(names))
    return sorted(grid[idx].flatten().tolist())


@pytest.mark.parametrize("wrong, case, contains", [
    (column_major, "(pp, dp, tp) = (2, 2, 2): mesh['tp']", "column-major layout"),
    (lambda shape, names, rank, dims: [r for r in submesh_ranks(shape, names, rank, dims) if r != rank],
     "(pp, dp, tp) = (2, 2, 2): mesh['tp']", "must contain it"),
])
def test_mesh_mistakes_are_named(wrong, case, contains):
    assert_public_case_fails("17.3", wrong, case, contains=contains)


@pytest.mark.parametrize("wrong, case, contains", [
    (lambda shapes, d, rank: -(-sum(math.prod(s) for s in shapes) // d), "d = 3", "notebook 15's ZeRO-3"),
    (lambda shapes, d, rank: sum(-(-s[0] // d) * math.prod(s[1:]) for s in shapes), "d = 3", "padded size"),
    (lambda shapes, d, rank: sum(s[0] // d * math.prod(s[1:]) for s in shapes), "d = 3", "rows left over"),
    # a learner's sum(numel) // d (rounded down): the flat buffer too, named (it once read only "got 1093 elements")
    (lambda shapes, d, rank: sum(math.prod(s) for s in shapes) // d, "d = 3", "notebook 15's ZeRO-3"),
    # a count that is none of the named mistakes still says where to look
    (lambda shapes, d, rank: 7, "shapes that d = 2 divides", "one parameter at a time"),
])
def test_fsdp_mistakes_are_named(wrong, case, contains):
    assert_public_case_fails("17.4", wrong, case, contains=contains)


@pytest.mark.parametrize("wrong, case, contains", [
    (lambda r, p, M: [f"{r}F{m}" for m in range(M)] + [f"{r}B{m}" for m in range(M)], "p = 2", "that is GPipe"),
    (lambda r, p, M: [a.replace(str(r), "0", 1) for a in torch_1f1b_actions(r, p, M)], "p = 2",
     "the stage index is the rank's"),
    (lambda r, p, M: [f"F{a[1:]}" if a[1] == "F" else a for a in torch_1f1b_actions(r, p, M)], "p = 2",
     "an action is written stage, F or B, microbatch"),
    (lambda r, p, M: torch_1f1b_actions(r, p + 1, M) if r < p else [], "p = 2", "out of order"),
])
def test_schedule_mistakes_are_named(wrong, case, contains):
    assert_public_case_fails("17.5", wrong, case, contains=contains)


def test_a_sub_mesh_of_the_wrong_size_is_named():
    """Issue 36's audit: 17.3's line for a sub-mesh with the wrong number of ranks has a wrong answer: the
    ranks along the LAST named dimension only, when two are asked for."""
    def last_dim_only(shape, names, rank, dims):
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        return submesh_ranks(shape, names, rank, dims[-1:])
    assert_check_fails("17.3", last_dim_only, contains="has as many as the named dimensions' sizes multiply to")
