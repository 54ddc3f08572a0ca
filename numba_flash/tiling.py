"""Every size of every kernel: block sizes, shared-memory layouts, padded strides.

One module states them so that the kernels, the checks on user input and
the I/O model cannot disagree.

Algorithm 1, line 1: choosing B_r and B_c from the SRAM size M
--------------------------------------------------------------
The paper sets B_c = ceil(M / 4d) and B_r = min(ceil(M / 4d), d), with M
counted in *elements*.  The 4 makes room for four d-wide tiles of that many
rows; in our literal kernel those are Q_i, K_j, V_j and the B_r x B_c score
tile S_ij (B_r <= d makes S_ij no larger than one d-wide tile of B_c rows).

Hardware and problem limits then clamp the result, each for a stated reason:

* **N**: a tile taller than the sequence only wastes SRAM, so B_r <= N_q
  and B_c <= N_k.
* **SRAM**: the ceilings can overshoot M by a few elements; we shrink B_c
  (then B_r) until Q_i, K_j, V_j and S_ij fit in M.
* **threads per block**: the literal kernel gives each row of Q_i its own
  thread, so B_r <= the device's maximum threads per block (1024).  Since
  B_r <= d this only bites for head dims above 1024.

The fast kernels' shared memory
-------------------------------
flash2's kernels keep their tiles in one dynamic shared-memory buffer of
32-bit words.  ``SharedTiles`` names each tile and its size; a kernel takes
its offsets from the same object that the host uses to size the launch.
Every tile is row-major; rows are padded so that the 32 lanes of a fragment
load, or ldmatrix's 8 rows of 16 bytes, hit different banks (``row_stride``),
except decoding's streamed K and V tiles, whose rows are unpadded and
swizzled instead (``swizzled_rows``).
"""
import math
from dataclasses import dataclass
from typing import Tuple

import numpy as np

from .runtime.device import device_limits

#: flash2: one warp owns 16 query rows (the M of the m16n8 tensor-core tiles).
ROWS_PER_WARP = 16
#: flash2's largest head dim (its accumulators live in registers).
FLASH2_MAX_HEAD_DIM = 256
#: The fast kernels' operand precision for each input dtype: 3xTF32 for float32, or 16-bit operands with
#: float32 accumulation.
PRECISION = {"float32": "tf32x3", "float16": "f16", "bfloat16": "bf16"}
PRECISIONS = tuple(PRECISION.values())


def precision_of(dtype):
    """The fast kernels' precision for a dtype (a NumPy dtype, or its name)."""
    return PRECISION[dtype if isinstance(dtype, str) else np.dtype(dtype).name]


def cdiv(a, b):
    """ceil(a / b) for positive integers."""
    return -(-a // b)


# ---------------------------------------------------------------- Algorithm 1, line 1

def flash1_sram_elements(block_rows, block_cols, head_dim):
    """Elements the literal kernel keeps in shared memory: Q_i, K_j, V_j and S_ij."""
    return (block_rows + 2 * block_cols) * head_dim + block_rows * block_cols


def flash1_shared_bytes(block_rows, block_cols, head_dim):
    """Shared memory of the literal forward (float32 tiles)."""
    return 4 * flash1_sram_elements(block_rows, block_cols, head_dim)


def line1_block_sizes(head_dim, *, sram_bytes=None, dtype=np.float32, n_q=None, n_k=None):
    """(B_r, B_c) by Algorithm 1, line 1, clamped as the module docstring explains.

    sram_bytes: the SRAM budget M in bytes; default: the shared memory one
    thread block may use on the current device without opting in (48 KiB on
    recent NVIDIA GPUs).  dtype: element type, which converts bytes to
    elements.  n_q, n_k: sequence lengths, for the N clamp (optional).
    """
    if head_dim < 1:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    limits = device_limits()
    if sram_bytes is None:
        sram_bytes = limits.shared_bytes_per_block
    m_elements = int(sram_bytes) // np.dtype(dtype).itemsize
    if m_elements < 4 * head_dim:
        raise ValueError(f"sram_bytes={sram_bytes} holds {m_elements} elements, fewer than the "
                         f"4*d = {4 * head_dim} that one row each of Q_i, K_j, V_j and S_ij need")

    block_cols = math.ceil(m_elements / (4 * head_dim))
    block_rows = min(math.ceil(m_elements / (4 * head_dim)), head_dim)

    block_rows = min(block_rows, limits.max_threads_per_block)
    if n_q is not None:
        block_rows = max(1, min(block_rows, n_q))
    if n_k is not None:
        block_cols = max(1, min(block_cols, n_k))
    while flash1_sram_elements(block_rows, block_cols, head_dim) > m_elements:
        if block_cols > 1:
            block_cols -= 1
        else:
            block_rows -= 1
    return block_rows, block_cols


def flash1_backward_sram_elements(block_rows, block_cols, head_dim):
    """Elements the literal backward keeps in shared memory: Q_i, dO_i, K_j, V_j, dK_j, dV_j, P_ij, dS_ij."""
    return (2 * block_rows + 4 * block_cols) * head_dim + 2 * block_rows * block_cols


def flash1_backward_shared_bytes(block_rows, block_cols, head_dim):
    """Shared memory of the literal backward (float32 tiles)."""
    return 4 * flash1_backward_sram_elements(block_rows, block_cols, head_dim)


def flash1_backward_block_sizes(head_dim, *, sram_bytes=None, dtype=np.float32, n_q=None, n_k=None):
    """(B_r, B_c) for Algorithm 4: line 1's blocks, shrunk until the backward's tiles fit.

    The backward keeps twice as many tiles on chip as the forward (Q_i, dO_i,
    K_j, V_j, dK_j, dV_j, P_ij, dS_ij), so line 1's sizes do not fit; we
    shrink B_c and B_r alternately (keeping them balanced) until they do.
    """
    m_elements = int(device_limits().shared_bytes_per_block if sram_bytes is None else sram_bytes)
    m_elements //= np.dtype(dtype).itemsize
    block_rows, block_cols = line1_block_sizes(head_dim, sram_bytes=sram_bytes, dtype=dtype, n_q=n_q, n_k=n_k)
    while flash1_backward_sram_elements(block_rows, block_cols, head_dim) > m_elements:
        if block_cols >= block_rows and block_cols > 1:
            block_cols -= 1
        elif block_rows > 1:
            block_rows -= 1
        else:
            raise ValueError(f"head dim {head_dim} is too large for the backward's tiles in {m_elements} elements")
    return block_rows, block_cols


# ---------------------------------------------------------------- flash2's tiles

def k_step(precision):
    """Depth of one mma: 8 for tf32 (m16n8k8), 16 for 16-bit operands (m16n8k16)."""
    return 8 if precision == "tf32x3" else 16


def padded_head_dim(head_dim, precision):
    """Head dim rounded up to the mma depth; the padding columns hold zeros."""
    return cdiv(head_dim, k_step(precision)) * k_step(precision)


def padded_stride(words, residue):
    """The smallest stride >= words that is congruent to residue mod 32 (banks)."""
    return words + (residue - words) % 32


def row_stride(d_pad, sixteen_bit, swizzled=False):
    """Words per row of a row-major tile: tf32 words, or 16-bit pairs along d (4 mod 32: conflict-free);
    swizzled rows (``swizzled_rows``: 16-bit) unpadded."""
    words = d_pad // 2 if sixteen_bit else d_pad
    return words if swizzled else padded_stride(words, 4)


#: A swizzled row's 16-byte chunks are permuted within groups of this many (``swizzled_rows``).
SWIZZLE_CHUNKS = 8


def swizzled_rows(d_pad, precision, key_warps):
    """Whether decoding's streamed K and V tiles (``key_warps`` > 1, 16-bit, d_pad a multiple of 64) sit in
    shared memory unpadded, chunk c of row r at chunk ``c ^ (r % 8)`` (``fragments.swizzle``), as
    CUTLASS's 128-byte swizzle lays them out.

    Why: each row then starts on a 128-byte boundary, so that a warp's cp.async of two 256-byte rows
    writes whole 128-byte lines of shared memory, as the copies alone do; ldmatrix's 8 rows of one
    logical chunk still hit 8 different chunk positions, so no bank is read twice.  With padded rows
    (16 bytes more each) ncu counted 1.5 times the ideal L2 sectors for the K/V reads of decoding (34% of
    them L2 hits, 80.7% of DRAM bandwidth; cuDNN's kernel 0.6% and 91%; H200, 2026-12-03,
    ``experiments/tuning/results/decode_breakdown_h200.md``)."""
    return key_warps > 1 and precision != "tf32x3" and d_pad % (SWIZZLE_CHUNKS * 8) == 0


def flash2_threads(block_rows, warp_rows=ROWS_PER_WARP):
    """Threads of a flash2 block: one warp per ``warp_rows`` rows of the tile it owns (16 unless the
    forward's ``flash2_forward_warp_rows`` says 32)."""
    return 32 * (block_rows // warp_rows)


@dataclass(frozen=True)
class SharedTiles:
    """Named tiles of a block's dynamic shared memory, in 32-bit words, in order."""

    tiles: Tuple[Tuple[str, int], ...]

    def offset(self, name):
        """Word offset of tile ``name`` (16-byte aligned: every size is a multiple of 4 words)."""
        at = 0
        for tile, words in self.tiles:
            if tile == name:
                return at
            at += words
        raise KeyError(name)

    @property
    def words(self):
        return sum(words for _, words in self.tiles)

    @property
    def bytes(self):
        return 4 * self.words


def _rows(name, rows, d_pad, precision, swizzled=False):
    """A row-major tile of ``rows`` rows: one copy for 16-bit data, hi and lo halves for 3xTF32; swizzled
    rows (``swizzled_rows``) unpadded."""
    stride = row_stride(d_pad, precision != "tf32x3", swizzled)
    if precision == "tf32x3":
        return ((name + "_HI", rows * stride), (name + "_LO", rows * stride))
    return ((name, rows * stride),)


def _words(count):
    """Room for ``count`` 32-bit words, rounded up to 4 (keeps later tiles 16-byte aligned)."""
    return cdiv(count, 4) * 4


def _staged(tiles, stages):
    """The streamed tiles once per buffer: stage 0 under their own names, stage s >= 1 as ``NAME_STAGE{s}``
    (so a stage's tiles sit ``offset("X_STAGE1") - offset("X")`` words after the previous stage's)."""
    return tiles + tuple((f"{name}_STAGE{s}", words) for s in range(1, stages) for name, words in tiles)


def flash2_forward_smem(block_m, block_n, d_pad, precision, stages=1, key_warps=1):
    """Q_i (block_m rows); K_j and V_j (block_n rows each) in ``stages`` buffers (``flash2_stages``), all
    row-major; one NaN flag per key of V_j (set in masked tiles only; see forward.py).

    ``key_warps`` > 1 (decoding: warps that share one warp's query rows and take turns along the keys,
    forward.py's KEY_WARPS): each warp has buffers and flags of its own, ``KEY_WARPS - K`` words apart,
    with room there for its partial result when the warps merge (``key_warp_result_words``), each warp's
    first buffer on a 128-byte boundary (its rows are swizzled: ``swizzled_rows``)."""
    swizzled = swizzled_rows(d_pad, precision, key_warps)
    streamed = _rows("K", block_n, d_pad, precision, swizzled) + _rows("V", block_n, d_pad, precision, swizzled)
    own = _staged(streamed, stages) + (("V_NAN", _words(block_n)),)
    if key_warps > 1:
        words = sum(size for _, size in own)
        stride = cdiv(max(words, key_warp_result_words(d_pad)), 32) * 32
        own += (("KEY_WARP_SLACK", stride - words), ("KEY_WARPS", (key_warps - 1) * stride))
    return SharedTiles(_rows("Q", block_m, d_pad, precision) + own)


def key_warp_result_words(d_pad):
    """Words of one key warp's partial result as its lanes hold it: m and l of a lane's two rows, and its O
    fragments (d_pad / 8 of 4 float32), for each of 32 lanes."""
    return 32 * (2 * 2 + 4 * (d_pad // 8))


def flash2_dkdv_smem(block_keys, block_queries, d_pad, precision, stages=1):
    """K_j, V_j (the block's keys); Q_i, dO_i (the streamed queries) with their lse and D, in ``stages``
    buffers; a NaN flag per streamed query (masked tiles only)."""
    streamed = (_rows("Q", block_queries, d_pad, precision) + _rows("DO", block_queries, d_pad, precision)
                + (("LSE2", _words(block_queries)), ("D_I", _words(block_queries))))
    return SharedTiles(_rows("K", block_keys, d_pad, precision) + _rows("V", block_keys, d_pad, precision)
                       + _staged(streamed, stages) + (("Q_NAN", _words(block_queries)),))


def flash2_dq_smem(block_queries, block_keys, d_pad, precision, stages=1):
    """Q_i, dO_i (the block's queries); K_j, V_j (the streamed keys) in ``stages`` buffers; a NaN flag per
    streamed key (masked tiles only)."""
    streamed = _rows("K", block_keys, d_pad, precision) + _rows("V", block_keys, d_pad, precision)
    return SharedTiles(_rows("Q", block_queries, d_pad, precision) + _rows("DO", block_queries, d_pad, precision)
                       + _staged(streamed, stages) + (("K_NAN", _words(block_keys)),))


def flash2_stages(layout, *sizes, precision, vec, most=2):
    """Buffers for the streamed tiles of a flash2 kernel whose shared memory is ``layout(*sizes, precision,
    stages)``: when the tiles can travel by cp.async (16-bit operands whose rows start on 16-byte
    boundaries, ``vec``), as many as fit in shared memory up to ``most`` (at least two), so that tiles
    j + 1 .. j + stages - 1 land in the others while the block computes on one (and one barrier per tile
    suffices); otherwise one, filled through registers (3xTF32 splits each element on the way)."""
    if precision == "tf32x3" or not vec:
        return 1
    limit = device_limits().shared_bytes_per_block_optin
    fitting = [s for s in range(2, max(2, most) + 1) if layout(*sizes, precision, stages=s).bytes <= limit]
    return fitting[-1] if fitting else 1


def flash2_backward_shared_bytes(block_rows, block_cols, d_pad, precision):
    """The larger of the two backward kernels' shared memory (both launch with the same tiles)."""
    return max(flash2_dkdv_smem(block_rows, block_cols, d_pad, precision).bytes,
               flash2_dq_smem(block_rows, block_cols, d_pad, precision).bytes)


# ---------------------------------------------------------------- flash2's default tiles

#: Default forward (BLOCK_M, BLOCK_N) per precision, for head dims up to each bound.
#: Measured with experiments/tuning/tune_flash2.py on the H200, (B,H,N,d) =
#: (4,16,4096,d), non-causal (experiments/tuning/results/tune_flash2.md), TFLOP/s:
#:   float32 d=64:  (64,32) 39.0  (128,32) 48.0  (128,64) 45.4  (256,32) 49.9
#:   float32 d=128: (64,32) 33.9  (128,32) 47.8  ((128,64) does not fit)
#:   float16 d=64:  (64,64) 110  (128,32) 130  (128,64) 147  (128,128) 45  (256,64) 137
#:   float16 d=128: (64,64) 132  (128,32) 137  (the sweep's time ran out here)
#: bfloat16 runs the same instructions as float16 on another input type and
#: takes its tiles.  d > 128 is not tuned: those tiles fit the shared memory.
FORWARD_BLOCK_SIZES = {
    "tf32x3": [(64, (128, 32)), (128, (128, 32)), (256, (32, 32))],
    "f16": [(64, (128, 64)), (128, (128, 64)), (256, (64, 32))],
}
#: Query rows a warp of flash2's forward owns, per precision, for head dims up to each bound: 16 (one
#: mma fragment of rows) or 32 (two, which share every K_j and V_j fragment the warp loads from shared
#: memory: half the shared-memory reads per product, as FlashAttention-2's warps have, for twice the
#: accumulator registers).  Timed on the H200 in one process (experiments/tuning/results/bench_warp_rows_h200.md,
#: 16-bit forward at (128, 64) tiles): 32 rows take 0.84-0.88x the time of 16 dense and 0.93-0.95x
#: causal, at d = 64 and d = 128.  Past d = 128 a warp's 32 x d accumulator does not fit its registers
#: (ptxas at d = 256, (64, 32): a 1536-byte stack frame), and float32's 3xTF32 operands double the
#: fragments (1 KB of spills at d = 128), so those keep 16.  Plain calls only (no block mask, no
#: dropout): ``flash2_forward_warp_rows``.
FORWARD_WARP_ROWS = {"tf32x3": [(256, ROWS_PER_WARP)], "f16": [(128, 32), (256, ROWS_PER_WARP)]}


def flash2_forward_warp_rows(block_m, d_pad, precision, *, plain=True):
    """The query rows per warp of flash2's forward for B_r = block_m at padded head dim d_pad
    (``FORWARD_WARP_ROWS``, when B_r is a multiple of it).  ``plain``: no block mask and no dropout.
    Their per-entry work (a mask lookup, a generator call) keeps a 32-row warp's loops over its rows
    rolled, which sends its scores to local memory (ptxas: stack frames of 128-304 bytes,
    tests/gpu_compile_all.py), so they keep warps of 16."""
    rows = tiles_for_head_dim(FORWARD_WARP_ROWS["f16" if precision == "bf16" else precision], d_pad)
    return rows if plain and block_m % rows == 0 else ROWS_PER_WARP


#: Default backward (B_r, B_c) per (precision, causal), for head dims up to each bound.  Chosen on
#: the H200 by ``experiments/tuning/tune_flash2.py --backward`` ((B,H,N,d) = (4,16,4096,d), non-causal;
#: experiments/tuning/results/tune_flash2_backward.md) and checked by interleaved timings of the
#: candidates, five rounds each (ms, medians):
#:   float32 d=64:            (64,32) 25.9  (128,32) 25.6  (128,64) 24.6
#:   float32 d=64 causal:     (64,32) 13.1  (128,64) 12.7
#:   float16 d=64 causal:     (64,32) 5.54  (128,32) 6.11  (128,64) 5.84
#:   float16 d=96:            (64,32) 14.7  (128,64) 13.2
#:   float16 d=128, N=8192:   (64,32) 33.9  (128,32) 32.4  (128,64) 28.0
#:   float16 d=128 causal:    (64,32) 19.0  (64,64) 19.3  (128,32) 18.4  (128,64) 16.3
#: (non-causal float16 d=64 is (128,64) by the sweep: 7.7 against 8.9 for (64,32).)
#: Causal float16 at d <= 64 is the one case where smaller tiles win: the kernel is
#: short there, so the many diagonal tiles' masked work and the imbalance of fewer,
#: longer blocks over the triangle outweigh the bigger tiles' reuse.  float32 keeps
#: (64, 32) above d = 64: B_r = 64 keeps d = 128's dK and dV accumulators within the
#: register file (the sweep: (64,32) 64.4 ms, (64,16) 82.3); (32, 16) lets the tiles of
#: d = 256 fit in shared memory.
_TF32X3_BACKWARD = [(64, (128, 64)), (128, (64, 32)), (256, (32, 16))]
BACKWARD_BLOCK_SIZES = {
    ("tf32x3", False): _TF32X3_BACKWARD,
    ("tf32x3", True): _TF32X3_BACKWARD,
    ("f16", False): [(128, (128, 64)), (256, (32, 16))],
    ("f16", True): [(64, (64, 32)), (128, (128, 64)), (256, (32, 16))],
}
#: flash2's tiles in Numba's CUDA simulator, forward and backward: every simulated
#: CUDA thread is a Python thread, so the smallest legal tiles (one warp) are fastest there.
SIMULATOR_BLOCK_SIZES = (16, 16)


def tiles_for_head_dim(table, head_dim):
    """The tiles of the first (largest head dim, tiles) entry of ``table`` that covers ``head_dim``."""
    for bound, blocks in table:
        if head_dim <= bound:
            return blocks
    raise ValueError(f"head dim {head_dim} exceeds {table[-1][0]}")


def flash2_tuned_block_sizes(head_dim, precision, *, backward=False, causal=False):
    """The (B_r, B_c) measured fastest on the H200 for flash2's forward or backward at this head dim."""
    tuned = "f16" if precision == "bf16" else precision  # the same instructions, the same tiles
    table = BACKWARD_BLOCK_SIZES[tuned, bool(causal)] if backward else FORWARD_BLOCK_SIZES[tuned]
    return tiles_for_head_dim(table, head_dim)


def flash2_default_block_sizes(head_dim, precision, *, backward=False, causal=False):
    """flash2's tiles when none are given: the tuned ones, or the smallest in the simulator."""
    if device_limits().simulated:
        return SIMULATOR_BLOCK_SIZES
    return flash2_tuned_block_sizes(head_dim, precision, backward=backward, causal=causal)


#: The most 16-byte chunks a thread of a decoding block keeps in flight per K or V tile (more spills).
DECODE_CHUNKS_PER_THREAD = 8
#: K/V buffers of a decoding block (``attention_with_kv_cache``'s ``kv_stages`` = 0), so that this many tiles less one
#: are in flight while one is computed on.  For one-warp blocks (GPU time on the H200, 2026-12-02,
#: experiments/tuning/results/decode_h200.md, (16, 32, 8, 1, 8192, 128) float16) 3, 4 or 6 buffers took 0.151-0.154 ms
#: against 0.151-0.152 for two; for blocks of four key warps, whose rounds copy 64 keys at (16, 16) tiles, three buffers
#: took 0.1374 ms against 0.1760 for two and 0.1387 for four (2026-12-03,
#: experiments/tuning/results/decode_key_warps_h200.md).
DECODE_KV_STAGES = 3
#: Warps of a decoding block that share its query rows and take turns along the keys (forward.py's KEY_WARPS), where the
#: tile is one warp's rows and travels by cp.async (fewer where their buffers do not fit); ``attention_with_kv_cache``'s
#: ``key_warps`` asks for others.  cuDNN's decoding kernel runs four such warps per block (ncu on the H200, 2026-12-02).
#: On the H200 (GPU time, 2026-12-03, experiments/tuning/results/decode_key_warps_h200.md) four warps, whose block
#: copies each round of their tiles together, at (16, 16) tiles and three buffers: 0.1374 ms against 0.1457 for one-warp
#: blocks (the default until then) in the same run; with their K/V rows swizzled (``swizzled_rows``) 0.1320 against
#: 0.1466 (experiments/tuning/results/decode_breakdown_h200.md).
DECODE_KEY_WARPS = 4


def decode_block_sizes(n_q, head_dim, precision):
    """Tiles for few queries against many keys (``attention_with_kv_cache``): the query rows the call
    needs (16 per warp, so often one warp), and the widest key tile (at most 64) whose register
    prefetch stays within ``DECODE_CHUNKS_PER_THREAD`` chunks per thread.  On the H200 at d = 128,
    float16 (experiments/tuning/results/decode_h200.md, best split each): (16, 16) 0.25 ms, (32, 32) 0.29 ms,
    (16, 32) 0.63 ms, (16, 64) 1.49 ms: wider key tiles spill (ptxas: 3.4 KB at (16, 64)).  Those
    numbers predate cp.async: aligned 16-bit tiles now travel without registers, and ptxas fits
    (16, 32) at d = 128 in 251 registers and (16, 64) in 255 with 20 bytes of spills (to be re-timed).
    Tiles of one warp's rows whose K/V travel by cp.async are widened (``decode_plan.default_tile``).
    """
    rows = min(128, cdiv(n_q, ROWS_PER_WARP) * ROWS_PER_WARP)
    chunk = 4 if precision == "tf32x3" else 8        # elements per 16-byte chunk
    step = k_step(precision)
    fitting = DECODE_CHUNKS_PER_THREAD * flash2_threads(rows) * chunk // padded_head_dim(head_dim, precision)
    return rows, max(step, min(64, fitting // step * step))


#: The key tile of decoding's key warps where the library picks the tiles (``decode_plan.default_tile``).  On the
#: H200 (GPU time, four warps, three buffers, swizzled rows, float16;
#: experiments/tuning/results/decode_key_warps_h200.md): at (B, H_q, H_kv, N_q, N, d) = (16, 32, 8, 1, 8192, 128), one
#: split, (16, 32) took 0.1301, 0.1301, 0.1270, 0.1290 and 0.1268 ms against (16, 16)'s 0.1320, 0.1320, 0.1283, 0.1308
#: and 0.1285 in five runs (1.01-1.02x); ncu: the wider tile's warps wait on memory where (16, 16)'s wait on their own
#: instructions.  With splits it once lost ((1, 32, 8, 1, 8192): 0.0390 against 0.0334 ms at 24 splits, each block a few
#: rounds of the wider tile); since the default split fills one block per multiprocessor (``decode_plan``), it is as
#: fast or faster there too (2026-12-03, experiments/tuning/results/decode_breakdown_h200.md: (4, 32, 8, 1, 32768)
#: 0.1277 against 0.1291 at 4 splits, (1, 32, 8, 1, 2048) 0.0120 against 0.0121 at 16).  ptxas: 255 registers at d =
#: 128.
DECODE_STREAMED_KEYS = 32
#: The key tile and key warps where a group's rows take several 16-row tiles that all read its K/V (MQA's 32 packed
#: query heads; eight heads of four new queries each) and the library picks the tiles (``decode_plan.default_tile``).
#: Those blocks do more arithmetic per byte: at (1, 32, 1, 32768, 128) ncu found four key warps issue-bound, one warp
#: per scheduler 3.86 cycles between instructions (H100, 2026-12-07, experiments/tuning/results/
#: decode_key_warps_h100.md).  Eight warps of 16-key tiles keep as many keys in flight per round as four of 32 (the
#: same buffers, 192 KB at d = 128) with twice the warps to issue: GPU time 1.00-1.24x less than four warps of 32 keys
#: at all nine multi-query shapes of experiments/tuning/decode_mqa_tiles.py, slower at none (H100, 2026-12-07,
#: experiments/tuning/results/decode_mqa_tiles_h100.md).  Only where a multiprocessor holds as many such blocks
#: (``decode_plan.shared_kv_layout``: not at d = 64, where their registers halve the blocks held).
DECODE_SHARED_KV_KEYS = 16
DECODE_SHARED_KV_KEY_WARPS = 8


def page_key_tile(keys, page_size, precision):
    """The widest key tile of at most ``keys`` keys (a multiple of the mma depth) that divides ``page_size``: a
    paged cache's tiles lie in one page each (``kernels/fast/forward.py``, PAGED)."""
    step = k_step(precision)
    return max(width for width in range(step, max(keys, step) + 1, step) if page_size % width == 0)


def decode_default_block_sizes(n_q, head_dim, precision):
    """``decode_block_sizes`` on a GPU, the smallest tiles in the simulator."""
    return SIMULATOR_BLOCK_SIZES if device_limits().simulated else decode_block_sizes(n_q, head_dim, precision)
