"""Decoding from a KV cache (attention_with_kv_cache): appends in place, per-entry lengths, split keys."""
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, reject
from hypothesis import strategies as st
from numba import cuda

import numba_flash
import reference
from strategies import SIZES, VARLEN_DTYPES, arrays, block_sizes, dtype_name, head_dims
from test_paged_cache import device_view, logical_rows, paged_copy
from tolerances import assert_close_to_reference

from numba_flash.decode_plan import decode_plan
from numba_flash.runtime.device import device_limits
from numba_flash.tiling import DECODE_STREAMED_KEYS, PRECISION, cdiv, decode_default_block_sizes

cache_dtypes = pytest.mark.parametrize("dtype", VARLEN_DTYPES, ids=dtype_name)


def alignment(causal):
    """The call's causal argument as ``attention`` spells it for one entry (True: bottom-right, as flash-attn)."""
    return "bottom_right" if causal is True else causal


@st.composite
def decoding_problems(draw, dtype):
    """q (B, H_q, N_q, d), caches (B, H_kv, N_max, d), lengths, and k_new, v_new (or None)."""
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 3))
    n_q = draw(st.one_of(st.just(1), st.integers(1, 4)))
    n_new = draw(st.integers(0, 3))
    n_max = draw(st.integers(max(1, n_new), SIZES.max_n["flash2"]))
    d = draw(head_dims())
    seqlens = np.array([draw(st.integers(0, n_max - n_new)) for _ in range(batch)], np.int32)
    q = arrays(draw, (batch, heads, n_q, d), dtype)
    k_cache, v_cache = (arrays(draw, (batch, kv_heads, n_max, d), dtype) for _ in range(2))
    new = (None, None) if n_new == 0 else tuple(arrays(draw, (batch, kv_heads, n_new, d), dtype) for _ in range(2))
    causal = draw(st.sampled_from((True, False, "top_left")))
    tiles = draw(st.one_of(st.none(), block_sizes("flash2", d, dtype)))
    splits = draw(st.integers(0, 4))           # 0: the library's choice; more than the key tiles is capped
    # K/V buffers: 0 (the library's), or 2-4 where the tiles travel by cp.async (16-bit rows of 16 bytes)
    streamed = dtype != np.float32 and d % 8 == 0
    stages = draw(st.sampled_from((0, 2, 3, 4))) if streamed else 0
    # Key warps: 0 (the library's), 1 (one-warp blocks), or 2-4 sharing a tile of one warp's rows (at most 16:
    # here the group's heads times N_q are at most 12, so the default tiles have one warp's rows).
    one_warp = tiles is None or tiles[0] <= 16
    key_warps = draw(st.sampled_from((0, 1, 2, 3, 4) if streamed and one_warp else (0, 1)))
    return q, k_cache, v_cache, seqlens, new, causal, tiles, splits, stages, key_warps


@cache_dtypes
@given(data=st.data(), on_device=st.booleans())
def test_decoding_matches_the_float64_reference_and_appends_in_place(dtype, data, on_device):
    q, k_cache, v_cache, seqlens, (k_new, v_new), causal, tiles, splits, stages, key_warps = data.draw(
        decoding_problems(dtype))
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    n_new = 0 if k_new is None else k_new.shape[2]
    for b, start in enumerate(seqlens):
        if n_new:
            expected_k[b, :, start:start + n_new] = k_new[b]
            expected_v[b, :, start:start + n_new] = v_new[b]
    to = cuda.to_device if on_device and dtype != np.dtype("bfloat16") else (lambda x: x)
    caches = (to(k_cache), to(v_cache))
    try:
        out, lse = numba_flash.attention_with_kv_cache(to(q), *caches, to(seqlens),
                                                       k_new=None if k_new is None else to(k_new),
                                                       v_new=None if v_new is None else to(v_new), causal=causal,
                                                       block_sizes=tiles, num_splits=splits, kv_stages=stages,
                                                       key_warps=key_warps, return_lse=True)
    except ValueError as exc:   # buffers beyond shared memory (wide tiles, big d, many warps): refused up front
        if "bytes of shared memory" not in str(exc):
            raise
        reject()
    out, lse = (x.copy_to_host() if hasattr(x, "copy_to_host") else x for x in (out, lse))
    got_k, got_v = (x.copy_to_host() if hasattr(x, "copy_to_host") else x for x in caches)
    np.testing.assert_array_equal(got_k.view(np.uint8), expected_k.view(np.uint8))   # appended, nothing else moved
    np.testing.assert_array_equal(got_v.view(np.uint8), expected_v.view(np.uint8))
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    group = q.shape[1] // k_cache.shape[1]
    scale = 1 / np.sqrt(q.shape[-1])
    for b, length in enumerate(seqlens + n_new):
        if length == 0:
            assert np.all(out[b].astype(np.float32) == 0) and np.all(np.isneginf(lse[b]))
            continue
        k = np.repeat(expected_k[b, :, :length], group, axis=0)
        v = np.repeat(expected_v[b, :, :length], group, axis=0)
        ref_out, ref_lse = reference.attention(q[b], k, v, causal=alignment(causal))
        assert_close_to_reference(out[b], lse[b], ref_out, ref_lse, q[b], k, v, scale, dtype)


@pytest.mark.parametrize("tiles", [None, (16, 16)], ids=["default tiles", "16x16"])
@pytest.mark.parametrize("group", [4, 9])
def test_one_step_of_generation_with_grouped_heads_and_split_keys(tiles, group):
    # The shape decoding runs at: one query per head, query heads grouped on each cached key/value head, a
    # long cache split between blocks, entries of different lengths (one empty).  In the simulator a cache of
    # 100 (7 tiles of 16, the last ragged: several per split) instead of 300.
    n_max, lengths = (100, [99, 0, 57]) if numba_flash.in_simulator() else (300, [299, 0, 170])
    rng = np.random.default_rng(3)
    q = rng.standard_normal((3, 2 * group, 1, 16)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((3, 2, n_max, 16)).astype(np.float32) for _ in range(2))
    seqlens = np.array(lengths, np.int32)
    k_new, v_new = (rng.standard_normal((3, 2, 1, 16)).astype(np.float32) for _ in range(2))
    out = numba_flash.attention_with_kv_cache(q, k_cache, v_cache, seqlens, k_new=k_new, v_new=v_new,
                                              block_sizes=tiles, num_splits=2)
    for b, length in enumerate(seqlens + 1):
        k, v = (np.repeat(x[b, :, :length], group, axis=0) for x in (k_cache, v_cache))
        ref_out, ref_lse = reference.attention(q[b], k, v)
        assert_close_to_reference(out[b], None, ref_out, ref_lse, q[b], k, v, 0.25)


SIXTEEN_BIT = [t for t in VARLEN_DTYPES if t != np.float32]


#: The simulator's (buffers, dtype) of the next test: each depth once, the 16-bit types taking turns (CI's time: they
#: take one path, what differs is the conversion).  A GPU runs every pair.
SIMULATOR_PIPELINES = {(2, SIXTEEN_BIT[0]), (3, SIXTEEN_BIT[-1]), (4, SIXTEEN_BIT[0])}


@pytest.mark.parametrize("stages, dtype", [
    pytest.param(stages, dtype, id=f"{stages} buffers, {dtype_name(dtype)}",
                 marks=() if (stages, dtype) in SIMULATOR_PIPELINES else pytest.mark.gpu_only)
    for stages in (2, 3, 4) for dtype in SIXTEEN_BIT])
def test_deeper_kv_pipelines_decode_as_two_buffers_do(dtype, stages):
    # Many key tiles per block (300 keys in tiles of 16, two splits of one warp), so that every buffer is refilled
    # several times, and the last tiles' groups are empty; grouped heads; entries of different lengths.
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 1, 16)).astype(dtype)
    k_cache, v_cache = (rng.standard_normal((2, 2, 300, 16)).astype(dtype) for _ in range(2))
    seqlens = np.array([300, 133], np.int32)
    out, lse = numba_flash.attention_with_kv_cache(q, k_cache, v_cache, seqlens, block_sizes=(16, 16), num_splits=2,
                                                   kv_stages=stages, key_warps=1, return_lse=True)
    for b, length in enumerate(seqlens):
        k, v = (np.repeat(x[b, :, :length], 2, axis=0) for x in (k_cache, v_cache))
        ref_out, ref_lse = reference.attention(q[b], k, v)
        assert_close_to_reference(out[b], lse[b], ref_out, ref_lse, q[b], k, v, 0.25, dtype)


@pytest.mark.parametrize("key_warps, splits, stages, dtype",
                         [(2, 2, 0, SIXTEEN_BIT[0]), (3, 1, 3, SIXTEEN_BIT[-1]), (4, 0, 2, SIXTEEN_BIT[0]),
                          (8, 0, 0, SIXTEEN_BIT[-1])],
                         ids=["2 warps, 2 splits", "3 warps, 3 buffers", "4 warps, default splits",
                              "8 warps (tiles that share their K/V), default splits"])
def test_warps_taking_turns_along_the_keys_decode_as_one_warp_does(dtype, key_warps, splits, stages):
    # Warps of one block share the query rows and take turns along the 300 keys (tiles of 16), merging in
    # shared memory; with two splits the blocks' results are merged again.  Entries of different lengths: the
    # 133-key one leaves the last warps of the last turn without a tile.
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 1, 16)).astype(dtype)
    k_cache, v_cache = (rng.standard_normal((2, 2, 300, 16)).astype(dtype) for _ in range(2))
    seqlens = np.array([300, 133], np.int32)
    out, lse = numba_flash.attention_with_kv_cache(q, k_cache, v_cache, seqlens, block_sizes=(16, 16),
                                                   num_splits=splits, kv_stages=stages, key_warps=key_warps,
                                                   return_lse=True)
    for b, length in enumerate(seqlens):
        k, v = (np.repeat(x[b, :, :length], 2, axis=0) for x in (k_cache, v_cache))
        ref_out, ref_lse = reference.attention(q[b], k, v)
        assert_close_to_reference(out[b], lse[b], ref_out, ref_lse, q[b], k, v, 0.25, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["one query", "three causal queries"])
def test_key_warps_keep_swizzled_rows_at_head_dims_of_64(causal):
    # At d = 64 the key warps keep K and V in unpadded rows whose 16-byte chunks are permuted by row
    # (tiling.swizzled_rows): the copies, both products and the NaN cleaning of partly masked tiles must
    # agree on where each chunk sits.  Entry 1 holds 45 keys, the last one with a NaN value: one query sees
    # every key (heads 0 and 1, which read key/value head 0, are NaN); of three causal queries (bottom-right)
    # only the last sees key 44, and the tile of keys 32-47 is partly masked, so V is cleaned there.
    rng = np.random.default_rng(13)
    dtype, n_q, d = SIXTEEN_BIT[0], 3 if causal else 1, 64
    q = rng.standard_normal((2, 4, n_q, d)).astype(dtype)
    k_cache, v_cache = (rng.standard_normal((2, 2, 100, d)).astype(dtype) for _ in range(2))
    seqlens = np.array([100, 45], np.int32)

    def decode(v):
        return numba_flash.attention_with_kv_cache(q, k_cache, v, seqlens, causal=causal, block_sizes=(16, 16),
                                                   num_splits=1, kv_stages=3, key_warps=4, return_lse=True)

    out, lse = decode(v_cache)
    for b, length in enumerate(seqlens):
        k, v = (np.repeat(x[b, :, :length], 2, axis=0) for x in (k_cache, v_cache))
        ref_out, ref_lse = reference.attention(q[b], k, v, causal="bottom_right" if causal else False)
        assert_close_to_reference(out[b], lse[b], ref_out, ref_lse, q[b], k, v, d ** -0.5, dtype)
    poisoned = v_cache.copy()
    poisoned[1, 0, 44, 5] = np.nan
    nan_out, nan_lse = decode(poisoned)
    nan_rows = np.zeros(out.shape[:-1], bool)
    nan_rows[1, :2, -1] = True                  # the query that sees key 44 (every one without causal)
    if not causal:
        nan_rows[1, :2] = True
    np.testing.assert_array_equal(np.isnan(nan_out).any(axis=-1), nan_rows)
    np.testing.assert_array_equal(nan_out[~nan_rows], out[~nan_rows])   # the cleaned zero adds nothing
    np.testing.assert_array_equal(nan_lse, lse)   # lse is the logits' (a NaN value does not reach it)


@pytest.mark.parametrize("n_max", [100, 8])
def test_key_warps_and_unsplit_blocks_stream_wider_key_tiles(monkeypatch, n_max):
    # On a GPU (here one of one multiprocessor, whose blocks need no split unless asked), the library's tiles
    # for one warp's rows widen to tiling.DECODE_STREAMED_KEYS keys (16-bit, d <= 128) where the block's warps
    # take turns along the keys, split or not, and where one-warp blocks need no split; float32 (tiles through
    # registers) keeps its own.  A split asked of a cache of at most one turn of tiles does not happen.  The
    # widened kernel runs (in the simulator) and matches the reference, also with a cache shorter than one
    # tile.  d = 128: the narrow tile is 16 keys on the GPU too.
    d = 128
    one_multiprocessor = replace(device_limits(), simulated=False, multiprocessors=1)
    monkeypatch.setattr(numba_flash.api, "device_limits", lambda: one_multiprocessor)
    plans = {}   # no plan made before the patch
    monkeypatch.setattr(numba_flash.api, "_PLANS", plans)
    rng = np.random.default_rng(17)
    for dtype, splits in ((SIXTEEN_BIT[0], 0), (SIXTEEN_BIT[0], 2), (np.float32, 0)):
        q = rng.standard_normal((2, 4, 1, d)).astype(dtype)
        k_cache, v_cache = (rng.standard_normal((2, 2, n_max, d)).astype(dtype) for _ in range(2))
        seqlens = np.array([n_max, n_max // 2], np.int32)
        out, lse = numba_flash.attention_with_kv_cache(q, k_cache, v_cache, seqlens, num_splits=splits,
                                                       return_lse=True)
        plan = list(plans.values())[-1]
        narrow = decode_default_block_sizes(4, d, PRECISION[np.dtype(dtype).name])
        wide = dtype != np.float32 and (plan.key_warps > 1 or plan.splits == 1)
        block_n = DECODE_STREAMED_KEYS if wide else narrow[1]
        assert plan.call.block_sizes == (narrow[0], block_n)
        # Two splits where the key warps have more than one turn of tiles (8 keys: one tile, no split).
        assert plan.splits == (2 if splits and cdiv(n_max, block_n) > plan.key_warps else 1)
        for b, length in enumerate(seqlens):
            k, v = (np.repeat(x[b, :, :length], 2, axis=0) for x in (k_cache, v_cache))
            ref_out, ref_lse = reference.attention(q[b], k, v)
            assert_close_to_reference(out[b], lse[b], ref_out, ref_lse, q[b], k, v, d ** -0.5, dtype)


@cache_dtypes
def test_the_merge_combines_more_splits_than_one_group_of_loads(dtype):
    # 19 splits of 16-key tiles (num_splits 20, capped by the 300-key cache's 19 tiles; split s sees tile s):
    # the merge reads them in groups of cache.MERGE_GROUP (16), the second group padded with weights of 0.
    # Key 290 of entry 0 (split 18's) points along both query heads: its split's lse is the largest, so the
    # second group rescales what the first one summed.  Entry 1 holds 40 keys, so that its splits 3-18 saw
    # nothing (lse -inf, weight 0); then a NaN key in entry 0 reaches its rows whole (the split that saw it
    # has a NaN lse, so a NaN weight) and no other entry's.
    rng = np.random.default_rng(19)
    q = rng.standard_normal((2, 2, 1, 16)).astype(dtype)
    k_cache, v_cache = (rng.standard_normal((2, 1, 300, 16)).astype(dtype) for _ in range(2))
    k_cache[0, 0, 290] = (2 * (q[0, 0, 0].astype(np.float32) + q[0, 1, 0].astype(np.float32))).astype(dtype)
    seqlens = np.array([300, 40], np.int32)

    def decode(k):
        return numba_flash.attention_with_kv_cache(q, k, v_cache, seqlens, block_sizes=(16, 16), num_splits=20,
                                                   key_warps=1, return_lse=True)

    out, lse = decode(k_cache)
    assert list(numba_flash.api._PLANS.values())[-1].splits == 19
    for b, length in enumerate(seqlens):
        k, v = (np.repeat(x[b, :, :length], 2, axis=0) for x in (k_cache, v_cache))
        ref_out, ref_lse = reference.attention(q[b], k, v)
        assert_close_to_reference(out[b], lse[b], ref_out, ref_lse, q[b], k, v, 0.25, dtype)
    poisoned = k_cache.copy()
    poisoned[0, 0, 250, 3] = np.nan
    nan_out, nan_lse = decode(poisoned)
    assert np.isnan(nan_out[0].astype(np.float32)).all() and np.isnan(nan_lse[0]).all()
    np.testing.assert_array_equal(nan_out[1], out[1])
    np.testing.assert_array_equal(nan_lse[1], lse[1])


# In the simulator float32 (tiles through registers) and one 16-bit type (CI's time): bfloat16 takes float16's path,
# what differs is the conversion, which test_decoding_matches_the_float64_reference_and_appends_in_place checks.
@pytest.mark.parametrize("dtype", [pytest.param(t, marks=pytest.mark.gpu_only) if t is SIXTEEN_BIT[-1] else t
                                   for t in VARLEN_DTYPES], ids=dtype_name)
def test_one_plan_decodes_call_after_call_as_lengths_change(dtype):
    # Three splits take turns along the key tiles (split s: tiles s, s + 3, ...), so entries of 1, 17 or 33
    # keys (one, two, three tiles of 16) leave some splits with nothing, and an entry of 0 leaves all; the
    # same plan (shapes unchanged) runs again as the lengths change, as in generation.  In the simulator a
    # cache of 70 (5 tiles, the last ragged: two splits get two tiles, one gets one) instead of 200.
    n_max = 70 if numba_flash.in_simulator() else 200
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, 4, 1, 16)).astype(dtype)
    k_cache, v_cache = (rng.standard_normal((2, 2, n_max, 16)).astype(dtype) for _ in range(2))
    for lengths in ([n_max, 57], [1, n_max], [0, 17], [33, n_max], [n_max, 57]):
        seqlens = np.array(lengths, np.int32)
        out, lse = numba_flash.attention_with_kv_cache(q, k_cache, v_cache, seqlens, block_sizes=(16, 16),
                                                       num_splits=3, return_lse=True)
        for b, length in enumerate(seqlens):
            if length == 0:
                assert np.all(out[b].astype(np.float32) == 0) and np.all(np.isneginf(lse[b]))
                continue
            k, v = (np.repeat(x[b, :, :length], 2, axis=0) for x in (k_cache, v_cache))
            ref_out, ref_lse = reference.attention(q[b], k, v)
            assert_close_to_reference(out[b], lse[b], ref_out, ref_lse, q[b], k, v, 0.25, dtype)


Q = np.zeros((2, 4, 1, 8), np.float32)
CACHE = np.zeros((2, 2, 10, 8), np.float32)
NEW = np.zeros((2, 2, 3, 8), np.float32)
LENGTHS = np.array([2, 7], np.int32)

BAD_INPUTS = [
    ("cache overflow", (Q, CACHE, CACHE, np.array([2, 8], np.int32)), {"k_new": NEW, "v_new": NEW}, ValueError,
     "cache overflow"),
    ("negative length", (Q, CACHE, CACHE, np.array([-1, 2], np.int32)), {}, ValueError, "must not be negative"),
    ("one length too few", (Q, CACHE, CACHE, np.array([2], np.int32)), {}, ValueError, "one length per batch"),
    ("float lengths", (Q, CACHE, CACHE, LENGTHS.astype(np.float32)), {}, TypeError, "integers"),
    ("k_new alone", (Q, CACHE, CACHE, LENGTHS), {"k_new": NEW}, ValueError, "together"),
    ("caches differ", (Q, CACHE, CACHE[:, :, :9], LENGTHS), {}, ValueError, "one shape"),
    ("q of 3 dims", (Q[0], CACHE, CACHE, LENGTHS), {}, ValueError, "(batch, heads, N, d)"),
    ("heads not a multiple", (Q[:, :3], CACHE, CACHE, LENGTHS), {}, ValueError, "multiple of the key/value"),
    ("new keys of another head dim", (Q, CACHE, CACHE, LENGTHS), {"k_new": NEW[..., :4], "v_new": NEW[..., :4]},
     ValueError, "k_new must be"),
    ("float64", (Q.astype(np.float64), CACHE, CACHE, LENGTHS), {}, TypeError, "dtype"),
    ("negative splits", (Q, CACHE, CACHE, LENGTHS), {"num_splits": -1}, ValueError, "num_splits"),
    ("fractional splits", (Q, CACHE, CACHE, LENGTHS), {"num_splits": 2.0}, TypeError, "num_splits"),
    ("one buffer", (Q, CACHE, CACHE, LENGTHS), {"kv_stages": 1}, ValueError, "at least 2"),
    ("fractional buffers", (Q, CACHE, CACHE, LENGTHS), {"kv_stages": 2.5}, TypeError, "kv_stages"),
    ("buffers for float32 tiles", (Q, CACHE, CACHE, LENGTHS), {"kv_stages": 3}, ValueError, "cp.async"),
    ("negative key warps", (Q, CACHE, CACHE, LENGTHS), {"key_warps": -1}, ValueError, "key_warps"),
    ("fractional key warps", (Q, CACHE, CACHE, LENGTHS), {"key_warps": 2.0}, TypeError, "key_warps"),
    ("key warps for float32 tiles", (Q, CACHE, CACHE, LENGTHS), {"key_warps": 2}, ValueError, "key_warps=2"),
    ("buffers past shared memory", (Q.astype(np.float16), CACHE.astype(np.float16), CACHE.astype(np.float16),
                                    LENGTHS), {"kv_stages": 400}, ValueError, "bytes of shared memory"),
]


@pytest.mark.parametrize("description, args, kwargs, error, words", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_decoding_input_is_rejected_before_any_launch(no_launch, description, args, kwargs, error, words):
    cache = np.zeros_like(args[1])   # the call's cache, to see that nothing was written into it
    args = (args[0], cache) + args[2:]
    with pytest.raises(error) as caught:
        numba_flash.attention_with_kv_cache(*args, **kwargs)
    assert words in str(caught.value), str(caught.value)
    assert not cache.any(), "the cache was written before the input was rejected"


@pytest.mark.parametrize("tiles", [None, (16, 16)], ids=["default tiles", "16x16"])
@pytest.mark.parametrize("dtype", VARLEN_DTYPES, ids=dtype_name)
def test_nan_reaches_exactly_the_rows_that_see_it(tiles, dtype):
    # As torch: a NaN key or value makes NaN every row that attends to it; one past an entry's length is
    # never seen; a NaN query row gives a NaN output row and lse.
    # In the simulator entries of 40 keys in a cache of 60 (instead of 150 in 200): the tile that holds the
    # last keys is still ragged, with NaN past the length in its loaded rows, and two splits share three tiles.
    # 16-bit tiles travel by cp.async, and the first rounds are copied up to the cache's rows before the
    # lengths are read (forward.py's EARLY_COPIES): the NaN past entry 1's keys lands, and must be cleared.
    n_max, length = (60, 40) if numba_flash.in_simulator() else (200, 150)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((3, 4, 1, 16)).astype(dtype)
    k_cache, v_cache = (rng.standard_normal((3, 2, n_max, 16)).astype(dtype) for _ in range(2))
    seqlens = np.array([length] * 3, np.int32)
    k_cache[0, 1, 7, 3] = np.nan       # seen by entry 0's query heads 2 and 3
    v_cache[1, 0, length:, :] = np.nan    # past entry 1's keys: seen by nobody
    q[2, 1, 0, 0] = np.nan             # entry 2, query head 1 only
    out, lse = numba_flash.attention_with_kv_cache(q, k_cache, v_cache, seqlens, block_sizes=tiles, num_splits=2,
                                                   return_lse=True)
    nan_rows = np.zeros((3, 4), bool)
    nan_rows[0, 2:] = True
    nan_rows[2, 1] = True
    np.testing.assert_array_equal(np.isnan(out[..., 0, :]).all(axis=-1), nan_rows)
    np.testing.assert_array_equal(np.isnan(lse[..., 0]), nan_rows)
    assert not np.isnan(out[~nan_rows]).any()


def _gpu(x):
    """A host array as a device array: a torch CUDA tensor on a GPU, a Numba (simulated) one in the simulator."""
    if numba_flash.in_simulator():
        return cuda.to_device(x)
    import torch

    return torch.from_numpy(x).cuda()


def _host(x):
    return x.copy_to_host() if hasattr(x, "copy_to_host") else x.cpu().numpy()


@pytest.mark.parametrize("bad_length", [-1, 39], ids=["negative", "new keys past N_max"])
def test_lengths_left_on_the_gpu_that_do_not_fit_give_nan_rows_and_no_append(bad_length):
    # Lengths on the GPU are not read by the host (no wait), so they cannot raise: an entry out of range gets no
    # append and NaN in its rows of O and lse, loudly, and the other entries are what host lengths give.
    rng = np.random.default_rng(9)
    q = rng.standard_normal((3, 4, 1, 16)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((3, 2, 40, 16)).astype(np.float32) for _ in range(2))
    k_new, v_new = (rng.standard_normal((3, 2, 2, 16)).astype(np.float32) for _ in range(2))
    seqlens = np.array([10, bad_length, 0], np.int32)
    caches = _gpu(k_cache), _gpu(v_cache)
    out, lse = numba_flash.attention_with_kv_cache(_gpu(q), *caches, _gpu(seqlens), k_new=_gpu(k_new),
                                                   v_new=_gpu(v_new), return_lse=True)
    out, lse, got_k, got_v = (_host(x) for x in (out, lse, *caches))
    assert np.isnan(out[1]).all() and np.isnan(lse[1]).all()
    np.testing.assert_array_equal(got_k[1], k_cache[1])   # nothing written for the entry out of range
    np.testing.assert_array_equal(got_v[1], v_cache[1])
    fits = [0, 2]
    want, want_lse = numba_flash.attention_with_kv_cache(q[fits], k_cache[fits], v_cache[fits], seqlens[fits],
                                                         k_new=k_new[fits], v_new=v_new[fits], return_lse=True)
    np.testing.assert_array_equal(out[fits], want)   # bit for bit: the same kernels
    np.testing.assert_array_equal(lse[fits], want_lse)
    np.testing.assert_array_equal(got_k[0, :, 10:12], k_new[0])


@pytest.mark.parametrize("lengths, error, words", [
    (np.array([3, 4], np.int64), TypeError, "must be int32"),
    (np.array([3], np.int32), ValueError, "one length per batch entry"),
    (np.array([[3, 4]], np.int32), ValueError, "one length per batch entry"),
], ids=["int64", "too few", "two dimensions"])
def test_bad_lengths_on_the_gpu_are_rejected_before_any_launch(no_launch, lengths, error, words):
    q, cache = _gpu(np.zeros((2, 4, 1, 8), np.float32)), _gpu(np.zeros((2, 2, 10, 8), np.float32))
    with pytest.raises(error, match=words):
        numba_flash.attention_with_kv_cache(q, cache, cache, _gpu(lengths))


@pytest.mark.gpu_only
def test_lengths_on_the_gpu_of_another_kind_than_q_are_rejected(no_launch):
    import torch

    q, cache = (torch.zeros(shape, device="cuda") for shape in ((2, 4, 1, 8), (2, 2, 10, 8)))
    with pytest.raises(TypeError, match="cache_seqlens on the GPU must be a torch array like q"):
        numba_flash.attention_with_kv_cache(q, cache, cache, cuda.to_device(np.array([3, 4], np.int32)))


@pytest.mark.gpu_only
def test_split_decoding_on_two_streams_at_once_and_in_a_cuda_graph():
    # The last split of each query tile merges (cache.last_to_arrive): its arrival counts are per stream, and
    # new zeros in a captured graph.  Steps queued on two streams at once, and a graph replayed between eager
    # steps of the same plan, give the eager step's bits (the splits are summed in their order, whichever
    # finished last).
    import torch

    torch.manual_seed(5)
    q = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 2, 4096, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    lengths = torch.tensor([4000], dtype=torch.int32, device="cuda")

    def step(x):
        return numba_flash.attention_with_kv_cache(x, k, v, lengths, num_splits=8)

    want = step(q)
    assert list(numba_flash.api._PLANS.values())[-1].splits == 8
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = []
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    for i in range(40):
        with torch.cuda.stream(streams[i % 2]):
            outs.append(step(q))
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    for out in outs:
        assert torch.equal(out, want)

    static_q = q.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step(static_q)
    for _ in range(3):
        graph.replay()
        eager = step(q)
    torch.cuda.synchronize()
    assert torch.equal(graph_out, want) and torch.equal(eager, want)


# ---- query groups packed as rows (decode_plan.py): each key/value tile read once per group ----

#: (H_q, H_kv): MHA, GQA of 4 and 8, MQA of 32.
GROUPS = ((2, 2), (4, 1), (8, 2), (8, 1), (32, 1))


@st.composite
def grouped_problems(draw):
    """A decoding call with query heads grouped on key/value heads, N_q 1 or 4: lengths 0, 1, full or ragged, new keys
    or none, any causal alignment, a contiguous or paged cache, the library's choices or the user's; tiles of 16 rows
    (the simulator's) or one tile of the whole packed group (at most 128 rows, as the library's on a GPU)."""
    dtype = draw(st.sampled_from(VARLEN_DTYPES))
    batch = draw(st.integers(1, 2))
    heads, kv_heads = draw(st.sampled_from(GROUPS))
    n_q = draw(st.sampled_from((1, 4)))
    d = 16
    n_new = draw(st.integers(0, 1))
    n_max = draw(st.sampled_from((16, 40)))
    lengths = st.one_of(st.sampled_from((0, 1, n_max - n_new)), st.integers(0, n_max - n_new))
    seqlens = np.array([draw(lengths) for _ in range(batch)], np.int32)
    q = arrays(draw, (batch, heads, n_q, d), dtype)
    k_cache, v_cache = (arrays(draw, (batch, kv_heads, n_max, d), dtype) for _ in range(2))
    new = (None, None) if n_new == 0 else tuple(arrays(draw, (batch, kv_heads, n_new, d), dtype) for _ in range(2))
    causal = draw(st.sampled_from((True, False, "top_left")))
    rows = heads // kv_heads * n_q
    whole = min(128, cdiv(rows, 16) * 16)
    tiles = draw(st.sampled_from((None, (whole, 16)) if whole > 16 else (None,)))
    splits = draw(st.sampled_from((0, 1, 3)))
    streamed = dtype != np.float32
    key_warps = draw(st.sampled_from((0, 1, 4) if streamed and (tiles is None or tiles[0] == 16) else (0, 1)))
    paged = draw(st.booleans())
    return q, k_cache, v_cache, seqlens, new, causal, tiles, splits, key_warps, paged


@given(problem=grouped_problems(), seed=st.integers(0, 2 ** 16))
def test_query_groups_read_as_rows_match_the_float64_reference(problem, seed):
    # Every query head of a group (and each of its N_q queries) gets its own causal diagonal, whether the group's
    # queries are one tile's rows or several tiles', through a contiguous cache or shuffled pages.
    check_grouped(problem, seed)


@pytest.mark.parametrize("heads, kv_heads, n_q, causal, tiles, splits, paged", [
    (32, 1, 4, True, (128, 16), 0, True),       # MQA, 4 new queries: 128 packed rows in one tile, shuffled pages
    (8, 2, 4, "top_left", (32, 16), 3, False),  # GQA of 4, top-left: 16 rows of each group in a 32-row tile, splits
    (32, 1, 1, True, None, 2, False),           # MQA, one query: 32 rows in two of the simulator's 16-row tiles
], ids=["mqa 128 rows paged", "gqa top-left split", "mqa two tiles"])
def test_query_groups_of_the_serving_shapes(heads, kv_heads, n_q, causal, tiles, splits, paged):
    # Entries full, empty and ragged, one new key each (bottom-right: the new key is on every query's diagonal).
    rng = np.random.default_rng(31)
    q = rng.standard_normal((3, heads, n_q, 16)).astype(np.float16)
    k_cache, v_cache = (rng.standard_normal((3, kv_heads, 48, 16)).astype(np.float16) for _ in range(2))
    new = tuple(rng.standard_normal((3, kv_heads, 1, 16)).astype(np.float16) for _ in range(2))
    seqlens = np.array([47, 0, 13], np.int32)
    check_grouped((q, k_cache, v_cache, seqlens, new, causal, tiles, splits, 0, paged), 7)


def check_grouped(problem, seed):
    """``grouped_problems``' call against the float64 reference (the pages' appended rows too), and packed."""
    q, k_cache, v_cache, seqlens, (k_new, v_new), causal, tiles, splits, key_warps, paged = problem
    n_new = 0 if k_new is None else k_new.shape[2]
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    for b, start in enumerate(seqlens):
        if n_new:
            expected_k[b, :, start:start + n_new] = k_new[b]
            expected_v[b, :, start:start + n_new] = v_new[b]
    options = dict(k_new=k_new, v_new=v_new, causal=causal, block_sizes=tiles, num_splits=splits, key_warps=key_warps,
                   return_lse=True)
    if paged:
        (k_cache, table), (v_cache, _) = (paged_copy(x, 16, np.random.default_rng(seed)) for x in (k_cache, v_cache))
        options["block_table"] = table
    out, lse = numba_flash.attention_with_kv_cache(q, k_cache, v_cache, seqlens, **options)
    heads, n_q = q.shape[1:3]
    group = heads // k_cache.shape[1]
    plans = [p for p in numba_flash.api._PLANS.values() if isinstance(p, numba_flash.api._CachePlan)
             and p.user_shape == q.shape and p.call.kv_heads == k_cache.shape[1]]
    assert plans and all(p.call.varlen.head_queries == (n_q if group > 1 else 0) for p in plans)   # C order: packed
    for b, length in enumerate(seqlens + n_new):
        if paged:   # the appended rows went through the table
            for cache, pool in ((expected_k, k_cache), (expected_v, v_cache)):
                np.testing.assert_array_equal(logical_rows(pool, table, b, length), cache[b, :, :length])
        if length == 0:
            assert np.all(out[b].astype(np.float32) == 0) and np.all(np.isneginf(lse[b]))
            continue
        k, v = (np.repeat(x[b, :, :length], group, axis=0) for x in (expected_k, expected_v))
        ref_out, ref_lse = reference.attention(q[b], k, v, causal=alignment(causal))
        assert_close_to_reference(out[b], lse[b], ref_out, ref_lse, q[b], k, v, 0.25, q.dtype)


def test_queries_whose_heads_are_not_n_q_rows_apart_keep_a_tile_per_head():
    # q as a (B, N_q, H_q, d) array's transposed view (heads d apart, queries H_q d): its group cannot be viewed as
    # rows, so each query head keeps its own tile (and reads the group's K/V itself); the results are the packed
    # call's.
    rng = np.random.default_rng(29)
    batch, heads, kv_heads, n_q, d = 2, 8, 2, 4, 16
    base = rng.standard_normal((batch, n_q, heads, d)).astype(np.float16)
    k_cache, v_cache = (rng.standard_normal((batch, kv_heads, 40, d)).astype(np.float16) for _ in range(2))
    seqlens = np.array([40, 13], np.int32)
    q_view = device_view(cuda.to_device(base), (0, 2, 1, 3))
    device = [cuda.to_device(x) for x in (k_cache, v_cache, seqlens)]
    out, lse = numba_flash.attention_with_kv_cache(q_view, *device, return_lse=True)
    q = np.ascontiguousarray(base.transpose(0, 2, 1, 3))
    want, want_lse = numba_flash.attention_with_kv_cache(q, k_cache, v_cache, seqlens, return_lse=True)
    # causal, scale, block_sizes, num_splits, kv_stages, key_warps, table, score_mod, mask_mod
    defaults = (True, None, None, 0, 0, 0, None, None, None)
    for x, packed in ((q_view, False), (q, True)):
        plan = numba_flash.api._CachePlan((x, k_cache if packed else device[0], v_cache if packed else device[1]),
                                          defaults)
        assert plan.call.varlen.head_queries == (n_q if packed else 0) and plan.plan.packed == packed
    np.testing.assert_allclose(out.copy_to_host().astype(np.float32), want.astype(np.float32), atol=2e-3)
    np.testing.assert_allclose(lse.copy_to_host(), want_lse, atol=1e-4)


@pytest.mark.parametrize("heads, kv_heads, n_q, d", [(32, 1, 1, 64), (32, 1, 1, 128), (32, 8, 4, 64), (8, 8, 1, 64)])
def test_a_call_the_library_tiles_runs_at_the_plans_tile(heads, kv_heads, n_q, d):
    # The plan's tile (MQA's 32 packed rows: 16-row tiles, 2.3-2.5x less GPU time than one 32-row tile on an H100,
    # 2026-12-07; at d = 128 of 16 keys with eight key warps) is the one the call takes, with the plan's key warps,
    # not only where they equal the narrow tile's.  On a GPU the plan of the call itself shows it; the simulator
    # keeps its narrow tiles, so there the step that picks the tile is asked directly.
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, heads, n_q, d)).astype(np.float16)
    k_cache, v_cache = (rng.standard_normal((2, kv_heads, 4096, d)).astype(np.float16) for _ in range(2))
    # causal, scale, block_sizes, num_splits, kv_stages, key_warps, table, score_mod, mask_mod
    made = numba_flash.api._CachePlan((q, k_cache, v_cache), (True, None, None, 0, 0, 0, None, None, None))
    rows = made.call.q_shape[2]
    tile = decode_plan(2, heads, kv_heads, n_q, 4096, d, 2, multiprocessors=device_limits().multiprocessors,
                       shared_bytes=device_limits().shared_bytes_per_block_optin).block_sizes
    planned, (stages, key_warps) = numba_flash.api._CachePlan.at_planned_tile(made.call, 0, 0, 0)
    assert planned.block_sizes == tile and (tile[0] < rows) == (rows > 16)
    assert key_warps == (1 if tile[0] > 16 else 8 if rows > 16 and d == 128 else 4)
    if not device_limits().simulated:
        assert made.call.block_sizes == tile and made.key_warps == key_warps


def test_calls_on_one_stream_reuse_their_scratch_and_keep_their_own_results():
    # A plan keeps one set of split buffers (partial rows, their lse, the arrival counts) and one lse for calls that do
    # not return it, per stream: a call's results must not change when the next call on the stream reuses them.
    rng = np.random.default_rng(8)
    q1, q2 = (rng.standard_normal((2, 4, 1, 32)).astype(np.float16) for _ in range(2))
    k_cache, v_cache = (rng.standard_normal((2, 2, 90, 32)).astype(np.float16) for _ in range(2))
    seqlens = np.array([90, 41], np.int32)
    options = dict(num_splits=3, block_sizes=(16, 16))
    first = numba_flash.attention_with_kv_cache(q1, k_cache, v_cache, seqlens, **options)
    second, second_lse = numba_flash.attention_with_kv_cache(q2, k_cache, v_cache, seqlens, return_lse=True,
                                                             **options)
    np.testing.assert_array_equal(first, numba_flash.attention_with_kv_cache(q1, k_cache, v_cache, seqlens,
                                                                             **options))
    plans = [p for p in numba_flash.api._PLANS.values() if isinstance(p, numba_flash.api._CachePlan)
             and p.user_shape == q1.shape and p.splits > 1]
    assert plans and all(len(p.scratches) == 1 for p in plans)
    for b, length in enumerate(seqlens):
        k, v = (np.repeat(x[b, :, :length], 2, axis=0) for x in (k_cache, v_cache))
        ref_out, ref_lse = reference.attention(q2[b], k, v, causal=alignment(True))
        assert_close_to_reference(second[b], second_lse[b], ref_out, ref_lse, q2[b], k, v, 0.25, q2.dtype)
