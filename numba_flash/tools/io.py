"""Device-memory traffic of the kernels (forward, and the flash2 backward), exactly, beside the paper's I/O bounds.

Theorem 2 of Dao et al. (2022) counts HBM accesses: standard attention
Theta(N d + N^2), FlashAttention Theta(N^2 d^2 / M) (M the SRAM size in
elements); Theorem 5 gives the same orders for the backward pass;
Proposition 4 gives block-sparse FlashAttention
Theta(N d + N^2 d^2 s / M) (s the fraction of non-zero blocks).  Those are
orders of growth of the paper's algorithms.  This module counts, for each
kernel *as implemented here*, the bytes that every global load and store in
its code moves, so that the bounds can be checked against what the code
really does:

* ``standard_traffic``: the three launches of Algorithm 0
  (``kernels/literal/standard_attention.py``);
* ``flash1_traffic``: Algorithm 1, or Algorithm 5 with a block mask
  (``kernels/literal/flash1_forward.py``);
* ``flash2_traffic``: the FlashAttention-2 kernel (``kernels/fast/forward.py``);
* ``flash1_backward_traffic``: Algorithm 4 (``kernels/literal/flash1_backward.py``);
* ``flash2_backward_traffic``: the three launches of the flash2 backward
  (``kernels/fast/backward.py``).

Each returns an ``AttentionTraffic``: one ``KernelTraffic`` per launch with
the bytes read and written per buffer, named as in ``api.py`` (q, k, v, o,
lse, s, p, l, m, layout, tile_offsets, tile_entries, tile_order).  ``device_allocations``
gives the bytes of the buffers a call allocates, and ``theorem2_standard``,
``theorem2_flash`` and ``proposition4_block_sparse`` the paper's leading
terms.  ``tests/test_io.py`` runs every kernel in the simulator on arrays
that count each element access and checks these numbers to the byte.

What is counted, precisely:

* bytes *requested* by each thread's loads and stores (element size: float32
  4, float16 2, int32 4, uint8 1; a 16-byte vector load counts 16).  A value
  that every thread of a block loads (flash1's M_ij, flash2's tile-list
  entries) counts once per thread.  This is the traffic the code asks of
  global memory, not what reaches DRAM: caches serve repeated requests (the
  standard matmul reloads each Q and K tile once per output tile), so a
  profiler's DRAM bytes are at most these numbers;
* tile elements outside the arrays are zero-filled, not loaded: not counted;
* dropout adds nothing: its mask is regenerated from counters, never stored;
* copies between host and device are not kernel traffic.

Where the kernels' traffic differs from the paper's accounting:

* standard: the tiled matmul reads Q, K and V once per tile of outputs,
  ceil(N/T) times each (T = ``MATMUL_TILE``), and P ceil(d/T) times, and
  the row softmax reads S three times (row max, row sum, numerators): about
  (4 d/T + 5) N^2 elements per head (21 N^2 at d = 64 on a GPU, T = 16)
  where the paper counts ~4 N^2 (write S, read S, write P, read P);
* flash1 (the literal Algorithm 1) writes O, l and m once more at line 2,
  reads O even on the first visit of a row, when it only multiplies it by 0,
  and reads l and m again for the final log-sum-exp;
* flash2 reads each K and V element ceil(N_q / B_r) times: Theta(N^2 d / B_r)
  with the query tile B_r in place of the paper's M / d.  With a block mask,
  every tile the layout covers only partly reads one layout byte per
  (row, key) it checks.
"""
from dataclasses import dataclass
from typing import Mapping, Tuple

import numpy as np

from ..kernels.literal.standard_attention import MATMUL_TILE
from ..sparsity.tile_lists import tile_lists, tile_visits
from ..tiling import cdiv, flash2_forward_warp_rows, flash2_threads, padded_head_dim, precision_of

FLOAT32 = 4  # bytes: S, P, l, m, lse, and q, k, v, o unless flash2 runs in float16
INT32 = 4    # flash2's tile lists
UINT8 = 1    # block-mask layouts


@dataclass(frozen=True)
class KernelTraffic:
    """Bytes one kernel launch reads and writes in device memory, per buffer."""

    name: str
    reads: Mapping[str, int]
    writes: Mapping[str, int]

    @property
    def read_bytes(self):
        return sum(self.reads.values())

    @property
    def write_bytes(self):
        return sum(self.writes.values())

    @property
    def total_bytes(self):
        return self.read_bytes + self.write_bytes


@dataclass(frozen=True)
class AttentionTraffic:
    """The launches of one attention call, in order, and their totals."""

    algorithm: str
    launches: Tuple[KernelTraffic, ...]

    @property
    def read_bytes(self):
        return sum(launch.read_bytes for launch in self.launches)

    @property
    def write_bytes(self):
        return sum(launch.write_bytes for launch in self.launches)

    @property
    def total_bytes(self):
        return self.read_bytes + self.write_bytes


def _bytes(counts):
    """{buffer: bytes} as plain ints, without buffers that move nothing."""
    return {name: int(count) for name, count in counts.items() if count}


def _block_lengths(n, block):
    """Length of each block of a split of range(n) into blocks of ``block`` (the last ragged)."""
    return np.minimum(block, n - block * np.arange(cdiv(n, block)))


def _layouts(mask, batch_heads, grid):
    """The block layout the kernels see, and how many heads each of its entries stands for.

    Without a mask every head is alike: one all-ones layout stands for all of
    them.  With one, ``mask`` is (layout, block size) as ``api.py`` passes
    it, the layout (batch_heads, T_r, T_c) boolean.
    """
    if mask is None:
        return np.ones((1,) + grid, bool), batch_heads
    layout = np.asarray(mask[0], bool)
    if layout.shape != (batch_heads,) + grid:
        raise ValueError(f"mask layout has shape {layout.shape}; these sizes need {(batch_heads,) + grid}")
    return layout, 1


def _visible_keys(n_q, n_k, causal):
    """Keys each query row may see before any block mask: j <= i when causal (top-left aligned)."""
    rows = np.arange(n_q)
    return np.minimum(n_k, rows + 1) if causal else np.full(n_q, n_k)


def _allowed_keys_per_row(layout, block_size, n_q, n_k, causal):
    """(heads, N_q): keys each row may attend to under the layout and causality."""
    block_rows, block_cols = block_size
    heads, _, t_c = layout.shape
    # before[h, i, c]: allowed keys of block row i in key blocks 0 .. c - 1.
    before = np.zeros(layout.shape[:2] + (t_c + 1,), np.int64)
    before[..., 1:] = np.cumsum(layout * _block_lengths(n_k, block_cols), axis=2)
    visible = _visible_keys(n_q, n_k, causal)
    whole_blocks, rest = np.divmod(visible, block_cols)
    # A row that sees all N_k keys of a multiple of B_c has no partial block:
    # the zero column keeps the index whole_blocks = T_c in range.
    partial_allowed = np.concatenate([layout, np.zeros((heads, layout.shape[1], 1), bool)], axis=2)
    block_row = np.arange(n_q) // block_rows
    return before[:, block_row, whole_blocks] + partial_allowed[:, block_row, whole_blocks] * rest


def _causal_pairs(rows_lo, rows_hi, keys_lo, keys_hi):
    """(row, key) pairs of [rows_lo, rows_hi) x [keys_lo, keys_hi) with key <= row (arrays)."""
    width = keys_hi - keys_lo

    def below(rows):  # pairs of rows 0 .. rows - 1: a ramp of 1, 2, .., width, then width per row
        ramp = np.clip(rows - keys_lo, 0, width)
        return ramp * (ramp + 1) // 2 + width * np.maximum(rows - keys_lo - width, 0)

    return below(rows_hi) - below(rows_lo)


def _tiled_matmul_elements(rows, cols, inner, tile):
    """Elements of A (rows x inner), B and C (rows x cols) that one batched_matmul moves per matrix.

    The block computing a tile x tile patch of C loads its band of A's rows
    and its band of B's columns over the whole inner dimension (guarded: only
    elements inside the matrices), so A is read once per column band of C and
    B once per row band, whether B is transposed or not.
    """
    return cdiv(cols, tile) * rows * inner, cdiv(rows, tile) * cols * inner, rows * cols


def standard_traffic(batch_heads, n_q, n_k, head_dim, *, causal=False, mask=None, matmul_tile=MATMUL_TILE):
    """Algorithm 0 as ``standard_attention`` launches it (float32).

    mask: None, or (layout, (B_r, B_c)) with layout (batch_heads, T_r, T_c)
    boolean.  matmul_tile: the matmul kernel's tile (16 on a GPU, 4 in the
    simulator: the module constant of wherever this runs).
    """
    block_size = (n_q, n_k) if mask is None else tuple(mask[1])
    layout, heads_each = _layouts(mask, batch_heads, (cdiv(n_q, block_size[0]), cdiv(n_k, block_size[1])))

    q_reads, k_reads, s_writes = _tiled_matmul_elements(n_q, n_k, head_dim, matmul_tile)
    qk = KernelTraffic("matmul S = tau Q K^T",
                       _bytes({"q": batch_heads * FLOAT32 * q_reads, "k": batch_heads * FLOAT32 * k_reads}),
                       _bytes({"s": batch_heads * FLOAT32 * s_writes}))

    # One pass each for the row max and the row sum over the allowed keys; the
    # writing pass reads S again for allowed keys when the row has any (l > 0),
    # and writes every entry of P (zeros where masked).
    allowed = _allowed_keys_per_row(layout, block_size, n_q, n_k, causal)
    visible = _visible_keys(n_q, n_k, causal)
    layout_reads = (2 * visible + visible * (allowed > 0)).sum() if mask is not None else 0
    softmax = KernelTraffic("row_softmax",
                            _bytes({"s": heads_each * FLOAT32 * 3 * allowed.sum(), "layout": UINT8 * layout_reads}),
                            _bytes({"p": batch_heads * FLOAT32 * n_q * n_k, "lse": batch_heads * FLOAT32 * n_q}))

    p_reads, v_reads, o_writes = _tiled_matmul_elements(n_q, head_dim, n_k, matmul_tile)
    pv = KernelTraffic("matmul O = P V",
                       _bytes({"p": batch_heads * FLOAT32 * p_reads, "v": batch_heads * FLOAT32 * v_reads}),
                       _bytes({"o": batch_heads * FLOAT32 * o_writes}))
    return AttentionTraffic("standard", (qk, softmax, pv))


def flash1_traffic(batch_heads, n_q, n_k, head_dim, block_sizes, *, causal=False, mask=None):
    """Algorithm 1 (Algorithm 5 with a mask) as ``flash1_forward`` runs it (float32).

    block_sizes: the kernel's (B_r, B_c); mask: None, or (layout, block size)
    with the block size equal to block_sizes (the kernel's tiles are the
    mask's blocks).
    """
    block_rows, block_cols = block_sizes
    if mask is not None and tuple(mask[1]) != tuple(block_sizes):
        raise ValueError(f"flash1 runs Algorithm 5 with tiles equal to the mask's blocks: "
                         f"{tuple(mask[1])} != {tuple(block_sizes)}")
    t_r, t_c = cdiv(n_q, block_rows), cdiv(n_k, block_cols)
    visited, heads_each = _layouts(mask, batch_heads, (t_r, t_c))
    visits = visited.sum(axis=2)                                   # inner iterations of each block row
    row_visits = (visits * _block_lengths(n_q, block_rows)).sum()  # (row, inner iteration) pairs
    # Line 12 reads and rewrites O only where l_new > 0: from the row's first
    # allowed key on.  A row that has any allowed key meets one in the first
    # visited tile of its block row (causality only removes later tiles), so
    # that is every visited tile of its block row, or none.
    attends = _allowed_keys_per_row(visited, block_sizes, n_q, n_k, causal) > 0
    o_updates = (np.repeat(visits, block_rows, axis=1)[:, :n_q] * attends).sum()
    rows_attending = attends.sum()

    reads = {
        # line 6: K_j, V_j once per outer iteration, masked or not (keys past N_k are zeros, not loads)
        "k": FLOAT32 * n_k * head_dim * batch_heads,
        "v": FLOAT32 * n_k * head_dim * batch_heads,
        "q": FLOAT32 * head_dim * row_visits * heads_each,          # line 8: Q_i every inner iteration
        "o": FLOAT32 * head_dim * o_updates * heads_each,           # line 12
        # line 8: l_i, m_i; after the loops lse reads l, and where l > 0, m and l again
        "l": FLOAT32 * (row_visits + rows_attending) * heads_each + FLOAT32 * n_q * batch_heads,
        "m": FLOAT32 * (row_visits + rows_attending) * heads_each,
        # Alg. 5, line 8: every thread of the block reads M_ij for every (i, j)
        "layout": UINT8 * block_rows * t_r * t_c * batch_heads if mask is not None else 0,
    }
    writes = {
        # line 2 (O = 0, l = 0, m = -inf), then lines 12 and 13
        "o": FLOAT32 * head_dim * (n_q * batch_heads + o_updates * heads_each),
        "l": FLOAT32 * (n_q * batch_heads + row_visits * heads_each),
        "m": FLOAT32 * (n_q * batch_heads + row_visits * heads_each),
        "lse": FLOAT32 * n_q * batch_heads,
    }
    name = "flash1_forward" if mask is None else "flash1_forward (Algorithm 5)"
    return AttentionTraffic("flash1", (KernelTraffic(name, _bytes(reads), _bytes(writes)),))


def _flash2_visited_tiles(n_q, n_k, tile, causal, mask):
    """(query tile, key tile, partly masked) of every key tile flash2 visits, as arrays, and the query tile of
    every block that loads its Q_i.

    Without a mask the kernel walks key tiles 0 .. n_blocks - 1 (causal: up to
    the last one holding a key <= the query tile's last row), the same in
    every head: these are one head's, and every block loads Q_i.  With a mask
    the host's ``tile_lists`` decides, and these are all heads' tiles; a block
    whose list is empty skips Q_i.
    """
    block_m, block_n = tile
    t_q, t_k = cdiv(n_q, block_m), cdiv(n_k, block_n)
    if mask is None:
        last_row = np.minimum(block_m * np.arange(t_q) + block_m, n_q) - 1
        visit = np.ones((1, t_q, t_k), bool)
        if causal:
            visit &= block_n * np.arange(t_k)[None, None, :] <= last_row[None, :, None]
        _, q_tile, k_tile = np.nonzero(visit)
        return q_tile, k_tile, np.zeros(len(k_tile), bool), np.arange(t_q)
    offsets, entries = tile_lists(*tile_visits(np.asarray(mask[0], bool), tuple(mask[1]), tile, n_q, n_k,
                                               0 if causal else None))
    per_query_tile = np.diff(offsets, axis=1).ravel()
    owner = np.repeat(np.arange(per_query_tile.size), per_query_tile)
    return owner % t_q, entries >> 1, (entries & 1).astype(bool), np.flatnonzero(per_query_tile) % t_q


def flash2_traffic(batch_heads, n_q, n_k, head_dim, block_sizes, *, dtype=np.float32, causal=False, mask=None):
    """The FlashAttention-2 kernel as ``flash2_forward`` launches it.

    block_sizes: (BLOCK_M, BLOCK_N); dtype: float32 or float16 (q, k, v, o;
    lse is float32); mask: None, or (layout, block size) in any block size.
    The bytes are the same for the 16-byte vector path and the scalar one:
    vector loads only run when d is a multiple of the vector, so neither
    loads a padding column.
    """
    block_m, block_n = block_sizes
    element = np.dtype(dtype).itemsize
    precision = precision_of(dtype)
    heads_each = batch_heads if mask is None else 1
    q_tile, k_tile, partly, loading_q = _flash2_visited_tiles(n_q, n_k, block_sizes, causal, mask)
    warp_rows = flash2_forward_warp_rows(block_m, padded_head_dim(head_dim, precision), precision,
                                         plain=not partly.any())
    threads = flash2_threads(block_m, warp_rows)

    keys = _block_lengths(n_k, block_n)[k_tile]
    reads = {   # Q_i once per block that visits a key tile; K_j, V_j once per visited tile
        "q": element * head_dim * _block_lengths(n_q, block_m)[loading_q].sum() * heads_each,
        "k": element * head_dim * keys.sum() * heads_each,
        "v": element * head_dim * keys.sum() * heads_each,
    }
    if mask is not None:
        q0, k0 = block_m * q_tile, block_n * k_tile
        rows_hi, keys_hi = np.minimum(q0 + block_m, n_q), np.minimum(k0 + block_n, n_k)
        # Only tiles the layout covers partly check it: there each
        # (row < N_q, key < N_k) that causality leaves reads its layout byte.
        checked = _causal_pairs(q0, rows_hi, k0, keys_hi) if causal else (rows_hi - q0) * (keys_hi - k0)
        reads["layout"] = UINT8 * checked[partly].sum()
        # Every thread reads its block's entry of the order and its query tile's two offsets, and each
        # visited entry twice: when fetching the tile ahead, and when computing on it.
        reads["tile_order"] = INT32 * threads * cdiv(n_q, block_m) * batch_heads
        reads["tile_offsets"] = INT32 * 2 * threads * cdiv(n_q, block_m) * batch_heads
        reads["tile_entries"] = INT32 * 2 * threads * len(k_tile)
    writes = {"o": element * n_q * head_dim * batch_heads, "lse": FLOAT32 * n_q * batch_heads}
    name = "flash2_forward" if mask is None else "flash2_forward (block-sparse)"
    return AttentionTraffic("flash2", (KernelTraffic(name, _bytes(reads), _bytes(writes)),))


def flash1_backward_traffic(batch_heads, n_q, n_k, head_dim, block_sizes, *, causal=False, mask=None):
    """Algorithm 4 as ``flash1_backward`` runs it (float32): one launch.

    Per head: dQ zeroed (line 5); K_j, V_j loaded once; for every visited
    (i, j) Q_i and dO_i loaded, and each valid row reads its O row and lse
    (for D_i, recomputed per visit as Algorithm 4 does) and reads and writes
    its dQ row (line 21); dK_j, dV_j written once.  causal changes nothing:
    Algorithm 4 visits every tile and masks elements.  With a mask (blocks
    equal to the tiles) only non-zero tiles are visited, and every thread
    reads M_ij for every (i, j).
    """
    block_rows, block_cols = block_sizes
    grid = (cdiv(n_q, block_rows), cdiv(n_k, block_cols))
    layout, heads_each = _layouts(mask, batch_heads, grid)
    if mask is not None and tuple(mask[1]) != tuple(block_sizes):
        raise ValueError(f"flash1 runs Algorithm 5 with tiles equal to the mask's blocks: "
                         f"mask blocks {tuple(mask[1])}, tiles {tuple(block_sizes)}")
    # Rows of query block i, summed over the tiles each head visits.
    visited_rows = heads_each * (layout * _block_lengths(n_q, block_rows)[None, :, None]).sum()
    row_elements = head_dim * visited_rows
    reads = {"k": FLOAT32 * batch_heads * n_k * head_dim, "v": FLOAT32 * batch_heads * n_k * head_dim,
             "q": FLOAT32 * row_elements, "do": FLOAT32 * row_elements, "o": FLOAT32 * row_elements,
             "dq": FLOAT32 * row_elements, "lse": FLOAT32 * visited_rows}
    if mask is not None:
        reads["layout"] = UINT8 * block_rows * grid[0] * grid[1] * batch_heads
    writes = {"dq": FLOAT32 * (batch_heads * n_q * head_dim + row_elements),
              "dk": FLOAT32 * batch_heads * n_k * head_dim, "dv": FLOAT32 * batch_heads * n_k * head_dim}
    return AttentionTraffic("flash1 backward", (KernelTraffic("flash1_backward", _bytes(reads), _bytes(writes)),))


def flash2_backward_traffic(batch_heads, n_q, n_k, head_dim, block_sizes, *, dtype=np.float32, causal=False,
                            mask=None):
    """The flash2 backward's three launches as ``flash2_backward`` makes them.

    block_sizes: (B_r, B_c) as the backward takes them (B_r owned, B_c
    streamed); dtype of q, k, v, o, do and the gradients (lse and D are
    float32); mask: None, or (layout, block size).  Each streamed tile is
    read once, whatever the dtype.
    """
    own, other = block_sizes
    element = np.dtype(dtype).itemsize
    threads = flash2_threads(own)
    rows_q, rows_k = batch_heads * n_q, batch_heads * n_k
    preprocess = KernelTraffic("flash2_backward_preprocess", _bytes({"o": element * rows_q * head_dim,
                                                                       "do": element * rows_q * head_dim}),
                               _bytes({"d": FLOAT32 * rows_q}))

    def visits(tile, transpose):
        """(own tile, other tile, partly, heads each stands for) of every visit of one pass.

        tile: (query rows, keys) of the pass's tiles; transpose: the pass owns
        key tiles (dK/dV) rather than query tiles (dQ).
        """
        t_q, t_k = cdiv(n_q, tile[0]), cdiv(n_k, tile[1])
        if mask is None:
            if transpose:  # dK/dV: key tile kt walks query tiles kt * B_r // B_c .. T_q - 1
                visit = np.arange(t_q)[None, :] >= (own * np.arange(t_k) // other)[:, None] if causal \
                    else np.ones((t_k, t_q), bool)
            else:          # dQ: as the forward
                last_row = np.minimum(tile[0] * np.arange(t_q) + tile[0], n_q) - 1
                visit = (tile[1] * np.arange(t_k)[None, :] <= last_row[:, None]) if causal \
                    else np.ones((t_q, t_k), bool)
            own_tile, other_tile = np.nonzero(visit)
            return own_tile, other_tile, np.zeros(len(own_tile), bool), batch_heads
        visit, partly = tile_visits(np.asarray(mask[0], bool), tuple(mask[1]), tile, n_q, n_k, 0 if causal else None)
        if transpose:
            visit, partly = visit.transpose(0, 2, 1), partly.transpose(0, 2, 1)
        _, own_tile, other_tile = np.nonzero(visit)
        return own_tile, other_tile, partly[visit], 1

    def layout_reads(q_lo, q_hi, k_lo, k_hi, partly):
        """Layout bytes read: each (query < N_q, key < N_k) pair causality leaves, in partly masked visits."""
        checked = _causal_pairs(q_lo, q_hi, k_lo, k_hi) if causal else (q_hi - q_lo) * (k_hi - k_lo)
        return UINT8 * checked[partly].sum()

    # dK/dV: one block per key tile (B_r keys) walks query tiles (B_c queries).
    k_tile, q_tile, partly, heads_each = visits((other, own), transpose=True)
    q0, k0 = other * q_tile, own * k_tile
    queries = np.minimum(q0 + other, n_q) - q0
    reads = {"k": element * rows_k * head_dim, "v": element * rows_k * head_dim,
             "q": element * head_dim * queries.sum() * heads_each,
             "do": element * head_dim * queries.sum() * heads_each,
             "lse": FLOAT32 * queries.sum() * heads_each, "d": FLOAT32 * queries.sum() * heads_each}
    if mask is not None:
        reads["layout"] = layout_reads(q0, q0 + queries, k0, np.minimum(k0 + own, n_k), partly)
        reads["tile_offsets"] = INT32 * 2 * threads * cdiv(n_k, own) * batch_heads
        reads["tile_entries"] = INT32 * threads * len(k_tile)
    dkdv = KernelTraffic("flash2_backward_dkdv", _bytes(reads),
                         _bytes({"dk": element * rows_k * head_dim, "dv": element * rows_k * head_dim}))

    # dQ: one block per query tile (B_r queries) walks key tiles (B_c keys); each row's
    # lse and D are read by the four lanes that hold it.
    q_tile, k_tile, partly, heads_each = visits((own, other), transpose=False)
    q0, k0 = own * q_tile, other * k_tile
    keys = np.minimum(k0 + other, n_k) - k0
    reads = {"q": element * rows_q * head_dim, "do": element * rows_q * head_dim,
             "lse": 4 * FLOAT32 * rows_q, "d": 4 * FLOAT32 * rows_q,
             "k": element * head_dim * keys.sum() * heads_each,
             "v": element * head_dim * keys.sum() * heads_each}
    if mask is not None:
        reads["layout"] = layout_reads(q0, np.minimum(q0 + own, n_q), k0, k0 + keys, partly)
        reads["tile_offsets"] = INT32 * 2 * threads * cdiv(n_q, own) * batch_heads
        reads["tile_entries"] = INT32 * threads * len(q_tile)
    dq = KernelTraffic("flash2_backward_dq", _bytes(reads), _bytes({"dq": element * rows_q * head_dim}))
    return AttentionTraffic("flash2 backward", (preprocess, dkdv, dq))


def attention_traffic(algorithm, batch_heads, n_q, n_k, head_dim, *, block_sizes=None, dtype=np.float32,
                      causal=False, mask=None):
    """The traffic of ``attention(..., algorithm=algorithm)`` with these sizes (block_sizes as the kernel uses them)."""
    if algorithm == "standard":
        return standard_traffic(batch_heads, n_q, n_k, head_dim, causal=causal, mask=mask)
    if algorithm == "flash1":
        return flash1_traffic(batch_heads, n_q, n_k, head_dim, block_sizes, causal=causal, mask=mask)
    if algorithm == "flash2":
        return flash2_traffic(batch_heads, n_q, n_k, head_dim, block_sizes, dtype=dtype, causal=causal, mask=mask)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def device_allocations(algorithm, batch_heads, n_q, n_k, head_dim, *, dtype=np.float32, block_sizes=None,
                       causal=False, mask=None):
    """{buffer: bytes} that one ``attention`` call with host (NumPy) inputs allocates on the device.

    All of them live until the call returns, so their sum is the call's
    peak.  With device inputs q, k and v are not allocated.  block_sizes and
    causal matter only for flash2 with a mask (the length of its tile list).
    """
    element = np.dtype(dtype).itemsize
    buffers = {
        "q": element * batch_heads * n_q * head_dim,
        "k": element * batch_heads * n_k * head_dim,
        "v": element * batch_heads * n_k * head_dim,
        "o": element * batch_heads * n_q * head_dim,
        "lse": FLOAT32 * batch_heads * n_q,
    }
    if algorithm == "standard":
        buffers["s"] = buffers["p"] = FLOAT32 * batch_heads * n_q * n_k
    elif algorithm == "flash1":
        buffers["l"] = buffers["m"] = FLOAT32 * batch_heads * n_q
    if mask is not None:
        buffers["layout"] = UINT8 * np.asarray(mask[0]).size
        if algorithm == "flash2":
            buffers["tile_offsets"] = INT32 * batch_heads * (cdiv(n_q, block_sizes[0]) + 1)
            buffers["tile_order"] = INT32 * batch_heads * cdiv(n_q, block_sizes[0])
            visited = len(_flash2_visited_tiles(n_q, n_k, block_sizes, causal, mask)[1])
            buffers["tile_entries"] = INT32 * max(visited, 1)  # an empty list still gets one entry
    return {name: int(size) for name, size in buffers.items()}


# The paper's I/O bounds: leading terms in element accesses per (batch, head),
# without constants.  M is the SRAM size in elements; compare shapes (slopes
# on log-log axes), not values.

def theorem2_standard(n, d):
    """Theorem 2, standard attention: N d + N^2."""
    return n * d + n ** 2


def theorem2_flash(n, d, sram_elements):
    """Theorem 2, FlashAttention: N^2 d^2 / M."""
    return n ** 2 * d ** 2 / sram_elements


def theorem5_backward(n, d, sram_elements=None):
    """Theorem 5, the backward pass: standard N d + N^2; FlashAttention N^2 d^2 / M (given M).

    The same orders as the forward's (Theorem 2): the backward reads and
    writes a constant number of N x d (and, for standard, N x N) arrays more.
    """
    return theorem2_standard(n, d) if sram_elements is None else theorem2_flash(n, d, sram_elements)


def proposition4_block_sparse(n, d, sram_elements, density):
    """Proposition 4, block-sparse FlashAttention: N d + N^2 d^2 s / M, s the fraction of non-zero blocks."""
    return n * d + n ** 2 * d ** 2 * density / sram_elements


__all__ = ["KernelTraffic", "AttentionTraffic", "standard_traffic", "flash1_traffic", "flash2_traffic",
           "flash1_backward_traffic", "flash2_backward_traffic", "attention_traffic", "device_allocations", "theorem2_standard",
           "theorem2_flash", "theorem5_backward", "proposition4_block_sparse"]
