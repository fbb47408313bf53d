"""Sites of different tensor x pipeline layouts under diloco (--site-tensor-model-parallel-sizes,
--site-pipeline-model-parallel-sizes; docs/heterogeneous_sites.md, core/lsgd/canonical_exchange.py).

- the layout: per-site coordinates, the lanes of the canonical form and their groups (pure).
"""

from __future__ import annotations

from megatron_lsgd.core.parallel_state import ParallelDims, enumerate_group_ranks

# ---- layout --------------------------------------------------------------------------------------
def test_a_tp2_pp2_site_beside_a_tp1_site():
    d = ParallelDims.from_world(5, 1, 1, 2, None, [2, 1], [2, 1])
    assert d.mixed_layouts and d.world_size == 5 and d.dp_intra == 1 and d.dp == 2
    assert [d.ranks_of_site(s) for s in (0, 1)] == [4, 1] and d.site_start(1) == 4
    assert [(c.site, c.tp, c.pp) for c in map(d.coords, range(5))] == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1),
                                                                      (1, 0, 0)]
    for r in range(5):
        c = d.coords(r)
        assert d.rank_of(c.tp, c.dp_intra, c.pp, c.site) == r
    assert (d.for_site(0).tp, d.for_site(0).pp, d.for_site(1).tp, d.for_site(1).pp) == (2, 2, 1, 1)
    groups = enumerate_group_ranks(d)
    assert groups["tp"] == [(0, 1), (2, 3), (4,)] and groups["site"] == [(0, 1, 2, 3), (4,)]
    # L = lcm(4, 1) lanes of the canonical form: site 0's rank j holds lane j, site 1's rank all four
    assert d.lanes == 4 and groups["dp_inter"] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert groups["dp"] == [] and groups["last_stages"] == [(2, 3, 4)]
    assert d.vocab_tp == 2


def test_replicas_and_lanes_with_two_replicas_per_site():
    d = ParallelDims.from_world(6, 1, 1, 2, None, [2, 1])
    assert d.dp_intra == 2 and d.site_pp == (1, 1) and d.lanes == 4 and d.lanes_of(1, 1) == [2, 3]
    assert enumerate_group_ranks(d)["dp_inter"] == [(0, 4), (1, 4), (2, 5), (3, 5)]


def test_one_layout_after_all_is_the_plain_layout():
    assert ParallelDims.from_world(4, 1, 1, 2, None, [2, 2]) == ParallelDims.from_world(4, 2, 1, 2)
