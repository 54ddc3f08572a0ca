"""dK, dV and dQ's sums in one kernel whose warps have roles: FlashAttention-3's backward, as far as Numba reaches.

The wgmma backward's "bulk-" ways of summing dQ (``dq_sums.DQ_MODES``) run this kernel.  A block of three warpgroups
(384 threads) per (tile of 128 keys, batch, key/value head):

* two *consumer* warpgroups, each on 64 of the keys (its K_j and V_j in shared memory, dK and dV in its registers),
  run the five products of every step as the one-warpgroup dK/dV kernel does (``backward.py``'s docstring), and
  between them warpgroup c computes dQ_i's columns c d/2 .. (c + 1) d/2 - 1 over all 128 keys from both warpgroups'
  dS^T (``dq_sums.bulk_dq_steps``), writing them to a float32 buffer of its own;
* a *producer* warpgroup: its first two warps copy each step's Q_i, dO_i (cp.async), lse and D into one of two
  stages; its other two, the *writers*, one per consumer, hand each filled dQ buffer to the copy engine, which adds
  it to DQ_SUM in L2 (``bulk.bulk_reduce_add``), in a fixed order of the key tiles (ORDERED: a counter per query
  tile and half) or as it comes.  It gives back its registers (``roles.register_budget``) so that the consumers can
  hold 240 each.

So no consumer ever issues a copy's address arithmetic or waits for an add's turn: a consumer waits only when the
data it needs is not there yet.  The hand-overs, each on its own barrier::

    producer (warps 0-1)                       consumers (warpgroups 1, 2)                   writer c (warp 2 + c)
    wait EMPTY[s]                              wait FULL[s]
    Q_i, dO_i, lse, D -> stage s               S^T, dP^T, P^T, dV += P^T dO_i, dS^T
    (cp.async, waited for, fenced)             dS^T -> shared (two buffers)  .. CONSUMERS (256) ..
    arrive FULL[s]                             dQ half = dS K over 128 keys, dK += dS^T Q_i
                                               wait DQ_EMPTY[c] .. dQ half -> buffer c ..     wait DQ_FULL[c]
                                               arrive DQ_FULL[c]                              (turn) bulk add
                                               products done: arrive EMPTY[s]                 read: arrive DQ_EMPTY[c]

FULL and EMPTY are mbarriers (``bulk.py``: a phase per use of a stage, waited for by parity), CONSUMERS, DQ_FULL and
DQ_EMPTY named barriers (``roles.py``).  The dS^T tiles have two buffers, by step parity: a warpgroup writes step
s + 1's only after CONSUMERS of step s, which the other passes only after its products of step s - 1 (the last to
read that buffer) are done.  Each fence and barrier is at its hand-over: the producer's copies are waited for and
fenced for the tensor cores (``fence_proxy_async``) before its arrival; a consumer fences its dS^T and dQ stores
before the barriers that publish them to the tensor cores and the copy engine.

Ordered (deterministic): a counter per query tile and half says whose turn it is; a writer waits for its turn while
its consumer goes on with the next step (it stops only if the buffer is still full when it needs it again), and
passes the turn on once its adds are done (a few microseconds: the add's round trip in L2, a fence, the counter).

* Causal: as the one-warpgroup "ordered" mode, the turns go from the diagonal down, the grid dispatching the
  shortest key tiles first; key tile j + 1 reaches query tile i two steps before key tile j, so the turns follow
  the work.
* Dense: were every key tile to walk the query tiles from 0, key tile j would reach query tile i when key tile
  j - 1 does, and wait for it: each block a hand-over behind the one before, a lag that grows along the head's key
  tiles in every wave ("bulk-ordered" took 1.46-1.89x "bulk-atomic"'s time so, H100, 2026-12-07).  So key tile j
  starts at query tile -r j (mod the query tiles; ``dq_sums.rotated_start``, r = ``rotation_stride``): it reaches
  query tile i r steps after key tile j - 1, which has passed its turn by then, and the turns follow the order in
  which the tiles reach i (``rotated_turn``).  Key tile 0 then waits for the last key tile of its head, dispatched
  after it: the host asks for this only where a head's key tiles (one block each) fit in half the GPU's
  multiprocessors, so that those it waits for are running or will be, with a margin for other streams' kernels
  (``rotates``; the simulator, which runs blocks one after another, never).

Scope: d <= 64 and d = 128 (``dq_sums.splits_dq_columns``), dense or causal (either alignment), grouped heads, packed
sequences (VARLEN), strides as the other kernels'; no block mask or mods (``backward.dq_mode_for`` sends those to
the one-warpgroup kernel).  sm_90a (wgmma, setmaxnreg).
"""
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32

from ...runtime.launch import inlined_device_function
from ..fast.common import ceil_div, sequence_bounds, tile_coordinates, warp_lane
from ..fast.primitives import copy_async_commit, copy_async_wait_all, sync_warp
from .backward_steps import (WARPGROUP, backward_kernel, step_copier, steps, transposed_scores, wait_all_but_one,
                             wait_all_products)
from .bulk import (BARRIER_BYTES, barrier_arrive, barrier_init, barrier_wait, bulk_commit, bulk_reduce_add,
                   bulk_wait_done, bulk_wait_read, fence_barrier_init)
from .common import A_WORDS, BLOCK_N, S_REGISTERS, first_atom_words, k_major_descriptor, mn_major_descriptor, tile_bytes
from .dq_sums import (DS_TILE_BYTES, bulk_dq_steps, contributors, dq_steps, rotated_start, rotated_turn,
                      rotation_stride, splits_dq_columns)
from .roles import named_arrive, named_sync, role_budgets
from .wgmma import advanced_device, fence_proxy_async, shared_address, wgmma_commit, wgmma_fence

CONSUMER_GROUPS = 2                          # consumer warpgroups, each on 64 keys of the block's tile
KEY_ROWS = CONSUMER_GROUPS * BLOCK_N         # keys of a block's tile
THREADS = (1 + CONSUMER_GROUPS) * WARPGROUP  # the producer warpgroup, then the consumers
COPIERS = 64                                 # the producer's first two warps copy the streamed tiles
WRITER_WARP = 2                              # the producer's warps 2 and 3 hand dQ's halves to the copy engine
STAGES = 2                                   # of Q_i, dO_i, lse and D (and of dS^T)
#: Named barriers: both consumer warpgroups; dQ buffer c filled (DQ_FULL_BARRIER + c: its consumer warpgroup and the
#: writer warp c), and emptied (DQ_EMPTY_BARRIER + c).
CONSUMERS_BARRIER, DQ_FULL_BARRIER, DQ_EMPTY_BARRIER = 1, 2, 4
#: Registers a thread: the producer and writers 24, the consumers 240 (the bulk modes' consumer loop without a spill).
give_registers, take_registers, _ = role_budgets(24)
CONSUMER_THREADS, DQ_BUFFER_THREADS = CONSUMER_GROUPS * WARPGROUP, WARPGROUP + 32
assert WRITER_WARP + CONSUMER_GROUPS == WARPGROUP // 32   # a writer warp per consumer, after the copiers

@inlined_device_function
def next_step(h, q_tile, first_q_tile, start_q_tile, own_q_tiles):
    """(query head, query tile) of a block's step after query tile q_tile of head h: each head of the group in turn,
    its query tiles from start_q_tile up to own_q_tiles - 1, then from first_q_tile up to start_q_tile - 1 (counted,
    where a division by the tiles a head has would cost each role a 64-bit division a step)."""
    q_tile += 1
    if q_tile == own_q_tiles:
        q_tile = first_q_tile
    if q_tile == start_q_tile:
        h += 1
    return h, q_tile


def shared_bytes(head_dim):
    """Both consumers' K and V tiles, two stages of Q_i and dO_i, two buffers of both consumers' dS^T tiles, their
    float32 dQ halves, two stages of lse and D, the four mbarriers, and slack to start the tiles on a 1024-byte
    boundary."""
    return ((2 * CONSUMER_GROUPS + 2 * STAGES) * tile_bytes(head_dim) + STAGES * CONSUMER_GROUPS * DS_TILE_BYTES
            + BLOCK_N * head_dim * 4 + STAGES * 2 * BLOCK_N * 4 + 2 * STAGES * BARRIER_BYTES + 1024)


@lru_cache(maxsize=None)
def make_specialized_dkdv(HEAD_DIM, ELEMENT, CAUSAL, ORDERED, VARLEN=False):
    """The kernel of the module docstring for head dim HEAD_DIM, ELEMENT "f16" or "bf16".  Its parameters are the
    one-warpgroup dK/dV kernel's that it reads (``backward.make_wgmma_dkdv``): DQ_SUM (float32, a (head, query tile)
    slab of 64 x d in register order per half, ``dq_sums.register_order_word``) and TURNS (int32, a counter per
    (head, query tile, half), zeroed) as its "ordered" mode's."""
    assert splits_dq_columns(HEAD_DIM), HEAD_DIM
    sequence, lse_row = sequence_bounds(VARLEN)
    ACC_REGISTERS, TILE_WORDS, start_tile, issue_scores, pack_pairs, issue_weighted, store_rows = steps(HEAD_DIM,
                                                                                                       ELEMENT)
    start_step = step_copier(HEAD_DIM, COPIERS)
    probabilities, score_gradients = transposed_scores(CAUSAL, False)
    stage_ds = dq_steps(HEAD_DIM, ELEMENT)[0]
    issue_dq_half, stage_dq_half, HALF_REGISTERS, HALF_WORDS = bulk_dq_steps(HEAD_DIM, ELEMENT)
    DS_WORDS = DS_TILE_BYTES // 4

    @inlined_device_function
    def produce(smem, q_at, scalars_at, barriers_at, Q, dO, LSE, D, b, h_kv, group, kv_heads, q_sb, q_sh, q_sn,
                do_sb, do_sh, do_sn, first_query, lse_rows, lse_sb, lse_sh, n_q, first_q_tile, start_q_tile,
                own_q_tiles, steps, tid):
        """The copier warps: each step's tiles into stage step % 2 once its consumers are done with it, waited for
        and fenced (the tensor cores read them), then announced on FULL[s] (an arrival of each of the 64 threads)."""
        h, q_tile = h_kv * group, start_q_tile
        for step in range(steps):
            stage = step & 1
            barrier_wait(smem, barriers_at + (STAGES + stage) * 2, ((step >> 1) & 1) ^ 1)   # EMPTY[s]
            start_step(smem, q_at + stage * 2 * TILE_WORDS, scalars_at + stage * 2 * BLOCK_N, Q, dO, LSE, D,
                       b * q_sb + h * q_sh + first_query * q_sn, b * do_sb + h * do_sh + first_query * do_sn, q_sn,
                       do_sn, lse_row(b * kv_heads * group + h, b, h, first_query, lse_rows, lse_sb, lse_sh),
                       q_tile * BLOCK_N, n_q, tid)
            copy_async_commit()
            copy_async_wait_all()
            fence_proxy_async()
            barrier_arrive(smem, barriers_at + stage * 2, 1)   # FULL[s]
            h, q_tile = next_step(h, q_tile, first_q_tile, start_q_tile, own_q_tiles)

    @inlined_device_function
    def write_dq(smem, dq_at, DQ_SUM, TURNS, b, h_kv, group, kv_heads, q_tiles, tile, own_k_tiles, own_q_tiles,
                 causal_offset, first_q_tile, start_q_tile, rotation, steps, c, lane):
        """Writer warp c: each step, consumer c's dQ half, once its buffer is full, added to DQ_SUM by one bulk
        reduction (lane 0; when ORDERED in its turn); the buffer handed back once the engine has read it (not after
        the last step: the consumer never waits again); when ORDERED, the turn passed on once the adds are done and
        visible.  A warp per half, so that the two halves' turns and adds (microseconds each, in L2) overlap."""
        if steps > 0:
            named_arrive(DQ_EMPTY_BARRIER + c, DQ_BUFFER_THREADS)   # the buffer starts empty
        h, q_tile = h_kv * group, start_q_tile
        for step in range(steps):
            slab = (b * kv_heads * group + h) * q_tiles + q_tile
            named_sync(DQ_FULL_BARRIER + c, DQ_BUFFER_THREADS)
            if lane == 0:
                if ORDERED:
                    turn = (contributors(q_tile, own_k_tiles, causal_offset, KEY_ROWS) - 1 - tile if CAUSAL
                            else rotated_turn(q_tile, tile, rotation, own_k_tiles, own_q_tiles))
                    while cuda.atomic.add(TURNS, slab * CONSUMER_GROUPS + c, 0) != turn:
                        pass
                    cuda.threadfence()
                bulk_reduce_add(DQ_SUM, slab * BLOCK_N * HEAD_DIM + c * HALF_WORDS, smem, dq_at + c * HALF_WORDS,
                                HALF_WORDS * 4)
                bulk_commit()
                bulk_wait_read()
            sync_warp()
            if step + 1 < steps:
                named_arrive(DQ_EMPTY_BARRIER + c, DQ_BUFFER_THREADS)
            if ORDERED and lane == 0:   # the adds done and visible before the next in the order starts its own
                bulk_wait_done()
                cuda.threadfence()
                cuda.atomic.add(TURNS, slab * CONSUMER_GROUPS + c, 1)
            h, q_tile = next_step(h, q_tile, first_q_tile, start_q_tile, own_q_tiles)
        if lane == 0:
            bulk_wait_done()   # the last reduction's adds, before the block ends

    def kernel(Q, K, V, dO, LSE, D, dK, dV, DQ_SUM, TURNS, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, do_sb,
               do_sh, do_sn, dk_sb, dk_sh, dk_sn, dv_sb, dv_sh, dv_sn, kv_heads, group, n_q, n_k, k_tiles, q_tiles,
               causal_offset, scale, scale_log2, q_bounds, q_step, k_bounds, k_step, bottom_right, lse_sb, lse_sh,
               rotates):
        # Operands as the one-warpgroup dK/dV kernel's (``backward.make_wgmma_dkdv``); rotates: 1 where every block of
        # a (batch, key/value head) can be resident at once (``backward.rotates``), so that dense ORDERED key tiles may
        # start apart (``rotated_start``: a block may then wait for one dispatched after it).
        rank, h_kv, b, _ = tile_coordinates(cuda.blockIdx.x, k_tiles, kv_heads, CAUSAL)
        # Causal: rank 0 is key tile 0 (longest first), or when the adds are ordered from the diagonal down, the last
        # key tile (shortest first: every block it waits for started before it).
        tile = k_tiles - 1 - rank if CAUSAL and ORDERED else rank
        tid = cuda.threadIdx.x
        tile_k0 = tile * KEY_ROWS
        lse_rows = n_q   # of lse and D per (batch, head), or per head over the packed sequences (VARLEN)
        first_query, first_key, n_q, n_k, causal_offset = sequence(b, q_bounds, q_step, k_bounds, k_step, n_q, n_k,
                                                                   causal_offset, bottom_right, 0)
        if VARLEN and tile_k0 >= n_k:   # the grid covers the longest sequence; the whole block leaves, before any
            return                      # barrier
        own_q_tiles, own_k_tiles = (ceil_div(n_q, BLOCK_N), ceil_div(n_k, KEY_ROWS)) if VARLEN else (q_tiles, k_tiles)
        # Every query tile of every query head of the group that sees the block's first key (causal: from the tile
        # holding row tile_k0 - causal_offset).
        first_q_tile = max(0, tile_k0 - causal_offset) // BLOCK_N if CAUSAL else 0
        per_head = max(0, own_q_tiles - first_q_tile)
        steps = group * per_head
        rotation = 0 if CAUSAL or not ORDERED else rotation_stride(own_q_tiles, own_k_tiles) * rotates
        start_q_tile = rotated_start(tile, rotation, first_q_tile, own_q_tiles)

        smem = cuda.shared.array(0, uint32)
        base = shared_address(smem)
        pad = first_atom_words(base)
        # The consumers' K tiles (one after the other: dQ's halves read both), their V tiles, the stages (stage s:
        # Q_i, dO_i at q_at + s 2 TILE_WORDS), dS^T (buffer s: both consumers' tiles), the dQ halves, lse and D
        # (stage s at scalars_at + s 2 BLOCK_N), the mbarriers FULL[0], FULL[1], EMPTY[0], EMPTY[1].
        q_at = pad + 2 * CONSUMER_GROUPS * TILE_WORDS
        ds_at = q_at + STAGES * 2 * TILE_WORDS
        dq_at = ds_at + STAGES * CONSUMER_GROUPS * DS_WORDS
        scalars_at = dq_at + CONSUMER_GROUPS * HALF_WORDS
        barriers_at = scalars_at + STAGES * 2 * BLOCK_N
        if tid < STAGES:
            barrier_init(smem, barriers_at + tid * 2, COPIERS)                                  # FULL
            barrier_init(smem, barriers_at + (STAGES + tid) * 2, CONSUMER_THREADS)              # EMPTY
            fence_barrier_init()
        cuda.syncthreads()   # the barriers' initialisation, before anyone arrives or waits (the last block barrier)

        if tid < WARPGROUP:   # the producer warpgroup
            give_registers()
            if tid < COPIERS:
                produce(smem, q_at, scalars_at, barriers_at, Q, dO, LSE, D, b, h_kv, group, kv_heads, q_sb, q_sh,
                        q_sn, do_sb, do_sh, do_sn, first_query, lse_rows, lse_sb, lse_sh, n_q, first_q_tile,
                        start_q_tile, own_q_tiles, steps, tid)
            else:
                write_dq(smem, dq_at, DQ_SUM, TURNS, b, h_kv, group, kv_heads, q_tiles, tile, own_k_tiles,
                         own_q_tiles, causal_offset, first_q_tile, start_q_tile, rotation, steps,
                         tid // 32 - WRITER_WARP, tid % 32)
            return

        take_registers()
        c = tid // WARPGROUP - 1   # this consumer's warpgroup, on keys k0 .. k0 + 63
        wtid = tid % WARPGROUP
        k0 = tile_k0 + c * BLOCK_N
        warp, g, t = warp_lane(wtid)
        k_at, v_at = pad + c * TILE_WORDS, pad + (CONSUMER_GROUPS + c) * TILE_WORDS
        # S^T = K Q^T and dP^T = V dO^T read all four K-major; dV += P^T dO and dK += dS^T Q read dO and Q MN-major,
        # dQ's halves both K tiles and both dS^T tiles MN-major.  The stage-0 (buffer-0) descriptors.
        k_desc, v_desc = k_major_descriptor(base + k_at * 4), k_major_descriptor(base + v_at * 4)
        q_desc, do_desc = k_major_descriptor(base + q_at * 4), k_major_descriptor(base + (q_at + TILE_WORDS) * 4)
        qt_desc = mn_major_descriptor(base + q_at * 4)
        dot_desc = mn_major_descriptor(base + (q_at + TILE_WORDS) * 4)
        kt_desc = mn_major_descriptor(base + pad * 4)
        ds_desc = mn_major_descriptor(base + ds_at * 4)

        dk_acc = cuda.local.array(ACC_REGISTERS, float32)
        dv_acc = cuda.local.array(ACC_REGISTERS, float32)
        st = cuda.local.array(S_REGISTERS, float32)
        dpt = cuda.local.array(S_REGISTERS, float32)
        dq_acc = cuda.local.array(HALF_REGISTERS, float32)
        p_words = cuda.local.array(A_WORDS, uint32)    # P^T, packed: the A operand of dV's product
        ds_words = cuda.local.array(A_WORDS, uint32)   # dS^T, packed: dK's
        for i in range(ACC_REGISTERS):
            dk_acc[i] = float32(0)
            dv_acc[i] = float32(0)

        if steps > 0:
            start_tile(smem, k_at, K, b * k_sb + h_kv * k_sh + (first_key + k0) * k_sn, k_sn, n_k - k0, wtid)
            start_tile(smem, v_at, V, b * v_sb + h_kv * v_sh + (first_key + k0) * v_sn, v_sn, n_k - k0, wtid)
            copy_async_commit()
            copy_async_wait_all()
            fence_proxy_async()
            named_sync(CONSUMERS_BARRIER, CONSUMER_THREADS)   # both consumers' K_j, V_j there: dQ's halves read both
        c_log2 = float32(scale_log2)
        h, q_tile = h_kv * group, start_q_tile
        for step in range(steps):
            stage = step & 1
            q0 = q_tile * BLOCK_N
            h, q_tile = next_step(h, q_tile, first_q_tile, start_q_tile, own_q_tiles)   # (the next step's)
            offset = stage * 8 * TILE_WORDS   # bytes of a stage: Q_i, then dO_i
            scalars = scalars_at + stage * 2 * BLOCK_N
            barrier_wait(smem, barriers_at + stage * 2, (step >> 1) & 1)   # FULL[s]: Q_i, dO_i, lse, D landed
            issue_scores(st, k_desc, advanced_device(q_desc, offset), dpt, v_desc, advanced_device(do_desc, offset))
            wait_all_but_one()   # S^T
            masked = (CAUSAL and k0 + BLOCK_N - 1 > q0 + causal_offset) or k0 + BLOCK_N > n_k
            probabilities(st, smem, scalars, k0, q0, n_k, causal_offset, c_log2, masked, uint32(0), warp, g, t)
            pack_pairs(p_words, st)
            wgmma_fence()   # P^T's registers, before the product reads them
            issue_weighted(dv_acc, p_words, advanced_device(dot_desc, offset))
            wgmma_commit()
            wait_all_but_one()   # dP^T
            score_gradients(dpt, st, smem, scalars, warp, g, t)
            pack_pairs(ds_words, dpt)
            # Both consumers' dS^T in buffer s, for the tensor cores; then this consumer's half of dQ_i, then dK.
            stage_ds(smem, ds_at + (stage * CONSUMER_GROUPS + c) * DS_WORDS, ds_words, warp, g, t)
            fence_proxy_async()
            named_sync(CONSUMERS_BARRIER, CONSUMER_THREADS)
            issue_dq_half(dq_acc, advanced_device(ds_desc, stage * CONSUMER_GROUPS * DS_TILE_BYTES), kt_desc, c)
            wgmma_fence()   # dS^T's registers, before the product reads them
            issue_weighted(dk_acc, ds_words, advanced_device(qt_desc, offset))
            wgmma_commit()
            wait_all_but_one()   # dV's and dQ's products (dK's may run on)
            named_sync(DQ_EMPTY_BARRIER + c, DQ_BUFFER_THREADS)   # the writer done with the previous half
            stage_dq_half(smem, dq_at + c * HALF_WORDS, dq_acc, wtid)
            fence_proxy_async()   # ordinary stores, read by the copy engine
            named_arrive(DQ_FULL_BARRIER + c, DQ_BUFFER_THREADS)
            wait_all_products()
            # EMPTY[s]: an arrival of every consumer thread, each after its own last read of the stage (lse and D
            # too).  One arrival a warp after a warp barrier is as correct by PTX's memory model, but racecheck
            # (2026-12-07, H100) then reports the other lanes' reads of lse against the producer's next stores.
            barrier_arrive(smem, barriers_at + (STAGES + stage) * 2, 1)

        store_rows(dK, b * dk_sb + h_kv * dk_sh + (first_key + k0) * dk_sn, dk_sn, dk_acc, n_k - k0, float32(scale),
                   warp, g, t)
        store_rows(dV, b * dv_sb + h_kv * dv_sh + (first_key + k0) * dv_sn, dv_sn, dv_acc, n_k - k0, float32(1), warp,
                   g, t)

    name = (f"wgmma_backward_dkdv_d{HEAD_DIM}_{ELEMENT}" + ("_causal" if CAUSAL else "")
            + ("_dq_bulk_ordered" if ORDERED else "_dq_bulk_atomic") + ("_varlen" if VARLEN else ""))
    return backward_kernel(kernel, name, ("dK", "dV"), dict(DQ_SUM=np.float32, TURNS=np.int32, q_bounds=np.int32,
                                                            k_bounds=np.int32), 1, THREADS)
