"""Moving tiles between device memory and shared memory, for the literal kernels.

The fast kernel has its own vectorised, pipelined loads; the literal kernels
load a tile the plain way: every thread of the block takes every
``threads``-th element.

These helpers are inlined by LLVM (``inlined_device_function``), not by Numba
(``inline=True``): NVVM 13 rejects the debug info of a function inlined at
the Numba IR level inside a loop ("Symbol name with unsupported characters")
once kernels are compiled with line info, as ours are for ncu.
"""
from numba import float32

from ...runtime.launch import inlined_device_function


@inlined_device_function
def load_rows(tile, X, bh, first_row, n_rows, thread, threads):
    """tile[r, x] = X[bh, first_row + r, x], zeros past row n_rows (all threads together)."""
    rows, width = tile.shape
    for e in range(thread, rows * width, threads):
        r = e // width
        x = e % width
        tile[r, x] = X[bh, first_row + r, x] if first_row + r < n_rows else float32(0)


@inlined_device_function
def zero_tile(tile, thread, threads):
    """tile[:, :] = 0 (all threads together)."""
    rows, width = tile.shape
    for e in range(thread, rows * width, threads):
        tile[e // width, e % width] = float32(0)
