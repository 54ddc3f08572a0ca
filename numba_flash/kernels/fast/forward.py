"""FlashAttention-2 forward (Dao, 2023) on tensor cores: the fast kernel.

The loop order is FlashAttention-2's: one thread block per (query tile,
batch, head), an outer loop that is the grid, and an inner loop over the
key/value tiles the query tile may see.  The running statistics m_i, l_i and
the output accumulator acc stay in registers for the whole inner loop; O is
divided by l once at the end and O and lse are written once.  With
``causal``, key tiles entirely above the diagonal are never visited and only
tiles that cross it are masked element by element; with a block mask the
host lists, per query tile, the key tiles to visit.

The inner loop, one key tile K_j, V_j per iteration::

    land_kv          tile j (started last iteration) complete in shared memory, then a barrier
    start_kv         tile j + 1 on its way, in flight while we compute on tile j
    clear_rows_from  (decoding's first tiles, copied before the entry's length was read) V past its keys to 0
    S = Q K^T        ``rows_by_rows_t``: each warp its 16 (or 32) query rows
    mask_scores      (tiles some query may not fully see) -inf where a query may not see a key; with mods, the
                     mask_mod's test (partly masked tiles) and the score_mod (every tile): ``mod_steps``
    online_softmax   m_new = c max S, P = exp2(c S - m_new), alpha = exp2(m - m_new), l = alpha l + rowsum P
    dropout          Algorithm 2's Z on P (after l: l and m see the undropped weights)
    poison_weights   (a lane's keys of a partly masked tile with a NaN value row) NaN where allowed
    O = alpha O + P V ``accumulate_product``: P straight from the S registers

How it is fast, and what each trick costs in clarity:

* **Tensor cores from Numba.**  numba-cuda exposes no matrix instructions,
  so ``primitives.py`` emits PTX ``mma.sync`` through intrinsics.  Each warp
  owns 16 query rows (or 32: ``WARP_ROWS``) and computes its 16 x BLOCK_N slice
  of S = Q K^T and its 16 x d slice of O += P V as 16x8 tiles, one ``mma`` per
  tile and k-step.
* **32 rows per warp** (16-bit, d <= 128, no block mask or dropout:
  ``tiling.FORWARD_WARP_ROWS``): two 16-row fragments per warp share every
  K_j and V_j fragment the warp loads from shared memory, as
  FlashAttention-2's warps do, so the block reads its tiles from shared
  memory half as often per product, for twice the accumulator registers
  (255, and 4 warps per block).  SASS of the key-tile loop at (128, 64),
  d = 64: 623 instructions for 64 mma per warp of 16 rows, 1000 for 128 per
  warp of 32 (4000 against 4984 per block and tile;
  experiments/tuning/results/warp_rows_sass.md); on the H200 0.84-0.88x the time
  dense, 0.93-0.95x causal (experiments/tuning/results/bench_warp_rows_h200.md).
* **float32 stays float32 (3xTF32).**  A tensor-core product of float32
  inputs rounds them to tf32 (10 mantissa bits, ~3e-4 relative error).  We
  split every operand x = hi + lo with hi = tf32(x), lo = tf32(x - hi) and
  accumulate lo*hi + hi*lo + hi*hi, dropping lo*lo (~2^-22 relative): float32
  accuracy for three mma per tile (the trick CUTLASS calls "3xTF32").  The
  split happens once, when a tile enters shared memory.
* **... at any length.**  The tensor cores' float32 accumulator truncates
  (``experiments/tuning/mma_accumulation.py``), so each key tile's P V goes into a
  fresh fragment and is added into O with one FMA that also rescales:
  O = alpha O + tile (``fragments.accumulate_product``).
* **16-bit operands** (float16, bfloat16) use ``mma.m16n8k16`` with float32
  accumulation.  P is rounded to the operand type for P V, as in
  FlashAttention-2.
* **P never leaves registers.**  The accumulator fragment of S (rows g, g+8;
  columns 2t, 2t+1 of each 8-wide tile) is reused as the A operand of P V.
  For 16-bit operands it matches the k16 A layout exactly; for tf32 (k8) the
  A columns are t and t+4, so we *renumber the keys inside the k-step*: k-index
  t stands for key 2t and t+4 for key 2t+1, and V's B fragment is read with
  the same renumbering.  A sum over keys does not care about their order.
* **exp2**: logits are scaled by scale*log2(e) so that softmax uses exp2
  (one ``ex2.approx`` instruction); lse is converted back to natural log.
  The scale rides in the exponent's FMA, exp2(c S - m), and the row max is
  taken over the unscaled scores (``online_softmax``).
* **Row statistics by shuffles**: the four lanes that share a row reduce
  max and sum with two ``shfl_xor`` (simulated in the simulator).
* **Software pipeline**: tile j + 1's loads are issued before tile j is
  computed on, so memory latency hides behind the products.  16-bit tiles
  with 16-byte rows travel by ``cp.async`` straight into the second of two
  shared buffers (``tiling.flash2_stages``): no registers hold them on the
  way, and one barrier per tile suffices, because the buffer being refilled
  was last read before that barrier.  With KV_STAGES > 2 buffers (decoding,
  where a block's few rows leave memory latency nothing to hide behind) tiles
  j + 1 .. j + KV_STAGES - 1 are in flight at once, one cp.async group each.
  Otherwise (3xTF32 splits each element on the way; unaligned 16-bit rows)
  the tile waits in registers and is stored to shared memory at the top of
  the iteration that uses it, between two barriers.
* **ldmatrix** (16-bit): fragments leave shared memory as whole 8x8
  matrices, Q's and K's for S = Q K^T directly, V's for P V transposed on
  the way (``ldmatrix.trans``): K_j and V_j sit in shared memory row-major,
  as they arrive.  One instruction where a lane issued two or four 32-bit
  loads (``experiments/tuning/results/ldmatrix_sass.md``: 1.01-1.17x on the H200).
* **No bank conflicts**: shared rows are padded so that the 32 lanes of a
  fragment load (or ldmatrix's 8 rows) hit different banks
  (``tiling.row_stride``).

Departures from the paper's Algorithm 1 (besides the loop order): the scale
is folded into the exp2 argument; a row that has seen no allowed key keeps
m = -inf, and its rescale factors are defined as 0 (exp2 of -inf - -inf
would be NaN); such a row ends with O = 0 and lse = -inf.  NaN in the inputs
reaches exactly the output rows allowed to see it (``common.py`` explains
the masked-tile step that ensures it).

Notation: a warp's lane is 4*g + t; ``s[nt]`` holds S rows (g, g+8) x
columns (2t, 2t+1) of key tile nt; ``acc[dt]`` the same for head-dim tile dt
of O.  Layouts of the mma fragments are in ``primitives.py``.
"""
import math
from functools import lru_cache, partial

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from ...runtime.arrays import Strides, placeholder
from ...runtime.launch import Kernel, Launch, inlined_device_function, unrolled
from ...sparsity.tile_lists import listed_tile, reads_layout
from ...tiling import (ROWS_PER_WARP, cdiv, flash2_forward_smem, flash2_forward_warp_rows, flash2_stages,
                       flash2_threads, padded_head_dim, row_stride, swizzled_rows)
from .cache import last_to_arrive, output_element, tile_merger
from .common import (LOG2_E, NEG_INF, allowed_below, block_mask_arguments, cache_rows, ceil_div, dropout_arguments,
                     dropout_words, has_tile_lists, kernel_name, keys_end, lane_flags, lse_slabs, paging_arguments,
                     partly_masked_tiles, row_lse, sequence_arguments, sequence_arrays, sequence_bounds, sequence_mode,
                     tile_coordinates, tile_copier, tile_movers, warp_lane, word_extent)
from .fragments import fragment_row_store, pair_store, tile_products
from .mod_steps import entry_steps, inside, mod_steps, mods_suffix, slot_arguments, slot_arrays
from .primitives import (copy_async_commit, copy_async_wait, copy_async_wait_all, exp2, f32_as_u32, load_word,
                         shfl_xor, store_word, sync_warp, u32_as_f32)


@lru_cache(maxsize=None)
def make_forward(BLOCK_M, BLOCK_N, D_PAD, PRECISION, VEC, CAUSAL, HAS_MASK, HAS_DROPOUT, VARLEN=False, SPLIT=False,
                 POSITIVE_SCALE=True, WARP_ROWS=ROWS_PER_WARP, PARTLY_MASKED=True, KV_STAGES=2, KEY_WARPS=1,
                 PAGED=False, QUERY_GROUPS=False, MODS=None):
    """The flash2 forward kernel for one (tiles, padded d, precision, VEC, causal, mask, dropout, varlen, split,
    sign of the scale, paging).

    D_PAD is the head dim rounded up to the mma depth: head dims that round to
    the same D_PAD share one compiled kernel, which is told the true d and
    zero-fills the rest.  VEC: rows start on 16-byte boundaries, so tiles move
    in 16-byte loads.  HAS_MASK: a block mask lists the key tiles of each query
    tile (``sparsity/tile_lists.py``).  HAS_DROPOUT: Algorithm 2's dropout.  VARLEN: per-batch lengths
    (``common.sequence_bounds``: True for bounds arrays, "cache" for a KV cache's lengths, its overflowing
    entries' rows written as NaN).  SPLIT (flash-decoding, for few queries and many keys): ``splits`` blocks
    share a query tile's keys (every splits-th key tile each), each writing its partial O (float32,
    normalised by its own l) and lse at ``split * o_split`` and ``split * lse_split``; the last of them to
    finish merges them by their lse into MERGED_O and MERGED_LSE (``cache.py``).  POSITIVE_SCALE:
    the scale goes into the exponent's FMA (see ``online_softmax``); a scale <= 0 gets a kernel that
    scales the scores first.  WARP_ROWS: the query rows a warp owns, 16 or 32 (two fragments that share
    every K and V fragment loaded, as FlashAttention-2's warps do; ``tiling.flash2_forward_warp_rows``).
    PARTLY_MASKED (with HAS_MASK): some listed tile is only partly covered by the mask, so entries are tested
    against its layout; False when the mask's blocks are unions of whole tiles, which compiles the test out
    and leaves the kernel the loops of a dense one (32-row warps included).  KV_STAGES: the most shared
    buffers for K_j, V_j when they travel by cp.async (``tiling.flash2_stages``: as many as fit).

    KEY_WARPS (decoding, a tile of one warp's rows whose K/V tiles travel by cp.async): that many warps share the
    block's query rows and take turns along its keys, as the splits do across blocks: warp w of split s visits tiles s
    KEY_WARPS + w, then every (splits KEY_WARPS)-th.  The block moves in rounds: round x is every warp's x-th tile,
    KEY_WARPS x BLOCK_N neighbouring keys, copied by all the block's threads together into the warps' own buffers and
    handed over by one block barrier, so that the block reads its head's cache as one stream of wide tiles, as cuDNN's
    decoding kernel does (on the H200, four warps of (16, 16) tiles, four buffers: 0.1387 ms against 0.1455 when each
    warp streamed its own tiles under ``sync_warp`` alone; no difference at (16, 32);
    ``experiments/tuning/results/decode_key_warps_h200.md``).  Their K/V rows are unpadded and swizzled
    (``tiling.swizzled_rows``: padded, L2 served 1.5 times the sectors needed).  At the end the warps leave their m, l
    and O in shared memory (``share_results``) and each combines and writes a share of the result's columns
    (``write_merged_output``).  So one block per multiprocessor streams a head's cache with several tiles in flight, and
    a grid of one block per query tile needs no merge kernel: cuDNN's decoding kernel is laid out so on the H200 (ncu,
    2026-12-02: 128 blocks of four warps, 16 x 128 tiles, for (B, H_kv) = (16, 8)).

    PAGED (decoding): K and V are pools of pages (num_pages, H_kv, page_size, d), k_sp and v_sp their page strides,
    and entry b's key j is row j % page_size of page PAGES[b * pages_sb + j // page_size] (``common.cache_rows``).
    The host makes page_size a multiple of BLOCK_N, so that each K/V tile lies in one page: a tile's rows are found
    by one table lookup and are copied as a contiguous cache's are (a round of key warps' tiles, which may span
    pages, is copied tile by tile).  Every block first checks the entry's table entries against the pool: an entry
    that names a page outside it sees no key and gets NaN rows, as one whose length overflows does.

    QUERY_GROUPS (decoding, causal or with mods): the tile's rows are the query heads of a group packed as rows (row
    g N_q + i is query i of the group's head g, ``head_queries`` = N_q; ``decode_plan.py``), so that the group reads
    each K/V tile once.  The causal mask of a row takes its own query index i = row mod N_q, the key bound of the tile
    its last query's (N_q - 1), and every tile that reaches past the first query's diagonal is masked (some row of the
    tile may be a group's query 0); the mods see query head h G + g and query i (``mod_row``).  Without causal or mods
    the packed rows need nothing of the kernel: every row sees every key.

    MODS (``mod_steps.ModSteps``, or None): a score_mod and/or mask_mod, one step of ``mask_scores`` and
    ``poison_weights`` (``mod_steps.entry_steps``).  The mask_mod ANDs into the keys an entry may see; its tiles
    are classified on the host into tile lists (HAS_MASK: ``sparsity/mod_tiles.py``), so that empty tiles are
    never visited and only partly masked ones test it element by element (and are cleaned of NaN, as a block
    mask's partly masked tiles are); the score_mod replaces the scaled score (the kernel then takes the
    scaled-first path of a scale <= 0: POSITIVE_SCALE False).  Both are evaluated at every tested entry, hidden
    ones too, at indices inside the sequences (``mod_steps.entry_steps``, ``inside``).  With VARLEN there are no
    tile lists (the host does not know a call's sequences when it plans it): a mask_mod is tested on every element
    of every tile (``MOD_EVERY_TILE``).  The indices the mods see are the sequence's: a packed sequence's rows and
    keys from its start, b its index in the pack; a KV cache's query i at its position L_b - N_q + i (L_b the
    entry's keys after the append, as its bottom-right causal mask places it: ``mod_row``).  Compiled out when
    None.
    """
    assert MODS is None or not (MODS.has_score and POSITIVE_SCALE), "a score_mod takes the scaled-first path"
    assert MODS is None or not MODS.has_mask or HAS_MASK or VARLEN, "a batched mask_mod's tiles come as lists"
    SCORE_MOD = MODS is not None and MODS.has_score
    MASK_MOD = MODS is not None and MODS.has_mask
    MOD_EVERY_TILE = MASK_MOD and not HAS_MASK   # no tile lists (VARLEN): every tile tested as a partly masked one
    READS_LAYOUT = HAS_MASK and reads_layout(PARTLY_MASKED)   # partly masked tiles test the block layout
    mod_allows, mod_score, _ = entry_steps(MODS)
    assert not (HAS_MASK and SPLIT), "a block mask's blocks follow its tile order, which has no splits"
    assert not SPLIT or VARLEN == "cache", "splits serve decoding: the merge reads a cache call's rows"
    assert not PAGED or VARLEN == "cache", "pages hold a KV cache's rows"
    assert not QUERY_GROUPS or (VARLEN == "cache" and (CAUSAL or MODS is not None)), \
        "query groups serve decoding whose rows differ (causal, or mods that read the query head and index)"
    SIXTEEN = PRECISION != "tf32x3"
    ROW_THREADS = flash2_threads(BLOCK_M, WARP_ROWS)   # the threads that own the tile's rows
    assert KEY_WARPS == 1 or (ROW_THREADS == 32 and WARP_ROWS == ROWS_PER_WARP and not HAS_MASK
                              and not HAS_DROPOUT), "key warps share one warp's 16 rows, dense or causal"
    THREADS = ROW_THREADS * KEY_WARPS
    STREAMERS = THREADS if KEY_WARPS == 1 else 32   # the threads that clean one K/V tile of NaN
    WARP_TILES = WARP_ROWS // ROWS_PER_WARP   # 16-row fragments per warp
    LANE_ROWS = 2 * WARP_TILES   # a lane's rows: g + 8 r (``fragments``: rows m X + x of s and acc)
    N_TILES = BLOCK_N // 8       # 8-wide key tiles of S
    S_ROWS = WARP_TILES * N_TILES                  # rows of a lane's S (and P) fragments
    D_TILES = D_PAD // 8         # 8-wide head-dim tiles of O
    O_ROWS = WARP_TILES * D_TILES  # rows of a lane's O fragments
    WORD = uint32 if SIXTEEN else float32
    layout = partial(flash2_forward_smem, key_warps=KEY_WARPS)
    STAGES = flash2_stages(layout, BLOCK_M, BLOCK_N, D_PAD, precision=PRECISION, vec=VEC, most=KV_STAGES)
    ASYNC = STAGES >= 2                          # K_j, V_j by cp.async into the other buffers
    assert KEY_WARPS == 1 or ASYNC, "key warps wait for their own copies: their tiles travel by cp.async"
    AHEAD = max(1, STAGES - 1)                   # tiles on their way while one is computed on
    tiles = layout(BLOCK_M, BLOCK_N, D_PAD, PRECISION, STAGES)
    # Where the tiles sit in shared memory (16-bit tiles have no lo half: LO = HI is never read).
    Q_HI = tiles.offset("Q" if SIXTEEN else "Q_HI")
    Q_LO = Q_HI if SIXTEEN else tiles.offset("Q_LO")
    K_HI = tiles.offset("K" if SIXTEEN else "K_HI")
    K_LO = K_HI if SIXTEEN else tiles.offset("K_LO")
    V_HI = tiles.offset("V" if SIXTEEN else "V_HI")
    V_LO = V_HI if SIXTEEN else tiles.offset("V_LO")
    V_NAN = tiles.offset("V_NAN")
    NAN_PASSES = cdiv(BLOCK_N, STREAMERS)  # keys per thread in the NaN pass (16 x 64 tiles: 64 keys, 32 threads)
    KV_STAGE = tiles.offset("K_STAGE1") - K_HI if ASYNC else 0   # words from buffer 0 to buffer 1
    KEY_WARP_WORDS = tiles.offset("KEY_WARPS") - K_HI if KEY_WARPS > 1 else 0   # from one key warp's buffers on
    Q_ITERS, fetch_q, commit_q, _ = tile_movers(BLOCK_M, D_PAD, PRECISION, VEC, THREADS)
    # Decoding's key warps keep K_j, V_j in unpadded, swizzled rows (``tiling.swizzled_rows`` says why).
    SWIZZLED = swizzled_rows(D_PAD, PRECISION, KEY_WARPS)
    K_ITERS, fetch_key_rows, commit_key_rows, sanitize_key_row = tile_movers(BLOCK_N, D_PAD, PRECISION, VEC,
                                                                             STREAMERS, SWIZZLED)
    # Every thread copies: a tile, or with key warps a round of them (every warp's next tile, side by side in
    # the cache) into the warps' buffers, RUN_ROWS rows at a time: the round at once, or tile by tile from a paged
    # cache (a tile lies in one page, a round may not).
    RUN_ROWS = BLOCK_N if PAGED else KEY_WARPS * BLOCK_N
    copy_key_rows = (tile_copier(RUN_ROWS, D_PAD, THREADS, BLOCK_N, KEY_WARP_WORDS, SWIZZLED)[0] if ASYNC
                     else None)
    wait_oldest_tile = copy_async_wait(AHEAD - 1) if ASYNC else None   # one group per tile, AHEAD in flight
    rows_by_rows_t, accumulate_product = tile_products(BLOCK_N, D_PAD, PRECISION, WARP_TILES, SWIZZLED)
    # Partial results of a split are float32 (they are merged before rounding to the output type).
    OUTPUT = ("tf32x3", False) if SPLIT else (PRECISION, VEC)
    store_fragment_row, store_pair = fragment_row_store(D_PAD, *OUTPUT), pair_store(*OUTPUT)
    merge_tile = tile_merger(PRECISION, D_PAD, THREADS) if SPLIT else None
    key_flags = lane_flags(N_TILES)
    sequence, lse_row = sequence_bounds(VARLEN)
    row_start, pages_fit = cache_rows(PAGED)
    KV_CACHE = VARLEN == "cache"
    # Decoding (K/V by cp.async): Q_i travels by cp.async too, in the first K/V round's group, and both start
    # before the entry's length is read from memory; through registers, Q's load waited for that read and its
    # store held back the first K/V copies, which needed the length (two memory latencies in turn).
    EARLY_COPIES = ASYNC and KV_CACHE
    copy_q_rows = tile_copier(BLOCK_M, D_PAD, THREADS)[0] if EARLY_COPIES else None
    V_ROW_WORDS, V_ROW_STRIDE = D_PAD // 2, row_stride(D_PAD, True, SWIZZLED)   # (16-bit pairs)
    CLEAR_PASSES = cdiv(BLOCK_N * V_ROW_WORDS, STREAMERS)   # words per thread when a V tile's rows are cleared

    @inlined_device_function
    def key_of(tile_entries, first, x, k_first_tile, tile_step):
        """The first key of the x-th key tile this block visits."""
        return listed_tile(tile_entries, first + x, BLOCK_N)[0] if HAS_MASK else k_first_tile + x * tile_step

    @inlined_device_function
    def buffer_of(x):
        """Words from the first K/V buffer to the x-th visited tile's (x modulo STAGES, in 32 bits: three
        buffers make it a multiply by a magic number, some fifteen instructions in 64 bits)."""
        return int32(uint32(x) % uint32(STAGES)) * KV_STAGE

    @inlined_device_function
    def start_rows(smem, stage, k_regs, v_regs, K, V, k_row, v_row, k_sp, v_sp, k_sn, v_sn, pages, key, rows, head_dim,
                   tid):
        """K and V rows key .. key + RUN_ROWS - 1 (zeros from ``rows`` on) on their way to buffer ``stage``: by
        cp.async, or as global loads into registers.  The rows lie in one page (``row_start``)."""
        k_start, inside = row_start(k_row, key, k_sp, k_sn, pages)
        v_start, _ = row_start(v_row, key, v_sp, v_sn, pages)
        rows = rows if inside else 0    # none from a page outside the pool
        if ASYNC:
            copy_key_rows(smem, K_HI + stage, K, k_start, k_sn, rows, head_dim, tid)
            copy_key_rows(smem, V_HI + stage, V, v_start, v_sn, rows, head_dim, tid)
        else:
            fetch_key_rows(k_regs, K, k_start, k_sn, rows, head_dim, tid)
            fetch_key_rows(v_regs, V, v_start, v_sn, rows, head_dim, tid)

    @inlined_device_function
    def start_kv(smem, x, k_regs, v_regs, K, V, k_row, v_row, k_sp, v_sp, k_sn, v_sn, pages, n_tiles, tile_entries,
                 first, k_first_tile, tile_step, keys_visited, n_k, head_dim, tid):
        """The x-th visited tile's K and V (if there is one) on their way: by cp.async into its buffer, one group
        (empty past the last tile, so that groups count tiles), or as global loads into registers.

        Key warps: the block's x-th round, every warp's x-th tile, KEY_WARPS x BLOCK_N neighbouring keys
        copied by all the block's threads into the warps' buffers (zeros from ``keys_visited`` on: tiles no
        warp visits)."""
        if x < n_tiles:
            k0 = key_of(tile_entries, first, x, k_first_tile, tile_step)
            # Keys of the tile (or round) to copy; zeros after them.
            valid = (min(n_k, keys_visited) if KEY_WARPS > 1 else n_k) - k0
            stage = buffer_of(x) if ASYNC else 0
            if PAGED:   # tile by tile, as a round may span pages (a tile past the keys copies nothing; its page
                for w in range(KEY_WARPS):   # is looked up at the last key's, inside the table)
                    start_rows(smem, stage + w * KEY_WARP_WORDS, k_regs, v_regs, K, V, k_row, v_row, k_sp, v_sp, k_sn,
                               v_sn, pages, min(k0 + w * BLOCK_N, n_k - 1), valid - w * BLOCK_N, head_dim, tid)
            else:
                start_rows(smem, stage, k_regs, v_regs, K, V, k_row, v_row, k_sp, v_sp, k_sn, v_sn, pages, k0, valid,
                           head_dim, tid)
        if ASYNC:
            copy_async_commit()

    @inlined_device_function
    def land_kv(smem, stage, k_regs, v_regs, tid):
        """This thread's part of K_j, V_j in buffer ``stage``, row-major (tf32: hi and lo halves; 16-bit V
        is read by ldmatrix.trans): the oldest copies waited for, or the registers stored."""
        if ASYNC:
            wait_oldest_tile()
        else:
            commit_key_rows(smem, k_regs, K_HI + stage, K_LO + stage, tid)
            commit_key_rows(smem, v_regs, V_HI + stage, V_LO + stage, tid)

    @inlined_device_function
    def sanitize_v(smem, stage, flags, tid):
        """NaN in V_j to 0, and a flag per key at word ``flags`` (partly masked tiles only: see common.py)."""
        for i in range(NAN_PASSES):
            key = tid + i * STREAMERS
            if key < BLOCK_N:
                store_word(smem, flags + key, sanitize_key_row(smem, V_HI + stage, key))

    @inlined_device_function
    def sync_tile():
        """The barrier of the threads that read a K/V buffer: the block's, or a key warp's own."""
        if KEY_WARPS > 1:
            sync_warp()
        else:
            cuda.syncthreads()

    @inlined_device_function
    def tiles_of(n_tiles, split, key_warp, turns):
        """(this warp's tiles, the block's rounds, the keys the rounds cover) of a query tile that visits
        ``n_tiles`` key tiles: with splits or key warps, every turns-th from tile split KEY_WARPS + key_warp,
        warp 0 the most (its count is the rounds')."""
        if SPLIT or KEY_WARPS > 1:
            mine = ceil_div(max(0, n_tiles - (split * KEY_WARPS + key_warp)), turns)
            if KEY_WARPS > 1:
                return mine, ceil_div(max(0, n_tiles - split * KEY_WARPS), turns), n_tiles * BLOCK_N
            return mine, mine, 0
        return n_tiles, n_tiles, 0

    @inlined_device_function
    def clear_rows_from(smem, at, first_row, cleaner):
        """Rows first_row .. BLOCK_N - 1 of the 16-bit V tile at word ``at`` to zeros (a swizzle moves chunks
        within their row only): P is 0 there, and 0 times what a cache holds past its keys may be NaN."""
        for i in range(CLEAR_PASSES):
            word = cleaner + i * STREAMERS
            row = word // V_ROW_WORDS
            if row >= first_row and row < BLOCK_N:
                store_word(smem, at + row * V_ROW_STRIDE + word % V_ROW_WORDS, uint32(0))

    @inlined_device_function
    def mod_row(row, n_q, query_position, head_queries, mod_args):
        """(q_idx, mod_args) that the mods see for the tile's ``row``: the row itself (a packed sequence's rows
        count from its start), a KV cache's query at ``query_position`` + i, and with QUERY_GROUPS row g N_q + i as
        query i of head h G + g (``mod_args`` then holds h G); a row past N_q (padding) as row 0 (``inside``:
        ``mod_steps.entry_steps`` evaluates the mods at hidden entries too, and h must stay a head)."""
        if QUERY_GROUPS:
            b, first_head, scale, MOD0, MOD1, MOD2, MOD3 = mod_args
            row = inside(row, n_q)
            g = uint32(row) // uint32(head_queries)   # (32-bit: as the causal mask's row mod N_q)
            query = int64(uint32(row) - g * uint32(head_queries))
            return query + query_position, (b, first_head + int64(g), scale, MOD0, MOD1, MOD2, MOD3)
        return inside(row, n_q) + query_position, mod_args

    def entry_pass(POISON):
        """mask_scores (POISON False) or poison_weights (True): one walk over the lane's entries, with each
        row's visible keys computed once (one compare per entry, so that NVVM unrolls the loops: rolled,
        a run-time index would send s to local memory)."""

        @inlined_device_function
        def walk(s, v_nan, c_log2, q0, row0, k0, t, n_q, n_k, causal_offset, partly_masked, M, bh, mask_rows,
                 mask_cols, mask_t_r, mask_t_c, head_queries, query_position, mod_args):
            for r in range(LANE_ROWS):
                row = q0 + row0 + 8 * r
                if SCORE_MOD or MASK_MOD:   # (only then: without mods the kernel's PTX is as before they came)
                    q_idx, row_args = mod_row(row, n_q, query_position, head_queries, mod_args)
                if QUERY_GROUPS:   # row g N_q + i of a packed group: query i's diagonal
                    end = (keys_end(int64(uint32(row) % uint32(head_queries)), head_queries, n_k, CAUSAL,
                                    causal_offset) if row < n_q else int64(0))
                else:
                    end = keys_end(row, n_q, n_k, CAUSAL, causal_offset)
                for nt in range(N_TILES):
                    x_row, half = (r // 2) * N_TILES + nt, r % 2
                    for e in range(2):
                        key = k0 + nt * 8 + 2 * t + e
                        visible = allowed_below(end, row, key, partly_masked if READS_LAYOUT else False, M, bh,
                                                mask_rows, mask_cols, mask_t_r, mask_t_c)
                        if MASK_MOD and partly_masked:   # (full tiles skip the test: ``sparsity/mod_tiles.py``)
                            visible = mod_allows(visible, q_idx, inside(key, n_k), row_args)
                        if POISON:
                            if visible and (v_nan >> uint64(2 * nt + e)) & uint64(1):
                                s[x_row, 2 * half + e] = float32(math.nan)
                        elif SCORE_MOD:   # the mod's score in log2 units, -inf where not visible
                            s[x_row, 2 * half + e] = mod_score(s[x_row, 2 * half + e], visible, q_idx, inside(key, n_k),
                                                               row_args)
                        else:
                            x = s[x_row, 2 * half + e] if POSITIVE_SCALE else s[x_row, 2 * half + e] * c_log2
                            s[x_row, 2 * half + e] = x if visible else float32(NEG_INF)

        return walk

    #: mask_scores(s, v_nan, c_log2, ...): -inf where the query may not see the key (a scale <= 0 first
    #: scales the scores to log2 units); v_nan unused.
    mask_scores = entry_pass(False)
    #: poison_weights(s, v_nan, c_log2, ...): P = NaN where the key is allowed and its value row held a NaN
    #: (v_nan: the lane's key flags, ``lane_flags``): O is NaN there, while l and lse stay those of the logits.
    poison_weights = entry_pass(True)

    @inlined_device_function
    def online_softmax(s, m_i, l_i, r, c_log2):
        """The lane's row r (g + 8 r): new max, P = exp2(c S - m) in place, l updated; returns alpha.

        With a positive scale c the row max is taken over the unscaled scores and scaled once (c > 0
        keeps their order), and c S - m is one FMA per entry: a multiply per entry fewer than scaling
        the scores first, as FlashAttention-2 does.  m, l and lse are in log2 units either way.
        """
        first, half = (r // 2) * N_TILES, r % 2     # the row's entries: s[first + nt, 2 half + e]
        m_tile = float32(NEG_INF)
        for nt in range(N_TILES):
            m_tile = max(m_tile, max(s[first + nt, 2 * half], s[first + nt, 2 * half + 1]))
        # The four lanes of a row hold different columns: combine them.
        m_tile = max(m_tile, shfl_xor(m_tile, 1))
        m_tile = max(m_tile, shfl_xor(m_tile, 2))
        if POSITIVE_SCALE:
            m_tile *= c_log2
        m_new = max(m_i[r], m_tile)
        # A row that has seen no allowed key keeps m = -inf; shifting by 0
        # instead makes every exp2 below exactly 0 rather than NaN.
        shift = m_new if m_new != float32(NEG_INF) else float32(0)
        alpha = exp2(m_i[r] - shift)
        row_sum = float32(0)
        for nt in range(N_TILES):
            for e in range(2):
                x = s[first + nt, 2 * half + e]
                p = exp2(cuda.fma(x, c_log2, -shift) if POSITIVE_SCALE else x - shift)
                s[first + nt, 2 * half + e] = p
                row_sum += p
        l_i[r] = alpha * l_i[r] + row_sum
        m_i[r] = m_new
        return alpha

    @inlined_device_function
    def dropout(s, q0, row0, k0, t, bh, keep_threshold, keep_scale, seed0, seed1):
        """Algorithm 2, lines 14-15: drop P entries (kept ones scaled by 1 / (1 - p))."""
        for r in range(LANE_ROWS):
            row = q0 + row0 + 8 * r
            half = r % 2
            for nt in range(N_TILES):
                x_row = (r // 2) * N_TILES + nt
                first, second = dropout_words(row, k0 + nt * 8 + 2 * t, bh, seed0, seed1, t)
                s[x_row, 2 * half] *= float32(keep_scale) if first >= keep_threshold else float32(0)
                s[x_row, 2 * half + 1] *= float32(keep_scale) if second >= keep_threshold else float32(0)

    @inlined_device_function
    def row_sum(l_lane):
        """A row's l from the partial sums of the four lanes that hold it (each sums its own columns)."""
        l_row = l_lane + shfl_xor(l_lane, 1)
        return l_row + shfl_xor(l_row, 2)

    @inlined_device_function
    def inverse_sum(l_row, overflowing):
        """1 / l; 0 for a row that saw no allowed key (l = 0: O = 0), NaN in every row of a cache entry that
        ``overflowing`` (``sequence_bounds``: 0 * NaN).  l = NaN stays NaN."""
        if overflowing:
            return float32(math.nan)
        return float32(1) / l_row if l_row != float32(0) else float32(0)

    @inlined_device_function
    def write_lse(LSE, at, m_log2, l_row, overflowing):
        """lse = m + log l (-inf for a row with no allowed key; NaN where the entry is ``overflowing``)."""
        LSE[at] = row_lse(m_log2, l_row) if not overflowing else float32(math.nan)

    @inlined_device_function
    def write_output(O, LSE, acc, m_i, l_i, q0, row0, t, o_row, o_sn, lse_first, n_q, head_dim, overflowing):
        """O_i = acc / l and lse = m + log l, once (``inverse_sum``, ``write_lse``)."""
        for r in range(LANE_ROWS):
            l_row = row_sum(l_i[r])
            inv_l = inverse_sum(l_row, overflowing)
            row = q0 + row0 + 8 * r
            if row < n_q:
                store_fragment_row(O, acc, r, o_row + row * o_sn, head_dim, inv_l, t)
                if t == 0:
                    write_lse(LSE, lse_first + row, m_i[r], l_row, overflowing)

    # ---- key warps: the block's result from its warps' partial ones (KEY_WARPS > 1) ----
    RESULT_ROW = 2 * 32     # words of a key warp's result per lane row r: m of the 32 lanes, then l
    RESULT_O = 2 * RESULT_ROW   # then its O fragments: word e of fragment dt of lane l at 4 dt 32 + e 32 + l
    WARP_D_TILES = cdiv(D_TILES, KEY_WARPS)   # the 8-wide column tiles of O that each warp combines and writes

    def fragment_saver(dt):
        """save(smem, acc, at, lane): O fragment ``dt`` of the lane into its warp's result at word ``at`` (the
        index a constant: a loop over the fragments stays rolled in NVVM, and a run-time index sends the whole
        accumulator to local memory)."""
        @inlined_device_function
        def save(smem, acc, at, lane):
            for e in range(4):
                store_word(smem, at + RESULT_O + 4 * dt * 32 + e * 32 + lane, f32_as_u32(acc[dt, e]))

        return save

    save_fragments = unrolled([fragment_saver(dt) for dt in range(D_TILES)]) if KEY_WARPS > 1 else None

    @inlined_device_function
    def share_results(smem, acc, m_i, l_i, key_warp, lane):
        """Each key warp's m, l and O fragments, lane by lane, into its own buffers, for every warp to read
        after the block barrier.  The buffers are free once the warp's lanes are past ``sync_warp`` (each read
        its last tile before; every copy into them landed before the last round's barrier, or, copied early
        for rounds the entry lacks, before the barrier after the loop)."""
        at = K_HI + key_warp * KEY_WARP_WORDS
        sync_warp()   # every lane of this warp done with its last tile before its result overwrites it
        for r in range(2):
            store_word(smem, at + r * RESULT_ROW + lane, f32_as_u32(m_i[r]))
            store_word(smem, at + r * RESULT_ROW + 32 + lane, f32_as_u32(l_i[r]))
        save_fragments(smem, acc, at, lane)
        cuda.syncthreads()   # every warp's result in shared memory before any warp reads them

    @inlined_device_function
    def combined(smem, weights, word, lane):
        """sum_w a_w x_w over the key warps' results, x_w the lane's word ``word`` of warp w's (in the order of
        the warps: the same bits every call; a warp of weight 0 is not read, so that 0 * NaN cannot count)."""
        total = float32(0)
        for w in range(KEY_WARPS):
            if weights[w] != float32(0):
                total += weights[w] * u32_as_f32(load_word(smem, K_HI + w * KEY_WARP_WORDS + word + lane))
        return total

    @inlined_device_function
    def write_merged_output(O, LSE, smem, key_warp, lane, q0, row0, t, o_row, o_sn, lse_first, n_q, head_dim,
                            overflowing):
        """The key warps' results (``share_results``) combined and written, as ``cache.py``'s merge combines
        splits: with m = max_w m_w and weights a_w = exp2(m_w - m), l = sum_w a_w l_w and O = sum_w a_w O_w
        (``combined``).  A warp that saw no key of a row (m_w = -inf, l_w = 0) weighs 0 there, one that saw
        only NaN scores (m_w = -inf, l_w = NaN) NaN.

        Every warp combines m and l, then the O columns of its own WARP_D_TILES tiles, and writes them; warp 0 writes
        lse.  (Warp 0 alone combining and writing every column took 7% of the kernel's warp samples after its loop,
        against cuDNN's 1%: ncu, H200, 2026-12-03, ``experiments/tuning/results/decode_breakdown_h200.md``.) Rows past
        the queries (decoding's rows g + 8 for up to 8 queries) are neither combined nor written."""
        weights = cuda.local.array(KEY_WARPS, float32)
        for r in range(2):
            if q0 + 8 * r >= n_q:   # no lane's row g + 8 r is a query (the whole warp skips: no shuffle waits)
                continue
            m = float32(NEG_INF)
            for w in range(KEY_WARPS):
                m = max(m, u32_as_f32(load_word(smem, K_HI + w * KEY_WARP_WORDS + r * RESULT_ROW + lane)))
            shift = m if m != float32(NEG_INF) else float32(0)   # no key in any warp: every weight 0
            for w in range(KEY_WARPS):
                result = K_HI + w * KEY_WARP_WORDS + r * RESULT_ROW + lane   # warp w's m; its l 32 words on
                m_w, l_w = u32_as_f32(load_word(smem, result)), u32_as_f32(load_word(smem, result + 32))
                # m_w = -inf: the warp saw no allowed key (l_w = 0: weight 0), or only NaN scores (a NaN query
                # row, whose max passes over NaN: l_w = NaN, which must reach the row as one warp's result does).
                no_key = m_w == float32(NEG_INF) and l_w == float32(0)
                weights[w] = exp2(m_w - shift) if m_w != float32(NEG_INF) or no_key else float32(math.nan)
            l_row = row_sum(combined(smem, weights, r * RESULT_ROW + 32, lane))
            inv_l = inverse_sum(l_row, overflowing)
            row = q0 + row0 + 8 * r
            if row < n_q:
                for i in range(WARP_D_TILES):
                    dt = key_warp * WARP_D_TILES + i
                    if D_TILES % KEY_WARPS == 0 or dt < D_TILES:
                        at = RESULT_O + 4 * dt * 32 + 2 * r * 32   # the lane's words (g + 8 r, 2t) and (.., 2t + 1)
                        store_pair(O, o_row + row * o_sn, dt * 8 + 2 * t, combined(smem, weights, at, lane) * inv_l,
                                   combined(smem, weights, at + 32, lane) * inv_l, head_dim)
                if key_warp == 0 and t == 0:
                    write_lse(LSE, lse_first + row, m, l_row, overflowing)

    def kernel(Q, K, V, O, LSE, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn, heads, group,
               n_q, n_k, head_dim, q_tiles, causal_offset, scale_log2, tile_offsets, tile_entries, tile_order, M,
               mask_rows, mask_cols, mask_t_r, mask_t_c, q_bounds, q_step, k_bounds, k_step, bottom_right, new_keys,
               lse_sb, lse_sh, splits, o_split, lse_split, MERGED_O, MERGED_LSE, ARRIVALS, keep_threshold,
               keep_scale, seed0, seed1, PAGES, pages_sb, page_size, num_pages, k_sp, v_sp, head_queries, MOD0, MOD1,
               MOD2, MOD3):
        # Q, K, V, O: flat words (module docstring of common.py); LSE: flat (batch*heads, N_q) float32.
        # Key/value head h // group serves query head h.  causal: key j visible to row i iff j <= i + causal_offset.
        # HAS_MASK: the key tiles of query tile qt of head bh are tile_entries[tile_offsets[bh (q_tiles + 1) + qt]
        # ...] (``listed_tile``), and block i runs tile tile_order[i] (bh q_tiles + qt: the longest lists first);
        # M: the (bh, mask_t_r, mask_t_c) uint8 block layout, blocks (mask_rows, mask_cols).
        # VARLEN: q_bounds, k_bounds bound each batch entry's rows (``sequence_bounds``).
        # SPLIT: O, LSE take this split's partial results; the tile's last split writes MERGED_O, MERGED_LSE.
        # PAGED: entry b's row of the block table PAGES starts at b * pages_sb (``common.cache_rows``); K and V are
        # pools of pages k_sp and v_sp apart, with no batch stride (k_sb = v_sb = 0).
        # MODS: MOD0..MOD3 are the score_mod's arrays, then the mask_mod's (``mod_steps``); placeholders otherwise.
        if HAS_MASK:
            tile, h, b, bh = tile_coordinates(tile_order[cuda.blockIdx.x], q_tiles, heads)
        else:
            tile, h, b, bh = tile_coordinates(cuda.blockIdx.x, q_tiles * splits if SPLIT else q_tiles, heads, CAUSAL,
                                              KV_CACHE)
        # Splits serve decoding only, which divides in 32 bits as ``tile_coordinates(narrow)``: the (16, 32)
        # split kernel's first copy came after 299 SASS instructions, a call of a 64-bit division among them;
        # now after 225.
        split = int64(uint32(tile) // uint32(q_tiles)) if SPLIT else 0
        tile -= split * q_tiles
        lse_rows = n_q                           # of lse per (batch, head), or per head when VARLEN
        # Causal query tiles further down have more keys to visit: rank 0 is the last one, and every head's
        # rank 0 starts first (``tile_coordinates``).  A block mask's order already says which tile.
        q_tile = q_tiles - 1 - tile if CAUSAL and not HAS_MASK else tile
        q0 = q_tile * BLOCK_M
        tid = cuda.threadIdx.x
        warp, g, t = warp_lane(tid)
        key_warp = warp if KEY_WARPS > 1 else 0  # which of the block's key warps (their rows are the same)
        row_warp = 0 if KEY_WARPS > 1 else warp  # which 16 (or 32) of the block's rows the warp owns
        own = key_warp * KEY_WARP_WORDS          # words from the block's K/V buffers to this warp's
        cleaner = tid % 32 if KEY_WARPS > 1 else tid   # this thread's rows when a tile's V is cleaned of NaN
        row0 = row_warp * WARP_ROWS + g          # this lane's rows: row0 + 8 r, r < LANE_ROWS
        kv_h = int64(uint32(h) // uint32(group)) if KV_CACHE else h // group   # as ``tile_coordinates``' narrow
        k_head = b * k_sb + kv_h * k_sh          # row 0 of this head's K (and V), before a sequence's first row
        v_head = b * v_sb + kv_h * v_sh
        pages = (PAGES, b * pages_sb, page_size, num_pages)   # where a paged entry's rows are (``row_start``)
        c_log2 = float32(scale_log2)             # softmax scale times log2(e)
        # What the mods read besides the entry (``mod_steps.entry_steps``): batch, query head (a packed group's
        # first: ``mod_row``), scale, their arrays.
        mod_args = (b, h * int64(uint32(n_q) // uint32(head_queries)) if QUERY_GROUPS else h,
                    float32(scale_log2 / LOG2_E), MOD0, MOD1, MOD2, MOD3)
        smem = cuda.shared.array(0, uint32)
        # The next K and V tiles in flight (register path only; cp.async needs no registers, and these go unused).
        k_regs = cuda.local.array((K_ITERS, 4), WORD)
        v_regs = cuda.local.array((K_ITERS, 4), WORD)

        # ---- the order of the key tiles (first, tile_step), and for decoding the first copies ---- The splits of a
        # query tile take turns along its keys, so that the blocks streaming one head's cache read neighbouring tiles at
        # any moment: 1.04x faster decoding than each split reading one contiguous run (H200, 2026-12-02,
        # ``experiments/tuning/results/decode_split_order_h200.md``; ``cp_async_stream.py`` shows the same on copies
        # alone).  Key warps take turns in the same way within the block: warp w of split s visits every turns-th tile
        # from tile ``first`` = s KEY_WARPS + w (a block mask lists its tiles instead). (Unsplit, turns is a constant: a
        # shift where a run-time count cost two 64-bit divisions.)
        turns = (splits if SPLIT else 1) * KEY_WARPS
        first = split * KEY_WARPS + key_warp
        tile_step = BLOCK_N * turns               # keys from one visited tile to the next, unmasked
        k_first_tile = first * BLOCK_N            # the key of the first visited tile, unmasked
        round_first_key = k_first_tile - key_warp * BLOCK_N   # key warps: warp 0's, whose round the block copies
        if EARLY_COPIES:
            # Before the entry's length is read (``sequence``: a load from memory), Q_i and the first AHEAD
            # rounds start on their way bounded by the cache's rows (n_k, here its N_max): their rows past
            # the entry's keys are cleared in the loop (``clear_rows_from``).
            copy_q_rows(smem, Q_HI, Q, b * q_sb + h * q_sh + q0 * q_sn, q_sn, n_q - q0, head_dim, tid)
            _, capacity, capacity_keys = tiles_of(ceil_div(n_k, BLOCK_N), split, key_warp, turns)
            for x in range(AHEAD):
                start_kv(smem, x, k_regs, v_regs, K, V, k_head, v_head, k_sp, v_sp, k_sn, v_sn, pages, capacity,
                         tile_entries, first, round_first_key, tile_step, capacity_keys, n_k, head_dim, tid)
        # (QUERY_GROUPS: the entry's causal offset is that of one head's N_q queries; n_q stays the tile's rows.)
        q_first, k_first, n_q_b, n_k, causal_offset = sequence(b, q_bounds, q_step, k_bounds, k_step,
                                                               head_queries if QUERY_GROUPS else n_q, n_k,
                                                               causal_offset, bottom_right, new_keys)
        if not QUERY_GROUPS:
            n_q = n_q_b
        if PAGED:   # an entry whose table names a page outside the pool for one of its keys: none seen, NaN out
            n_k = n_k if pages_fit(pages, n_k, tid, THREADS) else int64(-1)
        overflowing = KV_CACHE and n_k < 0   # a cache entry whose keys do not fit: NaN out
        if VARLEN and q0 >= n_q:  # the grid covers the longest sequence; the whole block leaves together
            return
        # A cache's query i sits at position L_b - N_q + i of its entry (what its mods see: ``mod_row``).
        query_position = n_k - (head_queries if QUERY_GROUPS else n_q) if KV_CACHE else int64(0)
        k_row = k_head + k_first * k_sn          # row 0 of this sequence's K (and V)
        v_row = v_head + k_first * v_sn

        # ---- the key tiles this query tile visits, this warp's (n_tiles) and the block's rounds ----
        if HAS_MASK:  # listed by the host
            first = tile_offsets[bh * (q_tiles + 1) + q_tile]
            n_tiles = tile_offsets[bh * (q_tiles + 1) + q_tile + 1] - first
            rounds, keys_visited = n_tiles, 0
        else:
            n_tiles = ceil_div(n_k, BLOCK_N)
            if CAUSAL:  # no key beyond the last row's diagonal
                last = head_queries if QUERY_GROUPS else min(q0 + BLOCK_M, n_q)   # past the tile's last query
                n_tiles = min(n_tiles, max(0, ceil_div(last + causal_offset, BLOCK_N)))
            n_tiles, rounds, keys_visited = tiles_of(n_tiles, split, key_warp, turns)

        # ---- Q_i: loaded once, it stays in shared memory for the whole loop ----
        q_regs = cuda.local.array((Q_ITERS, 4), WORD)
        # (A block mask's tile may visit nothing: O = 0, lse = -inf without Q.)
        if not EARLY_COPIES and (not HAS_MASK or n_tiles > 0):
            fetch_q(q_regs, Q, b * q_sb + h * q_sh + (q_first + q0) * q_sn, q_sn, n_q - q0, head_dim, tid)
            commit_q(smem, q_regs, Q_HI, Q_LO, tid)

        m_i = cuda.local.array(LANE_ROWS, float32)    # running max (log2 units) of the lane's rows
        l_i = cuda.local.array(LANE_ROWS, float32)    # running sum, this lane's columns only
        alpha = cuda.local.array(LANE_ROWS, float32)  # this tile's rescale of O, per row
        acc = cuda.local.array((O_ROWS, 4), float32)
        s = cuda.local.array((S_ROWS, 4), float32)
        for r in range(LANE_ROWS):
            m_i[r] = float32(NEG_INF)
            l_i[r] = float32(0)
        for x_row in range(O_ROWS):
            for e in range(4):
                acc[x_row, e] = float32(0)

        if not EARLY_COPIES:
            for x in range(AHEAD):
                start_kv(smem, x, k_regs, v_regs, K, V, k_row, v_row, k_sp, v_sp, k_sn, v_sn, pages, rounds,
                         tile_entries, first, round_first_key, tile_step, keys_visited, n_k, head_dim, tid)

        for j in range(rounds):
            if HAS_MASK:
                k0, partly_masked = listed_tile(tile_entries, first + j, BLOCK_N)
                if not PARTLY_MASKED:  # a constant for the compiler: the element test below is compiled out
                    partly_masked = False
            else:
                k0, partly_masked = k_first_tile + j * tile_step, MOD_EVERY_TILE
            stage = own + buffer_of(j)   # the word offset of tile j's buffer
            if not ASYNC:
                cuda.syncthreads()  # every warp is done with tile j - 1, which tile j overwrites
            land_kv(smem, stage, k_regs, v_regs, tid)
            # Tile j (and Q_i) complete in shared memory; with cp.async, also every warp done with
            # tile j - 1, so that start_kv may refill its buffer with tile j + AHEAD.  (Key warps: round j,
            # every warp's tile j, copied by all the block's threads.)
            cuda.syncthreads()
            start_kv(smem, j + AHEAD, k_regs, v_regs, K, V, k_row, v_row, k_sp, v_sp, k_sn, v_sn, pages, rounds,
                     tile_entries, first, round_first_key, tile_step, keys_visited, n_k, head_dim, tid)
            if KEY_WARPS > 1 and j >= n_tiles:   # a key warp past its last tile still copies and meets the barriers
                continue
            if EARLY_COPIES and j < AHEAD and k0 + BLOCK_N > n_k:   # copied up to the cache's rows: past the keys,
                clear_rows_from(smem, V_HI + stage, n_k - k0, cleaner)   # V holds what the cache holds there
                sync_tile()
            # Tiles that some query may not fully see: crossing the diagonal, or partly
            # covered by the block mask or a mask_mod (their masked weights are 0: see common.py on NaN).
            mixed = (CAUSAL and k0 + BLOCK_N - 1 > (0 if QUERY_GROUPS else q0) + causal_offset) or partly_masked
            if mixed:  # the same for every thread of the block (of the warp, for key warps): all reach the barrier
                sanitize_v(smem, stage, V_NAN + own, cleaner)
                sync_tile()  # V_j without NaN, and its flags, before any warp reads them

            rows_by_rows_t(s, smem, Q_HI, Q_LO, K_HI + stage, K_LO + stage, row_warp * WARP_ROWS, g, t)  # S = Q_i K_j^T
            v_nan = key_flags(smem, V_NAN + own, t) if mixed else uint64(0)
            if mixed or k0 + BLOCK_N > n_k or not POSITIVE_SCALE:
                mask_scores(s, v_nan, c_log2, q0, row0, k0, t, n_q, n_k, causal_offset, partly_masked, M, bh,
                            mask_rows, mask_cols, mask_t_r, mask_t_c, head_queries, query_position,
                            mod_args)
            for r in range(LANE_ROWS):
                alpha[r] = online_softmax(s, m_i, l_i, r, c_log2)
            if HAS_DROPOUT:
                dropout(s, q0, row0, k0, t, bh, keep_threshold, keep_scale, seed0, seed1)
            if v_nan != uint64(0):  # this lane's keys of a partly masked tile include a NaN value row
                poison_weights(s, v_nan, c_log2, q0, row0, k0, t, n_q, n_k, causal_offset, partly_masked, M, bh,
                               mask_rows, mask_cols, mask_t_r, mask_t_c, head_queries, query_position,
                            mod_args)
            accumulate_product(acc, alpha, s, smem, V_HI + stage, V_LO + stage, g, t)  # O = alpha O + P V_j

        if EARLY_COPIES and rounds < AHEAD:   # rounds copied early that the entry does not have: every thread's
            copy_async_wait_all()             # copies landed before the block ends, or its warps' results
            cuda.syncthreads()                # overwrite the buffers (``share_results``)
        o_row = split * o_split + b * o_sb + h * o_sh + q_first * o_sn   # row 0 of this head's O (and lse)
        head_row = lse_row(bh, b, h, q_first, lse_rows, lse_sb, lse_sh)   # row 0 of this head's (merged) results
        lse_first = split * lse_split + head_row
        if KEY_WARPS > 1:
            share_results(smem, acc, m_i, l_i, key_warp, tid % 32)
            write_merged_output(O, LSE, smem, key_warp, tid % 32, q0, row0, t, o_row, o_sn, lse_first, n_q,
                                head_dim, overflowing)
        else:
            write_output(O, LSE, acc, m_i, l_i, q0, row0, t, o_row, o_sn, lse_first, n_q, head_dim, overflowing)
        # Flash-decoding: the last of the query tile's splits to get here merges them all (``cache.py``).
        if SPLIT and last_to_arrive(ARRIVALS, bh * q_tiles + tile, splits, tid):
            merge_tile(O, LSE, MERGED_O, MERGED_LSE, head_row + q0, min(BLOCK_M, n_q - q0),
                       splits, lse_split, head_dim, tid)

    data = ((np.uint32 if VEC else np.uint16) if SIXTEEN else np.float32)
    return Kernel(kernel, kernel_name("flash2_forward", (BLOCK_M, BLOCK_N), D_PAD, PRECISION, VEC, CAUSAL, HAS_MASK,
                                      HAS_DROPOUT, VARLEN) + ("_split" if SPLIT else "")
                  + ("" if WARP_ROWS == ROWS_PER_WARP else f"_warp{WARP_ROWS}")
                  + ("_whole_tiles" if HAS_MASK and not PARTLY_MASKED else "")
                  + ("" if POSITIVE_SCALE or SCORE_MOD else "_nonpositive_scale")
                  + (f"_stages{STAGES}" if STAGES > 2 else "")
                  + (f"_key_warps{KEY_WARPS}" if KEY_WARPS > 1 else "") + ("_paged" if PAGED else "")
                  + ("_query_groups" if QUERY_GROUPS else "")
                  + mods_suffix(MODS),
                  arrays=dict(Q=data, K=data, V=data, O=np.float32 if SPLIT else data, LSE=np.float32,
                              MERGED_O=output_element(PRECISION)[1], MERGED_LSE=np.float32, ARRIVALS=np.uint32,
                              tile_offsets=np.int32, tile_entries=np.int32, tile_order=np.int32, M=np.uint8,
                              q_bounds=np.int32, k_bounds=np.int32, PAGES=np.int32,
                              **slot_arrays(MODS)),
                  floats=("scale_log2", "keep_scale"),
                  # Dense: two blocks per multiprocessor (128 registers for 2 x 8 warps), at d <= 64,
                  # and for 16-bit at d <= 128 once K_j, V_j come by cp.async (no registers hold them: ptxas
                  # then fits d = 128 in 128 registers with 28 bytes of spills, against 168 left alone, one
                  # block).  float32 at d = 64 used exactly 128 until tf32 rounding kept NaN (130 without
                  # the cap: one block per multiprocessor; 128 with 4 bytes of spills under it).
                  # Masks tested per element, dropout and packed sequences need more, and would spill under
                  # the cap (tests/gpu_compile_all.py prints them); a mask of whole tiles compiles like dense.
                  # Decoding's key warps: one block per multiprocessor (their K/V buffers fill its shared memory),
                  # all its registers theirs.  (Left alone, ptxas 13 once gave the (16, 32) d = 128 kernel 167 of
                  # them, when the block coordinates were computed in 32 bits, and P V's mma then waited on each
                  # other's registers: NOPs between them, K and V streamed 2% slower on the H200, 2026-12-03.)
                  launch_bounds=((THREADS, 2) if (D_PAD <= 64 or ASYNC and D_PAD <= 128)
                                 and not (HAS_MASK and PARTLY_MASKED or HAS_DROPOUT or VARLEN or MODS is not None)
                                 else (THREADS, 1) if KEY_WARPS > 1 else None))


def forward_launch(call, splits=1, kv_stages=2, key_warps=1, warp_rows=None):
    """flash2's forward for a validated ``AttentionCall`` as a ``Launch``, K/V tiles in up to ``kv_stages``
    shared buffers (``make_forward``'s KV_STAGES), ``key_warps`` warps taking turns along each query tile's
    keys (``make_forward``'s KEY_WARPS: decoding), ``warp_rows`` query rows per warp (None: the forward's
    ``tiling.flash2_forward_warp_rows``; decoding's plan may ask for 16).  A decoding call whose query heads
    are packed as rows (``Varlen.head_queries``) and causal takes ``make_forward``'s QUERY_GROUPS.

    Per call it takes q, k, v (the caller's arrays), o and lse (new results,
    C-contiguous), then for per-batch lengths the bounds q_bounds and k_bounds
    (a paged cache: its lengths, then its block table, int32 rows ``pages_sb``
    apart), then the dropout seed's two words.  With ``splits`` > 1 (flash-decoding) o
    and lse are the splits' partial results instead: float32 (splits, rows,
    d_pad) and (splits, rows), rows = batch * heads * N_q; after the bounds come
    the merged o and lse (C-contiguous (rows, d) and (rows,)) and the arrival
    counts, one uint32 per query tile, zero before the first call
    (``cache.last_to_arrive``).
    """
    block_m, block_n = call.block_sizes
    d_pad = padded_head_dim(call.head_dim, call.precision)
    has_mask, has_dropout = has_tile_lists(call), call.dropout_p > 0
    partly = partly_masked_tiles(call, (block_m, block_n), "forward")
    layout = partial(flash2_forward_smem, key_warps=key_warps)
    stages = flash2_stages(layout, block_m, block_n, d_pad, precision=call.precision, vec=call.vec, most=kv_stages)
    # The sign of the kernel's float32 scale: a tiny positive scale (1e-112) rounds to 0 there.
    mods = call.mods
    steps = mod_steps(*mods) if mods else None
    positive_scale = bool(np.float32(call.scale * LOG2_E) > 0) and not (steps and steps.has_score)
    if warp_rows is None:
        warp_rows = flash2_forward_warp_rows(block_m, d_pad, call.precision,
                                             plain=not (partly or has_dropout or steps is not None))
    mode = sequence_mode(call)
    paging = call.varlen.paging if call.varlen else None
    head_queries = call.varlen.head_queries if call.varlen and call.varlen.head_queries else call.n_q
    # (packed rows need the kernel's attention when they differ: under causal, or to the mods)
    query_groups = bool(call.varlen and call.varlen.head_queries and (call.causal or mods))
    kernel = make_forward(block_m, block_n, d_pad, call.precision, call.vec, call.causal, has_mask, has_dropout,
                          mode, splits > 1, positive_scale, warp_rows, partly, stages, key_warps, paging is not None,
                          query_groups, steps)
    q_tiles = cdiv(call.longest_q, block_m)
    qs, ks, vs = call.strides
    words = word_extent(call)
    q_shape, kv_shape = call.kernel_shapes
    rows = lse_slabs(call) * call.n_q
    merged = ("MERGED_O", "MERGED_LSE", "ARRIVALS")
    if splits > 1:   # partial results, one (rows, d_pad) float32 slab per split
        os_ = Strides(call.heads * call.n_q * d_pad, call.n_q * d_pad, d_pad)
        split_layout = dict(splits=splits, o_split=rows * d_pad, lse_split=rows)
        extents = dict(O=splits * rows * d_pad, LSE=splits * rows, MERGED_O=rows * call.head_dim, MERGED_LSE=rows,
                       ARRIVALS=q_tiles * call.batch_heads)
    else:
        os_ = call.result_strides("q")
        split_layout = dict(splits=1, o_split=0, lse_split=0, **{name: placeholder(kernel.arrays[name])
                                                                 for name in merged})
        extents = dict(O=words(q_shape, os_), LSE=rows)
        merged = ()
    fixed = dict(q_sb=qs.batch, q_sh=qs.head, q_sn=qs.row, k_sb=ks.batch, k_sh=ks.head, k_sn=ks.row,
                 v_sb=vs.batch, v_sh=vs.head, v_sn=vs.row, o_sb=os_.batch, o_sh=os_.head, o_sn=os_.row,
                 heads=call.heads, group=call.group, n_q=call.n_q, n_k=call.n_k, head_dim=call.head_dim,
                 q_tiles=q_tiles, causal_offset=call.causal_offset, scale_log2=call.scale * LOG2_E,
                 **dropout_arguments(call), **block_mask_arguments(call, (block_m, block_n), "forward"),
                 **sequence_arguments(call), **paging_arguments(paging), **split_layout,
                 k_sp=ks.batch if paging else 0, v_sp=vs.batch if paging else 0, head_queries=head_queries,
                 **slot_arguments(mods))
    if paging:   # pools of pages: an entry's pages come from the table, so no batch stride
        fixed.update(k_sb=0, v_sb=0)
    extents.update(Q=words(q_shape, qs), K=words(kv_shape, ks), V=words(kv_shape, vs))
    # Per-batch bounds come per call: a cache's lengths alone (its queries' bounds are the call's own), and a paged
    # cache's block table.
    bounds, bounds_extents = sequence_arrays(call)
    per_call = ("Q", "K", "V", "O", "LSE") + bounds + (("PAGES",) if paging else ()) + merged + ("seed0", "seed1")
    extents.update(bounds_extents)
    if paging:
        extents.update(PAGES=paging.table_extent)
    return Launch(kernel, q_tiles * splits * call.batch_heads, flash2_threads(block_m, warp_rows) * key_warps,
                  layout(block_m, block_n, d_pad, call.precision, stages).bytes, fixed, per_call, extents)
