"""What the Hopper kernels share: 64-row tiles of 16-bit rows in 128-byte-swizzled shared memory.

A tile is 64 rows (query rows, or keys) of d 16-bit columns, stored as
``layout_dim(d) / 64`` swizzled tiles of 64 columns (``wgmma.py``'s table): a
head dim that is not one of the layout widths 64, 128, 256 (``LAYOUT_DIMS``)
takes the layout of the next one (d = 96: two tiles, columns 96..127 zero;
d = 192: four tiles, columns 192..255 zero).  It is read by the tensor cores
in two ways: K-major (its rows are an operand's rows: Q and K in S = Q K^T)
or MN-major (its rows run along the product's k: V in O += P V).  The forward
(``forward.py``) and the backward (``backward.py``) copy their tiles with the
same cp.async copier and name them with the same descriptors.
"""
from functools import lru_cache

import numpy as np

from ...runtime.device import device_limits, in_simulator
from ...runtime.launch import inlined_device_function
from ..fast.common import LOG2_E, tile_coordinates
from ..fast.primitives import copy_async16
from .wgmma import ROW_BYTES, SWIZZLE_128B, descriptor_device, staged_offset_device, swizzle_128_device

BLOCK_N = 64             # rows per tile: keys of a K/V tile, or query rows of a Q/dO tile
S_REGISTERS = BLOCK_N // 2   # a lane's registers of a 64 x 64 accumulator (S, dP, and their transposes)
A_WORDS = S_REGISTERS // 2   # the same as 16-bit pairs: an A operand from registers
#: The head dims the wgmma forward and backward take (``out_of_scope``): multiples of 16 (their products' k-step) up to
#: 128, on the 64- or 128-column layout (``layout_dim``).
HEAD_DIMS = tuple(range(16, 129, 16))
#: The forward's: those, and up to 256 on the 256-column layout (Gemma-style heads: O is m64n256, 128 registers a
#: thread, wgmma's widest N).  The backward stops at 128: its dK and dV accumulators, 64 x d float32 each in one
#: warpgroup's registers, would be 256 registers a thread at d = 256, past the 255 a thread may have
#: (docs/performance.md, "Head dims").
FORWARD_HEAD_DIMS = HEAD_DIMS + tuple(range(144, 257, 16))
#: The widths of the shared-memory layouts (whole 64-column swizzled tiles).  No 192: the copier's column groups
#: (``tile_copier``) are 128 columns wide in a block of one warpgroup.
LAYOUT_DIMS = (64, 128, 256)
#: Descriptor byte offsets (leading, stride).  K-major (Q, K): 8-row groups 1024 bytes apart, the
#: leading offset unused.  MN-major (V): the 64-column tiles of V (BLOCK_N rows each) apart, and the
#: 8-row groups along the keys.  Both as wgmma.py's table has them (experiments/tuning/wgmma_layouts.py).
K_MAJOR_OFFSETS = (16, 1024)
MN_MAJOR_OFFSETS = (BLOCK_N * ROW_BYTES, 1024)


def environment_choice(variable, value, choices):
    """The setting of environment variable ``variable`` (its text ``value``) as the one of ``choices`` it names:
    an int where the choices are ints; else a ValueError naming the variable and the choices."""
    chosen = int(value) if isinstance(choices[0], int) and str(value).isdigit() else value
    if chosen not in choices:
        raise ValueError(f"{variable} must be one of {tuple(choices)}, not {value!r}")
    return chosen


def layout_dim(head_dim):
    """Columns of a tile of head dim d in shared memory: the narrowest of ``LAYOUT_DIMS`` that holds d (64, 128 or
    256), the columns past d zero."""
    return next(width for width in LAYOUT_DIMS if head_dim <= width)


def tile_bytes(head_dim):
    """Bytes of a 64-row tile of d 16-bit columns (as layout_dim(d) / 64 swizzled tiles of 64 columns)."""
    return BLOCK_N * layout_dim(head_dim) * 2


@inlined_device_function
def query_tile(block_id, q_tiles, heads, causal, rows):
    """(q0, head, batch, batch*heads index) of a block of a grid over query tiles of ``rows`` rows
    (``fast.common.tile_coordinates``; causal grids run each head's longest tile, the last, first)."""
    tile, h, b, bh = tile_coordinates(block_id, q_tiles, heads, causal)
    return (q_tiles - 1 - tile if causal else tile) * rows, h, b, bh


@inlined_device_function
def first_atom_words(base):
    """Words from a shared array at shared address ``base`` to its first 1024-byte boundary, where the swizzled tiles
    start (a 128-byte-swizzle atom is 1024 bytes, and the swizzle is a function of the address)."""
    return ((1024 - (base & 1023)) & 1023) // 4


@inlined_device_function
def k_step_bytes(step):
    """Where k-step ``step`` (16 columns) starts in a K-major tile: 32 bytes on per step, the next 64-column
    tile of BLOCK_N rows after four."""
    return (step // 4) * BLOCK_N * ROW_BYTES + (step % 4) * 32


@inlined_device_function
def k_major_descriptor(address):
    """The descriptor of a K-major tile at shared ``address`` (its first k-step)."""
    return descriptor_device(address, K_MAJOR_OFFSETS[0], K_MAJOR_OFFSETS[1], SWIZZLE_128B)


@inlined_device_function
def mn_major_descriptor(address):
    """The descriptor of an MN-major tile at shared ``address`` (its first k-step of 16 rows)."""
    return descriptor_device(address, MN_MAJOR_OFFSETS[0], MN_MAJOR_OFFSETS[1], SWIZZLE_128B)


@inlined_device_function
def mn_step_bytes(step):
    """Where k-step ``step`` (16 rows) starts in an MN-major tile."""
    return step * 16 * ROW_BYTES


@lru_cache(maxsize=None)
def tile_copier(D, THREADS):
    """(own_chunk, start_tile, PASSES, PASS_WORDS, GROUPS, GROUP_WORDS): the cp.async copier of 64-row tiles of head
    dim D for a block of THREADS threads, into the layout of LAYOUT_DIM = ``layout_dim(D)`` columns.

    A thread keeps one column of 16-byte chunks of the layout's row and walks down the rows, ROWS_PER_PASS at a
    time.  That is a multiple of 8, so the thread stays on one row of every 8-row swizzle atom it visits: its chunks
    land at one swizzled offset plus ROWS_PER_PASS rows per pass, and each copy costs an address increment (the
    general chunk-to-swizzled-address arithmetic cost ~95 instructions per 16 bytes at d = 128, a rolled loop:
    experiments/tuning/results/sass_counts_wgmma.md).  A row wider than THREADS / 8 chunks (d = 256 in one
    warpgroup: 32 chunks for 128 threads, which would leave 4 rows a pass) is copied as GROUPS column groups of
    GROUP_COLUMNS, whole 64-column tiles: a group's copies are the first group's moved by GROUP_COLUMNS elements in
    X and GROUP_WORDS words in shared memory (the swizzle depends only on the address's low 10 bits, which a whole
    tile leaves alone).  A thread whose column is a pad one (D <= column < LAYOUT_DIM) issues the same copies with
    source size 0: 16 zero bytes each, nothing read.  Where D is the layout's width that test is not compiled at
    all (PADDED is a Python constant).  Its copies of a tile: at words own_chunk + g GROUP_WORDS + i PASS_WORDS,
    g < GROUPS, i < PASSES."""
    LAYOUT_DIM = layout_dim(D)
    PADDED = D < LAYOUT_DIM
    GROUP_CHUNKS = min(LAYOUT_DIM // 8, THREADS // 8)   # chunks of a row a pass covers: 8 rows a pass at least
    GROUP_COLUMNS = 8 * GROUP_CHUNKS
    GROUPS = LAYOUT_DIM // GROUP_COLUMNS       # 1, but 2 at d > 128 in one warpgroup
    ROWS_PER_PASS = THREADS // GROUP_CHUNKS    # 16 at d = 64, 8 at d = 96 .. 256 (one warpgroup; two: 32, 16, 8)
    PASSES = BLOCK_N // ROWS_PER_PASS
    PASS_WORDS = ROWS_PER_PASS * ROW_BYTES // 4
    GROUP_WORDS = (GROUP_COLUMNS // 64) * BLOCK_N * ROW_BYTES // 4
    assert ROWS_PER_PASS % 8 == 0 and BLOCK_N % ROWS_PER_PASS == 0 and GROUP_COLUMNS % 64 == 0 and D % 8 == 0
    assert GROUPS <= 2   # (start_tile's two calls)

    @inlined_device_function
    def own_chunk(at, tid):
        """The word where this thread's first 16-byte chunk of the swizzled tile at word ``at`` lies (the others
        at the offsets above), and the row and column of X it holds."""
        r, c = tid // GROUP_CHUNKS, (tid % GROUP_CHUNKS) * 8    # the thread's first row, and its column
        return at + swizzle_128_device(staged_offset_device(r, c, BLOCK_N)) // 4, r, c

    @inlined_device_function
    def start_group(smem, own, X, first, row_stride, rows_valid, r, c, group):
        """Column group ``group`` of ``start_tile``'s copies (``own``, r, c: this thread's first chunk)."""
        to = own + group * GROUP_WORDS
        column = c + group * GROUP_COLUMNS
        # A pad column's copies read nothing but still need an address in X: its row's first chunk.
        real = column < D if PADDED else True
        # Words of X (pairs): rows are 16-byte aligned, so first, row_stride and column are even.
        chunk = (first + r * row_stride + (column if real else 0)) >> 1
        step = (ROWS_PER_PASS * row_stride) >> 1
        if rows_valid >= BLOCK_N:   # every tile but a ragged last one (block-uniform): no row tests, no selects
            for i in range(PASSES):
                copy_async16(smem, to + i * PASS_WORDS, X, chunk + i * step, real)
        else:
            for i in range(PASSES):
                inside = real and r + i * ROWS_PER_PASS < rows_valid
                # Outside, the copy reads nothing but still needs an address in X: the tile's first row.
                copy_async16(smem, to + i * PASS_WORDS, X, chunk + i * step if inside else first >> 1, inside)

    @inlined_device_function
    def start_tile(smem, at, X, first, row_stride, rows_valid, tid):
        """64 rows of X (flat 16-bit pairs; the first at element ``first``, rows ``row_stride`` elements apart)
        on their way by cp.async to the swizzled tile at word ``at`` (zeros past rows_valid, and in the pad
        columns D..LAYOUT_DIM-1)."""
        own, r, c = own_chunk(at, tid)
        # The groups one after another, not in a loop: a loop of one trip, where there is one group, took the
        # d = 64 forward from 131 registers to 138 (ptxas 13.0, sm_90a).
        start_group(smem, own, X, first, row_stride, rows_valid, r, c, 0)
        if GROUPS > 1:
            start_group(smem, own, X, first, row_stride, rows_valid, r, c, 1)

    return own_chunk, start_tile, PASSES, PASS_WORDS, GROUPS, GROUP_WORDS


def out_of_scope(call, kernel):
    """Why the wgmma ``kernel`` ("forward" or "backward") cannot run this validated call (a sentence), or None
    when it can."""
    name = f"the wgmma {kernel}"
    if call.precision == "tf32x3":
        return f"q, k, v must be float16 or bfloat16 for {name}, not {call.dtype}"
    head_dims = FORWARD_HEAD_DIMS if kernel == "forward" else HEAD_DIMS
    if call.head_dim not in head_dims:
        return f"the head dim must be one of {head_dims} for {name}, not {call.head_dim}"
    if not call.vec:
        return f"q, k and v must have rows that start on 16-byte boundaries for {name}"
    if not np.float32(call.scale * LOG2_E) > 0:
        return f"scale must be positive for {name}, not {call.scale}"
    if call.dropout_p > 0:
        return f"{name} has no dropout yet"
    if call.mods and call.head_dim > max(HEAD_DIMS):   # the 256-column forward with mods: not compiled or tested yet
        return f"{name} takes score_mod / mask_mod at head dims up to {max(HEAD_DIMS)}, not {call.head_dim}"
    if call.varlen is not None and (call.varlen.kv_cache or not call.varlen.packed):
        return f"{name} takes packed sequences (attention_varlen), not a KV cache"
    if not in_simulator() and device_limits().compute_capability != (9, 0):
        return f"{name} needs a GPU of compute capability 9.0 (H100, H200)"
    return None


__all__ = ["BLOCK_N", "FORWARD_HEAD_DIMS", "HEAD_DIMS", "K_MAJOR_OFFSETS", "LAYOUT_DIMS", "MN_MAJOR_OFFSETS",
           "environment_choice", "first_atom_words", "k_major_descriptor", "k_step_bytes", "layout_dim",
           "mn_major_descriptor", "mn_step_bytes", "out_of_scope", "query_tile", "tile_bytes", "tile_copier"]
