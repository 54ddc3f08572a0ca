"""Decoding from a paged KV cache (attention_with_kv_cache's block_table): pools of pages, appends through the table."""
import numpy as np
import pytest
from hypothesis import given, reject
from hypothesis import strategies as st
from numba import cuda

import numba_flash
import reference
from strategies import VARLEN_DTYPES, arrays, dtype_name, head_dims
from tolerances import assert_close_to_reference

from numba_flash.tiling import cdiv


def logical_rows(pool, table, b, length):
    """Keys 0 .. length - 1 of entry b as (H_kv, length, d): row j % P of page table[b, j // P] of the pool."""
    page_size = pool.shape[2]
    pages = [pool[table[b, i]] for i in range(cdiv(length, page_size))]
    return np.concatenate(pages, axis=1)[:, :length] if pages else pool[:0].reshape(pool.shape[1], 0, pool.shape[3])


def append_through_table(pool, new, seqlens, table):
    """What the call should leave in a pool: each new row r of entry b at logical row seqlens[b] + r."""
    page_size = pool.shape[2]
    for b, start in enumerate(seqlens):
        for r in range(new.shape[2]):
            page, row = divmod(int(start) + r, page_size)
            pool[table[b, page], :, row] = new[b, :, r]


def pool_of(shape, page_major, draw, dtype):
    """A pool (pages, H_kv, P, d): C-contiguous, or (``page_major``) a (pages, P, H_kv, d) array's transposed view, as
    flash-attn and vLLM keep their pages.  Returns (the pool as the call sees it, the array it views)."""
    pages, kv_heads, page_size, d = shape
    if not page_major:
        pool = arrays(draw, shape, dtype)
        return pool, pool
    base = arrays(draw, (pages, page_size, kv_heads, d), dtype)
    return base.transpose(0, 2, 1, 3), base


@st.composite
def paged_problems(draw, dtype):
    """q, pools, lengths, table and k_new, v_new (or None) of a decoding call on a paged cache.

    Entries take their pages from a shuffled pool, so that an entry's pages are scattered and out of order; with
    "shared" two entries begin with the same page where neither appends into it (a shared prompt's prefix); table
    slots past an entry's keys hold pages outside the pool (-1, or past its end: never used) or another entry's page.
    """
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 3))
    n_q = draw(st.one_of(st.just(1), st.integers(1, 3)))
    n_new = draw(st.integers(0, 2))
    page_size = draw(st.sampled_from((16, 32, 48)))
    max_pages = draw(st.integers(1, 3))
    capacity = max_pages * page_size
    d = draw(head_dims())
    held = st.one_of(st.sampled_from((0, capacity - n_new)), st.integers(0, capacity - n_new))
    seqlens = np.array([draw(held) for _ in range(batch)], np.int32)
    used = [cdiv(int(length) + n_new, page_size) for length in seqlens]
    pages = sum(used) + draw(st.integers(0, 2))
    order = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1))).permutation(max(pages, 1))
    table = np.empty((batch, max_pages), np.int32)
    taken = 0
    for b in range(batch):
        table[b, :used[b]] = order[taken:taken + used[b]]
        taken += used[b]
        for i in range(used[b], max_pages):
            table[b, i] = draw(st.sampled_from((-1, max(pages, 1), 2 ** 31 - 1, int(order[0]))))
    if draw(st.sampled_from(("scattered", "shared"))) == "shared" and batch > 1 and min(seqlens[:2]) >= page_size:
        table[1, 0] = table[0, 0]
    shape = (max(pages, 1), kv_heads, page_size, d)
    page_major = draw(st.booleans())
    k_pool, v_pool = (pool_of(shape, page_major, draw, dtype) for _ in range(2))
    q = arrays(draw, (batch, heads, n_q, d), dtype)
    new = (None, None) if n_new == 0 else tuple(arrays(draw, (batch, kv_heads, n_new, d), dtype) for _ in range(2))
    causal = draw(st.sampled_from((True, False, "top_left")))
    splits = draw(st.integers(0, 3))
    streamed = dtype != np.float32 and d % 8 == 0
    key_warps = draw(st.sampled_from((0, 1, 4) if streamed else (0, 1)))
    return q, k_pool, v_pool, seqlens, table, new, causal, splits, key_warps


def device_view(array, axes):
    """A device ``array`` with its axes permuted, no copy (on a GPU, Numba's ``DeviceNDArray.transpose`` takes 2-D
    arrays only; the simulator's takes any)."""
    if numba_flash.in_simulator():
        return array.transpose(axes)
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return DeviceNDArray(tuple(array.shape[a] for a in axes), tuple(array.strides[a] for a in axes), array.dtype,
                         gpu_data=array.gpu_data)


@pytest.mark.parametrize("dtype", VARLEN_DTYPES, ids=dtype_name)
@given(data=st.data(), on_device=st.booleans())
def test_paged_decoding_matches_the_float64_reference_and_appends_through_the_table(dtype, data, on_device):
    q, (k_pool, k_base), (v_pool, v_base), seqlens, table, (k_new, v_new), causal, splits, key_warps = data.draw(
        paged_problems(dtype))
    n_new = 0 if k_new is None else k_new.shape[2]
    expected_k, expected_v = k_pool.copy(), v_pool.copy()
    if n_new:
        append_through_table(expected_k, k_new, seqlens, table)
        append_through_table(expected_v, v_new, seqlens, table)
    device = on_device and dtype != np.dtype("bfloat16")
    if device:   # pools on the GPU as the caller made them, transposed views included (no copy)
        k_base, v_base = cuda.to_device(k_base), cuda.to_device(v_base)
        k_pool, v_pool = ((x if x.shape == k_pool.shape else device_view(x, (0, 2, 1, 3))) for x in (k_base, v_base))
    to = cuda.to_device if device else (lambda x: x)
    try:
        out, lse = numba_flash.attention_with_kv_cache(
            to(q), k_pool, v_pool, to(seqlens), k_new=None if k_new is None else to(k_new),
            v_new=None if v_new is None else to(v_new), causal=causal, num_splits=splits, key_warps=key_warps,
            block_table=to(table), return_lse=True)
    except ValueError as exc:   # key warps whose buffers exceed shared memory (large d): refused up front
        if "bytes of shared memory" not in str(exc):
            raise
        reject()
    out, lse = (x.copy_to_host() if hasattr(x, "copy_to_host") else x for x in (out, lse))
    got_k, got_v = (x.copy_to_host() if hasattr(x, "copy_to_host") else x for x in (k_base, v_base))
    if got_k.shape != expected_k.shape:   # the (pages, P, H_kv, d) array under the view
        got_k, got_v = (x.transpose(0, 2, 1, 3) for x in (got_k, got_v))
    np.testing.assert_array_equal(got_k.view(np.uint8), expected_k.view(np.uint8))   # those rows, nothing else
    np.testing.assert_array_equal(got_v.view(np.uint8), expected_v.view(np.uint8))
    group = q.shape[1] // k_pool.shape[1]
    for b, length in enumerate(seqlens + n_new):
        if length == 0:
            assert np.all(out[b].astype(np.float32) == 0) and np.all(np.isneginf(lse[b]))
            continue
        k, v = (np.repeat(logical_rows(x, table, b, length), group, axis=0) for x in (expected_k, expected_v))
        ref_out, ref_lse = reference.attention(q[b], k, v, causal="bottom_right" if causal is True else causal)
        assert_close_to_reference(out[b], lse[b], ref_out, ref_lse, q[b], k, v, q.shape[-1] ** -0.5, dtype)


def paged_copy(cache, page_size, rng, spare=1):
    """A contiguous cache (B, H_kv, N_max, d) as a pool of shuffled pages (with ``spare`` pages of noise) and its
    block table: the same keys, elsewhere."""
    batch, kv_heads, n_max, d = cache.shape
    max_pages = cdiv(n_max, page_size)
    order = rng.permutation(batch * max_pages + spare).astype(np.int32)
    pool = rng.standard_normal((order.size, kv_heads, page_size, d)).astype(cache.dtype)
    table = order[:batch * max_pages].reshape(batch, max_pages)
    for b in range(batch):
        for i in range(max_pages):
            rows = cache[b, :, i * page_size:(i + 1) * page_size]
            pool[table[b, i], :, :rows.shape[1]] = rows
    return pool, table


SIXTEEN_BIT = [t for t in VARLEN_DTYPES if t != np.float32]
INVARIANCE = [
    # (dtype, page size, N_q, query heads, causal, splits, key warps, K/V buffers, tiles)
    (SIXTEEN_BIT[0], 16, 1, 4, True, 2, 4, 0, (16, 16)),     # a round of four warps' tiles over four pages
    (np.float32, 32, 3, 2, True, 3, 1, 0, (16, 16)),         # tiles through registers, two per page; N_q > 1
    (SIXTEEN_BIT[-1], 48, 2, 4, "top_left", 1, 1, 3, None),  # three buffers copied before the lengths are read
]


@pytest.mark.parametrize("dtype, page_size, n_q, heads, causal, splits, key_warps, stages, tiles", INVARIANCE,
                         ids=["16-bit, key warps", "float32, N_q 3", "16-bit, early copies"])
def test_paged_decoding_gives_the_bits_of_the_contiguous_cache_it_holds(dtype, page_size, n_q, heads, causal, splits,
                                                                        key_warps, stages, tiles):
    # The same keys in a contiguous cache and in shuffled pages, the same tiles and splits: the kernels add the
    # same products in the same order, so O, lse and the appended rows are the same bits.
    rng = np.random.default_rng(23)
    k_cache, v_cache = (rng.standard_normal((2, 2, 96, 16)).astype(dtype) for _ in range(2))
    q = rng.standard_normal((2, heads, n_q, 16)).astype(dtype)
    k_new, v_new = (rng.standard_normal((2, 2, 1, 16)).astype(dtype) for _ in range(2))
    seqlens = np.array([95, 37], np.int32)
    (k_pool, table), (v_pool, _) = (paged_copy(x, page_size, np.random.default_rng(5)) for x in (k_cache, v_cache))
    options = dict(k_new=k_new, v_new=v_new, causal=causal, block_sizes=tiles, num_splits=splits, kv_stages=stages,
                   key_warps=key_warps, return_lse=True)
    want = numba_flash.attention_with_kv_cache(q, k_cache, v_cache, seqlens, **options)
    got = numba_flash.attention_with_kv_cache(q, k_pool, v_pool, seqlens, block_table=table, **options)
    for x, y in zip(want, got):
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))
    for cache, pool in ((k_cache, k_pool), (v_cache, v_pool)):
        for b, length in enumerate(seqlens + 1):
            np.testing.assert_array_equal(logical_rows(pool, table, b, length), cache[b, :, :length])


def test_a_device_table_naming_pages_outside_the_pool_gives_nan_rows_and_no_write_there():
    # A table on the GPU is not read by the host, so it cannot raise: an entry that keeps one of its keys on a page
    # outside the pool sees no key and gets NaN rows (as one whose length does not fit), and its new rows are not
    # written where that page would be; the other entries get what a valid table gives, bit for bit.
    rng = np.random.default_rng(29)
    q = rng.standard_normal((3, 2, 1, 16)).astype(np.float32)
    k_pool, v_pool = (rng.standard_normal((6, 1, 16, 16)).astype(np.float32) for _ in range(2))
    k_new, v_new = (rng.standard_normal((3, 1, 1, 16)).astype(np.float32) for _ in range(2))
    seqlens = np.array([20, 31, 5], np.int32)
    table = np.array([[3, 0], [1, 6], [4, -1]], np.int32)    # entry 1's key 16 .. 31 on page 6 of 6
    pools = cuda.to_device(k_pool), cuda.to_device(v_pool)
    out, lse = numba_flash.attention_with_kv_cache(cuda.to_device(q), *pools, cuda.to_device(seqlens),
                                                   k_new=cuda.to_device(k_new), v_new=cuda.to_device(v_new),
                                                   block_table=cuda.to_device(table), return_lse=True)
    out, lse, got_k, got_v = (x.copy_to_host() for x in (out, lse, *pools))
    assert np.isnan(out[1]).all() and np.isnan(lse[1]).all()
    fits = [0, 2]
    want_k, want_v = k_pool.copy(), v_pool.copy()
    want, want_lse = numba_flash.attention_with_kv_cache(q[fits], want_k, want_v, seqlens[fits], k_new=k_new[fits],
                                                         v_new=v_new[fits], block_table=table[fits], return_lse=True)
    np.testing.assert_array_equal(out[fits], want)
    np.testing.assert_array_equal(lse[fits], want_lse)
    np.testing.assert_array_equal(got_k, want_k)   # entry 1's new row (key 31, page 6) went nowhere
    np.testing.assert_array_equal(got_v, want_v)


POOL = np.zeros((4, 2, 16, 8), np.float32)
Q = np.zeros((2, 4, 1, 8), np.float32)
NEW = np.zeros((2, 2, 1, 8), np.float32)
TABLE = np.array([[0, 1], [2, 3]], np.int32)
LENGTHS = np.array([5, 20], np.int32)

BAD_TABLES = [
    ("int64 table", (Q, POOL, POOL, LENGTHS), {"block_table": TABLE.astype(np.int64)}, TypeError, "int32"),
    ("1-D table", (Q, POOL, POOL, LENGTHS), {"block_table": TABLE[0]}, ValueError, "(batch, max_pages)"),
    ("a row per entry", (Q, POOL, POOL, LENGTHS), {"block_table": TABLE[:1]}, ValueError, "one row per batch"),
    ("page of 8 rows", (Q, POOL[:, :, :8], POOL[:, :, :8], LENGTHS), {"block_table": TABLE}, ValueError,
     "page size"),
    ("page of 24 rows", (Q, np.zeros((4, 2, 24, 8), np.float32), np.zeros((4, 2, 24, 8), np.float32), LENGTHS),
     {"block_table": TABLE}, ValueError, "multiple of 16"),
    ("page of 272 rows", (Q, np.zeros((1, 2, 272, 8), np.float32), np.zeros((1, 2, 272, 8), np.float32), LENGTHS),
     {"block_table": TABLE}, ValueError, "page size"),
    ("pools differ", (Q, POOL, POOL[:3], LENGTHS), {"block_table": TABLE}, ValueError, "one shape"),
    ("page outside the pool", (Q, POOL, POOL, LENGTHS), {"block_table": np.array([[0, 1], [2, 4]], np.int32)},
     ValueError, "block_table[1, 1] = 4"),
    ("negative page", (Q, POOL, POOL, LENGTHS), {"block_table": np.array([[-1, 1], [2, 3]], np.int32)},
     ValueError, "block_table[0, 0] = -1"),
    ("page of the new key outside", (Q, POOL, POOL, np.array([5, 16], np.int32)),
     {"block_table": np.array([[0, 9], [2, -1]], np.int32), "k_new": NEW, "v_new": NEW}, ValueError,
     "block_table[1, 1] = -1"),
    ("longer than the table", (Q, POOL, POOL, np.array([5, 32], np.int32)),
     {"block_table": TABLE, "k_new": NEW, "v_new": NEW}, ValueError, "2 pages of 16 rows"),
    ("tile wider than a page", (Q, POOL, POOL, LENGTHS), {"block_table": TABLE, "block_sizes": (16, 32)},
     ValueError, "divide the page size"),
]


@pytest.mark.parametrize("description, args, kwargs, error, words", BAD_TABLES, ids=[c[0] for c in BAD_TABLES])
def test_bad_paged_input_is_rejected_before_any_launch(no_launch, description, args, kwargs, error, words):
    pool = np.zeros_like(args[1])   # the call's pool, to see that nothing was written into it
    with pytest.raises(error) as caught:
        numba_flash.attention_with_kv_cache(args[0], pool, *args[2:], **kwargs)
    assert words in str(caught.value), str(caught.value)
    assert not pool.any(), "the pool was written before the input was rejected"


def test_a_device_table_of_another_kind_than_the_arrays_is_rejected(no_launch):
    with pytest.raises(TypeError, match="q a host array: pass a table of q's kind"):
        numba_flash.attention_with_kv_cache(Q, POOL, POOL, LENGTHS, block_table=cuda.to_device(TABLE))


@pytest.mark.gpu_only
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_generation_loop_captured_in_a_cuda_graph_replays_the_eager_steps_bit_for_bit(paged):
    # One step of generation for a whole batch, with no host in the loop: append the new tokens' keys and values,
    # attend, and advance cache_seqlens on the GPU (a torch op), captured once in a CUDA graph and replayed step
    # after step.  Eager steps from the same start give the same outputs, caches and lengths, bit for bit.
    import torch

    torch.manual_seed(31)
    batch, heads, kv_heads, d, page_size, steps = 4, 8, 2, 64, 16, 5
    n_max = 128
    dtype, device = torch.float16, "cuda"
    lengths = torch.tensor([100, 3, 57, 0], dtype=torch.int32, device=device)
    if paged:
        table = torch.randperm(batch * n_max // page_size, device=device).to(torch.int32).reshape(batch, -1)
        cache_shape = (batch * n_max // page_size, page_size, kv_heads, d)   # flash-attn's layout
    else:
        table, cache_shape = None, (batch, kv_heads, n_max, d)
    caches = [torch.randn(cache_shape, dtype=dtype, device=device) for _ in range(2)]
    tokens = [[torch.randn(shape, dtype=dtype, device=device) for shape in
               ((batch, heads, 1, d), (batch, kv_heads, 1, d), (batch, kv_heads, 1, d))] for _ in range(steps)]

    def state():
        """Fresh copies of the caches and the lengths, and the step's inputs (q, k_new, v_new) to fill."""
        return [x.clone() for x in caches], lengths.clone(), [torch.empty_like(x) for x in tokens[0]]

    def step(k_cache, v_cache, seqlens, q, k_new, v_new):
        view = (lambda x: x.transpose(1, 2)) if paged else (lambda x: x)
        out = numba_flash.attention_with_kv_cache(q, view(k_cache), view(v_cache), seqlens, k_new=k_new, v_new=v_new,
                                                  block_table=table)
        seqlens += 1
        return out

    (k_eager, v_eager), eager_lengths, inputs = state()
    eager = []
    for token in tokens:
        for x, value in zip(inputs, token):
            x.copy_(value)
        eager.append(step(k_eager, v_eager, eager_lengths, *inputs).clone())

    (k_graph, v_graph), graph_lengths, static = state()
    warm = state()   # the plan built (and its kernels compiled) outside the capture
    step(*warm[0], warm[1], *warm[2])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step(k_graph, v_graph, graph_lengths, *static)
    for token, want in zip(tokens, eager):
        for x, value in zip(static, token):
            x.copy_(value)
        graph.replay()
        assert torch.equal(graph_out, want)
    torch.cuda.synchronize()
    assert torch.equal(graph_lengths, eager_lengths) and torch.equal(graph_lengths, lengths + steps)
    assert torch.equal(k_graph, k_eager) and torch.equal(v_graph, v_eager)
