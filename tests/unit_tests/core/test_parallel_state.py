import pytest

from megatron_lsgd.core.parallel_state import ParallelDims, enumerate_group_ranks


def test_rank_order_tp_fastest_then_dp_intra_pp_site():
    d = ParallelDims(tp=2, pp=2, dp_intra=2, sites=2)
    assert d.world_size == 16 and d.dp == 4
    assert d.rank_of(tp=1, dp_intra=0, pp=0, site=0) == 1
    assert d.rank_of(tp=0, dp_intra=1, pp=0, site=0) == 2
    assert d.rank_of(tp=0, dp_intra=0, pp=1, site=0) == 4
    assert d.rank_of(tp=0, dp_intra=0, pp=0, site=1) == 8
    for r in range(d.world_size):
        c = d.coords(r)
        assert d.rank_of(c.tp, c.dp_intra, c.pp, c.site) == r


def test_sites_are_contiguous_blocks():
    d = ParallelDims(tp=2, pp=2, dp_intra=2, sites=2)
    groups = enumerate_group_ranks(d)
    assert groups["site"] == [tuple(range(0, 8)), tuple(range(8, 16))]


def test_every_kind_partitions_the_world():
    d = ParallelDims(tp=2, pp=2, dp_intra=2, sites=3)
    groups = enumerate_group_ranks(d)
    for kind in ("tp", "pp", "dp", "dp_intra", "dp_inter", "model_parallel", "site"):
        members = sorted(r for g in groups[kind] for r in g)
        assert members == list(range(d.world_size)), kind
    assert all(len(g) == 3 for g in groups["dp_inter"])
    assert all(len(g) == 6 for g in groups["dp"])
    # dp_inter: same (tp, pp, dp_intra) on every site
    for g in groups["dp_inter"]:
        coords = [d.coords(r) for r in g]
        assert len({(c.tp, c.pp, c.dp_intra) for c in coords}) == 1
        assert [c.site for c in coords] == [0, 1, 2]
    # embedding: first and last stage of one (tp, dp_intra, site)
    for g in groups["embedding"]:
        assert [d.coords(r).pp for r in g] == [0, 1]


@pytest.mark.parametrize("world,tp,pp,sites,flag", [
    (6, 4, 1, 1, "--tensor-model-parallel-size"),
    (8, 2, 2, 3, "--num-sites"),
    (4, 0, 1, 1, "--tensor-model-parallel-size"),
    (4, 1, 1, 0, "--num-sites"),
])
def test_bad_layouts_name_the_flag(world, tp, pp, sites, flag):
    with pytest.raises(ValueError, match=flag):
        ParallelDims.from_world(world, tp, pp, sites)


def test_from_world_derives_dp_intra():
    assert ParallelDims.from_world(16, 2, 2, 2) == ParallelDims(tp=2, pp=2, dp_intra=2, sites=2)
