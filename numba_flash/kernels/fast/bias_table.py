"""The relative-bias table's gradient, summed by the backward's dQ kernels while they compute dS.

With t_ij = scale q_i k_j + bias[h, clamp(j - i, -D, D) + D] (``mods.relative_position_bias``), d L / d bias[h, c]
is the sum of dS = P o (dP - D) over the entries of head h (every batch entry) whose clamped distance j - i is c.
A dQ kernel (the ``mma.sync`` backward's, ``fast/backward.make_dq``, and the wgmma backward's "separate" one,
``hopper/backward.make_wgmma_dq``) already holds dS of each (query tile, key tile) in registers, so with
``TABLE_REACH`` = D it also sums it along the table's bins, two named steps per tile:

    stash_gradients    this lane's dS entries into a ROWS x COLS float32 tile in shared memory   (a barrier after)
    add_diagonals      the tile's ROWS + COLS - 1 diagonals m = key - row (m = 1 - ROWS .. COLS - 1), each summed
                       down its rows by one thread (thread x takes diagonals x, x + THREADS, ...), then added to the
                       bin of the clamped distance k0 - q0 + m: an inner bin in shared memory (in one tile no two
                       diagonals share one), an edge bin (|distance| >= D) into the thread's own two sums
    (next tile: the loop's barrier orders its stash after every thread's reads, and a bin's adds by tile)

and at the end ``write_bins``: the threads' edge sums added in thread order into bins 0 and 2D, the block's 2D + 1
bins written to row (batch head, query tile) of a float32 workspace, which the host sums over batch entries and
query tiles (``numba_flash.torch``).  Every add runs in an order fixed by the grid, so the gradient has the same bits
on every run; it differs from the torch path's (``_bias_gradient``) in the order of its float32 adds.  Both kernels'
dS lanes use mma's accumulator layout (``lane_entry``: register i of lane (g, t) of warp w at row 16 w + g +
8 ((i % 4) // 2), column 8 (i // 4) + 2 t + i % 2), the wgmma kernel's as one flat array, the mma.sync kernel's as
(column tiles, 4) (FRAGMENTS).  The torch path stays for packed sequences, the modes that sum dQ in the dK/dV kernel,
dropout, tables wider than ``FUSED_REACH`` and tiles whose shared memory would not fit.
"""
from functools import lru_cache

from numba import cuda, float32

from ...runtime.launch import inlined_device_function
from .common import lane_entry
from .primitives import f32_as_u32, load_word, store_word, u32_as_f32

#: Words a row of the stashed float32 dS tile takes beyond its COLS: 8, so that rows eight apart (a warp's two row
#: halves) fall in different banks at COLS = 64 (72 = 8 mod 32), and a diagonal's reads by consecutive threads are
#: consecutive words.
ROW_PAD = 8
#: The widest table (2 D + 1 bins, D = FUSED_REACH) whose bins a dQ kernel keeps in shared memory (16 KB); wider
#: ones take the torch path.
FUSED_REACH = 2047


def table_words(reach, threads, rows, cols):
    """Shared-memory words the steps use at ``reach`` for ROWS x COLS tiles and blocks of ``threads``: the dS tile,
    the bins, and two edge sums per thread."""
    return rows * (cols + ROW_PAD) + 2 * reach + 1 + 2 * threads


def table_rows(batch_heads, query_tiles, reach):
    """Words of a dQ kernel's table sums: 2 D + 1 bins per (batch, query head, query tile), in that order."""
    return batch_heads * query_tiles * (2 * reach + 1)


@lru_cache(maxsize=None)
def table_steps(REACH, THREADS, ROWS, COLS, FRAGMENTS=False):
    """(zero_bins, stash_gradients, add_diagonals, write_bins) for a table of 2 REACH + 1 bins, ROWS x COLS tiles of
    dS and blocks of THREADS threads (16-row warps: THREADS = 2 ROWS); FRAGMENTS: dS as (COLS / 8, 4) per lane
    (the mma.sync kernels'), else flat.  The words from ``at`` hold the tile, then the bins, then the edge sums."""
    BINS = 2 * REACH + 1
    ROW_WORDS = COLS + ROW_PAD
    REGISTERS = ROWS * COLS // THREADS
    DIAGONALS = ROWS + COLS - 1
    BINS_AT = ROWS * ROW_WORDS
    EDGES_AT = BINS_AT + BINS
    assert THREADS == 2 * ROWS and COLS % 8 == 0, (THREADS, ROWS, COLS)

    @inlined_device_function
    def zero_bins(smem, at, tid):
        """The block's bins to 0 (ordered before the first adds by the tile loop's barrier)."""
        for x in range(tid, BINS, THREADS):
            store_word(smem, at + BINS_AT + x, f32_as_u32(float32(0)))

    @inlined_device_function
    def stash_gradients(smem, at, ds, warp, g, t):
        """This lane's dS entries (``lane_entry``) into the float32 tile: element (r, c) at word r ROW_WORDS + c."""
        for i in range(REGISTERS):
            row, column = lane_entry(i, g, t, warp)
            value = ds[i // 4, i % 4] if FRAGMENTS else ds[i]
            store_word(smem, at + row * ROW_WORDS + column, f32_as_u32(value))

    @inlined_device_function
    def add_diagonals(smem, at, distance0, low, high, tid):
        """The diagonals of thread tid (m = x - (ROWS - 1) for x = tid, tid + THREADS, ...) summed down their rows,
        each added to the bin of the clamped distance ``distance0`` + m (``distance0`` = the tile's first key minus
        its first query); returns the thread's (low, high) edge sums, the part of the bins -D and D beyond the inner
        ones."""
        for x in range(tid, DIAGONALS, THREADS):
            m = x - (ROWS - 1)
            total = float32(0)
            for r in range(max(0, -m), min(ROWS, COLS - m)):
                total += u32_as_f32(load_word(smem, at + r * ROW_WORDS + r + m))
            distance = distance0 + m
            if distance <= -REACH:
                low += total
            elif distance >= REACH:
                high += total
            else:
                word = at + BINS_AT + distance + REACH
                store_word(smem, word, f32_as_u32(u32_as_f32(load_word(smem, word)) + total))
        return low, high

    @inlined_device_function
    def write_bins(smem, at, low, high, SUMS, first, tid):
        """Bins 0 and 2 REACH take the threads' edge sums in thread order (low, then high: with REACH = 0 both are
        bin 0); then the bins go to SUMS[first .. first + 2 REACH]."""
        store_word(smem, at + EDGES_AT + tid, f32_as_u32(low))
        store_word(smem, at + EDGES_AT + THREADS + tid, f32_as_u32(high))
        cuda.syncthreads()   # every edge sum and every inner bin's last add is there
        if tid == 0:
            for side in range(2):
                bin_word = at + BINS_AT + side * (BINS - 1)
                total = u32_as_f32(load_word(smem, bin_word))
                for x in range(THREADS):
                    total += u32_as_f32(load_word(smem, at + EDGES_AT + side * THREADS + x))
                store_word(smem, bin_word, f32_as_u32(total))
        cuda.syncthreads()   # the edge bins are whole
        for x in range(tid, BINS, THREADS):
            SUMS[first + x] = u32_as_f32(load_word(smem, at + BINS_AT + x))

    return zero_bins, stash_gradients, add_diagonals, write_bins
