"""Sparsity patterns for block-sparse attention, as ``BlockMask`` generators.

Algorithm 5 of the paper (block-sparse FlashAttention) skips the tiles of S
that a ``BlockMask`` leaves out.  Every generator here returns one for an
attention matrix of ``n_q`` query rows and ``n_k`` keys at
``block_size = (B_r, B_c)``; its layout is exactly the grid
``(T_r, T_c) = (ceil(n_q / B_r), ceil(n_k / B_c))`` that
``BlockMask.grid_for(n_q, n_k)`` gives.  Indices are 0-based and every bound
is inclusive unless it says otherwise.

Two kinds of pattern:

* **Element level** (``causal``, ``local``, ``strided``, ``fixed``,
  ``longformer``): defined on tokens, query i and key j.  Each has a dense
  NumPy definition, ``<name>_elements``, returning the boolean (n_q, n_k)
  array, and its generator coarsens that exactly like ``from_dense``: a block
  is kept iff any of its elements is allowed (a ragged last block counts only
  its real elements).  A kept block can hold disallowed elements, so the
  block mask alone is a superset of the pattern: the element rule (for
  example ``attention(causal=True)``) still has to be applied inside it.
* **Block level** (``butterfly``, ``bigbird``, ``random``): defined directly
  on the block grid, query block i and key block j; no element array is built.

Worked example: 5 tokens, causal, in blocks of 2 x 2 (the last block row and
column hold one token each)::

    >>> causal_elements(5, 5).astype(int)
    array([[1, 0, 0, 0, 0],
           [1, 1, 0, 0, 0],
           [1, 1, 1, 0, 0],
           [1, 1, 1, 1, 0],
           [1, 1, 1, 1, 1]])
    >>> causal(5, 5, (2, 2)).layout.astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [1, 1, 1]])

Masks of one block size combine with ``&`` and ``|``, for example
``bigbird(...) | causal(...)``.  For element-level patterns ``|`` of the
coarsened masks equals the coarsening of the union, but ``&`` can keep more
blocks than coarsening the intersection would (two patterns may each touch a
block without sharing an element).

``GENERATORS`` maps a short name to an example ``(n, block_size) ->
BlockMask`` (used by ``numba-flash masks`` and ``experiments/paper/mask_gallery.py``),
and ``save_picture`` draws a mask to a PNG.
"""
import numbers

import numpy as np

from ._checks import boolean_grid, positive_int_pair
from ._optional import require
from .sparsity.block_mask import BlockMask
from .tiling import cdiv

__all__ = ["from_dense", "causal", "causal_elements", "local", "local_elements", "butterfly",
           "strided", "strided_elements", "fixed", "fixed_elements", "bigbird", "longformer",
           "longformer_elements", "random", "save_picture", "GENERATORS"]


# ---------------------------------------------------------------- arguments

def _check_int(name, value, minimum):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_fraction(name, value):
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return float(value)


def _check_sizes(n_q, n_k):
    return _check_int("n_q", n_q, 1), _check_int("n_k", n_k, 1)


def _grid(n_q, n_k, block_size):
    """Validated ((B_r, B_c), (T_r, T_c)) for an (n_q, n_k) attention matrix."""
    n_q, n_k = _check_sizes(n_q, n_k)
    block_rows, block_cols = positive_int_pair("block_size", block_size)
    return (block_rows, block_cols), (cdiv(n_q, block_rows), cdiv(n_k, block_cols))


# ---------------------------------------------------------------- coarsening

def _any_per_block(mask, block_size):
    """(..., T_r, T_c): whether each (B_r, B_c) block of ``mask`` (..., n_q, n_k) has a True."""
    block_rows, block_cols = block_size
    # reduceat runs each block from its start to the next start (or the end): ragged blocks come out right
    row_blocks = np.logical_or.reduceat(mask, np.arange(0, mask.shape[-2], block_rows), axis=-2)
    return np.logical_or.reduceat(row_blocks, np.arange(0, mask.shape[-1], block_cols), axis=-1)


def from_dense(mask, block_size):
    """The coarsest ``BlockMask`` covering a dense mask: a block is kept iff any element is.

    ``mask`` is boolean (..., n_q, n_k); the result has layout (..., T_r, T_c).
    The last block row (column) may be ragged: only its real elements count.

    >>> m = np.array([[1, 0, 0], [0, 0, 0], [0, 0, 1]], dtype=bool)
    >>> from_dense(m, (2, 2)).layout.astype(int)
    array([[1, 0],
           [0, 1]])
    """
    mask = boolean_grid("mask", mask, ("n_q", "n_k"))
    return BlockMask(_any_per_block(mask, positive_int_pair("block_size", block_size)), block_size)


def _rule_on(rule, queries, keys):
    """The boolean (len(queries), len(keys)) array of ``rule(i, j)`` for those indices."""
    return rule(queries[:, None], keys[None, :])


def _elements(rule, n_q, n_k):
    """The dense (n_q, n_k) array of an element rule."""
    n_q, n_k = _check_sizes(n_q, n_k)
    return _rule_on(rule, np.arange(n_q), np.arange(n_k))


def _coarsen(rule, n_q, n_k, block_size):
    """``from_dense(_elements(rule, n_q, n_k), block_size)``, one block row at a time.

    Only a (B_r, n_k) strip of elements exists at once, not the whole
    (n_q, n_k) matrix.
    """
    block_size, _ = _grid(n_q, n_k, block_size)
    block_rows = block_size[0]
    keys = np.arange(n_k)
    block_row_layouts = [
        _any_per_block(_rule_on(rule, np.arange(start, min(start + block_rows, n_q)), keys), block_size)
        for start in range(0, n_q, block_rows)]
    return BlockMask(np.concatenate(block_row_layouts, axis=0), block_size)


# ---------------------------------------------------------------- element-level patterns
# A rule is a function of broadcasting query and key index arrays (i, j).
# ``_<name>_rule(parameters)`` checks a pattern's parameters and returns its
# rule; causal has no parameters, so ``_causal_rule`` is the rule itself.

def _causal_rule(i, j):
    return j <= i


def causal_elements(n_q, n_k):
    """Dense causal mask: query i sees key j iff j <= i (top-left aligned)."""
    return _elements(_causal_rule, n_q, n_k)


def causal(n_q, n_k, block_size):
    """Causal: query i sees key j iff j <= i, top-left aligned as in ``attention(causal=True)``.

    With n_q > n_k the last queries see every key; with n_q < n_k the last
    n_k - n_q keys are seen by no query.  See the module docstring for a
    worked example.
    """
    return _coarsen(_causal_rule, n_q, n_k, block_size)


def _local_rule(window, causal):
    window = _check_int("window", window, 0)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if causal:
        return lambda i, j: (i - window <= j) & (j <= i)
    return lambda i, j: np.abs(i - j) <= window


def local_elements(n_q, n_k, window, causal=False):
    """Dense sliding window: ``|i - j| <= window``, or i - window <= j <= i if causal."""
    return _elements(_local_rule(window, causal), n_q, n_k)


def local(n_q, n_k, block_size, window, causal=False):
    """Sliding window of ``window`` tokens on each side (both ends inclusive).

    Two-sided, query i sees key j iff ``|i - j| <= window`` (2 * window + 1 keys
    away from the edges); causal, iff i - window <= j <= i (window + 1 keys).
    ``window = 0`` is the diagonal.

    >>> local_elements(4, 4, 1).astype(int)
    array([[1, 1, 0, 0],
           [1, 1, 1, 0],
           [0, 1, 1, 1],
           [0, 0, 1, 1]])
    >>> local(4, 4, (2, 2), 1).layout.astype(int)
    array([[1, 1],
           [1, 1]])
    >>> local(6, 6, (2, 2), 1, causal=True).layout.astype(int)
    array([[1, 0, 0],
           [1, 1, 0],
           [0, 1, 1]])
    """
    return _coarsen(_local_rule(window, causal), n_q, n_k, block_size)


def _strided_rule(stride):
    stride = _check_int("stride", stride, 1)
    return lambda i, j: (j <= i) & ((i - j < stride) | ((i - j) % stride == 0))


def strided_elements(n, stride):
    """Dense strided Sparse Transformer mask, n x n; see ``strided``."""
    return _elements(_strided_rule(stride), n, n)


def strided(n, block_size, stride):
    """Strided attention of the Sparse Transformer (Child et al. 2019), causal, n x n.

    Query i sees key j iff j <= i and either i - stride < j (the last
    ``stride`` keys, i included) or (i - j) mod stride == 0 (every
    stride-th key back from i).

    >>> strided_elements(6, 2).astype(int)
    array([[1, 0, 0, 0, 0, 0],
           [1, 1, 0, 0, 0, 0],
           [1, 1, 1, 0, 0, 0],
           [0, 1, 1, 1, 0, 0],
           [1, 0, 1, 1, 1, 0],
           [0, 1, 0, 1, 1, 1]])
    """
    n = _check_int("n", n, 1)
    return _coarsen(_strided_rule(stride), n, n, block_size)


def _fixed_rule(stride, c):
    stride = _check_int("stride", stride, 1)
    c = _check_int("c", c, 1)
    if c > stride:
        raise ValueError(f"c must be <= stride ({stride}), got {c}")
    return lambda i, j: (j <= i) & ((j // stride == i // stride) | (j % stride >= stride - c))


def fixed_elements(n, stride, c):
    """Dense fixed Sparse Transformer mask, n x n; see ``fixed``."""
    return _elements(_fixed_rule(stride, c), n, n)


def fixed(n, block_size, stride, c):
    """Fixed attention of the Sparse Transformer (Child et al. 2019), causal, n x n.

    Query i sees key j iff j <= i and either floor(j / stride) ==
    floor(i / stride) (same chunk of ``stride`` tokens) or j mod stride is
    in {stride - c, ..., stride - 1} (the last c tokens of every chunk act as
    summaries); 1 <= c <= stride.

    >>> fixed_elements(8, 4, 1).astype(int)
    array([[1, 0, 0, 0, 0, 0, 0, 0],
           [1, 1, 0, 0, 0, 0, 0, 0],
           [1, 1, 1, 0, 0, 0, 0, 0],
           [1, 1, 1, 1, 0, 0, 0, 0],
           [0, 0, 0, 1, 1, 0, 0, 0],
           [0, 0, 0, 1, 1, 1, 0, 0],
           [0, 0, 0, 1, 1, 1, 1, 0],
           [0, 0, 0, 1, 1, 1, 1, 1]])
    """
    n = _check_int("n", n, 1)
    return _coarsen(_fixed_rule(stride, c), n, n, block_size)


def _longformer_rule(n_q, n_k, window, global_tokens):
    window = _check_int("window", window, 0)
    try:
        global_tokens = [_check_int("global_tokens entries", g, 0) for g in global_tokens]
    except TypeError as error:
        raise TypeError(f"global_tokens must be a list of token indices: {error}") from None
    out_of_range = [g for g in global_tokens if g >= max(n_q, n_k)]
    if out_of_range:
        raise ValueError(f"global_tokens {out_of_range} are past both n_q = {n_q} and n_k = {n_k}")
    global_tokens = np.array(global_tokens, dtype=np.int64)
    # a global index only matches rows (columns) that exist: g >= n_k gives a row but no column
    return lambda i, j: (np.abs(i - j) <= window) | np.isin(i, global_tokens) | np.isin(j, global_tokens)


def longformer_elements(n_q, n_k, window, global_tokens):
    """Dense Longformer mask; see ``longformer``."""
    _check_sizes(n_q, n_k)  # before the rule compares global_tokens with them
    return _elements(_longformer_rule(n_q, n_k, window, global_tokens), n_q, n_k)


def longformer(n_q, n_k, block_size, window, global_tokens):
    """Longformer (Beltagy et al. 2020): a sliding window plus global tokens.

    Query i sees key j iff ``|i - j| <= window``, or i is in ``global_tokens``
    (a global token attends to every key: row i all ones), or j is (every
    query attends to it: column j all ones, for j < n_k).

    >>> longformer_elements(5, 5, 0, [1]).astype(int)
    array([[1, 1, 0, 0, 0],
           [1, 1, 1, 1, 1],
           [0, 1, 1, 0, 0],
           [0, 1, 0, 1, 0],
           [0, 1, 0, 0, 1]])
    """
    _check_sizes(n_q, n_k)  # before the rule compares global_tokens with them
    return _coarsen(_longformer_rule(n_q, n_k, window, global_tokens), n_q, n_k, block_size)


# ---------------------------------------------------------------- block-level patterns

def _with_global_blocks(layout, global_blocks):
    """Set the first ``global_blocks`` block rows and block columns to all ones."""
    layout[:global_blocks, :] = True
    layout[:, :global_blocks] = True
    return layout


def butterfly(n_q, n_k, block_size, n_factors, global_blocks=0):
    """Flat block butterfly (Pixelated Butterfly, Chen et al. 2021) on the block grid.

    Block (i, j) is kept iff i == j or i XOR j == 2**k for some
    0 <= k < n_factors (so each block row of a power-of-two square grid P x P
    keeps 1 + min(n_factors, log2 P) blocks).  A grid that is not a
    power-of-two square is cut from the pattern on the next power of two
    >= max(T_r, T_c).  The first ``global_blocks`` block rows and columns are
    all ones.

    >>> butterfly(4, 4, (1, 1), n_factors=2).layout.astype(int)
    array([[1, 1, 1, 0],
           [1, 1, 0, 1],
           [1, 0, 1, 1],
           [0, 1, 1, 1]])
    >>> butterfly(3, 4, (1, 1), n_factors=1, global_blocks=1).layout.astype(int)
    array([[1, 1, 1, 1],
           [1, 1, 0, 0],
           [1, 0, 1, 1]])
    """
    block_size, (t_r, t_c) = _grid(n_q, n_k, block_size)
    n_factors = _check_int("n_factors", n_factors, 0)
    global_blocks = _check_int("global_blocks", global_blocks, 0)
    # The rule depends only on i XOR j, so evaluating it on the grid's own
    # indices is the same as building the padded power-of-two grid and cropping.
    distance = np.arange(t_r)[:, None] ^ np.arange(t_c)[None, :]
    padded_bits = (max(t_r, t_c) - 1).bit_length()  # log2 of the padded grid
    # factors past log2 of the padded grid add nothing (i XOR j < 2**padded_bits);
    # capping keeps 2**n_factors within int64
    reach = 2 ** min(n_factors, padded_bits)
    is_zero_or_power_of_two = (distance & (distance - 1)) == 0
    layout = is_zero_or_power_of_two & (distance < reach)
    return BlockMask(_with_global_blocks(layout, global_blocks), block_size)


def bigbird(n_q, n_k, block_size, window, global_blocks, random_blocks, seed):
    """BigBird (Zaheer et al. 2020) on the block grid: window + global + random blocks.

    Block (i, j) is kept if ``|i - j| <= window`` (``window`` blocks each side),
    or i < global_blocks or j < global_blocks (global block rows and
    columns).  Then each block row, in order, gets ``random_blocks`` more
    blocks drawn without replacement from its blocks not yet kept, with
    ``numpy.random.default_rng(seed)`` (all that remain if fewer).  The same
    arguments always give the same mask.

    >>> bigbird(6, 6, (1, 1), window=0, global_blocks=1, random_blocks=1, seed=0).layout.sum(axis=1)
    array([6, 3, 3, 3, 3, 3])
    """
    block_size, (t_r, t_c) = _grid(n_q, n_k, block_size)
    window = _check_int("window", window, 0)
    global_blocks = _check_int("global_blocks", global_blocks, 0)
    random_blocks = _check_int("random_blocks", random_blocks, 0)
    seed = _check_int("seed", seed, 0)
    rows, cols = np.arange(t_r)[:, None], np.arange(t_c)[None, :]
    layout = _with_global_blocks(np.abs(rows - cols) <= window, global_blocks)
    rng = np.random.default_rng(seed)
    for row in layout:  # a view: drawn after the fixed blocks, so every random block is an additional one
        free = np.flatnonzero(~row)
        row[rng.choice(free, size=min(random_blocks, free.size), replace=False)] = True
    return BlockMask(layout, block_size)


def random(n_q, n_k, block_size, density, seed):
    """Each block kept independently with probability ``density``, from ``default_rng(seed)``.

    ``density`` 0 keeps no block and 1 keeps all; the same arguments always
    give the same mask.

    >>> random(8, 8, (2, 2), density=0.5, seed=0).layout.astype(int)
    array([[0, 1, 1, 1],
           [0, 0, 0, 0],
           [0, 0, 0, 1],
           [0, 1, 0, 1]])
    """
    _, grid = _grid(n_q, n_k, block_size)
    density = _check_fraction("density", density)
    seed = _check_int("seed", seed, 0)
    # random() is in [0, 1): density 1 keeps every block, density 0 none
    return BlockMask(np.random.default_rng(seed).random(grid) < density, block_size)


# ---------------------------------------------------------------- pictures

def save_picture(block_mask, path, *, n_q=None, n_k=None, title=None):
    """Draw ``block_mask`` to a PNG at ``path`` (kept = dark).

    Without n_q and n_k, draws the block layout (query block i down, key
    block j across); with them, the element mask ``to_dense(n_q, n_k)``
    (query i down, key j across) with the block boundaries.  A layout with
    leading dims is drawn at its first leading index.  The title gets a
    caption with the grid, the block size and the density.
    """
    Figure = require("matplotlib.figure", "plot", "save_picture").Figure  # no pyplot: no global backend state
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask, got {type(block_mask).__name__}")
    if (n_q is None) != (n_k is None):
        raise ValueError("give both n_q and n_k (element picture) or neither (block picture)")
    first = (0,) * (block_mask.layout.ndim - 2)
    layout = block_mask.layout[first]
    (t_r, t_c), (block_rows, block_cols) = layout.shape, block_mask.block_size
    if n_q is None:
        image, labels = layout, ("key block j", "query block i")
        row_edges, col_edges = np.arange(t_r + 1), np.arange(t_c + 1)
    else:
        image, labels = block_mask.to_dense(n_q, n_k)[first], ("key j", "query i")
        row_edges = np.minimum(np.arange(t_r + 1) * block_rows, n_q)
        col_edges = np.minimum(np.arange(t_c + 1) * block_cols, n_k)
    caption = f"{t_r} x {t_c} blocks of {block_rows} x {block_cols}, density {layout.mean():.3f}"
    if n_q is not None:
        caption = f"{n_q} x {n_k} elements, " + caption

    figure = Figure(figsize=(5, 5), dpi=120)
    axes = figure.add_subplot()
    axes.imshow(image, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")  # vmin/vmax: all-ones is dark
    if max(t_r, t_c) <= 64:  # block boundaries, unless they would blacken the picture
        axes.set_xticks(col_edges - 0.5, minor=True)
        axes.set_yticks(row_edges - 0.5, minor=True)
        axes.grid(which="minor", color="0.8", linewidth=0.5)
        axes.tick_params(which="minor", length=0)
    axes.set_xlabel(labels[0])
    axes.set_ylabel(labels[1])
    axes.set_title(f"{title}\n{caption}" if title else caption, fontsize=10)
    figure.tight_layout()
    figure.savefig(path)


# ---------------------------------------------------------------- examples
# One representative mask per pattern, sized by n: the first docstring line
# says what it shows (the CLI's list and the gallery print it).

def _causal_example(n, block_size):
    """Causal: query i sees keys 0..i, so the key blocks right of the diagonal are skipped."""
    return causal(n, n, block_size)


def _local_example(n, block_size):
    """Sliding window, two-sided, |i - j| <= n/8 tokens: a band around the diagonal."""
    return local(n, n, block_size, window=n // 8)


def _butterfly_example(n, block_size):
    """Flat butterfly of full depth (block i sees i and every i XOR 2**k) plus 1 global block row and column."""
    longest_side = max(cdiv(n, b) for b in block_size)  # T_r or T_c
    full_depth = (longest_side - 1).bit_length()  # log2 of the padded power-of-two grid
    return butterfly(n, n, block_size, n_factors=full_depth, global_blocks=1)


def _strided_example(n, block_size):
    """Sparse Transformer strided, stride n/4: the last n/4 keys plus every (n/4)-th key back, causal."""
    return strided(n, block_size, stride=max(1, n // 4))


def _fixed_example(n, block_size):
    """Sparse Transformer fixed, stride n/4, c = n/16: own chunk plus the last c tokens of every chunk, causal."""
    stride = max(1, n // 4)
    return fixed(n, block_size, stride=stride, c=max(1, stride // 4))


def _bigbird_example(n, block_size):
    """BigBird: 1 block each side, 1 global block row and column, 2 random blocks per block row (seed 0)."""
    return bigbird(n, n, block_size, window=1, global_blocks=1, random_blocks=2, seed=0)


def _longformer_example(n, block_size):
    """Longformer: |i - j| <= n/16 tokens plus global token 0, which sees and is seen by every token."""
    return longformer(n, n, block_size, window=n // 16, global_tokens=[0])


def _random_example(n, block_size):
    """Random: each block kept with probability 0.25 (seed 0)."""
    return random(n, n, block_size, density=0.25, seed=0)


#: Short name -> example (n, block_size) -> BlockMask for an n x n matrix.
GENERATORS = {
    "causal": _causal_example,
    "local": _local_example,
    "butterfly": _butterfly_example,
    "strided": _strided_example,
    "fixed": _fixed_example,
    "bigbird": _bigbird_example,
    "longformer": _longformer_example,
    "random": _random_example,
}
