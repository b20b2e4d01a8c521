"""ProcessGrid: Megatron-Core's rank order (TP innermost, then CP, DP, PP outermost) as a named mesh,
EP folded onto DP, and the groups it builds equal to what its arithmetic says."""
import pytest
import torch
import torch.distributed as dist

from labkit.dist import launch
from labkit.grid import AXES, Mesh, ProcessGrid


def _formula(r, t, c, d):
    """Megatron-LM's order written out: rank = ((pp * d + dp) * cp + cp_rank) * t + tp."""
    return {"tp": r % t, "cp": (r // t) % c, "dp": (r // (t * c)) % d, "pp": r // (t * c * d)}


@pytest.mark.parametrize("t,c,d,p", [(2, 1, 2, 2), (1, 1, 4, 1), (2, 2, 1, 3), (4, 1, 1, 2), (1, 3, 2, 1)])
def test_coords_and_rank_of_follow_megatrons_order(t, c, d, p):
    g = ProcessGrid(tp=t, cp=c, dp=d, pp=p)
    assert AXES == ("pp", "dp", "cp", "tp") and g.world == t * c * d * p
    for r in range(g.world):
        assert g.coords(r) == _formula(r, t, c, d)
        assert g.rank_of(**g.coords(r)) == r
    for axis in AXES:
        groups = g.all_ranks(axis)
        assert sorted(x for grp in groups for x in grp) == list(range(g.world))   # a partition
        for grp in groups:                      # members differ only in this axis, in coordinate order
            cs = [g.coords(x) for x in grp]
            assert [cc[axis] for cc in cs] == list(range(g.sizes[axis]))
            assert all({a: v for a, v in cc.items() if a != axis} == {a: v for a, v in cs[0].items() if a != axis}
                       for cc in cs)


def test_named_groups_of_a_2x2x2_grid():
    g = ProcessGrid(tp=2, pp=2, dp=2, rank=5)
    assert (g.tp_rank, g.dp_rank, g.pp_rank, g.cp_rank) == (1, 0, 1, 0)
    assert g.ranks("tp") == [4, 5] and g.ranks("dp") == [5, 7] and g.ranks("pp") == [1, 5] == g.pp_ranks
    assert g.all_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.rank_of(pp=1) == 4 and g.rank_of(pp=1, dp=1, tp=1) == 7


def test_ep_is_folded_onto_dp():
    """ep = d (default): the EP group is the DP group; ep < d: ep consecutive DP ranks hold different
    experts, and the d/ep EP groups of a DP group replicate them (expert data parallelism)."""
    g = ProcessGrid(tp=2, dp=4)
    assert g.all_ranks("ep") == g.all_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    g = ProcessGrid(tp=2, dp=4, ep=2, rank=5)
    assert g.all_ranks("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.all_ranks("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (g.ep_rank, g.edp, g.ranks("ep"), g.ranks("edp")) == (0, 2, [5, 7], [1, 5])


@pytest.mark.parametrize("kwargs,message", [
    ({"tp": 0}, r"tp=0: every degree of the grid must be an integer >= 1"),
    ({"dp": 2.0}, r"dp=2.0: every degree"),
    ({"dp": 4, "ep": 3}, r"ep=3 must be an integer >= 1 that divides dp=4"),
    ({"tp": 2, "rank": 2}, r"rank 2 is outside the grid's ranks 0..1"),
])
def test_bad_grids_are_refused_with_the_rule(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProcessGrid(**kwargs)


def test_bad_coordinates_are_refused():
    g = ProcessGrid(tp=2, pp=2)
    with pytest.raises(ValueError, match=r"pp=2 is outside 0..1"):
        g.rank_of(pp=2)
    with pytest.raises(ValueError, match=r"unknown axis 'ep_rank'"):
        g.rank_of(ep_rank=0)
    with pytest.raises(ValueError, match=r"rank 4 is outside"):
        g.coords(4)
    with pytest.raises(ValueError, match=r"no rank"):
        g.ranks("tp")


def _members(ctx):
    """Each built group's members, found by an all-reduce over it (not by the grid's arithmetic)."""
    g = ProcessGrid.build(ctx, tp=2, cp=2, dp=2, ep=1)
    out = {}
    for axis in ("tp", "cp", "dp", "pp", "ep", "edp"):
        x = torch.zeros(ctx.world_size)
        x[ctx.rank] = 1
        dist.all_reduce(x, group=g.group(axis))
        out[axis] = [i for i, m in enumerate(x.tolist()) if m]
    return out, {axis: g.ranks(axis) for axis in out}


def test_built_groups_hold_the_ranks_the_mesh_names():
    res = launch(_members, 8, timeout=20)
    for measured, named in res:
        assert measured == named
    m0, m5 = res[0][0], res[5][0]
    assert m0["cp"] == [0, 2] and m5["cp"] == [5, 7] and m5["tp"] == [4, 5] and m5["dp"] == [1, 5]
    assert m5["pp"] == [5] and m5["ep"] == [5] and m5["edp"] == [1, 5]


def test_shard_is_the_rank_s_part_along_one_axis():
    x = torch.arange(12).view(6, 2)
    mesh = Mesh(dp=3, tp=2)
    assert [mesh.shard(x, "dp", r).tolist() for r in (0, 1, 4, 5)] == [[[0, 1], [2, 3]], [[0, 1], [2, 3]],
                                                                      [[8, 9], [10, 11]], [[8, 9], [10, 11]]]
    assert mesh.shard(x, "tp", 3, dim=1).tolist() == [[1], [3], [5], [7], [9], [11]]
    grid = ProcessGrid(tp=2, dp=3, rank=2)                  # dp coordinate 1
    assert grid.shard(x, "dp").tolist() == [[4, 5], [6, 7]] and grid.part(8, "tp") == slice(0, 4)
    assert ProcessGrid(tp=2, dp=3).part(8, "tp", rank=5) == slice(4, 8)
    with pytest.raises(ValueError, match="this grid has no rank"):
        ProcessGrid(tp=2).shard(x, "tp")
    with pytest.raises(ValueError, match="5 rows along dim 0 cannot be split evenly over dp=3 ranks"):
        mesh.shard(x[:5], "dp", 0)
    with pytest.raises(ValueError, match="unknown axis 'ep'"):
        mesh.shard(x, "ep", 0)


def test_even_part_is_the_one_split_of_n_items_over_an_axis():
    from labkit.grid import even_part

    # 12 experts over ep = 3: ranks hold 0-3, 4-7, 8-11 (Megatron-Core's local_expert_indices)
    assert [even_part(12, 3, i) for i in range(3)] == [slice(0, 4), slice(4, 8), slice(8, 12)]
    g = ProcessGrid(tp=2, pp=1, dp=3)
    assert [g.part(12, "dp", r) for r in range(6)] == [even_part(12, 3, r // 2) for r in range(6)]
    for args, msg in [((10, 3, 0), "cannot be split evenly into 3 parts"), ((12, 3, 3), "part 3 is outside 0..2"),
                      ((12, 0, 0), "into 0 parts"), ((12, 3, -1), "outside 0..2")]:
        with pytest.raises(ValueError, match=msg):
            even_part(*args)
