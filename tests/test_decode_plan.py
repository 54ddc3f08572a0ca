"""decode_plan: the layout a decoding call gets from the model of the GPU (host arithmetic only, no kernel runs)."""
import pytest

from numba_flash.decode_plan import COPY_BANDWIDTH, MULTIPROCESSORS, TIE, decode_plan, estimate, packs, resident_blocks
from numba_flash.tiling import cdiv

# (B, H_q, H_kv, N_q, N, d) of issue 47's table, 16-bit, on the H200's 132 multiprocessors.
ISSUE_16_CASE = (16, 32, 8, 1, 8192, 128)


def plan(batch, q_heads, kv_heads, n_q, n, d, dtype_bytes=2, **options):
    return decode_plan(batch, q_heads, kv_heads, n_q, n, d, dtype_bytes, **options)


def blocks(p, batch, heads):
    """Thread blocks of the plan's launch: a tile per (batch, head, rows) and split."""
    return batch * heads * cdiv(p.rows, p.block_sizes[0]) * p.splits


def test_mqa_packs_the_group_as_rows_and_splits_to_fill_the_gpu():
    # (4, 32, 1, 16384, 128), 0.20x cuDNN on 2026-12-04's main: the 32 query heads of the one K/V head are the rows of
    # two 16-row tiles (each K/V tile read twice, not 32 times; one tile of 32 rows in two warps took 2.5x the GPU
    # time on an H100, 2026-12-07), each tile's warp with eight key warps of 16 keys (the tiles that share the K/V
    # wait on their own instructions with four of 32), and the keys split between enough blocks that the GPU streams
    # them.
    p = plan(4, 32, 1, 1, 16384, 128)
    assert p.packed and p.rows == 32 and p.block_sizes == (16, 16) and p.key_warps == 8
    # At d = 64 eight warps' registers would halve the blocks a multiprocessor holds: four warps of 32 keys stay.
    narrow = plan(4, 32, 1, 1, 16384, 64)
    assert narrow.block_sizes == (16, 32) and narrow.key_warps == 4
    assert p.splits >= 8 and blocks(p, 4, 1) >= 64
    assert p.estimate_us <= min(p.times_us) * (1 + TIE) and p.estimate_us < p.times_us[0] / 2


def test_a_long_single_sequence_gets_many_splits_in_one_wave():
    # (1, 32, 8, 131072): 8 packed tiles of 4 rows, four key warps each (one block per multiprocessor): split until the
    # blocks fill the 132 multiprocessors once, and no further (a second wave costs a wave's fixed time).
    p = plan(1, 32, 8, 1, 131072, 128)
    assert p.packed and p.rows == 4 and p.key_warps == 4
    assert p.splits >= 12 and blocks(p, 1, 8) <= MULTIPROCESSORS


@pytest.mark.parametrize("shape", [ISSUE_16_CASE, (64, 32, 8, 1, 2048, 128), (64, 32, 32, 1, 8192, 64),
                                   (8, 32, 32, 1, 4096, 64)])
def test_a_big_batch_gets_one_split(shape):
    # 128 or more tiles already fill the GPU: no split, no merge (issue 16's case streams at cuDNN's rate so).
    assert plan(*shape).splits == 1


def test_small_batches_split_as_measured_on_the_h200():
    # The H200's measurements that the model's constants were fitted to (decode_breakdown_h200.md, 2026-12-03): four
    # splits at (4, 32, 8, 32768), 16 at (1, 32, 8, 8192) (one block per multiprocessor; the model may stop a split or
    # two short of the wave where the difference is within its tie).
    assert plan(4, 32, 8, 1, 32768, 128).splits == 4
    assert 14 <= plan(1, 32, 8, 1, 8192, 128).splits <= 16


def test_speculative_decoding_packs_query_groups_when_q_allows_it():
    # GQA with four new queries per sequence: the group's 8 heads x 4 queries are 32 rows of one tile (C-ordered q);
    # a q whose heads are not N_q rows apart keeps a tile per query head; MHA has nothing to pack.
    packed = plan(16, 32, 8, 4, 8192, 128)
    assert packed.packed and packed.rows == 16 and packed.key_warps == 4
    assert plan(16, 64, 8, 4, 8192, 128).rows == 32
    unpacked = plan(16, 64, 8, 4, 8192, 128, packable=False)
    assert not unpacked.packed and unpacked.rows == 4
    assert not plan(16, 32, 32, 4, 8192, 128).packed
    assert packs(32, 8, 1, packable=False)   # one query per head: the heads are the rows, whatever the strides
    big = plan(4, 32, 1, 4, 16384, 128)        # MQA, 128 rows: eight 16-row tiles with key warps
    assert big.block_sizes == (16, 16) and big.key_warps == 8 and blocks(big, 4, 1) == 8 * 4 * big.splits
    wide = plan(4, 32, 1, 1, 8192, 256)         # d = 256: one tile of the group's 32 rows in two 16-row warps
    assert wide.block_sizes[0] == 32 and wide.warp_rows == 16 and wide.warps == 2


def test_user_choices_are_kept():
    p = plan(1, 32, 8, 1, 8192, 128, num_splits=3, key_warps=1, block_sizes=(16, 16), kv_stages=4)
    assert (p.splits, p.key_warps, p.block_sizes, p.kv_stages) == (3, 1, (16, 16), 4)
    # The user's tile keeps the usual key warps, even where the library's own tiles would share the group's K/V.
    assert plan(4, 32, 1, 1, 16384, 128, block_sizes=(16, 16)).key_warps == 4
    # More splits than leave each warp a key tile are capped: 100 keys, tiles of 32, four key warps: one split.
    assert plan(1, 32, 8, 1, 100, 128, num_splits=8).splits == 1
    assert plan(1, 32, 8, 1, 100, 128).splits == 1


def test_other_tiles_float32_paged_and_large_heads():
    # float32 (3xTF32 tiles through registers): no cp.async, so one buffer and no key warps; a paged cache's key tile
    # divides its page; d = 256 keeps 16-key tiles (a 32-key round of four warps would not fit shared memory).
    p = plan(2, 8, 2, 1, 4096, 128, dtype_bytes=4)
    assert p.key_warps == 1 and p.kv_stages == 1
    assert plan(2, 8, 2, 1, 4096, 128, page_size=16).block_sizes == (16, 16)
    assert plan(2, 8, 2, 1, 4096, 256).block_sizes == (16, 16)
    assert plan(2, 8, 2, 1, 4096, 128, aligned=False).key_warps == 1


def test_the_model_streams_a_big_call_near_the_copy_rate():
    # Issue 16's case moves 537 MB of K and V: the model's time is within 15% of that at the copy rate (the grid's
    # measured 0.125 ms on the H200), and the time of a split call falls as splits fill an idle GPU.
    p = plan(*ISSUE_16_CASE)
    kv_bytes = 2 * 16 * 8 * 8192 * 128 * 2
    assert kv_bytes / COPY_BANDWIDTH * 1e6 <= p.estimate_us <= 1.15 * kv_bytes / COPY_BANDWIDTH * 1e6
    times = plan(1, 32, 8, 1, 131072, 128).times_us
    assert times[0] > 2.5 * times[15]
    common = dict(tiles=8, n_k=131072, head_dim=128, dtype_bytes=2, block_sizes=(16, 32), warp_rows=16, key_warps=4,
                  stages=3, rows=4)
    assert estimate(16, **common) < estimate(32, **common)   # a second wave costs more than it gains


def test_resident_blocks_follow_shared_memory_threads_and_registers():
    assert resident_blocks(200_000, 128) == 1      # key warps: their buffers fill a multiprocessor
    assert resident_blocks(30_000, 32) == 7        # one-warp blocks: shared memory allows 7
    assert resident_blocks(10_000, 256) == 1       # 256 threads of 255 registers: the register file holds one
