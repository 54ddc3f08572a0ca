"""The forward with warps that have roles: a producer warpgroup and two or three consumer warpgroups that take turns on
the tensor cores (FlashAttention-3's "ping-pong"), as far as Numba reaches.

``forward.py``'s blocks are one warpgroup of 64 query rows that copies its own tiles, so every thread spends issue
slots on copies and every tile ends in a block barrier; three blocks a multiprocessor overlap each other's softmax
and products only as the scheduler happens to interleave them, and each reads every K/V tile for 64 rows (the L2
read rate, not the tensor cores, was its limit: 70% of L2's throughput against 56% of the tensor pipe, ncu, H200,
``experiments/tuning/results/ncu_wgmma_ring_d128_h200.txt``).  Here a block of a producer and C = 2 or 3 consumer
warpgroups (384 or 512 threads, ``CONSUMER_COUNTS``) owns 64 C query rows of one head:

* the *producer* (warpgroup 0) copies K_j and V_j (cp.async, 64-key tiles on the 128-byte swizzle) into stage
  j % STAGES once every consumer is done with the tile that was there, waits for them, and announces them on the
  stage's FULL mbarrier (tile j - 1 after issuing tile j with three stages, tile j - 2 with four: ``STAGE_COUNTS``);
  it gives back registers (``roles.role_budgets``: 56 left to it) so that each consumer holds 224 (C = 2) or 152
  (C = 3);
* *consumer* c (warpgroup 1 + c) owns query rows 64 c .. 64 c + 63 of the block (its Q tile, its O, m and l) and
  runs the loop below.  They share every K/V tile, so a tile read from L2 serves 64 C rows.

A consumer's loop, one round per key tile (``consume``)::

    wait FULL[j]                                        (K_j, V_j landed)
    wait for its turn  ........ TURN[c]
    issue S_j = Q K_j^T;  issue O += P_{j-1} V_{j-1}    (wgmma, both in flight)
    pass the turn  ............ TURN[(c + 1) % C]
    wait for S_j; mask; softmax -> P_j, alpha_j         (while O += P_{j-1} V_{j-1} runs)
    wait for P_{j-1} V_{j-1}; release stage j - 1       (EMPTY)
    O = alpha_j O; P_j packed                           (then one more round for P_{n-1} V_{n-1})

The turn (C named barriers of 256 threads, ``roles.py``) orders the consumers' products: consumer c issues its
round's products only after consumer c - 1 has issued its own, so each one's softmax runs while the others' products
keep the tensor cores busy (FlashAttention-3's warp-scheduler barriers; its paper: 570 -> 620-660 TFLOP/s at
d = 128; it takes C = 2 at d = 128 and C = 3, 192-row blocks, at d <= 96, whose products are shorter against the
same softmax).  Inside a consumer, S_j's product overlaps nothing, but P_{j-1} V_{j-1} overlaps the softmax of S_j (its
"intra-warpgroup overlap"), which costs a second set of P registers' lifetime, not a second S array.

NaN in V (a tile the causal diagonal crosses): the tensor cores make 0 x NaN = NaN, so a NaN value row would reach
rows that the mask hides it from.  ``forward.py`` cleans such a tile in a pass after a block barrier; here the
producer does it before it announces the tile: each of its threads tests the chunks it copied (visible to it once
it has waited for them), sets them to 0 and flags their rows in the stage's flag words (an atomic OR: 16 threads
share a row at d = 128), and the consumers make the allowed weights of flagged keys NaN (``forward_steps.poison``),
as the other kernels do.  Only tiles the diagonal crosses pay for it (one named barrier of the producer's 128
threads, ordering the flags' zeroing before the ORs).

Barriers and fences: the mbarriers are initialised by one thread each, made visible to the copy engine
(``fence_barrier_init``) and to the block by the kernel's only block barrier.  The producer's copies are waited for
and fenced for the async proxy (``fence_proxy_async``; the tensor cores read through it) before its FULL arrival;
a consumer's Q tile likewise, before a named barrier of its own warpgroup.  A consumer arrives on EMPTY[s] (each of
its threads) only after the products that read stage s are complete (``wgmma_wait``), so the producer's refill
cannot overwrite a tile the tensor cores still read.  The turns are balanced: the last consumer opens consumer 0's
first turn, each passes the turn after each round, and the last consumer does not pass it after its last, so every
phase of every turn barrier gets its 256 threads and none is left pending at the end.

Scope (``specialized_scope``): float16 and bfloat16, head dims up to 128 (``common.HEAD_DIMS``), dense or causal
(either alignment), grouped heads, strides as the other kernels', packed sequences; no block mask, mods or
dropout (those run on ``forward.py``).  sm_90a (wgmma, setmaxnreg).  ``NUMBA_FLASH_WGMMA_FORWARD=specialized``
selects it (``forward.forward_launch``; ``NUMBA_FLASH_WGMMA_CONSUMERS=3`` its blocks of three consumers,
``NUMBA_FLASH_WGMMA_QUERY=registers`` Q held in registers, ``NUMBA_FLASH_WGMMA_STAGES=4`` four K/V stages).
Measured 0.71-0.93x the speed of ``forward.py``'s kernel with three stages (H100, 2026-12-07,
``experiments/tuning/results/wgmma_forward_kernels_h100.md``): ncu finds the tensor pipe at 45% and the warps stalled
on the producer's cp.async copies (``results/ncu_specialized_forward_d128_h100.txt``), which FlashAttention-3 issues
as bulk tensor copies from one thread.
"""
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32, uint64

from ...runtime.launch import Kernel, inlined_device_function
from ..fast.common import ceil_div, lane_flags, nan_cleaner, pair_has_nan, sequence_bounds, warp_lane
from ..fast.primitives import copy_async_commit, copy_async_wait, copy_async_wait_all, load_vec4
from .bulk import BARRIER_BYTES, barrier_arrive, barrier_init, barrier_wait, fence_barrier_init
from .common import (BLOCK_N, HEAD_DIMS, first_atom_words, k_major_descriptor, mn_major_descriptor, query_tile,
                     tile_bytes, tile_copier)
from .forward_steps import P_WORDS, S_REGISTERS, query_words, tile_steps
from .roles import named_arrive, named_sync, role_budgets
from .wgmma import advanced_device, fence_proxy_async, shared_address, wgmma_wait

WARPGROUP = 128
#: Consumer warpgroups a block may have: two (128 query rows, FlashAttention-3's choice at d = 128) or three (192
#: rows: its choice at d <= 96, where a tile's products are shorter against the same softmax).
CONSUMER_COUNTS = (2, 3)
#: K/V stages a block may have: the producer announces tile j - (STAGES - 2) after it has issued tile j, so the
#: consumers work on one stage while STAGES - 1 are on their way (a consumer frees a stage only once the product of the
#: tile after it is done, hence the 2).  Three (the default: two Q tiles and 3 x (K, V) take 128 KB of shared memory at
#: d = 128, 64 KB at d = 64), or four, whose producer is a tile further ahead (160 KB at d = 128; 176 KB with three
#: consumers): the copies it waits for were issued a tile earlier.  Four is unmeasured on a GPU (2026-12-08).
STAGE_COUNTS = (3, 4)
#: Registers a thread given back by the producer (at 24 its copies' addresses spilled 96 bytes at d = 128, at 40 32;
#: at 56 none): the consumers then hold 224 each with two of them, 152 with three (``roles.role_budgets``; ptxas
#: 13.0, sm_90a, 2026-12-07: no spills at d = 32-128, ``experiments/tuning/results/specialized_forward_ptxas_sm90.md``).
PRODUCER_REGISTERS = 56


def threads(consumers):
    """A block's threads: the producer warpgroup, then the consumers."""
    return (1 + consumers) * WARPGROUP


def rows(consumers):
    """A block's query rows: 64 a consumer."""
    return consumers * BLOCK_N


def specialized_scope(call):
    """Why this kernel cannot run a call that ``forward.py``'s kernel takes (a sentence), or None."""
    if call.head_dim not in HEAD_DIMS:
        return f"the warp-specialised forward takes head dims {HEAD_DIMS}, not {call.head_dim}"
    if call.block_mask is not None or call.mods:
        return "the warp-specialised forward takes no block mask or mods yet"
    return None


def shared_bytes(head_dim, consumers=2, stages=STAGE_COUNTS[0]):
    """The consumers' Q tiles, ``stages`` of K and V, each stage's NaN flags (a word a key), the 2 ``stages``
    mbarriers, and slack to start the tiles on a 1024-byte boundary."""
    return ((consumers + 2 * stages) * tile_bytes(head_dim) + stages * BLOCK_N * 4 + 2 * stages * BARRIER_BYTES
            + 1024)


@lru_cache(maxsize=None)
def make_specialized_forward(D, ELEMENT, CAUSAL, VARLEN=False, CONSUMERS=2, QUERY_IN_REGISTERS=False,
                             STAGES=STAGE_COUNTS[0]):
    """The kernel of the module docstring for head dim D (``common.HEAD_DIMS``), ELEMENT "f16" or "bf16",
    CONSUMERS consumer warpgroups (``CONSUMER_COUNTS``) and STAGES K/V stages (``STAGE_COUNTS``).  Its parameters
    are ``forward.make_wgmma_forward``'s without the block mask's and the mods'.  QUERY_IN_REGISTERS: each consumer
    holds its Q tile as wgmma A fragments, so that S = Q K^T reads only K from shared memory (m64n64k16 from shared
    memory reads 4 KB for 131 kFLOP, about the 128 bytes a cycle shared memory serves at the tensor cores' peak; Q
    from registers halves that)."""
    assert D in HEAD_DIMS and CONSUMERS in CONSUMER_COUNTS and STAGES in STAGE_COUNTS, (D, CONSUMERS, STAGES)
    AHEAD = STAGES - 2   # tiles the producer has issued past the one it announces
    THREADS, ROWS = threads(CONSUMERS), rows(CONSUMERS)
    CONSUMER_THREADS = CONSUMERS * WARPGROUP
    give_registers, take_registers, _ = role_budgets(PRODUCER_REGISTERS, CONSUMERS)
    # Named barriers: TURN_BARRIER + c, consumer c's turn to issue its products (its 128 threads sync, the previous
    # consumer's 128 arrive); Q_BARRIER + c, consumer c's Q tile landed (its own threads); PRODUCER_BARRIER, the
    # producer's threads (a NaN pass's flags zeroed before they are ORed).
    TURN_BARRIER, Q_BARRIER, PRODUCER_BARRIER = 1, 1 + CONSUMERS, 1 + 2 * CONSUMERS
    TURN_THREADS = 2 * WARPGROUP
    LAST = CONSUMERS - 1
    sequence, lse_row = sequence_bounds(VARLEN)
    (LOW_REGISTERS, HIGH_REGISTERS, HIGH_ARRAY, start_rows, issue_scores, mask_outside, online_softmax, poison,
     rescale_and_pack, issue_weighted_values, store_output, load_query, issue_scores_from_registers
     ) = tile_steps(D, ELEMENT, CAUSAL)
    Q_WORDS = query_words(D) if QUERY_IN_REGISTERS else 1
    own_chunk, start_tile, PASSES, PASS_WORDS, GROUPS, GROUP_WORDS = tile_copier(D, WARPGROUP)
    ROWS_PER_PASS = BLOCK_N // PASSES
    TILE_WORDS = tile_bytes(D) // 4
    STAGE_WORDS = 2 * TILE_WORDS                  # a stage: K_j, then V_j
    STAGE_BYTES = 4 * STAGE_WORDS
    cleaned = nan_cleaner(ELEMENT)
    has_nan = pair_has_nan(ELEMENT)
    flags_of_lane = lane_flags(BLOCK_N // 8)
    wait_all_but_newest_tiles = copy_async_wait(2 * AHEAD)   # the producer's newest AHEAD tiles (K, V) stay in flight
    wait_all_products = wgmma_wait(0)
    wait_all_but_one_product = wgmma_wait(1)

    @inlined_device_function
    def crossed(k0, q0, causal_offset):
        """Whether the causal diagonal of the block's rows q0 .. q0 + ROWS - 1 crosses the key tile at k0 (some key
        hidden from some row: a NaN in its V needs the producer's pass)."""
        return CAUSAL and k0 + BLOCK_N - 1 > q0 + causal_offset

    @inlined_device_function
    def clean_own_chunks(smem, v_at, flags_at, tid):
        """The producer thread's chunks of the V tile at word ``v_at`` with their NaN elements set to 0, and the
        rows that held one flagged in ``flags_at`` (an OR: the threads of a row share its word)."""
        at, r, _ = own_chunk(v_at, tid)
        for group in range(GROUPS):
            for i in range(PASSES):
                word = at + group * GROUP_WORDS + i * PASS_WORDS
                a, b, c, d = load_vec4(smem, word)
                if has_nan(a) or has_nan(b) or has_nan(c) or has_nan(d):
                    for x in range(4):
                        smem[word + x] = cleaned(smem[word + x])[0]
                    cuda.atomic.or_(smem, flags_at + r + i * ROWS_PER_PASS, uint32(1))

    @inlined_device_function
    def issue_tile(smem, at, flags_at, K, V, k_first, v_first, k_sn, v_sn, n_k, k0, q0, causal_offset, tid):
        """K and V of the key tile at k0 on their way into the stage at word ``at`` (each its own commit group); on a
        tile the diagonal crosses, the stage's NaN flags (at ``flags_at``) zeroed."""
        start_tile(smem, at, K, k_first + k0 * k_sn, k_sn, n_k - k0, tid)
        copy_async_commit()
        start_tile(smem, at + TILE_WORDS, V, v_first + k0 * v_sn, v_sn, n_k - k0, tid)
        copy_async_commit()
        if crossed(k0, q0, causal_offset) and tid < BLOCK_N:
            smem[flags_at + tid] = uint32(0)

    @inlined_device_function
    def announce_tile(smem, at, flags_at, full, k0, q0, causal_offset, tid):
        """The landed tile in the stage at word ``at`` cleaned of NaN where the diagonal crosses it, fenced for the
        tensor cores, and announced on the stage's FULL mbarrier (at word ``full``)."""
        if crossed(k0, q0, causal_offset):
            named_sync(PRODUCER_BARRIER, WARPGROUP)   # every flag of the tile zeroed, before any OR
            clean_own_chunks(smem, at + TILE_WORDS, flags_at, tid)
        fence_proxy_async()   # the copies (and cleaned chunks) are ordinary writes; the tensor cores' reads are not
        barrier_arrive(smem, full, 1)

    @inlined_device_function
    def next_stage(stage, phase):
        """The stage after ``stage`` and the phase its mbarriers are then in (flipped on each wrap): counted along
        rather than j % STAGES and (j // STAGES) & 1, which on Numba's 64-bit integers cost ~35 instructions a round
        (SASS, ptxas 13.0 sm_90a), a tenth of a consumer's round on a tile without a mask at d = 64."""
        if stage + 1 == STAGES:
            return 0, phase ^ 1
        return stage + 1, phase

    @inlined_device_function
    def produce(smem, kv_at, flags_at, barriers_at, K, V, k_first, v_first, k_sn, v_sn, n_k, q0, causal_offset,
                n_tiles, tid):
        """Tile j into stage j % STAGES once the consumers released it (EMPTY), then tile j - AHEAD, which has landed
        by then, announced (FULL: an arrival of each thread).  Past the last tile, empty commit groups keep the count
        of groups a round the same, so that one wait serves every round."""
        stage, phase = 0, 0   # tile j's stage and that stage's phase
        announced = 0         # tile j - AHEAD's stage
        for j in range(n_tiles + AHEAD):
            if j < n_tiles:
                barrier_wait(smem, barriers_at + 2 * (STAGES + stage), phase ^ 1)   # EMPTY[stage]
                issue_tile(smem, kv_at + stage * STAGE_WORDS, flags_at + stage * BLOCK_N, K, V, k_first, v_first,
                           k_sn, v_sn, n_k, j * BLOCK_N, q0, causal_offset, tid)
            else:
                copy_async_commit()
                copy_async_commit()
            wait_all_but_newest_tiles()   # tile j - AHEAD landed
            if j >= AHEAD:
                announce_tile(smem, kv_at + announced * STAGE_WORDS, flags_at + announced * BLOCK_N,
                              barriers_at + 2 * announced, (j - AHEAD) * BLOCK_N, q0, causal_offset, tid)
                announced = next_stage(announced, 0)[0]
            stage, phase = next_stage(stage, phase)

    @inlined_device_function
    def scores_of_tile(s, q_desc, q_words, k_desc):
        """S_j = Q K_j^T issued, Q from shared memory or (QUERY_IN_REGISTERS) from the lane's fragments."""
        if QUERY_IN_REGISTERS:
            issue_scores_from_registers(s, q_words, k_desc)
        else:
            issue_scores(s, q_desc, k_desc)

    @inlined_device_function
    def softmax_of_tile(s, m_i, l_i, alpha, q_c, k0, n_k, causal_offset, c_log2, warp, g, t):
        """S_j masked where some key is hidden from some row of the consumer's (the causal diagonal, keys past
        N_k), then m, P_j = exp2(c S_j - m), l and alpha."""
        if (CAUSAL and k0 + BLOCK_N - 1 > q_c + causal_offset) or k0 + BLOCK_N > n_k:
            mask_outside(s, q_c, k0, n_k, causal_offset, warp, g, t)
        online_softmax(s, m_i, l_i, alpha, c_log2)

    @inlined_device_function
    def weights_of_tile(smem, acc, alpha, s, p_words, flags_at, stage, q0, q_c, k0, causal_offset, warp, g, t):
        """P_j made NaN where an allowed key's value row held one (the producer's flags, on tiles the diagonal
        crosses), then O = alpha O and P_j packed for the next round's product."""
        if crossed(k0, q0, causal_offset):
            v_nan = flags_of_lane(smem, flags_at + stage * BLOCK_N, t)
            if v_nan != uint64(0):
                poison(s, v_nan, uint32(0), q_c, k0, causal_offset, warp, g, t, False)
        rescale_and_pack(acc, alpha, s, p_words)

    @inlined_device_function
    def release(smem, barriers_at, stage):
        """The consumer done with the tile in ``stage`` (EMPTY[stage]: an arrival of each of its threads)."""
        barrier_arrive(smem, barriers_at + 2 * (STAGES + stage), 1)

    @inlined_device_function
    def consume(smem, acc, m_i, l_i, alpha, s, p_words, q_desc, q_words, k_desc, v_desc, flags_at, barriers_at, q0,
                q_c, n_k, causal_offset, c_log2, n_tiles, c, warp, g, t):
        """Consumer c's rounds (the module docstring's loop) over the block's key tiles: S_0 alone, then S_j with
        P_{j-1} V_{j-1}, then P_{n-1} V_{n-1} alone.

        A round ends with the softmax of S_j, and the wait for P_{j-1} V_{j-1} (with the stage's release and P_j's
        packing, which must follow it) opens the next round: ptxas schedules within a block of straight-line code
        as if ``wgmma_wait`` cost nothing, and with the wait after the softmax in one block it put the wait first,
        so that the softmax ran after the product instead of under it (SASS, ptxas 13.0 sm_90a: all 34 MUFU.EX2 of
        a round after its WARPGROUP.DEPBAR.LE gsb0, 0x0).  The loop's back edge is a boundary it does not move the
        wait across.  The release stays ahead of the wait for tile j: the producer announces tile j only after it
        has issued tile j + 1, into the stage that tile j - 2 frees.

        No branch on j around a product: ptxas keeps the products in flight only where it can see that no
        instruction reads an accumulator they write (else it serialises every wgmma of the kernel, its warning
        C7514); hence the first and last rounds written apart."""
        if n_tiles == 0:
            return
        following = TURN_BARRIER + (c + 1) % CONSUMERS   # the turn goes round the consumers
        if c == LAST:
            named_arrive(TURN_BARRIER, TURN_THREADS)   # consumer 0 takes the first turn
        stage, phase = 0, 0
        barrier_wait(smem, barriers_at, phase)    # FULL[0]
        named_sync(TURN_BARRIER + c, TURN_THREADS)
        scores_of_tile(s, q_desc, q_words, k_desc)
        named_arrive(following, TURN_THREADS)
        wait_all_products()
        softmax_of_tile(s, m_i, l_i, alpha, q_c, 0, n_k, causal_offset, c_log2, warp, g, t)
        before, previous = 0, stage   # the stages of tiles j - 2 and j - 1
        stage, phase = next_stage(stage, phase)
        for j in range(1, n_tiles):
            wait_all_products()   # P_{j-2} V_{j-2}: its stage read, O and P_{j-1}'s registers free
            if j > 1:
                release(smem, barriers_at, before)
            barrier_wait(smem, barriers_at + 2 * stage, phase)   # FULL: tile j landed
            weights_of_tile(smem, acc, alpha, s, p_words, flags_at, previous, q0, q_c, (j - 1) * BLOCK_N,
                            causal_offset, warp, g, t)
            named_sync(TURN_BARRIER + c, TURN_THREADS)
            scores_of_tile(s, q_desc, q_words, advanced_device(k_desc, stage * STAGE_BYTES))
            issue_weighted_values(acc, p_words, advanced_device(v_desc, previous * STAGE_BYTES))
            named_arrive(following, TURN_THREADS)
            wait_all_but_one_product()   # S_j (P_{j-1} V_{j-1} runs on, under the softmax)
            softmax_of_tile(s, m_i, l_i, alpha, q_c, j * BLOCK_N, n_k, causal_offset, c_log2, warp, g, t)
            before, previous = previous, stage
            stage, phase = next_stage(stage, phase)
        wait_all_products()
        if n_tiles > 1:
            release(smem, barriers_at, before)
        weights_of_tile(smem, acc, alpha, s, p_words, flags_at, previous, q0, q_c, (n_tiles - 1) * BLOCK_N,
                        causal_offset, warp, g, t)
        named_sync(TURN_BARRIER + c, TURN_THREADS)
        issue_weighted_values(acc, p_words, advanced_device(v_desc, previous * STAGE_BYTES))
        if c != LAST:   # (the last consumer's last turn passes nothing: no phase is left waiting)
            named_arrive(following, TURN_THREADS)
        wait_all_products()

    def kernel(Q, K, V, O, LSE, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn, heads, group,
               n_q, n_k, q_tiles, causal_offset, scale_log2, q_bounds, q_step, k_bounds, k_step, bottom_right,
               new_keys, lse_sb, lse_sh):
        # Operands as ``forward.make_wgmma_forward``'s; the block's 128 query rows start at q0.
        q0, h, b, bh = query_tile(cuda.blockIdx.x, q_tiles, heads, CAUSAL, ROWS)
        lse_rows = n_q
        first_query, first_key, n_q, n_k, causal_offset = sequence(b, q_bounds, q_step, k_bounds, k_step, n_q, n_k,
                                                                   causal_offset, bottom_right, new_keys)
        if VARLEN and q0 >= n_q:   # the grid covers the longest sequence; the whole block leaves, before any barrier
            return
        n_tiles = ceil_div(n_k, BLOCK_N)
        if CAUSAL:   # no key beyond the last row's diagonal
            n_tiles = min(n_tiles, max(0, ceil_div(min(q0 + ROWS, n_q) + causal_offset, BLOCK_N)))
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(0, uint32)
        base = shared_address(smem)
        pad = first_atom_words(base)
        # Consumer c's Q at q_at + c TILE_WORDS; stage s's K at kv_at + s STAGE_WORDS, its V a tile on; then each
        # stage's flags (a word a key), and the mbarriers FULL[0 .. STAGES - 1], EMPTY[0 .. STAGES - 1].
        q_at = pad
        kv_at = q_at + CONSUMERS * TILE_WORDS
        flags_at = kv_at + STAGES * STAGE_WORDS
        barriers_at = flags_at + STAGES * BLOCK_N
        if tid < STAGES:
            barrier_init(smem, barriers_at + 2 * tid, WARPGROUP)                     # FULL: the producer's threads
            barrier_init(smem, barriers_at + 2 * (STAGES + tid), CONSUMER_THREADS)   # EMPTY: the consumers'
            fence_barrier_init()
        cuda.syncthreads()   # the barriers' initialisation, before anyone arrives or waits (the only block barrier)

        if tid < WARPGROUP:
            give_registers()
            h_kv = h // group
            produce(smem, kv_at, flags_at, barriers_at, K, V, b * k_sb + h_kv * k_sh + first_key * k_sn,
                    b * v_sb + h_kv * v_sh + first_key * v_sn, k_sn, v_sn, n_k, q0, causal_offset, n_tiles, tid)
            return

        take_registers()
        c = tid // WARPGROUP - 1
        wtid = tid % WARPGROUP
        warp, g, t = warp_lane(wtid)
        q_c = q0 + c * BLOCK_N   # this consumer's first row
        if n_tiles > 0:
            start_tile(smem, q_at + c * TILE_WORDS, Q, b * q_sb + h * q_sh + (first_query + q_c) * q_sn, q_sn,
                       n_q - q_c, wtid)
            copy_async_commit()
            copy_async_wait_all()
            fence_proxy_async()
            named_sync(Q_BARRIER + c, WARPGROUP)   # every thread's part of Q there, for the tensor cores
        q_desc = k_major_descriptor(base + (q_at + c * TILE_WORDS) * 4)
        k_desc = k_major_descriptor(base + kv_at * 4)
        v_desc = mn_major_descriptor(base + (kv_at + TILE_WORDS) * 4)

        m_i = cuda.local.array(2, float32)   # this lane's rows g and g + 8 (of 16 warp)
        l_i = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        s = cuda.local.array(S_REGISTERS, float32)
        acc = (cuda.local.array(LOW_REGISTERS, float32), cuda.local.array(HIGH_ARRAY, float32))
        p_words = cuda.local.array(P_WORDS, uint32)
        q_words = cuda.local.array(Q_WORDS, uint32)
        if QUERY_IN_REGISTERS and n_tiles > 0:
            load_query(smem, q_at + c * TILE_WORDS, q_words, warp, g, t)
        start_rows(m_i, l_i, acc)
        consume(smem, acc, m_i, l_i, alpha, s, p_words, q_desc, q_words, k_desc, v_desc, flags_at, barriers_at, q0,
                q_c, n_k, causal_offset, float32(scale_log2), n_tiles, c, warp, g, t)
        store_output(O, LSE, acc, m_i, l_i, q_c, n_q, b * o_sb + h * o_sh + first_query * o_sn, o_sn,
                     lse_row(bh, b, h, first_query, lse_rows, lse_sb, lse_sh), warp, g, t)

    return Kernel(kernel, f"wgmma_forward_specialized_d{D}_{ELEMENT}" + ("_causal" if CAUSAL else "")
                  + ("_varlen" if VARLEN else "") + ("" if CONSUMERS == 2 else f"_consumers{CONSUMERS}")
                  + ("_query_in_registers" if QUERY_IN_REGISTERS else "")
                  + ("" if STAGES == STAGE_COUNTS[0] else f"_stages{STAGES}"),
                  arrays=dict(Q=np.uint32, K=np.uint32, V=np.uint32, O=np.uint32, LSE=np.float32, q_bounds=np.int32,
                              k_bounds=np.int32),
                  floats=("scale_log2",), launch_bounds=(THREADS, 1))


__all__ = ["CONSUMER_COUNTS", "STAGE_COUNTS", "make_specialized_forward", "rows", "shared_bytes", "specialized_scope",
           "threads"]
