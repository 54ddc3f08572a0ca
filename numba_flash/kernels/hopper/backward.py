"""The attention backward on Hopper's warpgroup tensor cores: FlashAttention-2's backward with its products on wgmma.

``algorithm="flash2"`` runs it on a Hopper GPU for the calls in its scope (``chosen_for``; else the ``mma.sync``
backward of ``kernels/fast``, its reference), and ``algorithm="wgmma"`` asks for it.  Scope: as the wgmma forward's
up to d = 128 (``common.out_of_scope``; above, dK and dV would not fit in a warpgroup's registers: docs/performance.md,
"Head dims on wgmma"): float16 and bfloat16, d a multiple of 16 up to 128 (``common.HEAD_DIMS``; flash2 takes it
at d = 64, 96 and 128, where it takes the forward), dense or causal (either alignment), block masks (below; flash2
takes those of whole 64 x 64 tiles, as for the forward), grouped heads, strides with contiguous 16-byte rows, packed
sequences (``attention_varlen_backward``; every kernel's VARLEN, as the forward's: each block reads its sequence's
bounds with ``fast.common.sequence_bounds`` first; in every way of summing dQ, the ordered turns over the sequence's
own key tiles; flash2 takes them where it takes the batched call).

A head dim that is not a multiple of 64 runs on the shared-memory layout of the next one, as in the forward (d = 96
on d = 128's two swizzled 64-column tiles, ``common.layout_dim``), the pad columns zero-filled by the same cp.async
copies; the products take only d: S^T and dP^T in d / 16 k-steps, dV, dK (and the dQ kernel's dQ) as m64n{d}k16,
whose MN-major B is read only up to column d - 1, dQ's slices in the dK/dV kernel as wide as d
(``dq_sums.dq_slice_columns``), and the stores write d columns.

Three launches: the mma.sync backward's preprocess (D = rowsum(dO o O), ``fast/backward.preprocess_launch``),
a dK/dV kernel of one warpgroup (128 threads; each warp owns 16 of the tile's 64 rows, its lanes hold accumulators
in ``wgmma.py``'s layout, mma.sync's C fragment per 8 columns; at d <= 64 a register cap lets three blocks share a
multiprocessor: ``dkdv_blocks_per_multiprocessor``), and a dQ kernel shaped like the forward
(``make_wgmma_dq``; or, in the modes that sum dQ in the dK/dV kernel, one that converts that float32 sum to
16-bit: see "Deterministic" below).

A warpgroup per (key tile of 64, batch, key/value head) keeps K_j and V_j in shared memory and streams past them
the query tiles of every query head of its group that see them, in a fixed order::

    K_j, V_j -> shared (swizzled, once);  Q_i, dO_i of the first step, their rows' lse and D -> stage 0
    for each query head h of the group, for each query tile i that sees key tile j:
        land Q_i, dO_i; start the next step's into the other stage              cp.async, one barrier
        S^T = K_j Q_i^T,  dP^T = V_j dO_i^T      wgmma m64n64k16 x d/16 each, both operands from shared memory,
                                                 each its own commit group, waited for only when read
        P^T = exp2(c S^T - lse),  dS^T = P^T o (dP^T - D)          0 where the key may not be seen
        dV += P^T dO_i,  dK += dS^T Q_i          wgmma m64n{d}k16 x 4 each, A from registers, B transposed
        ("ordered", "atomic": dS^T -> shared;  dQ_i += dS K_j in slices (64 columns at d = 128, else all d),
         added to a float32 sum in L2)
    dK = scale dK;  dK, dV -> 16-bit

The products overlap the arithmetic where the data allow: P^T's exponentials run under dP^T's products, dS^T's
under dV's, and accumulators that start a sum are written by the product itself (scale-d = 0,
``wgmma_ss(fresh=True)``) rather than zeroed in registers, so that ptxas inserts no waits of its own (its C7517
warning) in any dK/dV kernel.

Every tile is the forward's (``common.py``): 64 rows in 128-byte-swizzled shared memory, read K-major by the
score products and MN-major by the gradient products: the same bytes under two descriptors.  The transposed
scores leave P^T and dS^T in exactly the registers a register-sourced A operand wants (as in FlashAttention-3's
backward), so P never goes through shared memory; dQ's product needs dS itself as A, which is dS^T's tile read
MN-major.  Barriers and fences as the forward's: after a thread's copies (or its dS^T stores) land,
``fence_proxy_async`` (ordinary writes, read by the tensor cores through the async proxy) and ``syncthreads``
(every thread's part is there, and every warp has waited for the products that read what is about to be
overwritten); ``wgmma_fence`` before each group of products (the zeroed accumulators, or the packed A registers,
written just before).

With a block mask (``numba_flash.BlockMask``) the host lists the tiles each kernel visits, from the rule of the
mma.sync backward's and the forward's lists (``sparsity/tile_lists.py``, ``kernels/fast/common.block_mask_arguments``,
here for 64 x 64 tiles: ``MASK_TILES``): the dK/dV kernel's block walks, for each query head of its group in turn,
the query tiles that its key tile's list names ("for each query tile i that sees key tile j" above; ``query_steps``,
``listed_step``), through the same two stages; the dQ kernel's block the key tiles of its query tile's list (the
wgmma forward's lists at one warpgroup), its blocks in the forward's order (longest list first).  A tile the mask
covers only partly takes the element test against the uint8 block layout (``element_test``, through
``kernels/fast/common.allowed``, gathered into one word as in the forward; the dK/dV kernel finds it before the
step's products are issued, so that its temporaries never sit beside S^T and dP^T), so that P^T (and with it dS^T)
is 0 outside the mask; a query row that sees no key has lse = -inf, so P = 0 and its gradients are 0; a block whose list
is empty copies nothing and writes zeros.  Both are compile-time flags (HAS_MASK, PARTLY_MASKED): a mask of whole
tiles compiles the element test out, and without a mask the kernels compile to the PTX instructions they had before
(sm_90a; the mask's placeholder arguments added at the end of the parameter list).

Score and mask mods (``numba_flash.mods``; every kernel's MODS, in every way of summing dQ): a mask_mod's tiles come
as the lists above (classified on the host, ANDed with a block mask's), its partly covered tiles testing each entry
with it in ``element_test``; a score_mod is evaluated at every entry (its results used only where allowed, the
element test run where a tile needs it) and gives P = exp2(score_mod(scale S) log2(e) - lse) and dS = P o (dP - D)
o d score_mod / d score, the derivative the backward's ``ModSteps`` traced (``fast.mod_steps.entry_steps``'
``mod_weight``).  The dK/dV kernel packs P^T for dV's product and keeps P^T o d score_mod / d score in S^T's
registers in the same pass (``probability_pair``), so the slope needs no registers of its own.  A lone
``relative_position_bias`` whose table learns: the dQ kernel also sums dS into the table's bins (TABLE_REACH,
``fast/bias_table.py``).  Without mods the PTX
instructions are unchanged (sm_90a, 2026-12-06).  GPU tests and sanitizers: ``experiments/tuning/results/
gpu_tests_h200.md``.

Deterministic.  dQ_i is the sum over key tiles of dS_ij K_j, and float32 addition is not associative, so the order
of the adds must not depend on timing.  Five ways of summing it are built (``DQ_MODES``); a call takes the fastest
measured of those its ``deterministic`` allows (``dq_mode``; ``NUMBA_FLASH_WGMMA_DQ`` forces one, to measure them):
"separate" gives dQ a kernel of its own (``make_wgmma_dq``: a warpgroup per query tile streams K_j, V_j past it and
computes S and dP again: seven products instead of five, but no adds across blocks), so the dK/dV kernel needs no dS
tile in shared memory and no dQ registers.  "ordered" sums dQ in the dK/dV kernel, giving each query tile of each
head a counter (``wait_turn``, ``pass_turn``) and each key tile its turn, ascending, or for causal grids from the
diagonal down, the grid then dispatching its shortest key tiles first: a block only ever waits for blocks that were
dispatched before it, which are running or done, so the wait ends (the argument of FlashAttention-3's deterministic
backward).  With a block mask only the key tiles in the query tile's list add to its dQ, so a key tile's turn is its
place among them in the same order (``dq_turn``: the forward's list for that query tile, the transpose of the dK/dV
kernel's, searched by bisection), and the argument holds as before.  "atomic" adds as the blocks arrive (for
``deterministic=False`` only).  On an H100 (2026-12-05) the two summing modes lost to "separate" everywhere: the
dK/dV kernel's extra registers and dS^T stores, the adds' traffic, and for "ordered" the waits for turns, cost more
than two products (``docs/performance.md``).  "bulk-ordered" and "bulk-atomic" sum it as FlashAttention-3's
backward does, in a dK/dV kernel of its own (``specialized_dkdv.py``): a block of three warpgroups with roles on 128
keys, two consumers computing and adding dQ_i's column halves from shared memory by bulk reductions that a writer
warp issues (in turn, or not), a producer warpgroup copying the streamed tiles, ``setmaxnreg`` moving registers from
it to the consumers.  At d = 96 and 112 (halves that straddle K's 64-column tiles), with a block mask or mods, a call
takes "separate" (``dq_mode``), or where ``NUMBA_FLASH_WGMMA_DQ`` forces a bulk mode, "ordered" or "atomic"
(``dq_mode_for``).  The bulk modes' first form (two warpgroups that both computed and
copied, 2026-12-06, H100) lost to "separate" (1.04-1.7x its time unordered, 1.3-2.4x ordered:
``experiments/tuning/results/backward_bulk_dq_h100.md``); the kernel with roles replaced it, and "bulk-atomic" now
takes 0.74-0.88x the time of "separate" dense and at d = 128 causal over long sequences (H100, 2026-12-07,
``experiments/tuning/results/backward_dq_modes_h100.md``), so ``deterministic=False`` takes it there.
"bulk-ordered" first lost to "separate" too (1.11-1.86x its time: each query tile's adds passed from key tile to key
tile, every block a hand-over behind the one before); with a writer warp per half and dense key tiles that start
apart along the query tiles (``specialized_dkdv.py``'s docstring) it takes 0.78-0.93x the time of "separate" dense
at d = 128, and is the deterministic default there (same GPU, same day).

Departures from FlashAttention-3's backward, each a step still to take (and to measure):

* copies by cp.async (in the bulk modes' kernel by a producer warpgroup, elsewhere by the warps that compute), not
  by the tensor copy engine (TMA needs a tensor map made on the host, ``docs/performance.md``);
* NaN is not confined to the entries that may see it: a NaN in a row the mask hides still meets a weight of
  0 in the tensor cores (0 * NaN = NaN).  The mma.sync backward's NaN semantics (``tests/test_nan.py``) hold
  there, not here;
* block masks: the grid keeps its dense order (the forward's longest-first order applies to the dQ kernel only: the ordered adds need
  the dispatch order of their turns);
* packed sequences: the grid covers the longest sequence's tiles for every sequence, and the blocks past a sequence's
  end leave at once (FlashAttention-3's scheduler visits only the tiles that exist);
* no dropout yet.
"""
import math
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int64, uint32

from ...runtime.arrays import placeholder
from ...runtime.device import device_limits, in_simulator
from ...runtime.launch import Kernel, Launch, inlined_device_function, unrolled, unrolled_or
from ...sparsity.tile_lists import listed_tile, reads_layout
from ...tiling import cdiv
from ..fast.backward import preprocess_launch
from ..fast.bias_table import FUSED_REACH, table_rows, table_steps, table_words
from ..fast.common import (LOG2_E, allowed, block_mask_arguments, ceil_div, has_tile_lists, lane_entry, log2_lse,
                           lse_slabs, partly_masked_tiles, sequence_arguments, sequence_arrays, sequence_bounds,
                           sequence_mode, tile_coordinates, warp_lane, word_extent)
from ..fast.fragments import sixteen_bit_ops
from ..fast.mod_steps import entry_steps, inside, mod_steps, mods_suffix, slot_arguments, slot_arrays
from ..fast.primitives import copy_async_commit, copy_async_wait_all, exp2, load_word, store_word, u32_as_f32
from . import forward, specialized_dkdv
from .backward_steps import (WARPGROUP, backward_kernel, step_copier, steps, transposed_scores, wait_all_but_one,
                             wait_all_products)
from .common import (A_WORDS, BLOCK_N, S_REGISTERS, environment_choice, first_atom_words, k_major_descriptor,
                     mn_major_descriptor, out_of_scope, query_tile, tile_bytes)
from .dq_sums import (DQ_MODES, DS_TILE_BYTES, UNORDERED_MODES, contributors, dq_steps, key_warpgroups, pass_turn,
                      register_order_word, splits_dq_columns, wait_turn)
from .wgmma import advanced_device, enable_sm90a, fence_proxy_async, shared_address, wgmma_commit, wgmma_fence

STREAMED_TILES = 4       # 64-row tiles of the streamed Q_i and dO_i in shared memory: two stages of the two


def shared_bytes(head_dim, dq_mode="separate"):
    """The one-warpgroup kernels': the K and V tiles, two stages of Q_i and dO_i, the streamed query rows' lse and D
    (two stages), dS^T where dQ is summed by the dK/dV kernel, and slack to start the tiles on a 1024-byte
    boundary.  (The bulk modes' kernel: ``specialized_dkdv.shared_bytes``.)"""
    return ((2 + STREAMED_TILES) * tile_bytes(head_dim) + (0 if dq_mode == "separate" else DS_TILE_BYTES)
            + 2 * 2 * BLOCK_N * 4 + 1024)


#: A block mask's lists for these kernels are of 64 x 64 tiles (``sparsity/tile_lists.py``): query tiles per key tile
#: for the dK/dV kernel ("dkdv"), key tiles per query tile for the dQ kernel and for the order of the dK/dV kernel's
#: adds ("forward": the wgmma forward's lists at one warpgroup, and its order of the blocks, longest list first).
MASK_TILES = (BLOCK_N, BLOCK_N)
MASK_ARRAYS = dict(tile_offsets=np.int32, tile_entries=np.int32, M=np.uint8)
#: Packed sequences' bounds (``fast.common.sequence_bounds``; placeholders without).
BOUNDS_ARRAYS = dict(q_bounds=np.int32, k_bounds=np.int32)


@lru_cache(maxsize=None)
def tile_list(PARTLY_MASKED):
    """(list_bounds, listed): how the kernels read a block mask's tile lists (``sparsity/tile_lists.py``, tiles of
    BLOCK_N): where own tile ``tile`` of head bh finds its list, and entry ``index`` of a list.  PARTLY_MASKED
    False (no listed tile only partly covered: the mask's blocks are whole tiles) makes every entry's flag a
    constant False, which compiles the element test out."""

    @inlined_device_function
    def list_bounds(tile_offsets, bh, own_tiles, tile):
        """(first, count): the list of own tile ``tile`` of head bh is entries first .. first + count - 1."""
        at = bh * (own_tiles + 1) + tile
        first = int64(tile_offsets[at])
        return first, int64(tile_offsets[at + 1]) - first

    @inlined_device_function
    def listed(tile_entries, index):
        """The listed tile's first row (or key), and whether the mask covers it only partly (``listed_tile``)."""
        first_row, partly = listed_tile(tile_entries, index, BLOCK_N)
        if not PARTLY_MASKED:   # a constant for the compiler
            partly = False
        return int64(first_row), partly

    return list_bounds, listed


@lru_cache(maxsize=None)
def element_test(CAUSAL, TRANSPOSED, MODS=None, READS_LAYOUT=True):
    """``hidden_entries(q0, k0, n_q, n_k, causal_offset, partly, layout, warp, g, t, mod_args)``: bit i set where this
    lane's register i of a 64 x 64 score tile (S: query rows, key columns; S^T where TRANSPOSED) holds an entry its
    query may not see (``fast.common.allowed``: outside either sequence, right of the causal diagonal, or, in a tile
    the block mask or mask_mod covers only partly, outside its blocks, read from the uint8 block layout where a block
    mask cuts tiles (READS_LAYOUT: ``tile_lists.reads_layout``), and outside the mask_mod: ``fast.mod_steps.
    entry_steps``' ``mod_allows``); ``layout`` = (M, bh, mask_rows, mask_cols, mask_t_r, mask_t_c).  One word, as
    the forward's ``hidden_entries``: the loop over the registers that tests it then indexes S with constants only;
    and as there, the mask_mod's test is chosen once per tile, each variant written out register by register."""
    MASK_MOD = MODS is not None and MODS.has_mask
    mod_allows = entry_steps(MODS)[0]

    def entry_bit(i, TEST_MOD):
        @inlined_device_function
        def bit(q0, k0, n_q, n_k, causal_offset, partly, layout, warp, g, t, mod_args):
            M, bh, mask_rows, mask_cols, mask_t_r, mask_t_c = layout
            row, column = lane_entry(i, g, t, warp)
            query, key = (q0 + column, k0 + row) if TRANSPOSED else (q0 + row, k0 + column)
            visible = allowed(query, key, n_q, n_k, CAUSAL, causal_offset, partly if READS_LAYOUT else False, M, bh,
                              mask_rows, mask_cols, mask_t_r, mask_t_c)
            if TEST_MOD:
                visible = mod_allows(visible, inside(query, n_q), inside(key, n_k), mod_args)
            return uint32(0) if visible else uint32(1) << uint32(i)

        return bit

    # Register by register (``unrolled_or``), as the forward's: a loop stayed rolled, its row and key recomputed in
    # 64-bit arithmetic on each of the 32 passes.
    plain_bits = unrolled_or([entry_bit(i, False) for i in range(S_REGISTERS)])
    mod_bits = unrolled_or([entry_bit(i, True) for i in range(S_REGISTERS)]) if MASK_MOD else None

    @inlined_device_function
    def hidden_entries(q0, k0, n_q, n_k, causal_offset, partly, layout, warp, g, t, mod_args):
        if MASK_MOD and partly:   # (tiles the mask_mod fills skip its test: ``sparsity/mod_tiles.py``)
            return mod_bits(q0, k0, n_q, n_k, causal_offset, partly, layout, warp, g, t, mod_args)
        return plain_bits(q0, k0, n_q, n_k, causal_offset, partly, layout, warp, g, t, mod_args)

    return hidden_entries


def dkdv_blocks_per_multiprocessor(head_dim, dq_mode, mods, partly_masked, varlen):
    """Blocks of the dK/dV kernel that ptxas is asked to fit on one multiprocessor (the launch bounds' minimum).

    At d <= 64 the kernel takes 201-219 registers left alone (ptxas 13.0, sm_90a), so two blocks of one warpgroup
    share a multiprocessor although the shared memory (51 KB a block) has room for four; asked for three (168
    registers), the dense and causal kernels spill 28-36 bytes and run 1.12-1.19x faster (H100, 2026-12-06, the
    backward alone at six shapes from (16, 16, 1024) to (1, 32 / 8, 8192), float16 and bfloat16, the same bits:
    ``experiments/tuning/results/backward_register_cap_h100.md``), and the kernels of masks of whole tiles spill
    nothing.  Elsewhere 1 (no cap): at d = 96 and 128 the accumulators alone take 96-128 registers and the cap for
    three spills 424-724 bytes (and the shared memory fits two anyway); the element test of partly masked tiles
    spills 152-168 bytes under it, packed sequences 48-80 (not timed), and the modes that sum dQ and the mods
    have more registers live still."""
    capped = head_dim <= 64 and dq_mode == "separate" and mods is None and not partly_masked and not varlen
    return 3 if capped else 1


@lru_cache(maxsize=None)
def make_wgmma_dkdv(HEAD_DIM, ELEMENT, CAUSAL, DQ_MODE="separate", HAS_MASK=False, PARTLY_MASKED=True, VARLEN=False,
                    MODS=None):
    """dK and dV: one warpgroup per (key tile, batch, key/value head); see the module docstring.  With DQ_MODE
    "ordered" or "atomic" it also adds each step's dS K into DQ_SUM (float32, (batch * heads, q_tiles * 64, d)):
    "ordered" in a fixed order of the key tiles per query tile, kept by the counters TURNS (one per query tile and
    head, zeroed): ascending, or for causal grids descending, the grid then running its shortest key tiles first,
    so that a block only ever waits for blocks that started before it.  (The "bulk-" modes have a kernel of their
    own: ``specialized_dkdv.py``.)

    HAS_MASK: a block mask lists the query tiles each key tile's block visits, per query head (``MASK_TILES``,
    ``query_steps``, ``listed_step``); "ordered" then gives a key tile the turn of its place among the key tiles
    that visit the query tile, in the same order (``dq_turn``).  PARTLY_MASKED (with HAS_MASK): some listed tile
    is only partly covered by the mask's blocks, and its P^T takes the element test (``element_test``); False
    compiles the test out.  Without a mask every step compiles as before (the mask's arguments placeholders).

    VARLEN: packed sequences (``fast.common.sequence_bounds``, as the forward's VARLEN): the block's first step
    reads its sequence's bounds, and from then on n_q, n_k, causal_offset and the query and key tiles are the
    sequence's (the grid covers the longest: a block past its sequence's keys leaves before any barrier), its rows
    offset by the sequence's first query and key, lse and D where ``lse_row`` puts them.  dQ's float32 sum and its
    turns keep their layout (a slab of the longest sequence's query tiles per (sequence, head)), the ordered turns
    counted over the sequence's own key tiles.

    MODS (``fast.mod_steps.ModSteps`` built for the backward, or None): a mask_mod's tiles come as lists (HAS_MASK,
    classified on the host) and its partly covered tiles take it in the element test; a score_mod makes every step
    evaluate every entry (its results used only where ``hidden_entries`` allows) and compute P^T =
    exp2(score_mod(scale S^T) log2(e) - lse) and d score_mod / d score by ``mod_weight``
    (``fast.mod_steps.entry_steps``), so that dS^T = P^T o (dP^T - D) o d score_mod / d score
    (``mod_probabilities``).  Without mods every step compiles as before (MOD0 .. MOD3 placeholders at the end of
    the parameter list)."""
    assert not (VARLEN and HAS_MASK), "packed sequences take no block mask"
    assert MODS is None or not VARLEN, "mods: not with packed sequences yet"
    assert MODS is None or not MODS.has_mask or HAS_MASK, "a mask_mod's tiles come as lists (HAS_MASK)"
    assert key_warpgroups(DQ_MODE) == 1, "the bulk modes' kernel: specialized_dkdv.py"
    sequence, lse_row = sequence_bounds(VARLEN)
    ACC_REGISTERS, TILE_WORDS, start_tile, issue_scores, pack_pairs, issue_weighted, store_rows = steps(HEAD_DIM,
                                                                                                       ELEMENT)
    SUM_DQ, ORDERED = DQ_MODE != "separate", DQ_MODE not in UNORDERED_MODES + ("separate",)
    ELEMENT_TEST = HAS_MASK and PARTLY_MASKED   # a listed tile's P^T may need the block mask's element test
    HAS_MODS = MODS is not None
    SCORE_MOD = HAS_MODS and MODS.has_score
    ENTRY_TEST = ELEMENT_TEST or SCORE_MOD      # each entry tested (a score_mod decides every score)
    stage_ds, issue_dq_slice, add_dq_slice, DQ_SLICES, SLICE_REGISTERS = dq_steps(HEAD_DIM, ELEMENT)
    list_bounds, listed = tile_list(PARTLY_MASKED)
    hidden_entries = element_test(CAUSAL, True, MODS, HAS_MASK and reads_layout(PARTLY_MASKED))
    mod_weight = entry_steps(MODS)[2]
    _, pack = sixteen_bit_ops(ELEMENT)
    probabilities, score_gradients = transposed_scores(CAUSAL, ELEMENT_TEST)
    start_step = step_copier(HEAD_DIM, WARPGROUP)

    # ---- which query tiles a block visits, in what order, and (ordered) when it adds to each one's dQ ----
    @inlined_device_function
    def query_steps(tile_offsets, bh0, group, tile, k_tiles, k0, q_tiles, causal_offset):
        """(first_q_tile, per_head, steps): the block's steps.  Without a mask, every query tile of every query head
        of the group that sees key tile ``tile`` (causal: from the tile holding row k0 - causal_offset, the first
        that sees key k0), per_head a head; with one, the lists of the group's heads (bh0: the first's batch*heads
        index) one after another (first_q_tile and per_head unused)."""
        if HAS_MASK:
            steps = int64(0)
            for x in range(group):
                steps += list_bounds(tile_offsets, bh0 + x, k_tiles, tile)[1]
            return int64(0), int64(1), steps
        first_q_tile = max(0, k0 - causal_offset) // BLOCK_N if CAUSAL else 0
        per_head = max(0, q_tiles - first_q_tile)
        return first_q_tile, per_head, group * per_head

    @inlined_device_function
    def listed_step(tile_offsets, tile_entries, bh0, group, tile, k_tiles, step):
        """(HAS_MASK) (x, q_tile, partly): step ``step`` visits query tile q_tile of the group's query head x, a
        tile the block mask covers only partly or not (a constant False without the element test): entry ``step``
        of the heads' lists one after another (a walk over the group's heads, a few loads a step).  Without a mask,
        step ``step`` is query tile first_q_tile + step % per_head of head step // per_head: the kernel computes
        those where it did before the mask came (a division checks its divisor, so moving one changes the code)."""
        rest = step
        for x in range(group):
            first, count = list_bounds(tile_offsets, bh0 + x, k_tiles, tile)
            if rest < count:
                q0, partly = listed(tile_entries, first + rest)
                return int64(x), q0 // BLOCK_N, partly
            rest -= count
        return int64(group), int64(0), False   # past the last step: never asked for

    @inlined_device_function
    def dq_turn(row_offsets, row_entries, bh, q_tile, q_tiles, tile, k_tiles, causal_offset):
        """(ORDERED) When key tile ``tile`` adds to query tile q_tile's dQ: after the key tiles before it in the
        order of the grid's dispatch, ascending, or for causal grids from the diagonal down (``contributors``).
        With a block mask only the key tiles in q_tile's list add (the key tiles per query tile: this kernel's lists
        transposed, the same tiles), so its turn is its place in that list, found by bisection: a key tile waits
        for no tile that never comes."""
        if HAS_MASK:
            first, count = list_bounds(row_offsets, bh, q_tiles, q_tile)
            low, high = first, first + count
            while low < high:
                middle = (low + high) // 2
                if (row_entries[middle] >> 1) < tile:
                    low = middle + 1
                else:
                    high = middle
            before = low - first   # listed key tiles before this one
            return count - 1 - before if CAUSAL else before
        return contributors(q_tile, k_tiles, causal_offset, BLOCK_N) - 1 - tile if CAUSAL else tile

    @inlined_device_function
    def entry_weight(i, st, smem, scalars_at, k0, q0, n_q, n_k, hidden, mod_args, warp, g, t):
        """(SCORE_MOD) (P^T, d score_mod / d score) of register i of S^T: 0 and 0 where bit i of ``hidden`` is set."""
        key, column = lane_entry(i, g, t, warp)
        visible = not (hidden >> uint32(i)) & uint32(1)
        return mod_weight(st[i], u32_as_f32(load_word(smem, scalars_at + column)), visible, inside(q0 + column, n_q),
                          inside(k0 + key, n_k), mod_args)

    def probability_pair(x):
        """(SCORE_MOD) ``pair(st, p_words, ...)``: registers 2x and 2x + 1 of S^T to P^T, packed into word x of
        ``p_words`` (``pack_pairs``' layout: dV's A operand), and st to P^T o d score_mod / d score, the factor of
        (dP^T - D) in dS^T (``score_gradients``): no registers beside st hold the slope.  One function per pair,
        written out by ``unrolled``: NVVM leaves a loop whose body calls a mod rolled, and S^T indexed at run time
        goes to local memory."""

        @inlined_device_function
        def pair(st, p_words, smem, scalars_at, k0, q0, n_q, n_k, hidden, mod_args, warp, g, t):
            p_even, slope_even = entry_weight(2 * x, st, smem, scalars_at, k0, q0, n_q, n_k, hidden, mod_args, warp, g,
                                              t)
            p_odd, slope_odd = entry_weight(2 * x + 1, st, smem, scalars_at, k0, q0, n_q, n_k, hidden, mod_args, warp,
                                            g, t)
            p_words[x] = pack(p_even, p_odd)
            st[2 * x] = p_even * slope_even
            st[2 * x + 1] = p_odd * slope_odd

        return pair

    #: (SCORE_MOD) mod_probabilities(st, p_words, smem, scalars_at, k0, q0, n_q, n_k, hidden, mod_args, warp, g, t):
    #: every pair.
    mod_probabilities = unrolled([probability_pair(x) for x in range(A_WORDS)]) if SCORE_MOD else None

    @inlined_device_function
    def start_dq(smem, ds_at, ds_words, ds_desc, kt_desc, dq_acc, warp, g, t):
        """dS^T into shared memory (the A operand must be dS, the transpose of what the registers hold), fenced for
        the tensor cores and published by a barrier, then dQ's first slice issued: before dK's and dV's products,
        so that its adds run while they do.  The next step overwrites the tile only after the barrier at its top,
        which every warp reaches after waiting for this step's products."""
        stage_ds(smem, ds_at, ds_words, warp, g, t)
        fence_proxy_async()
        cuda.syncthreads()
        issue_dq_slice(dq_acc, ds_desc, kt_desc, 0)

    @inlined_device_function
    def add_dq(DQ_SUM, TURNS, ds_desc, kt_desc, dq_acc, bh, q_tile, q_tiles, turn, warp, g, t, tid):
        """dQ_i += dS_ij K_j into DQ_SUM, slice by slice (in TURNS' order when ORDERED): the first slice, issued by
        ``start_dq``, is waited for alone (dK's and dV's products, one group after it, may still run)."""
        first = (bh * q_tiles + q_tile) * BLOCK_N * HEAD_DIM
        for part in range(DQ_SLICES):
            if part == 0:
                wait_all_but_one()
            else:
                issue_dq_slice(dq_acc, ds_desc, kt_desc, part)
                wait_all_products()
            if ORDERED and part == 0:
                wait_turn(TURNS, bh * q_tiles + q_tile, turn, tid)
            add_dq_slice(DQ_SUM, first, dq_acc, part, warp, g, t)
        if ORDERED:
            pass_turn(TURNS, bh * q_tiles + q_tile, tid)

    def kernel(Q, K, V, dO, LSE, D, dK, dV, DQ_SUM, TURNS, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, do_sb,
               do_sh, do_sn, dk_sb, dk_sh, dk_sn, dv_sb, dv_sh, dv_sn, kv_heads, group, n_q, n_k, k_tiles, q_tiles,
               causal_offset, scale, scale_log2, tile_offsets, tile_entries, M, mask_rows, mask_cols, mask_t_r,
               mask_t_c, row_offsets, row_entries, q_bounds, q_step, k_bounds, k_step, bottom_right, lse_sb, lse_sh,
               MOD0, MOD1, MOD2, MOD3):
        # Q, K, V, dO, dK, dV: flat 16-bit pairs, element (b, h, n, x) at b sb + h sh + n sn + x (rows 16-byte
        # aligned); LSE, D: (batch * heads, n_q) float32.  Query heads h_kv group .. h_kv group + group - 1 read
        # key/value head h_kv.  DQ_SUM and TURNS: see above (unused when dQ has its own pass).  HAS_MASK: the query
        # tiles of key tile kt of head bh are tile_entries[tile_offsets[bh (k_tiles + 1) + kt] ...], the key tiles
        # of query tile qt row_entries[row_offsets[bh (q_tiles + 1) + qt] ...] (``MASK_TILES``), M the uint8
        # (bh, mask_t_r, mask_t_c) block layout of blocks (mask_rows, mask_cols); placeholders without a mask.
        # VARLEN: q_bounds, k_bounds bound each sequence's rows (``sequence_bounds``; placeholders without).  MODS:
        # MOD0 .. MOD3 the score_mod's arrays, then the mask_mod's (``fast.mod_steps``); placeholders otherwise.
        rank, h_kv, b, _ = tile_coordinates(cuda.blockIdx.x, k_tiles, kv_heads, CAUSAL)
        # Causal: rank 0 is key tile 0, the one the most query rows see (longest first), or when the adds are
        # ordered from the diagonal down, the last key tile (shortest first: every block it waits for started
        # before it).
        tile = k_tiles - 1 - rank if CAUSAL and ORDERED else rank
        tid = cuda.threadIdx.x
        k0 = tile * BLOCK_N
        lse_rows = n_q   # of lse and D per (batch, head), or per head over the packed sequences (VARLEN)
        first_query, first_key, n_q, n_k, causal_offset = sequence(b, q_bounds, q_step, k_bounds, k_step, n_q, n_k,
                                                                   causal_offset, bottom_right, 0)
        if VARLEN and k0 >= n_k:   # the grid covers the longest sequence; the whole block leaves, before any
            return                      # barrier
        # The sequence's query and key tiles (the grid's k_tiles and q_tiles still lay out the lists and dQ's sum).
        own_q_tiles, own_k_tiles = (ceil_div(n_q, BLOCK_N), ceil_div(n_k, BLOCK_N)) if VARLEN else (q_tiles, k_tiles)
        warp, g, t = warp_lane(tid)
        smem = cuda.shared.array(0, uint32)
        base = shared_address(smem)
        pad = first_atom_words(base)
        # K_j, V_j, then the stages (stage s: Q_i, dO_i at q_at + s 2 TILE_WORDS).
        k_at, v_at = pad, pad + TILE_WORDS
        q_at = pad + 2 * TILE_WORDS
        ds_at = q_at + STREAMED_TILES * TILE_WORDS   # dS^T, when this kernel sums dQ
        scalars_at = ds_at + (DS_TILE_BYTES // 4 if SUM_DQ else 0)    # stage s: lse, then D, at + s 2 BLOCK_N
        # S^T = K Q^T and dP^T = V dO^T read all four K-major; dV += P^T dO and dK += dS^T Q read dO and Q
        # MN-major, dQ += dS K reads K MN-major: the same bytes.  The stage-0 descriptors, advanced by a stage's bytes.
        k_desc, v_desc = k_major_descriptor(base + k_at * 4), k_major_descriptor(base + v_at * 4)
        q_desc, do_desc = k_major_descriptor(base + q_at * 4), k_major_descriptor(base + (q_at + TILE_WORDS) * 4)
        qt_desc = mn_major_descriptor(base + q_at * 4)
        dot_desc = mn_major_descriptor(base + (q_at + TILE_WORDS) * 4)
        kt_desc = mn_major_descriptor(base + k_at * 4)
        ds_desc = mn_major_descriptor(base + ds_at * 4)

        # The steps: every query tile of every query head of the group that sees key tile j, heads in order.
        bh0 = (b * kv_heads + h_kv) * group   # the group's first query head, as a batch*heads index
        first_q_tile, per_head, steps = query_steps(tile_offsets, bh0, group, tile, k_tiles, k0, own_q_tiles,
                                                    causal_offset)

        dk_acc = cuda.local.array(ACC_REGISTERS, float32)
        dv_acc = cuda.local.array(ACC_REGISTERS, float32)
        st = cuda.local.array(S_REGISTERS, float32)
        dpt = cuda.local.array(S_REGISTERS, float32)
        dq_acc = cuda.local.array(SLICE_REGISTERS, float32)   # a slice of dS K, when this kernel sums dQ
        p_words = cuda.local.array(A_WORDS, uint32)    # P^T, packed: the A operand of dV's product
        ds_words = cuda.local.array(A_WORDS, uint32)   # dS^T, packed: dK's
        for i in range(ACC_REGISTERS):
            dk_acc[i] = float32(0)
            dv_acc[i] = float32(0)

        # (a key tile no listed query tile sees, or a sequence without queries, copies nothing: dK = dV = 0)
        if steps > 0 or not (HAS_MASK or VARLEN):
            start_tile(smem, k_at, K, b * k_sb + h_kv * k_sh + (first_key + k0) * k_sn, k_sn, n_k - k0, tid)
            start_tile(smem, v_at, V, b * v_sb + h_kv * v_sh + (first_key + k0) * v_sn, v_sn, n_k - k0, tid)
        if steps > 0:
            if HAS_MASK:
                x, q_tile, _ = listed_step(tile_offsets, tile_entries, bh0, group, tile, k_tiles, 0)
            else:
                x, q_tile = 0, first_q_tile
            h = h_kv * group + x
            q0 = q_tile * BLOCK_N
            start_step(smem, q_at, scalars_at, Q, dO, LSE, D, b * q_sb + h * q_sh + first_query * q_sn,
                       b * do_sb + h * do_sh + first_query * do_sn, q_sn, do_sn,
                       lse_row(b * kv_heads * group + h, b, h, first_query, lse_rows, lse_sb, lse_sh), q0, n_q, tid)
        copy_async_commit()
        c_log2 = float32(scale_log2)
        for step in range(steps):
            stage = step & 1
            if HAS_MASK:
                x, q_tile, partly = listed_step(tile_offsets, tile_entries, bh0, group, tile, k_tiles, step)
            else:
                x, q_tile, partly = 0, first_q_tile + step % per_head, False   # (x: see below)
            q0 = q_tile * BLOCK_N
            # K_j, V_j (first step) and this step's tiles landed, for the tensor cores too, and its lse and D
            # stored; every warp done with the previous step's products, so their stage may be refilled.
            copy_async_wait_all()
            fence_proxy_async()
            cuda.syncthreads()
            if step + 1 < steps:
                if HAS_MASK:
                    x_next, q_next, _ = listed_step(tile_offsets, tile_entries, bh0, group, tile, k_tiles, step + 1)
                else:   # (q_next: below, where the dense kernel computed it)
                    x_next, q_next = (step + 1) // per_head, 0
                h_next = h_kv * group + x_next
                start_step(smem, q_at + (stage ^ 1) * 2 * TILE_WORDS, scalars_at + (stage ^ 1) * 2 * BLOCK_N, Q, dO,
                           LSE, D, b * q_sb + h_next * q_sh + first_query * q_sn,
                           b * do_sb + h_next * do_sh + first_query * do_sn, q_sn, do_sn,
                           lse_row(b * kv_heads * group + h_next, b, h_next, first_query, lse_rows, lse_sb, lse_sh),
                           (q_next if HAS_MASK else first_q_tile + (step + 1) % per_head) * BLOCK_N, n_q, tid)
            copy_async_commit()
            offset = stage * 8 * TILE_WORDS   # bytes of a stage: Q_i, then dO_i
            # What the mods read besides the entry (``fast.mod_steps.entry_steps``): batch, this step's query head,
            # scale, their arrays (without mods, never read).
            mod_args = (b, h_kv * group + (x if HAS_MASK else step // per_head) if HAS_MODS else 0,
                        float32(scale), MOD0, MOD1, MOD2, MOD3)
            # With the element test, the entries it hides, before the products are issued: its temporaries are
            # then never live beside S^T and dP^T (found after them, at d = 128 they spilled 100-372 bytes).  Only
            # where some entry may be hidden: a mixed tile, or one with keys or (for a score_mod, which must not see
            # them) queries past the sequences; a score_mod's other tiles are wholly allowed.
            hidden = (hidden_entries(q0, k0, n_q, n_k, causal_offset, partly,
                                     (M, bh0 + x, mask_rows, mask_cols, mask_t_r, mask_t_c), warp, g, t, mod_args)
                      if ENTRY_TEST and (partly or (CAUSAL and k0 + BLOCK_N - 1 > q0 + causal_offset)
                                         or k0 + BLOCK_N > n_k or (SCORE_MOD and q0 + BLOCK_N > n_q))
                      else uint32(0))
            # The products in the order their inputs are ready, each waited for only when its result is needed:
            # P^T's exponentials run under dP^T's products, dS^T's under dV's.
            issue_scores(st, k_desc, advanced_device(q_desc, offset), dpt, v_desc, advanced_device(do_desc, offset))
            wait_all_but_one()   # S^T
            masked = (CAUSAL and k0 + BLOCK_N - 1 > q0 + causal_offset) or k0 + BLOCK_N > n_k
            scalars = scalars_at + stage * 2 * BLOCK_N
            if SCORE_MOD:
                mod_probabilities(st, p_words, smem, scalars, k0, q0, n_q, n_k, hidden, mod_args, warp, g, t)
            else:
                probabilities(st, smem, scalars, k0, q0, n_k, causal_offset, c_log2, masked, hidden, warp, g, t)
                pack_pairs(p_words, st)
            wgmma_fence()   # P^T's registers, before the product reads them
            issue_weighted(dv_acc, p_words, advanced_device(dot_desc, offset))
            wgmma_commit()
            wait_all_but_one()   # dP^T
            score_gradients(dpt, st, smem, scalars, warp, g, t)
            pack_pairs(ds_words, dpt)
            if SUM_DQ:
                start_dq(smem, ds_at, ds_words, ds_desc, kt_desc, dq_acc, warp, g, t)
            wgmma_fence()   # dS^T's registers, before the product reads them
            issue_weighted(dk_acc, ds_words, advanced_device(qt_desc, offset))
            wgmma_commit()
            if SUM_DQ:
                h = h_kv * group + (x if HAS_MASK else step // per_head)
                turn = dq_turn(row_offsets, row_entries, b * kv_heads * group + h, q_tile, q_tiles, tile, own_k_tiles,
                               causal_offset)
                add_dq(DQ_SUM, TURNS, ds_desc, kt_desc, dq_acc, b * kv_heads * group + h, q_tile, q_tiles, turn, warp,
                       g, t, tid)
            wait_all_products()

        store_rows(dK, b * dk_sb + h_kv * dk_sh + (first_key + k0) * dk_sn, dk_sn, dk_acc, n_k - k0, float32(scale), warp,
                   g, t)
        store_rows(dV, b * dv_sb + h_kv * dv_sh + (first_key + k0) * dv_sn, dv_sn, dv_acc, n_k - k0, float32(1), warp,
                   g, t)

    name = f"wgmma_backward_dkdv_d{HEAD_DIM}_{ELEMENT}" + ("_causal" if CAUSAL else "") + (
        "" if DQ_MODE == "separate" else f"_dq_{DQ_MODE.replace('-', '_')}") + (
        ("_sparse" if PARTLY_MASKED else "_sparse_whole_tiles") if HAS_MASK else "") + ("_varlen" if VARLEN else "") + (
        mods_suffix(MODS))
    return backward_kernel(kernel, name, ("dK", "dV"), dict(DQ_SUM=np.float32, TURNS=np.int32, **MASK_ARRAYS,
                                                            row_offsets=np.int32, row_entries=np.int32,
                                                            **BOUNDS_ARRAYS, **slot_arrays(MODS)),
                           dkdv_blocks_per_multiprocessor(HEAD_DIM, DQ_MODE, MODS, ELEMENT_TEST, VARLEN))


@lru_cache(maxsize=None)
def make_dq_convert(HEAD_DIM, ELEMENT, VARLEN=False, REGISTER_ORDER=False):
    """dQ = scale DQ_SUM in 16-bit: one block of 128 threads per (query tile, batch * head), each thread a column
    pair of every ROWS_AT_ONCE-th row (consecutive threads, consecutive words: coalesced both ways).  VARLEN: batch
    entry b is packed sequence b, its rows of dQ from its first query on (``sequence_bounds``), its sum's slab laid
    out as a batch entry's.  REGISTER_ORDER: each slab is the bulk modes' two halves in register order
    (``register_order_word``; consecutive threads read 8 bytes 16 apart), else rows of d."""
    sequence = sequence_bounds(VARLEN)[0]
    _, pack = sixteen_bit_ops(ELEMENT)
    PAIRS = HEAD_DIM // 2
    ROWS_AT_ONCE = WARPGROUP // PAIRS
    # Where a row's pairs do not divide the block (d = 96: two rows of 48 at once), the threads past the last whole
    # row have none; the test is not compiled where they do (d = 16, 32, 64, 128).
    ALL_BUSY = ROWS_AT_ONCE * PAIRS == WARPGROUP

    def kernel(DQ_SUM, dQ, dq_sb, dq_sh, dq_sn, heads, n_q, q_tiles, scale, q_bounds, q_step, k_bounds, k_step):
        q_tile, h, b, bh = tile_coordinates(cuda.blockIdx.x, q_tiles, heads)
        first_query, _, n_q, _, _ = sequence(b, q_bounds, q_step, k_bounds, k_step, n_q, n_q, 0, 0, 0)
        tid = cuda.threadIdx.x
        column = 2 * (tid % PAIRS)
        first_row = tid // PAIRS if ALL_BUSY or tid < ROWS_AT_ONCE * PAIRS else BLOCK_N
        for r in range(first_row, BLOCK_N, ROWS_AT_ONCE):
            row = q_tile * BLOCK_N + r
            if row < n_q:
                if REGISTER_ORDER:
                    at = (bh * q_tiles + q_tile) * BLOCK_N * HEAD_DIM + register_order_word(r, column, HEAD_DIM)
                else:
                    at = (bh * q_tiles * BLOCK_N + row) * HEAD_DIM + column
                store_word(dQ, (b * dq_sb + h * dq_sh + (first_query + row) * dq_sn + column) // 2,
                           pack(DQ_SUM[at] * float32(scale), DQ_SUM[at + 1] * float32(scale)))

    return Kernel(kernel, f"wgmma_backward_dq_convert_d{HEAD_DIM}_{ELEMENT}" + ("_varlen" if VARLEN else "")
                  + ("_register_order" if REGISTER_ORDER else ""),
                  arrays=dict(DQ_SUM=np.float32, dQ=np.uint32, **BOUNDS_ARRAYS), floats=("scale",),
                  launch_bounds=(WARPGROUP, 1))


@lru_cache(maxsize=None)
def make_wgmma_dq(HEAD_DIM, ELEMENT, CAUSAL, HAS_MASK=False, PARTLY_MASKED=True, VARLEN=False, MODS=None,
                  TABLE_REACH=None):
    """dQ: one warpgroup per (query tile, batch, query head); see the module docstring.  HAS_MASK: a block mask
    lists the key tiles each query tile visits and the order of the blocks (the wgmma forward's lists at one
    warpgroup, ``MASK_TILES``), as in the forward; PARTLY_MASKED, VARLEN and MODS as the dK/dV kernel's (a block
    past its sequence's queries leaves before any barrier; a score_mod's dS = P o (dP - D) o d score_mod / d score
    in ``score_gradients``).  TABLE_REACH = D (MODS a lone ``relative_position_bias`` of a (H, 2 D + 1) table): dS
    also summed into the table's bins (``fast/bias_table.py``), written to TABLE_SUMS (a row of 2 D + 1 per block)."""
    assert not (VARLEN and HAS_MASK), "packed sequences take no block mask"
    assert TABLE_REACH is None or (MODS is not None and not VARLEN), "a table's bins: a score_mod, no packed sequences"
    assert MODS is None or not VARLEN, "mods: not with packed sequences yet"
    assert MODS is None or not MODS.has_mask or HAS_MASK, "a mask_mod's tiles come as lists (HAS_MASK)"
    sequence, lse_row = sequence_bounds(VARLEN)
    ACC_REGISTERS, TILE_WORDS, start_tile, issue_scores, pack_pairs, issue_weighted, store_rows = steps(HEAD_DIM,
                                                                                                       ELEMENT)
    ELEMENT_TEST = HAS_MASK and PARTLY_MASKED
    SCORE_MOD = MODS is not None and MODS.has_score
    ENTRY_TEST = ELEMENT_TEST or SCORE_MOD      # each entry tested (a score_mod decides every score)
    list_bounds, listed = tile_list(PARTLY_MASKED)
    hidden_entries = element_test(CAUSAL, False, MODS, HAS_MASK and reads_layout(PARTLY_MASKED))
    mod_weight = entry_steps(MODS)[2]
    TABLE = TABLE_REACH is not None
    if TABLE:
        zero_bins, stash_gradients, add_diagonals, write_bins = table_steps(TABLE_REACH, WARPGROUP, BLOCK_N, BLOCK_N)
        TABLE_BINS = 2 * TABLE_REACH + 1

    def gradient_entry(i):
        """(SCORE_MOD) ``entry(s, dp, lse2, d_i, hidden, q0, k0, warp, g, t, mod_args)``: register i of dP to dS = P (dP
        - D) d score_mod / d score (``mod_weight``), 0 where bit i of ``hidden`` is set.  One function per register,
        written out by ``unrolled``: NVVM leaves a loop whose body calls a mod rolled, and S and dP indexed at run
        time go to local memory."""

        @inlined_device_function
        def entry(s, dp, lse2, d_i, hidden, q0, k0, n_q, n_k, warp, g, t, mod_args):
            r = (i % 4) // 2
            row, key = lane_entry(i, g, t, warp)
            p, slope = mod_weight(s[i], lse2[r], not (hidden >> uint32(i)) & uint32(1), inside(q0 + row, n_q),
                                  inside(k0 + key, n_k), mod_args)
            dp[i] = p * slope * (dp[i] - d_i[r])

        return entry

    mod_gradients = unrolled([gradient_entry(i) for i in range(S_REGISTERS)]) if SCORE_MOD else None

    # ---- which query tile a block takes, and which key tiles it visits (the forward's steps of the same names) ----
    @inlined_device_function
    def block_tile(tile_order, q_tiles, heads):
        """(q0, head, batch, batch*heads index): with a block mask, tile ``tile_order[block]`` (longest lists
        first), else ``query_tile``'s."""
        if HAS_MASK:
            tile, h, b, bh = tile_coordinates(tile_order[cuda.blockIdx.x], q_tiles, heads)
            return tile * BLOCK_N, h, b, bh
        return query_tile(cuda.blockIdx.x, q_tiles, heads, CAUSAL, BLOCK_N)

    @inlined_device_function
    def key_tiles(tile_offsets, q0, bh, q_tiles, n_q, n_k, causal_offset):
        """(first, n_tiles): with a block mask, entries first .. first + n_tiles - 1 of the lists; else key tiles
        0 .. n_tiles - 1 (causal: none beyond the last row's diagonal)."""
        if HAS_MASK:
            return list_bounds(tile_offsets, bh, q_tiles, q0 // BLOCK_N)
        n_tiles = ceil_div(n_k, BLOCK_N)
        if CAUSAL:  # no key beyond the last row's diagonal
            n_tiles = min(n_tiles, max(0, ceil_div(min(q0 + BLOCK_N, n_q) + causal_offset, BLOCK_N)))
        return 0, n_tiles

    @inlined_device_function
    def key_tile(tile_entries, first, j, n_tiles):
        """The first key of the j-th key tile visited, and whether the mask covers it only partly (key 0 past the
        list's end, where nothing is copied)."""
        if HAS_MASK:
            if j >= n_tiles:
                return int64(0), False
            return listed(tile_entries, first + j)
        return j * BLOCK_N, False

    @inlined_device_function
    def score_gradients(s, dp, lse2, d_i, k0, q0, n_q, n_k, causal_offset, c_log2, masked, partly, layout, warp, g,
                        t, mod_args):
        """s: S -> P = exp2(c S - lse), dp: dP -> dS = P o (dP - D); both 0 where the key may not be seen (in a
        tile a block mask or mask_mod covers only partly, by the element test).  With a score_mod, P =
        exp2(score_mod(scale S) log2(e) - lse) and dS = P o (dP - D) o d score_mod / d score (``mod_weight``, its
        results used only where the entry is allowed; tested where the tile is ``masked`` or, for a score_mod, has
        rows past N_q)."""
        hidden = (hidden_entries(q0, k0, n_q, n_k, causal_offset, partly, layout, warp, g, t, mod_args)
                  if ENTRY_TEST and (masked or (SCORE_MOD and q0 + BLOCK_N > n_q)) else uint32(0))
        if SCORE_MOD:
            mod_gradients(s, dp, lse2, d_i, hidden, q0, k0, n_q, n_k, warp, g, t, mod_args)
            return
        for i in range(S_REGISTERS):
            row, key = lane_entry(i, g, t, warp)
            r = (i % 4) // 2
            p = exp2(cuda.fma(s[i], c_log2, -lse2[r]))
            if ELEMENT_TEST:
                if (hidden >> uint32(i)) & uint32(1):
                    p = float32(0)
            elif masked and (k0 + key >= n_k or (CAUSAL and k0 + key > q0 + row + causal_offset)):
                p = float32(0)
            dp[i] = p * (dp[i] - d_i[r])

    def kernel(Q, K, V, dO, LSE, D, dQ, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, do_sb, do_sh, do_sn,
               dq_sb, dq_sh, dq_sn, heads, group, n_q, n_k, q_tiles, causal_offset, scale, scale_log2, tile_offsets,
               tile_entries, tile_order, M, mask_rows, mask_cols, mask_t_r, mask_t_c, q_bounds, q_step, k_bounds,
               k_step, bottom_right, lse_sb, lse_sh, MOD0, MOD1, MOD2, MOD3, TABLE_SUMS):
        # As the dK/dV kernel's; key/value head h // group serves query head h.  HAS_MASK: the key tiles of query
        # tile qt of head bh are tile_entries[tile_offsets[bh (q_tiles + 1) + qt] ...], block i runs tile
        # tile_order[i]; placeholders without a mask.  VARLEN: the sequences' bounds, MODS: the mods' arrays, as the
        # dK/dV kernel's.
        q0, h, b, bh = block_tile(tile_order, q_tiles, heads)
        lse_rows = n_q   # of lse and D per (batch, head), or per head over the packed sequences (VARLEN)
        first_query, first_key, n_q, n_k, causal_offset = sequence(b, q_bounds, q_step, k_bounds, k_step, n_q, n_k,
                                                                   causal_offset, bottom_right, 0)
        if VARLEN and q0 >= n_q:   # the grid covers the longest sequence; the whole block leaves, before any barrier
            return
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(0, uint32)
        base = shared_address(smem)
        pad = first_atom_words(base)
        q_at, do_at, kv_at = pad, pad + TILE_WORDS, pad + 2 * TILE_WORDS   # stage s: K_j, V_j at kv_at + s 2 TILE_WORDS
        q_desc, do_desc = k_major_descriptor(base + q_at * 4), k_major_descriptor(base + do_at * 4)
        k_desc, v_desc = k_major_descriptor(base + kv_at * 4), k_major_descriptor(base + (kv_at + TILE_WORDS) * 4)
        kt_desc = mn_major_descriptor(base + kv_at * 4)   # K_j as dQ's B: the same bytes, MN-major

        warp, g, t = warp_lane(tid)
        lse2 = cuda.local.array(2, float32)   # this lane's rows g and g + 8 (of its warp's 16): lse in log2 units
        d_i = cuda.local.array(2, float32)
        lse_first = lse_row(bh, b, h, first_query, lse_rows, lse_sb, lse_sh)   # this head's lse (and D) row 0
        for r in range(2):
            row = q0 + 16 * warp + g + 8 * r
            lse2[r] = log2_lse(LSE[lse_first + row]) if row < n_q else float32(math.inf)
            d_i[r] = D[lse_first + row] if row < n_q else float32(0)
        first, n_tiles = key_tiles(tile_offsets, q0, bh, q_tiles, n_q, n_k, causal_offset)
        k_first = b * k_sb + (h // group) * k_sh + first_key * k_sn
        v_first = b * v_sb + (h // group) * v_sh + first_key * v_sn

        dq_acc = cuda.local.array(ACC_REGISTERS, float32)
        s = cuda.local.array(S_REGISTERS, float32)
        dp = cuda.local.array(S_REGISTERS, float32)
        ds_words = cuda.local.array(A_WORDS, uint32)   # dS, packed: the A operand of dQ's product
        for i in range(ACC_REGISTERS):
            dq_acc[i] = float32(0)

        if n_tiles > 0 or not (HAS_MASK or VARLEN):   # (a block mask, or a sequence without keys: dQ = 0, no copies)
            start_tile(smem, q_at, Q, b * q_sb + h * q_sh + (first_query + q0) * q_sn, q_sn, n_q - q0, tid)
            start_tile(smem, do_at, dO, b * do_sb + h * do_sh + (first_query + q0) * do_sn, do_sn, n_q - q0, tid)
        if n_tiles > 0:
            k0 = key_tile(tile_entries, first, 0, n_tiles)[0]
            start_tile(smem, kv_at, K, k_first + k0 * k_sn, k_sn, n_k - k0, tid)
            start_tile(smem, kv_at + TILE_WORDS, V, v_first + k0 * v_sn, v_sn, n_k - k0, tid)
        copy_async_commit()
        c_log2 = float32(scale_log2)
        layout = (M, bh, mask_rows, mask_cols, mask_t_r, mask_t_c)
        mod_args = (b, h, float32(scale), MOD0, MOD1, MOD2, MOD3)   # (``fast.mod_steps.entry_steps``)
        table_at = kv_at + 4 * TILE_WORDS   # (TABLE: after the tiles)
        low = high = float32(0)   # (TABLE: this thread's sums of the edge bins)
        if TABLE:
            zero_bins(smem, table_at, tid)
        for j in range(n_tiles):
            stage = j & 1
            k0, partly = key_tile(tile_entries, first, j, n_tiles)
            k1 = key_tile(tile_entries, first, j + 1, n_tiles)[0]   # the next tile's (if any)
            copy_async_wait_all()   # Q_i, dO_i and K_j, V_j landed, for the tensor cores too; every warp done
            fence_proxy_async()     # with tile j - 1's products, so their stage may be refilled
            cuda.syncthreads()
            if j + 1 < n_tiles:
                at = kv_at + (stage ^ 1) * 2 * TILE_WORDS
                start_tile(smem, at, K, k_first + k1 * k_sn, k_sn, n_k - k1, tid)
                start_tile(smem, at + TILE_WORDS, V, v_first + k1 * v_sn, v_sn, n_k - k1, tid)
            copy_async_commit()
            offset = stage * 8 * TILE_WORDS   # bytes of a stage: K_j, then V_j
            issue_scores(s, q_desc, advanced_device(k_desc, offset), dp, do_desc, advanced_device(v_desc, offset))
            wait_all_products()
            masked = (CAUSAL and k0 + BLOCK_N - 1 > q0 + causal_offset) or k0 + BLOCK_N > n_k or partly
            score_gradients(s, dp, lse2, d_i, k0, q0, n_q, n_k, causal_offset, c_log2, masked, partly, layout, warp, g,
                            t, mod_args)
            if TABLE:
                stash_gradients(smem, table_at, dp, warp, g, t)
            pack_pairs(ds_words, dp)
            wgmma_fence()   # dS's registers, before the product reads them
            issue_weighted(dq_acc, ds_words, advanced_device(kt_desc, offset))
            wgmma_commit()
            if TABLE:   # under dQ's product
                cuda.syncthreads()   # every lane's dS is in the tile
                low, high = add_diagonals(smem, table_at, k0 - q0, low, high, tid)
            wait_all_products()

        if TABLE:
            write_bins(smem, table_at, low, high, TABLE_SUMS, (bh * q_tiles + q0 // BLOCK_N) * TABLE_BINS, tid)
        store_rows(dQ, b * dq_sb + h * dq_sh + (first_query + q0) * dq_sn, dq_sn, dq_acc, n_q - q0, float32(scale),
                   warp, g, t)

    return backward_kernel(kernel, f"wgmma_backward_dq_d{HEAD_DIM}_{ELEMENT}" + ("_causal" if CAUSAL else "") + (
        ("_sparse" if PARTLY_MASKED else "_sparse_whole_tiles") if HAS_MASK else "") + ("_varlen" if VARLEN else "")
                   + mods_suffix(MODS) + (f"_table{TABLE_REACH}" if TABLE else ""), ("dQ",),
                   dict(MASK_ARRAYS, tile_order=np.int32, **BOUNDS_ARRAYS, **slot_arrays(MODS), TABLE_SUMS=np.float32))


@dataclass(frozen=True)
class SummedDq:
    """The launches of a backward whose dK/dV kernel sums dQ: per call, ``preprocess(stream, O, dO, D)``,
    ``dkdv(stream, Q, K, V, dO, LSE, D, dK, dV, DQ_SUM, TURNS)`` with DQ_SUM (``sum_words`` float32) and TURNS
    (``turns`` int32) zeroed, then ``convert(stream, DQ_SUM, dQ)``; packed sequences add their bounds to both,
    ``(..., q_bounds, k_bounds)``."""
    preprocess: Launch
    dkdv: Launch
    convert: Launch
    sum_words: int
    turns: int


#: How the backward sums dQ when the environment names a way (``NUMBA_FLASH_WGMMA_DQ``, one of ``DQ_MODES``), for
#: every call of the process, to measure the ways side by side; an unordered one ("atomic", "bulk-atomic") then serves
#: the calls that allow it (``deterministic=False``), the others staying on "separate".  None (unset): ``dq_mode``.
DQ_MODE = os.environ.get("NUMBA_FLASH_WGMMA_DQ") or None
#: Key tiles of 128 keys from which a causal call's bulk-atomic backward beats "separate" at d > 64 (``dq_mode``).
BULK_CAUSAL_KEY_TILES = 16


def dq_mode(call, deterministic):
    """The ``DQ_MODES`` entry a call runs in.  By default the fastest way measured that ``deterministic`` allows
    (H100, 2026-12-07, bfloat16, nine shapes, d = 64 and 128, dense and causal, GQA, the ways in one process:
    ``experiments/tuning/results/backward_dq_modes_h100.md``):

    * deterministic: "bulk-ordered" dense at d = 128 (0.78-0.93x the time of "separate" over 16-160 key tiles of 128,
      rotated or not (``rotates``); 1.00x over 8), else "separate" (dense at d = 64 "bulk-ordered" took 1.12-1.15x
      its time, causal 1.10-1.50x: the turns go from the diagonal down, so the grid dispatches the shortest key
      tiles first and the longest start last; "ordered" 1.76-3.18x);
    * ``deterministic=False``: "bulk-atomic" where it beat "separate" (0.74-0.88x its time dense, 0.84-0.88x causal at
      d = 128 over 32-64 key tiles of 128), else "separate" (causal at d <= 64, 1.04-1.15x; causal over 8 key tiles
      at d = 128, 1.03x), and outside the bulk kernel's scope (``dq_mode_for``): "atomic", the other unordered
      way, lost to "separate" everywhere (1.37-2.13x its time).

    ``DQ_MODE`` set: that mode (within determinism's bounds), or its one-warpgroup twin outside the bulk kernel's
    scope."""
    if DQ_MODE is None:
        if deterministic:
            fast = "bulk-ordered" if not call.causal and call.head_dim > 64 else "separate"
        else:
            key_tiles = cdiv(call.longest_k, specialized_dkdv.KEY_ROWS)
            bulk_pays = not call.causal or (call.head_dim > 64 and key_tiles >= BULK_CAUSAL_KEY_TILES)
            fast = "bulk-atomic" if bulk_pays else "separate"
        return "separate" if dq_mode_for(call, fast) != fast else fast
    environment_choice("NUMBA_FLASH_WGMMA_DQ", DQ_MODE, DQ_MODES)
    return dq_mode_for(call, "separate" if DQ_MODE in UNORDERED_MODES and deterministic else DQ_MODE)


def rotates(call):
    """Whether the bulk-ordered kernel's dense key tiles may start apart along the query tiles
    (``specialized_dkdv.py``'s docstring): where every block of a head (one per key tile of 128, one block a
    multiprocessor) fits in half the multiprocessors, so that a block may wait for one dispatched after it: those
    blocks are resident at once even while other streams' kernels hold up to half the GPU (a process that MPS or a
    green context limits to fewer multiprocessors than the device has should set ``NUMBA_FLASH_WGMMA_DQ=separate``);
    never in the simulator, which runs the blocks one after another."""
    key_tiles = cdiv(call.longest_k, specialized_dkdv.KEY_ROWS)
    return not in_simulator() and key_tiles <= device_limits().multiprocessors // 2


def dq_mode_for(call, mode):
    """The mode a call runs in when ``mode`` is asked for: a bulk mode's dK/dV kernel (two warpgroups, dQ_i's
    columns split between them) takes no block mask or mods yet, and head dims whose halves fit one 64-column tile
    of K (``splits_dq_columns``); elsewhere the one-warpgroup mode that sums dQ the same way (ordered or not)."""
    if key_warpgroups(mode) > 1 and (has_tile_lists(call) or call.mods or not splits_dq_columns(call.head_dim)):
        return mode[len("bulk-"):]
    return mode


def chosen_for(call, block_sizes):
    """Whether ``algorithm="flash2"`` runs this call's backward on wgmma: where it runs the forward
    (``forward.chosen_for``, the one source of the pick, with this kernel's scope): on a Hopper GPU, for calls in
    its scope whose caller named no tile sizes, at the (head dim, causal) pairs where flash2 takes the wgmma forward
    (``forward.AUTOMATIC_SCOPE``: d = 64, 96 and 128), with no block mask or one of whole 64 x 64 tiles
    (``forward.whole_tiles``: here too the element test compiled out), so that a call's two directions share a
    kernel family (1.32-1.97x the mma.sync backward on an H100, 2026-12-05; with a 10%-dense mask of 128 x 128
    blocks 2.1-3.9x, H200, 2026-12-05); the other head dims of its scope, and other block masks, run when asked
    for (``algorithm="wgmma"``)."""
    return forward.chosen_for(call, block_sizes, "backward")


def backward_launches(call, o_strides, do_strides, do_aligned, dq_mode="separate", table_reach=None):
    """The wgmma backward for a validated call in its scope: with ``dq_mode`` "separate", three ``Launch``es
    (preprocess, dK/dV, dQ) taking per call what the mma.sync backward's take (``fast/backward.backward_launches``);
    otherwise a ``SummedDq``.  ``table_reach`` (``table_fused``): the dQ kernel also sums the relative-bias table's
    gradient (``fast/bias_table.py``), into a float32 array of ``bias_table.table_rows`` words passed after dQ."""
    reason = out_of_scope(call, "backward")
    if reason is None and not (do_aligned and all(s % 8 == 0 for s in (do_strides.batch, do_strides.head,
                                                                          do_strides.row))):
        reason = "do must have rows that start on 16-byte boundaries for the wgmma backward"
    if reason is not None:
        raise ValueError(f"algorithm='wgmma': {reason}")
    assert dq_mode in DQ_MODES and dq_mode_for(call, dq_mode) == dq_mode, dq_mode   # (``dq_mode``)
    groups = key_warpgroups(dq_mode)
    if not in_simulator():
        enable_sm90a()
    words = word_extent(call)
    (qs, ks, vs), dq_s, dkv_s = call.strides, call.result_strides("q"), call.result_strides("kv")
    q_shape, kv_shape = call.kernel_shapes
    rows = lse_slabs(call) * call.n_q   # of lse and D
    operands = dict(q_sb=qs.batch, q_sh=qs.head, q_sn=qs.row, k_sb=ks.batch, k_sh=ks.head, k_sn=ks.row,
                    v_sb=vs.batch, v_sh=vs.head, v_sn=vs.row, do_sb=do_strides.batch, do_sh=do_strides.head,
                    do_sn=do_strides.row, group=call.group, n_q=call.n_q, n_k=call.n_k,
                    causal_offset=call.causal_offset, scale=call.scale, scale_log2=call.scale * LOG2_E,
                    **sequence_arguments(call), **slot_arguments(call.mods))
    bounds, bounds_extents = sequence_arrays(call)   # (packed sequences: cu_seqlens_q and _k, after the rest)
    extents = dict(Q=words(q_shape, qs), K=words(kv_shape, ks), V=words(kv_shape, vs), dO=words(q_shape, do_strides),
                   LSE=rows, D=rows, **bounds_extents)
    inputs = ("Q", "K", "V", "dO", "LSE", "D")
    varlen = sequence_mode(call)
    # Packed sequences: the longest one's tiles for every sequence (the blocks past a sequence's end leave at once).
    k_tiles, q_tiles = cdiv(call.longest_k, groups * BLOCK_N), cdiv(call.longest_q, BLOCK_N)
    # (the bulk modes order each half of dQ_i's columns by a counter of its own)
    sum_words, turns = call.batch_heads * q_tiles * BLOCK_N * call.head_dim, call.batch_heads * q_tiles * groups
    # A block mask's lists (placeholders without one): query tiles per key tile for the dK/dV kernel, key tiles per
    # query tile (the forward's) for the dQ kernel and for the order of the dK/dV kernel's adds ("ordered").
    rows_lists = block_mask_arguments(call, MASK_TILES, "forward")
    dkdv_operands = dict(operands, dk_sb=dkv_s.batch, dk_sh=dkv_s.head, dk_sn=dkv_s.row, dv_sb=dkv_s.batch,
                         dv_sh=dkv_s.head, dv_sn=dkv_s.row, kv_heads=call.kv_heads, k_tiles=k_tiles, q_tiles=q_tiles,
                         **block_mask_arguments(call, MASK_TILES, "dkdv"), row_offsets=rows_lists["tile_offsets"],
                         row_entries=rows_lists["tile_entries"],
                         rotates=int(rotates(call)))
    dkdv_extents = dict(extents, dK=words(kv_shape, dkv_s), dV=words(kv_shape, dkv_s), DQ_SUM=sum_words, TURNS=turns)
    has_mask = has_tile_lists(call)   # a block mask's, or a mask_mod's classified tiles
    compiled_mods = mod_steps(*call.mods, backward=True) if call.mods else None
    if groups > 1:   # the bulk modes' kernel of three warpgroups with roles
        dkdv_kernel = specialized_dkdv.make_specialized_dkdv(call.head_dim, call.precision, bool(call.causal),
                                                             dq_mode not in UNORDERED_MODES, varlen)
        dkdv_threads, dkdv_shared = specialized_dkdv.THREADS, specialized_dkdv.shared_bytes(call.head_dim)
    else:
        dkdv_kernel = make_wgmma_dkdv(call.head_dim, call.precision, bool(call.causal), dq_mode, has_mask,
                                      partly_masked_tiles(call, MASK_TILES, "dkdv"), varlen, compiled_mods)
        dkdv_threads, dkdv_shared = WARPGROUP, shared_bytes(call.head_dim, dq_mode)
    dkdv_grid = k_tiles * call.batch * call.kv_heads
    preprocess = preprocess_launch(call, o_strides, do_strides)
    if dq_mode != "separate":
        dkdv = Launch(dkdv_kernel, dkdv_grid, dkdv_threads, dkdv_shared, dkdv_operands,
                      inputs + ("dK", "dV", "DQ_SUM", "TURNS") + bounds, dkdv_extents)
        convert = Launch(make_dq_convert(call.head_dim, call.precision, varlen, groups > 1), q_tiles * call.batch_heads,
                         WARPGROUP,
                         0, dict(dq_sb=dq_s.batch, dq_sh=dq_s.head, dq_sn=dq_s.row, heads=call.heads, n_q=call.n_q,
                                 q_tiles=q_tiles, scale=call.scale, **sequence_arguments(call)),
                         ("DQ_SUM", "dQ") + bounds, dict(DQ_SUM=sum_words, dQ=words(q_shape, dq_s), **bounds_extents))
        return SummedDq(preprocess, dkdv, convert, sum_words, turns)
    shared = shared_bytes(call.head_dim)
    dkdv = Launch(dkdv_kernel, dkdv_grid, WARPGROUP, shared,
                  dict(dkdv_operands, DQ_SUM=placeholder(np.float32), TURNS=placeholder(np.int32)),
                  inputs + ("dK", "dV") + bounds, dkdv_extents)
    dq_kernel = make_wgmma_dq(call.head_dim, call.precision, bool(call.causal), has_mask,
                              partly_masked_tiles(call, MASK_TILES, "forward"), varlen, compiled_mods, table_reach)
    dq_operands = dict(operands, dq_sb=dq_s.batch, dq_sh=dq_s.head, dq_sn=dq_s.row, heads=call.heads, q_tiles=q_tiles,
                       **rows_lists)
    if table_reach is None:
        dq = Launch(dq_kernel, q_tiles * call.batch_heads, WARPGROUP, shared,
                    dict(dq_operands, TABLE_SUMS=placeholder(np.float32)), inputs + ("dQ",) + bounds,
                    dict(extents, dQ=words(q_shape, dq_s)))
    else:
        assert table_fused(call, dq_mode, table_reach)
        dq = Launch(dq_kernel, q_tiles * call.batch_heads, WARPGROUP,
                    shared + 4 * table_words(table_reach, WARPGROUP, BLOCK_N, BLOCK_N), dq_operands,
                    inputs + ("dQ", "TABLE_SUMS"),
                    dict(extents, dQ=words(q_shape, dq_s),
                         TABLE_SUMS=table_rows(call.batch_heads, q_tiles, table_reach)))
    return preprocess, dkdv, dq


def table_fused(call, dq_mode, reach):
    """Whether this backward's dQ kernel can sum the gradient of a relative-bias table of reach D = ``reach``
    (``fast/bias_table.py``): dQ in a kernel of its own, no packed sequences, a table of at most 2 FUSED_REACH + 1
    bins."""
    return dq_mode == "separate" and not sequence_mode(call) and 0 <= reach <= FUSED_REACH
