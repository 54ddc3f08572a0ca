"""Hypothesis strategies and the variants every test file shares: draw the problem's shape first, then its arrays
(and ``forward_warp_rows``, a library setting that tests and tests/gpu_sanitize.py switch).

Sizes depend on where the tests run (the simulator runs every CUDA thread as
a Python thread, so its shapes are tiny); ``SIZES`` holds both sets.  On a
GPU most of a run is compilation, one kernel per (tiles, padded head dim,
flags): the ``gpu_smoke`` profile therefore draws head dims from
``SMOKE_HEAD_DIMS`` and fewer tiles, the ``gpu`` profile from everything.
Arrays come from a drawn seed and a drawn distribution rather than element
by element: shapes still shrink, and large arrays stay cheap to draw.
"""
import contextlib
import os
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
from hypothesis import strategies as st

from numba_flash import BlockMask, in_simulator

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

#: (algorithm, dtype) pairs: every algorithm in float32, the fast one also in the 16-bit types.
FORWARD_VARIANTS = [("standard", np.float32), ("flash1", np.float32), ("flash2", np.float32), ("flash2", np.float16),
                    ("flash2", BFLOAT16)]
#: The algorithms with a backward.
BACKWARD_VARIANTS = [(a, t) for a, t in FORWARD_VARIANTS if a != "standard"]


def dtype_name(dtype):
    return np.dtype(dtype).name


def variants(pairs):
    """``pytest.mark.parametrize("algorithm, dtype", pairs)`` with readable ids."""
    return pytest.mark.parametrize("algorithm, dtype", pairs, ids=[f"{a}-{dtype_name(t)}" for a, t in pairs])


@dataclass(frozen=True)
class Sizes:
    max_n: dict         # per algorithm: N_q and N_k are drawn from 1..max_n
    max_d: int          # head dim from 1..max_d
    max_batch_heads: int
    max_block: int      # flash1's B_r and B_c from 1..max_block
    flash2_rows: tuple  # flash2's B_r choices (multiples of 16: one warp per 16 rows)
    flash2_cols: tuple  # flash2's B_c choices


# In the simulator every CUDA thread is a Python thread and every warp-level
# instruction a barrier: Algorithm 0 (a block per row of S) and flash2 (two
# warps) get smaller problems there.
SMOKE = not in_simulator() and os.environ.get("HYPOTHESIS_PROFILE") == "gpu_smoke"
SIZES = Sizes(max_n={"standard": 12, "flash1": 40, "flash2": 24}, max_d=16, max_batch_heads=3, max_block=16,
              flash2_rows=(16, 32), flash2_cols=(8, 16, 32)) if in_simulator() else \
    Sizes(max_n={"standard": 300, "flash1": 300, "flash2": 600}, max_d=128, max_batch_heads=12, max_block=64,
          flash2_rows=(16, 128) if SMOKE else (16, 48, 64, 128), flash2_cols=(16, 64) if SMOKE else (8, 16, 48, 64))
#: Head dims of the smoke profile: the smallest, odd and padded ones, the common ones and the largest.
SMOKE_HEAD_DIMS = (1, 12, 40, 64, 72, 128)


def head_dims():
    """The head dims a test draws: 1 .. SIZES.max_d, or ``SMOKE_HEAD_DIMS`` in the smoke profile."""
    return st.sampled_from(SMOKE_HEAD_DIMS) if SMOKE else st.integers(1, SIZES.max_d)

#: Distributions of q, k, v entries: (name, sampler(rng, shape)).
DISTRIBUTIONS = {
    "normal": lambda rng, shape: rng.standard_normal(shape),
    "uniform": lambda rng, shape: rng.uniform(-1.0, 1.0, shape),
    # a few large entries among small ones: peaky softmax rows
    "spiky": lambda rng, shape: rng.standard_normal(shape) * np.where(rng.random(shape) < 0.05, 8.0, 0.5),
}


@dataclass
class Problem:
    """One call's inputs; ``scale=None`` means the default 1/sqrt(d)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    causal: object  # False, True, "top_left" or "bottom_right"
    scale: object  # None or a float
    block_sizes: object  # None or (B_r, B_c)

    @property
    def effective_scale(self):
        return 1.0 / np.sqrt(self.q.shape[-1]) if self.scale is None else self.scale

    @property
    def group(self):
        """Query heads per key/value head."""
        return (self.q.shape[-3] // self.k.shape[-3]) if self.q.ndim > 2 else 1

    def expanded(self, x):
        """k or v with each key/value head repeated for its query heads (what the reference reads)."""
        return np.repeat(x, self.group, axis=-3) if self.group > 1 else x


def batch_shapes(max_batch_heads):
    """Leading dims: () , (B,) or (B, H) with B*H <= max_batch_heads."""
    return st.lists(st.integers(1, max_batch_heads), min_size=0, max_size=2).filter(
        lambda dims: int(np.prod(dims)) <= max_batch_heads).map(tuple)


def block_sizes(algorithm, head_dim, dtype, backward=False):
    """(B_r, B_c) the algorithm accepts at head_dim, by the library's own check (``_validation.check_block_sizes``)."""
    from numba_flash._validation import check_block_sizes

    if algorithm == "flash1":
        top = SIZES.max_block
        candidates = [(r, c) for r in range(1, top + 1) for c in range(1, top + 1)]
    else:
        candidates = [(r, c) for r in SIZES.flash2_rows for c in SIZES.flash2_cols]
    legal = []
    for pair in candidates:
        try:
            check_block_sizes(pair, algorithm, head_dim, 100, 100, dtype_name(dtype), backward=backward)
        except ValueError:
            continue
        legal.append(pair)
    return st.sampled_from(legal)


def arrays(draw, shape, dtype=np.float32):
    seed = draw(st.integers(0, 2 ** 32 - 1))
    kind = draw(st.sampled_from(sorted(DISTRIBUTIONS)))
    rng = np.random.default_rng(seed)
    return DISTRIBUTIONS[kind](rng, shape).astype(dtype)


CAUSAL_CHOICES = (False, True, "bottom_right")


@st.composite
def problems(draw, *, algorithm, dtype=np.float32, causal=None, max_n=None, backward=False, gqa=None):
    """A random attention problem for ``algorithm`` (shapes first, then data); tiles for the backward if asked.

    gqa: None (drawn: flash2 may get fewer key/value heads than query heads), False or True.
    """
    max_n = max_n or SIZES.max_n[algorithm]
    batch = draw(batch_shapes(SIZES.max_batch_heads))
    kv_batch = batch
    if gqa is None:
        gqa = algorithm == "flash2" and draw(st.booleans())
    if gqa and len(batch) >= 1:
        # the last leading dim is the heads: key/value heads divide it
        heads = batch[-1]
        kv_heads = draw(st.sampled_from([h for h in range(1, heads + 1) if heads % h == 0]))
        kv_batch = batch[:-1] + (kv_heads,)
    n_q = draw(st.integers(1, max_n))
    n_k = draw(st.integers(1, max_n))
    d = draw(head_dims())
    tiles = None
    if algorithm != "standard":
        tiles = draw(st.one_of(st.none(), block_sizes(algorithm, d, dtype, backward)))
    scale = draw(st.one_of(st.none(), st.floats(-3.0, 3.0, allow_nan=False, allow_subnormal=False)))
    if causal is None:
        causal = draw(st.sampled_from(CAUSAL_CHOICES))
    q = arrays(draw, batch + (n_q, d), dtype)
    k = arrays(draw, kv_batch + (n_k, d), dtype)
    v = arrays(draw, kv_batch + (n_k, d), dtype)
    return Problem(q, k, v, causal, scale, tiles)


def causal_mask(causal, n_q, n_k):
    """The element-level causal mask (n_q, n_k) of a ``causal`` argument, or None."""
    if not causal:
        return None
    offset = n_k - n_q if causal == "bottom_right" else 0
    return np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + offset


def ragged_length(draw, blocks, block):
    """A length that needs exactly ``blocks`` blocks of ``block``: often not a multiple of it."""
    return draw(st.integers((blocks - 1) * block + 1, blocks * block))


#: Kinds of block layout: random density, and the corner cases a kernel can get wrong.
LAYOUT_KINDS = ("random", "all_zero", "all_one", "empty_rows", "empty_columns", "single_block")


@st.composite
def block_masks(draw, n_q=None, n_k=None, block_size=None, batch_shape=(), max_block=8, max_blocks=6, fits=None):
    """(BlockMask, n_q, n_k): a random block mask, or one of the corner cases of ``LAYOUT_KINDS``.

    What is not given is drawn: the block size, then the lengths (ragged, up to
    ``max_blocks`` blocks), the leading dims (none, ``batch_shape``, or ones of
    its rank: all broadcast to it), the layout from a seed.  ``fits`` (None:
    any size): whether blocks of a size can run (flash1's tiles are the mask's
    blocks); a single block that does not fit becomes all-one blocks.
    """
    given_block = block_size is not None
    if not given_block:
        block_size = (draw(st.integers(1, max_block)), draw(st.integers(1, max_block)))
    if n_q is None:
        n_q = ragged_length(draw, draw(st.integers(1, max_blocks)), block_size[0])
    if n_k is None:
        n_k = ragged_length(draw, draw(st.integers(1, max_blocks)), block_size[1])
    kind = draw(st.sampled_from(LAYOUT_KINDS))
    if kind == "single_block":
        whole = (max(block_size[0], n_q), max(block_size[1], n_k))
        block_size, kind = ((whole, kind) if not given_block and (fits is None or fits(whole))
                            else (block_size, "all_one"))
    grid = (-(-n_q // block_size[0]), -(-n_k // block_size[1]))
    leading = draw(st.sampled_from([(), tuple(batch_shape), tuple(1 for _ in batch_shape)]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    layout = rng.random(leading + grid) < draw(st.sampled_from([0.2, 0.5, 0.9]))
    if kind == "all_zero":
        layout[...] = False
    elif kind in ("all_one", "single_block"):
        layout[...] = True
    elif kind == "empty_rows":
        layout[..., rng.integers(0, grid[0]), :] = False
    elif kind == "empty_columns":
        layout[..., :, rng.integers(0, grid[1])] = False
    return BlockMask(layout, block_size), n_q, n_k


def flash1_fits(block_size, head_dim, backward=False):
    """Whether the literal kernel runs with tiles of ``block_size`` at head_dim (its own check)."""
    from numba_flash._validation import check_block_sizes

    try:
        check_block_sizes(block_size, "flash1", head_dim, 100, 100, "float32", backward=backward)
    except ValueError:
        return False
    return True


#: The dtypes of the packed (variable-length) entry point: flash2's.
VARLEN_DTYPES = [t for a, t in FORWARD_VARIANTS if a == "flash2"]
VARLEN_CAUSAL_CHOICES = (False, True, "top_left")   # True: bottom-right per sequence, as flash-attn's varlen


@dataclass
class PackedProblem:
    """A batch of sequences packed without padding: q (total_q, H_q, d), k and v (total_k, H_kv, d)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    cu_q: np.ndarray  # int32 (batch + 1,)
    cu_k: np.ndarray
    causal: object
    scale: object
    block_sizes: object

    @property
    def batch(self):
        return self.cu_q.size - 1

    @property
    def longest(self):
        return int(np.diff(self.cu_q).max()), int(np.diff(self.cu_k).max())

    def sequence(self, b):
        """(q, k, v) of sequence b as (heads, N, d) problems, the layout of ``attention``."""
        rows, keys = slice(self.cu_q[b], self.cu_q[b + 1]), slice(self.cu_k[b], self.cu_k[b + 1])
        return tuple(np.swapaxes(x, 0, 1) for x in (self.q[rows], self.k[keys], self.v[keys]))

    def rows(self, b):
        return slice(self.cu_q[b], self.cu_q[b + 1])

    def keys(self, b):
        return slice(self.cu_k[b], self.cu_k[b + 1])


def cumulative(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@st.composite
def packed_problems(draw, *, dtype=np.float32, backward=False, equal_lengths=False, max_n=None):
    """A random packed batch: 1-4 sequences of 0 to max_n queries and keys each (never all empty), grouped
    heads, drawn tiles, scale and causal alignment.  ``equal_lengths``: every sequence N_q queries, N_k keys.
    ``max_n``: the longest sequence (default ``SIZES``')."""
    max_n = max_n or SIZES.max_n["flash2"]
    batch = draw(st.integers(1, 4 if not in_simulator() else 3))
    if equal_lengths:
        lengths_q = [draw(st.integers(1, max_n))] * batch
        lengths_k = [draw(st.integers(1, max_n))] * batch
    else:
        # Empty and one-row sequences are the edges a kernel gets wrong: draw them often.
        length = st.one_of(st.sampled_from([0, 1]), st.integers(0, max_n))
        lengths_q = draw(st.lists(length, min_size=batch, max_size=batch).filter(any))
        lengths_k = draw(st.lists(length, min_size=batch, max_size=batch).filter(any))
    heads = draw(st.integers(1, SIZES.max_batch_heads))
    kv_heads = draw(st.sampled_from([h for h in range(1, heads + 1) if heads % h == 0]))
    d = draw(head_dims())
    tiles = draw(st.one_of(st.none(), block_sizes("flash2", d, dtype, backward)))
    scale = draw(st.one_of(st.none(), st.floats(-3.0, 3.0, allow_nan=False, allow_subnormal=False)))
    causal = draw(st.sampled_from(VARLEN_CAUSAL_CHOICES))
    q = arrays(draw, (sum(lengths_q), heads, d), dtype)
    k = arrays(draw, (sum(lengths_k), kv_heads, d), dtype)
    v = arrays(draw, (sum(lengths_k), kv_heads, d), dtype)
    return PackedProblem(q, k, v, cumulative(lengths_q), cumulative(lengths_k), causal, scale, tiles)


@contextlib.contextmanager
def forward_warp_rows(rows):
    """flash2's forward with warps of ``rows`` query rows where the library may choose them
    (``tiling.FORWARD_WARP_ROWS``), plans rebuilt before and after."""
    from numba_flash import api, tiling

    saved = dict(tiling.FORWARD_WARP_ROWS)
    tiling.FORWARD_WARP_ROWS.update({precision: [(tiling.FLASH2_MAX_HEAD_DIM, rows)] for precision in saved})
    api._PLANS.clear()
    try:
        yield
    finally:
        tiling.FORWARD_WARP_ROWS.update(saved)
        api._PLANS.clear()


@contextlib.contextmanager
def wgmma_dq(mode):
    """The wgmma backward summing dQ in ``mode`` (one of its ``DQ_MODES``) for the while (``DQ_MODE``, which
    ``NUMBA_FLASH_WGMMA_DQ`` sets for a process): yields the ``deterministic`` that asks for it; plans rebuilt before
    and after."""
    from numba_flash import api
    from numba_flash.kernels.hopper import backward as hopper_backward
    from numba_flash.kernels.hopper.dq_sums import UNORDERED_MODES

    saved = hopper_backward.DQ_MODE
    hopper_backward.DQ_MODE = mode
    api._PLANS.clear()
    try:
        yield mode not in UNORDERED_MODES
    finally:
        hopper_backward.DQ_MODE = saved
        api._PLANS.clear()


@contextlib.contextmanager
def wgmma_loop(overlap=False, warpgroups=1, kernel="blocks", consumers=2, query="shared", stages=3):
    """The wgmma forward with its products overlapping the softmax or not, in blocks of one warpgroup or two
    (``OVERLAP_PRODUCTS`` and ``WARPGROUPS``, which ``NUMBA_FLASH_WGMMA_OVERLAP`` and
    ``NUMBA_FLASH_WGMMA_WARPGROUPS`` set for a process), or on the warp-specialised kernel (``kernel="specialized"``,
    ``NUMBA_FLASH_WGMMA_FORWARD``) with ``consumers`` consumer warpgroups (``NUMBA_FLASH_WGMMA_CONSUMERS``) reading Q
    from ``query`` ("shared" or "registers", ``NUMBA_FLASH_WGMMA_QUERY``) through ``stages`` K/V stages
    (``NUMBA_FLASH_WGMMA_STAGES``), plans rebuilt before and after."""
    from numba_flash import api
    from numba_flash.kernels.hopper import forward as hopper

    names = ("OVERLAP_PRODUCTS", "WARPGROUPS", "FORWARD_KERNEL", "CONSUMERS", "QUERY_OPERAND", "STAGES")
    saved = [getattr(hopper, name) for name in names]
    for name, value in zip(names, (overlap, str(warpgroups), kernel, str(consumers), query, str(stages))):
        setattr(hopper, name, value)
    api._PLANS.clear()
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(hopper, name, value)
        api._PLANS.clear()
