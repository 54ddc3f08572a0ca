"""Hypothesis strategies: draw the problem's shape first, then its arrays.

Sizes depend on where the tests run (the simulator runs every CUDA thread as
a Python thread, so its shapes are tiny); ``SIZES`` holds both sets.
Arrays come from a drawn seed and a drawn distribution rather than element
by element: shapes still shrink, and large arrays stay cheap to draw.
"""
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from numba_flash import in_simulator


@dataclass(frozen=True)
class Sizes:
    max_n: dict         # per algorithm: N_q and N_k are drawn from 1..max_n
    max_d: int          # head dim from 1..max_d
    max_batch_heads: int
    max_block: int      # flash1's B_r and B_c from 1..max_block
    flash2_rows: tuple  # flash2's B_r choices (multiples of 16: one warp per 16 rows)
    flash2_cols: tuple  # flash2's B_c choices (multiples of 16 work for both dtypes)


# In the simulator every CUDA thread is a Python thread and every warp-level
# instruction a barrier: Algorithm 0 (a block per row of S) and flash2 (two
# warps) get smaller problems there.
SIZES = Sizes(max_n={"standard": 12, "flash1": 40, "flash2": 24}, max_d=16, max_batch_heads=3, max_block=16,
              flash2_rows=(16, 32), flash2_cols=(8, 16, 32)) if in_simulator() else \
    Sizes(max_n={"standard": 300, "flash1": 300, "flash2": 600}, max_d=128, max_batch_heads=12, max_block=64,
          flash2_rows=(16, 48, 64, 128), flash2_cols=(8, 16, 48, 64))

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
    causal: bool
    scale: object  # None or a float
    block_sizes: object  # None or (B_r, B_c)

    @property
    def effective_scale(self):
        return 1.0 / np.sqrt(self.q.shape[-1]) if self.scale is None else self.scale


def batch_shapes(max_batch_heads):
    """Leading dims: () , (B,) or (B, H) with B*H <= max_batch_heads."""
    return st.lists(st.integers(1, max_batch_heads), min_size=0, max_size=2).filter(
        lambda dims: int(np.prod(dims)) <= max_batch_heads).map(tuple)


def flash1_fits(block_sizes, head_dim, backward=False):
    """Whether the literal kernel's tiles (forward or Algorithm 4's) fit in static shared memory."""
    from numba_flash import device_limits
    from numba_flash.kernels.literal import flash1_backward, flash1_forward

    kernel = flash1_backward if backward else flash1_forward
    return kernel.shared_bytes(*block_sizes, head_dim) <= device_limits().shared_bytes_per_block


def flash1_block_sizes(d, backward=False):
    """(B_r, B_c) that the literal kernel can run: anything whose tiles fit."""
    top = SIZES.max_block
    return st.tuples(st.integers(1, top), st.integers(1, top)).filter(lambda b: flash1_fits(b, d, backward))


def flash2_block_sizes(head_dim, dtype, backward=False):
    """(B_r, B_c) for flash2 whose tiles fit the device's shared memory at head_dim.

    The forward needs B_c to be a multiple of 16 for float16 (the k16 mma), the
    backward both sizes to be multiples of 16 (tiles of warps in both passes).
    """
    from numba_flash import device_limits
    from numba_flash.kernels.fast.backward import BackwardLayout
    from numba_flash.kernels.fast.forward import Flash2Layout

    limit = device_limits().shared_bytes_per_block_optin
    is_f16 = np.dtype(dtype) == np.float16
    step = 16 if is_f16 or backward else 8
    layout = BackwardLayout if backward else Flash2Layout
    pairs = [(r, c) for r in SIZES.flash2_rows for c in SIZES.flash2_cols
             if c % step == 0 and layout(r, c, head_dim, is_f16).shared_bytes <= limit]
    return st.sampled_from(pairs)


def arrays(draw, shape, dtype=np.float32):
    seed = draw(st.integers(0, 2 ** 32 - 1))
    kind = draw(st.sampled_from(sorted(DISTRIBUTIONS)))
    rng = np.random.default_rng(seed)
    return DISTRIBUTIONS[kind](rng, shape).astype(dtype)


@st.composite
def problems(draw, *, algorithm, dtype=np.float32, causal=None, max_n=None, backward=False):
    """A random attention problem for ``algorithm`` (shapes first, then data); block sizes for the backward if asked."""
    max_n = max_n or SIZES.max_n[algorithm]
    batch = draw(batch_shapes(SIZES.max_batch_heads))
    n_q = draw(st.integers(1, max_n))
    n_k = draw(st.integers(1, max_n))
    d = draw(st.integers(1, SIZES.max_d))
    block_sizes = None
    if algorithm == "flash1":
        block_sizes = draw(st.one_of(st.none(), flash1_block_sizes(d, backward)))
    elif algorithm == "flash2":
        block_sizes = draw(st.one_of(st.none(), flash2_block_sizes(d, dtype, backward)))
    scale = draw(st.one_of(st.none(), st.floats(-3.0, 3.0, allow_nan=False, allow_subnormal=False)))
    if causal is None:
        causal = draw(st.booleans())
    q = arrays(draw, batch + (n_q, d), dtype)
    k = arrays(draw, batch + (n_k, d), dtype)
    v = arrays(draw, batch + (n_k, d), dtype)
    return Problem(q, k, v, causal, scale, block_sizes)


def random_block_mask(data, n_q, n_k, block_sizes=None):
    """A random BlockMask at block_sizes (random blocks if None), dense or sparse; empty rows and columns happen."""
    from numba_flash import BlockMask

    block_sizes = block_sizes or (data.draw(st.integers(1, 8)), data.draw(st.integers(1, 8)))
    grid = (-(-n_q // block_sizes[0]), -(-n_k // block_sizes[1]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    return BlockMask(rng.random(grid) < data.draw(st.sampled_from([0.3, 0.6, 1.0])), block_sizes)
