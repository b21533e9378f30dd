"""The plan's arithmetic: which units a rank holds, how layers split into stages, path patterns."""

from __future__ import annotations

import pytest

from mlx_loom.parallel import Split, Units, stage_ranges
from mlx_loom.parallel.plan import matches, sizes_that_work, units_check


def test_units_split_evenly_into_contiguous_blocks():
    heads = Units("num_attention_heads", 8)
    assert [heads.local(r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_units_that_do_not_divide_do_not_fit():
    assert not Units("num_attention_heads", 6).fits(4)
    assert Units("num_attention_heads", 6).fits(3)


def test_replicable_units_give_each_rank_the_one_its_queries_read():
    # 8 query heads, 2 key/value heads, 4 ranks: ranks 0-1 read head 0, ranks 2-3 head 1,
    # the same heads grouped-query attention pairs with their query heads.
    kv = Units("num_key_value_heads", 2, replicable=True)
    heads = Units("num_attention_heads", 8)
    assert kv.fits(4)
    for rank in range(4):
        start, stop = heads.local(rank, 4)
        assert kv.local(rank, 4) == (start // 4, start // 4 + 1)  # 4 query heads per kv head


def test_replicable_units_still_need_the_group_to_be_a_multiple():
    assert not Units("num_key_value_heads", 2, replicable=True).fits(3)


def test_the_sizes_that_work_pass_every_check():
    checks = (units_check(Units("a", 12)), units_check(Units("b", 8)))
    assert sizes_that_work(checks) == [2, 4]


def test_a_star_matches_exactly_one_path_component():
    assert matches("model.layers.*.mlp", "model.layers.3.mlp")
    assert not matches("model.layers.*.mlp", "model.layers.3.block.mlp")
    assert not matches("model.layers.*.mlp", "model.layers.3.mlp.down_proj")


def test_a_split_without_segments_covers_the_whole_dimension():
    split = Split("x", Units("h", 4))
    assert [s.size for s in split.segments(128)] == [128]


def test_stages_are_as_even_as_the_layer_count_allows():
    assert stage_ranges(5, 2) == [(0, 3), (3, 5)]
    assert stage_ranges(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_a_kept_range_is_never_cut():
    # Layers 1-4 must share a stage (KV donors and the layers reading them).
    assert stage_ranges(5, 2, ((1, 5),)) == [(0, 1), (1, 5)]
    assert stage_ranges(10, 2, ((2, 9),)) == [(0, 2), (2, 10)]


@pytest.mark.parametrize(
    ("layers", "size", "keep"), [(2, 3, ()), (5, 3, ((1, 5),)), (4, 2, ((0, 4),))]
)
def test_no_split_exists_without_enough_boundaries(layers, size, keep):
    assert stage_ranges(layers, size, keep) is None
