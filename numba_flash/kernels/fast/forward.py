"""FlashAttention-2 forward (Dao, 2023) on tensor cores: the fast kernel.

The loop order is FlashAttention-2's: one thread block per (query block,
batch*head), an outer loop that is the grid, and an inner loop over key/value
blocks.  The running statistics m_i, l_i and the output accumulator acc stay
in registers for the whole inner loop; O is divided by l once at the end and
O and lse are written once.  With ``causal``, key blocks entirely above the
diagonal are never visited and only blocks that cross it are masked element
by element.

How it is fast, and what each trick costs in clarity:

* **Tensor cores from Numba.**  numba-cuda exposes no matrix instructions,
  so ``primitives.py`` emits PTX ``mma.sync`` through intrinsics.  Each warp
  owns 16 query rows and computes its 16 x BLOCK_N slice of S = Q K^T and its
  16 x d slice of O += P V as 16x8 tiles, one ``mma`` per tile and k-step.
* **float32 stays float32 (3xTF32).**  A tensor-core product of float32
  inputs rounds them to tf32 (10 mantissa bits, ~3e-4 relative error).  We
  split every operand x = hi + lo with hi = tf32(x), lo = tf32(x - hi) and
  accumulate lo*hi + hi*lo + hi*hi, dropping lo*lo (~2^-22 relative): float32
  accuracy for three mma per tile (the trick CUTLASS calls "3xTF32").  The
  split happens once, when a tile enters shared memory.
* **float16** uses ``mma.m16n8k16`` with float32 accumulation.  P is rounded
  to float16 for the P V product, as in FlashAttention-2.
* **P never leaves registers.**  The accumulator fragment of S (rows g, g+8;
  columns 2t, 2t+1 of each 8-wide tile) is reused as the A operand of P V.
  For float16 it matches the k16 A layout exactly; for tf32 (k8) the A
  columns are t and t+4, so we *renumber the keys inside the k-step*: k-index
  t stands for key 2t and t+4 for key 2t+1, and V's B fragment is read with
  the same renumbering.  A sum over keys does not care about their order.
* **exp2**: logits are scaled by scale*log2(e) so that softmax uses exp2
  (one ``ex2.approx`` instruction); lse is converted back to natural log.
* **Row statistics by shuffles**: the four lanes that share a row reduce
  max and sum with two ``shfl_xor`` (simulated in the simulator).
* **No bank conflicts**: shared rows are padded so that the 32 lanes of a
  fragment load hit 32 different banks (strides = 4 mod 32 words, and 8 mod
  32 for the float16 V layout).

The two products (S = Q K^T, and O += P V from the registers) are
``fragments.py``'s ``rows_by_rows_t`` and ``regs_by_rows``, which the
backward shares.  Layouts of the mma fragments are in ``primitives.py``.  Notation: a warp's
lane is 4*g + t; ``s_acc[nt]`` holds S rows (g, g+8) x columns (2t, 2t+1) of
key tile nt; ``o_acc[dt]`` the same for head-dim tile dt of O.
"""
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32

from ...dropout import NO_DROPOUT, philox_device
from ...runtime.launch import cdiv, cuda_kernel, inlined_device_function, launch, no_mask_layout
from .fragments import fragment_row_store, pair_stride, row_stride, split_tf32, tile_products
from .primitives import exp2, load_vec4, load_word, pack_half2, shfl_xor, store_vec4

LOG2_E = 1.4426950408889634
ROWS_PER_WARP = 16
MAX_HEAD_DIM = 256

#: Default (BLOCK_M, BLOCK_N) per dtype, for head dims up to each bound.
#: Measured with experiments/tune_flash2.py on the H200, (B,H,N,d) =
#: (4,16,4096,d), non-causal (experiments/results/tune_flash2.md), TFLOP/s:
#:   float32 d=64:  (64,32) 39.0  (128,32) 48.0  (128,64) 45.4  (256,32) 49.9
#:   float32 d=128: (64,32) 33.9  (128,32) 47.8  ((128,64) does not fit)
#:   float16 d=64:  (64,64) 110  (128,32) 130  (128,64) 147  (128,128) 45  (256,64) 137
#:   float16 d=128: (64,64) 132  (128,32) 137  (the sweep's time ran out here)
#: (256,32) edged out (128,32) at float32 d=64 by 4% but was not in the
#: benchmark run, so the default stays the tile the published numbers used;
#: float16 d=128 keeps (128,64), which the benchmark measured at 166 TFLOP/s
#: at (2,16,8192,128).  d > 128 is not tuned: those tiles fit the shared
#: memory, and the accumulators of d = 256 (128 registers) already spill.
DEFAULT_BLOCK_SIZES = {
    "float32": [(64, (128, 32)), (128, (128, 32)), (256, (32, 32))],
    "float16": [(64, (128, 64)), (128, (128, 64)), (256, (64, 32))],
}


def tiles_for_head_dim(table, head_dim):
    """The tiles of the first (largest head dim, tiles) entry of ``table`` that covers ``head_dim``."""
    for bound, blocks in table:
        if head_dim <= bound:
            return blocks
    raise ValueError(f"head dim {head_dim} exceeds {table[-1][0]}")


def default_block_sizes(head_dim, dtype):
    """The tuned (BLOCK_M, BLOCK_N) for this head dim and dtype."""
    return tiles_for_head_dim(DEFAULT_BLOCK_SIZES[np.dtype(dtype).name], head_dim)


@inlined_device_function
def listed_tile(tile_entries, index, block):
    """Entry ``index`` of a ``tile_lists`` list: the tile's first row (or key), and whether it is partly masked."""
    entry = load_word(tile_entries, index)
    return (entry >> 1) * block, (entry & 1) != 0


@dataclass(frozen=True)
class Flash2Layout:
    """Compile-time shape of one flash2 specialisation and its shared memory."""

    block_m: int
    block_n: int
    head_dim: int
    is_f16: bool

    @property
    def warps(self):
        return self.block_m // ROWS_PER_WARP

    @property
    def threads(self):
        return 32 * self.warps

    @property
    def k_step(self):
        """Depth of one mma: 8 for tf32, 16 for float16."""
        return 16 if self.is_f16 else 8

    @property
    def d_pad(self):
        """Head dim rounded up to the mma depth; the padding columns hold zeros."""
        return cdiv(self.head_dim, self.k_step) * self.k_step

    @property
    def qk_stride(self):
        """Words per row of the Q and K tiles, and of every row-major tile (tf32 words, or float16 pairs)."""
        return row_stride(self.d_pad, self.is_f16)

    @property
    def v_stride(self):
        """Words per row of the V tile (float16: a row holds a pair of keys, as every interleaved-pairs tile)."""
        return pair_stride(self.d_pad) if self.is_f16 else row_stride(self.d_pad, False)

    @property
    def shared_words(self):
        if self.is_f16:  # Q, K as float16 pairs along d; V as pairs along keys
            return (self.block_m + self.block_n) * self.qk_stride + self.block_n // 2 * self.v_stride
        # hi and lo halves of Q, K and V
        return 2 * (self.block_m * self.qk_stride + self.block_n * (self.qk_stride + self.v_stride))

    @property
    def shared_bytes(self):
        return 4 * self.shared_words


@lru_cache(maxsize=None)
def make_load_chunk(IS_F16, VEC):
    """The device function that fetches one 16-byte chunk of a row (see its docstring) for this dtype and VEC."""

    @cuda.jit(device=True, inline=True)
    def load_chunk(X, row_start, c, head_dim, row_ok):
        """Words c/4 .. c/4 + 3 of a row (columns c.. of float32, c.. c+7 of float16), zeros outside."""
        if IS_F16:
            if VEC:  # X is the float16 data viewed as uint32 pairs; d is a multiple of 8
                if row_ok and c < head_dim:
                    return load_vec4(X, (row_start + c) // 2)
                return uint32(0), uint32(0), uint32(0), uint32(0)
            h = cuda.local.array(8, float32)
            for i in range(8):
                h[i] = float32(load_word(X, row_start + c + i)) if row_ok and c + i < head_dim else float32(0)
            return (pack_half2(h[0], h[1]), pack_half2(h[2], h[3]),
                    pack_half2(h[4], h[5]), pack_half2(h[6], h[7]))
        if VEC:  # d is a multiple of 4: a chunk is wholly inside the row or wholly padding
            if row_ok and c < head_dim:
                return load_vec4(X, row_start + c)
            return float32(0), float32(0), float32(0), float32(0)
        x = cuda.local.array(4, float32)
        for i in range(4):
            x[i] = load_word(X, row_start + c + i) if row_ok and c + i < head_dim else float32(0)
        return x[0], x[1], x[2], x[3]

    return load_chunk


@cuda.jit(device=True, inline=True)
def store_split(base_hi, base_lo, w0, w1, w2, w3, smem):
    """Four float32 into shared memory as tf32 hi and lo halves (3xTF32)."""
    h0, l0 = split_tf32(w0)
    h1, l1 = split_tf32(w1)
    h2, l2 = split_tf32(w2)
    h3, l3 = split_tf32(w3)
    store_vec4(smem, base_hi, h0, h1, h2, h3)
    store_vec4(smem, base_lo, l0, l1, l2, l3)


@cuda.jit(device=True, inline=True)
def cdiv_device(a, b):
    return (a + b - 1) // b


@lru_cache(maxsize=None)
def make_flash2_forward(BLOCK_M, BLOCK_N, D_PAD, CAUSAL, IS_F16, VEC, HAS_MASK, HAS_DROPOUT):
    """The flash2 forward kernel for one (BLOCK_M, BLOCK_N, padded d, causal, dtype, VEC, mask, dropout).

    D_PAD is the head dim rounded up to the mma depth (8 for tf32, 16 for
    float16): head dims that round to the same D_PAD share one compiled
    kernel, which is told the true d and zero-fills the rest.  VEC: rows
    start on 16-byte boundaries (d a multiple of 4 float32 / 8 float16 and
    aligned arrays), so tiles move in 16-byte loads; otherwise element by
    element.  HAS_MASK: a block mask lists, per query tile, the key tiles to
    visit (see ``key_tile_lists``); only tiles the mask covers partly are
    masked element by element.  HAS_DROPOUT: Algorithm 2's dropout on P,
    regenerated from ``numba_flash.dropout``'s counter-based generator.
    """
    layout = Flash2Layout(BLOCK_M, BLOCK_N, D_PAD, IS_F16)
    assert layout.d_pad == D_PAD, "D_PAD must be a multiple of the mma depth"
    THREADS = layout.threads
    QK_STRIDE = layout.qk_stride
    V_STRIDE = layout.v_stride
    N_TILES = BLOCK_N // 8       # 8-wide key tiles of S
    D_TILES = D_PAD // 8         # 8-wide head-dim tiles of O
    # Tiles move between device memory and shared memory in chunks of four
    # 32-bit words: 4 float32, or 8 float16 (as 4 packed pairs).
    ROW_CHUNKS = D_PAD // (8 if IS_F16 else 4)
    Q_ITERS = cdiv(BLOCK_M * ROW_CHUNKS, THREADS)
    K_ITERS = cdiv(BLOCK_N * ROW_CHUNKS, THREADS)
    # float16 V is stored as pairs of keys, so one unit is two rows' chunks.
    V_UNITS = (BLOCK_N // 2 if IS_F16 else BLOCK_N) * ROW_CHUNKS
    V_ITERS = cdiv(V_UNITS, THREADS)
    V_WORDS = 8 if IS_F16 else 4
    WORD = uint32 if IS_F16 else float32
    # Offsets (in 32-bit words) of the tiles in dynamic shared memory.
    if IS_F16:
        Q_W = 0
        K_W = BLOCK_M * QK_STRIDE
        V_W = K_W + BLOCK_N * QK_STRIDE
    else:
        Q_HI = 0
        Q_LO = BLOCK_M * QK_STRIDE
        K_HI = 2 * BLOCK_M * QK_STRIDE
        K_LO = K_HI + BLOCK_N * QK_STRIDE
        V_HI = K_LO + BLOCK_N * QK_STRIDE
        V_LO = V_HI + BLOCK_N * V_STRIDE
    # The tiles as the shared products read them (float16 has no lo halves).
    Q_A, Q_A_LO = (Q_W, 0) if IS_F16 else (Q_HI, Q_LO)
    K_B, K_B_LO = (K_W, 0) if IS_F16 else (K_HI, K_LO)
    V_B, V_B_LO = (V_W, 0) if IS_F16 else (V_HI, V_LO)
    rows_by_rows_t, regs_by_rows = tile_products(BLOCK_N, D_PAD, IS_F16)
    store_fragment_row = fragment_row_store(D_PAD, IS_F16, VEC)

    load_chunk = make_load_chunk(IS_F16, VEC)

    def kernel(Q, K, V, O, LSE, n_q, n_k, head_dim, scale_log2, tile_offsets, tile_entries, M, mask_rows, mask_cols,
               keep_threshold, keep_scale, seed0, seed1):
        # Q, O: flat (BH * N_q * d); K, V: flat (BH * N_k * d); LSE: (BH, N_q) float32.
        # With VEC and float16 the flat arrays are uint32 views (pairs of halves).
        # With HAS_MASK: key tiles of query tile qt of head bh are
        # tile_entries[tile_offsets[bh, qt]:tile_offsets[bh, qt + 1]] >> 1 (low bit:
        # partly masked); M: (BH, T_r, T_c) uint8 block mask in blocks of
        # (mask_rows, mask_cols).
        bh = cuda.blockIdx.y
        # Causal blocks further down have more keys to visit: start them first.
        q_block = (cdiv_device(n_q, BLOCK_M) - 1 - cuda.blockIdx.x) if CAUSAL else cuda.blockIdx.x
        q0 = q_block * BLOCK_M
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2
        t = lane & 3
        row0 = warp * ROWS_PER_WARP + g          # this lane's rows: row0 and row0 + 8
        NEG_INF = float32(-math.inf)
        c_log2 = float32(scale_log2)             # softmax scale times log2(e)
        smem = cuda.shared.array(0, uint32)

        # ---- load Q_i once: it stays in shared memory for the whole loop ----
        for i in range(Q_ITERS):
            e = tid + i * THREADS
            if e < BLOCK_M * ROW_CHUNKS:
                r = e // ROW_CHUNKS
                w0, w1, w2, w3 = load_chunk(Q, (bh * n_q + q0 + r) * head_dim, (e % ROW_CHUNKS) * (8 if IS_F16 else 4),
                                            head_dim, q0 + r < n_q)
                if IS_F16:
                    store_vec4(smem, Q_W + r * QK_STRIDE + 4 * (e % ROW_CHUNKS), w0, w1, w2, w3)
                else:
                    at = r * QK_STRIDE + 4 * (e % ROW_CHUNKS)
                    store_split(Q_HI + at, Q_LO + at, w0, w1, w2, w3, smem)

        m_i = cuda.local.array(2, float32)       # running max (log2 units) of rows row0, row0 + 8
        l_i = cuda.local.array(2, float32)       # running sum, this lane's columns only
        acc = cuda.local.array((D_TILES, 4), float32)
        s_acc = cuda.local.array((N_TILES, 4), float32)
        k_next = cuda.local.array((K_ITERS, 4), WORD)       # the next K tile, in flight
        v_next = cuda.local.array((V_ITERS, V_WORDS), WORD)  # the next V tile, in flight
        for h in range(2):
            m_i[h] = NEG_INF
            l_i[h] = float32(0)
        for dt in range(D_TILES):
            for e in range(4):
                acc[dt, e] = float32(0)

        if HAS_MASK:  # the host listed the key tiles this query tile visits
            first = tile_offsets[bh, q_block]
            n_blocks = tile_offsets[bh, q_block + 1] - first
        else:
            first = 0
            n_blocks = cdiv_device(n_k, BLOCK_N)
            if CAUSAL:  # key blocks beyond the last row of this query block see nothing
                n_blocks = min(n_blocks, cdiv_device(min(q0 + BLOCK_M, n_q), BLOCK_N))
        # Software pipeline: iteration j stores tile j (fetched during
        # iteration j - 1) into shared memory, starts the global loads of
        # tile j + 1 into registers, and computes on tile j while they fly.
        # Iteration -1 only fetches tile 0.
        for j in range(-1, n_blocks):
            if j >= 0:
                cuda.syncthreads()  # everyone is done with tile j - 1 (and Q_i is stored)
                for i in range(K_ITERS):
                    e = tid + i * THREADS
                    if e < BLOCK_N * ROW_CHUNKS:
                        at = (e // ROW_CHUNKS) * QK_STRIDE + 4 * (e % ROW_CHUNKS)
                        if IS_F16:
                            store_vec4(smem, K_W + at, k_next[i, 0], k_next[i, 1], k_next[i, 2], k_next[i, 3])
                        else:
                            store_split(K_HI + at, K_LO + at, k_next[i, 0], k_next[i, 1], k_next[i, 2],
                                        k_next[i, 3], smem)
                for i in range(V_ITERS):
                    e = tid + i * THREADS
                    if e < V_UNITS:
                        at = (e // ROW_CHUNKS) * V_STRIDE + V_WORDS * (e % ROW_CHUNKS)
                        if IS_F16:
                            # Rows 2r and 2r+1 interleaved: word (key pair r, column c)
                            # holds V[2r, c] low and V[2r+1, c] high (m16n8k16's B layout).
                            for w in range(4):
                                a = v_next[i, w]
                                b = v_next[i, 4 + w]
                                v_next[i, w] = (a & 0xFFFF) | (b << 16)            # column 2w
                                v_next[i, 4 + w] = (a >> 16) | (b & 0xFFFF0000)    # column 2w + 1
                            store_vec4(smem, V_W + at, v_next[i, 0], v_next[i, 4], v_next[i, 1], v_next[i, 5])
                            store_vec4(smem, V_W + at + 4, v_next[i, 2], v_next[i, 6], v_next[i, 3], v_next[i, 7])
                        else:
                            store_split(V_HI + at, V_LO + at, v_next[i, 0], v_next[i, 1], v_next[i, 2],
                                        v_next[i, 3], smem)
                cuda.syncthreads()  # tile j complete in shared memory
            if j + 1 < n_blocks:
                # ---- fetch tile j + 1 into registers (no wait: used next iteration) ----
                k1 = ((load_word(tile_entries, first + j + 1) >> 1) if HAS_MASK else j + 1) * BLOCK_N
                for i in range(K_ITERS):
                    e = tid + i * THREADS
                    r = e // ROW_CHUNKS
                    w0, w1, w2, w3 = load_chunk(K, (bh * n_k + k1 + r) * head_dim,
                                                (e % ROW_CHUNKS) * (8 if IS_F16 else 4), head_dim,
                                                e < BLOCK_N * ROW_CHUNKS and k1 + r < n_k)
                    k_next[i, 0], k_next[i, 1], k_next[i, 2], k_next[i, 3] = w0, w1, w2, w3
                for i in range(V_ITERS):
                    e = tid + i * THREADS
                    c = (e % ROW_CHUNKS) * (8 if IS_F16 else 4)
                    if IS_F16:  # key pair r: rows 2r and 2r + 1
                        key = k1 + 2 * (e // ROW_CHUNKS)
                        w0, w1, w2, w3 = load_chunk(V, (bh * n_k + key) * head_dim, c, head_dim,
                                                    e < V_UNITS and key < n_k)
                        v_next[i, 0], v_next[i, 1], v_next[i, 2], v_next[i, 3] = w0, w1, w2, w3
                        w0, w1, w2, w3 = load_chunk(V, (bh * n_k + key + 1) * head_dim, c, head_dim,
                                                    e < V_UNITS and key + 1 < n_k)
                        v_next[i, 4], v_next[i, 5], v_next[i, 6], v_next[i, 7] = w0, w1, w2, w3
                    else:
                        key = k1 + e // ROW_CHUNKS
                        w0, w1, w2, w3 = load_chunk(V, (bh * n_k + key) * head_dim, c, head_dim,
                                                    e < V_UNITS and key < n_k)
                        v_next[i, 0], v_next[i, 1], v_next[i, 2], v_next[i, 3] = w0, w1, w2, w3
            if j < 0:
                continue
            if HAS_MASK:
                k0, partly_masked = listed_tile(tile_entries, first + j, BLOCK_N)
            else:
                k0 = j * BLOCK_N
                partly_masked = False
            # ---- S = Q_i K_j^T for this warp's 16 rows ----
            for nt in range(N_TILES):
                for e in range(4):
                    s_acc[nt, e] = float32(0)
            rows_by_rows_t(s_acc, smem, Q_A, Q_A_LO, K_B, K_B_LO, warp * ROWS_PER_WARP, g, t)

            # ---- online softmax: scale to log2 units, mask, new max, P = exp2(S - m) ----
            # Only the last key block (ragged) and blocks crossing the diagonal need masks.
            masked = k0 + BLOCK_N > n_k or (CAUSAL and k0 + BLOCK_N - 1 > q0) or partly_masked
            for h in range(2):
                row = q0 + row0 + 8 * h
                m_tile = NEG_INF
                for nt in range(N_TILES):
                    for e in range(2):
                        x = s_acc[nt, 2 * h + e] * c_log2
                        if masked:
                            key = k0 + nt * 8 + 2 * t + e
                            if key >= n_k or (CAUSAL and key > row):
                                x = NEG_INF
                            elif partly_masked and (row >= n_q or M[bh, row // mask_rows, key // mask_cols] == 0):
                                x = NEG_INF
                        s_acc[nt, 2 * h + e] = x
                        m_tile = max(m_tile, x)
                # The four lanes of a row hold different columns: combine them.
                m_tile = max(m_tile, shfl_xor(m_tile, 1))
                m_tile = max(m_tile, shfl_xor(m_tile, 2))
                m_new = max(m_i[h], m_tile)
                # A row that has seen no allowed key keeps m = -inf; shifting by
                # 0 instead makes every exp2 below exactly 0 rather than NaN.
                shift = m_new if m_new != NEG_INF else float32(0)
                alpha = exp2(m_i[h] - shift)
                row_sum = float32(0)
                for nt in range(N_TILES):
                    for e in range(2):
                        p = exp2(s_acc[nt, 2 * h + e] - shift)
                        s_acc[nt, 2 * h + e] = p
                        row_sum += p
                l_i[h] = alpha * l_i[h] + row_sum
                m_i[h] = m_new
                for dt in range(D_TILES):
                    acc[dt, 2 * h] *= alpha
                    acc[dt, 2 * h + 1] *= alpha

            if HAS_DROPOUT:
                # Algorithm 2, lines 14-15: drop P after l is summed (l and m see
                # the undropped values).  A lane's two columns 2t, 2t + 1 share one
                # generator call: they are words 2(t & 1) and 2(t & 1) + 1 of
                # the group of four keys they belong to.
                for h in range(2):
                    row = q0 + row0 + 8 * h
                    for nt in range(N_TILES):
                        key = k0 + nt * 8 + 2 * t
                        w0, w1, w2, w3 = philox_device(uint32(key // 4), uint32(row), uint32(bh), uint32(0),
                                                       uint32(seed0), uint32(seed1))
                        first_word = w2 if t & 1 else w0
                        second_word = w3 if t & 1 else w1
                        s_acc[nt, 2 * h] *= float32(keep_scale) if first_word >= keep_threshold else float32(0)
                        s_acc[nt, 2 * h + 1] *= float32(keep_scale) if second_word >= keep_threshold else float32(0)

            # ---- acc += P V_j, with P straight from the S registers ----
            regs_by_rows(acc, s_acc, smem, V_B, V_B_LO, g, t)

        # ---- epilogue: O_i = acc / l_i, lse = m + log l, written once ----
        for h in range(2):
            l_row = l_i[h]
            l_row += shfl_xor(l_row, 1)
            l_row += shfl_xor(l_row, 2)
            row = q0 + row0 + 8 * h
            inv_l = float32(1) / l_row if l_row > float32(0) else float32(0)
            if row < n_q:
                store_fragment_row(O, acc, h, (bh * n_q + row) * head_dim, head_dim, inv_l, t)
                if t == 0:
                    LSE[bh, row] = (m_i[h] * float32(1 / LOG2_E) + math.log(l_row)
                                    if l_row > float32(0) else NEG_INF)

    name = (f"flash2_forward_m{BLOCK_M}_n{BLOCK_N}_d{D_PAD}_{'f16' if IS_F16 else 'f32'}"
            + ("_causal" if CAUSAL else "") + ("" if VEC else "_scalar") + ("_sparse" if HAS_MASK else "")
            + ("_dropout" if HAS_DROPOUT else ""))
    return cuda_kernel(kernel, name, fastmath=True)


@lru_cache(maxsize=None)
def no_tile_lists():
    """Placeholder tile lists for the dense kernel, which never reads them."""
    return cuda.to_device(np.zeros((1, 2), np.int32)), cuda.to_device(np.zeros(1, np.int32))


def _flat(x, as_pairs):
    """x (BH, N, d) as a flat array; float16 data as uint32 pairs when ``as_pairs``."""
    flat = x.reshape(x.size)
    return flat.view(np.uint32) if as_pairs else flat


def _aligned16(x):
    """True if the array's data starts on a 16-byte boundary (always true in the simulator)."""
    pointer = getattr(x, "device_ctypes_pointer", None)
    return pointer is None or pointer.value is None or pointer.value % 16 == 0


def tile_visits(layout, mask_block, tile, n_q, n_k, causal):
    """Which (query tile, key tile) pairs a kernel visits under a block mask, and which it masks.

    layout: (BH, T_r, T_c) bool, in blocks of mask_block = (B_r, B_c); tile:
    (query rows, keys) of the kernel's tiles, which need not match the mask's
    blocks.  A tile is visited if any mask block it overlaps is non-zero (and,
    when causal, if any of its keys is not above every one of its rows); it is
    *partly masked* unless every mask block it overlaps is non-zero, and then
    the kernel checks each element against the layout.  Returns boolean
    (visit, partly), each (BH, query tiles, key tiles).
    """
    (mask_rows, mask_cols), (block_m, block_n) = mask_block, tile
    heads = layout.shape[0]
    # 2-D prefix sums count the non-zero mask blocks in any rectangle.
    prefix = np.zeros((heads, layout.shape[1] + 1, layout.shape[2] + 1), np.int64)
    prefix[:, 1:, 1:] = layout.cumsum(1).cumsum(2)
    q_first = np.arange(0, n_q, block_m)
    q_last = np.minimum(q_first + block_m, n_q) - 1
    k_first = np.arange(0, n_k, block_n)
    k_last = np.minimum(k_first + block_n, n_k) - 1
    r0, r1 = q_first // mask_rows, q_last // mask_rows + 1
    c0, c1 = k_first // mask_cols, k_last // mask_cols + 1
    nonzero = (prefix[:, r1][:, :, c1] - prefix[:, r0][:, :, c1] - prefix[:, r1][:, :, c0]
               + prefix[:, r0][:, :, c0])
    covered = (r1 - r0)[:, None] * (c1 - c0)[None, :]
    visit = nonzero > 0
    if causal:
        visit &= k_first[None, None, :] <= q_last[None, :, None]
    return visit, visit & (nonzero < covered[None])


def tile_lists(visit, partly):
    """visit, partly (BH, T_own, T_other) as per-(head, own tile) lists of the other tiles to visit.

    Returns (offsets (BH, T_own + 1) int32, entries int32 = other tile * 2 +
    partly-masked bit): head bh's own tile i visits
    ``entries[offsets[bh, i]:offsets[bh, i + 1]] >> 1``, in increasing order.
    """
    heads, own_tiles = visit.shape[:2]
    counts = visit.sum(axis=2)
    offsets = np.zeros((heads, own_tiles + 1), np.int64)
    offsets[:, 1:] = counts.cumsum(axis=1)
    offsets += (np.concatenate([[0], counts.sum(axis=1).cumsum()[:-1]]))[:, None]
    _, _, others = np.nonzero(visit)
    return offsets.astype(np.int32), (others * 2 + partly[visit]).astype(np.int32)


def key_tile_lists(layout, mask_block, tile, n_q, n_k, causal):
    """For each (head, query tile), the key tiles flash2's forward visits (``tile_visits``, ``tile_lists``)."""
    return tile_lists(*tile_visits(layout, mask_block, tile, n_q, n_k, causal))


def block_mask_args(layout, device_layout, mask_block, tile, n_q, n_k, causal):
    """A block mask as flash2's kernel arguments: device tile lists, the layout, its block size.

    layout: (BH, T_r, T_c) bool NumPy array (the host builds the tile lists
    from it); device_layout: the same as a uint8 device array.
    """
    offsets, entries = key_tile_lists(layout, mask_block, tile, n_q, n_k, causal)
    return (cuda.to_device(offsets), cuda.to_device(entries if entries.size else np.zeros(1, np.int32)),
            device_layout, int(mask_block[0]), int(mask_block[1]))


def flash2_forward(q, k, v, o, lse, *, scale, causal, block_sizes, mask=None, dropout=None, stream=0):
    """Launch the flash2 forward on device arrays q, o (BH, N_q, d), k, v (BH, N_k, d).

    mask: None, or ``block_mask_args(...)`` for these tiles; dropout: None or
    ``numba_flash.dropout.kernel_args``.
    """
    block_m, block_n = int(block_sizes[0]), int(block_sizes[1])  # plain ints: compile-time constants
    bh, n_q, head_dim = (int(n) for n in q.shape)
    n_k = int(k.shape[1])
    is_f16 = q.dtype.itemsize == 2
    layout = Flash2Layout(block_m, block_n, head_dim, is_f16)
    vec = head_dim % (8 if is_f16 else 4) == 0 and all(_aligned16(x) for x in (q, k, v, o))
    kernel = make_flash2_forward(block_m, block_n, layout.d_pad, bool(causal), is_f16, vec, mask is not None,
                                 dropout is not None)
    grid = (cdiv(n_q, block_m), bh)
    sparse = no_tile_lists() + (no_mask_layout(), 1, 1) if mask is None else mask
    args = (tuple(_flat(x, is_f16 and vec) for x in (q, k, v, o)) + (lse, n_q, n_k, head_dim, scale * LOG2_E) + sparse
            + (NO_DROPOUT if dropout is None else dropout))
    launch(kernel, grid, layout.threads, args, dynamic_shared_bytes=layout.shared_bytes, stream=stream)
