"""The relative-bias table's gradient, summed by the wgmma backward's dQ kernel while it computes dS.

With t_ij = scale q_i k_j + bias[h, clamp(j - i, -D, D) + D] (``mods.relative_position_bias``), d L / d bias[h, c]
is the sum of dS = P o (dP - D) over the entries of head h (every batch entry) whose clamped distance j - i is c.
The dQ kernel (``backward.make_wgmma_dq``, "separate" mode) already holds dS of each (query tile, key tile) in
registers, so with ``TABLE_REACH`` = D it also sums it along the table's bins, two named steps per tile:

    stash_gradients    this lane's dS entries into a 64 x 64 float32 tile in shared memory      (a barrier after)
    add_diagonals      thread m + 63 sums diagonal m = key - row of the tile (m = -63 .. 63), rows in order, and adds
                       it to the bin of the clamped distance k0 - q0 + m: an inner bin in shared memory (in one tile
                       no two threads share one), an edge bin (|distance| >= D) into the thread's own two sums
    (next tile: the loop's barrier orders its stash after every thread's reads, and a bin's adds by tile)

and at the end ``write_bins``: the threads' edge sums added in thread order into bins 0 and 2D, the block's 2D + 1
bins written to row (batch head, query tile) of a float32 workspace, which the host sums over batch entries and
query tiles (``numba_flash.torch``).  Every add runs in an order fixed by the grid, so the gradient has the same bits
on every run; it differs from the torch path's (``_bias_gradient``) in the order of its float32 adds.  The steps run
on the diagonal-sum reads' shared-memory bandwidth (4096 stores and reads a tile) while dQ's product runs
(``add_diagonals`` is issued after it).  The torch path stays for every other backward (mma.sync, packed sequences,
the modes that sum dQ in the dK/dV kernel) and for tables wider than ``FUSED_REACH``.
"""
from functools import lru_cache

from numba import cuda, float32

from ...runtime.launch import inlined_device_function
from ..fast.primitives import f32_as_u32, load_word, store_word, u32_as_f32
from .common import BLOCK_N, lane_entry

#: Words between two rows of the stashed float32 dS tile: 72 = 8 mod 32 banks, so a warp's stores of two rows
#: eight apart land in different banks (two wavefronts a store), and a diagonal's reads by consecutive threads
#: are consecutive words (one wavefront).
ROW_WORDS = 72
DIAGONALS = 2 * BLOCK_N - 1
#: The widest table (2 D + 1 bins, D = FUSED_REACH) whose bins the dQ kernel keeps in shared memory (16 KB); wider
#: ones take the torch path.
FUSED_REACH = 2047


def table_words(reach, threads):
    """Shared-memory words the steps use at ``reach``: the dS tile, the bins, and two edge sums per thread."""
    return BLOCK_N * ROW_WORDS + 2 * reach + 1 + 2 * threads


@lru_cache(maxsize=None)
def table_steps(REACH, THREADS):
    """(zero_bins, stash_gradients, add_diagonals, write_bins) for a table of 2 REACH + 1 bins and blocks of THREADS
    (a warpgroup: 128 >= DIAGONALS) threads; the words from ``at`` hold the tile, then the bins, then the edge
    sums."""
    BINS = 2 * REACH + 1
    REGISTERS = BLOCK_N * BLOCK_N // THREADS
    BINS_AT = BLOCK_N * ROW_WORDS
    EDGES_AT = BINS_AT + BINS

    @inlined_device_function
    def zero_bins(smem, at, tid):
        """The block's bins to 0 (ordered before the first adds by the tile loop's barrier)."""
        for x in range(tid, BINS, THREADS):
            store_word(smem, at + BINS_AT + x, f32_as_u32(float32(0)))

    @inlined_device_function
    def stash_gradients(smem, at, ds, warp, g, t):
        """This lane's dS entries (its registers of a 64 x 64 accumulator, ``lane_entry``) into the float32 tile:
        element (r, c) at word r ROW_WORDS + c."""
        for i in range(REGISTERS):
            row, column = lane_entry(i, g, t, warp)
            store_word(smem, at + row * ROW_WORDS + column, f32_as_u32(ds[i]))

    @inlined_device_function
    def add_diagonals(smem, at, distance0, low, high, tid):
        """Thread tid < DIAGONALS: the tile's diagonal m = tid - 63 summed down its rows, added to the bin of the
        clamped distance ``distance0`` + m (``distance0`` = the tile's first key minus its first query); returns the
        thread's (low, high) edge sums, the part of the bins -D and D beyond the inner ones."""
        if tid < DIAGONALS:
            m = tid - (BLOCK_N - 1)
            total = float32(0)
            for r in range(BLOCK_N):
                column = r + m
                if column >= 0 and column < BLOCK_N:
                    total += u32_as_f32(load_word(smem, at + r * ROW_WORDS + column))
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
