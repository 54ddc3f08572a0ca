"""The attention forward on Hopper's warpgroup tensor cores: step 2 of the README's Hopper plan.

``numba_flash.attention(..., algorithm="flash2")`` runs it by itself on a GPU of compute capability
9.0 for the calls in its scope (``out_of_scope``, ``chosen_for``), and ``algorithm="wgmma"`` asks for
it outright; every other call, and every other GPU, stays on the ``mma.sync`` kernel in
``kernels/fast`` (the reference it is tested against).  Scope: float16 and bfloat16, d a multiple
of 16 up to 256 (``common.FORWARD_HEAD_DIMS``; flash2 takes it at d = 64, 96, 128 and 256), dense or
causal (top-left or bottom-right), block masks (below; flash2 takes those of whole 64 x 64 tiles,
``whole_tiles``), grouped heads, any strides with contiguous 16-byte rows, a positive scale, NaN
propagated as on the other path, packed sequences (``attention_varlen``; below); no dropout yet.
``tests/test_hopper.py`` (and ``tests/test_hopper_varlen.py``) checks it against the float64
reference in the simulator (through ``wgmma.py``'s twins, which read operands by its layout table)
and on a Hopper GPU, where
``experiments/tuning/wgmma_layouts.py`` confirmed the table (2026-12-01; at d = 64 and 128 only:
the m64n96 read of V below is the twins' so far, its cases there not yet run on a GPU).

A head dim that is not a layout's width (64, 128, 256) runs on the shared-memory layout of the next one
(d = 96 on d = 128's two swizzled 64-column tiles, d = 144..240 on d = 256's four, ``common.layout_dim``), the
pad columns zero-filled by the same cp.async copies (source size 0: no extra reads); the products take only
d: S in d / 16 k-steps, O += P V as m64n{d}k16, and the stores write d columns.

The head-dim-dependent choices, each in one place: the layout's width (``common.layout_dim``); the copier's
column groups (``common.tile_copier``: two of 128 columns at d > 128 in one warpgroup); the K/V stages
(``uses_ring``); warpgroups per block (``DEFAULT_WARPGROUPS``: two at d > 128); O's slices
(``forward_steps.value_slices``: above d = 128, columns 0..127 and 128..d-1, two accumulators and two products per
k-step); the register cap (``blocks_per_multiprocessor``).  The key tile stays 64 keys and the swizzle 128 bytes at
every d.  (FlashAttention-3 takes 80-key tiles at d = 256; here a tile is the copier's and the descriptors' 64 rows,
and at 64 keys the block's shared memory, 193 KB with two warpgroups, already leaves room for no second block.)

One thread block is one warpgroup (128 threads) and owns 64 query rows, or two warpgroups that own
64 each and share every K/V tile (``make_wgmma_forward``'s WARPGROUPS); each warp owns 16 rows, and
its lanes hold S and O in the layout of ``mma.sync``'s C fragments (``wgmma.py``), so the online
softmax below is the fast forward's, over 64-key tiles::

    Q_i -> shared (swizzled, once); K_0, V_0 -> their buffers                  cp.async
    for j in key tiles:
        land K_j, V_j; start K_{j+1}, V_{j+1} into tile j - 1's buffers         cp.async, one barrier
        S = Q_i K_j^T                    wgmma m64n64k16 x d/16, both operands from shared memory
        mask (causal diagonal, the last tile's keys past N_k), m, P = exp2(c S - m), l, alpha
        (a tile the causal diagonal crosses whose V_j holds a NaN: its rows cleaned and flagged first, below)
        O = alpha O;  O += P V_j         wgmma m64n{d}k16 x 4, P from registers, V_j transposed
    O / l, lse

With a block mask (``numba_flash.BlockMask``) the host lists, per query tile (64 rows a warpgroup: 64 or
128), the key tiles of 64 keys it visits, in increasing order, and orders the blocks by the length of their
lists, longest first (``sparsity/tile_lists.py``, ``kernels/fast/common.block_mask_arguments``: the mma.sync
forward's lists, for this kernel's tiles).  "for j in key tiles" then runs over the list, through the same
buffers and copies (``key_tiles``, ``key_tile``, ``block_tile``); a tile the mask covers only partly takes the
element test against the uint8 block layout in the mask step (``hidden_entries``, through
``kernels/fast/common.allowed``), and the NaN pass of a diagonal tile; causal tiles are masked as before, and a
mask never lists a tile wholly above the diagonal.  A query tile whose list is empty copies nothing and writes
O = 0 and lse = -inf, as does a row that sees no key in the tiles its block visits: the mma.sync forward's
results.  Both are compile-time flags (``make_wgmma_forward``'s HAS_MASK, PARTLY_MASKED): a mask of whole
tiles (blocks of multiples of 64 rows and keys, one warpgroup) compiles the element test out, leaving the dense
kernel's steps over a list, and without a mask the kernels compile as before (their PTX instructions unchanged,
sm_90a; the mask's placeholder arguments added to the parameter list).  Departures from the dense kernel: the
blocks take the lists' order (longest first) instead of the causal grid's, and a kernel with the element test has
no register cap (``blocks_per_multiprocessor``).  Not yet run on a GPU.

At d = 128 (and every d of the 128-column layout) the K/V tiles go round a ring of three buffers instead
(``uses_ring``): K_{j+1} is started into V_{j-1}'s buffer after the first barrier, and V_{j+1} into K_j's after a
second one, once S_j is done (each tile its own commit group, so each barrier waits for the tile it needs alone).
A block then needs 66 KB of shared memory instead of 83, and three blocks fit on a multiprocessor instead of two:
1.10-1.19x faster (H200, ``experiments/tuning/results/bench_ring_h200.md``).

Each product group is waited for before its accumulator is read (``wgmma_wait(0)``).  A second loop
(``make_wgmma_forward``'s OVERLAP, ``NUMBA_FLASH_WGMMA_OVERLAP=1``) issues S_{j+1} = Q K_{j+1}^T before the softmax of
S_j, so the tensor cores work while the warpgroup's other units do: half of step 3 of the plan.  On the H200 it took
1.19-1.34x the plain loop's time at d = 64 (its registers leave two blocks per multiprocessor instead of the plain
loop's three or four: ``experiments/tuning/results/bench_wgmma_overlap_h200.md``), so it stays off.  The other half of
step 3 starts with the blocks of two warpgroups (``WARPGROUPS=2``: on the H200 0.95-1.03x one warpgroup's time at d = 64
and 1.08-1.15x at d = 128, 2026-12-02 before the issue-slot work below,
``experiments/tuning/results/bench_wgmma_warpgroups{1,2}_h200.md``; so not the default).  Warpgroups that take turns,
one's softmax under the other's products, with a producer warpgroup copying the tiles, are another kernel:
``specialized_forward.py`` (``NUMBA_FLASH_WGMMA_FORWARD=specialized``).  The loop's steps are the same named device
functions in every variant, and in that kernel (``forward_steps.py``).

What a key tile costs the issue slots matters as much as the products: at d = 64 a warpgroup's tile is 256
tensor-core cycles of work, and every warp of it issues the whole loop.  So the descriptors are built once
and advanced by constants (``tile_descriptors``, ``staged``, ``wgmma.advanced``), whole tiles are copied
without row tests (``start_tile``), and the stage is a bit: a full tile's path is 336 instructions at d = 64
and 417 at d = 128 (ptxas, sm_90a; 429 and ~600 before, ``experiments/tuning/results/sass_counts_wgmma.md``).

Packed sequences (``make_wgmma_forward``'s VARLEN): the block's first step reads its sequence's bounds with the
mma.sync kernels' device function (``fast.common.sequence_bounds``), after which every step above runs on the
sequence's lengths, causal offset and rows; the grid covers the longest sequence, and a block past its sequence's
last query tile leaves before any barrier.  flash2 takes it where it takes the batched call (``chosen_for``).
Departure from the dense kernel: none in the loop; the flag
compiles out of the kernels without it (their PTX instructions unchanged, sm_90a, 2026-12-05).

Score and mask mods (``numba_flash.mods``, ``make_wgmma_forward``'s MODS): the mma.sync forward's steps
(``fast.mod_steps.entry_steps``) in this kernel's mask step.  A mask_mod's tiles are classified on the host into the
block-mask lists above (empty tiles never visited, full ones without the test, partly covered ones testing each entry
with the mask_mod in ``hidden_entries``, ANDed with a block mask's); a score_mod replaces each allowed score by
score_mod(scale S) log2(e) before the softmax, whose scale is then 1, evaluated at every entry (hidden ones at
indices inside the sequences, then -inf), the element test run on the tiles that need it (mixed or ragged ones).
Without mods the kernels' PTX instructions are unchanged (sm_90a, 2026-12-06; MOD0 .. MOD3's placeholders added to the
parameter list).  flash2 takes this kernel with mods wherever it takes it without; not yet run on a GPU.

Barriers and fences, each where it sits:

* after a thread's ``cp.async`` copies land (``land_tiles``), ``fence_proxy_async``: the copies are
  ordinary writes, and the tensor cores read shared memory through the async proxy; then
  ``syncthreads``: every thread's part of the tile is there, and every warp has finished the products of
  tile j - 1 (each waited for its own), so its buffers may be refilled.  In the ring, a second such
  barrier after S_j: V_j has landed, and every warp is done with K_j, whose buffer takes V_{j+1}.  In a
  tile the causal diagonal crosses, the barrier after which V_j is read is ``syncthreads_or`` and also
  answers whether V_j holds a NaN:
  each thread tests the chunks of V_j it copied itself (its own copies are visible to it once it has
  waited for them), and the barrier ORs the answers, so the question costs no barrier of its own.
* only if it does: after the NaN pass rewrites V_j's rows (generic-proxy stores),
  ``fence_proxy_async`` and a second ``syncthreads``: the tensor cores must read the cleaned rows, and
  every lane its keys' flags.  0 * NaN = NaN in the tensor cores, so without the pass a NaN value row
  would reach rows the mask hides it from; with it, the allowed weights of a flagged key become NaN
  (``kernels/fast/common.py``, "NaN", does the same on the mma.sync path).
* ``wgmma_fence`` before the products of S (the zeroed accumulator) and of O (the rescaled
  accumulator and P's registers, written by ordinary instructions just before).
"""
import os
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from ...runtime.device import in_simulator
from ...runtime.launch import Kernel, Launch, inlined_device_function, unrolled, unrolled_or
from ...sparsity.tile_lists import listed_tile, reads_layout
from ...tiling import cdiv
from ..fast.common import (LOG2_E, NEG_INF, allowed, block_mask_arguments, ceil_div, has_tile_lists, lane_flags,
                           lse_slabs, nan_cleaner, pair_has_nan, partly_masked_tiles, sequence_arguments,
                           sequence_arrays, sequence_bounds, sequence_mode, tile_coordinates, warp_lane, word_extent)
from ..fast.mod_steps import entry_steps, inside, mod_steps, mods_suffix, slot_arguments, slot_arrays
from ..fast.primitives import copy_async_commit, copy_async_wait, copy_async_wait_all, load_vec4
from .common import (BLOCK_N, environment_choice, first_atom_words, k_major_descriptor, layout_dim,
                     mn_major_descriptor, out_of_scope, query_tile, tile_bytes, tile_copier)
from . import specialized_forward as specialized
from .forward_steps import P_WORDS, S_REGISTERS, row_and_key, tile_steps
from .wgmma import (advanced_device, enable_sm90a, fence_proxy_async, shared_address, staged_offset_device,
                    swizzle_128_device, wgmma_wait)

WARPGROUP = 128          # threads of a warpgroup
BLOCK_M = 64             # query rows per warpgroup: wgmma's M
WARPGROUP_COUNTS = (1, 2)  # warpgroups per block, sharing each K/V tile


def uses_ring(head_dim, overlap):
    """Whether the K/V tiles go round a ring of three buffers (K_0, V_0, K_1, V_1, ... into buffers 0, 1, 2, 0,
    ...), or sit in two stages of K and two of V.  The ring: at d = 128, where its 16 KB less a block makes room for a
    third block on a multiprocessor (``blocks_per_multiprocessor``), 1.10-1.19x faster dense and causal at (2, 16, 8192,
    128) in float16 and bfloat16; at d = 64, where registers allow four blocks either way, its second barrier a tile
    made it 0.94-0.96x (H200, 2026-12-03, ``experiments/tuning/results/bench_ring_h200.md``).  So for every head dim
    on the 128-column layout (d = 80-128: the same shared memory a tile; unmeasured below 128), and not for the
    overlapped loop, whose K_{j+1} is read while V_j waits.  Not on the 256-column layout either: there a block
    takes 161 KB of shared memory in two stages with one warpgroup, 193 KB with two, and the ring's 32 KB less makes
    room for no second block (227 KB a multiprocessor), so it would only add its barrier."""
    return layout_dim(head_dim) == 128 and not overlap


def kv_buffers(head_dim, overlap):
    """K/V tile buffers: three in the ring, else four."""
    return 3 if uses_ring(head_dim, overlap) else 4


def shared_bytes(head_dim, warpgroups=1, overlap=False):
    """Q (a 64-row tile per warpgroup), the K/V buffers (each on the layout of ``layout_dim(head_dim)`` columns), the
    NaN flags of V's rows, and slack to start the tiles on a 1024-byte boundary."""
    return (warpgroups + kv_buffers(head_dim, overlap)) * tile_bytes(head_dim) + 4 * BLOCK_N + 1024


@lru_cache(maxsize=None)
def make_wgmma_forward(D, ELEMENT, CAUSAL, OVERLAP=False, WARPGROUPS=1, HAS_MASK=False, PARTLY_MASKED=True,
                       VARLEN=False, MODS=None):
    """The kernel for head dim D (``common.FORWARD_HEAD_DIMS``: a multiple of 16 up to 256), ELEMENT "f16" or
    "bf16", causal or not, with a block mask or not.

    Its tiles sit in shared memory on the layout of LAYOUT_DIM = ``layout_dim(D)`` columns (64, 128 or 256), the
    columns past D zero (``common.tile_copier``), but the products take only D: S = Q K^T in D / 16 k-steps, and
    O += P V as m64n{D}k16 (above D = 128 in two slices, m64n128k16 and m64n{D - 128}k16: ``value_slices``), so
    that O holds D / 2 registers a thread and no pad column is multiplied (at D = 96 the MN-major V's second
    64-column tile is read half: the descriptor names the tiles, N how much of them).

    WARPGROUPS (1 or 2): warpgroups per block, each with its own 64 query rows (its Q tile, its accumulators),
    sharing every K/V tile the block copies: two halve the copies and the L2 reads per query row, for a block
    of 256 threads.  Everything else is per warpgroup as with one, and every barrier is the block's.

    OVERLAP: the scores of the next key tile are computed while this one's softmax runs (half of step 3 of
    the README's plan: FlashAttention-3's intra-warpgroup pipelining).  Without it, each step waits for its
    products::

        land K_j, V_j | S_j = Q K_j^T, wait | mask, softmax(S_j) | O = alpha O + P_j V_j, wait

    With it, S_0 is computed before the loop, and::

        land K_{j+1}, V_j | issue S_{j+1} | mask, softmax(S_j) | O = alpha O + P_j V_j | wait for both

    which costs a second score array (BLOCK_N / 2 registers) and moves each K tile one iteration earlier:
    K_{j+2} is copied at the top of iteration j into K_j's buffer (S_j was waited for in iteration j - 1),
    V_{j+1} into V_{j-1}'s.  P_j V_j is waited for before the loop turns: left in flight across the
    back-edge, the accumulator's loop-carried copies would read its registers during the product, and
    ptxas serialises every wgmma of the kernel then (its C7514 "Potential Performance Loss", seen with
    ptxas 13.0 at sm_90a).

    HAS_MASK: a block mask lists the key tiles of each query tile of ROWS rows, and the order of the query tiles
    (``sparsity/tile_lists.py``, as for the mma.sync forward): the loops above run over the list instead of every
    tile, through the same buffers (``key_tiles``, ``key_tile``, ``block_tile``).  PARTLY_MASKED (with HAS_MASK):
    some listed tile is only partly covered by the mask's blocks, so its scores take the element test against the
    uint8 block layout M (``mask``, ``kernels/fast/common.allowed``) and its V_j the NaN pass (as a tile the causal
    diagonal crosses); False when the mask's blocks are unions of whole tiles, which compiles the test out.
    Without a mask every step compiles as before: the PTX of the dense and causal kernels is the same but for the
    mask's arguments in the parameter list (unused placeholders, ``block_mask_arguments``).

    VARLEN: packed sequences of their own lengths (``fast.common.sequence_bounds``, the mma.sync kernels' step):
    batch entry b is sequence b, its rows read from the bounds arrays q_bounds and k_bounds, and from then on n_q,
    n_k and causal_offset are the sequence's (``sequence``, the block's first step), its rows offset by its first
    query and key, its lse rows where ``lse_row`` puts them.  A block past its sequence's last query tile leaves
    before its first copy (the grid covers the longest sequence), and one whose sequence has no key copies nothing
    and writes O = 0, lse = -inf.  Without it ``sequence`` returns the call's own lengths and rows 0, which the
    compiler folds away (the bounds' placeholder arguments added to the parameter list).

    MODS (``fast.mod_steps.ModSteps``, or None): a score_mod and/or mask_mod, the mma.sync forward's steps
    (``fast.mod_steps.entry_steps``) in this kernel's mask step.  A mask_mod's tiles come as the lists above
    (HAS_MASK: classified on the host, ``sparsity/mod_tiles.py``), its partly covered tiles (PARTLY_MASKED) testing
    each entry with it in ``hidden_entries``; a score_mod replaces every allowed score of every tile by its
    score_mod(scale S) in log2 units (so the softmax's scale is 1), the hidden ones (outside both sequences, the
    causal mask or the masks) by -inf, the mod evaluated at every entry without a branch (``entry_steps``).  A tile
    only the mask_mod cuts reads no block layout (``tile_lists.reads_layout``).  Without mods the
    steps compile as before (MOD0 .. MOD3 placeholders added to the parameter list).
    """
    assert not (VARLEN and HAS_MASK), "packed sequences take no block mask"
    assert MODS is None or not VARLEN, "mods: not with packed sequences yet"
    assert MODS is None or not MODS.has_mask or HAS_MASK, "a mask_mod's tiles come as lists (HAS_MASK)"
    SCORE_MOD = MODS is not None and MODS.has_score
    MASK_MOD = MODS is not None and MODS.has_mask
    mod_allows, mod_score, _ = entry_steps(MODS)
    assert VARLEN in (False, True), "the wgmma forward reads packed sequences, not a KV cache"
    sequence, lse_row = sequence_bounds(VARLEN)
    THREADS = WARPGROUP * WARPGROUPS
    ROWS = BLOCK_M * WARPGROUPS               # the block's query rows
    ELEMENT_TEST = HAS_MASK and PARTLY_MASKED   # a listed tile's scores may need the block mask's element test
    READS_LAYOUT = HAS_MASK and reads_layout(PARTLY_MASKED)   # ... against the block layout
    ENTRY_TEST = ELEMENT_TEST or SCORE_MOD      # each entry tested (a score_mod decides every score)
    (LOW_REGISTERS, HIGH_REGISTERS, HIGH_ARRAY, start_rows, issue_scores, mask_outside, online_softmax, poison_allowed,
     rescale_and_pack, issue_weighted_values, store_output, *_) = tile_steps(D, ELEMENT, CAUSAL)
    ROW_CHUNKS = D // 8                       # 16-byte chunks of a row of V that hold values (the rest are zeros)
    TILE_BYTES = tile_bytes(D)                # on the layout of layout_dim(D) columns
    TILE_WORDS = TILE_BYTES // 4
    cleaned = nan_cleaner(ELEMENT)
    has_nan = pair_has_nan(ELEMENT)
    flags_of_lane = lane_flags(BLOCK_N // 8)
    wait_all_products = wgmma_wait(0)
    RING = uses_ring(D, OVERLAP)
    BUFFERS = kv_buffers(D, OVERLAP)
    # In the ring, K_j and V_j land one at a time (each its own commit group; the newer may stay in flight); in
    # two stages each barrier waits for every copy.
    wait_for_landing = copy_async_wait(1) if RING else copy_async_wait_all

    # The tiles' cp.async copies (common.py): a thread's at own_chunk + g GROUP_WORDS + i PASS_WORDS.
    own_chunk, start_tile, PASSES, PASS_WORDS, GROUPS, GROUP_WORDS = tile_copier(D, THREADS)

    @inlined_device_function
    def land_tiles(smem, v_tile, ask_for_nan, tid):
        """The tile the loop needs next is in shared memory, for the tensor cores too: each thread waits for its
        own copies (``wait_for_landing``; in the ring, all but the newest tile's), ``fence_proxy_async``
        (cp.async's writes are ordinary ones; the tensor cores read through the async proxy), and the barrier (every thread's part is there, and every thread is past the work
        before it: the waits for the products that read the buffers about to be refilled).

        ``ask_for_nan`` (block-uniform): also whether the V tile at word ``v_tile`` holds a NaN, answered by
        the same barrier.  Each thread tests the chunks it copied there (its own copies are visible to it
        after its wait) and ``syncthreads_or`` gives every thread the OR of the answers.  Returns the answer
        (False when not asked)."""
        wait_for_landing()
        fence_proxy_async()
        if not ask_for_nan:
            cuda.syncthreads()
            return False
        found = 0
        at = own_chunk(v_tile, tid)[0]
        for group in range(GROUPS):
            for i in range(PASSES):
                a, b, c, d = load_vec4(smem, at + group * GROUP_WORDS + i * PASS_WORDS)
                if has_nan(a) or has_nan(b) or has_nan(c) or has_nan(d):
                    found = 1
        return cuda.syncthreads_or(found) != 0

    @inlined_device_function
    def sanitize_value_row(smem, at, key):
        """NaN elements of row ``key`` of the swizzled V tile at word ``at`` to 0; 1 if there were any."""
        found = uint32(0)
        for c in range(ROW_CHUNKS):
            word = at + swizzle_128_device(staged_offset_device(key, 8 * c, BLOCK_N)) // 4
            for x in range(4):
                value, nan = cleaned(smem[word + x])
                if nan:
                    smem[word + x] = value
                    found = uint32(1)
        return found

    @inlined_device_function
    def clean_values(smem, v_at, flags_at, t, tid):
        """A tile the causal diagonal crosses whose V_j holds a NaN (``land_tiles`` asked): a NaN in a value
        row must reach only the rows allowed to see it, but the tensor cores make 0 * NaN = NaN for the others
        too.  As in the mma.sync forward (kernels/fast/common.py, "NaN"): NaN in V_j to 0, a flag per key row,
        and the allowed weights of flagged keys to NaN (``poison``).  Returns this lane's keys' flags."""
        if tid < BLOCK_N:
            smem[flags_at + tid] = sanitize_value_row(smem, v_at, tid)
        fence_proxy_async()   # the cleaned rows, before the tensor cores read V_j
        cuda.syncthreads()    # V_j clean and its flags written, before any warp reads either
        return flags_of_lane(smem, flags_at, t)

    # ---- which query tile a block takes, and which key tiles it visits in what order ----
    @inlined_device_function
    def block_tile(tile_order, q_tiles, heads):
        """(q0, head, batch, batch*heads index) of this block's query tile: with a block mask, tile
        ``tile_order[block]`` (the host orders them by the length of their lists, longest first:
        ``tile_lists.longest_first``), else ``query_tile``'s (causal grids: the longest tiles first)."""
        if HAS_MASK:
            tile, h, b, bh = tile_coordinates(tile_order[cuda.blockIdx.x], q_tiles, heads)
            return tile * ROWS, h, b, bh
        return query_tile(cuda.blockIdx.x, q_tiles, heads, CAUSAL, ROWS)

    @inlined_device_function
    def key_tiles(tile_offsets, q0, bh, q_tiles, n_q, n_k, causal_offset):
        """(first, n_tiles): the key tiles query tile q0 visits.  With a block mask, entries first .. first +
        n_tiles - 1 of the host's lists (``key_tile``; none for a tile whose rows see no block); else tiles 0 ..
        n_tiles - 1: every tile up to N_k, and (causal) none beyond the last row's diagonal."""
        if HAS_MASK:
            at = bh * (q_tiles + 1) + q0 // ROWS
            first = int64(tile_offsets[at])
            return first, int64(tile_offsets[at + 1]) - first
        n_tiles = ceil_div(n_k, BLOCK_N)
        if CAUSAL:  # no key beyond the last row's diagonal
            n_tiles = min(n_tiles, max(0, ceil_div(min(q0 + ROWS, n_q) + causal_offset, BLOCK_N)))
        return 0, n_tiles

    @inlined_device_function
    def key_tile(tile_entries, first, x, n_tiles):
        """The first key of the x-th key tile the block visits, and whether the block mask covers it only partly (so
        that its scores need the element test): entry x of the list (``listed_tile``; key 0 past the list's end, where
        nothing is copied), or without a mask tile x, which no mask covers."""
        if HAS_MASK:
            if x >= n_tiles:
                return int64(0), False
            k0, partly = listed_tile(tile_entries, first + x, BLOCK_N)
            if not PARTLY_MASKED:   # a constant for the compiler: the element test is compiled out
                partly = False
            return int64(k0), partly
        return x * BLOCK_N, False

    def entry_bit(i, TEST_MOD):
        """``bit(q0, k0, n_q, n_k, causal_offset, warp, g, t, partly, layout, mod_args)``: ``hidden_entries``' bit i,
        with the mask_mod's test (TEST_MOD) or without."""

        @inlined_device_function
        def bit(q0, k0, n_q, n_k, causal_offset, warp, g, t, partly, layout, mod_args):
            M, bh, mask_rows, mask_cols, mask_t_r, mask_t_c = layout
            row, key = row_and_key(i, q0, k0, warp, g, t)
            visible = allowed(row, key, n_q, n_k, CAUSAL, causal_offset, partly if READS_LAYOUT else False, M, bh,
                              mask_rows, mask_cols, mask_t_r, mask_t_c)
            if TEST_MOD:
                visible = mod_allows(visible, inside(row, n_q), inside(key, n_k), mod_args)
            return uint32(0) if visible else uint32(1) << uint32(i)

        return bit

    # Written out register by register (``unrolled_or``): as a loop, NVVM left the test rolled, and each of the 32
    # passes recomputed its row and key in 64-bit arithmetic with Python's floor division (~80 SASS instructions an
    # entry, 2.5 thousand a tile: what made a score_mod, which tests every tile, cost 5x the causal forward).
    plain_bits = unrolled_or([entry_bit(i, False) for i in range(S_REGISTERS)])
    mod_bits = unrolled_or([entry_bit(i, True) for i in range(S_REGISTERS)]) if MASK_MOD else None

    @inlined_device_function
    def hidden_entries(q0, k0, n_q, n_k, causal_offset, warp, g, t, partly, layout, mod_args):
        """With the element test (ENTRY_TEST), bit i set where this lane's score register i is hidden from its query
        (``fast.common.allowed``: outside either sequence, right of the causal diagonal, or, in a tile the mask
        covers only partly, outside its blocks, read from the uint8 block layout where a block mask cuts tiles
        (``tile_lists.reads_layout``), and outside the mask_mod's: tiles the mask_mod fills skip its test,
        ``sparsity/mod_tiles.py``); ``layout`` = (M, bh, mask_rows, mask_cols, mask_t_r, mask_t_c), where this
        head's layout is; ``mod_args``: the mods' (``fast.mod_steps.entry_steps``).  One word, so that this loop
        indexes no register of S (a rolled loop over S would put S in local memory: ptxas, a 128-byte stack frame,
        and waits injected after the products)."""
        if MASK_MOD and partly:
            return mod_bits(q0, k0, n_q, n_k, causal_offset, warp, g, t, partly, layout, mod_args)
        return plain_bits(q0, k0, n_q, n_k, causal_offset, warp, g, t, partly, layout, mod_args)

    # The descriptors are built once, for each tile's first k-step in buffer 0 (``tile_descriptors``); a product's
    # is that one advanced (``wgmma.advanced``): by the k-step's bytes within the tile (a constant), the buffer's.
    @inlined_device_function
    def tile_descriptors(q_address, k_address, v_address):
        """The descriptors of this warpgroup's Q tile and of the buffer-0 K and V tiles (K-major, and MN-major V)."""
        return k_major_descriptor(q_address), k_major_descriptor(k_address), mn_major_descriptor(v_address)

    @inlined_device_function
    def staged(desc, buffer):
        """A buffer-0 tile's descriptor moved to K/V buffer ``buffer``."""
        return advanced_device(desc, buffer * TILE_BYTES)

    def score_entry(i, WHOLE):
        """(SCORE_MOD) ``entry(s, hidden, q0, k0, warp, g, t, mod_args)``: score register i to score_mod(scale S)
        log2(e), or to -inf where bit i of ``hidden`` is set.  One function per register, written out by ``unrolled``:
        NVVM leaves a loop whose body calls a mod rolled, and S indexed at run time goes to local memory.  WHOLE: a
        tile that needs no test (every entry allowed, every row and key inside its sequence; ``hidden`` unread), so
        that neither the bit's test and select nor the indices' clamps (``inside``) are compiled into its entries
        (with ALiBi at d = 64 the whole-tile loop 1153 -> 1093 SASS instructions, ptxas 13.0 sm_90a; its forward
        0.757 -> 0.635 ms on an H100, ``experiments/tuning/results/mods_bench_whole_tiles_h100.md``)."""

        @inlined_device_function
        def entry(s, hidden, q0, k0, n_q, n_k, warp, g, t, mod_args):
            row, key = row_and_key(i, q0, k0, warp, g, t)
            if WHOLE:
                s[i] = mod_score(s[i], True, row, key, mod_args)
            else:
                s[i] = mod_score(s[i], not (hidden >> uint32(i)) & uint32(1), inside(row, n_q), inside(key, n_k),
                                 mod_args)

        return entry

    modded_scores, whole_modded_scores = ((unrolled([score_entry(i, whole) for i in range(S_REGISTERS)])
                                           for whole in (False, True)) if SCORE_MOD else (None, None))

    @inlined_device_function
    def mask(s, q0, k0, n_q, n_k, causal_offset, warp, g, t, partly, layout, mod_args, tested):
        """Scores of keys past N_k, (causal) right of the diagonal, and (a tile a block mask or mask_mod covers only
        partly) outside the mask, to -inf (with the element test, also every score of a row past N_q); with a
        score_mod, every other score to score_mod(scale S) log2(e) (``mod_score``: -inf where not allowed).
        ``tested``: whether the tile needs the test at all (a mixed or ragged one).  Called without it only with a
        score_mod, whose untested tiles take ``whole_modded_scores`` (every entry allowed)."""
        if SCORE_MOD and not tested:
            whole_modded_scores(s, uint32(0), q0, k0, n_q, n_k, warp, g, t, mod_args)
            return
        hidden = (hidden_entries(q0, k0, n_q, n_k, causal_offset, warp, g, t, partly, layout, mod_args)
                  if ENTRY_TEST else uint32(0))
        if SCORE_MOD:
            modded_scores(s, hidden, q0, k0, n_q, n_k, warp, g, t, mod_args)
            return
        if ELEMENT_TEST:
            for i in range(S_REGISTERS):
                if (hidden >> uint32(i)) & uint32(1):
                    s[i] = float32(NEG_INF)
        else:
            mask_outside(s, q0, k0, n_k, causal_offset, warp, g, t)

    @inlined_device_function
    def poison(s, v_nan, q0, k0, n_q, n_k, causal_offset, warp, g, t, partly, layout, mod_args):
        """NaN where this lane's key is allowed and its value row held a NaN (``clean_values``' flags)."""
        hidden = (hidden_entries(q0, k0, n_q, n_k, causal_offset, warp, g, t, partly, layout, mod_args) if ENTRY_TEST
                  else 0)
        poison_allowed(s, v_nan, hidden, q0, k0, causal_offset, warp, g, t, ENTRY_TEST)

    @inlined_device_function
    def issue_values(acc, alpha, s, p_words, v_desc):
        """O = alpha O, then O += P V_j committed as one group; nothing waits for it.  P is packed whole
        before the first product: a register the products still read is not rewritten while they are in
        flight."""
        rescale_and_pack(acc, alpha, s, p_words)
        issue_weighted_values(acc, p_words, v_desc)

    def kernel(Q, K, V, O, LSE, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn, heads, group,
               n_q, n_k, q_tiles, causal_offset, scale_log2, tile_offsets, tile_entries, tile_order, M, mask_rows,
               mask_cols, mask_t_r, mask_t_c, q_bounds, q_step, k_bounds, k_step, bottom_right, new_keys, lse_sb,
               lse_sh, MOD0, MOD1, MOD2, MOD3):
        # Q, K, V, O: flat 16-bit pairs, element (b, h, n, x) at b sb + h sh + n sn + x (rows 16-byte aligned);
        # key/value head h // group serves query head h; LSE: (batch * heads, n_q) float32.  HAS_MASK: the key tiles
        # of query tile qt of head bh are tile_entries[tile_offsets[bh (q_tiles + 1) + qt] ...] (``key_tile``),
        # block i runs tile tile_order[i], and M is the (bh, mask_t_r, mask_t_c) uint8 block layout, blocks of
        # (mask_rows, mask_cols) (``block_mask_arguments``; placeholders without a mask).  VARLEN: q_bounds,
        # k_bounds bound each sequence's rows (``sequence_bounds``; placeholders without).  MODS: MOD0 .. MOD3 the
        # score_mod's arrays, then the mask_mod's (``fast.mod_steps``); placeholders otherwise.
        q0, h, b, bh = block_tile(tile_order, q_tiles, heads)
        lse_rows = n_q   # of lse per (batch, head), or per head over the packed sequences (VARLEN)
        first_query, first_key, n_q, n_k, causal_offset = sequence(b, q_bounds, q_step, k_bounds, k_step, n_q, n_k,
                                                                   causal_offset, bottom_right, new_keys)
        if VARLEN and q0 >= n_q:   # the grid covers the longest sequence; the whole block leaves, before any barrier
            return
        layout = (M, bh, mask_rows, mask_cols, mask_t_r, mask_t_c)
        tid = cuda.threadIdx.x
        warp, g, t = warp_lane(tid)
        # A score_mod's scores come in log2 units, scaled (``mask``): the softmax's scale is then 1.
        c_log2 = float32(1) if SCORE_MOD else float32(scale_log2)
        # What the mods read besides the entry (``fast.mod_steps.entry_steps``): batch, query head, scale, arrays.
        mod_args = (b, h, float32(scale_log2 / LOG2_E), MOD0, MOD1, MOD2, MOD3)
        smem = cuda.shared.array(0, uint32)
        base = shared_address(smem)
        pad = first_atom_words(base)
        q_at = pad                                        # warpgroup w's 64 rows of Q at q_at + w TILE_WORDS
        k_at = pad + WARPGROUPS * TILE_WORDS              # K/V buffer x at k_at + x TILE_WORDS, x < BUFFERS
        v_at = k_at + 2 * TILE_WORDS if OVERLAP else k_at  # overlapped: K_x in buffer x % 2, V_x in 2 + x % 2
        flags_at = k_at + BUFFERS * TILE_WORDS            # one word per key of V_j: did its row hold a NaN?
        # This warpgroup's Q (with one, a constant: a block-uniform address keeps the descriptors uniform too).
        q_address = base + (q_at + ((warp // 4) * TILE_WORDS if WARPGROUPS > 1 else 0)) * 4
        q_desc, k_desc, v_desc = tile_descriptors(q_address, base + k_at * 4, base + v_at * 4)

        first, n_tiles = key_tiles(tile_offsets, q0, bh, q_tiles, n_q, n_k, causal_offset)
        k_first = b * k_sb + (h // group) * k_sh + first_key * k_sn   # key 0 of this head's K (and V below)
        v_first = b * v_sb + (h // group) * v_sh + first_key * v_sn

        m_i = cuda.local.array(2, float32)                # this lane's rows g and g + 8 (of 16 warp)
        l_i = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        s = cuda.local.array(S_REGISTERS, float32)
        s_next = cuda.local.array(S_REGISTERS if OVERLAP else 1, float32)   # S_{j+1} in flight
        acc = (cuda.local.array(LOW_REGISTERS, float32), cuda.local.array(HIGH_ARRAY, float32))
        p_words = cuda.local.array(P_WORDS, uint32)   # P, packed: wgmma's A operand
        start_rows(m_i, l_i, acc)

        for w in range(WARPGROUPS):
            q_w = q0 + w * BLOCK_M
            # (a block mask, or a sequence without keys, may give a tile no key: O = 0, lse = -inf, no copies)
            if n_tiles > 0 or not (HAS_MASK or VARLEN):
                start_tile(smem, q_at + w * TILE_WORDS, Q, b * q_sb + h * q_sh + (first_query + q_w) * q_sn, q_sn,
                           n_q - q_w, tid)
        if not OVERLAP:
            # K_0 (with Q: one commit group) and V_0; then each tile's copies a group (an empty one past the last
            # tile, so that the count stays right).  Where tile j + 1 goes: in the ring (64 < d <= 128), K_{j+1} where
            # V_{j-1} was, as soon as every warp is done with P_{j-1} V_{j-1}, and V_{j+1} where K_j was, once
            # every warp is done with S_j; each tile still has a whole iteration to land, in three buffers
            # instead of four (room for a third block on a multiprocessor).  In two stages (the other d), both into
            # the buffers of tile j - 1, one barrier a tile.
            k_buffer, v_buffer = 0, 1 if RING else 2     # where K_j and V_j are
            k0 = key_tile(tile_entries, first, 0, n_tiles)[0]
            if n_tiles > 0:
                start_tile(smem, k_at, K, k_first + k0 * k_sn, k_sn, n_k - k0, tid)
            copy_async_commit()
            if n_tiles > 0:
                start_tile(smem, k_at + v_buffer * TILE_WORDS, V, v_first + k0 * v_sn, v_sn, n_k - k0, tid)
            copy_async_commit()
            for j in range(n_tiles):
                k0, partly = key_tile(tile_entries, first, j, n_tiles)
                k1 = key_tile(tile_entries, first, j + 1, n_tiles)[0]   # the next tile's (if any)
                next_k, next_v = (3 - k_buffer - v_buffer, k_buffer) if RING else (k_buffer ^ 1, v_buffer ^ 1)
                diagonal = CAUSAL and k0 + BLOCK_N - 1 > q0 + causal_offset   # block-uniform
                mixed = diagonal or partly   # some key of the tile hidden from some row: NaN in V_j needs care
                # K_j and Q landed (and V_j, in two stages); every warp done with tile j - 1's products, so the
                # buffer of V_{j-1} (and of K_{j-1}) may be refilled; in two stages on a mixed tile, any NaN in V_j?
                v_has_nan = land_tiles(smem, k_at + v_buffer * TILE_WORDS, mixed and not RING, tid)
                if j + 1 < n_tiles:
                    start_tile(smem, k_at + next_k * TILE_WORDS, K, k_first + k1 * k_sn, k_sn, n_k - k1, tid)
                    if not RING:
                        start_tile(smem, k_at + next_v * TILE_WORDS, V, v_first + k1 * v_sn, v_sn, n_k - k1, tid)
                copy_async_commit()
                issue_scores(s, q_desc, staged(k_desc, k_buffer))
                wait_all_products()
                if RING:   # V_j landed; every warp done with S_j, so K_j's buffer may take V_{j+1}; NaN in V_j?
                    v_has_nan = land_tiles(smem, k_at + v_buffer * TILE_WORDS, mixed, tid)
                    if j + 1 < n_tiles:
                        start_tile(smem, k_at + next_v * TILE_WORDS, V, v_first + k1 * v_sn, v_sn, n_k - k1, tid)
                    copy_async_commit()
                v_nan = (clean_values(smem, k_at + v_buffer * TILE_WORDS, flags_at, t, tid) if v_has_nan
                         else uint64(0))
                tested = mixed or k0 + BLOCK_N > n_k or q0 + ROWS > n_q   # (not: the tile is wholly allowed)
                if SCORE_MOD or tested:   # (a score_mod changes every score; the rest need no mask)
                    mask(s, q0, k0, n_q, n_k, causal_offset, warp, g, t, partly, layout, mod_args, tested)
                online_softmax(s, m_i, l_i, alpha, c_log2)
                if v_nan != uint64(0):
                    poison(s, v_nan, q0, k0, n_q, n_k, causal_offset, warp, g, t, partly, layout, mod_args)
                issue_values(acc, alpha, s, p_words, staged(v_desc, v_buffer))
                wait_all_products()
                k_buffer, v_buffer = next_k, next_v
        else:
            # Prologue: S_0 = Q K_0^T waited for; K_1 and V_0 on their way.
            if n_tiles > 0:
                k0, k1 = key_tile(tile_entries, first, 0, n_tiles)[0], key_tile(tile_entries, first, 1, n_tiles)[0]
                start_tile(smem, k_at, K, k_first + k0 * k_sn, k_sn, n_k - k0, tid)
                land_tiles(smem, v_at, False, tid)
                if n_tiles > 1:
                    start_tile(smem, k_at + TILE_WORDS, K, k_first + k1 * k_sn, k_sn, n_k - k1, tid)
                start_tile(smem, v_at, V, v_first + k0 * v_sn, v_sn, n_k - k0, tid)
                issue_scores(s, q_desc, k_desc)
                wait_all_products()
            for j in range(n_tiles):
                k0, partly = key_tile(tile_entries, first, j, n_tiles)
                stage = j & 1
                ahead = j + 1 < n_tiles
                diagonal = CAUSAL and k0 + BLOCK_N - 1 > q0 + causal_offset
                mixed = diagonal or partly
                # K_{j+1} and V_j; every thread past its wait for S_j and P_{j-1} V_{j-1}; any NaN in V_j?
                v_has_nan = land_tiles(smem, v_at + stage * TILE_WORDS, mixed, tid)
                k1 = key_tile(tile_entries, first, j + 1, n_tiles)[0]   # the next tiles' (if any)
                k2 = key_tile(tile_entries, first, j + 2, n_tiles)[0]
                if j + 2 < n_tiles:   # into K_j's buffer
                    start_tile(smem, k_at + stage * TILE_WORDS, K, k_first + k2 * k_sn, k_sn, n_k - k2, tid)
                if ahead:             # into V_{j-1}'s buffer
                    start_tile(smem, v_at + (stage ^ 1) * TILE_WORDS, V, v_first + k1 * v_sn, v_sn,
                               n_k - k1, tid)
                v_nan = (clean_values(smem, v_at + stage * TILE_WORDS, flags_at, t, tid) if v_has_nan
                         else uint64(0))
                if ahead:   # S_{j+1} runs while this tile's softmax does
                    issue_scores(s_next, q_desc, staged(k_desc, stage ^ 1))
                tested = mixed or k0 + BLOCK_N > n_k or q0 + ROWS > n_q
                if SCORE_MOD or tested:
                    mask(s, q0, k0, n_q, n_k, causal_offset, warp, g, t, partly, layout, mod_args, tested)
                online_softmax(s, m_i, l_i, alpha, c_log2)
                if v_nan != uint64(0):
                    poison(s, v_nan, q0, k0, n_q, n_k, causal_offset, warp, g, t, partly, layout, mod_args)
                issue_values(acc, alpha, s, p_words, staged(v_desc, stage))
                wait_all_products()   # S_{j+1} and P_j V_j
                if ahead:
                    for i in range(S_REGISTERS):
                        s[i] = s_next[i]

        # ---- O / l and lse, once ----
        lse_first = lse_row(bh, b, h, first_query, lse_rows, lse_sb, lse_sh)   # this head's lse row 0
        store_output(O, LSE, acc, m_i, l_i, q0, n_q, b * o_sb + h * o_sh + first_query * o_sn, o_sn, lse_first, warp,
                     g, t)

    return Kernel(kernel, f"wgmma_forward_d{D}_{ELEMENT}" + ("_causal" if CAUSAL else "") + ("_overlap" if OVERLAP else "")
                  + ("" if WARPGROUPS == 1 else f"_warpgroups{WARPGROUPS}")
                  + (("_sparse" if PARTLY_MASKED else "_sparse_whole_tiles") if HAS_MASK else "")
                  + ("_varlen" if VARLEN else "") + mods_suffix(MODS),
                  arrays=dict(Q=np.uint32, K=np.uint32, V=np.uint32, O=np.uint32, LSE=np.float32, tile_offsets=np.int32,
                              tile_entries=np.int32, tile_order=np.int32, M=np.uint8, q_bounds=np.int32,
                              k_bounds=np.int32, **slot_arrays(MODS)),
                  floats=("scale_log2",),
                  launch_bounds=(THREADS, blocks_per_multiprocessor(D, CAUSAL, OVERLAP, WARPGROUPS, READS_LAYOUT,
                                                                    MODS is not None)))


def blocks_per_multiprocessor(head_dim, causal, overlap, warpgroups, element_test=False, mods=False):
    """The blocks per multiprocessor the kernel's registers must allow (``launch_bounds``' second number), or 1
    where ptxas is best left alone.

    At d = 64 the registers decide it: shared memory (42 KB a block of one warpgroup, 50 KB of two) leaves room for five
    and four, and 65536 registers give four blocks of 128 threads at 128 registers each, three at 129-170.  Left alone,
    ptxas gives the dense kernel 128 (four blocks) and the causal one 136 (its mask and NaN steps): three.  Asked for
    four, the causal kernel fits in 126 with no spills (ptxas 13.0, sm_90a), and ran 1.12-1.23x faster on the H200; the
    dense one, already at four, took 1.05x longer at (4, 16, 4096, 64) under the cap (126 registers, 23 more
    instructions a tile; 2026-12-02, ``experiments/tuning/results/bench_blocks4_h200.md``), so it keeps its own
    allocation.  Two warpgroups: two blocks (128 registers), the same 16 warps.

    At d = 128 a block of one warpgroup takes 66 KB of shared memory with the ring of three K/V buffers (83 KB
    with four), room for three blocks; left alone ptxas takes 180-184 registers, which allow two, so the cap
    asks for three (168).  The overlapped loop would spill under any cap (64-96 bytes at d = 64), and blocks of
    two warpgroups at d = 128 (180-196 registers) fit once either way.

    With mods (``mods``; a mask_mod's tiles test no block layout), at d = 64 in one warpgroup the cap for three
    blocks: left alone ptxas took 166-248 registers for the built-ins (ALiBi's int64 distances the most), two
    blocks; under it 157-168, no spills (ptxas 13.0, sm_90a, 2026-12-06); for four, ALiBi spilled 92 bytes.  At
    d = 128 none: 207-255 registers, and the cap for three spilled 56 bytes with ALiBi.

    Other head dims take the choices of their layout's width (``layout_dim``: d < 64 those of 64, 64 < d < 128
    those of 128: the same shared memory a block), with fewer accumulator registers (D / 2) under the same caps.
    Unmeasured on a GPU.  At d = 96 (ptxas 13.0, sm_90a, 2026-12-04): one warpgroup 158-160 registers under the
    cap for three blocks, two warpgroups 161-182, overlapped 196-201, no spills in any.

    A block mask of whole tiles keeps these caps (ptxas 13.0, sm_90a, 2026-12-05, no spills: d = 64 139 registers
    dense and 128 causal, d = 96 158-160, d = 128 163-168; two warpgroups 128-194, overlapped 179-221).  A kernel
    with the element test (``element_test``: blocks that cut tiles) spilled 188-200 bytes under the caps of d = 64
    causal and d = 128, so it has none: 158-166 registers at d = 64, 188-192 at d = 96, 196-206 at d = 128 (one or
    two warpgroups), 192-236 overlapped, no spills; a block of one warpgroup then fits three times on a
    multiprocessor at d = 64 and twice at d = 96 and 128.  Unmeasured on a GPU.

    On the 256-column layout one block fits on a multiprocessor by its shared memory (``uses_ring``), so the cap is
    one block, 255 registers a thread: at d = 256 ptxas 13.0 (sm_90a, 2026-12-06) gives 238-239, no spills, one
    warpgroup or two (65536 registers hold a block of 256 threads at up to 256 each);
    ``experiments/tuning/results/wgmma_d256_ptxas_sm90.md`` has every specialisation."""
    layout = layout_dim(head_dim)
    if overlap or element_test:
        return 1
    if mods:
        return 3 if layout == 64 and warpgroups == 1 else 1
    if layout == 64 and warpgroups == 1 and not causal:
        return 1
    if layout == 128:
        return 3 if warpgroups == 1 else 1
    if layout == 256:
        return 1
    return 4 // warpgroups


#: ``NUMBA_FLASH_WGMMA=0`` keeps ``algorithm="flash2"`` on the mma.sync kernel on Hopper GPUs too.
AUTOMATIC = os.environ.get("NUMBA_FLASH_WGMMA", "1") != "0"
#: ``NUMBA_FLASH_WGMMA_OVERLAP=1`` runs the kernel whose products overlap the softmax (``make_wgmma_forward``, OVERLAP).
#: Off by default: 1.04-1.34x the plain loop's time on the H200
#: (experiments/tuning/results/bench_wgmma_overlap_h200.md).
OVERLAP_PRODUCTS = os.environ.get("NUMBA_FLASH_WGMMA_OVERLAP", "0") == "1"
#: ``NUMBA_FLASH_WGMMA_FORWARD``: "blocks" (the default) runs ``make_wgmma_forward``'s kernel, "specialized" the
#: warp-specialised one (``specialized_forward.py``: a producer warpgroup, two consumers taking turns) for the calls in
#: its scope, the others on "blocks".  Not the default: 0.71-0.93x the speed of "blocks" at issue 45's rows (H100,
#: 2026-12-07, ``experiments/tuning/results/wgmma_forward_kernels_h100.md``; its producer's copies pace it).
FORWARD_KERNELS = ("blocks", "specialized")
FORWARD_KERNEL = os.environ.get("NUMBA_FLASH_WGMMA_FORWARD", "blocks")
#: ``NUMBA_FLASH_WGMMA_CONSUMERS``: the warp-specialised kernel's consumer warpgroups, 2 (128-row blocks, the default)
#: or 3 (192 rows: FlashAttention-3's choice at d <= 96).
CONSUMERS = os.environ.get("NUMBA_FLASH_WGMMA_CONSUMERS", "2")
#: ``NUMBA_FLASH_WGMMA_QUERY``: where the warp-specialised kernel's S = Q K^T reads Q, "shared" (the default) or
#: "registers" (each consumer's fragments, ``specialized_forward.make_specialized_forward``'s QUERY_IN_REGISTERS).
QUERY_OPERANDS = ("shared", "registers")
QUERY_OPERAND = os.environ.get("NUMBA_FLASH_WGMMA_QUERY", "shared")
#: ``NUMBA_FLASH_WGMMA_STAGES``: the warp-specialised kernel's K/V stages, 3 (the default) or 4 (its producer a tile
#: further ahead: ``specialized_forward.STAGE_COUNTS``).
STAGES = os.environ.get("NUMBA_FLASH_WGMMA_STAGES", "3")
#: ``NUMBA_FLASH_WGMMA_WARPGROUPS=1`` or ``2`` runs blocks of that many warpgroups sharing each K/V tile
#: (``make_wgmma_forward``, WARPGROUPS) at every head dim; unset, each head dim takes its ``DEFAULT_WARPGROUPS``.
WARPGROUPS = os.environ.get("NUMBA_FLASH_WGMMA_WARPGROUPS")
#: Warpgroups per block by layout width (``common.layout_dim``).  1 on the 64- and 128-column layouts: two took
#: 0.95-1.03x the time at d = 64 and 1.08-1.15x at d = 128 on the H200 (2026-12-02).  2 on the 256-column layout: there
#: a block takes 161 KB of shared memory with one warpgroup, 193 KB with two (``shared_bytes``), so one block fits on a
#: multiprocessor either way, and with one warpgroup it would hold only 4 warps, nothing to run while they wait for
#: their products (FlashAttention-3 also runs d = 256 on two warpgroups of 64 query rows).  Unmeasured on a GPU.
DEFAULT_WARPGROUPS = {64: 1, 128: 1, 256: 2}
#: The (head dim, causal) pairs for which ``algorithm="flash2"`` takes this kernel: where it beat the mma.sync kernel on
#: the H200, float16 and bfloat16 alike.  d = 64: dense 1.06-1.13x (2026-12-01,
#: ``experiments/tuning/results/bench_wgmma_h200.md``), causal 1.03-1.06x once only the diagonal tiles were masked
#: (``experiments/tuning/results/bench_wgmma_diagonal_h200.md``; 0.76-0.78x before).  d = 128: 0.56-0.59x while the tile
#: copies cost ~95 instructions per 16 bytes, then 1.50x dense and 1.42x causal with each thread walking one column of
#: chunks (2026-12-02, GPU time, ``experiments/tuning/results/bench_wgmma_warpgroups1_h200.md``;
#: ``experiments/tuning/results/sass_counts_wgmma.md``).  d = 96 (Phi-style heads, on the 128-column layout with its pad
#: columns zero): taken on the strength of d = 128's numbers, pending its own GPU measurement against mma.sync.
#: d = 256 (Gemma-style heads, two warpgroups a block: ``DEFAULT_WARPGROUPS``): 2.2x the mma.sync forward and 1.45x
#: torch flash (H100, 2026-12-06, (4, 16, 4096, 256) bfloat16 dense, GPU time, ``experiments/tuning/results/
#: bench_d256_h100.md``), taken since its GPU property tests and memcheck / racecheck / synccheck runs passed (H100,
#: 2026-12-06 afternoon, ``experiments/tuning/results/gpu_tests_h200.md``).  Its backward stays on mma.sync.
AUTOMATIC_SCOPE = {(64, False), (64, True), (96, False), (96, True), (128, False), (128, True), (256, False),
                   (256, True)}


def whole_tiles(block_mask, rows=BLOCK_M):
    """Whether a block mask's blocks are whole multiples of the kernel's tiles (B_r a multiple of the query tile's
    ``rows``, B_c of BLOCK_N: 64; rows 128 for the forward's blocks of two warpgroups at d = 256), the masks
    ``algorithm="flash2"`` takes to this kernel: their blocks' edges are tiles' edges, so that the block's tiles
    (64 x 64 a warpgroup) are each wholly inside the mask or wholly outside, the element test
    is compiled out (``make_wgmma_forward``'s PARTLY_MASKED), and the loop is the dense one's over a list: the loop
    measured faster than the mma.sync kernel's (``AUTOMATIC_SCOPE``).  Other blocks (smaller ones, or ones whose edges
    cut tiles) run here too with ``algorithm="wgmma"``, their partly covered tiles tested element by element, but
    stay on mma.sync under flash2 until a GPU measures that test against mma.sync's.  (With blocks of two warpgroups,
    128-row query tiles, B_r = 64 leaves tiles partly covered: the test is compiled in, and the result the same.)"""
    block_rows, block_keys = block_mask.block_size
    return block_rows % rows == 0 and block_keys % BLOCK_N == 0


def chosen_for(call, block_sizes, kernel="forward"):
    """Whether ``algorithm="flash2"`` runs this call on the wgmma forward (or, ``kernel="backward"``, its backward:
    ``backward.chosen_for``): on a Hopper GPU, for calls in its scope and in ``AUTOMATIC_SCOPE`` whose caller named
    no tile sizes (explicit ``block_sizes`` are the mma.sync kernel's), with no block mask or one of whole tiles
    (``whole_tiles``, of the forward's query tiles: 64 rows a warpgroup, ``DEFAULT_WARPGROUPS``; the backward's
    64 x 64).
    Packed sequences too, where their batched call would be taken: on an H100 (2026-12-06,
    ``experiments/tuning/results/varlen_wgmma_h100.md``) 1.2-1.8x the mma.sync forward and 1.4-1.8x its backward."""
    return (AUTOMATIC and block_sizes is None and not in_simulator()
            and (call.head_dim, bool(call.causal)) in AUTOMATIC_SCOPE and out_of_scope(call, kernel) is None
            and (call.block_mask is None or whole_tiles(call.block_mask, BLOCK_M * (
                DEFAULT_WARPGROUPS[layout_dim(call.head_dim)] if kernel == "forward" else 1))))


def forward_launch(call):
    """The wgmma forward for a validated call in its scope, as a ``Launch`` taking q, k, v, o, lse per call: on the
    warp-specialised kernel where ``NUMBA_FLASH_WGMMA_FORWARD=specialized`` asks for it and the call is in its scope
    (``specialized_forward.specialized_scope``), else on ``make_wgmma_forward``'s."""
    reason = out_of_scope(call, "forward")
    if reason is not None:
        raise ValueError(f"algorithm='wgmma': {reason}")
    environment_choice("NUMBA_FLASH_WGMMA_FORWARD", FORWARD_KERNEL, FORWARD_KERNELS)
    warpgroups = environment_choice("NUMBA_FLASH_WGMMA_WARPGROUPS", WARPGROUPS if WARPGROUPS is not None
                                    else DEFAULT_WARPGROUPS[layout_dim(call.head_dim)], WARPGROUP_COUNTS)
    if not in_simulator():
        enable_sm90a()
    # A block mask's lists are of the block's query tiles (64 rows a warpgroup) and of BLOCK_N keys.
    tiles = (BLOCK_M * warpgroups, BLOCK_N)
    if FORWARD_KERNEL == "specialized" and specialized.specialized_scope(call) is None:
        consumers = environment_choice("NUMBA_FLASH_WGMMA_CONSUMERS", CONSUMERS, specialized.CONSUMER_COUNTS)
        environment_choice("NUMBA_FLASH_WGMMA_QUERY", QUERY_OPERAND, QUERY_OPERANDS)
        stages = environment_choice("NUMBA_FLASH_WGMMA_STAGES", STAGES, specialized.STAGE_COUNTS)
        tiles = (specialized.rows(consumers), BLOCK_N)
        kernel = specialized.make_specialized_forward(call.head_dim, call.precision, call.causal, sequence_mode(call),
                                                      consumers, QUERY_OPERAND == "registers", stages)
        threads, shared = (specialized.threads(consumers),
                           specialized.shared_bytes(call.head_dim, consumers, stages))
    else:
        kernel = make_wgmma_forward(call.head_dim, call.precision, call.causal, OVERLAP_PRODUCTS, warpgroups,
                                    has_tile_lists(call), partly_masked_tiles(call, tiles, "forward"),
                                    sequence_mode(call), mod_steps(*call.mods) if call.mods else None)
        threads, shared = WARPGROUP * warpgroups, shared_bytes(call.head_dim, warpgroups, OVERLAP_PRODUCTS)
    words = word_extent(call)
    (qs, ks, vs), os_ = call.strides, call.result_strides("q")
    q_shape, kv_shape = call.kernel_shapes
    q_tiles = cdiv(call.longest_q, tiles[0])   # packed sequences: the longest one's tiles, per sequence
    fixed = dict(q_sb=qs.batch, q_sh=qs.head, q_sn=qs.row, k_sb=ks.batch, k_sh=ks.head, k_sn=ks.row,
                 v_sb=vs.batch, v_sh=vs.head, v_sn=vs.row, o_sb=os_.batch, o_sh=os_.head, o_sn=os_.row,
                 heads=call.heads, group=call.group, n_q=call.n_q, n_k=call.n_k, q_tiles=q_tiles,
                 causal_offset=call.causal_offset, scale_log2=call.scale * LOG2_E,
                 **block_mask_arguments(call, tiles, "forward"), **sequence_arguments(call),
                 **slot_arguments(call.mods))
    bounds, bounds_extents = sequence_arrays(call)   # (packed sequences: cu_seqlens_q and _k, per call)
    extents = dict(Q=words(q_shape, qs), K=words(kv_shape, ks), V=words(kv_shape, vs), O=words(q_shape, os_),
                   LSE=lse_slabs(call) * call.n_q, **bounds_extents)
    return Launch(kernel, q_tiles * call.batch_heads, threads, shared, fixed, ("Q", "K", "V", "O", "LSE") + bounds,
                  extents)
