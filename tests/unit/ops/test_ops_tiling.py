"""Tiling arithmetic of the custom operators (the shared C++ the Ascend host and the CPU kernels run).

Checked through the CPU libraries' query hooks: every element is covered exactly
once, core ranges and tiles are 32-byte aligned, tail tiles and shapes that do
not divide come out right, UB budgets are respected, and impossible budgets are
refused.
"""

import numpy as np
import pytest

from ms_deepseek.ops.tiling import TilingError, schedule, tiling

from npu_cases import PENALTY_IDS_STREAMED, SOFTMAX_SHORT_LAST_TILE

BLOCK = 32
RESERVE = 1024  # msds::kUbReserveBytes


# --------------------------------------------------------------------------- softmax

SOFTMAX_PROBLEMS = [
    # rows, cols, in_bytes, num_inputs, core_num, ub_bytes
    (1, 1, 4, 1, 48, 196352),
    (7, 10, 4, 1, 48, 196352),  # fewer rows than cores
    (97, 33, 2, 1, 8, 196352),  # rows do not divide over cores, cols not a block multiple
    (1000, 129, 4, 2, 48, 196352),  # backward: two input streams
    (64, 4096, 2, 1, 40, 196352),  # several rows per tile
    (5, 203, 4, 1, 3, 4096),  # a row does not fit: column tiles with a tail
    (9, 1000, 2, 1, 4, 4096),
    (3, 8, 4, 1, 2, 1024 + 352 + 8 * 20),  # exactly one aligned row fits
    (4096, 4096, 4, 1, 48, 196352),  # attention scores at S = 4096, float32: two rows per tile
]


def _per_elem(in_bytes, num_inputs, mode):
    """Double-buffered input(s) and float32 output, a float32 scratch, and a float32 work buffer
    except for whole rows of float32 input (they go from the input queue into the SoftMax API)."""
    work = 0 if (mode == 0 and in_bytes == 4) else 4
    return 2 * in_bytes * num_inputs + 2 * 4 + 4 + work


# Per row besides its elements: max and sum (a block each) and the SoftMax API's 8 + 64 extra
# temporary floats per row (asc-devkit v9.0.0 softmax_tiling.cpp GetSoftMaxMaxTmpSize, float, A2).
ROW_EXTRA = 2 * BLOCK + (8 + 64) * 4


def _column_stats(col_tiles):
    """Column mode: per-tile max and sum arrays (block aligned) and one block for a reduction."""
    return 2 * -(-col_tiles // 8) * 8 * 4 + BLOCK


@pytest.mark.parametrize("problem", SOFTMAX_PROBLEMS, ids=lambda p: "x".join(map(str, p)))
def test_softmax_tiling_covers_every_element_once_within_ub(problem):
    rows, cols, in_bytes, num_inputs, core_num, ub = problem
    kw = dict(rows=rows, cols=cols, in_bytes=in_bytes, num_inputs=num_inputs, core_num=core_num, ub_bytes=ub)
    t = tiling("fp32_softmax", **kw)
    assert t["align"] * in_bytes == BLOCK
    assert t["cols_aligned"] % t["align"] == 0 and cols <= t["cols_aligned"] < cols + t["align"]
    assert t["used_cores"] == min(core_num, rows)
    seen = np.zeros((rows, cols), np.int32)
    rows_per_core = {}
    for tile in schedule("fp32_softmax", **kw):
        r0, n, c0, m = tile["row_start"], tile["rows"], tile["col_start"], tile["cols"]
        assert n >= 1 and m >= 1
        seen[r0 : r0 + n, c0 : c0 + m] += 1
        if c0 == 0:
            rows_per_core[tile["core"]] = rows_per_core.get(tile["core"], 0) + n
        if t["mode"] == 0:  # whole rows: a tile of n padded rows fits in UB
            assert n <= t["rows_per_tile"]
            assert n * (t["cols_aligned"] * _per_elem(in_bytes, num_inputs, 0) + ROW_EXTRA) <= ub - RESERVE
        else:  # column tiles start on a block boundary and fit in UB
            assert n == 1 and m <= t["col_tile"] and (c0 * in_bytes) % BLOCK == 0
            assert t["col_tile"] * _per_elem(in_bytes, num_inputs, 1) + _column_stats(t["col_tiles"]) <= ub - RESERVE
    assert (seen == 1).all()
    counts = list(rows_per_core.values())
    assert len(counts) == t["used_cores"] and max(counts) - min(counts) <= 1


def test_softmax_tiling_modes_and_tails():
    t = tiling("fp32_softmax", rows=5, cols=203, in_bytes=4, num_inputs=1, core_num=3, ub_bytes=4096)
    assert t["mode"] == 1  # 208 * 20 + 352 bytes per row > 3072
    assert t["col_tile"] == 120  # (3072 - 96) // 24 = 124 -> 120 (block multiple)
    assert t["col_tiles"] == 2 and t["col_tail"] == 83
    t = tiling("fp32_softmax", rows=100, cols=64, in_bytes=2, num_inputs=1, core_num=48, ub_bytes=196352)
    assert t["mode"] == 0 and (t["base_rows"], t["big_cores"]) == (2, 4)  # 4 cores get 3 rows
    assert t["rows_per_tile"] == 3


def test_softmax_tiling_float32_whole_rows_have_no_work_buffer():
    """Whole rows of float32 input need no float32 work buffer (no cast; the SoftMax API reads the
    input queue): 20 bytes per element, not 24. A row of 4096 floats: 4096 * 20 + 352 = 82272
    bytes, two rows in 195328; with the work buffer (98656 bytes a row) only one."""
    t = tiling("fp32_softmax", rows=96, cols=4096, in_bytes=4, num_inputs=1, core_num=48, ub_bytes=196352)
    assert (t["mode"], t["rows_per_tile"]) == (0, 2)
    # 16-bit input keeps it (the cast to float32): 4096 * (4 + 8 + 4 + 4) + 352 = 82272 bytes, two rows
    t = tiling("fp32_softmax", rows=96, cols=4096, in_bytes=2, num_inputs=1, core_num=48, ub_bytes=196352)
    assert (t["mode"], t["rows_per_tile"]) == (0, 2)
    # column tiles load into it whatever the dtype: (3072 - 96) // 24 = 124 -> 120
    t = tiling("fp32_softmax", rows=1, cols=1000, in_bytes=4, num_inputs=1, core_num=1, ub_bytes=4096)
    assert (t["mode"], t["col_tile"]) == (1, 120)


@pytest.mark.parametrize("shape", SOFTMAX_SHORT_LAST_TILE, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("in_bytes", [4, 2])
def test_npu_softmax_shapes_reach_a_short_last_tile(shape, in_bytes):
    """The NPU test's shapes (tests/helpers/npu_cases.py) on the 910B schedule: whole rows, and a
    tile shorter than rows_per_tile, where the SoftMax API re-derives its split on the device."""
    kw = dict(rows=shape[0], cols=shape[1], in_bytes=in_bytes, num_inputs=1, core_num=48, ub_bytes=196352)
    t = tiling("fp32_softmax", **kw)
    assert t["mode"] == 0
    assert any(tile["rows"] < t["rows_per_tile"] for tile in schedule("fp32_softmax", **kw))


def test_softmax_tiling_many_column_tiles_keep_their_statistics_in_ub():
    # 25 tiles of 32 floats: the per-tile max / sum arrays (2 * 32 floats + a block) come out of
    # the same UB as the tile
    t = tiling("fp32_softmax", rows=1, cols=800, in_bytes=4, num_inputs=1, core_num=1, ub_bytes=1024 + 1100)
    assert t["mode"] == 1 and (t["col_tile"], t["col_tiles"]) == (32, 25)
    assert t["col_tile"] * 24 + _column_stats(t["col_tiles"]) <= 1100
    with pytest.raises(TilingError) as err:  # more tiles than a tile holds statistics for
        tiling("fp32_softmax", rows=1, cols=100000, in_bytes=4, num_inputs=1, core_num=1, ub_bytes=1024 + 1100)
    assert err.value.status == 2


def test_softmax_tiling_refuses_impossible_problems():
    with pytest.raises(TilingError) as err:  # not even one block of columns fits
        tiling("fp32_softmax", rows=2, cols=100, in_bytes=4, num_inputs=1, core_num=1, ub_bytes=1200)
    assert err.value.status == 2
    with pytest.raises(TilingError) as err:
        tiling("fp32_softmax", rows=2, cols=100, in_bytes=8, num_inputs=1)
    assert err.value.status == 3
    with pytest.raises(TilingError) as err:
        tiling("fp32_softmax", rows=-1, cols=100, in_bytes=4, num_inputs=1)
    assert err.value.status == 1
    empty = tiling("fp32_softmax", rows=0, cols=7, in_bytes=4, num_inputs=1)
    assert empty["used_cores"] == 0
    assert schedule("fp32_softmax", rows=0, cols=7, in_bytes=4, num_inputs=1) == []


# --------------------------------------------------------------------------- expert lookup

LOOKUP_PROBLEMS = [
    # slots, num_experts, experts_per_rank, capacity, core_num, ub_bytes
    (1, 4, 2, 1, 48, 196352),
    (37 * 3, 8, 2, 15, 48, 196352),  # fewer aligned chunks than cores
    (4096 * 6, 160, 20, 300, 48, 196352),  # DeepSeek-V2 routing of 4096 tokens
    (1000, 64, 8, 40, 7, 4096),  # small UB: several tiles per core, a tail tile
    (8 * 5, 4, 4, 0, 5, 196352),  # exactly divisible
]


@pytest.mark.parametrize("problem", LOOKUP_PROBLEMS, ids=lambda p: "x".join(map(str, p)))
@pytest.mark.parametrize("groups", [1, 4])
def test_expert_lookup_tiling_covers_slots_in_order(problem, groups):
    slots, e, e_local, capacity, core_num, ub = problem
    kw = dict(
        slots=slots * groups,
        groups=groups,
        num_experts=e,
        experts_per_rank=e_local,
        capacity=capacity,
        core_num=core_num,
        ub_bytes=ub,
    )
    t = tiling("expert_lookup", **kw)
    assert (t["groups"], t["group_slots"]) == (groups, slots)
    assert t["chunk"] % 8 == 0 and t["tile"] % 8 == 0 and t["hist_stride"] % 8 == 0
    # one counter per (group, expert) in each core's workspace row
    assert t["hist_stride"] >= groups * e and t["workspace_bytes"] == t["used_cores"] * t["hist_stride"] * 4
    assert 1 <= t["used_cores"] <= core_num
    assert 0 < t["last_chunk"] <= t["chunk"]
    fixed = (2 * -(-e // 8) * 8 + 2 * -(-(groups * e) // 8) * 8) * 4
    # ids in, four outputs: one int32/float32 buffer each, and no more (no half-used double buffers)
    assert t["tile"] == min(t["chunk"], (ub - RESERVE - fixed) // 20 // 8 * 8)
    tiles = schedule("expert_lookup", **kw)
    expected_start = 0
    for tile in tiles:  # contiguous, in order: the k-major order is preserved
        assert tile["start"] == expected_start and 1 <= tile["slots"] <= t["tile"]
        expected_start += tile["slots"]
    assert expected_start == slots * groups
    for core in range(t["used_cores"]):
        first = next(x for x in tiles if x["core"] == core)
        assert first["start"] == core * t["chunk"] and (first["start"] * 4) % BLOCK == 0


def test_expert_lookup_tiling_edges():
    t = tiling("expert_lookup", slots=0, num_experts=4, experts_per_rank=2, capacity=1)
    assert t["used_cores"] == 0 and t["workspace_bytes"] == 0
    assert schedule("expert_lookup", slots=0, num_experts=4, experts_per_rank=2, capacity=1) == []
    t = tiling("expert_lookup", slots=100, num_experts=4, experts_per_rank=2, capacity=1, core_num=3)
    assert (t["chunk"], t["used_cores"], t["last_chunk"]) == (40, 3, 20)  # ceil(100/3)=34 -> 40
    with pytest.raises(TilingError) as err:  # the placement table alone overflows UB
        tiling("expert_lookup", slots=10, num_experts=1000, experts_per_rank=10, capacity=1, ub_bytes=8192)
    assert err.value.status == 2
    with pytest.raises(TilingError):
        tiling("expert_lookup", slots=10, num_experts=4, experts_per_rank=2, capacity=-1)
    with pytest.raises(TilingError) as err:  # the stream does not split into equal groups
        tiling("expert_lookup", slots=10, groups=3, num_experts=4, experts_per_rank=2, capacity=1)
    assert err.value.status == 1


# --------------------------------------------------------------------------- repetition penalty

PENALTY_PROBLEMS = [
    # batch, vocab, length, core_num, ub_bytes
    (1, 102400, 4096, 48, 196352),  # DeepSeek-V2 vocabulary
    (3, 97, 11, 48, 196352),
    (2, 50, 200, 3, 4096),  # ids in several UB loads, tiles span rows
    (4, 1000, 0, 7, 2048),  # empty prefix
]


@pytest.mark.parametrize("problem", PENALTY_PROBLEMS, ids=lambda p: "x".join(map(str, p)))
def test_repetition_penalty_tiling_covers_logits_once(problem):
    b, v, length, core_num, ub = problem
    kw = dict(batch=b, vocab=v, length=length, core_num=core_num, ub_bytes=ub)
    t = tiling("repetition_penalty", **kw)
    assert t["chunk"] % 8 == 0 and t["tile"] % 8 == 0 and t["id_tile"] % 8 == 0
    # one tile of float32, its "done" mask (a bit per element, int32 words, block aligned), one id load
    mask_bytes = -(-(-(-t["tile"] // 32)) // 8) * 8 * 4  # noqa: B002 (ceiling divisions)
    assert t["tile"] * 4 + mask_bytes + t["id_tile"] * 4 <= ub - RESERVE
    covered = np.zeros(b * v, np.int32)
    for tile in schedule("repetition_penalty", **kw):
        start, n = tile["start"], tile["len"]
        assert 1 <= n <= t["tile"]
        covered[start : start + n] += 1
        assert tile["first_row"] == start // v and tile["last_row"] == (start + n - 1) // v
        assert tile["first_row"] == tile["last_row"]  # a tile never spans two rows
    assert (covered == 1).all()
    cores = {tile["core"] for tile in schedule("repetition_penalty", **kw)}
    assert cores == set(range(t["used_cores"]))
    for core in cores:
        start = min(x["start"] for x in schedule("repetition_penalty", **kw) if x["core"] == core)
        assert (start * 4) % BLOCK == 0


def test_repetition_penalty_tiling_ids_in_one_load_or_streamed():
    """DeepSeek-V2 decode: a 4096-id prefix is loaded once per row segment (L <= id_tile) and the
    UB left over holds large tiles; a longer prefix than a quarter of UB is streamed."""
    t = tiling("repetition_penalty", batch=1, vocab=102400, length=4096)
    assert t["id_tile"] == 4096 and t["tile"] == t["chunk"] == 2136  # one tile per core
    t = tiling("repetition_penalty", batch=64, vocab=102400, length=4096)
    assert t["id_tile"] == 4096 and t["tile"] > 36000
    t = tiling("repetition_penalty", batch=1, vocab=102400, length=20000)
    assert t["id_tile"] == (196352 - RESERVE) // 16 // 8 * 8 < 20000


@pytest.mark.parametrize("b, v, length", PENALTY_IDS_STREAMED)
def test_npu_penalty_cases_stream_their_ids(b, v, length):
    """The NPU test's long id lists (tests/helpers/npu_cases.py) take more than one id load on the
    910B schedule (the streamed path)."""
    t = tiling("repetition_penalty", batch=b, vocab=v, length=length, core_num=48, ub_bytes=196352)
    assert t["id_tile"] < length


def test_repetition_penalty_tiling_refuses_tiny_ub():
    with pytest.raises(TilingError) as err:
        tiling("repetition_penalty", batch=1, vocab=10, length=3, core_num=1, ub_bytes=1100)
    assert err.value.status == 2
