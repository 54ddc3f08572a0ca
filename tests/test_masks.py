"""Sparsity patterns (``numba_flash.masks``) and the ``BlockMask`` they return.

The expected side of every element-level pattern is its formula evaluated
here one element at a time (``dense``), independent of the module's own
``*_elements`` functions.  A generator must equal it exactly at block size
(1, 1), and at any block size equal ``from_dense`` of it, which is itself
checked against a loop over blocks (``coarsen_by_loops``).  Block-level
patterns are checked against their definitions on the block grid and for
their properties (symmetry, row counts, determinism, density).  Sizes are
tiny and include lengths that are not multiples of the block size.
"""
import doctest
import re
import sys

import numpy as np
import pytest
from hypothesis import given, strategies as st

import reference
from strategies import block_masks, ragged_length
from numba_flash import cli, masks
from numba_flash.sparsity.block_mask import BlockMask
from numba_flash.sparsity.tile_lists import per_head_layout, tile_lists, tile_visits

MAX_N = 24
MAX_BLOCK = 8
lengths = st.integers(1, MAX_N)
block_sizes = st.tuples(st.integers(1, MAX_BLOCK), st.integers(1, MAX_BLOCK))
seeds = st.integers(0, 2 ** 32 - 1)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def dense(n_q, n_k, allowed):
    """Boolean (n_q, n_k): element (i, j) is ``allowed(i, j)``, one element at a time."""
    return np.array([[bool(allowed(i, j)) for j in range(n_k)] for i in range(n_q)], dtype=bool).reshape(n_q, n_k)


def coarsen_by_loops(mask, block_size):
    """Block (I, J) is True iff any element of mask's block (I, J) is (ragged last blocks included)."""
    block_rows, block_cols = block_size
    n_q, n_k = mask.shape
    return np.array([[mask[r:r + block_rows, c:c + block_cols].any() for c in range(0, n_k, block_cols)]
                     for r in range(0, n_q, block_rows)], dtype=bool)


def check_element_pattern(generate, elements, expected, block_size):
    """``generate(block_size)`` and the module's dense ``elements`` agree with the test's ``expected``."""
    assert np.array_equal(elements, expected)
    assert np.array_equal(generate((1, 1)).layout, expected)
    block_mask = generate(block_size)
    assert block_mask.layout.shape == block_mask.grid_for(*expected.shape)
    assert block_mask == masks.from_dense(expected, block_size)


# ---------------------------------------------------------------- element-level patterns

@given(lengths, lengths, block_sizes)
def test_causal_is_j_at_most_i_aligned_like_attention(n_q, n_k, block_size):
    expected = dense(n_q, n_k, lambda i, j: j <= i)
    assert np.array_equal(expected, reference.allowed_mask(n_q, n_k, causal=True))  # attention(causal=True)
    check_element_pattern(lambda b: masks.causal(n_q, n_k, b), masks.causal_elements(n_q, n_k), expected,
                          block_size)


@given(lengths, lengths, block_sizes, st.integers(0, MAX_N), st.booleans())
def test_local_is_a_window_of_inclusive_bounds(n_q, n_k, block_size, window, causal):
    if causal:
        expected = dense(n_q, n_k, lambda i, j: i - window <= j <= i)
    else:
        expected = dense(n_q, n_k, lambda i, j: abs(i - j) <= window)
    check_element_pattern(lambda b: masks.local(n_q, n_k, b, window, causal=causal),
                          masks.local_elements(n_q, n_k, window, causal=causal), expected, block_size)


@given(lengths, block_sizes, st.integers(1, MAX_N))
def test_strided_is_recent_keys_plus_every_stride_th(n, block_size, stride):
    expected = dense(n, n, lambda i, j: j <= i and (i - stride < j or (i - j) % stride == 0))
    check_element_pattern(lambda b: masks.strided(n, b, stride), masks.strided_elements(n, stride),
                          expected, block_size)


@given(lengths, block_sizes, st.integers(1, MAX_N).flatmap(lambda s: st.tuples(st.just(s), st.integers(1, s))))
def test_fixed_is_own_chunk_plus_summary_tokens(n, block_size, stride_and_c):
    stride, c = stride_and_c
    summaries = set(range(stride - c, stride))
    expected = dense(n, n, lambda i, j: j <= i and (j // stride == i // stride or j % stride in summaries))
    check_element_pattern(lambda b: masks.fixed(n, b, stride, c), masks.fixed_elements(n, stride, c),
                          expected, block_size)


@given(lengths, lengths, block_sizes, st.integers(0, MAX_N), st.data())
def test_longformer_is_window_plus_global_rows_and_columns(n_q, n_k, block_size, window, data):
    global_tokens = data.draw(st.lists(st.integers(0, max(n_q, n_k) - 1), max_size=4))
    expected = dense(n_q, n_k, lambda i, j: abs(i - j) <= window or i in global_tokens or j in global_tokens)
    check_element_pattern(lambda b: masks.longformer(n_q, n_k, b, window, global_tokens),
                          masks.longformer_elements(n_q, n_k, window, global_tokens), expected, block_size)


# ---------------------------------------------------------------- butterfly

def butterfly_by_loops(t_r, t_c, n_factors, global_blocks):
    """The definition: built on the next power of two >= max(T_r, T_c), then cropped."""
    padded = 1
    while padded < max(t_r, t_c):
        padded *= 2
    powers = {2 ** k for k in range(n_factors)}
    full = dense(padded, padded, lambda i, j: i == j or (i ^ j) in powers)
    layout = full[:t_r, :t_c].copy()
    layout[:global_blocks, :] = True
    layout[:, :global_blocks] = True
    return layout


@st.composite
def grids(draw, max_blocks=20):
    """(n_q, n_k, block_size, (T_r, T_c)): the grid first, then lengths that need it."""
    t_r, t_c = draw(st.integers(1, max_blocks)), draw(st.integers(1, max_blocks))
    block_rows, block_cols = draw(block_sizes)
    n_q, n_k = ragged_length(draw, t_r, block_rows), ragged_length(draw, t_c, block_cols)
    return n_q, n_k, (block_rows, block_cols), (t_r, t_c)


@given(grids(), st.integers(0, 6), st.integers(0, 4))
def test_butterfly_matches_its_definition_cropped_from_a_power_of_two(grid, n_factors, global_blocks):
    n_q, n_k, block_size, (t_r, t_c) = grid
    block_mask = masks.butterfly(n_q, n_k, block_size, n_factors, global_blocks)
    assert block_mask.block_size == block_size
    assert np.array_equal(block_mask.layout, butterfly_by_loops(t_r, t_c, n_factors, global_blocks))


@given(st.integers(1, 40), st.integers(0, 7))
def test_butterfly_on_a_square_grid_is_symmetric_with_its_diagonal(t, n_factors):
    layout = masks.butterfly(t, t, (1, 1), n_factors).layout
    assert np.array_equal(layout, layout.T)
    assert layout.diagonal().all()


@given(st.integers(0, 5).flatmap(lambda log2_t: st.tuples(st.just(log2_t), st.integers(0, log2_t))),
       st.integers(1, 4))
def test_butterfly_keeps_one_plus_n_factors_blocks_per_row_of_a_power_of_two_grid(log2_t_and_factors, block):
    log2_t, n_factors = log2_t_and_factors
    t = 2 ** log2_t
    block_mask = masks.butterfly(t * block, t * block, (block, block), n_factors)
    assert np.all(block_mask.layout.sum(axis=1) == 1 + n_factors)
    assert block_mask.density == (1 + n_factors) / t


def test_butterfly_global_blocks_are_whole_rows_and_columns():
    plain = masks.butterfly(50, 30, (5, 5), 2).layout
    with_global = masks.butterfly(50, 30, (5, 5), 2, global_blocks=2).layout
    assert with_global[:2, :].all() and with_global[:, :2].all()
    assert np.array_equal(with_global[2:, 2:], plain[2:, 2:])


# ---------------------------------------------------------------- bigbird and random

@given(grids(max_blocks=12), st.integers(0, 4), st.integers(0, 3), st.integers(0, 6), seeds)
def test_bigbird_adds_min_r_available_random_blocks_to_window_and_global(grid, window, global_blocks,
                                                                          random_blocks, seed):
    n_q, n_k, block_size, (t_r, t_c) = grid
    block_mask = masks.bigbird(n_q, n_k, block_size, window, global_blocks, random_blocks, seed)
    fixed_part = dense(t_r, t_c, lambda i, j: abs(i - j) <= window or i < global_blocks or j < global_blocks)
    layout = block_mask.layout
    assert layout.shape == (t_r, t_c)
    assert layout[fixed_part].all()
    added = (layout & ~fixed_part).sum(axis=1)
    assert np.array_equal(added, np.minimum(random_blocks, (~fixed_part).sum(axis=1)))
    assert block_mask == masks.bigbird(n_q, n_k, block_size, window, global_blocks, random_blocks, seed)


@given(seeds, seeds)
def test_bigbird_and_random_differ_between_seeds(seed, other_seed):
    if seed == other_seed:
        return
    # 64 rows of 3 random blocks among ~60, or 4096 fair coins: a collision is never going to happen
    assert masks.bigbird(256, 256, (4, 4), 1, 1, 3, seed) != masks.bigbird(256, 256, (4, 4), 1, 1, 3, other_seed)
    assert masks.random(256, 256, (4, 4), 0.5, seed) != masks.random(256, 256, (4, 4), 0.5, other_seed)


@given(grids(max_blocks=12), st.floats(0.0, 1.0), seeds)
def test_random_is_deterministic_per_seed(grid, density, seed):
    n_q, n_k, block_size, (t_r, t_c) = grid
    block_mask = masks.random(n_q, n_k, block_size, density, seed)
    assert block_mask.layout.shape == (t_r, t_c)
    assert block_mask == masks.random(n_q, n_k, block_size, density, seed)


@given(st.floats(0.0, 1.0), seeds)
def test_random_density_is_within_a_binomial_bound(density, seed):
    blocks = 64 * 64
    observed = masks.random(64, 64, (1, 1), density, seed).density
    # six standard deviations of a binomial(4096, density) proportion: a false alarm about once in 10**9
    assert abs(observed - density) <= 6 * np.sqrt(density * (1 - density) / blocks) + 1e-12


def test_random_density_zero_and_one_are_exact():
    assert not masks.random(20, 30, (3, 4), 0.0, 1).layout.any()
    assert masks.random(20, 30, (3, 4), 1.0, 1).layout.all()


def test_block_level_generators_build_no_element_array():
    # a 2**20 x 2**20 element array would need a terabyte; the block grid is 1024 x 1024
    n, block_size = 2 ** 20, (1024, 1024)
    for block_mask in (masks.butterfly(n, n, block_size, 10, 1), masks.bigbird(n, n, block_size, 1, 1, 2, 0),
                       masks.random(n, n, block_size, 0.1, 0)):
        assert block_mask.layout.shape == (1024, 1024)


# ---------------------------------------------------------------- from_dense and BlockMask

@given(block_masks(batch_shape=(3, 2)))
def test_from_dense_of_to_dense_is_the_same_mask(case):
    block_mask, n_q, n_k = case
    assert masks.from_dense(block_mask.to_dense(n_q, n_k), block_mask.block_size) == block_mask


@pytest.mark.parametrize("layout, n_q, n_k", [
    (np.zeros((3, 4), bool), 9, 12),                                # all zero
    (np.ones((1, 1), bool), 1, 1),                                  # a single block of one element
    (np.zeros((1, 1), bool), 3, 3),                                 # a single empty block
    (np.array([[1, 0, 1], [0, 0, 0], [1, 0, 1]], bool), 7, 7),      # an empty row and column, ragged
    (np.eye(4, dtype=bool)[None].repeat(2, 0), 10, 10),             # leading dim, last blocks of one element
], ids=["all-zero", "one-block", "one-empty-block", "empty-row-and-column", "leading-dim-ragged"])
def test_from_dense_round_trip_edge_cases(layout, n_q, n_k):
    block_mask = BlockMask(layout, (3, 3))
    assert masks.from_dense(block_mask.to_dense(n_q, n_k), (3, 3)) == block_mask


@given(st.lists(st.integers(1, 3), max_size=2), lengths, lengths, block_sizes, seeds)
def test_from_dense_keeps_a_block_iff_any_element_is_set(leading, n_q, n_k, block_size, seed):
    rng = np.random.default_rng(seed)
    mask = rng.random(tuple(leading) + (n_q, n_k)) < rng.choice([0.0, 0.05, 0.3])
    layout = masks.from_dense(mask, block_size).layout
    expected = [coarsen_by_loops(m, block_size) for m in mask.reshape(-1, n_q, n_k)]
    assert np.array_equal(layout.reshape((-1,) + layout.shape[-2:]), np.array(expected))


@pytest.mark.parametrize("layout", [np.ones((2, 2), np.int8), np.ones((2, 2), np.float32)])
def test_block_mask_rejects_a_non_boolean_layout(layout):
    with pytest.raises(ValueError, match="boolean"):
        BlockMask(layout, (2, 2))


def test_to_dense_rejects_a_layout_of_the_wrong_grid():
    with pytest.raises(ValueError, match="does not match"):
        BlockMask(np.ones((2, 3), bool), (4, 4)).to_dense(9, 12)  # needs 3 x 3 blocks


@pytest.mark.parametrize("combine", [lambda a, b: a & b, lambda a, b: a | b], ids=["and", "or"])
def test_combining_masks_of_different_block_sizes_fails(combine):
    with pytest.raises(ValueError, match="block sizes"):
        combine(BlockMask(np.ones((2, 2), bool), (2, 2)), BlockMask(np.ones((2, 2), bool), (2, 3)))


@given(seeds)
def test_and_or_broadcast_leading_dims_elementwise(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.random((2, 1, 3, 4)) < 0.5, rng.random((3, 3, 4)) < 0.5
    mask_a, mask_b = BlockMask(a, (2, 5)), BlockMask(b, (2, 5))
    assert (mask_a & mask_b) == BlockMask(a & b, (2, 5))
    assert (mask_a | mask_b) == BlockMask(a | b, (2, 5))
    assert (mask_a & mask_b).layout.shape == (2, 3, 3, 4)
    assert (mask_a | mask_b).density == np.mean(a | b)


@given(block_masks(batch_shape=(3, 2)))
def test_tile_lists_in_the_masks_own_blocks_list_each_rows_nonzeros(case):
    # Kernel tiles equal to the mask's blocks: every non-zero block is visited, wholly, and no other.
    block_mask, n_q, n_k = case
    layout = per_head_layout(block_mask, block_mask.layout.shape[:-2], n_q, n_k)
    offsets, entries = tile_lists(*tile_visits(layout, block_mask.block_size, block_mask.block_size, n_q, n_k))
    assert offsets.shape == (layout.shape[0], layout.shape[1] + 1)
    for head in range(layout.shape[0]):
        for i in range(layout.shape[1]):
            listed = entries[offsets[head, i]:offsets[head, i + 1]]
            assert np.array_equal(listed >> 1, np.nonzero(layout[head, i])[0])
            assert not np.any(listed & 1)
    assert entries.size == layout.sum()


# ---------------------------------------------------------------- argument errors

ARGUMENT_ERRORS = [
    # (generator, args, exception, the argument its message must start with)
    (masks.causal, (0, 4, (2, 2)), ValueError, "n_q"),
    (masks.causal, (4, 2.0, (2, 2)), TypeError, "n_k"),
    (masks.causal_elements, (True, 4), TypeError, "n_q"),
    (masks.causal, (4, 4, (2, 0)), ValueError, "block_size"),
    (masks.causal, (4, 4, 2), TypeError, "block_size"),
    (masks.local, (4, 4, (2, 2), -1), ValueError, "window"),
    (masks.local, (4, 4, (2, 2), 1.5), TypeError, "window"),
    (masks.local, (4, 4, (2, 2), 1, "yes"), TypeError, "causal"),
    (masks.butterfly, (4, 4, (2, 2), -1), ValueError, "n_factors"),
    (masks.butterfly, (4, 4, (2, 2), 1, -1), ValueError, "global_blocks"),
    (masks.strided, (0, (2, 2), 2), ValueError, "n"),
    (masks.strided, (8, (2, 2), 0), ValueError, "stride"),
    (masks.fixed, (8, (2, 2), 0, 1), ValueError, "stride"),
    (masks.fixed, (8, (2, 2), 4, 0), ValueError, "c"),
    (masks.fixed, (8, (2, 2), 4, 5), ValueError, "c"),
    (masks.bigbird, (8, 8, (2, 2), -1, 0, 0, 0), ValueError, "window"),
    (masks.bigbird, (8, 8, (2, 2), 1, -1, 0, 0), ValueError, "global_blocks"),
    (masks.bigbird, (8, 8, (2, 2), 1, 0, -1, 0), ValueError, "random_blocks"),
    (masks.bigbird, (8, 8, (2, 2), 1, 0, 1, 0.5), TypeError, "seed"),
    (masks.longformer, (8, 8, (2, 2), -1, []), ValueError, "window"),
    (masks.longformer, (8, 6, (2, 2), 1, [8]), ValueError, "global_tokens"),
    (masks.longformer, (8, 8, (2, 2), 1, [-1]), ValueError, "global_tokens"),
    (masks.longformer, (8, 8, (2, 2), 1, 3), TypeError, "global_tokens"),
    (masks.random, (8, 8, (2, 2), 1.5, 0), ValueError, "density"),
    (masks.random, (8, 8, (2, 2), -0.1, 0), ValueError, "density"),
    (masks.random, (8, 8, (2, 2), float("nan"), 0), ValueError, "density"),
    (masks.random, (8, 8, (2, 2), "0.5", 0), TypeError, "density"),
    (masks.random, (8, 8, (2, 2), 0.5, -1), ValueError, "seed"),
    (masks.from_dense, (np.ones((4, 4), np.int64), (2, 2)), ValueError, "mask"),
    (masks.from_dense, (np.ones(4, bool), (2, 2)), ValueError, "mask"),
    (masks.from_dense, (np.ones((0, 4), bool), (2, 2)), ValueError, "mask"),
]


@pytest.mark.parametrize("generator, args, exception, argument", ARGUMENT_ERRORS,
                         ids=[f"{g.__name__}-{a}-{i}" for i, (g, _, _, a) in enumerate(ARGUMENT_ERRORS)])
def test_bad_arguments_raise_naming_the_argument(generator, args, exception, argument):
    with pytest.raises(exception, match=rf"^{re.escape(argument)}\b"):
        generator(*args)


def test_a_global_token_past_n_k_is_a_row_only():
    layout = masks.longformer_elements(6, 4, 0, [5])
    assert layout[5].all()
    assert np.array_equal(layout[:5], np.eye(5, 4, dtype=bool))


# ---------------------------------------------------------------- examples, pictures, CLI, docs

@pytest.mark.parametrize("name", list(masks.GENERATORS))
@pytest.mark.parametrize("n, block_size", [(1, (1, 1)), (7, (2, 3)), (64, (8, 8))])
def test_every_example_covers_its_grid(name, n, block_size):
    example = masks.GENERATORS[name]
    block_mask = example(n, block_size)
    assert block_mask.layout.shape == block_mask.grid_for(n, n)
    assert example.__doc__.strip()  # the CLI's list and the gallery print its first line


def test_save_picture_writes_pngs_of_blocks_and_elements(tmp_path):
    pytest.importorskip("matplotlib")
    block_mask = masks.butterfly(40, 36, (8, 8), 2, global_blocks=1)
    with_leading_dim = BlockMask(np.stack([block_mask.layout, ~block_mask.layout]), (8, 8))
    masks.save_picture(block_mask, tmp_path / "blocks.png", title="butterfly")
    masks.save_picture(with_leading_dim, tmp_path / "elements.png", n_q=40, n_k=36)
    for path in (tmp_path / "blocks.png", tmp_path / "elements.png"):
        assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_save_picture_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'numba-flash[plot]'")):
        masks.save_picture(masks.causal(4, 4, (2, 2)), tmp_path / "causal.png")


def test_cli_masks_show_prints_the_layout(capsys):
    assert cli.main(["masks", "--show", "butterfly", "--n", "64", "--block", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    grid = [line.split() for line in lines if line and set(line) <= set("#. ")]
    expected = masks.GENERATORS["butterfly"](64, (8, 8)).layout
    assert np.array_equal(np.array(grid) == "#", expected)
    assert expected.shape == (8, 8)


def test_cli_masks_list_names_every_example(capsys):
    assert cli.main(["masks", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(masks.GENERATORS)


def test_cli_masks_out_saves_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "local.png"
    assert cli.main(["masks", "--show", "local", "--n", "40", "--block", "8", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_docstring_examples_run():
    result = doctest.testmod(masks, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
