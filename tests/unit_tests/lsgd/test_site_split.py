"""The split of inter-site traffic across a site's DP_intra ranks (site_split.SiteSplit), for every
algorithm: 2 sites x DP_intra 2 without ZeRO-1 (every rank of a site holds the same copy)
must put on each rank's link half of the site's bytes, as ZeRO-1's shards do, and every
replica must end bit-identical. One spawn runs every configuration back to back."""

from __future__ import annotations

import pytest

from tests.unit_tests.harness import assert_replicas_identical, run_distributed_many
from tests.unit_tests.lsgd.test_algorithms import COMMON

SITES2_DP2 = ["--num-sites", "2", "--ddp-bucket-size", "5000", "--train-iters", "6"]
ZERO1 = ["--use-distributed-optimizer"]
ALGORITHMS = {
    "sync": ["--lsgd-algorithm", "sync"],
    "diloco": ["--lsgd-algorithm", "diloco", "--lsgd-interval", "2"],
    "dilocox-int8": ["--lsgd-algorithm", "dilocox", "--lsgd-interval", "2", "--lsgd-compression", "int8"],
    "streaming-diloco": ["--lsgd-algorithm", "streaming-diloco", "--lsgd-interval", "4", "--lsgd-fragments", "2"],
    "cocodc": ["--lsgd-algorithm", "cocodc", "--lsgd-interval", "4", "--lsgd-fragments", "2"],
    "edit": ["--lsgd-algorithm", "edit", "--lsgd-interval", "2"],
    "dreamddp": ["--lsgd-algorithm", "dreamddp", "--lsgd-interval", "1"],  # H = 1: no timed schedule
    "acco": ["--lsgd-algorithm", "acco", "--global-batch-size", "16"],  # two micro-batches: one per stage
    "dpu": ["--lsgd-algorithm", "dpu"],
}
# a-edit is left out: its sites' step counts, so its bytes, depend on timing.


def _site_bytes(records, site):
    return [r["comm"]["bytes_sent"] for r in records if r["coords"].site == site]


@pytest.mark.slow
def test_every_algorithm_splits_a_sites_traffic_over_its_dp_intra_ranks():
    argvs = []
    for flags in ALGORITHMS.values():
        argvs += [COMMON + SITES2_DP2 + flags, COMMON + SITES2_DP2 + flags + ZERO1]
    runs = run_distributed_many(argvs, 4)
    for i, name in enumerate(ALGORITHMS):
        plain, zero1 = runs[2 * i], runs[2 * i + 1]
        assert_replicas_identical(plain)
        for site in (0, 1):
            mine, sharded = _site_bytes(plain, site), _site_bytes(zero1, site)
            assert sum(sharded) > 0, name
            # the site moves what ZeRO-1's shards move (not DP_intra times that) ...
            assert abs(sum(mine) / sum(sharded) - 1) < 0.02, (name, mine, sharded)
            # ... and each of its two ranks carries half of it (block padding aside)
            assert max(mine) < 0.51 * sum(mine), (name, mine)
