"""Block masks: which (query block, key block) tiles of S may be non-zero.

Algorithm 5 of the paper (block-sparse FlashAttention) skips whole tiles
chosen in advance.  A ``BlockMask`` holds that choice: a boolean ``layout``
of shape (T_r, T_c), or (..., T_r, T_c) with leading dims that broadcast
against the batch dims of q, and the ``block_size`` (B_r, B_c) it is
expressed in.  Element (i, j) of the attention matrix is allowed iff
``layout[..., i // B_r, j // B_c]``.

    >>> import numpy as np
    >>> bm = BlockMask(np.array([[True, False], [True, True]]), (2, 3))
    >>> bm.to_dense(4, 5).astype(int)
    array([[1, 1, 1, 0, 0],
           [1, 1, 1, 0, 0],
           [1, 1, 1, 1, 1],
           [1, 1, 1, 1, 1]])
    >>> bm.density
    0.75

Masks combine with ``&`` and ``|`` (same block size; layouts broadcast), and
``numba_flash.masks`` has generators for the usual patterns.
"""
import numpy as np

from .._checks import boolean_grid, positive_int_pair
from .._registry import new_key
from ..tiling import cdiv

class BlockMask:
    """A boolean tile layout at a given block size; see the module docstring."""

    def __init__(self, layout, block_size):
        self._layout = boolean_grid("layout", layout, ("T_r", "T_c")).copy()
        self._layout.flags.writeable = False
        self._block_size = positive_int_pair("block_size", block_size)
        #: Device forms of this mask (layouts, tile lists) kept by ``sparsity/tile_lists.py``: a mask is immutable.
        self._device_forms = {}
        #: How ``numba_flash.torch``'s operators name this mask (``_registry``).
        self.key = new_key(self)

    @property
    def layout(self):
        """Boolean (..., T_r, T_c), read-only."""
        return self._layout

    @property
    def block_size(self):
        """(B_r, B_c): rows and columns of the attention matrix per layout entry."""
        return self._block_size

    @property
    def density(self):
        """Fraction of non-zero blocks."""
        return float(self._layout.mean())

    def __repr__(self):
        return (f"BlockMask(layout shape {self._layout.shape}, block_size {self._block_size}, "
                f"density {self.density:.3f})")

    def grid_for(self, n_q, n_k):
        """(T_r, T_c) that an (n_q, n_k) attention matrix needs at this block size."""
        block_rows, block_cols = self._block_size
        return cdiv(n_q, block_rows), cdiv(n_k, block_cols)

    def check_covers(self, n_q, n_k):
        """Raise ValueError unless the layout is exactly the grid of an (n_q, n_k) matrix."""
        needed = self.grid_for(n_q, n_k)
        if self._layout.shape[-2:] != needed:
            raise ValueError(f"block_mask: a layout of {self._layout.shape[-2:]} blocks of {self._block_size} "
                             f"does not match N_q={n_q}, N_k={n_k}, which need {needed} blocks")

    def to_dense(self, n_q, n_k):
        """Boolean (..., n_q, n_k): element (i, j) allowed iff its block is."""
        self.check_covers(n_q, n_k)
        block_rows, block_cols = self._block_size
        rows = np.arange(n_q) // block_rows
        cols = np.arange(n_k) // block_cols
        return self._layout[..., rows[:, None], cols[None, :]]

    def _combine(self, other, op, symbol):
        if not isinstance(other, BlockMask):
            return NotImplemented
        if other.block_size != self.block_size:
            raise ValueError(f"cannot combine masks of block sizes {self.block_size} and {other.block_size} "
                             f"with {symbol}")
        return BlockMask(op(self._layout, other._layout), self._block_size)

    def __and__(self, other):
        return self._combine(other, np.logical_and, "&")

    def __or__(self, other):
        return self._combine(other, np.logical_or, "|")

    def __eq__(self, other):
        if not isinstance(other, BlockMask):
            return NotImplemented
        return self.block_size == other.block_size and np.array_equal(self._layout, other._layout)

    __hash__ = None
