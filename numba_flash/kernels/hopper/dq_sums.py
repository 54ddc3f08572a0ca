"""How the wgmma backward's dK/dV kernel sums dQ, where it does (``backward.make_wgmma_dkdv``'s DQ_MODE).

dQ_i is the sum over key tiles of dS_ij K_j.  By default a dQ kernel of its own computes it ("separate",
``backward.make_wgmma_dq``); the other modes have the dK/dV kernel, which holds dS_ij^T for its key tile anyway, add
dS_ij K_j into a float32 sum DQ_SUM (a (head, query tile) slab of 64 x d each) that a last kernel converts
(``backward.make_dq_convert``):

* "ordered" / "atomic": a block of one warpgroup on 64 keys adds dQ_i's columns a slice at a time (``dq_steps``) from
  its registers by reductions in L2 (``red.global.add.v2.f32``), in a fixed order of the key tiles (a counter per
  query tile and head: ``wait_turn``, ``pass_turn``, turns counted by ``contributors``) or as they arrive;
* "bulk-ordered" / "bulk-atomic": two consumer warpgroups on 128 keys (``specialized_dkdv.py``, a block whose warps
  have roles), consumer w computing dQ_i's columns w d / 2 .. (w + 1) d / 2 - 1 over all 128 keys, a writer warp
  adding them from shared memory by one bulk reduction (``bulk_dq_steps``, ``bulk.bulk_reduce_add``):
  FlashAttention-3's data flow, half the adds and none from registers.

Which is the default and what each measured: ``backward.DQ_MODE``, ``docs/performance.md``.
"""
from functools import lru_cache

from numba import cuda

from ...runtime.launch import inlined_device_function
from ..fast.common import lane_entry
from ..fast.primitives import f32_as_u32, reduce_add_pair, store_vec4, store_word
from .common import A_WORDS, BLOCK_N, mn_step_bytes, tile_bytes
from .wgmma import ROW_BYTES, advanced_device, swizzle_128_device, wgmma_commit, wgmma_fence, wgmma_ss

#: Where dQ is summed over the key tiles: in a pass of its own (S and dP computed again, no atomics), or by the
#: dK/dV kernel, each key tile's dS K added into a float32 accumulator in an order fixed by semaphores ("ordered",
#: deterministic) or in whatever order the adds arrive ("atomic"); the "bulk-" modes sum it the same two ways from the
#: dK/dV kernel of ``specialized_dkdv.py``, each consumer warpgroup's half of dQ_i's columns added by one bulk reduction
#: from shared memory (``bulk_dq_steps``; FlashAttention-3's way).
DQ_MODES = ("separate", "ordered", "atomic", "bulk-ordered", "bulk-atomic")
#: The modes whose adds land in whatever order they arrive (``deterministic=False`` only).
UNORDERED_MODES = ("atomic", "bulk-atomic")
DS_TILE_BYTES = tile_bytes(BLOCK_N)   # dS^T (64 keys x 64 query rows, 16-bit), dQ's A operand


def key_warpgroups(dq_mode):
    """Warpgroups of the dK/dV kernel's block in ``dq_mode`` that compute, each on 64 keys of the block's key tile:
    two in the bulk modes (``specialized_dkdv.py``, beside its producer warpgroup), else one."""
    return 2 if dq_mode.startswith("bulk-") else 1


def splits_dq_columns(head_dim):
    """Whether the bulk modes can split dQ_i's columns between their two warpgroups at head dim d: each half (d / 2
    columns) must lie in one 64-column tile of K, which its product's B descriptor names (d <= 64, or d = 128)."""
    return head_dim <= 64 or head_dim == 128


def dq_slice_columns(head_dim):
    """Columns of each slice of dQ_i += dS_ij K_j in the dK/dV kernel (``dq_steps``): 64 at d = 128, the whole
    head dim below.

    A slice is one product whose B (K, read MN-major) starts on one of K's 64-column tiles (the descriptor names
    whole tiles, N how much of them), and slices of one width keep the products one loop: so the whole d, or 64
    where d is a multiple of 64.  A slice's accumulator (half its columns in registers) is live beside dK's and
    dV's (d / 2 each) and the packed P^T and dS^T that the products in flight still read (32): at d = 128 the
    whole slice would make that 224 where the 64-column slices' 192 already reach 255 registers with spills; at
    d = 96 it is 176, against 160 for slices of 64 and 32 columns (two product groups and two waits a step, and
    a second product width).  ptxas 13.0, sm_90a (2026-12-05): at d = 96 the kernels that sum dQ take 243-253
    registers, no spills, and 243-252 with a 64-column slice in place of the 96-column one, so splitting would
    win no registers; d = 112 takes 252-255, its unordered kernels spilling 20-28 bytes (d = 128: 20-68)."""
    return 64 if head_dim == 128 else head_dim


@lru_cache(maxsize=None)
def dq_steps(HEAD_DIM, ELEMENT):
    """The steps by which the dK/dV kernel sums dQ (``DQ_MODES`` "ordered" and "atomic"): (stage_ds, issue_dq_slice,
    add_dq_slice, DQ_SLICES, SLICE_REGISTERS).  dQ_i += dS_ij K_j is computed DQ_SLICE columns at a time
    (``dq_slice_columns``) and each slice is added to the float32 accumulator by reductions in L2
    (``reduce_add_pair``)."""
    DQ_SLICE = dq_slice_columns(HEAD_DIM)
    DQ_SLICES = HEAD_DIM // DQ_SLICE
    SLICE_REGISTERS = DQ_SLICE // 2
    slice_product = wgmma_ss(DQ_SLICE, ELEMENT, True, True)   # dQ slice += dS K: A (dS^T's tile) and B (K) MN-major
    first_slice_product = wgmma_ss(DQ_SLICE, ELEMENT, True, True, fresh=True)

    @inlined_device_function
    def stage_ds(smem, ds_at, ds_words, warp, g, t):
        """dS^T, packed (``pack_pairs``), into its swizzled 64 x 64 tile at word ``ds_at``: rows the keys, the query
        rows along each row, so that the tile is dS as an MN-major A operand.  Word x of ``ds_words`` holds the
        accumulator's registers 2x and 2x + 1: row 16 warp + g + 8 (x % 2), columns 8 (x // 2) + 2t and + 1."""
        for x in range(A_WORDS):
            row, column = 16 * warp + g + 8 * (x % 2), 8 * (x // 2) + 2 * t
            store_word(smem, ds_at + swizzle_128_device(row * ROW_BYTES + 2 * column) // 4, ds_words[x])

    @inlined_device_function
    def issue_dq_slice(dq_acc, ds_desc, kt_desc, part):
        """dq_acc = dS K[:, DQ_SLICE part : DQ_SLICE (part + 1)], four k-steps along the keys (the first
        overwriting), one commit group.  Where there are several slices they are K's 64-column tiles, DS_TILE_BYTES
        (64 x 64 16-bit) apart."""
        wgmma_fence()   # dS^T's tile and the registers, before the products read and write them
        first_slice_product(dq_acc, ds_desc, advanced_device(kt_desc, part * DS_TILE_BYTES))
        for step in range(1, BLOCK_N // 16):
            slice_product(dq_acc, advanced_device(ds_desc, mn_step_bytes(step)),
                          advanced_device(kt_desc, part * DS_TILE_BYTES + mn_step_bytes(step)))
        wgmma_commit()

    @inlined_device_function
    def add_dq_slice(DQ_SUM, first, dq_acc, part, warp, g, t):
        """This lane's entries of a 64 x DQ_SLICE slice added to the float32 accumulator, row r at first + r
        HEAD_DIM."""
        for i in range(0, SLICE_REGISTERS, 2):
            row, column = lane_entry(i, g, t, warp)
            reduce_add_pair(DQ_SUM, first + row * HEAD_DIM + DQ_SLICE * part + column, dq_acc[i], dq_acc[i + 1])

    return stage_ds, issue_dq_slice, add_dq_slice, DQ_SLICES, SLICE_REGISTERS


@lru_cache(maxsize=None)
def bulk_dq_steps(HEAD_DIM, ELEMENT):
    """The steps by which the bulk modes' dK/dV kernel (two warpgroups, 128 keys) sums dQ: (issue_dq_half,
    stage_dq_half, HALF_REGISTERS, HALF_WORDS).  Warpgroup w computes dQ_i's columns w d / 2 .. (w + 1) d / 2 - 1
    over all 128 keys (A: both warpgroups' dS^T tiles, read as dS; B: both K tiles, MN-major, from that column on),
    so that each half is added once a step for the block's 128 keys: half the adds of the one-warpgroup modes'
    64-key tiles.  The half goes from the registers to shared memory in register order (``stage_dq_half``) and from
    there by one bulk reduction into DQ_SUM, whose (head, query tile) slab of 64 x d is these two halves, each in that
    order (``make_dq_convert``'s REGISTER_ORDER reads it back)."""
    assert splits_dq_columns(HEAD_DIM), HEAD_DIM
    HALF = HEAD_DIM // 2
    HALF_REGISTERS = HALF // 2
    HALF_WORDS = BLOCK_N * HALF
    K_TILE_BYTES = tile_bytes(HEAD_DIM)   # the second warpgroup's K tile follows the first's
    half_product = wgmma_ss(HALF, ELEMENT, True, True)   # A (dS^T's tiles) and B (K) MN-major
    first_half_product = wgmma_ss(HALF, ELEMENT, True, True, fresh=True)

    @inlined_device_function
    def issue_dq_half(dq_acc, ds_desc, kt_desc, wg):
        """dq_acc = dS K[:, HALF wg : HALF (wg + 1)] over the block's 128 keys: eight k-steps, four from each
        warpgroup's dS^T and K tiles (the first overwriting), one commit group.  The half starts on a 64-column tile
        of K (d = 128), or inside the first (d <= 64: its 128-byte rows swizzled by address, as the K-major k-steps'
        32-byte offsets)."""
        column = wg * HALF
        b_at = (column // 64) * DS_TILE_BYTES + (column % 64) * 2
        wgmma_fence()   # dS^T's tiles and the registers, before the products read and write them
        first_half_product(dq_acc, ds_desc, advanced_device(kt_desc, b_at))
        for step in range(1, 2 * BLOCK_N // 16):
            tile, k = step // 4, step % 4
            half_product(dq_acc, advanced_device(ds_desc, tile * DS_TILE_BYTES + mn_step_bytes(k)),
                         advanced_device(kt_desc, tile * K_TILE_BYTES + b_at + mn_step_bytes(k)))
        wgmma_commit()

    @inlined_device_function
    def stage_dq_half(smem, at, dq_acc, wtid):
        """This lane's registers of the half to the float32 buffer at word ``at``, in register order: registers
        4x .. 4x + 3 of every lane as one block of 512 words, lane after lane (16-byte stores, consecutive lanes
        consecutive: no bank conflicts)."""
        for x in range(HALF_REGISTERS // 4):
            store_vec4(smem, at + 512 * x + 4 * wtid, f32_as_u32(dq_acc[4 * x]), f32_as_u32(dq_acc[4 * x + 1]),
                       f32_as_u32(dq_acc[4 * x + 2]), f32_as_u32(dq_acc[4 * x + 3]))

    return issue_dq_half, stage_dq_half, HALF_REGISTERS, HALF_WORDS


@inlined_device_function
def register_order_word(row, column, head_dim):
    """Where a bulk mode's DQ_SUM slab holds dQ_i's entry (row, column), for an even column (the pair at it and
    the next word): the inverse of ``bulk_dq_steps``' ``stage_dq_half`` and ``lane_entry``."""
    half = head_dim // 2
    part, within = column // half, column % half
    warp, row16 = row // 16, row % 16
    lane = 4 * (row16 % 8) + (within % 8) // 2
    return part * BLOCK_N * half + 512 * (within // 8) + 4 * (32 * warp + lane) + 2 * (row16 // 8)


@inlined_device_function
def wait_turn(TURNS, index, turn, tid):
    """Every thread of the block waits until counter ``index`` of TURNS reaches ``turn``: the blocks before this one
    in the order of the sum have added their part (thread 0 polls the counter in L2; the fence orders this block's
    adds after what it saw)."""
    if tid == 0:
        while cuda.atomic.add(TURNS, index, 0) != turn:
            pass
        cuda.threadfence()
    cuda.syncthreads()


@inlined_device_function
def pass_turn(TURNS, index, tid):
    """The block's adds are done and visible (each thread's fence, then the barrier): counter ``index`` moves on."""
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        cuda.atomic.add(TURNS, index, 1)


@inlined_device_function
def contributors(m, k_tiles, causal_offset, key_rows):
    """How many key tiles (of ``key_rows`` keys) add to query tile m's dQ under the causal mask: those whose first
    query tile is at most m (``first_q_tile`` of the dK/dV kernel), key tiles 0 .. count - 1."""
    return max(0, min(k_tiles, (m * BLOCK_N + BLOCK_N - 1 + causal_offset) // key_rows + 1))


@inlined_device_function
def rotation_stride(q_tiles, k_tiles):
    """How far apart the bulk-ordered kernel's key tiles start along the query tiles of a dense head
    (``rotated_start``): the widest stride r that leaves each of the k_tiles a step of its own at every query tile
    (r (k_tiles - 1) < q_tiles); 0 (every key tile from query tile 0) where there is none, or one key tile."""
    return (q_tiles - 1) // (k_tiles - 1) if k_tiles > 1 else 0


@inlined_device_function
def rotated_start(tile, rotation, first_q_tile, q_tiles):
    """The query tile where key tile ``tile`` starts: first_q_tile without rotation; else -rotation tile (mod
    q_tiles), so that key tile t reaches query tile m at its step (m + rotation t) mod q_tiles and tile t - 1 reached
    it ``rotation`` steps before (``rotated_turn``)."""
    if rotation == 0:
        return first_q_tile
    return (q_tiles - rotation * tile) % q_tiles


@inlined_device_function
def rotated_turn(m, tile, rotation, k_tiles, q_tiles):
    """Key tile ``tile``'s turn at dense query tile m, when the k_tiles start where ``rotated_start`` puts them: the
    order in which they reach m, by (m + rotation t) mod q_tiles.  The last ``wrapped`` key tiles (m + rotation t >=
    q_tiles) reach it first, in ascending order, then tiles 0, 1, ...; without rotation the order is 0, 1, ...
    (every tile reaches m at step m), which is then the grid's dispatch order."""
    wrapped = 0 if rotation == 0 else max(0, k_tiles - (q_tiles - m + rotation - 1) // rotation)
    first = k_tiles - wrapped
    return tile - first if tile >= first else tile + wrapped

