"""Block-sparse attention (Algorithm 5): every algorithm honours any BlockMask exactly."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numba_flash
import reference
from numba_flash import BlockMask
from numba_flash.sparsity.tile_lists import longest_first, tile_lists, tile_visits
from strategies import FORWARD_VARIANTS, block_masks, block_sizes, flash1_fits, forward_warp_rows, problems, variants
from tolerances import assert_close_to_reference

@variants(FORWARD_VARIANTS)
@given(data=st.data())
def test_block_mask_matches_the_element_level_definition(algorithm, dtype, data):
    p = data.draw(problems(algorithm=algorithm, dtype=dtype))
    n_q, n_k = p.q.shape[-2], p.k.shape[-2]
    d = p.q.shape[-1]
    # flash1 runs with tiles equal to the mask's blocks, so they must fit its shared memory; flash2 takes any tiles.
    fits = (lambda block_size: flash1_fits(block_size, d)) if algorithm == "flash1" else None
    bm = data.draw(block_masks(n_q, n_k, batch_shape=p.q.shape[:-2], max_block=12, fits=fits))[0]
    block_sizes = p.block_sizes if algorithm == "flash2" else None
    out, lse = numba_flash.attention(p.q, p.k, p.v, causal=p.causal, scale=p.scale, block_mask=bm,
                                     algorithm=algorithm, block_sizes=block_sizes, return_lse=True)
    dense = bm.to_dense(n_q, n_k)
    ref_out, ref_lse = reference.attention(p.q, p.k, p.v, scale=p.scale, causal=p.causal, mask=dense)
    assert_close_to_reference(out, lse, ref_out, ref_lse, p.q, p.expanded(p.k), p.expanded(p.v), p.effective_scale,
                              dtype)
    # A row that may attend to nothing gives exactly 0 (and lse = -inf, checked above).
    assert np.all(out[np.isneginf(ref_lse)] == 0)


@variants([(a, t) for a, t in FORWARD_VARIANTS if a == "flash2"])
@given(data=st.data(), rows_per_warp=st.sampled_from([16, 32]), density=st.sampled_from([0.2, 0.5, 0.9]))
def test_a_mask_of_whole_tiles_runs_without_element_tests(algorithm, dtype, data, rows_per_warp, density):
    """Mask blocks that are unions of whole kernel tiles (the usual block-sparse case: 128 x 128 blocks
    over (128, 64) tiles) leave no tile partly masked, so flash2's forward compiles the element test out
    and may use warps of 32 rows (``forward.partly_masked_tiles``); the mask must hold all the same.
    (Not compared bit for bit with the kernel that tests elements: on the H200 the two compile to
    different code, and one lse in 258 came out 1 ulp apart.)"""
    p = data.draw(problems(algorithm=algorithm, dtype=dtype))
    n_q, n_k, d = p.q.shape[-2], p.k.shape[-2], p.q.shape[-1]
    tiles = data.draw(block_sizes(algorithm, d, dtype))
    mask_block = (tiles[0] * data.draw(st.integers(1, 2)), tiles[1] * data.draw(st.integers(1, 3)))
    grid = (-(-n_q // mask_block[0]), -(-n_k // mask_block[1]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    bm = BlockMask(rng.random(p.q.shape[:-2] + grid) < density, mask_block)
    heads_layout = np.broadcast_to(bm.layout, p.q.shape[:-2] + grid).reshape((-1,) + grid)
    assert not tile_visits(heads_layout, mask_block, tiles, n_q, n_k)[1].any()   # no tile partly masked
    with forward_warp_rows(rows_per_warp):
        out, lse = numba_flash.attention(p.q, p.k, p.v, causal=p.causal, scale=p.scale, block_sizes=tiles,
                                         block_mask=bm, return_lse=True)
    ref_out, ref_lse = reference.attention(p.q, p.k, p.v, scale=p.scale, causal=p.causal, mask=bm.to_dense(n_q, n_k))
    assert_close_to_reference(out, lse, ref_out, ref_lse, p.q, p.expanded(p.k), p.expanded(p.v), p.effective_scale,
                              dtype)
    assert np.all(out[np.isneginf(ref_lse)] == 0)


def test_all_zero_mask_gives_zeros_and_minus_infinity():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 10, 8)).astype(np.float32) for _ in range(3))
    bm = BlockMask(np.zeros((4, 3), bool), (3, 4))
    for algorithm in ("standard", "flash1", "flash2"):
        out, lse = numba_flash.attention(q, k, v, block_mask=bm, algorithm=algorithm, return_lse=True)
        assert np.all(out == 0) and np.all(np.isneginf(lse)), algorithm


def test_flash2_visits_only_listed_tiles():
    # Mask blocks (4, 4) under kernel tiles (16, 8): a tile is visited iff it
    # touches a non-zero block, and flagged for element masking unless every
    # block it touches is non-zero.
    layout = np.zeros((1, 8, 8), bool)
    layout[0, 0, 0] = True                  # inside query tile 0, key tile 0 (partly)
    layout[0, 4:8, 2:4] = True              # query tile 1, key tile 1 exactly (fully)
    offsets, entries = tile_lists(*tile_visits(layout, (4, 4), (16, 8), 32, 32))
    assert offsets.tolist() == [[0, 1, 2]]
    assert entries.tolist() == [0 * 2 + 1, 1 * 2 + 0]


def test_blocks_take_the_longest_tile_lists_first():
    """``longest_first``: every own tile once, by decreasing list length, ties in grid order (head-major)."""
    layout = np.zeros((2, 4, 4), bool)
    layout[0, 1, :3] = layout[0, 3, :1] = layout[1, 0, :] = layout[1, 2, :3] = True
    offsets, _ = tile_lists(*tile_visits(layout, (8, 8), (8, 8), 32, 32))
    assert longest_first(offsets).tolist() == [4, 1, 6, 3, 0, 2, 5, 7]   # lengths 4, 3, 3, 1, then the empty ones


def test_flash2_tile_lists_respect_causality():
    layout = np.ones((1, 4, 4), bool)
    offsets, entries = tile_lists(*tile_visits(layout, (8, 8), (16, 16), 32, 32, causal_offset=0))
    tiles = [sorted(e >> 1 for e in entries[offsets[0, i]:offsets[0, i + 1]]) for i in range(2)]
    assert tiles == [[0], [0, 1]]


@pytest.mark.parametrize("kwargs, error, words", [
    ({"block_mask": np.ones((2, 2), bool)}, TypeError, "BlockMask"),
    ({"block_mask": BlockMask(np.ones((3, 3), bool), (4, 4))}, ValueError, "does not match"),
    ({"block_mask": BlockMask(np.ones((5, 2, 2), bool), (4, 4))}, ValueError, "broadcast"),
    ({"block_mask": BlockMask(np.ones((2, 2), bool), (4, 4)), "algorithm": "flash1", "block_sizes": (2, 2)},
     ValueError, "mask's blocks"),
    # flash1's tiles are the mask's blocks: 8 x 64 of them with d = 4 fit, 8 x 4096 do not.
    ({"block_mask": BlockMask(np.ones((1, 1), bool), (8, 4096)), "algorithm": "flash1"},
     ValueError, r"block_mask: flash1 .* blocks \(8, 4096\).* shared memory"),
])
def test_bad_masks_are_rejected(kwargs, error, words):
    q = np.zeros((2, 8, 4), np.float32)
    with pytest.raises(error, match=words):
        numba_flash.attention(q, q, q, **kwargs)


def test_block_mask_validates_its_own_input():
    with pytest.raises(ValueError, match="boolean"):
        BlockMask(np.ones((2, 2), np.int32), (2, 2))
    with pytest.raises(ValueError, match="block_size"):
        BlockMask(np.ones((2, 2), bool), (0, 2))
    with pytest.raises(ValueError, match="block sizes"):
        BlockMask(np.ones((2, 2), bool), (2, 2)) & BlockMask(np.ones((2, 2), bool), (2, 1))


def test_a_mask_reused_across_calls_gives_each_call_its_own_result():
    # A mask keeps the device form it was prepared in, per (sizes, tiles, causal):
    # reusing one mask for other lengths, tiles or causal must not mix them up.
    rng = np.random.default_rng(11)
    bm = BlockMask(rng.random((3, 3)) < 0.6, (8, 8))
    for n_q, n_k, causal, blocks in [(20, 24, False, (16, 8)), (20, 24, True, (16, 8)), (24, 17, False, (16, 8)),
                                     (20, 24, False, (32, 16)), (20, 24, False, (16, 8))]:
        q = rng.standard_normal((2, n_q, 8)).astype(np.float32)
        k, v = (rng.standard_normal((2, n_k, 8)).astype(np.float32) for _ in range(2))
        out, lse = numba_flash.attention(q, k, v, block_mask=bm, causal=causal, block_sizes=blocks, return_lse=True)
        ref_out, ref_lse = reference.attention(q, k, v, causal=causal, mask=bm.to_dense(n_q, n_k))
        assert_close_to_reference(out, lse, ref_out, ref_lse, q, k, v, 1 / np.sqrt(8), np.float32)
