"""FlashAttention-2 backward on tensor cores: the fast, deterministic backward.

Given Q, K, V, the forward's O and lse, and dO, the gradients are

    P  = exp(scale Q K^T - lse)            (recomputed tile by tile, never stored)
    dV = (P o Z)^T dO                      (Z: Algorithm 2's dropout weights, 1 without dropout)
    dP = (dO V^T) o Z
    dS = P o (dP - D),   D = rowsum(dO o O)
    dQ = scale dS K,     dK = scale dS^T Q

Three launches, none with atomics, so every run gives the same bits:

1. ``preprocess``: D_i = rowsum(dO_i o O_i), one thread per row (Algorithm 4
   computes D_i inside its loops; FlashAttention-2 hoists it out).
2. ``dkdv``: one thread block per (key tile of B_r keys, batch*head).  K_j and
   V_j stay in shared memory; the block walks the query tiles (B_c queries
   each) that can see its keys and accumulates dK_j and dV_j in registers,
   writing each once.  Each warp owns 16 keys, so it computes S^T = K_j Q_i^T
   (keys are the rows of its fragments) and feeds P^T and dS^T straight from
   its accumulators into dV_j += P^T dO_i and dK_j += dS^T Q_i.
3. ``dq``: one thread block per (query tile of B_r queries, batch*head): the
   forward's loop order.  It recomputes S and dP for its rows and accumulates
   dQ_i += dS K_j in registers.  Recomputing S in both passes costs two extra
   matrix products (7 instead of 5), which is what buys the determinism: the
   alternative, accumulating dQ from the dK/dV pass with atomic adds, sums in
   a different order every run.

causal skips tiles entirely above the diagonal in both passes; a block mask
gives each pass its own tile lists (per query tile for ``dq``, per key tile
for ``dkdv``) from the same rule as the forward (``flash2_forward.tile_visits``);
dropout regenerates the forward's Z from the counter-based generator.

The machinery is the forward's (``flash2_forward.py`` explains it): PTX
``mma.sync`` from ``primitives.py``, float32 kept to float32 accuracy with
3xTF32 (operands split into tf32 hi and lo halves once, as they enter shared
memory), float16 on m16n8k16 with float32 accumulation, padded rows that
avoid bank conflicts.  Two fragment products do all the work:

* ``rows_by_rows_t``: acc += A B^T, A and B both row-major tiles in shared
  memory (the contraction runs over d): S = Q K^T, dP = dO V^T and their
  transposes;
* ``regs_by_rows``: acc += P B, P an accumulator fragment still in registers
  (the contraction runs over the 8-wide column tiles of P) and B a row-major
  tile: dV, dK and dQ.  tf32 renumbers P's columns inside each k-step as the
  forward does; float16 reads B from a copy stored as interleaved row pairs
  (m16n8k16's B layout), so float16 tiles used that way are stored twice.

Block sizes (B_r, B_c): the tile a thread block owns (B_r: queries in
``dq``, keys in ``dkdv``; 16 per warp) and the tile it streams (B_c), both
multiples of 16.
"""
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32

from ...dropout import NO_DROPOUT, dropout_weight, philox_device
from ...runtime.launch import cdiv, cuda_kernel, inlined_device_function, launch, no_mask_layout
from .forward import (LOG2_E, ROWS_PER_WARP, Flash2Layout, _aligned16, _flat, listed_tile, make_load_chunk,
                             no_tile_lists, store_split, tile_lists, tile_visits, tiles_for_head_dim)
from .fragments import fragment_row_store, pair_stride, row_stride, tile_products
from .primitives import exp2, f32_as_u32, load_word, store_vec4, store_word, u32_as_f32

MAX_HEAD_DIM = 256
BLOCK_MULTIPLE = 16
#: Default (B_r, B_c) per (dtype, causal), for head dims up to each bound.  Chosen on the
#: H200 by ``experiments/tune_flash2.py --backward`` ((B,H,N,d) = (4,16,4096,d), non-causal;
#: experiments/results/tune_flash2_backward.md) and checked by interleaved timings of the
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
_FLOAT32_BLOCK_SIZES = [(64, (128, 64)), (128, (64, 32)), (256, (32, 16))]
DEFAULT_BLOCK_SIZES = {
    ("float32", False): _FLOAT32_BLOCK_SIZES,
    ("float32", True): _FLOAT32_BLOCK_SIZES,
    ("float16", False): [(128, (128, 64)), (256, (32, 16))],
    ("float16", True): [(64, (64, 32)), (128, (128, 64)), (256, (32, 16))],
}


def default_block_sizes(head_dim, dtype, causal=False):
    return tiles_for_head_dim(DEFAULT_BLOCK_SIZES[np.dtype(dtype).name, bool(causal)], head_dim)


@dataclass(frozen=True)
class BackwardLayout(Flash2Layout):
    """The forward's layout read for the backward: ``block_m`` is the tile a thread block owns
    (B_r: queries in dQ, keys in dK/dV), ``block_n`` the tile it streams (B_c); shared memory
    is that of the two backward kernels."""

    def _tiles(self, rows):
        """Words of one row-major tile (hi and lo halves for tf32)."""
        return rows * self.qk_stride * (1 if self.is_f16 else 2)

    @property
    def dkdv_words(self):
        # K_j, V_j; Q_i, dO_i (twice for float16: rows and pairs); lse and D of the query tile.
        pairs = 2 * (self.block_n // 2) * self.v_stride if self.is_f16 else 0
        return 2 * self._tiles(self.block_m) + 2 * self._tiles(self.block_n) + pairs + 2 * self.block_n

    @property
    def dq_words(self):
        # Q_i, dO_i; K_j (twice for float16), V_j.
        pairs = (self.block_n // 2) * self.v_stride if self.is_f16 else 0
        return 2 * self._tiles(self.block_m) + 2 * self._tiles(self.block_n) + pairs

    @property
    def shared_words(self):
        """The larger of the two kernels' shared memory."""
        return max(self.dkdv_words, self.dq_words)


@lru_cache(maxsize=None)
def _tile_moves(D_PAD, IS_F16, THREADS, VEC):
    """Device functions both kernels use to move tiles: rows into shared memory, results out."""
    RS = row_stride(D_PAD, IS_F16)
    PS = pair_stride(D_PAD)
    ROW_CHUNKS = D_PAD // (8 if IS_F16 else 4)  # 16-byte chunks per row
    CHUNK = 8 if IS_F16 else 4                  # elements per chunk
    load_chunk = make_load_chunk(IS_F16, VEC)
    store_fragment_row = fragment_row_store(D_PAD, IS_F16, VEC)

    @inlined_device_function
    def store_rows(smem, X, tile_start, rows_valid, head_dim, HI, LO, ROWS, tid):
        """Rows tile_start.. of X (ROWS of them, zeros past rows_valid) as a row-major tile at HI (and LO)."""
        for e in range(tid, ROWS * ROW_CHUNKS, THREADS):
            r = e // ROW_CHUNKS
            chunk = e % ROW_CHUNKS
            w0, w1, w2, w3 = load_chunk(X, tile_start + r * head_dim, chunk * CHUNK, head_dim, r < rows_valid)
            at = r * RS + 4 * chunk
            if IS_F16:
                store_vec4(smem, HI + at, w0, w1, w2, w3)
            else:
                store_split(HI + at, LO + at, w0, w1, w2, w3, smem)

    @inlined_device_function
    def store_pairs(smem, X, tile_start, rows_valid, head_dim, AT, ROWS, tid):
        """float16 rows as interleaved pairs: word (pair r, column c) = X[2r, c] low, X[2r + 1, c] high."""
        for e in range(tid, (ROWS // 2) * ROW_CHUNKS, THREADS):
            r = e // ROW_CHUNKS
            chunk = e % ROW_CHUNKS
            a0, a1, a2, a3 = load_chunk(X, tile_start + 2 * r * head_dim, chunk * 8, head_dim, 2 * r < rows_valid)
            b0, b1, b2, b3 = load_chunk(X, tile_start + (2 * r + 1) * head_dim, chunk * 8, head_dim,
                                        2 * r + 1 < rows_valid)
            at = AT + r * PS + 8 * chunk
            # a_w holds columns 2w (low) and 2w + 1 (high) of row 2r; b_w the same of row 2r + 1.
            store_vec4(smem, at, (a0 & 0xFFFF) | (b0 << 16), (a0 >> 16) | (b0 & 0xFFFF0000),
                       (a1 & 0xFFFF) | (b1 << 16), (a1 >> 16) | (b1 & 0xFFFF0000))
            store_vec4(smem, at + 4, (a2 & 0xFFFF) | (b2 << 16), (a2 >> 16) | (b2 & 0xFFFF0000),
                       (a3 & 0xFFFF) | (b3 << 16), (a3 >> 16) | (b3 & 0xFFFF0000))

    @inlined_device_function
    def store_result(X, acc, first_row, n_rows, row_base, head_dim, scale, row0, t):
        """Rows row0, row0 + 8 of a 16 x d accumulator fragment, times scale, into X (rows past n_rows dropped)."""
        for h in range(2):
            row = first_row + row0 + 8 * h
            if row < n_rows:
                store_fragment_row(X, acc, h, (row_base + row) * head_dim, head_dim, scale, t)

    return store_rows, store_pairs, store_result


@inlined_device_function
def _zero(acc):
    for i in range(acc.shape[0]):
        for e in range(4):
            acc[i, e] = float32(0)


@inlined_device_function
def _log2_lse(lse):
    """lse in log2 units; +inf for a row that attended to nothing, so that exp2(s - it) = 0."""
    return lse * float32(LOG2_E) if lse != float32(-math.inf) else float32(math.inf)


def _preprocess(O, dO, Dsum):
    """Dsum[bh, i] = sum_x O[bh, i, x] dO[bh, i, x] in float32."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    bh = cuda.blockIdx.y
    if i < O.shape[1]:
        total = float32(0)
        for x in range(O.shape[2]):
            total += float32(O[bh, i, x]) * float32(dO[bh, i, x])
        Dsum[bh, i] = total


preprocess = cuda_kernel(_preprocess, "flash2_backward_preprocess")
PREPROCESS_THREADS = 128


@lru_cache(maxsize=None)
def make_flash2_backward_dkdv(BLOCK_KEYS, BLOCK_QUERIES, D_PAD, CAUSAL, IS_F16, VEC, HAS_MASK, HAS_DROPOUT):
    """dK and dV: one thread block per (key tile of BLOCK_KEYS, batch*head); see the module docstring."""
    layout = BackwardLayout(BLOCK_KEYS, BLOCK_QUERIES, D_PAD, IS_F16)
    THREADS = layout.threads
    store_rows, store_pairs, store_result = _tile_moves(D_PAD, IS_F16, THREADS, VEC)
    rows_by_rows_t, regs_by_rows = tile_products(BLOCK_QUERIES, D_PAD, IS_F16)
    Q_TILES = BLOCK_QUERIES // 8
    D_TILES = D_PAD // 8
    KEY_WORDS = layout._tiles(BLOCK_KEYS)
    QUERY_WORDS = layout._tiles(BLOCK_QUERIES)
    # Offsets (32-bit words) in dynamic shared memory; a tf32 tile's lo half follows its hi half.
    K_HI = 0
    V_HI = KEY_WORDS
    Q_HI = 2 * KEY_WORDS
    DO_HI = Q_HI + QUERY_WORDS
    HALF_K = BLOCK_KEYS * layout.qk_stride
    HALF_Q = BLOCK_QUERIES * layout.qk_stride
    K_LO, V_LO, Q_LO, DO_LO = K_HI + HALF_K, V_HI + HALF_K, Q_HI + HALF_Q, DO_HI + HALF_Q
    PAIRS = (BLOCK_QUERIES // 2) * layout.v_stride
    Q_PAIRS = DO_HI + QUERY_WORDS
    DO_PAIRS = Q_PAIRS + PAIRS
    LSE2 = DO_HI + QUERY_WORDS + (2 * PAIRS if IS_F16 else 0)
    DSUM = LSE2 + BLOCK_QUERIES
    # regs_by_rows reads B from the pairs copy in float16, from the row-major tile in tf32.
    Q_B = Q_PAIRS if IS_F16 else Q_HI
    DO_B = DO_PAIRS if IS_F16 else DO_HI

    def kernel(Q, K, V, dO, LSE, Dsum, dK, dV, n_q, n_k, head_dim, scale, scale_log2, tile_offsets, tile_entries,
               M, mask_rows, mask_cols, keep_threshold, keep_scale, seed0, seed1):
        # Q, dO: flat (BH * N_q * d); K, V, dK, dV: flat (BH * N_k * d) (uint32 pairs for float16 with VEC);
        # LSE, Dsum: (BH, N_q) float32.  HAS_MASK: the query tiles of key tile kt are
        # tile_entries[tile_offsets[bh, kt]:tile_offsets[bh, kt + 1]] >> 1 (low bit: partly masked).
        bh = cuda.blockIdx.y
        k_tile = cuda.blockIdx.x
        k0 = k_tile * BLOCK_KEYS
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2
        t = lane & 3
        c_log2 = float32(scale_log2)
        smem = cuda.shared.array(0, uint32)

        # K_j and V_j once: they stay for the whole loop.
        store_rows(smem, K, (bh * n_k + k0) * head_dim, n_k - k0, head_dim, K_HI, K_LO, BLOCK_KEYS, tid)
        store_rows(smem, V, (bh * n_k + k0) * head_dim, n_k - k0, head_dim, V_HI, V_LO, BLOCK_KEYS, tid)

        dk_acc = cuda.local.array((D_TILES, 4), float32)
        dv_acc = cuda.local.array((D_TILES, 4), float32)
        st = cuda.local.array((Q_TILES, 4), float32)    # S^T, then (P o Z)^T
        dpt = cuda.local.array((Q_TILES, 4), float32)   # dP^T, then dS^T
        _zero(dk_acc)
        _zero(dv_acc)

        if HAS_MASK:
            first = tile_offsets[bh, k_tile]
            n_visits = tile_offsets[bh, k_tile + 1] - first
        else:
            # causal: only query tiles whose last query reaches this tile's first key.
            first = k0 // BLOCK_QUERIES if CAUSAL else 0
            n_visits = (n_q + BLOCK_QUERIES - 1) // BLOCK_QUERIES - first
        for j in range(n_visits):
            if HAS_MASK:
                q0, partly_masked = listed_tile(tile_entries, first + j, BLOCK_QUERIES)
            else:
                q0 = (first + j) * BLOCK_QUERIES
                partly_masked = False
            cuda.syncthreads()  # everyone is done with the previous Q_i, dO_i
            start = (bh * n_q + q0) * head_dim
            store_rows(smem, Q, start, n_q - q0, head_dim, Q_HI, Q_LO, BLOCK_QUERIES, tid)
            store_rows(smem, dO, start, n_q - q0, head_dim, DO_HI, DO_LO, BLOCK_QUERIES, tid)
            if IS_F16:
                store_pairs(smem, Q, start, n_q - q0, head_dim, Q_PAIRS, BLOCK_QUERIES, tid)
                store_pairs(smem, dO, start, n_q - q0, head_dim, DO_PAIRS, BLOCK_QUERIES, tid)
            for r in range(tid, BLOCK_QUERIES, THREADS):
                # Queries past N_q get lse = +inf (P = 0) and D = 0: they add nothing.
                valid = q0 + r < n_q
                store_word(smem, LSE2 + r, f32_as_u32(_log2_lse(LSE[bh, q0 + r]) if valid else float32(math.inf)))
                store_word(smem, DSUM + r, f32_as_u32(Dsum[bh, q0 + r] if valid else float32(0)))
            cuda.syncthreads()

            # S^T = K_j Q_i^T and dP^T = V_j dO_i^T for this warp's 16 keys.
            _zero(st)
            rows_by_rows_t(st, smem, K_HI, K_LO, Q_HI, Q_LO, warp * ROWS_PER_WARP, g, t)
            _zero(dpt)
            rows_by_rows_t(dpt, smem, V_HI, V_LO, DO_HI, DO_LO, warp * ROWS_PER_WARP, g, t)

            # P^T = exp(S^T - lse), dS^T = P^T o (dP^T o Z - D).  Keys past N_k need
            # no mask: their rows of dK and dV are never written.
            masked = partly_masked or (CAUSAL and k0 + BLOCK_KEYS - 1 > q0)
            for h in range(2):
                key = k0 + warp * ROWS_PER_WARP + g + 8 * h
                for mt in range(Q_TILES):
                    for e in range(2):
                        r = mt * 8 + 2 * t + e
                        q = q0 + r
                        p = exp2(st[mt, 2 * h + e] * c_log2 - u32_as_f32(load_word(smem, LSE2 + r)))
                        if masked:
                            if CAUSAL and key > q:
                                p = float32(0)
                            elif partly_masked and (q >= n_q or key >= n_k
                                                    or M[bh, q // mask_rows, key // mask_cols] == 0):
                                p = float32(0)
                        dp = dpt[mt, 2 * h + e]
                        if HAS_DROPOUT:
                            z = dropout_weight(bh, q, key, keep_threshold, keep_scale, seed0, seed1)
                            dp *= z
                            st[mt, 2 * h + e] = p * z
                        else:
                            st[mt, 2 * h + e] = p
                        dpt[mt, 2 * h + e] = p * (dp - u32_as_f32(load_word(smem, DSUM + r)))

            # dV_j += (P o Z)^T dO_i and dK_j += dS^T Q_i, from the registers.
            regs_by_rows(dv_acc, st, smem, DO_B, DO_LO, g, t)
            regs_by_rows(dk_acc, dpt, smem, Q_B, Q_LO, g, t)

        row0 = warp * ROWS_PER_WARP + g
        store_result(dK, dk_acc, k0, n_k, bh * n_k, head_dim, float32(scale), row0, t)
        store_result(dV, dv_acc, k0, n_k, bh * n_k, head_dim, float32(1), row0, t)

    name = (f"flash2_backward_dkdv_n{BLOCK_KEYS}_m{BLOCK_QUERIES}_d{D_PAD}_{'f16' if IS_F16 else 'f32'}"
            + ("_causal" if CAUSAL else "") + ("" if VEC else "_scalar") + ("_sparse" if HAS_MASK else "")
            + ("_dropout" if HAS_DROPOUT else ""))
    return cuda_kernel(kernel, name, fastmath=True)


@lru_cache(maxsize=None)
def make_flash2_backward_dq(BLOCK_QUERIES, BLOCK_KEYS, D_PAD, CAUSAL, IS_F16, VEC, HAS_MASK, HAS_DROPOUT):
    """dQ: one thread block per (query tile of BLOCK_QUERIES, batch*head); see the module docstring."""
    layout = BackwardLayout(BLOCK_QUERIES, BLOCK_KEYS, D_PAD, IS_F16)
    THREADS = layout.threads
    store_rows, store_pairs, store_result = _tile_moves(D_PAD, IS_F16, THREADS, VEC)
    rows_by_rows_t, regs_by_rows = tile_products(BLOCK_KEYS, D_PAD, IS_F16)
    K_TILES = BLOCK_KEYS // 8
    D_TILES = D_PAD // 8
    QUERY_WORDS = layout._tiles(BLOCK_QUERIES)
    KEY_WORDS = layout._tiles(BLOCK_KEYS)
    HALF_Q = BLOCK_QUERIES * layout.qk_stride
    HALF_K = BLOCK_KEYS * layout.qk_stride
    Q_HI = 0
    DO_HI = QUERY_WORDS
    K_HI = 2 * QUERY_WORDS
    V_HI = K_HI + KEY_WORDS
    Q_LO, DO_LO, K_LO, V_LO = Q_HI + HALF_Q, DO_HI + HALF_Q, K_HI + HALF_K, V_HI + HALF_K
    K_PAIRS = V_HI + KEY_WORDS
    K_B = K_PAIRS if IS_F16 else K_HI

    def kernel(Q, K, V, dO, LSE, Dsum, dQ, n_q, n_k, head_dim, scale, scale_log2, tile_offsets, tile_entries,
               M, mask_rows, mask_cols, keep_threshold, keep_scale, seed0, seed1):
        # As the dkdv kernel, with the lists per query tile.
        bh = cuda.blockIdx.y
        n_q_tiles = (n_q + BLOCK_QUERIES - 1) // BLOCK_QUERIES
        # Causal tiles further down have more keys to visit: start them first.
        q_tile = (n_q_tiles - 1 - cuda.blockIdx.x) if CAUSAL else cuda.blockIdx.x
        q0 = q_tile * BLOCK_QUERIES
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2
        t = lane & 3
        row0 = warp * ROWS_PER_WARP + g
        c_log2 = float32(scale_log2)
        smem = cuda.shared.array(0, uint32)

        start = (bh * n_q + q0) * head_dim
        store_rows(smem, Q, start, n_q - q0, head_dim, Q_HI, Q_LO, BLOCK_QUERIES, tid)
        store_rows(smem, dO, start, n_q - q0, head_dim, DO_HI, DO_LO, BLOCK_QUERIES, tid)
        lse2 = cuda.local.array(2, float32)
        dsum = cuda.local.array(2, float32)
        for h in range(2):
            row = q0 + row0 + 8 * h
            lse2[h] = _log2_lse(LSE[bh, row]) if row < n_q else float32(math.inf)
            dsum[h] = Dsum[bh, row] if row < n_q else float32(0)

        dq_acc = cuda.local.array((D_TILES, 4), float32)
        s = cuda.local.array((K_TILES, 4), float32)     # S, then dS
        dp = cuda.local.array((K_TILES, 4), float32)
        _zero(dq_acc)

        if HAS_MASK:
            first = tile_offsets[bh, q_tile]
            n_blocks = tile_offsets[bh, q_tile + 1] - first
        else:
            first = 0
            n_blocks = (n_k + BLOCK_KEYS - 1) // BLOCK_KEYS
            if CAUSAL:  # key tiles beyond the last row of this query tile see nothing
                n_blocks = min(n_blocks, (min(q0 + BLOCK_QUERIES, n_q) + BLOCK_KEYS - 1) // BLOCK_KEYS)
        for j in range(n_blocks):
            if HAS_MASK:
                k0, partly_masked = listed_tile(tile_entries, first + j, BLOCK_KEYS)
            else:
                k0 = j * BLOCK_KEYS
                partly_masked = False
            cuda.syncthreads()  # everyone is done with the previous K_j, V_j (and Q_i, dO_i are stored)
            key_start = (bh * n_k + k0) * head_dim
            store_rows(smem, K, key_start, n_k - k0, head_dim, K_HI, K_LO, BLOCK_KEYS, tid)
            store_rows(smem, V, key_start, n_k - k0, head_dim, V_HI, V_LO, BLOCK_KEYS, tid)
            if IS_F16:
                store_pairs(smem, K, key_start, n_k - k0, head_dim, K_PAIRS, BLOCK_KEYS, tid)
            cuda.syncthreads()

            # S = Q_i K_j^T and dP = dO_i V_j^T for this warp's 16 queries.
            _zero(s)
            rows_by_rows_t(s, smem, Q_HI, Q_LO, K_HI, K_LO, warp * ROWS_PER_WARP, g, t)
            _zero(dp)
            rows_by_rows_t(dp, smem, DO_HI, DO_LO, V_HI, V_LO, warp * ROWS_PER_WARP, g, t)

            # dS = P o (dP o Z - D), P = exp(S - lse); keys past N_k must be masked here.
            masked = k0 + BLOCK_KEYS > n_k or (CAUSAL and k0 + BLOCK_KEYS - 1 > q0) or partly_masked
            for h in range(2):
                row = q0 + row0 + 8 * h
                for nt in range(K_TILES):
                    if HAS_DROPOUT:
                        # As in the forward: a lane's keys 2t, 2t + 1 are words 2(t & 1)
                        # and 2(t & 1) + 1 of one generator call for their group of four.
                        w0, w1, w2, w3 = philox_device(uint32((k0 + nt * 8 + 2 * t) // 4), uint32(row), uint32(bh),
                                                       uint32(0), uint32(seed0), uint32(seed1))
                        first_word = w2 if t & 1 else w0
                        second_word = w3 if t & 1 else w1
                    for e in range(2):
                        key = k0 + nt * 8 + 2 * t + e
                        p = exp2(s[nt, 2 * h + e] * c_log2 - lse2[h])
                        if masked:
                            if key >= n_k or (CAUSAL and key > row):
                                p = float32(0)
                            elif partly_masked and (row >= n_q or M[bh, row // mask_rows, key // mask_cols] == 0):
                                p = float32(0)
                        d = dp[nt, 2 * h + e]
                        if HAS_DROPOUT:
                            word = second_word if e else first_word
                            d *= float32(keep_scale) if word >= keep_threshold else float32(0)
                        s[nt, 2 * h + e] = p * (d - dsum[h])

            # dQ_i += dS K_j, from the registers.
            regs_by_rows(dq_acc, s, smem, K_B, K_LO, g, t)

        store_result(dQ, dq_acc, q0, n_q, bh * n_q, head_dim, float32(scale), row0, t)

    name = (f"flash2_backward_dq_m{BLOCK_QUERIES}_n{BLOCK_KEYS}_d{D_PAD}_{'f16' if IS_F16 else 'f32'}"
            + ("_causal" if CAUSAL else "") + ("" if VEC else "_scalar") + ("_sparse" if HAS_MASK else "")
            + ("_dropout" if HAS_DROPOUT else ""))
    return cuda_kernel(kernel, name, fastmath=True)


def backward_mask_args(layout, device_layout, mask_block, block_sizes, n_q, n_k, causal):
    """A block mask as the backward's kernel arguments: (dq lists, dkdv lists, layout, block size).

    layout: (BH, T_r, T_c) bool NumPy array; device_layout: the same as a
    uint8 device array.  The dq pass visits (query tile B_r, key tile B_c)
    pairs, the dkdv pass (key tile B_r, query tile B_c) pairs: the same rule,
    with the roles of the tiles exchanged.
    """
    own, other = int(block_sizes[0]), int(block_sizes[1])
    dq_lists = tile_lists(*tile_visits(layout, mask_block, (own, other), n_q, n_k, causal))
    visit, partly = tile_visits(layout, mask_block, (other, own), n_q, n_k, causal)
    dkdv_lists = tile_lists(visit.transpose(0, 2, 1), partly.transpose(0, 2, 1))

    def on_device(lists):
        offsets, entries = lists
        return cuda.to_device(offsets), cuda.to_device(entries if entries.size else np.zeros(1, np.int32))

    return on_device(dq_lists), on_device(dkdv_lists), (device_layout, int(mask_block[0]), int(mask_block[1]))


def flash2_backward(q, k, v, o, do, lse, dq, dk, dv, dsum, *, scale, causal, block_sizes, mask=None, dropout=None, stream=0):
    """Launch the three backward kernels on device arrays (BH, N, d); dsum: (BH, N_q) float32 scratch.

    mask: None or ``backward_mask_args(...)`` for these block sizes; dropout:
    None or ``numba_flash.dropout.kernel_args``.
    """
    own, other = int(block_sizes[0]), int(block_sizes[1])
    bh, n_q, head_dim = (int(n) for n in q.shape)
    n_k = int(k.shape[1])
    is_f16 = q.dtype.itemsize == 2
    layout = BackwardLayout(own, other, head_dim, is_f16)
    vec = head_dim % (8 if is_f16 else 4) == 0 and all(_aligned16(x) for x in (q, k, v, do, dq, dk, dv))
    flags = (bool(causal), is_f16, vec, mask is not None, dropout is not None)

    launch(preprocess, (cdiv(n_q, PREPROCESS_THREADS), bh), PREPROCESS_THREADS, (o, do, dsum), stream=stream)

    if mask is None:
        dq_lists = dkdv_lists = no_tile_lists()
        mask_layout = (no_mask_layout(), 1, 1)
    else:
        dq_lists, dkdv_lists, mask_layout = mask
    flat = {name: _flat(x, is_f16 and vec) for name, x in dict(q=q, k=k, v=v, do=do, dq=dq, dk=dk, dv=dv).items()}
    common = (lse, dsum)
    sizes = (n_q, n_k, head_dim, float(scale), float(scale) * LOG2_E)
    tail = mask_layout + (NO_DROPOUT if dropout is None else tuple(dropout))

    dkdv = make_flash2_backward_dkdv(own, other, layout.d_pad, *flags)
    launch(dkdv, (cdiv(n_k, own), bh), layout.threads,
           (flat["q"], flat["k"], flat["v"], flat["do"]) + common + (flat["dk"], flat["dv"]) + sizes + dkdv_lists + tail,
           dynamic_shared_bytes=4 * layout.dkdv_words, stream=stream)
    dq_kernel = make_flash2_backward_dq(own, other, layout.d_pad, *flags)
    launch(dq_kernel, (cdiv(n_q, own), bh), layout.threads,
           (flat["q"], flat["k"], flat["v"], flat["do"]) + common + (flat["dq"],) + sizes + dq_lists + tail,
           dynamic_shared_bytes=4 * layout.dq_words, stream=stream)
