"""The public API of numba-flash: ``attention`` and ``attention_backward``, their packed
variable-length forms ``attention_varlen`` and ``attention_varlen_backward``, and decoding from a KV
cache, ``attention_with_kv_cache``.

A call is checked once per distinct set of shapes, strides, dtypes and
options: the checked call becomes a *plan* (the validated ``AttentionCall``
and its kernels' launches laid out, ``runtime/launch.py``), kept in a small
cache keyed by a cheap summary of the arrays.  A later call with the same
summary allocates its results, writes the data pointers and launches: no
argument typing, no host synchronisation (``README``: "Host time per call").
"""
import functools
from collections import namedtuple
from dataclasses import replace

import numpy as np
from numba import cuda

from ._validation import (FORWARD_ALGORITHMS, GRADIENT_ALGORITHMS, VARLEN_ALGORITHMS, check_attention_args,
                          check_backward_operands, check_block_table_pages, check_cache_args, check_cache_seqlens,
                          check_cu_seqlens, check_decode_layout, check_deterministic, check_device_cache_seqlens,
                          check_dropout, check_loop, check_mod_shapes, check_mods, check_new_keys, check_varlen_args,
                          operand_strides, streamed)
from .decode_plan import decode_plan
from .dropout import kernel_args as dropout_kernel_args
from .dropout import seed_words
from .kernels.fast.backward import backward_launches, table_fused
from .kernels.fast.bias_table import table_rows
from .kernels.fast.cache import append_launch
from .kernels.fast.forward import forward_launch
from .kernels.hopper import backward as hopper_backward
from .kernels.hopper import forward as hopper
from .kernels.literal.flash1_backward import flash1_backward
from .kernels.literal.flash1_forward import flash1_forward
from .kernels.literal.standard_attention import standard_attention
from .runtime import arrays as _arrays
from .runtime.device import current_context, device_limits
from .mods import MASK, Mod, relative_bias_reach
from .sparsity.block_mask import BlockMask
from .sparsity.mod_tiles import array_versions
from .tiling import cdiv, padded_head_dim
from .sparsity.tile_lists import device_layout

#: Plans kept at most (a model calls attention with a handful of shapes).
PLAN_CACHE_SIZE = 256
_PLANS = {}


def _frees_after_the_call(entry_point):
    """``entry_point`` with Numba's frees of device memory held back while it runs on Numba device arrays.

    Numba frees the device arrays nobody references in batches (every tenth or so), and ``cuMemFree``
    waits for the whole device: a batch falling due inside a call (the call's own temporaries, dropped
    as it returns) made the call wait for the GPU (H200, 2026-12-03, tests/test_interop.py, once in the
    whole suite).  Under ``cuda.defer_cleanup`` they join the batch of a later free instead.  Torch
    tensors come from torch's caching allocator, which does not free; host arrays wait for their results
    anyway."""
    @functools.wraps(entry_point)
    def call(q, *args, **kwargs):
        if not _arrays.is_numba_device_array(q):
            return entry_point(q, *args, **kwargs)
        with cuda.defer_cleanup():
            return entry_point(q, *args, **kwargs)

    return call


@_frees_after_the_call
def attention(q, k, v, *, causal=False, scale=None, block_mask=None, dropout_p=0.0, seed=0, algorithm="flash2",
              block_sizes=None, return_lse=False, score_mod=None, mask_mod=None):
    """Exact attention softmax(scale * q k^T) v, computed on the GPU.

    Parameters
    ----------
    q : array (..., H_q, N_q, d);  k, v : arrays (..., H_kv, N_k, d)
        Equal leading (batch) dims; H_q a multiple of H_kv (grouped-query
        attention: query head h reads key/value head h // (H_q // H_kv); the
        heads dim is the third from the end, and 2-D inputs have one head).
        float32, or float16 / bfloat16 with ``algorithm="flash2"`` (float32
        accumulation, output in the input dtype).  All host arrays (NumPy, or
        anything ``np.asarray`` takes: results come back as NumPy), all torch
        CUDA tensors (results are torch tensors, on torch's current stream),
        or all other CUDA arrays (Numba, CuPy: anything with
        ``__cuda_array_interface__``; results are Numba device arrays, on the
        inputs' stream).  CUDA inputs are used in place with any strides whose
        last dimension is contiguous (the literal algorithms want C order).
    causal : bool or {"top_left", "bottom_right"}
        Query i attends to key j only if j <= i (True or "top_left", as
        torch's ``is_causal=True``), or only if j <= i + N_k - N_q
        ("bottom_right", as flash-attn >= 2.1, for a block of new queries at the
        end of a longer key sequence).
    scale : float, optional
        Multiplies the logits; default 1/sqrt(d).
    algorithm : {"flash2", "flash1", "standard", "wgmma"}
        "standard" is the paper's Algorithm 0 (S and P materialised in device
        memory), "flash1" its Algorithm 1 written literally, "flash2" the fast
        FlashAttention-2 loop order on tensor cores (the default).  On a GPU of
        compute capability 9.0 (H100, H200) flash2 runs on the warpgroup
        instructions (``wgmma``) when the call is in that kernel's scope:
        float16/bfloat16, d = 64, 96 or 128 ("wgmma": any multiple of 16 up
        to 128), rows on 16-byte boundaries, a positive scale, no dropout or
        ``block_sizes``, and no block mask or one whose blocks are multiples
        of 64 rows and keys ("wgmma": any block mask); the rest select the
        ``mma.sync`` kernel, as does the environment variable
        ``NUMBA_FLASH_WGMMA=0``.  "wgmma" asks for that kernel outright (a
        ValueError says why a call is outside its scope).
    block_sizes : (B_r, B_c), optional
        Tile sizes for the flash algorithms.  flash1: any pair whose tiles
        fit in 48 KiB of shared memory; default Algorithm 1's line 1
        (``numba_flash.line1_block_sizes``).  flash2: B_r a multiple of 16,
        B_c a multiple of 8 (float32) or 16 (16-bit), fitting in the device's
        opt-in shared memory; default measured per (d, dtype) on the H200
        (``tiling.py``; (16, 16) in the simulator, where small tiles are fast).
    return_lse : bool
        Also return the row log-sum-exp lse = m + log(l) (float32, natural
        log); -inf for a row that may attend to no key (its output is 0).
    block_mask : numba_flash.BlockMask, optional
        Block-sparse attention (the paper's Algorithm 5): element (i, j) is
        allowed iff ``layout[..., i // B_r, j // B_c]``; the layout's leading
        dims broadcast to q's batch and head dims and its grid must be exactly
        (ceil(N_q / B_r), ceil(N_k / B_c)).  Combines with ``causal`` (AND).
        flash1 runs with tiles equal to the mask's blocks and skips zero
        tiles; flash2 visits, per query tile, only the key tiles that touch
        a non-zero block (any tile shape); standard masks S element-wise.
    dropout_p, seed : float in [0, 1), int in [0, 2**64)
        Dropout on the attention weights (Algorithm 2): each entry of P is
        dropped with probability dropout_p and the kept ones scaled by
        1/(1 - dropout_p); lse is that of the undropped weights.  Which
        entries are kept is a pure function of (seed, batch*head index,
        query row, key column): ``numba_flash.dropout_mask(shape, p, seed)``
        returns that mask on the host, bit for bit.
    score_mod, mask_mod : function or numba_flash.mods.Mod, optional
        FlexAttention's modifications (``numba_flash.mods``, ``docs/mods.md``):
        the logit of (b, h, i, j) is ``score_mod(scale q_i.k_j, b, h, i, j, *arrays)``
        where ``mask_mod(b, h, i, j, *arrays)`` (and causal, block_mask) allow it,
        -inf elsewhere.  flash2 (the kernel it picks: wgmma on Hopper where it
        takes it without mods, else ``mma.sync``) and "wgmma"; also on packed
        sequences (``attention_varlen``, mma.sync) and KV caches
        (``attention_with_kv_cache``).  A bad mod raises TypeError before any launch.

    NaN in the inputs reaches exactly the output rows that may see it: a NaN
    in query row i makes row i of O and lse NaN (unless it may attend to no
    key: then O = 0, lse = -inf), and a NaN in key or value row j makes NaN
    every output row allowed to attend to key j (the standard algorithm, like
    torch's math backend, spreads a NaN value to its whole head).

    Returns
    -------
    O, or (O, lse) with ``return_lse=True``; O has q's shape and dtype, lse q's shape without d.
    """
    plan = _plan(_ForwardPlan, (q, k, v), (causal, scale, block_mask, dropout_p, algorithm, block_sizes, score_mod,
                                           mask_mod))
    _check_seed(seed, dropout_p)
    return plan(q, k, v, seed, return_lse)


@_frees_after_the_call
def attention_backward(q, k, v, o, lse, do, *, causal=False, scale=None, block_mask=None, dropout_p=0.0, seed=0,
                       algorithm="flash2", block_sizes=None, deterministic=True, score_mod=None, mask_mod=None):
    """Gradients (dq, dk, dv) of sum(O * do) for O = attention(q, k, v, ...).

    ``o`` and ``lse`` are what ``attention(..., return_lse=True)`` returned
    for the same arguments (the backward recomputes P from q, k and lse and
    never materialises N x N); ``do`` is dL/dO.  causal, scale, block_mask,
    dropout_p and seed must be those of the forward call (dropout regenerates
    the same mask from the seed).  Results have the shapes and dtype of q, k,
    v (with grouped-query attention dk and dv sum over each key/value head's
    query heads, in a fixed order) and the kind of the inputs, as ``attention``.

    algorithm: "flash2" (the default) is the fast backward on tensor cores,
    float32 or 16-bit; on a Hopper GPU (compute capability 9.0) it runs on
    the warpgroup instructions wherever the call is in their scope (16-bit,
    d = 64, 96 or 128 ("wgmma": any multiple of 16 up to 128), no dropout,
    no ``block_sizes``, no block mask or one of whole
    64 x 64 tiles ("wgmma": any block mask)), elsewhere on
    ``mma.sync``.  "wgmma" asks for the Hopper
    backward (``kernels/hopper/backward.py``; NaN is not confined to the
    entries that may see it there); "flash1" is Algorithm 4 written
    literally (float32).  block_sizes: for "flash1" the (B_r, B_c) of
    Algorithm 4 (default: ``flash1_backward_block_sizes``); for "flash2" the
    tiles of the mma.sync backward: the tile a thread block owns (B_r
    queries in the dQ pass, B_r keys in the dK/dV pass) and the tile it
    streams (B_c), both multiples of 16 (default: measured on the H200,
    ``tiling.py``).

    deterministic: True (the default) gives the same bits on every run: every
    sum in a fixed order (neither backward adds across thread blocks: dQ has
    a pass of its own).  False allows sums whose last bits may differ from run
    to run (FlashAttention-2's and -3's default); today it changes nothing,
    because the Hopper backward's unordered dQ adds measured slower than its
    deterministic pass (``docs/performance.md``: determinism costs nothing
    here), so both values run the same kernels.

    score_mod, mask_mod: those of the forward call (``attention``), on the
    backward the call picks (``mma.sync`` or ``wgmma``, as without mods); dS
    is multiplied by d score_mod / d score, derived
    by tracing the score_mod (``numba_flash.mods.derivative``) unless its Mod
    has ``grad=``.  The mods' arrays get no gradient.
    """
    plan = _plan(_BackwardPlan, (q, k, v, o, lse, do), (causal, scale, block_mask, dropout_p, algorithm,
                                                        block_sizes, deterministic, score_mod, mask_mod))
    _check_seed(seed, dropout_p)
    return plan(q, k, v, o, lse, do, seed)


@_frees_after_the_call
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None, dropout_p=0.0, seed=0,
                     block_sizes=None, return_lse=False, algorithm="flash2", score_mod=None, mask_mod=None):
    """Attention over a batch of sequences of different lengths packed without padding (flash-attn's varlen).

    Parameters
    ----------
    q : array (total_q, H_q, d);  k, v : arrays (total_k, H_kv, d)
        The sequences one after the other; H_q a multiple of H_kv (grouped
        heads as ``attention``).  Kinds and dtypes as ``attention`` (flash2:
        float32, float16, bfloat16); any strides whose last dimension is
        contiguous.
    cu_seqlens_q, cu_seqlens_k : integer arrays (batch + 1,)
        Sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and
        cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1 of k and v: they start at 0,
        never decrease (empty sequences are allowed: their rows give O = 0, lse =
        -inf) and end at total_q, total_k.  They are checked on the host, so
        device arrays are copied back first (a wait on their stream, so a
        packed call cannot be captured in a CUDA graph); int32 device arrays of
        the call's kind are then used in place.
    causal : bool or {"top_left", "bottom_right"}
        Per sequence.  True means "bottom_right", as flash-attn's varlen
        function: query i of sequence b sees key j iff j <= i + N_k,b - N_q,b
        (new queries at the end of a longer context).
    scale, dropout_p, seed, block_sizes, return_lse
        As ``attention``.  Dropout keeps entry (i, j) of sequence b and head h
        exactly where ``attention`` on a (batch, H, N_q, N_k) batch would keep
        entry [b, h, i, j]: ``numba_flash.dropout_mask((batch, H, N_q, N_k), p,
        seed)[b, h, :N_q,b, :N_k,b]``.
    algorithm : {"flash2", "wgmma"}
        "flash2" (the default) picks as ``attention`` does: on a Hopper GPU
        the wgmma kernel where the batched call would take it, elsewhere
        the mma.sync kernel.  "wgmma" asks for the Hopper
        forward (16-bit, d a multiple of 16 up to 128, no dropout, no
        ``block_sizes``; on a GPU of compute capability 9.0).
    score_mod, mask_mod : function or numba_flash.mods.Mod, optional
        As ``attention``'s, per sequence: b is the sequence's index in the
        pack, q_idx and kv_idx count from its first query and key (the causal
        mask, when asked for, is still bottom-right).  On the mma.sync kernels
        ("flash2" leaves wgmma for them); a mask_mod is evaluated on every
        tile's elements (no tile is skipped: ``docs/mods.md``).

    Returns
    -------
    O (total_q, H_q, d) in q's dtype, or (O, lse) with ``return_lse=True``, lse
    (H_q, total_q) float32 (flash-attn's varlen layout).
    """
    plan, sequences = _varlen_plan(_VarlenForwardPlan, (q, k, v), cu_seqlens_q, cu_seqlens_k,
                                   (causal, scale, dropout_p, block_sizes, algorithm, score_mod, mask_mod))
    _check_seed(seed, dropout_p)
    return plan(q, k, v, seed, return_lse, sequences)


@_frees_after_the_call
def attention_varlen_backward(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None,
                              dropout_p=0.0, seed=0, block_sizes=None, algorithm="flash2", deterministic=True,
                              score_mod=None, mask_mod=None):
    """Gradients (dq, dk, dv) of sum(O * do) for O = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ...).

    ``o`` and ``lse`` are what ``attention_varlen(..., return_lse=True)`` returned for the same
    arguments; the other arguments must be the forward's.  Results are shaped like q, k and v.
    ``algorithm``: "flash2" (the default: the forward's pick) or "wgmma" (the Hopper backward, asked for; as
    ``attention_backward``'s).  ``deterministic``: as ``attention_backward``'s.  ``score_mod``, ``mask_mod``: the
    forward's (``attention_backward`` says how they enter the gradients).
    """
    plan, sequences = _varlen_plan(_VarlenBackwardPlan, (q, k, v, o, lse, do), cu_seqlens_q, cu_seqlens_k,
                                   (causal, scale, dropout_p, block_sizes, algorithm, deterministic, score_mod,
                                    mask_mod))
    _check_seed(seed, dropout_p)
    return plan(q, k, v, o, lse, do, seed, sequences)


@_frees_after_the_call
def attention_with_kv_cache(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, causal=True, scale=None,
                            block_sizes=None, num_splits=0, kv_stages=0, key_warps=0, return_lse=False,
                            block_table=None, score_mod=None, mask_mod=None):
    """Decoding: new queries against a KV cache, optionally appending their keys and values to it first.

    Grouped heads run the group's queries as the rows of one tile (row g N_q + i: query i of the group's head
    g), so each key and value is read once per group, not once per query head; with N_q > 1 this needs q's
    heads N_q rows apart (C order; other strides run a tile per query head).  The layout (tile, warps,
    splits) comes from ``numba_flash.decode_plan`` (a model of the GPU); ``numba_flash.api._PLANS`` keeps
    each call's ``plan``.

    Parameters
    ----------
    q : array (B, H_q, N_q, d)
        The new tokens' queries (N_q = 1 for one step of generation).
    k_cache, v_cache : arrays (B, H_kv, N_max, d), or with ``block_table`` (num_pages, H_kv, page_size, d)
        The caches; H_q a multiple of H_kv.  Entry b holds cache_seqlens[b] keys.  With a block table, pools of
        pages (any strides whose last dimension is contiguous: a (num_pages, page_size, H_kv, d) pool, as vLLM and
        flash-attn keep it, passes as ``pool.transpose(1, 2)``, no copy).
    cache_seqlens : integer array (B,)
        Keys already in each entry, left unchanged: the caller advances it, as with flash-attn.  On the host
        (NumPy, a list) they are checked before any launch.  A GPU array of q's kind (int32, contiguous)
        is not read by the host, so the call does not wait for the GPU (and can be captured in a CUDA
        graph): the kernels read it, and an entry whose length is out of range (negative, or its new keys
        past N_max) gets no append and NaN in its rows of O and lse.
    k_new, v_new : arrays (B, H_kv, N_new, d), optional
        Written into the caches in place at rows cache_seqlens[b] .. cache_seqlens[b] + N_new - 1 before
        attending (host caches are written on the host).  Overflowing N_max raises a ValueError.
    block_table : int32 array (B, max_pages), optional
        A paged cache: key j of entry b is row j % page_size of page block_table[b, j // page_size] of the
        pools (flash-attn's ``block_table``; new keys go there too); N_max is max_pages * page_size.  Pages hold
        16 to 256 rows, a multiple of 16 (a key tile lies in one page: ``block_sizes``' B_c must divide the page
        size; the default does).  Entries may share pages (a common prefix), but not pages that new keys go to.
        On the host (NumPy) it is checked with host lengths: every page an entry's keys lie in must be in the
        pool.  A GPU array of q's kind (rows contiguous) is not read by the host, as lengths on the GPU: an
        entry whose table names a page outside the pool for one of its keys gets NaN in its rows of O and lse,
        and its new keys are not written to such pages; nothing is read or written outside the pools.
    causal : bool or {"top_left", "bottom_right"}
        Key j of entry b is visible iff j < L_b = cache_seqlens[b] + N_new and, when causal (True means
        bottom-right, as flash-attn), j <= i + L_b - N_q for query i.
    scale, block_sizes, return_lse
        As ``attention``; lse is (B, H_q, N_q).  The default tile has as few query rows as the call needs
        (a packed group's: up to 128), and is wider along the keys where its K/V travel by cp.async
        (``numba_flash.decode_plan``).
    num_splits : int
        Thread blocks that share each query tile's keys, their results merged by lse (flash-decoding, as
        flash-attn's ``num_splits``); 0 (default): ``numba_flash.decode_plan``'s model of the GPU chooses.
        Capped so that every warp of every split has a key tile.
    kv_stages : int
        Shared buffers for the streamed K and V tiles, so that ``kv_stages - 1`` tiles are in flight while
        one is computed on (a tuning knob, like ``num_splits``); 0 (default): ``tiling.DECODE_KV_STAGES``,
        or fewer where they do not fit.  At least 2, for 16-bit inputs whose rows start on 16-byte
        boundaries (their tiles travel by ``cp.async``; others go through registers, one tile ahead).
    key_warps : int
        Warps of a block that share its query rows and take turns along the keys, merging their results in
        shared memory at the end (a tuning knob); 0 (default): ``tiling.DECODE_KEY_WARPS`` where the tile is
        one warp's 16 rows and its tiles travel by ``cp.async`` (fewer where their buffers do not fit), else 1.
    score_mod, mask_mod : function or numba_flash.mods.Mod, optional
        As ``attention``'s (``numba_flash.mods``), with every layout above (pages, splits, key warps, grouped
        heads): b is the batch row, h the query head, q_idx query i's position in its entry, L_b - N_q + i (L_b
        = cache_seqlens[b] + N_new, as the causal mask places it), kv_idx the key's position.  So
        ``mods.sliding_window(W)`` and ``mods.softcap(c)`` decode without a mask tensor.  A mask_mod is
        evaluated on every visited tile's elements (no tile is skipped).  Its arrays are read for positions up
        to N_max - 1.

    Returns
    -------
    O (B, H_q, N_q, d) in q's dtype, or (O, lse).
    """
    check_new_keys(k_new, v_new)
    arrays = (q, k_cache, v_cache) + (() if k_new is None else (k_new, v_new))
    # The table's summary keys the plan (its shape sets N_max, its row stride is the kernels'); its values come
    # per call.
    table = None
    if block_table is not None:
        table = replace(_arrays.describe("block_table", block_table), stream=0, aligned=True)
    plan = _plan(_CachePlan, arrays, (causal, scale, block_sizes, num_splits, kv_stages, key_warps, table, score_mod,
                                      mask_mod))
    paging = plan.call.varlen.paging
    pages = None   # a host table, as NumPy
    if table is not None and not table.on_device:
        pages = _arrays.as_host_array(block_table)
    if plan.call.on_device and _arrays.is_device_array(cache_seqlens):   # not read here: no wait for the GPU
        check_device_cache_seqlens(_arrays.describe("cache_seqlens", cache_seqlens), plan.call, plan.device)
        return plan(arrays, cache_seqlens, None, return_lse, block_table, pages)
    lengths = check_cache_seqlens(_arrays.integers_on_host(cache_seqlens), plan.call.batch, plan.n_new,
                                  plan.call.n_k, paging)
    if pages is not None:
        check_block_table_pages(pages, lengths, paging)
    return plan(arrays, cache_seqlens, lengths, return_lse, block_table, pages)


# ---------------------------------------------------------------- plans

def _signature(x):
    """What the checks read from an array, as a hashable tuple cheap to build; None for types without a shortcut."""
    if type(x) is _arrays.TORCH_TENSOR:
        return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, x.requires_grad and _arrays.grad_enabled())
    if type(x) is np.ndarray:
        return (x.shape, x.strides, x.dtype)
    if _arrays.is_numba_device_array(x):
        return (x.shape, x.strides, x.dtype, _arrays.device_pointer(x) & 15)
    return None


def _option_key(option):
    """An option as part of a plan's key: a block mask by identity (it is immutable), lists as tuples."""
    if isinstance(option, BlockMask):
        return id(option)
    return tuple(option) if isinstance(option, list) else option


def _mask_versions(options):
    """The in-place version counters of a plain mask_mod's torch tensors (``mod_tiles.array_versions``): a plan holds
    the tile lists classified from them, so a change (document ids rewritten for the next batch) builds a new plan
    rather than skip tiles by the old ids.  A TileMask is the user's own classification, kept as it is."""
    return tuple(array_versions(o) for o in options if type(o) is Mod and o.kind == MASK)


def _plan(build, arrays, options):
    """The cached plan for these arrays' summaries and options, built (and checked) on first use."""
    signatures = tuple(map(_signature, arrays))
    try:
        try:  # options as given (a BlockMask hashes by identity); lists need _option_key
            key = (build, signatures, _mask_versions(options), *options)
            plan = _PLANS.get(key)
        except TypeError:
            key = (build, signatures, _mask_versions(options), *map(_option_key, options))
            plan = _PLANS.get(key)
        if None in signatures:
            plan = None
    except TypeError:  # an option that cannot be hashed: the checks name it
        return build(arrays, options)
    if plan is None:
        plan = build(arrays, options)
        if None not in signatures:
            if len(_PLANS) >= PLAN_CACHE_SIZE:
                _PLANS.pop(next(iter(_PLANS)))
            _PLANS[key] = plan
    return plan


def _check_seed(seed, dropout_p):
    if type(seed) is not int or not 0 <= seed < 1 << 64:
        check_dropout(dropout_p, seed)


class _Plan:
    """What every plan shares: the checked call, where results go and on which stream work runs."""

    def __init__(self, q, call):
        self.call = call
        self.device = q.device
        self.result_kind = "torch" if call.kind == "torch" else "cuda"
        # lse and the backward's D, one float32 per query row: q's shape without d, or (H_q, total_q) packed.
        self.lse_shape = (call.heads, call.n_q) if call.varlen and call.varlen.packed else call.q_shape[:-1]

    def stream(self, arrays):
        """The stream to launch on: torch's current one, or the one the inputs name (ordered after the others)."""
        if self.call.kind == "torch":
            # torch binds its CUDA context to a thread at the thread's first runtime call.  On autograd's
            # device thread a backward whose memory all comes from torch's cache has made none yet, and a
            # launch there would fail with CUDA_ERROR_INVALID_CONTEXT: bind the primary context if needed.
            current_context()
            return _arrays.current_torch_stream(self.device)
        if self.call.kind == "host":
            return 0
        streams = [_arrays.stream_of(x) for x in arrays]
        if len(set(streams)) > 1:
            _arrays.wait_for(streams[0], streams[1:])
        return streams[0]

    def to_device(self, arrays):
        return tuple(_arrays.to_device(x) for x in arrays) if self.call.kind == "host" else arrays

    def empty(self, shape, dtype, stream):
        return _arrays.empty(self.result_kind, shape, dtype, stream, self.device)

    def deliver(self, results, dtypes):
        if self.call.kind != "host":
            return results
        return tuple(_arrays.to_host(x, dtype) for x, dtype in zip(results, dtypes))


class _ForwardPlan(_Plan):
    def __init__(self, arrays, options):
        q, k, v = (_arrays.describe(name, x) for name, x in zip("qkv", arrays))
        causal, scale, block_mask, dropout_p, algorithm, block_sizes, score_mod, mask_mod = options
        loop = check_loop(algorithm, FORWARD_ALGORITHMS, block_sizes, (hopper.BLOCK_M, hopper.BLOCK_N))
        mods = check_mods(score_mod, mask_mod, algorithm=algorithm)
        super().__init__(q, check_mod_shapes(mods, check_attention_args(q, k, v, causal=causal, scale=scale,
                                                                        block_mask=block_mask, dropout_p=dropout_p,
                                                                        seed=0, algorithm=loop,
                                                                        block_sizes=block_sizes)))
        if algorithm == "wgmma" or (algorithm == "flash2" and hopper.chosen_for(self.call, block_sizes)):
            self.launch = hopper.forward_launch(self.call)
        else:
            self.launch = forward_launch(self.call) if algorithm == "flash2" else None

    def __call__(self, q, k, v, seed, return_lse, sequences=()):
        """The call; ``sequences``: a packed call's cu_seqlens as device arrays."""
        call = self.call
        q, k, v = self.to_device((q, k, v))
        stream = self.stream((q, k, v))
        o = self.empty(call.q_shape, call.dtype, stream)
        lse = self.empty(self.lse_shape, "float32", stream)
        if self.launch is not None:
            self.launch(stream, q, k, v, o, lse, *sequences, *seed_words(seed))
        else:
            self._literal(q, k, v, o, lse, seed, stream)
        o, lse = self.deliver((o, lse), (call.dtype, "float32"))
        return (o, lse) if return_lse else o

    def _literal(self, q, k, v, o, lse, seed, stream):
        """Algorithm 0 or 1 on (batch*heads, N, d) views, launched through Numba's dispatcher."""
        call = self.call
        bh, n_q, n_k, d = call.batch_heads, call.n_q, call.n_k, call.head_dim
        q3, o3 = (_heads(x, n_q, d) for x in (q, o))
        k3, v3 = (_heads(x, n_k, d) for x in (k, v))
        lse2 = _heads(lse, n_q)
        layout = None if call.block_mask is None else device_layout(call.block_mask, call.q_shape[:-2], n_q, n_k)
        dropout = dropout_kernel_args(call.dropout_p, seed) if call.dropout_p > 0 else None
        numba_stream = _arrays.numba_stream(stream)
        scratch = (lambda shape: _arrays.empty("cuda", shape, "float32", stream))
        options = dict(scale=call.scale, causal=call.causal, causal_offset=call.causal_offset, dropout=dropout,
                       stream=numba_stream)
        if call.algorithm == "standard":
            blocks = None if layout is None else (layout, call.block_mask.block_size)
            standard_attention(q3, k3, v3, o3, lse2, scratch((bh, n_q, n_k)), scratch((bh, n_q, n_k)),
                               block_layout=blocks, **options)
        else:
            flash1_forward(q3, k3, v3, o3, scratch((bh, n_q)), scratch((bh, n_q)), lse2,
                           block_sizes=call.block_sizes, block_layout=layout, **options)


class _BackwardPlan(_Plan):
    #: The reach D of the relative-bias table whose gradient this plan's dQ kernel sums (``_TableBackwardPlan``), and
    #: the query rows of that kernel's tiles (a row of sums per tile).
    table_reach = table_tile_rows = None

    def __init__(self, arrays, options):
        q, k, v, o, lse, do = (_arrays.describe(name, x) for name, x in zip(("q", "k", "v", "o", "lse", "do"),
                                                                            arrays))
        causal, scale, block_mask, dropout_p, algorithm, block_sizes, deterministic, score_mod, mask_mod = options
        loop = check_loop(algorithm, GRADIENT_ALGORITHMS, block_sizes, (hopper_backward.BLOCK_N,) * 2)
        mods = check_mods(score_mod, mask_mod, algorithm=algorithm, backward=True)
        super().__init__(q, check_mod_shapes(mods, check_attention_args(q, k, v, causal=causal, scale=scale,
                                                                        block_mask=block_mask, dropout_p=dropout_p,
                                                                        seed=0, algorithm=loop, block_sizes=block_sizes,
                                                                        backward=True)))
        check_deterministic(deterministic)
        o_strides, do_strides = check_backward_operands(self.call, o, lse, do)
        aligned = o.aligned and do.aligned
        if algorithm == "wgmma" or (algorithm == "flash2" and hopper_backward.chosen_for(self.call, block_sizes)):
            dq_mode = hopper_backward.dq_mode(self.call, deterministic)
            self.table_reach = self._fused_table_reach(functools.partial(hopper_backward.table_fused, self.call,
                                                                         dq_mode))
            self.table_tile_rows = hopper_backward.BLOCK_N
            self.launches = hopper_backward.backward_launches(self.call, o_strides, do_strides, aligned, dq_mode,
                                                              self.table_reach)
        elif loop == "flash2":
            self.table_reach = self._fused_table_reach(functools.partial(table_fused, self.call))
            self.table_tile_rows = self.call.block_sizes[0]
            self.launches = backward_launches(self.call, o_strides, do_strides, aligned, self.table_reach)
        else:
            self.launches = None

    def _fused_table_reach(self, fits):
        """(``_TableBackwardPlan``) the table's reach when this plan's dQ kernel sums its gradient (``fits(reach)``:
        the kernel family's ``table_fused``), else None."""
        return None

    def __call__(self, q, k, v, o, lse, do, seed, sequences=(), table_sums=None):
        """The call; ``sequences``: a packed call's cu_seqlens as device arrays; ``table_sums``: where the dQ kernel
        writes the table's sums (``_TableBackwardPlan``)."""
        call = self.call
        q, k, v, o, lse, do = self.to_device((q, k, v, o, lse, do))
        stream = self.stream((q, k, v, o, lse, do))
        dq = self.empty(call.q_shape, call.dtype, stream)
        dk = self.empty(call.kv_shape, call.dtype, stream)
        dv = self.empty(call.kv_shape, call.dtype, stream)
        if isinstance(self.launches, hopper_backward.SummedDq):   # dQ summed by the dK/dV kernel, then converted
            run = self.launches
            d_i = self.empty(self.lse_shape, "float32", stream)
            dq_sum = _arrays.zeros(self.result_kind, (run.sum_words,), "float32", stream, self.device)
            turns = _arrays.zeros(self.result_kind, (run.turns,), "int32", stream, self.device)
            run.preprocess(stream, o, do, d_i)
            run.dkdv(stream, q, k, v, do, lse, d_i, dk, dv, dq_sum, turns, *sequences)
            run.convert(stream, dq_sum, dq, *sequences)
        elif self.launches is not None:
            preprocess, dkdv, dq_pass = self.launches
            d_i = self.empty(self.lse_shape, "float32", stream)  # D_i = rowsum(dO o O)
            seeds = seed_words(seed)
            preprocess(stream, o, do, d_i)
            dkdv(stream, q, k, v, do, lse, d_i, dk, dv, *sequences, *seeds)
            dq_pass(stream, q, k, v, do, lse, d_i, dq, *sequences, *(() if table_sums is None else (table_sums,)),
                    *seeds)
        else:
            n_q, n_k, d = call.n_q, call.n_k, call.head_dim
            layout = (None if call.block_mask is None
                      else device_layout(call.block_mask, call.q_shape[:-2], n_q, n_k))
            flash1_backward(_heads(q, n_q, d), _heads(k, n_k, d), _heads(v, n_k, d),
                            _heads(o, n_q, d), _heads(do, n_q, d), _heads(lse, n_q), _heads(dq, n_q, d),
                            _heads(dk, n_k, d), _heads(dv, n_k, d), scale=call.scale, causal=call.causal,
                            causal_offset=call.causal_offset, block_sizes=call.block_sizes, block_layout=layout,
                            dropout=dropout_kernel_args(call.dropout_p, seed) if call.dropout_p > 0 else None,
                            stream=_arrays.numba_stream(stream))
        return self.deliver((dq, dk, dv), (call.dtype,) * 3)


class _TableBackwardPlan(_BackwardPlan):
    """``_BackwardPlan`` whose dQ kernel also sums the gradient of its score_mod's relative-bias table, where that
    kernel can (the mma.sync or the wgmma backward's ``table_fused``); elsewhere ``table_reach`` stays None."""

    def _fused_table_reach(self, fits):
        score, mask = self.call.mods or (None, None)
        reach = relative_bias_reach(score)
        if reach is None or mask is not None or self.call.dropout_p:
            return None
        return reach if fits(reach) else None

    def __call__(self, q, k, v, o, lse, do):
        stream = self.stream((q, k, v, o, lse, do))   # (host inputs: 0, as after their copies)
        rows = table_rows(self.call.batch_heads, cdiv(self.call.n_q, self.table_tile_rows), self.table_reach)
        sums = self.empty((rows,), "float32", stream)
        gradients = super().__call__(q, k, v, o, lse, do, 0, table_sums=sums)
        sums = self.deliver((sums,), ("float32",))[0]
        return gradients + (sums.reshape(self.call.batch, self.call.heads, -1, 2 * self.table_reach + 1),)


def _attention_backward_and_table_sums(q, k, v, o, lse, do, *, causal, scale, block_mask, algorithm, deterministic,
                                       score_mod, block_sizes=None):
    """For ``numba_flash.torch``: ``attention_backward``'s (dq, dk, dv) and the sums of the gradient of score_mod's
    relative-bias table (a lone ``mods.relative_position_bias``, no dropout), (batch, H_q, query tiles, 2 D + 1)
    float32 of the inputs' kind, to be added over axes 0 and 2, where the call's backward has a dQ kernel that sums
    them (``kernels/fast/bias_table.py``: the mma.sync and the wgmma backward's); else None (nothing launched)."""
    plan = _plan(_TableBackwardPlan, (q, k, v, o, lse, do), (causal, scale, block_mask, 0.0, algorithm, block_sizes,
                                                             deterministic, score_mod, None))
    return None if plan.table_reach is None else plan(q, k, v, o, lse, do)


def _varlen_plan(build, arrays, cu_seqlens_q, cu_seqlens_k, options):
    """A packed call's plan and its sequence bounds as device arrays.

    The bounds are checked on every call (their values change from batch to batch); the plan is keyed by
    the arrays' summaries, the options and the number and longest lengths of the sequences (the grid).
    """
    q, k = (_arrays.describe(name, x) for name, x in zip("qk", arrays[:2]))
    total_q, total_k = (x.shape[0] if len(x.shape) == 3 else -1 for x in (q, k))
    hosts = check_cu_seqlens(_arrays.integers_on_host(cu_seqlens_q), _arrays.integers_on_host(cu_seqlens_k),
                             total_q, total_k)
    lengths = (hosts[0].size - 1, int(np.diff(hosts[0]).max()), int(np.diff(hosts[1]).max()))
    plan = _plan(build, arrays, options + (lengths,))
    stream = plan.stream(arrays) if plan.call.kind != "host" else None
    sequences = tuple(_arrays.int32_on_device(x, host, plan.call.kind, plan.device, stream)
                      for x, host in zip((cu_seqlens_q, cu_seqlens_k), hosts))
    return plan, sequences


class _VarlenForwardPlan(_ForwardPlan):
    """A packed call's forward: its own checks, the batched plan's call."""

    def __init__(self, arrays, options):
        q, k, v = (_arrays.describe(name, x) for name, x in zip("qkv", arrays))
        causal, scale, dropout_p, block_sizes, algorithm, score_mod, mask_mod, lengths = options
        check_loop(algorithm, VARLEN_ALGORITHMS, block_sizes, (hopper.BLOCK_M, hopper.BLOCK_N))
        mods = check_mods(score_mod, mask_mod, algorithm=algorithm, varlen=True)
        _Plan.__init__(self, q, check_mod_shapes(mods, check_varlen_args(q, k, v, lengths, causal=causal, scale=scale,
                                                                         dropout_p=dropout_p, seed=0,
                                                                         block_sizes=block_sizes)))
        if algorithm == "wgmma" or (not mods and hopper.chosen_for(self.call, block_sizes)):
            self.launch = hopper.forward_launch(self.call)
        else:
            self.launch = forward_launch(self.call)


class _VarlenBackwardPlan(_BackwardPlan):
    """A packed call's backward: its own checks, the batched plan's call."""

    def __init__(self, arrays, options):
        q, k, v, o, lse, do = (_arrays.describe(name, x) for name, x in zip(("q", "k", "v", "o", "lse", "do"),
                                                                            arrays))
        causal, scale, dropout_p, block_sizes, algorithm, deterministic, score_mod, mask_mod, lengths = options
        check_loop(algorithm, VARLEN_ALGORITHMS, block_sizes, (hopper_backward.BLOCK_N,) * 2)
        check_deterministic(deterministic)
        mods = check_mods(score_mod, mask_mod, algorithm=algorithm, backward=True, varlen=True)
        _Plan.__init__(self, q, check_mod_shapes(mods, check_varlen_args(q, k, v, lengths, causal=causal, scale=scale,
                                                                         dropout_p=dropout_p, seed=0,
                                                                         block_sizes=block_sizes, backward=True)))
        o_strides, do_strides = check_backward_operands(self.call, o, lse, do)
        aligned = o.aligned and do.aligned
        if algorithm == "wgmma" or (not mods and hopper_backward.chosen_for(self.call, block_sizes)):
            self.launches = hopper_backward.backward_launches(self.call, o_strides, do_strides, aligned,
                                                              hopper_backward.dq_mode(self.call, deterministic))
        else:
            self.launches = backward_launches(self.call, o_strides, do_strides, aligned)


#: A decoding call's buffers that no one reads after it (``_CachePlan.scratch``): lse where it is not returned, and
#: with splits the split blocks' partial rows and lse, and their arrival counts; None without splits.
_CacheScratch = namedtuple("_CacheScratch", "lse partial_o partial_lse arrivals")


class _CachePlan(_Plan):
    """A decoding call: the append launches (when there are new keys), and the forward over per-entry lengths."""

    def __init__(self, arrays, options):
        names = ("q", "k_cache", "v_cache", "k_new", "v_new")
        operands = [_arrays.describe(name, x) for name, x in zip(names, arrays)]
        q, k_cache, v_cache = operands[:3]
        k_new, v_new = operands[3:] if len(operands) == 5 else (None, None)
        causal, scale, block_sizes, num_splits, kv_stages, key_warps, block_table, score_mod, mask_mod = options
        mods = check_mods(score_mod, mask_mod, algorithm="flash2")
        super().__init__(q, check_mod_shapes(mods, check_cache_args(q, k_cache, v_cache, k_new, v_new, causal=causal,
                                                                    scale=scale, block_sizes=block_sizes,
                                                                    num_splits=num_splits, kv_stages=kv_stages,
                                                                    block_table=block_table)))
        call = self.call
        self.user_shape = tuple(q.shape)
        self.n_new = 0 if k_new is None else k_new.shape[2]
        # The layout from decode_plan's model of the GPU: flash-decoding's splits (blocks sharing each tile's keys,
        # merged by lse), the key warps (the warps of a block sharing them) and the tile.
        stages, self.key_warps = check_decode_layout(call, kv_stages, key_warps)
        if block_sizes is None and streamed(call) and not device_limits().simulated:   # (others: the narrow tile)
            planned = self.at_planned_tile(call, num_splits, kv_stages, key_warps)
            if planned is not None:
                call, (stages, self.key_warps) = planned
                self.call = call
        self.plan = self._decode_plan(call, call.block_sizes, num_splits, stages, self.key_warps)
        self.splits = self.plan.splits
        self.launch = forward_launch(call, self.splits, stages, self.key_warps, self.plan.warp_rows)
        self.rows = call.batch_heads * call.n_q      # of the partial results, one per (batch, head, query)
        self.d_pad = padded_head_dim(call.head_dim, call.precision)
        self.scratches = {}   # per stream (``scratch``)
        self.appends = None
        if k_new is not None and self.call.on_device:
            self.appends = tuple(append_launch(cache.shape, operand_strides(name, cache, "flash2"), new.shape,
                                               operand_strides(new_name, new, "flash2"), self.call.dtype,
                                               call.varlen.paging)
                                 for name, cache, new_name, new in (("k_cache", k_cache, "k_new", k_new),
                                                                    ("v_cache", v_cache, "v_new", v_new)))

    @classmethod
    def at_planned_tile(cls, call, num_splits, kv_stages, key_warps):
        """(call, (K/V buffers, key warps)) at the tile that ``decode_plan`` picks for a call the library tiles, with
        the key warps the plan gives it there where the user left them at 0 (eight for tiles that share their K/V),
        checked by ``check_decode_layout``; None where the user's kv_stages / key_warps fit only the library's narrower
        tile."""
        plan = cls._decode_plan(call, None, num_splits, kv_stages, key_warps)
        planned = replace(call, block_sizes=plan.block_sizes)
        try:
            return planned, check_decode_layout(planned, kv_stages, key_warps or plan.key_warps)
        except ValueError:
            return None

    @staticmethod
    def _decode_plan(call, block_sizes, num_splits, kv_stages, key_warps):
        """``decode_plan`` for a call checked by ``check_cache_args`` (packed or not as it decided), on this GPU."""
        limits = device_limits()
        head_queries = call.varlen.head_queries
        n_q = head_queries or call.n_q
        q_heads = call.heads * call.n_q // head_queries if head_queries else call.heads
        paging = call.varlen.paging
        return decode_plan(call.batch, q_heads, call.kv_heads, n_q, call.n_k, call.head_dim,
                           4 if call.precision == "tf32x3" else 2, multiprocessors=limits.multiprocessors,
                           shared_bytes=limits.shared_bytes_per_block_optin, packable=head_queries > 0,
                           aligned=call.vec, page_size=None if paging is None else paging.page_size,
                           block_sizes=block_sizes, num_splits=num_splits, key_warps=key_warps, kv_stages=kv_stages)

    def scratch(self, stream):
        """What a call on ``stream`` writes for itself alone (``_CacheScratch``): made once per stream and reused, since
        calls on one stream run in order (the next call's kernels start after this one's last read), which saves
        the host an allocation each (3-4 us of a small decoding call's 27-44, H100); calls on different streams never
        share it.  While torch captures a CUDA graph, made anew for each call (the graph keeps its own)."""
        if self.call.kind == "torch" and _arrays.capturing():
            return self._new_scratch(stream)
        scratch = self.scratches.get(stream)
        if scratch is None:
            scratch = self.scratches[stream] = self._new_scratch(stream)
        return scratch

    def _new_scratch(self, stream):
        lse = self.empty(self.user_shape[:-1], "float32", stream)
        if self.splits == 1:
            return _CacheScratch(lse, None, None, None)
        # The split blocks' arrival counts (int32, which the kernel reads as uint32): zeros, which every call leaves
        # at zero (``cache.last_to_arrive``).
        return _CacheScratch(lse, self.empty((self.splits, self.rows, self.d_pad), "float32", stream),
                             self.empty((self.splits, self.rows), "float32", stream),
                             _arrays.zeros(self.result_kind, self.launch.extents["ARRIVALS"], "int32", stream,
                                           self.device))

    def __call__(self, arrays, cache_seqlens, lengths, return_lse, block_table=None, pages=None):
        """The call; ``lengths``: the checked keys per entry after the append, or None for lengths that stay on
        the GPU (``cache_seqlens`` itself, of the call's kind: read by the kernels only, which give an entry out
        of range no append and NaN in its rows: ``common.sequence_bounds``).  A paged call's ``block_table``
        stays where it is on the GPU, or comes from the host as ``pages`` (NumPy)."""
        call = self.call
        paging = call.varlen.paging
        if self.n_new and not call.on_device:  # host caches: append where they live, then copy
            seqlens = lengths - self.n_new
            for cache, new in ((arrays[1], arrays[3]), (arrays[2], arrays[4])):
                _append_on_host(_arrays.as_host_array(cache), _arrays.as_host_array(new), seqlens, pages, paging)
        q, k_cache, v_cache, *new = self.to_device(arrays)
        stream = self.stream((q, k_cache, v_cache, *new))
        # The appends and the forward read the lengths before the call's new keys, where they lie.
        seqlens = cache_seqlens if lengths is None else _arrays.int32_on_device(cache_seqlens, lengths - self.n_new,
                                                                                call.kind, self.device, stream)
        table = ()
        if paging is not None:
            table = (block_table if pages is None else
                     _arrays.int32_on_device(None, pages.reshape(-1), call.kind, self.device, stream),)
        if self.appends is not None:
            for append, cache, fresh in zip(self.appends, (k_cache, v_cache), new):
                append(stream, cache, fresh, seqlens, *table)
        o = self.empty(self.user_shape, call.dtype, stream)     # the kernels' q view has q's C order
        scratch = self.scratch(stream)
        lse = self.empty(self.user_shape[:-1], "float32", stream) if return_lse else scratch.lse
        if self.splits == 1:
            self.launch(stream, q, k_cache, v_cache, o, lse, seqlens, *table, 0, 0)
        else:
            self.launch(stream, q, k_cache, v_cache, scratch.partial_o, scratch.partial_lse, seqlens, *table, o, lse,
                        scratch.arrivals, 0, 0)
        o, lse = self.deliver((o, lse), (call.dtype, "float32"))
        return (o, lse) if return_lse else o


def _append_on_host(cache, new, seqlens, pages, paging):
    """New rows ``new`` (B, H_kv, N_new, d) written into a host ``cache`` at rows seqlens[b] .. of entry b: its own
    (B, H_kv, N_max, d) rows, or (``paging``) those its row of the block table ``pages`` names in the pool."""
    for b, start in enumerate(seqlens):
        if paging is None:
            cache[b, :, start:start + new.shape[2]] = new[b]
            continue
        for r in range(new.shape[2]):
            page, row = divmod(int(start) + r, paging.page_size)
            cache[pages[b, page], :, row] = new[b, :, r]


def _heads(x, n, d=None):
    """A C-contiguous device array as a Numba (batch*heads, n[, d]) view (what the literal kernels index)."""
    if _arrays.is_torch_tensor(x):
        x = cuda.as_cuda_array(x.detach(), sync=False)
    return x.reshape((-1, n) if d is None else (-1, n, d))
