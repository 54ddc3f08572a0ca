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
2. ``dkdv``: one thread block per (key tile of B_r keys, batch, key/value
   head).  K_j and V_j stay in shared memory; the block walks the query tiles
   (B_c queries each) that can see its keys, of every query head that shares
   this key/value head (grouped-query attention sums their gradients here, in
   a fixed order), and accumulates dK_j and dV_j in registers, writing each
   once.  Each warp owns 16 keys, so it computes S^T = K_j Q_i^T (keys are the
   rows of its fragments) and feeds P^T and dS^T straight from its
   accumulators into dV_j += P^T dO_i and dK_j += dS^T Q_i.
3. ``dq``: one thread block per (query tile of B_r queries, batch, head): the
   forward's loop order.  It recomputes S and dP for its rows and accumulates
   dQ_i += dS K_j in registers.  Recomputing S in both passes costs two extra
   matrix products (7 instead of 5), which is what buys the determinism: the
   alternative, accumulating dQ from the dK/dV pass with atomic adds, sums in
   a different order every run.

One step per streamed tile, in each pass::

    land tile       Q_i, dO_i (dkdv) or K_j, V_j (dq) complete in shared memory, then a barrier
    start next      the next tile on its way by cp.async (16-bit, 16-byte rows: the forward's pipeline)
    sanitize        in partly masked tiles only: NaN to 0 and flagged (common.py)
    S, dP           two ``rows_by_rows_t`` products
    gradient_terms  P = exp2(S c - lse) masked, Z, dS = P o (dP o Z - D), 0 where masked
    accumulate      ``accumulate_product``: a fresh fragment per tile, added on the float32 units

causal skips tiles entirely above the diagonal in both passes; a block mask
gives each pass its own tile lists (per query tile for ``dq``, per key tile
for ``dkdv``) from the same rule as the forward (``sparsity/tile_lists.py``);
dropout regenerates the forward's Z from the counter-based generator.  The
machinery (tensor cores, 3xTF32, fresh fragments per tile, padded rows) is
the forward's; ``forward.py`` explains it.

Block sizes (B_r, B_c): the tile a thread block owns (B_r: queries in
``dq``, keys in ``dkdv``; 16 per warp) and the tile it streams (B_c), both
multiples of 16.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32, uint64

from ...dropout import dropout_weight
from ...runtime.launch import Kernel, Launch, inlined_device_function
from ...sparsity.tile_lists import listed_tile, reads_layout
from ...runtime.arrays import placeholder
from ...runtime.device import device_limits
from ...tiling import (ROWS_PER_WARP, SharedTiles, cdiv, flash2_dkdv_smem, flash2_dq_smem, flash2_stages,
                       flash2_threads, padded_head_dim)
from .bias_table import FUSED_REACH, table_rows, table_steps, table_words
from .common import (LOG2_E, allowed, block_mask_arguments, ceil_div, dropout_arguments, dropout_words,
                     has_tile_lists, kernel_name, lane_flags, log2_lse, lse_slabs, operand_extent, partly_masked_tiles,
                     sequence_arguments, sequence_arrays, sequence_bounds, tile_coordinates, tile_copier, tile_movers,
                     warp_lane, word_extent)
from .fragments import fragment_row_store, tile_products, widening
from .mod_steps import entry_steps, inside, mod_steps, mods_suffix, slot_arguments, slot_arrays
from .primitives import WARP_SIZE, exp2, f32_as_u32, load_word, shfl_xor, store_word, u32_as_f32

#: Rows of O and dO per block of the preprocess kernel, and its warps (each reads one row at a time).
PREPROCESS_ROWS = 128
PREPROCESS_WARPS = 4


@lru_cache(maxsize=None)
def make_preprocess(PRECISION):
    """D[bh * n_q + i] = D_i = sum_x O[bh, i, x] dO[bh, i, x] in float32 (O, dO: float32 or 16-bit words).

    A warp reads one row at a time, lane l elements l, l + 32, ... (neighbouring lanes, neighbouring elements: one
    coalesced access per load), the block's warps neighbouring rows; the lanes' 32 partial sums are added by shuffles,
    always in the same order (D is bitwise repeatable).  With one thread per row, each load of a warp touched 32
    rows' cache lines: 250 us of a 0.68 ms masked backward at (4, 16, 4096, 64) float16 on an H100 (2026-12-06,
    torch's profiler; ``experiments/tuning/results/backward_profile_h100.md``), where O and dO are 67 MB, ~25 us of
    copy bandwidth."""
    widen = widening(PRECISION)

    def kernel(O, dO, D, o_sb, o_sh, o_sn, do_sb, do_sh, do_sn, heads, n_q, head_dim, row_blocks):
        block, h, b, bh = tile_coordinates(cuda.blockIdx.x, row_blocks, heads)
        warp, lane = cuda.threadIdx.x // WARP_SIZE, cuda.threadIdx.x % WARP_SIZE
        for r in range(PREPROCESS_ROWS // PREPROCESS_WARPS):
            i = block * PREPROCESS_ROWS + r * PREPROCESS_WARPS + warp
            if i < n_q:   # the same for every lane of the warp: all take part in the shuffles
                o_row = b * o_sb + h * o_sh + i * o_sn
                do_row = b * do_sb + h * do_sh + i * do_sn
                total = float32(0)
                for x in range(lane, head_dim, WARP_SIZE):
                    total += widen(load_word(O, o_row + x)) * widen(load_word(dO, do_row + x))
                lanes = WARP_SIZE // 2
                while lanes > 0:
                    total += shfl_xor(total, lanes)
                    lanes //= 2
                if lane == 0:
                    D[bh * n_q + i] = total

    data = np.float32 if PRECISION == "tf32x3" else np.uint16
    return Kernel(kernel, f"flash2_backward_preprocess_{PRECISION}", arrays=dict(O=data, dO=data, D=np.float32))


@inlined_device_function
def _zero(acc):
    for i in range(acc.shape[0]):
        for e in range(4):
            acc[i, e] = float32(0)


def _tile_offsets(tiles, name, sixteen):
    """(HI, LO) word offsets of a row-major tile (16-bit tiles have one copy: LO = HI, never read)."""
    if sixteen:
        return tiles.offset(name), tiles.offset(name)
    return tiles.offset(name + "_HI"), tiles.offset(name + "_LO")


@lru_cache(maxsize=None)
def make_dkdv(BLOCK_KEYS, BLOCK_QUERIES, D_PAD, PRECISION, VEC, CAUSAL, HAS_MASK, HAS_DROPOUT, VARLEN=False,
              MODS=None, READS_LAYOUT=True):
    """dK and dV: one thread block per (key tile of BLOCK_KEYS, batch, key/value head); see the module docstring.
    MODS: a score_mod / mask_mod (``mod_steps``), as ``gradient_terms`` says.  READS_LAYOUT (with HAS_MASK): a
    partly masked tile's entries are tested against the block layout (``tile_lists.reads_layout``; False: a
    mask_mod alone cuts tiles)."""
    SIXTEEN = PRECISION != "tf32x3"
    THREADS = flash2_threads(BLOCK_KEYS)
    WORD = uint32 if SIXTEEN else float32
    STAGES = flash2_stages(flash2_dkdv_smem, BLOCK_KEYS, BLOCK_QUERIES, D_PAD, precision=PRECISION, vec=VEC)
    ASYNC = STAGES == 2                          # Q_i, dO_i by cp.async into the other buffer
    tiles = flash2_dkdv_smem(BLOCK_KEYS, BLOCK_QUERIES, D_PAD, PRECISION, STAGES)
    K_HI, K_LO = _tile_offsets(tiles, "K", SIXTEEN)
    V_HI, V_LO = _tile_offsets(tiles, "V", SIXTEEN)
    Q_HI, Q_LO = _tile_offsets(tiles, "Q", SIXTEEN)
    DO_HI, DO_LO = _tile_offsets(tiles, "DO", SIXTEEN)
    LSE2, D_I, Q_NAN = tiles.offset("LSE2"), tiles.offset("D_I"), tiles.offset("Q_NAN")
    QS_STAGE = tiles.offset("Q_STAGE1") - Q_HI if ASYNC else 0   # words from buffer 0 to buffer 1
    SCALAR_ITERS = cdiv(BLOCK_QUERIES, THREADS)  # lse and D values per thread
    NAN_PASSES = SCALAR_ITERS                    # streamed queries per thread in the NaN pass
    Q_TILES = BLOCK_QUERIES // 8
    D_TILES = D_PAD // 8
    OWN_ITERS, fetch_own, commit_own, _ = tile_movers(BLOCK_KEYS, D_PAD, PRECISION, VEC, THREADS)
    ROW_ITERS, fetch_rows, commit_rows, sanitize_row = tile_movers(BLOCK_QUERIES, D_PAD, PRECISION, VEC, THREADS)
    copy_rows, wait_rows = tile_copier(BLOCK_QUERIES, D_PAD, THREADS) if ASYNC else (None, None)
    rows_by_rows_t, accumulate_product = tile_products(BLOCK_QUERIES, D_PAD, PRECISION)
    store_fragment_row = fragment_row_store(D_PAD, PRECISION, VEC)
    query_flags = lane_flags(Q_TILES)
    sequence, lse_row = sequence_bounds(VARLEN)
    SCORE_MOD = MODS is not None and MODS.has_score
    MASK_MOD = MODS is not None and MODS.has_mask
    MOD_EVERY_TILE = MASK_MOD and not HAS_MASK   # packed sequences: no tile lists, every tile tested (``forward``)
    mod_allows, _, mod_weight = entry_steps(MODS)

    @inlined_device_function
    def fetch_query_scalars(scalars, LSE, D, lse_first, q0, n_q, tid):
        """The streamed queries' lse (log2 units) and D into registers.  Queries past N_q get lse = +inf
        (P = 0) and D = 0: they add nothing."""
        for i in range(SCALAR_ITERS):
            r = tid + i * THREADS
            valid = r < BLOCK_QUERIES and q0 + r < n_q
            scalars[i, 0] = log2_lse(LSE[lse_first + q0 + r]) if valid else float32(math.inf)
            scalars[i, 1] = D[lse_first + q0 + r] if valid else float32(0)

    @inlined_device_function
    def commit_query_scalars(smem, stage, scalars, tid):
        for i in range(SCALAR_ITERS):
            r = tid + i * THREADS
            if r < BLOCK_QUERIES:
                store_word(smem, LSE2 + stage + r, f32_as_u32(scalars[i, 0]))
                store_word(smem, D_I + stage + r, f32_as_u32(scalars[i, 1]))

    @inlined_device_function
    def start_query_tile(smem, stage, scalars, Q, dO, LSE, D, q_row, do_row, q_sn, do_sn, lse_first, q0, n_q,
                         head_dim, tid):
        """(cp.async only) Q_i and dO_i (row-major) on their way into buffer ``stage``, lse and D into registers."""
        copy_rows(smem, Q_HI + stage, Q, q_row, q_sn, n_q - q0, head_dim, tid)
        copy_rows(smem, DO_HI + stage, dO, do_row, do_sn, n_q - q0, head_dim, tid)
        fetch_query_scalars(scalars, LSE, D, lse_first, q0, n_q, tid)

    @inlined_device_function
    def land_query_tile(smem, stage, rows, scalars, Q, dO, LSE, D, q_row, do_row, q_sn, do_sn, lse_first, q0, n_q,
                        head_dim, tid):
        """This thread's part of Q_i, dO_i, their log2 lse and D in buffer ``stage``: the copies waited for, or
        loaded and stored through registers (no pipeline: the loads' latency is exposed)."""
        if ASYNC:
            wait_rows()
        else:
            fetch_rows(rows, Q, q_row, q_sn, n_q - q0, head_dim, tid)
            commit_rows(smem, rows, Q_HI, Q_LO, tid)
            fetch_rows(rows, dO, do_row, do_sn, n_q - q0, head_dim, tid)
            commit_rows(smem, rows, DO_HI, DO_LO, tid)
            fetch_query_scalars(scalars, LSE, D, lse_first, q0, n_q, tid)
        commit_query_scalars(smem, stage, scalars, tid)

    @inlined_device_function
    def sanitize_queries(smem, stage, tid):
        """NaN in Q_i, dO_i to 0, a flag per query at Q_NAN (partly masked tiles only: see common.py)."""
        for i in range(NAN_PASSES):
            query = tid + i * THREADS
            if query < BLOCK_QUERIES:
                store_word(smem, Q_NAN + query, sanitize_row(smem, Q_HI + stage, query)
                           | sanitize_row(smem, DO_HI + stage, query))

    @inlined_device_function
    def gradient_terms(st, dpt, masked, q_nan, c_log2, k0, key0, q0, t, n_q, n_k, causal_offset, partly_masked, M,
                       bh, mask_rows, mask_cols, mask_t_r, mask_t_c, keep_threshold, keep_scale, seed0, seed1, smem,
                       stage, mod_args):
        """st: S^T -> (P o Z)^T, dpt: dP^T -> dS^T = P^T o (dP^T o Z - D), 0 where the query may not see the key;
        NaN where it may and its Q or dO row held one (q_nan: the lane's query flags, ``lane_flags``).
        MODS: the mask_mod joins ``allowed``; with a score_mod P = exp2(score_mod(scale S) log2(e) - lse) and
        dS is multiplied by d score_mod / d score (``mod_steps.entry_steps``; masked is then always True, so that
        the mods see only entries inside the sequences)."""
        for half in range(2):
            key = key0 + 8 * half
            for mt in range(Q_TILES):
                for e in range(2):
                    r = mt * 8 + 2 * t + e
                    q = q0 + r
                    slope = float32(1)   # (a score_mod's P and slope come with ``allowed`` below)
                    p = (float32(0) if SCORE_MOD
                         else exp2(st[mt, 2 * half + e] * c_log2 - u32_as_f32(load_word(smem, LSE2 + stage + r))))
                    dp = dpt[mt, 2 * half + e]
                    visible = True
                    if masked:
                        visible = allowed(q, key, n_q, n_k, CAUSAL, causal_offset,
                                          partly_masked if HAS_MASK and READS_LAYOUT else False, M, bh, mask_rows,
                                          mask_cols, mask_t_r, mask_t_c)
                        if MASK_MOD and partly_masked:   # (full tiles skip the test: ``sparsity/mod_tiles.py``)
                            visible = mod_allows(visible, inside(q, n_q), inside(key, n_k), mod_args)
                        if SCORE_MOD:
                            lse2 = u32_as_f32(load_word(smem, LSE2 + stage + r))
                            p, slope = mod_weight(st[mt, 2 * half + e], lse2, visible, inside(q, n_q),
                                                  inside(key, n_k), mod_args)
                        if not visible:
                            p = float32(0)
                        elif (q_nan >> uint64(2 * mt + e)) & uint64(1):
                            p = float32(math.nan)
                    # A lane's queries and keys both vary: one generator call per entry.
                    z = (dropout_weight(bh, q, key, keep_threshold, keep_scale, seed0, seed1) if HAS_DROPOUT
                         else float32(1))
                    st[mt, 2 * half + e] = p * z
                    ds = p * (dp * z - u32_as_f32(load_word(smem, D_I + stage + r)))
                    if SCORE_MOD:
                        ds *= slope
                    dpt[mt, 2 * half + e] = ds if visible else float32(0)

    def kernel(Q, K, V, dO, LSE, D, dK, dV, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, do_sb, do_sh,
               do_sn, dk_sb, dk_sh, dk_sn, dv_sb, dv_sh, dv_sn, heads, group, n_q, n_k, head_dim, k_tiles,
               q_tiles, causal_offset, scale, scale_log2, tile_offsets, tile_entries, M, mask_rows, mask_cols,
               mask_t_r, mask_t_c, q_bounds, q_step, k_bounds, k_step, bottom_right, lse_sb, lse_sh,
               keep_threshold, keep_scale, seed0, seed1, MOD0, MOD1, MOD2, MOD3):
        # Operands as in the forward; heads: query heads, heads // group key/value heads.  MOD0..MOD3: the mods'
        # arrays (``mod_steps``).  HAS_MASK: the query
        # tiles of key tile kt of query head bh are listed at tile_offsets[bh (k_tiles + 1) + kt].
        # Causal: key tile 0 is seen by the most queries, and every head's tile 0 starts first (``tile_coordinates``).
        k_tile, hk, b, _ = tile_coordinates(cuda.blockIdx.x, k_tiles, heads // group, CAUSAL)
        lse_rows = n_q                           # of lse and D per (batch, head), or per head when VARLEN
        q_first, k_first, n_q, n_k, causal_offset = sequence(b, q_bounds, q_step, k_bounds, k_step, n_q, n_k,
                                                             causal_offset, bottom_right, 0)
        k0 = k_tile * BLOCK_KEYS
        if VARLEN and k0 >= n_k:  # the grid covers the longest sequence; the whole block leaves together
            return
        tid = cuda.threadIdx.x
        warp, g, t = warp_lane(tid)
        key0 = k0 + warp * ROWS_PER_WARP + g    # this lane's keys: key0 and key0 + 8
        c_log2 = float32(scale_log2)
        smem = cuda.shared.array(0, uint32)

        # K_j and V_j once: they stay for the whole loop.
        own = cuda.local.array((OWN_ITERS, 4), WORD)
        fetch_own(own, K, b * k_sb + hk * k_sh + (k_first + k0) * k_sn, k_sn, n_k - k0, head_dim, tid)
        commit_own(smem, own, K_HI, K_LO, tid)
        fetch_own(own, V, b * v_sb + hk * v_sh + (k_first + k0) * v_sn, v_sn, n_k - k0, head_dim, tid)
        commit_own(smem, own, V_HI, V_LO, tid)

        dk_acc = cuda.local.array((D_TILES, 4), float32)
        dv_acc = cuda.local.array((D_TILES, 4), float32)
        st = cuda.local.array((Q_TILES, 4), float32)    # S^T, then (P o Z)^T
        dpt = cuda.local.array((Q_TILES, 4), float32)   # dP^T, then dS^T
        rows = cuda.local.array((ROW_ITERS, 4), WORD)
        scalars = cuda.local.array((SCALAR_ITERS, 2), float32)   # lse (log2 units) and D of the next queries
        _zero(dk_acc)
        _zero(dv_acc)

        for h in range(hk * group, hk * group + group):  # the query heads that read this key/value head
            bh = b * heads + h
            mod_args = (b, h, float32(scale), MOD0, MOD1, MOD2, MOD3)
            if HAS_MASK:
                first = tile_offsets[bh * (k_tiles + 1) + k_tile]
                n_visits = tile_offsets[bh * (k_tiles + 1) + k_tile + 1] - first
            else:
                # causal: only query tiles whose last query reaches this tile's first key.
                first = max(0, k0 - causal_offset) // BLOCK_QUERIES if CAUSAL else 0
                n_visits = max(0, ceil_div(n_q, BLOCK_QUERIES) - first)
            q_row = b * q_sb + h * q_sh + q_first * q_sn      # row 0 of this head's Q (and dO, lse below)
            do_row = b * do_sb + h * do_sh + q_first * do_sn
            lse_first = lse_row(bh, b, h, q_first, lse_rows, lse_sb, lse_sh)
            if ASYNC and n_visits > 0:
                q0 = listed_tile(tile_entries, first, BLOCK_QUERIES)[0] if HAS_MASK else first * BLOCK_QUERIES
                cuda.syncthreads()  # every warp is done with the previous head's last tile (it may be in buffer 0)
                start_query_tile(smem, 0, scalars, Q, dO, LSE, D, q_row + q0 * q_sn, do_row + q0 * do_sn, q_sn,
                                 do_sn, lse_first, q0, n_q, head_dim, tid)
            for j in range(n_visits):
                if HAS_MASK:
                    q0, partly_masked = listed_tile(tile_entries, first + j, BLOCK_QUERIES)
                else:
                    q0, partly_masked = (first + j) * BLOCK_QUERIES, MOD_EVERY_TILE
                stage = (j % 2) * QS_STAGE        # the word offset of tile j's buffer
                if not ASYNC:
                    cuda.syncthreads()  # every warp is done with the previous Q_i, dO_i, which this one overwrites
                land_query_tile(smem, stage, rows, scalars, Q, dO, LSE, D, q_row + q0 * q_sn, do_row + q0 * do_sn,
                                q_sn, do_sn, lse_first, q0, n_q, head_dim, tid)
                # Q_i, dO_i, lse and D (and K_j, V_j) complete; with cp.async, every warp done with tile j - 1.
                cuda.syncthreads()
                if ASYNC and j + 1 < n_visits:
                    q1 = listed_tile(tile_entries, first + j + 1, BLOCK_QUERIES)[0] if HAS_MASK else q0 + BLOCK_QUERIES
                    start_query_tile(smem, QS_STAGE - stage, scalars, Q, dO, LSE, D, q_row + q1 * q_sn,
                                     do_row + q1 * do_sn, q_sn, do_sn, lse_first, q1, n_q, head_dim, tid)
                mixed = partly_masked or (CAUSAL and k0 + BLOCK_KEYS - 1 > q0 + causal_offset)
                if mixed:  # the same for every thread of the block, so all reach the barriers
                    sanitize_queries(smem, stage, tid)
                    cuda.syncthreads()  # sanitized tiles and flags before any warp reads them

                # S^T = K_j Q_i^T and dP^T = V_j dO_i^T for this warp's 16 keys.
                rows_by_rows_t(st, smem, K_HI, K_LO, Q_HI + stage, Q_LO + stage, warp * ROWS_PER_WARP, g, t)
                rows_by_rows_t(dpt, smem, V_HI, V_LO, DO_HI + stage, DO_LO + stage, warp * ROWS_PER_WARP, g, t)
                # Keys past N_k need no mask (their rows of dK, dV are never written); queries past N_q
                # have P = 0 (lse = +inf) and D = 0.
                q_nan = query_flags(smem, Q_NAN, t) if mixed else uint64(0)
                gradient_terms(st, dpt, mixed or SCORE_MOD, q_nan, c_log2, k0, key0, q0, t, n_q, n_k, causal_offset,
                               partly_masked, M, bh, mask_rows, mask_cols, mask_t_r, mask_t_c, keep_threshold,
                               keep_scale, seed0, seed1, smem, stage, mod_args)
                # dV_j += (P o Z)^T dO_i and dK_j += dS^T Q_i, from the registers.
                accumulate_product(dv_acc, (float32(1), float32(1)), st, smem, DO_HI + stage, DO_LO + stage, g, t)
                accumulate_product(dk_acc, (float32(1), float32(1)), dpt, smem, Q_HI + stage, Q_LO + stage, g, t)

        for half in range(2):
            key = key0 + 8 * half
            if key < n_k:
                at = k_first + key
                store_fragment_row(dK, dk_acc, half, b * dk_sb + hk * dk_sh + at * dk_sn, head_dim, float32(scale), t)
                store_fragment_row(dV, dv_acc, half, b * dv_sb + hk * dv_sh + at * dv_sn, head_dim, float32(1), t)

    data = ((np.uint32 if VEC else np.uint16) if SIXTEEN else np.float32)
    return Kernel(kernel, kernel_name("flash2_backward_dkdv", (BLOCK_KEYS, BLOCK_QUERIES), D_PAD, PRECISION, VEC,
                                      CAUSAL, HAS_MASK, HAS_DROPOUT, VARLEN)
                  + mods_suffix(MODS),
                  arrays=dict(Q=data, K=data, V=data, dO=data, LSE=np.float32, D=np.float32, dK=data, dV=data,
                              tile_offsets=np.int32, tile_entries=np.int32, M=np.uint8, q_bounds=np.int32,
                              k_bounds=np.int32, **slot_arrays(MODS)),
                  floats=("scale", "scale_log2", "keep_scale"))


@lru_cache(maxsize=None)
def dq_layout(table_reach=None, threads=0):
    """The dQ kernel's shared memory as ``flash2_dq_smem``'s signature takes it: its tiles, then, where it sums a
    relative-bias table's gradient of reach ``table_reach`` (``bias_table.py``), that step's words."""
    if table_reach is None:
        return flash2_dq_smem

    def layout(block_queries, block_keys, d_pad, precision, stages=1):
        words = table_words(table_reach, threads, block_queries, block_keys)
        tiles = flash2_dq_smem(block_queries, block_keys, d_pad, precision, stages)
        return SharedTiles(tiles.tiles + (("TABLE", -(-words // 4) * 4),))

    return layout


def table_fused(call, reach):
    """Whether this backward's dQ kernel can sum the gradient of a relative-bias table of reach D = ``reach``
    (``bias_table.py``): no packed sequences, a table of at most 2 FUSED_REACH + 1 bins, and the kernel's tiles with
    the step's words (one stage of K_j, V_j at least) within the device's shared memory."""
    if call.varlen is not None or not 0 <= reach <= FUSED_REACH:
        return False
    own, streamed = call.block_sizes
    layout = dq_layout(reach, flash2_threads(own))
    d_pad = padded_head_dim(call.head_dim, call.precision)
    return layout(own, streamed, d_pad, call.precision).bytes <= device_limits().shared_bytes_per_block_optin


@lru_cache(maxsize=None)
def make_dq(BLOCK_QUERIES, BLOCK_KEYS, D_PAD, PRECISION, VEC, CAUSAL, HAS_MASK, HAS_DROPOUT, VARLEN=False,
            MODS=None, READS_LAYOUT=True, TABLE_REACH=None):
    """dQ: one thread block per (query tile of BLOCK_QUERIES, batch, head); see the module docstring.
    MODS, READS_LAYOUT: as ``make_dkdv``'s.  TABLE_REACH = D (MODS a lone ``relative_position_bias`` of a
    (H, 2 D + 1) table, no dropout, no packed sequences): dS also summed into the table's bins (``bias_table.py``),
    written to TABLE_SUMS (a row of 2 D + 1 per block)."""
    assert TABLE_REACH is None or (MODS is not None and not VARLEN and not HAS_DROPOUT), "a table: see table_fused"
    SIXTEEN = PRECISION != "tf32x3"
    THREADS = flash2_threads(BLOCK_QUERIES)
    WORD = uint32 if SIXTEEN else float32
    layout = dq_layout(TABLE_REACH, THREADS)
    STAGES = flash2_stages(layout, BLOCK_QUERIES, BLOCK_KEYS, D_PAD, precision=PRECISION, vec=VEC)
    ASYNC = STAGES == 2                          # K_j, V_j by cp.async into the other buffer
    tiles = layout(BLOCK_QUERIES, BLOCK_KEYS, D_PAD, PRECISION, STAGES)
    TABLE = TABLE_REACH is not None
    if TABLE:
        zero_bins, stash_gradients, add_diagonals, write_bins = table_steps(TABLE_REACH, THREADS, BLOCK_QUERIES,
                                                                            BLOCK_KEYS, True)
        TABLE_AT, TABLE_BINS = tiles.offset("TABLE"), 2 * TABLE_REACH + 1
    Q_HI, Q_LO = _tile_offsets(tiles, "Q", SIXTEEN)
    DO_HI, DO_LO = _tile_offsets(tiles, "DO", SIXTEEN)
    K_HI, K_LO = _tile_offsets(tiles, "K", SIXTEEN)
    V_HI, V_LO = _tile_offsets(tiles, "V", SIXTEEN)
    K_NAN = tiles.offset("K_NAN")
    KV_STAGE = tiles.offset("K_STAGE1") - K_HI if ASYNC else 0   # words from buffer 0 to buffer 1
    NAN_PASSES = cdiv(BLOCK_KEYS, THREADS)       # streamed keys per thread in the NaN pass
    K_TILES = BLOCK_KEYS // 8
    D_TILES = D_PAD // 8
    OWN_ITERS, fetch_own, commit_own, _ = tile_movers(BLOCK_QUERIES, D_PAD, PRECISION, VEC, THREADS)
    ROW_ITERS, fetch_rows, commit_rows, sanitize_row = tile_movers(BLOCK_KEYS, D_PAD, PRECISION, VEC, THREADS)
    copy_rows, wait_rows = tile_copier(BLOCK_KEYS, D_PAD, THREADS) if ASYNC else (None, None)
    rows_by_rows_t, accumulate_product = tile_products(BLOCK_KEYS, D_PAD, PRECISION)
    store_fragment_row = fragment_row_store(D_PAD, PRECISION, VEC)
    key_flags = lane_flags(K_TILES)
    sequence, lse_row = sequence_bounds(VARLEN)
    SCORE_MOD = MODS is not None and MODS.has_score
    MASK_MOD = MODS is not None and MODS.has_mask
    MOD_EVERY_TILE = MASK_MOD and not HAS_MASK   # packed sequences: no tile lists, every tile tested (``forward``)
    mod_allows, _, mod_weight = entry_steps(MODS)

    @inlined_device_function
    def start_key_tile(smem, stage, K, V, k_row, v_row, k_sn, v_sn, keys, head_dim, tid):
        """(cp.async only) K_j and V_j (row-major) on their way into buffer ``stage``."""
        copy_rows(smem, K_HI + stage, K, k_row, k_sn, keys, head_dim, tid)
        copy_rows(smem, V_HI + stage, V, v_row, v_sn, keys, head_dim, tid)

    @inlined_device_function
    def land_key_tile(smem, stage, rows, K, V, k_row, v_row, k_sn, v_sn, keys, head_dim, tid):
        """This thread's part of K_j and V_j (row-major) in buffer ``stage``: the copies waited for, or
        loaded and stored through registers (no pipeline: the load's latency is exposed)."""
        if ASYNC:
            wait_rows()
        else:
            fetch_rows(rows, K, k_row, k_sn, keys, head_dim, tid)
            commit_rows(smem, rows, K_HI, K_LO, tid)
            fetch_rows(rows, V, v_row, v_sn, keys, head_dim, tid)
            commit_rows(smem, rows, V_HI, V_LO, tid)

    @inlined_device_function
    def sanitize_keys(smem, stage, tid):
        """NaN in K_j to 0 and a flag per key (partly masked tiles only: see common.py).  V_j needs none:
        dP = dO V^T keeps a NaN value in its own column, and dS is 0 where masked."""
        for i in range(NAN_PASSES):
            key = tid + i * THREADS
            if key < BLOCK_KEYS:
                store_word(smem, K_NAN + key, sanitize_row(smem, K_HI + stage, key))

    @inlined_device_function
    def gradient_terms(s, dp, masked, k_nan, c_log2, lse2, d_i, q0, row0, k0, t, n_q, n_k, causal_offset,
                       partly_masked, M, bh, mask_rows, mask_cols, mask_t_r, mask_t_c, keep_threshold, keep_scale,
                       seed0, seed1, mod_args):
        """s: S -> dS = P o (dP o Z - D) with P = exp2(S c - lse), 0 where the query may not see the key; NaN
        where it may and its K row held one (k_nan: the lane's key flags, ``lane_flags``).  MODS: as the dK/dV
        kernel's ``gradient_terms``."""
        for half in range(2):
            row = q0 + row0 + 8 * half
            for nt in range(K_TILES):
                if HAS_DROPOUT:
                    first, second = dropout_words(row, k0 + nt * 8 + 2 * t, bh, seed0, seed1, t)
                for e in range(2):
                    key = k0 + nt * 8 + 2 * t + e
                    slope = float32(1)   # (a score_mod's P and slope come with ``allowed`` below)
                    p = float32(0) if SCORE_MOD else exp2(s[nt, 2 * half + e] * c_log2 - lse2[half])
                    visible = True
                    if masked:
                        visible = allowed(row, key, n_q, n_k, CAUSAL, causal_offset,
                                          partly_masked if HAS_MASK and READS_LAYOUT else False, M, bh, mask_rows,
                                          mask_cols, mask_t_r, mask_t_c)
                        if MASK_MOD and partly_masked:   # (full tiles skip the test: ``sparsity/mod_tiles.py``)
                            visible = mod_allows(visible, inside(row, n_q), inside(key, n_k), mod_args)
                        if SCORE_MOD:
                            p, slope = mod_weight(s[nt, 2 * half + e], lse2[half], visible, inside(row, n_q),
                                                  inside(key, n_k), mod_args)
                        if not visible:
                            p = float32(0)
                        elif (k_nan >> uint64(2 * nt + e)) & uint64(1):
                            p = float32(math.nan)
                    d = dp[nt, 2 * half + e]
                    if HAS_DROPOUT:
                        word = second if e else first
                        d *= float32(keep_scale) if word >= keep_threshold else float32(0)
                    ds = p * (d - d_i[half])
                    if SCORE_MOD:
                        ds *= slope
                    s[nt, 2 * half + e] = ds if visible else float32(0)

    def kernel(Q, K, V, dO, LSE, D, dQ, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, do_sb, do_sh,
               do_sn, dq_sb, dq_sh, dq_sn, heads, group, n_q, n_k, head_dim, q_tiles, causal_offset, scale,
               scale_log2, tile_offsets, tile_entries, M, mask_rows, mask_cols, mask_t_r, mask_t_c, q_bounds, q_step,
               k_bounds, k_step, bottom_right, lse_sb, lse_sh, keep_threshold, keep_scale, seed0, seed1, MOD0, MOD1,
               MOD2, MOD3, TABLE_SUMS):
        # As the dkdv kernel, with the lists per query tile (as the forward's); TABLE_SUMS: the table's sums
        # (TABLE), else a placeholder.
        tile, h, b, bh = tile_coordinates(cuda.blockIdx.x, q_tiles, heads, CAUSAL)
        lse_rows = n_q                           # of lse and D per (batch, head), or per head when VARLEN
        q_first, k_first, n_q, n_k, causal_offset = sequence(b, q_bounds, q_step, k_bounds, k_step, n_q, n_k,
                                                             causal_offset, bottom_right, 0)
        # Causal query tiles further down have more keys to visit: rank 0 is the last one, and every head's
        # rank 0 starts first (``tile_coordinates``).
        q_tile = q_tiles - 1 - tile if CAUSAL else tile
        q0 = q_tile * BLOCK_QUERIES
        if VARLEN and q0 >= n_q:  # the grid covers the longest sequence; the whole block leaves together
            return
        tid = cuda.threadIdx.x
        warp, g, t = warp_lane(tid)
        row0 = warp * ROWS_PER_WARP + g
        k_row = b * k_sb + (h // group) * k_sh + k_first * k_sn
        v_row = b * v_sb + (h // group) * v_sh + k_first * v_sn
        lse_at = lse_row(bh, b, h, q_first, lse_rows, lse_sb, lse_sh)
        c_log2 = float32(scale_log2)
        mod_args = (b, h, float32(scale), MOD0, MOD1, MOD2, MOD3)   # what the mods read (``mod_steps``)
        smem = cuda.shared.array(0, uint32)

        own = cuda.local.array((OWN_ITERS, 4), WORD)
        fetch_own(own, Q, b * q_sb + h * q_sh + (q_first + q0) * q_sn, q_sn, n_q - q0, head_dim, tid)
        commit_own(smem, own, Q_HI, Q_LO, tid)
        fetch_own(own, dO, b * do_sb + h * do_sh + (q_first + q0) * do_sn, do_sn, n_q - q0, head_dim, tid)
        commit_own(smem, own, DO_HI, DO_LO, tid)
        lse2 = cuda.local.array(2, float32)
        d_i = cuda.local.array(2, float32)
        for half in range(2):
            row = q0 + row0 + 8 * half
            lse2[half] = log2_lse(LSE[lse_at + row]) if row < n_q else float32(math.inf)
            d_i[half] = D[lse_at + row] if row < n_q else float32(0)

        dq_acc = cuda.local.array((D_TILES, 4), float32)
        s = cuda.local.array((K_TILES, 4), float32)     # S, then dS
        dp = cuda.local.array((K_TILES, 4), float32)
        rows = cuda.local.array((ROW_ITERS, 4), WORD)
        _zero(dq_acc)

        if HAS_MASK:
            first = tile_offsets[bh * (q_tiles + 1) + q_tile]
            n_tiles = tile_offsets[bh * (q_tiles + 1) + q_tile + 1] - first
        else:
            first = 0
            n_tiles = ceil_div(n_k, BLOCK_KEYS)
            if CAUSAL:  # no key beyond the last row's diagonal
                n_tiles = min(n_tiles, max(0, ceil_div(min(q0 + BLOCK_QUERIES, n_q) + causal_offset, BLOCK_KEYS)))
        if ASYNC and n_tiles > 0:
            k0 = listed_tile(tile_entries, first, BLOCK_KEYS)[0] if HAS_MASK else 0
            start_key_tile(smem, 0, K, V, k_row + k0 * k_sn, v_row + k0 * v_sn, k_sn, v_sn, n_k - k0, head_dim, tid)
        low = high = float32(0)   # (TABLE: this thread's sums of the edge bins)
        if TABLE:
            zero_bins(smem, TABLE_AT, tid)
        for j in range(n_tiles):
            if HAS_MASK:
                k0, partly_masked = listed_tile(tile_entries, first + j, BLOCK_KEYS)
            else:
                k0, partly_masked = j * BLOCK_KEYS, MOD_EVERY_TILE
            stage = (j % 2) * KV_STAGE            # the word offset of tile j's buffer
            if not ASYNC:
                cuda.syncthreads()  # every warp is done with the previous K_j, V_j, which this one overwrites
            land_key_tile(smem, stage, rows, K, V, k_row + k0 * k_sn, v_row + k0 * v_sn, k_sn, v_sn, n_k - k0,
                          head_dim, tid)
            cuda.syncthreads()  # K_j, V_j (and Q_i, dO_i) complete; with cp.async, every warp done with tile j - 1
            if ASYNC and j + 1 < n_tiles:
                k1 = listed_tile(tile_entries, first + j + 1, BLOCK_KEYS)[0] if HAS_MASK else k0 + BLOCK_KEYS
                start_key_tile(smem, KV_STAGE - stage, K, V, k_row + k1 * k_sn, v_row + k1 * v_sn, k_sn, v_sn,
                               n_k - k1, head_dim, tid)
            mixed = (CAUSAL and k0 + BLOCK_KEYS - 1 > q0 + causal_offset) or partly_masked
            if mixed:  # the same for every thread of the block, so all reach the barrier
                sanitize_keys(smem, stage, tid)
                cuda.syncthreads()  # sanitized K_j and its flags before any warp reads them

            # S = Q_i K_j^T and dP = dO_i V_j^T for this warp's 16 queries.
            rows_by_rows_t(s, smem, Q_HI, Q_LO, K_HI + stage, K_LO + stage, warp * ROWS_PER_WARP, g, t)
            rows_by_rows_t(dp, smem, DO_HI, DO_LO, V_HI + stage, V_LO + stage, warp * ROWS_PER_WARP, g, t)
            # Keys past N_k must be masked here (they would add to dQ).
            k_nan = key_flags(smem, K_NAN, t) if mixed else uint64(0)
            gradient_terms(s, dp, mixed or k0 + BLOCK_KEYS > n_k or SCORE_MOD, k_nan, c_log2, lse2, d_i, q0, row0, k0,
                           t, n_q, n_k, causal_offset, partly_masked, M, bh, mask_rows, mask_cols, mask_t_r, mask_t_c,
                           keep_threshold, keep_scale, seed0, seed1, mod_args)
            # dQ_i += dS K_j
            accumulate_product(dq_acc, (float32(1), float32(1)), s, smem, K_HI + stage, K_LO + stage, g, t)
            if TABLE:   # dS along the table's bins; the next tile's first barrier orders its stash after these reads
                stash_gradients(smem, TABLE_AT, s, warp, g, t)
                cuda.syncthreads()   # every lane's dS is in the tile
                low, high = add_diagonals(smem, TABLE_AT, k0 - q0, low, high, tid)

        if TABLE:
            write_bins(smem, TABLE_AT, low, high, TABLE_SUMS, (bh * q_tiles + q_tile) * TABLE_BINS, tid)
        for half in range(2):
            row = q0 + row0 + 8 * half
            if row < n_q:
                store_fragment_row(dQ, dq_acc, half, b * dq_sb + h * dq_sh + (q_first + row) * dq_sn, head_dim,
                                   float32(scale), t)

    data = ((np.uint32 if VEC else np.uint16) if SIXTEEN else np.float32)
    return Kernel(kernel, kernel_name("flash2_backward_dq", (BLOCK_QUERIES, BLOCK_KEYS), D_PAD, PRECISION, VEC, CAUSAL,
                                      HAS_MASK, HAS_DROPOUT, VARLEN)
                  + mods_suffix(MODS) + (f"_table{TABLE_REACH}" if TABLE else ""),
                  arrays=dict(Q=data, K=data, V=data, dO=data, LSE=np.float32, D=np.float32, dQ=data,
                              tile_offsets=np.int32, tile_entries=np.int32, M=np.uint8, q_bounds=np.int32,
                              k_bounds=np.int32, **slot_arrays(MODS), TABLE_SUMS=np.float32),
                  floats=("scale", "scale_log2", "keep_scale"))


def backward_launches(call, o_strides, do_strides, do_aligned, table_reach=None):
    """flash2's backward for a validated ``AttentionCall`` as three ``Launch``es (preprocess, dK/dV, dQ).

    Per call: preprocess takes (O, dO, D); dK/dV (Q, K, V, dO, LSE, D, dK, dV[, q_bounds, k_bounds], seed0, seed1);
    dQ (Q, K, V, dO, LSE, D, dQ[, q_bounds, k_bounds], seed0, seed1), the bounds for per-batch lengths.  D
    is float32 scratch shaped like lse; the results are new C-contiguous arrays of q's, k's and v's shapes.
    ``table_reach`` (``table_fused``): the dQ kernel also sums the relative-bias table's gradient (``bias_table.py``),
    into a float32 array of batch * heads * query tiles * (2 D + 1) words passed after dQ.
    """
    own, streamed = call.block_sizes
    d_pad = padded_head_dim(call.head_dim, call.precision)
    vector = 4 if call.precision == "tf32x3" else 8   # elements of one 16-byte load
    vec = call.vec and do_aligned and all(s % vector == 0 for s in (do_strides.batch, do_strides.head, do_strides.row))
    varlen = call.varlen is not None
    steps = mod_steps(*call.mods, backward=True) if call.mods else None
    flags = (d_pad, call.precision, vec, call.causal, has_tile_lists(call), call.dropout_p > 0, varlen, steps)
    qs, ks, vs = call.strides
    dq_s, dkv_s = call.result_strides("q"), call.result_strides("kv")
    q_shape, kv_shape = call.kernel_shapes
    words = word_extent(call)
    rows = lse_slabs(call) * call.n_q   # of lse and D
    sizes = dict(heads=call.heads, n_q=call.n_q, head_dim=call.head_dim)
    sequences, bounds_extents = sequence_arrays(call)

    operands = dict(q_sb=qs.batch, q_sh=qs.head, q_sn=qs.row, k_sb=ks.batch, k_sh=ks.head, k_sn=ks.row,
                    v_sb=vs.batch, v_sh=vs.head, v_sn=vs.row, do_sb=do_strides.batch, do_sh=do_strides.head,
                    do_sn=do_strides.row, group=call.group, n_k=call.n_k, causal_offset=call.causal_offset,
                    scale=call.scale, scale_log2=call.scale * LOG2_E, **sizes, **dropout_arguments(call),
                    **sequence_arguments(call), **slot_arguments(call.mods))
    extents = dict(Q=words(q_shape, qs), K=words(kv_shape, ks), V=words(kv_shape, vs),
                   dO=words(q_shape, do_strides), LSE=rows, D=rows)
    extents.update(bounds_extents)
    threads = flash2_threads(own)

    k_tiles = cdiv(call.longest_k, own)
    dkdv = make_dkdv(own, streamed, *flags, READS_LAYOUT=reads_layout(partly_masked_tiles(call, (own, streamed),
                                                                                          "dkdv")))
    dkdv_stages = flash2_stages(flash2_dkdv_smem, own, streamed, d_pad, precision=call.precision, vec=vec)
    dkdv_launch = Launch(
        dkdv, k_tiles * call.batch * call.kv_heads, threads,
        flash2_dkdv_smem(own, streamed, d_pad, call.precision, dkdv_stages).bytes,
        dict(operands, dk_sb=dkv_s.batch, dk_sh=dkv_s.head, dk_sn=dkv_s.row, dv_sb=dkv_s.batch, dv_sh=dkv_s.head,
             dv_sn=dkv_s.row, k_tiles=k_tiles, q_tiles=cdiv(call.longest_q, streamed),
             **block_mask_arguments(call, (own, streamed), "dkdv")),
        ("Q", "K", "V", "dO", "LSE", "D", "dK", "dV") + sequences + ("seed0", "seed1"),
        dict(extents, dK=words(kv_shape, dkv_s), dV=words(kv_shape, dkv_s)))

    q_tiles = cdiv(call.longest_q, own)
    dq = make_dq(own, streamed, *flags, READS_LAYOUT=reads_layout(partly_masked_tiles(call, (own, streamed), "dq")),
                 TABLE_REACH=table_reach)
    layout = dq_layout(table_reach, threads)
    dq_stages = flash2_stages(layout, own, streamed, d_pad, precision=call.precision, vec=vec)
    table = table_reach is not None
    dq_launch = Launch(
        dq, q_tiles * call.batch_heads, threads, layout(own, streamed, d_pad, call.precision, dq_stages).bytes,
        dict(operands, dq_sb=dq_s.batch, dq_sh=dq_s.head, dq_sn=dq_s.row, q_tiles=q_tiles,
             **block_mask_arguments(call, (own, streamed), "dq"), **({} if table else
                                                                     dict(TABLE_SUMS=placeholder(np.float32)))),
        ("Q", "K", "V", "dO", "LSE", "D", "dQ") + sequences + (("TABLE_SUMS",) if table else ()) + ("seed0", "seed1"),
        dict(extents, dQ=words(q_shape, dq_s), **(dict(TABLE_SUMS=table_rows(call.batch_heads, q_tiles, table_reach))
                                                  if table else {})))
    return preprocess_launch(call, o_strides, do_strides), dkdv_launch, dq_launch


def preprocess_launch(call, o_strides, do_strides):
    """The backward's first step for a validated call, D = rowsum(dO o O) in float32 (lse-shaped), as a ``Launch``
    taking (O, dO, D) per call.  Every backward's (the wgmma one's too)."""
    row_blocks = cdiv(call.n_q, PREPROCESS_ROWS)   # D is lse-shaped: row blocks of every slab, packed or not
    q_shape = call.kernel_shapes[0]
    return Launch(
        make_preprocess(call.precision), row_blocks * lse_slabs(call), PREPROCESS_WARPS * WARP_SIZE, 0,
        dict(o_sb=o_strides.batch, o_sh=o_strides.head, o_sn=o_strides.row, do_sb=do_strides.batch,
             do_sh=do_strides.head, do_sn=do_strides.row, row_blocks=row_blocks, heads=call.heads, n_q=call.n_q,
             head_dim=call.head_dim),
        ("O", "dO", "D"), dict(O=operand_extent(q_shape, o_strides), dO=operand_extent(q_shape, do_strides),
                               D=lse_slabs(call) * call.n_q))
