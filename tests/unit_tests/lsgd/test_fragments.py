"""Fragment partitions: sizes, strides, where the embedding and head go, bad input."""

from types import SimpleNamespace

import pytest

from megatron_lsgd.core.lsgd.fragments import fragment_of, partition


def units(names):
    return [SimpleNamespace(name=n) for n in names]


ALL = ["embedding"] + [f"layers.{i}" for i in range(10)] + ["output"]


def test_sequential_blocks_differ_by_at_most_one_layer():
    groups = partition(units(ALL), 10, 4, "sequential", tied_embeddings=False)
    layers = [[u.name for u in g if u.name.startswith("layers.")] for g in groups]
    assert [len(g) for g in layers] == [3, 3, 2, 2]
    assert sum(layers, []) == [f"layers.{i}" for i in range(10)]  # contiguous, in order
    assert groups[0][0].name == "embedding" and groups[-1][-1].name == "output"


def test_strided_spreads_every_fragment_over_the_depth():
    groups = partition(units(ALL), 10, 4, "strided", tied_embeddings=False)
    assert [u.name for u in groups[1]] == ["layers.1", "layers.5", "layers.9", "output"]
    assert [u.name for u in groups[0]] == ["embedding", "layers.0", "layers.4", "layers.8"]


@pytest.mark.parametrize("mode", ["sequential", "strided"])
def test_tied_head_syncs_with_the_embedding(mode):
    assert fragment_of("output", 10, 4, mode, tied_embeddings=True) == fragment_of("embedding", 10, 4, mode, True)


def test_a_pipeline_stage_gets_the_same_answer_for_its_own_units():
    stage1 = units(["layers.5", "layers.6", "layers.7", "layers.8", "layers.9", "output"])
    whole = partition(units(ALL), 10, 3, "sequential", False)
    mine = partition(stage1, 10, 3, "sequential", False)
    for k in range(3):
        assert [u.name for u in mine[k]] == [u.name for u in whole[k] if u.name in {x.name for x in stage1}]


@pytest.mark.parametrize("k,mode,message", [(0, "strided", "need 1 <= fragments"), (11, "strided", "need 1 <= fr"),
                                            (2, "random", "choose one of sequential, strided")])
def test_bad_partitions(k, mode, message):
    with pytest.raises(ValueError, match=message):
        fragment_of("layers.0", 10, k, mode, False)
