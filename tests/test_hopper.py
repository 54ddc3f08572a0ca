"""The Hopper path (``kernels/hopper``).  Host-side facts that need no GPU: the swizzle, the descriptor's bits,
the accumulator layout; the tiles' cp.async copier (any GPU, or the simulator).  Whatever issues ``wgmma`` runs
only on a Hopper GPU (the simulator has no warpgroup instructions): the forward against the float64 reference
here, the layouts in ``experiments/tuning/wgmma_layouts.py``."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numba import cuda, uint32

from numba_flash.kernels.hopper.wgmma import (ATOM_BYTES, SWIZZLE_128B, accumulator_entries, descriptor, staged_offset,
                                              swizzle_128)
from strategies import causal_mask, wgmma_dq, wgmma_loop
from test_nan import Poisoned, flags_of, nan_pattern, without_nan


def test_the_128_byte_swizzle_permutes_the_chunks_of_each_row_of_an_atom():
    offsets = np.arange(0, 4 * ATOM_BYTES, 2)
    swizzled = np.array([swizzle_128(int(x)) for x in offsets])
    assert sorted(swizzled) == list(offsets)                          # a permutation
    assert np.all(swizzled // 128 == offsets // 128)                  # within its 128-byte row
    assert np.all(swizzled % 16 == offsets % 16)                      # 16-byte chunks move whole
    rows, chunks = offsets // 128, (offsets % 128) // 16
    assert np.all((swizzled % 128) // 16 == chunks ^ (rows % 8))      # chunk c of row r goes to c ^ (r % 8)


def test_a_descriptor_holds_each_field_where_the_ptx_isa_puts_it():
    value = int(descriptor(0x2A40, 16, 1024, SWIZZLE_128B))
    assert value & 0x3FFF == 0x2A40 >> 4
    assert (value >> 16) & 0x3FFF == 1
    assert (value >> 32) & 0x3FFF == 1024 >> 4
    assert value >> 62 == SWIZZLE_128B
    assert value & ~((0x3FFF) | (0x3FFF << 16) | (0x3FFF << 32) | (3 << 62)) == 0   # nothing else set


def test_the_accumulator_layout_gives_every_element_to_exactly_one_register():
    for n in (64, 128):
        owners = np.zeros((64, n), int)
        for member in range(128):
            rows, columns = accumulator_entries(member, n)
            np.add.at(owners, (rows, columns), 1)
        assert np.all(owners == 1)
    # Thread 0 holds rows 0 and 8, columns 0-1 of each 8-column block (mma.sync's C fragment per block).
    rows, columns = accumulator_entries(0, 64)
    assert list(zip(rows[:8], columns[:8])) == [(0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9), (8, 8), (8, 9)]


def test_every_wgmma_forward_fits_a_hopper_block_and_splits_o_in_slices_wgmma_can_take():
    """The forward's head-dim choices at every head dim it takes: the block's shared memory (``shared_bytes``, every
    warpgroup count and loop) within the 227 KB a block may have on sm_90, on a layout that holds d; O's slices
    (``value_slices``) cover d, each at most 128 columns (64 registers) and a multiple of 8 (wgmma's N, and the
    stores' 8-column blocks)."""
    from numba_flash.kernels.hopper.common import FORWARD_HEAD_DIMS, HEAD_DIMS, LAYOUT_DIMS, layout_dim
    from numba_flash.kernels.hopper.forward import WARPGROUP_COUNTS, shared_bytes
    from numba_flash.kernels.hopper.forward_steps import value_slices
    from numba_flash.kernels.hopper.specialized_forward import STAGE_COUNTS
    from numba_flash.kernels.hopper.specialized_forward import shared_bytes as specialized_shared_bytes

    for d in FORWARD_HEAD_DIMS:
        assert layout_dim(d) in LAYOUT_DIMS and layout_dim(d) >= d
        for warpgroups in WARPGROUP_COUNTS:
            for overlap in (False, True):
                assert shared_bytes(d, warpgroups, overlap) <= 227 * 1024, (d, warpgroups, overlap)
        slices = value_slices(d)
        assert sum(slices) == d and all(0 < x <= 128 and x % 8 == 0 for x in slices), slices
    for d in HEAD_DIMS:   # the warp-specialised forward's three or four stages, two or three consumers' Q tiles
        assert specialized_shared_bytes(d, 3, max(STAGE_COUNTS)) <= 227 * 1024, d
    assert value_slices(256) == (128, 128) and value_slices(96) == (96,)


SENTINEL = 0xDEADBEEF   # what shared memory holds before the copies


@given(data=st.data())
def test_the_tile_copier_lands_the_rows_swizzled_and_zeros_the_pad_columns(data):
    """``common.tile_copier`` against NumPy: 64 rows of X (a ragged last tile too, strided rows) in the swizzled
    layout of ``layout_dim(d)`` columns, zeros past the valid rows and in the pad columns d..layout_dim(d) - 1
    (d = 96: columns 96..127 of the second 64-column tile), nothing else written; the 256-column layout's rows in
    two column groups with one warpgroup (d = 192 first: its second group half pad)."""
    from numba_flash.kernels.fast.primitives import copy_async_wait_all
    from numba_flash.kernels.hopper.common import BLOCK_N, FORWARD_HEAD_DIMS, layout_dim, tile_bytes, tile_copier

    d = data.draw(st.sampled_from(sorted(FORWARD_HEAD_DIMS, key=lambda x: x != 192)))
    threads = data.draw(st.sampled_from([128, 256]))
    rows_valid = data.draw(st.sampled_from([BLOCK_N, 200, data.draw(st.integers(1, BLOCK_N - 1))]))
    stride = d + 8 * data.draw(st.integers(0, 3))            # elements between rows (16-byte aligned)
    first = 8 * data.draw(st.integers(0, 3))
    rows_in_x = min(rows_valid, BLOCK_N)
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    x = rng.integers(0, 2 ** 16, first + rows_in_x * stride, dtype=np.uint64).astype(np.uint16)
    start_tile = tile_copier(d, threads)[1]
    words = tile_bytes(d) // 4

    @cuda.jit
    def kernel(x, out):
        tile = cuda.shared.array(0, uint32)
        for i in range(cuda.threadIdx.x, words, cuda.blockDim.x):
            tile[i] = SENTINEL
        cuda.syncthreads()   # the sentinels everywhere before any copy lands
        start_tile(tile, 0, x, first, stride, rows_valid, cuda.threadIdx.x)
        copy_async_wait_all()
        cuda.syncthreads()   # every thread's copies landed
        for i in range(cuda.threadIdx.x, words, cuda.blockDim.x):
            out[i] = tile[i]

    out = np.zeros(words, np.uint32)
    kernel[1, threads, 0, 4 * words](x.view(np.uint32), out)
    got = out.view(np.uint16)
    expected = np.zeros((BLOCK_N, layout_dim(d)), np.uint16)
    for r in range(rows_in_x):
        expected[r, :d] = x[first + r * stride:first + r * stride + d]
    rows, cols = np.meshgrid(np.arange(BLOCK_N), np.arange(layout_dim(d)), indexing="ij")
    at = np.vectorize(lambda r, c: swizzle_128(staged_offset(int(r), int(c), BLOCK_N)) // 2)(rows, cols)
    np.testing.assert_array_equal(got[at], expected)


def _where():
    """Where the wgmma forward can run here: "simulator" (NumPy inputs, the twins of wgmma.py), "hopper"
    (torch tensors on a GPU of compute capability 9.0), or None (another GPU)."""
    from numba_flash import in_simulator

    if in_simulator():
        return "simulator"
    try:
        import torch
    except ImportError:
        return None
    return "hopper" if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) else None


def to_gpu(x, token_major=False):
    """A host array (16-bit, bfloat16 through ml_dtypes, or float32) as a torch CUDA tensor with the same strides:
    (B, H, N, d), or (B, N, H, d) memory viewed as (B, H, N, d) when ``token_major``."""
    import torch

    memory = np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if token_major else x
    if memory.dtype.itemsize == 2:
        kind = torch.float16 if memory.dtype == np.float16 else torch.bfloat16
        tensor = torch.from_numpy(memory.view(np.int16)).cuda().view(kind)
    else:
        tensor = torch.from_numpy(memory).cuda()
    return tensor.transpose(1, 2) if token_major else tensor


def to_host(t):
    """A torch CUDA tensor back as NumPy (bfloat16 through ml_dtypes)."""
    import ml_dtypes
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def forward_head_dims(where):
    """The wgmma forward's head dims a test draws: every one on a GPU (``common.FORWARD_HEAD_DIMS``); in the
    simulator, whose time grows with d, those up to 128 and two of the 256-column layout, d = 256 and d = 192 (the
    layout's last 64 columns pad).  d = 256 first in both: Hypothesis's first example, its simplest, then draws it
    (so that the gpu_smoke profile's five examples take it too)."""
    from numba_flash.kernels.hopper.common import FORWARD_HEAD_DIMS, HEAD_DIMS

    head_dims = FORWARD_HEAD_DIMS if where == "hopper" else HEAD_DIMS + (192, 256)
    return st.sampled_from(sorted(head_dims, key=lambda d: d != 256))


@pytest.mark.skipif(_where() is None, reason="the wgmma forward needs a Hopper GPU (sm_90a) or the simulator")
@given(data=st.data())
def test_the_wgmma_forward_matches_the_float64_reference(data):
    """Random shapes, grouped heads, strides, both causal alignments; and NaN (drawn into a query, key or value
    row) reaching exactly the rows allowed to see it, as on the mma.sync path (tests/test_nan.py); both loops,
    products waited for at once or overlapping the softmax (``make_wgmma_forward``'s OVERLAP), in blocks of
    one warpgroup or two (WARPGROUPS), and the warp-specialised kernel (``specialized_forward.py``, up to d = 128,
    two or three consumers, Q from shared memory or registers, three or four K/V stages);
    head dims on the 64-, 128- and 256-column layouts (O in two slices above 128)."""
    import ml_dtypes

    import numba_flash
    import reference
    from numba_flash.kernels.hopper.common import HEAD_DIMS
    from numba_flash.kernels.hopper.forward import BLOCK_M, WARPGROUP_COUNTS
    from numba_flash.kernels.hopper.specialized_forward import STAGE_COUNTS
    from tolerances import assert_close_to_reference

    where = _where()
    d = data.draw(forward_head_dims(where))
    # In the simulator: up to three tiles each way (every thread of a block is a Python thread), two above d = 128.
    longest = 200 if where == "hopper" else (2 if d <= 128 else 1) * BLOCK_M + 5
    batch = data.draw(st.integers(1, 2))
    kv_heads = data.draw(st.integers(1, 2 if where == "hopper" else 1))
    group = data.draw(st.sampled_from([1, 2, 3]))                       # grouped-query heads
    heads = kv_heads * group
    n_q, n_k = data.draw(st.integers(1, longest)), data.draw(st.integers(1, longest))
    dtype = data.draw(st.sampled_from([np.float16, ml_dtypes.bfloat16]))
    causal = data.draw(st.sampled_from([False, True, "bottom_right"]))
    token_major = data.draw(st.booleans())   # q, k, v as (B, N, H, d) memory viewed as (B, H, N, d)
    poisoned = data.draw(st.sampled_from([None, "q", "k", "v"]))
    overlap = data.draw(st.booleans())
    warpgroups = data.draw(st.sampled_from(WARPGROUP_COUNTS))
    kernel = data.draw(st.sampled_from(["blocks", "specialized"] if d in HEAD_DIMS else ["blocks"]))
    consumers = data.draw(st.sampled_from([2, 3]))   # (the warp-specialised kernel's)
    query = data.draw(st.sampled_from(["shared", "registers"]))   # (its S = Q K^T's A operand)
    stages = data.draw(st.sampled_from(STAGE_COUNTS))               # (its K/V stages)
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))

    def operand(h, n):
        if token_major:
            return rng.standard_normal((batch, n, h, d)).astype(dtype).transpose(0, 2, 1, 3)
        return rng.standard_normal((batch, h, n, d)).astype(dtype)

    host = dict(q=operand(heads, n_q), k=operand(kv_heads, n_k), v=operand(kv_heads, n_k))
    if poisoned:
        x = host[poisoned]
        x[data.draw(st.integers(0, batch - 1)), data.draw(st.integers(0, x.shape[1] - 1)),
          data.draw(st.integers(0, x.shape[2] - 1)), data.draw(st.integers(0, d - 1))] = np.nan
    if where == "hopper":
        with wgmma_loop(overlap, warpgroups, kernel, consumers, query, stages):
            out, lse = numba_flash.attention(*(to_gpu(host[x], token_major) for x in "qkv"), causal=causal,
                                             algorithm="wgmma", return_lse=True)
        out, lse = to_host(out), to_host(lse)
    else:
        with wgmma_loop(overlap, warpgroups, kernel, consumers, query, stages):
            out, lse = numba_flash.attention(host["q"], host["k"], host["v"], causal=causal, algorithm="wgmma",
                                             return_lse=True)
    allowed = causal_mask(causal, n_q, n_k)
    allowed = np.ones((batch * heads, n_q, n_k), bool) if allowed is None else np.broadcast_to(
        allowed, (batch * heads, n_q, n_k))
    bad = Poisoned(flags_of(host["q"]), flags_of(host["k"]), flags_of(host["v"]), np.zeros((batch * heads, n_q), bool))
    nan_o, nan_lse, *_ = nan_pattern(allowed, bad, group)
    got_o = np.isnan(np.asarray(out, np.float64)).any(-1).reshape(nan_o.shape)
    assert np.array_equal(got_o, nan_o), f"NaN rows of O: {np.argwhere(got_o != nan_o)[:5]}"
    assert np.array_equal(np.isnan(lse).reshape(nan_lse.shape), nan_lse)
    # Every other row is what it would be without the NaN.
    q64, k64, v64 = (without_nan(host[x]).astype(np.float64) for x in "qkv")
    ref_out, ref_lse = reference.attention(q64, k64, v64, causal=causal)
    keep, keep_lse = ~nan_o.reshape(out.shape[:-1]), ~nan_lse.reshape(out.shape[:-1])
    expanded = [reference.repeat_kv(x, heads) for x in (k64, v64)]
    assert_close_to_reference(np.where(keep[..., None], out, 0), np.where(keep_lse, lse, ref_lse),
                              np.where(keep[..., None], ref_out, 0), ref_lse, q64, *expanded, 1 / np.sqrt(d), dtype)


@pytest.mark.skipif(_where() is None, reason="the wgmma forward needs a Hopper GPU (sm_90a) or the simulator")
@given(data=st.data())
def test_the_wgmma_forward_with_a_block_mask_matches_the_float64_reference(data):
    """Random block masks (``strategies.block_masks``: random density, all zero or all one, empty rows or columns of
    blocks), of blocks that are whole tiles (multiples of 64: the element test compiled out, as flash2 takes them)
    or of any size (tiles wholly inside, wholly outside and partly covered, the last tested element by element),
    leading dims broadcast over batch and heads; ragged N_q and N_k, grouped heads, both causal alignments, float16
    and bfloat16, both loops and warpgroup counts.  Rows that see no key give O = 0 and lse = -inf exactly, and a
    NaN (drawn into a query, key or value row) reaches exactly the rows allowed to see it: in a partly covered
    tile, through the NaN pass, as on a causal diagonal."""
    import ml_dtypes

    import numba_flash
    import reference
    from numba_flash.kernels.hopper.common import HEAD_DIMS
    from numba_flash.kernels.hopper.forward import BLOCK_M, WARPGROUP_COUNTS
    from strategies import block_masks
    from tolerances import assert_close_to_reference

    where = _where()
    longest = 200 if where == "hopper" else 2 * BLOCK_M + 5   # the simulator: up to three tiles each way
    batch = data.draw(st.integers(1, 2))
    kv_heads = data.draw(st.integers(1, 2 if where == "hopper" else 1))
    group = data.draw(st.sampled_from([1, 2, 3]))
    heads = kv_heads * group
    n_q, n_k = data.draw(st.integers(1, longest)), data.draw(st.integers(1, longest))
    whole = data.draw(st.booleans())
    block_size = (data.draw(st.sampled_from([64, 128])), data.draw(st.sampled_from([64, 128]))) if whole else (
        data.draw(st.integers(1, 80)), data.draw(st.integers(1, 80)))
    bm = data.draw(block_masks(n_q, n_k, block_size, batch_shape=(batch, heads)))[0]
    # The simulator: d up to 128 (the forward's test above draws the 256-column layout there).
    d = data.draw(forward_head_dims(where) if where == "hopper" else st.sampled_from(HEAD_DIMS))
    dtype = data.draw(st.sampled_from([np.float16, ml_dtypes.bfloat16]))
    causal = data.draw(st.sampled_from([False, True, "bottom_right"]))
    poisoned = data.draw(st.sampled_from([None, "q", "k", "v"]))
    overlap = data.draw(st.booleans())
    warpgroups = data.draw(st.sampled_from(WARPGROUP_COUNTS))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    host = dict(q=rng.standard_normal((batch, heads, n_q, d)).astype(dtype),
                k=rng.standard_normal((batch, kv_heads, n_k, d)).astype(dtype),
                v=rng.standard_normal((batch, kv_heads, n_k, d)).astype(dtype))
    if poisoned:
        x = host[poisoned]
        x[data.draw(st.integers(0, batch - 1)), data.draw(st.integers(0, x.shape[1] - 1)),
          data.draw(st.integers(0, x.shape[2] - 1)), data.draw(st.integers(0, d - 1))] = np.nan
    with wgmma_loop(overlap, warpgroups):
        if where == "hopper":
            out, lse = numba_flash.attention(*(to_gpu(host[x]) for x in "qkv"), causal=causal, block_mask=bm,
                                             algorithm="wgmma", return_lse=True)
            out, lse = to_host(out), to_host(lse)
        else:
            out, lse = numba_flash.attention(host["q"], host["k"], host["v"], causal=causal, block_mask=bm,
                                             algorithm="wgmma", return_lse=True)
    dense = np.broadcast_to(bm.to_dense(n_q, n_k), (batch, heads, n_q, n_k))
    causal_part = causal_mask(causal, n_q, n_k)
    allowed = (dense if causal_part is None else dense & causal_part).reshape(batch * heads, n_q, n_k)
    bad = Poisoned(flags_of(host["q"]), flags_of(host["k"]), flags_of(host["v"]), np.zeros((batch * heads, n_q), bool))
    nan_o, nan_lse, *_ = nan_pattern(allowed, bad, group)
    got_o = np.isnan(np.asarray(out, np.float64)).any(-1).reshape(nan_o.shape)
    assert np.array_equal(got_o, nan_o), f"NaN rows of O: {np.argwhere(got_o != nan_o)[:5]}"
    assert np.array_equal(np.isnan(lse).reshape(nan_lse.shape), nan_lse)
    # Every other row is what it would be without the NaN; a row that sees no key is exactly 0, its lse -inf.
    q64, k64, v64 = (without_nan(host[x]).astype(np.float64) for x in "qkv")
    ref_out, ref_lse = reference.attention(q64, k64, v64, causal=causal, mask=dense)
    keep, keep_lse = ~nan_o.reshape(out.shape[:-1]), ~nan_lse.reshape(out.shape[:-1])
    expanded = [reference.repeat_kv(x, heads) for x in (k64, v64)]
    assert_close_to_reference(np.where(keep[..., None], out, 0), np.where(keep_lse, lse, ref_lse),
                              np.where(keep[..., None], ref_out, 0), ref_lse, q64, *expanded, 1 / np.sqrt(d), dtype)
    unseen = ~allowed.any(-1).reshape(out.shape[:-1])
    assert np.all(np.asarray(out, np.float64)[unseen] == 0) and np.all(np.isneginf(lse[unseen]))


def test_the_wgmma_forward_rejects_what_it_cannot_run():
    from numba_flash import attention

    def arrays(d=64, dtype=np.float16, n_k=8):
        return (np.zeros((1, 1, 8, d), dtype), np.zeros((1, 1, n_k, d), dtype), np.zeros((1, 1, n_k, d), dtype))

    for d in (72, 232):   # not multiples of 16 (d <= 256 otherwise: every call's limit)
        with pytest.raises(ValueError, match=f"algorithm='wgmma': the head dim must be one of .* forward, not {d}"):
            attention(*arrays(d=d), algorithm="wgmma")
    with pytest.raises(ValueError, match="algorithm='wgmma': q, k, v must be float16 or bfloat16"):
        attention(*arrays(dtype=np.float32), algorithm="wgmma")
    with pytest.raises(ValueError, match="k and v"):
        q, k, _ = arrays()
        attention(q, k, np.zeros((1, 1, 9, 64), np.float16), algorithm="wgmma")
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        q = np.zeros((1, 3, 8, 64), np.float16)
        attention(q, np.zeros((1, 2, 8, 64), np.float16), np.zeros((1, 2, 8, 64), np.float16), algorithm="wgmma")
    with pytest.raises(ValueError, match="causal"):
        attention(*arrays(), causal="diagonal", algorithm="wgmma")
    with pytest.raises(ValueError, match="algorithm='wgmma': scale must be positive"):
        attention(*arrays(), scale=-1.0, algorithm="wgmma")
    with pytest.raises(ValueError, match="block_sizes must be None with algorithm='wgmma'"):
        attention(*arrays(), block_sizes=(64, 64), algorithm="wgmma")
    with pytest.raises(ValueError, match="algorithm='wgmma': the wgmma forward has no dropout yet"):
        attention(*arrays(), dropout_p=0.1, algorithm="wgmma")


def test_flash2_picks_the_wgmma_forward_on_hopper_for_calls_in_its_scope(monkeypatch, hopper_lookalike):
    """Which kernel ``algorithm="flash2"`` lays out, with the device made to look like an H200 (the plan is built,
    nothing launched): wgmma inside its scope, mma.sync outside it and wherever the caller names tiles."""
    import numba_flash
    from numba_flash import api
    from numba_flash.kernels.hopper import forward as hopper

    device = hopper_lookalike

    def kernel(d=64, dtype=np.float16, causal=False, scale=None, block_mask=None, dropout_p=0.0, block_sizes=None,
               whole_name=False):
        x = np.zeros((1, 2, 70, d), dtype)
        plan = api._ForwardPlan((x, x, x), (causal, scale, block_mask, dropout_p, "flash2", block_sizes,
                                                  None, None))
        return plan.launch.kernel.name if whole_name else plan.launch.kernel.name.split("_")[0]

    monkeypatch.setattr(hopper, "AUTOMATIC_SCOPE", {(64, False), (96, False), (128, True)})   # (head dim, causal)
    assert kernel() == kernel(d=128, causal="bottom_right") == kernel(dtype=np.dtype("bfloat16")) == "wgmma"
    assert kernel(d=96) == "wgmma"
    assert kernel(d=128) == kernel(causal=True) == kernel(d=96, causal=True) == kernel(d=32) == "flash2"
    assert kernel(d=72) == kernel(dtype=np.float32) == kernel(scale=-0.5) == kernel(dropout_p=0.1) == "flash2"
    assert kernel(block_sizes=(64, 64)) == "flash2"
    # Block masks of whole tiles (blocks of multiples of 64 rows and keys: ``forward.whole_tiles``), the element test
    # compiled out; other blocks stay on mma.sync (they run on wgmma when asked for by name).
    whole = numba_flash.BlockMask(np.array([[True, False], [True, True]]), (64, 64))
    assert kernel(block_mask=whole, whole_name=True) == "wgmma_forward_d64_f16_sparse_whole_tiles"
    assert kernel(block_mask=numba_flash.BlockMask(np.ones((1, 1), bool), (128, 128))) == "wgmma"
    assert kernel(d=128, causal=True, block_mask=numba_flash.BlockMask(np.ones((1, 2), bool), (128, 64))) == "wgmma"
    assert kernel(block_mask=numba_flash.BlockMask(np.ones((5, 5), bool), (16, 16))) == "flash2"
    assert kernel(block_mask=numba_flash.BlockMask(np.ones((1, 2), bool), (128, 48))) == "flash2"
    assert kernel(d=128, block_mask=whole) == "flash2"   # outside AUTOMATIC_SCOPE, mask or not
    assert kernel(block_mask=whole, block_sizes=(64, 64)) == "flash2"
    device.compute_capability = (8, 0)
    assert kernel() == kernel(block_mask=whole) == "flash2"
    device.compute_capability = (9, 0)
    monkeypatch.setattr(hopper, "AUTOMATIC", False)   # NUMBA_FLASH_WGMMA=0
    assert kernel() == kernel(block_mask=whole) == "flash2"


def test_the_wgmma_forward_at_d256_runs_in_blocks_of_two_warpgroups(monkeypatch, hopper_lookalike):
    """d = 256 on a device made to look like an H200, nothing launched: flash2's forward on wgmma in blocks
    of two warpgroups (``DEFAULT_WARPGROUPS``; one where NUMBA_FLASH_WGMMA_WARPGROUPS says so), block masks of whole
    128 x 64 tiles there but not of 64 x 64 blocks (they cut its 128-row tiles); the other head dims of the
    256-column layout on wgmma only when asked for; the backward on mma.sync (its dK and dV would not fit in a
    warpgroup's registers)."""
    import numba_flash
    from numba_flash import api
    from numba_flash.kernels.hopper import backward as hopper_backward
    from numba_flash.kernels.hopper import forward as hopper


    def forward(d=256, dtype=np.float16, causal=False, block_mask=None, algorithm="flash2"):
        x = np.zeros((1, 2, 70, d), dtype)
        return api._ForwardPlan((x, x, x), (causal, None, block_mask, 0.0, algorithm, None, None,
                                            None)).launch.kernel.name

    def backward(d=256):
        x, lse = np.zeros((1, 2, 70, d), np.float16), np.zeros((1, 2, 70), np.float32)
        launches = api._BackwardPlan((x, x, x, x, lse, x), (False, None, None, 0.0, "flash2", None, True, None,
                                                             None)).launches
        return (launches.dkdv if isinstance(launches, hopper_backward.SummedDq) else launches[1]).kernel.name

    assert forward() == forward(algorithm="wgmma") == "wgmma_forward_d256_f16_warpgroups2"
    assert forward(causal="bottom_right", dtype=np.dtype("bfloat16")) == "wgmma_forward_d256_bf16_causal_warpgroups2"
    tiles = numba_flash.BlockMask(np.ones((1, 2), bool), (128, 64))
    assert forward(block_mask=tiles) == "wgmma_forward_d256_f16_warpgroups2_sparse_whole_tiles"
    assert forward(block_mask=numba_flash.BlockMask(np.ones((2, 2), bool), (64, 64))).startswith("flash2")
    assert forward(d=192).startswith("flash2")
    assert forward(d=192, algorithm="wgmma") == "wgmma_forward_d192_f16_warpgroups2"
    assert backward().startswith("flash2") and backward(d=128).startswith("wgmma")
    monkeypatch.setattr(hopper, "WARPGROUPS", "1")   # NUMBA_FLASH_WGMMA_WARPGROUPS=1
    assert forward() == "wgmma_forward_d256_f16"


def test_the_warp_specialised_forward_runs_the_calls_in_its_scope_when_asked(monkeypatch, hopper_lookalike):
    """``NUMBA_FLASH_WGMMA_FORWARD=specialized`` on a device made to look like an H200, nothing launched: the
    warp-specialised kernel for the calls in its scope (d <= 128, no block mask or mods), ``make_wgmma_forward``'s
    for the others; an unknown value is a ValueError naming the variable."""
    import numba_flash
    from numba_flash import api
    from numba_flash.kernels.hopper import forward as hopper

    def forward(d=128, causal=False, block_mask=None):
        x = np.zeros((1, 2, 70, d), np.float16)
        return api._ForwardPlan((x, x, x), (causal, None, block_mask, 0.0, "flash2", None, None,
                                            None)).launch.kernel.name

    assert forward() == "wgmma_forward_d128_f16"
    monkeypatch.setattr(hopper, "FORWARD_KERNEL", "specialized")
    assert forward() == "wgmma_forward_specialized_d128_f16"
    assert forward(64, "bottom_right") == "wgmma_forward_specialized_d64_f16_causal"
    assert forward(256) == "wgmma_forward_d256_f16_warpgroups2"
    assert forward(block_mask=numba_flash.BlockMask(np.ones((2, 2), bool), (64, 64))).endswith("_sparse_whole_tiles")
    monkeypatch.setattr(hopper, "CONSUMERS", "3")
    assert forward(64) == "wgmma_forward_specialized_d64_f16_consumers3"
    monkeypatch.setattr(hopper, "QUERY_OPERAND", "registers")
    assert forward(64) == "wgmma_forward_specialized_d64_f16_consumers3_query_in_registers"
    monkeypatch.setattr(hopper, "QUERY_OPERAND", "texture")
    with pytest.raises(ValueError, match="NUMBA_FLASH_WGMMA_QUERY"):
        forward()
    monkeypatch.setattr(hopper, "QUERY_OPERAND", "shared")
    monkeypatch.setattr(hopper, "CONSUMERS", "4")
    with pytest.raises(ValueError, match="NUMBA_FLASH_WGMMA_CONSUMERS"):
        forward()
    monkeypatch.setattr(hopper, "FORWARD_KERNEL", "pingpong")
    with pytest.raises(ValueError, match="NUMBA_FLASH_WGMMA_FORWARD"):
        forward()


def test_flash2_picks_the_wgmma_backward_on_hopper_for_calls_in_its_scope(monkeypatch, hopper_lookalike):
    """Which backward ``algorithm="flash2"`` lays out on a device made to look like an H200 (nothing launched): the
    wgmma one inside its scope where flash2 takes the wgmma forward (``AUTOMATIC_SCOPE``: d = 64, 96, 128), with no
    block mask or one of whole 64 x 64 tiles (the forward's pick), summing dQ as ``dq_mode`` says: in a kernel of its
    own when the caller asks for determinism (the default) but dense at d = 128 by the bulk kernel's ordered adds, by
    its unordered adds where they measured faster when the caller allows
    (dense; causal at d = 128 over 16 or more key tiles of 128); mma.sync outside the scope, at the
    scope's other head dims, for other block masks and wherever the caller names tiles."""
    import numba_flash
    from numba_flash import api
    from numba_flash.kernels.hopper import backward as hopper_backward
    from numba_flash.kernels.hopper import forward as hopper

    device = hopper_lookalike

    def kernel(d=64, dtype=np.float16, causal=False, block_mask=None, dropout_p=0.0, block_sizes=None,
               deterministic=True, n=70):
        x = np.zeros((1, 2, n, d), dtype)
        lse = np.zeros((1, 2, n), np.float32)
        plan = api._BackwardPlan((x, x, x, x, lse, x), (causal, None, block_mask, dropout_p, "flash2", block_sizes,
                                                         deterministic, None, None))
        launches = plan.launches
        dkdv = launches.dkdv if isinstance(launches, hopper_backward.SummedDq) else launches[1]
        return dkdv.kernel.name

    assert kernel() == "wgmma_backward_dkdv_d64_f16"
    assert kernel(deterministic=False) == "wgmma_backward_dkdv_d64_f16_dq_bulk_atomic"
    assert kernel(causal=True, deterministic=False) == "wgmma_backward_dkdv_d64_f16_causal"
    assert kernel(d=128, causal="bottom_right", dtype=np.dtype("bfloat16")).startswith("wgmma")
    long_causal = dict(d=128, causal=True, deterministic=False)
    assert kernel(**long_causal, n=15 * 128) == "wgmma_backward_dkdv_d128_f16_causal"   # 15 key tiles of 128
    assert kernel(**long_causal, n=15 * 128 + 1) == "wgmma_backward_dkdv_d128_f16_causal_dq_bulk_atomic"
    assert kernel(d=128) == "wgmma_backward_dkdv_d128_f16_dq_bulk_ordered"
    assert kernel(d=128, n=132 * 128 + 1) == "wgmma_backward_dkdv_d128_f16_dq_bulk_ordered"   # (not rotated)
    assert kernel(d=128, causal=True) == "wgmma_backward_dkdv_d128_f16_causal"
    assert kernel(d=96) == "wgmma_backward_dkdv_d96_f16"
    assert kernel(d=96, deterministic=False) == "wgmma_backward_dkdv_d96_f16"   # (halves straddle K's tiles)
    assert kernel(d=96, causal=True, deterministic=False) == "wgmma_backward_dkdv_d96_f16_causal"
    whole_tiles = numba_flash.BlockMask(np.array([[True, False], [True, True]]), (64, 64))
    assert kernel(block_mask=whole_tiles, deterministic=False) == "wgmma_backward_dkdv_d64_f16_sparse_whole_tiles"
    monkeypatch.setattr(hopper_backward, "DQ_MODE", "atomic")   # NUMBA_FLASH_WGMMA_DQ=atomic
    assert kernel(deterministic=False).endswith("_dq_atomic") and kernel() == "wgmma_backward_dkdv_d64_f16"
    # The bulk modes where their two warpgroups can split dQ's columns (d <= 64, 128), else the one-warpgroup kernel
    # that sums dQ the same way.
    monkeypatch.setattr(hopper_backward, "DQ_MODE", "bulk-ordered")
    assert kernel(d=128) == "wgmma_backward_dkdv_d128_f16_dq_bulk_ordered"
    assert kernel(d=96) == "wgmma_backward_dkdv_d96_f16_dq_ordered"
    assert kernel(block_mask=whole_tiles) == "wgmma_backward_dkdv_d64_f16_dq_ordered_sparse_whole_tiles"
    monkeypatch.setattr(hopper_backward, "DQ_MODE", "bulk-atomic")
    assert kernel(deterministic=False).endswith("_dq_bulk_atomic") and kernel() == "wgmma_backward_dkdv_d64_f16"
    monkeypatch.setattr(hopper_backward, "DQ_MODE", "separate")
    # d = 32 and 80 are in the wgmma backward's scope but not in AUTOMATIC_SCOPE; d = 72 in neither.
    for outside in (kernel(d=32), kernel(d=80), kernel(d=72), kernel(dtype=np.float32), kernel(dropout_p=0.1),
                    kernel(block_sizes=(64, 64))):
        assert outside.startswith("flash2"), outside
    # Block masks as the forward's pick takes them (``forward.whole_tiles``: blocks of multiples of 64 rows and keys,
    # the element test compiled out); other blocks stay on mma.sync (they run on wgmma when asked for by name).
    whole = numba_flash.BlockMask(np.array([[True, False], [True, True]]), (64, 64))
    assert kernel(block_mask=whole) == "wgmma_backward_dkdv_d64_f16_sparse_whole_tiles"
    assert kernel(block_mask=numba_flash.BlockMask(np.ones((1, 1), bool), (128, 128))).startswith("wgmma")
    assert kernel(d=128, causal=True, block_mask=numba_flash.BlockMask(np.ones((1, 2), bool), (128, 64)),
                  deterministic=False) == "wgmma_backward_dkdv_d128_f16_causal_sparse_whole_tiles"
    for outside in (kernel(block_mask=numba_flash.BlockMask(np.ones((5, 5), bool), (16, 16))),
                    kernel(block_mask=numba_flash.BlockMask(np.ones((1, 2), bool), (128, 48))),
                    kernel(d=32, block_mask=whole), kernel(block_mask=whole, block_sizes=(64, 64))):
        assert outside.startswith("flash2"), outside
    device.compute_capability = (8, 0)
    assert kernel().startswith("flash2") and kernel(block_mask=whole).startswith("flash2")
    device.compute_capability = (9, 0)
    monkeypatch.setattr(hopper, "AUTOMATIC", False)   # NUMBA_FLASH_WGMMA=0
    assert kernel().startswith("flash2") and kernel(block_mask=whole).startswith("flash2")
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        kernel(deterministic=None)


def _four_key_tiles(d, causal, overlap, warpgroups, kernel="blocks", key_tiles=4, n_q=70, consumers=2,
                    query="shared", stages=3):
    """Four key tiles (every buffer refilled at least once; or ``key_tiles``), the diagonal crossing two of them,
    grouped heads, 70 query rows (with two warpgroups: the second's rows 64-69 and 58 rows past N_q; or ``n_q``),
    against float64."""
    import numba_flash
    import reference
    from numba_flash.kernels.hopper.common import BLOCK_N
    from tolerances import assert_close_to_reference

    rng = np.random.default_rng(11)
    n_k = (key_tiles - 1) * BLOCK_N + 17
    q = rng.standard_normal((1, 2, n_q, d)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, n_k, d)).astype(np.float16) for _ in range(2))
    if _where() == "hopper":
        import torch
        q, k, v = (torch.from_numpy(x).cuda() for x in (q, k, v))
    with wgmma_loop(overlap, warpgroups, kernel, consumers, query, stages):
        out, lse = numba_flash.attention(q, k, v, causal=causal, algorithm="wgmma", return_lse=True)
    q, k, v, out, lse = (x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x) for x in (q, k, v, out, lse))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    expanded = [reference.repeat_kv(x, 2) for x in (k64, v64)]
    ref_out, ref_lse = reference.attention(q64, *expanded, causal=causal)
    assert out.shape == q.shape
    assert_close_to_reference(out, lse, ref_out, ref_lse, q64, *expanded, 1 / np.sqrt(d), np.float16)


@pytest.mark.skipif(_where() is None, reason="the wgmma forward needs a Hopper GPU (sm_90a) or the simulator")
@pytest.mark.parametrize("causal, warpgroups", [(False, 1), ("bottom_right", 1), ("bottom_right", 2)])
def test_the_overlapped_wgmma_forward_runs_every_buffer(causal, warpgroups):
    """The overlapped loop over four key tiles (every K buffer refilled twice, every V buffer at least once, the
    last tile's ahead-steps skipped), in blocks of one warpgroup and of two."""
    _four_key_tiles(64, causal, True, warpgroups)


@pytest.mark.skipif(_where() is None, reason="the wgmma forward needs a Hopper GPU (sm_90a) or the simulator")
@pytest.mark.parametrize("causal, overlap, warpgroups", [(False, False, 1), ("bottom_right", False, 2),
                                                         (True, True, 1)])
def test_the_wgmma_forward_at_d96_reads_the_128_column_layout(causal, overlap, warpgroups):
    """d = 96 on the 128-column layout (pad columns 96..127 zero-filled by the copies): S in six k-steps, O as
    m64n96 reading V's second 64-column tile half; over four key tiles, in the ring of three buffers (the plain
    loop) and in the overlapped loop.  The property test above draws d = 96 among other head dims."""
    _four_key_tiles(96, causal, overlap, warpgroups)


@pytest.mark.skipif(_where() is None, reason="the wgmma forward needs a Hopper GPU (sm_90a) or the simulator")
@pytest.mark.parametrize("d, causal, n_q, consumers, query, stages", [(96, "bottom_right", 70, 2, "shared", 3),
                                                                      (32, True, 130, 2, "shared", 3),
                                                                      (64, True, 130, 3, "shared", 3),
                                                                      (64, True, 70, 2, "registers", 3),
                                                                      (128, "bottom_right", 130, 2, "shared", 4)])
def test_the_warp_specialised_forward_runs_every_stage_and_every_consumer(d, causal, n_q, consumers, query, stages):
    """``specialized_forward.py`` over its stages and two more key tiles (the first two stages refilled: the producer
    waits for the consumers' release; with four stages, its producer two tiles ahead), the diagonal crossing two; the
    last consumer's rows partly (n_q = 70; with three, rows 128-129 of 192) or wholly (the second block of n_q = 130)
    past N_q, still taking its turns; d = 96 on the 128-column layout; Q from registers (four k-steps of fragments).
    (Dense calls: the property test above draws them.)"""
    _four_key_tiles(d, causal, False, 1, "specialized", key_tiles=stages + 2, n_q=n_q, consumers=consumers,
                    query=query, stages=stages)


@pytest.mark.skipif(_where() is None, reason="the wgmma forward needs a Hopper GPU (sm_90a) or the simulator")
@pytest.mark.parametrize("d, overlap, kernel", [(64, False, "blocks"), (64, True, "blocks"), (96, False, "blocks"),
                                                (64, False, "specialized3"), (96, False, "specialized")])
def test_a_nan_value_row_on_the_causal_diagonal_reaches_exactly_the_rows_after_it(d, overlap, kernel):
    """A NaN in value row 40 (at d = 96 in the second 64-column tile, whose pad columns must not hide it from
    the NaN pass), inside the first key tile, which the diagonal of the first 64 query rows crosses:
    the tile is cleaned only when the barrier that lands it has found the NaN (``land_tiles``; in the warp-specialised
    kernel, the producer's pass), and rows 0-39, which may not see key 40, stay finite while rows 40-69 (the
    specialised kernel's second consumer: 64-69; "specialized3": its kernel of three consumers) become NaN.  Without
    the NaN pass, or with the question answered wrong, the tensor cores' 0 * NaN would reach rows 0-39 too."""
    import numba_flash

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 1, 70, d)).astype(np.float16) for _ in range(3))
    v[0, 0, 40, 17 if d == 64 else 80] = np.nan   # d = 96: column 80, in the second 64-column tile
    if _where() == "hopper":
        import torch
        q, k, v = (torch.from_numpy(x).cuda() for x in (q, k, v))
    with wgmma_loop(overlap, 1, kernel.rstrip("3"), 3 if kernel.endswith("3") else 2):
        out = numba_flash.attention(q, k, v, causal=True, algorithm="wgmma")
    out = out.cpu().numpy() if hasattr(out, "cpu") else np.asarray(out)
    nan_rows = np.isnan(out.astype(np.float32)).any(-1)[0, 0]
    assert np.flatnonzero(nan_rows).tolist() == list(range(40, 70))


@pytest.mark.skipif(_where() is None, reason="the wgmma forward needs a Hopper GPU (sm_90a) or the simulator")
@pytest.mark.parametrize("d, causal, overlap, warpgroups, blocks", [
    (64, False, False, 1, (64, 64)),              # whole tiles, two stages
    (128, "bottom_right", False, 1, (16, 32)),    # partly covered tiles, the ring
    (96, "bottom_right", True, 1, (64, 64)),      # the overlapped loop
    (64, False, True, 2, (16, 32)),               # overlapped, 128-row query tiles
    (128, False, False, 2, (64, 64)),             # the ring, 128-row tiles partly covered by 64-row blocks
])
def test_the_wgmma_forward_visits_a_block_masks_tiles_through_every_buffer(d, causal, overlap, warpgroups, blocks):
    """A block mask whose first 64 query rows visit key tiles 0, 2, 3 and 5 of six (64 x 64 blocks; a list with
    gaps, long enough to take every buffer round, the diagonal crossing some under causal) and whose rows 64-69
    see none (O = 0, lse = -inf); or a random one of 16 x 32 blocks with an empty row of blocks.  A NaN in value
    row 150 reaches exactly the rows the mask (and causality) let see key 150.  Against float64, in blocks of one
    warpgroup or two (whose 128-row tiles the 64-row blocks then cover partly)."""
    import numba_flash
    import reference
    from numba_flash.kernels.hopper.common import BLOCK_N
    from tolerances import assert_close_to_reference

    rng = np.random.default_rng(13)
    n_q, n_k, nan_key = 70, 5 * BLOCK_N + 17, 150
    grid = (-(-n_q // blocks[0]), -(-n_k // blocks[1]))
    if blocks == (64, 64):
        layout = np.zeros(grid, bool)
        layout[0, [0, 2, 3, 5]] = True
    else:
        layout = rng.random(grid) < 0.6
        layout[1] = False
    bm = numba_flash.BlockMask(layout, blocks)
    q = rng.standard_normal((1, 2, n_q, d)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, n_k, d)).astype(np.float16) for _ in range(2))
    v[0, 0, nan_key, 5] = np.nan
    inputs = (q, k, v)
    if _where() == "hopper":
        import torch
        inputs = tuple(torch.from_numpy(x).cuda() for x in inputs)
    with wgmma_loop(overlap, warpgroups):
        out, lse = numba_flash.attention(*inputs, causal=causal, block_mask=bm, algorithm="wgmma", return_lse=True)
    out, lse = (x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x) for x in (out, lse))
    allowed = bm.to_dense(n_q, n_k) & (True if not causal else causal_mask(causal, n_q, n_k))
    nan_rows = np.isnan(out.astype(np.float32)).any(-1)
    assert nan_rows.any() and np.array_equal(nan_rows, np.broadcast_to(allowed[:, nan_key], nan_rows.shape))
    q64, k64, v64 = (without_nan(x).astype(np.float64) for x in (q, k, v))
    expanded = [reference.repeat_kv(x, 2) for x in (k64, v64)]
    ref_out, ref_lse = reference.attention(q64, *expanded, causal=causal, mask=bm.to_dense(n_q, n_k))
    keep = ~nan_rows[..., None]
    assert_close_to_reference(np.where(keep, out, 0), lse, np.where(keep, ref_out, 0), ref_lse, q64, *expanded,
                              1 / np.sqrt(d), np.float16)
    unseen = ~allowed.any(-1)
    assert unseen.any() and np.all(out[:, :, unseen] == 0) and np.all(np.isneginf(lse[:, :, unseen]))


@pytest.mark.skipif(_where() is None, reason="the wgmma backward needs a Hopper GPU (sm_90a) or the simulator")
@settings(max_examples=max(3, settings.default.max_examples // 4))   # each example: three kernels, run twice
@given(data=st.data())
def test_the_wgmma_backward_matches_the_float64_reference(data):
    """dQ, dK and dV of ``attention_backward(..., algorithm="wgmma")`` against float64: random shapes (ragged,
    several tiles each way, a key tile no query sees under bottom-right causal), every head dim of its scope (on
    the 64- and the 128-column layout), grouped heads (dK and dV summed over each group), both causal alignments,
    (B, N, H, d) strides, each way of summing dQ (``DQ_MODES``); and where deterministic, bitwise equal run to
    run."""
    import ml_dtypes

    from numba_flash.kernels.hopper.dq_sums import DQ_MODES
    from numba_flash.kernels.hopper.common import BLOCK_N, HEAD_DIMS

    where = _where()
    longest = 200 if where == "hopper" else 2 * BLOCK_N + 5   # the simulator: up to three tiles each way
    batch = data.draw(st.integers(1, 2))
    kv_heads = data.draw(st.integers(1, 2 if where == "hopper" else 1))
    group = data.draw(st.sampled_from([1, 2, 3]))
    heads = kv_heads * group
    n_q, n_k = data.draw(st.integers(1, longest)), data.draw(st.integers(1, longest))
    # d = 96 first: Hypothesis's first example, its simplest, then draws it (the 128-column layout half used).
    d = data.draw(st.sampled_from(sorted(HEAD_DIMS, key=lambda x: x != 96)))
    dtype = data.draw(st.sampled_from([np.float16, ml_dtypes.bfloat16]))
    causal = data.draw(st.sampled_from([False, True, "bottom_right"]))
    token_major = data.draw(st.booleans())
    dq_mode = data.draw(st.sampled_from(DQ_MODES))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))

    def operand(h, n):
        if token_major:
            return rng.standard_normal((batch, n, h, d)).astype(dtype).transpose(0, 2, 1, 3)
        return rng.standard_normal((batch, h, n, d)).astype(dtype)

    q, k, v, do = operand(heads, n_q), operand(kv_heads, n_k), operand(kv_heads, n_k), operand(heads, n_q)
    _check_wgmma_backward(q, k, v, do, causal, dq_mode, token_major)


@pytest.mark.skipif(_where() is None, reason="the wgmma backward needs a Hopper GPU (sm_90a) or the simulator")
@pytest.mark.parametrize("dq_mode, causal", [
    ("separate", False), ("ordered", "bottom_right"), ("atomic", True)])
def test_the_wgmma_backward_at_d96_reads_the_128_column_layout(dq_mode, causal):
    """d = 96 on the 128-column layout (pad columns 96..127 zero-filled by the copies), in each way of summing dQ:
    S^T and dP^T in six k-steps, dV, dK (and the dQ kernel's dQ) as m64n96, the dK/dV kernel's dQ as one 96-column
    slice (``dq_slice_columns``) and its convert kernel with 96 of its 128 threads; three key tiles, two query
    tiles, grouped heads.  The property test above draws d = 96 among the other head dims."""
    from numba_flash.kernels.hopper.common import BLOCK_N

    rng = np.random.default_rng(7)
    n_q, n_k = BLOCK_N + 6, 2 * BLOCK_N + 2
    q, do = (rng.standard_normal((1, 2, n_q, 96)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, n_k, 96)).astype(np.float16) for _ in range(2))
    _check_wgmma_backward(q, k, v, do, causal, dq_mode, False)


def _hand_over_kernel():
    """A producer warp fills a one-word-a-lane buffer ``ROUNDS`` times; the two consumer warps (lanes 0 .. 31 each)
    sum what they read in each round.  The hand-overs go through mbarriers (FULL: the producer's 32 arrivals; EMPTY:
    one arrival a consumer warp) when ``mbarriers``, else through named barriers (1: buffer full, 2: buffer empty,
    96 threads: the producer arrives, the consumers sync, and back)."""
    from numba_flash.kernels.fast.primitives import sync_warp
    from numba_flash.kernels.hopper.bulk import barrier_arrive, barrier_init, barrier_wait, fence_barrier_init
    from numba_flash.kernels.hopper.roles import named_arrive, named_sync

    @cuda.jit
    def hand_over(sums, rounds, mbarriers):
        smem = cuda.shared.array(0, uint32)   # words 0-1: FULL, 2-3: EMPTY, 8 ..: the buffer
        tid = cuda.threadIdx.x
        if tid == 0:
            barrier_init(smem, 0, 32)
            barrier_init(smem, 2, 2)
            fence_barrier_init()
        cuda.syncthreads()
        if tid < 32:
            for r in range(rounds):
                if mbarriers:
                    barrier_wait(smem, 2, (r & 1) ^ 1)
                elif r > 0:
                    named_sync(2, 96)
                smem[8 + tid] = uint32(100 * r + tid)
                if mbarriers:
                    barrier_arrive(smem, 0, 1)
                else:
                    named_arrive(1, 96)
        else:
            total = uint32(0)
            for r in range(rounds):
                if mbarriers:
                    barrier_wait(smem, 0, r & 1)
                else:
                    named_sync(1, 96)
                total += smem[8 + tid % 32]
                sync_warp()
                if mbarriers:
                    if tid % 32 == 0:
                        barrier_arrive(smem, 2, 1)
                elif r + 1 < rounds:
                    named_arrive(2, 96)
            sums[tid - 32] = total

    return hand_over


@pytest.mark.skipif(_where() is None, reason="mbarrier arrivals with a count need sm_90 (or the simulator)")
@pytest.mark.parametrize("mbarriers", [True, False], ids=["mbarriers", "named_barriers"])
def test_a_producer_warp_hands_buffers_to_consumer_warps(mbarriers):
    """The hand-overs of a block whose warps have roles (``kernels/hopper/specialized_dkdv.py``): every consumer
    lane reads each round's value exactly once, after it was written and before it is overwritten, through either
    kind of barrier.  A wait that did not wait (as the simulator's mbarrier twin did before it counted arrivals)
    reads a round twice or misses one."""
    rounds = 6
    kernel = _hand_over_kernel()
    if _where() == "hopper":
        import torch
        sums = torch.zeros(64, dtype=torch.int32, device="cuda")
        kernel[1, 96, 0, 256](sums, rounds, mbarriers)
        sums = sums.cpu().numpy()
    else:
        sums = np.zeros(64, np.uint32)
        kernel[1, 96, 0, 256](sums, rounds, mbarriers)
    lanes = np.arange(64) % 32
    np.testing.assert_array_equal(sums, sum(100 * r + lanes for r in range(rounds)))


@pytest.mark.skipif(_where() is None, reason="the wgmma backward needs a Hopper GPU (sm_90a) or the simulator")
@pytest.mark.parametrize("dq_mode, d, causal, n_q, n_k, group", [
    ("bulk-ordered", 64, True, 70, 150, 2), ("bulk-atomic", 128, "bottom_right", 70, 200, 1),
    pytest.param("bulk-ordered", 128, False, 200, 300, 3, marks=pytest.mark.gpu_only),
    pytest.param("bulk-ordered", 32, "bottom_right", 257, 129, 1, marks=pytest.mark.gpu_only),
    pytest.param("bulk-atomic", 64, False, 1, 250, 2, marks=pytest.mark.gpu_only),
    pytest.param("bulk-ordered", 64, False, 1000, 1000, 2, marks=pytest.mark.gpu_only)])   # rotated by 2
def test_the_bulk_modes_split_each_dq_tile_between_two_warpgroups(dq_mode, d, causal, n_q, n_k, group):
    """The bulk modes' dK/dV kernel (``specialized_dkdv.py``: a producer warpgroup, two writer warps, two consumer
    warpgroups on 128 keys, handing tiles and dQ's halves over through mbarriers and named barriers, which the
    simulator counts as the GPU does), each consumer's half of dQ_i's columns added from shared memory by a bulk
    reduction (in turn, or as they arrive), its float32 sum read back in register order; key
    blocks whose second warpgroup has a few keys (n_k = 200) or none (n_k = 150, 129), several query tiles, grouped
    heads, both causal alignments.  The property test above draws these modes too (and the head dims they
    leave to the one-warpgroup kernel)."""
    rng = np.random.default_rng(11)
    q, do = (rng.standard_normal((1, group, n_q, d)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, n_k, d)).astype(np.float16) for _ in range(2))
    _check_wgmma_backward(q, k, v, do, causal, dq_mode, False)


@given(q_tiles=st.integers(1, 300), k_tiles=st.integers(1, 150), group=st.integers(1, 3), rotates=st.booleans())
def test_the_dense_bulk_ordered_turns_follow_the_order_in_which_the_key_tiles_reach_each_query_tile(
        q_tiles, k_tiles, group, rotates):
    """The schedule of ``specialized_dkdv.py``'s dense ordered adds, as its roles walk it (``next_step`` from
    ``rotated_start``): every key tile visits each (head, query tile) of its group once; at each query tile the turns
    are a permutation of the key tiles, in the order of the steps at which they get there, so that no turn waits for
    a block that reaches the tile later (a wait in a cycle would hang the GPU); and rotated, each key tile gets there
    ``rotation`` steps after the one whose turn comes before it, but for the first key tile's wait on the last."""
    from numba_flash.kernels.hopper.dq_sums import rotated_start, rotated_turn, rotation_stride
    from numba_flash.kernels.hopper.specialized_dkdv import next_step

    rotation = rotation_stride.py_func(q_tiles, k_tiles) * rotates
    assert rotation * (k_tiles - 1) < q_tiles
    reached = np.zeros((k_tiles, group, q_tiles), int)   # the step at which each key tile gets to each tile
    for tile in range(k_tiles):
        start = rotated_start.py_func(tile, rotation, 0, q_tiles)
        h, q_tile = 0, start
        for step in range(group * q_tiles):
            reached[tile, h, q_tile] = step
            h, q_tile = next_step.py_func(h, q_tile, 0, start, q_tiles)
        assert (h, q_tile) == (group, start)
        assert sorted(reached[tile].ravel()) == list(range(group * q_tiles))   # each once
    for m in range(q_tiles):
        turns = [rotated_turn.py_func(m, tile, rotation, k_tiles, q_tiles) for tile in range(k_tiles)]
        order = sorted(range(k_tiles), key=lambda tile: (reached[tile, 0, m], tile))
        assert [turns[tile] for tile in order] == list(range(k_tiles))
        if rotation:
            gaps = [reached[order[i], 0, m] - reached[order[i - 1], 0, m] for i in range(1, k_tiles)]
            assert all(gap >= 1 for gap in gaps) and sum(gap != rotation for gap in gaps) <= 1


@pytest.mark.skipif(_where() is None, reason="the wgmma backward needs a Hopper GPU (sm_90a) or the simulator")
@settings(max_examples=max(3, settings.default.max_examples // 4))   # each example: three kernels, run twice
@given(data=st.data())
def test_the_wgmma_backward_with_a_block_mask_matches_the_float64_reference(data):
    """dQ, dK and dV under random block masks (``strategies.block_masks``: random density, all zero or all one,
    empty rows or columns of blocks; leading dims broadcast over batch and heads) of blocks of 16 or of multiples
    of 64 each way (whole 64 x 64 tiles: the element test compiled out, as flash2 takes them; else partly covered
    tiles, tested element by element), against float64: ragged lengths, grouped heads, both causal alignments,
    (B, N, H, d) strides, each way of summing dQ (the ordered one's turns counted over each query tile's own list
    of key tiles: a wrong count waits forever); rows that see no key, and keys no query sees, get exactly 0; and
    where deterministic, bitwise equal run to run."""
    import ml_dtypes

    from numba_flash.kernels.hopper.dq_sums import DQ_MODES
    from numba_flash.kernels.hopper.common import BLOCK_N, HEAD_DIMS
    from strategies import block_masks

    where = _where()
    longest = 200 if where == "hopper" else 2 * BLOCK_N + 5   # the simulator: up to three tiles each way
    batch = data.draw(st.integers(1, 2))
    kv_heads = data.draw(st.integers(1, 2 if where == "hopper" else 1))
    group = data.draw(st.sampled_from([1, 2, 3]))
    heads = kv_heads * group
    n_q, n_k = data.draw(st.integers(1, longest)), data.draw(st.integers(1, longest))
    block_size = tuple(data.draw(st.sampled_from([16, 64, 128])) for _ in range(2))
    bm = data.draw(block_masks(n_q, n_k, block_size, batch_shape=(batch, heads)))[0]
    # The simulator: head dims of both layouts, the small ones (its time grows with d).
    d = data.draw(st.sampled_from(HEAD_DIMS if where == "hopper" else (16, 32, 64, 80)))
    dtype = data.draw(st.sampled_from([np.float16, ml_dtypes.bfloat16]))
    causal = data.draw(st.sampled_from([False, True, "bottom_right"]))
    token_major = data.draw(st.booleans())
    dq_mode = data.draw(st.sampled_from(DQ_MODES))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))

    def operand(h, n):
        if token_major:
            return rng.standard_normal((batch, n, h, d)).astype(dtype).transpose(0, 2, 1, 3)
        return rng.standard_normal((batch, h, n, d)).astype(dtype)

    q, k, v, do = operand(heads, n_q), operand(kv_heads, n_k), operand(kv_heads, n_k), operand(heads, n_q)
    _check_wgmma_backward(q, k, v, do, causal, dq_mode, token_major, bm)


@pytest.mark.skipif(_where() is None, reason="the wgmma backward needs a Hopper GPU (sm_90a) or the simulator")
@pytest.mark.parametrize("dq_mode, causal", [
    ("ordered", False), ("ordered", "bottom_right"), ("separate", True), ("atomic", False)])
def test_the_wgmma_backward_visits_a_block_masks_tiles_in_every_mode(dq_mode, causal):
    """A block mask of 16 x 16 blocks over four query tiles and four key tiles (ragged lengths), two query heads
    per key/value head (each key tile's steps walk both heads' lists): query tile 0 sees key tiles 0, 2 and 3 (a
    list with a gap: the ordered dQ's turns count over the tiles listed, and a wrong count waits forever), tile 1
    none (dQ = 0), tile 2 random blocks (tiles partly covered: the element test), tile 3 every key tile but, in
    head 0, the ragged last one (3); no query sees key tile 1 (dK = dV = 0, nothing copied).  Against float64;
    deterministic modes bitwise equal run to run."""
    import numba_flash
    from numba_flash.kernels.hopper.common import BLOCK_N

    rng = np.random.default_rng(17)
    n_q, n_k, d = 3 * BLOCK_N + 9, 3 * BLOCK_N + 30, 32
    layout = np.zeros((2, 13, 14), bool)   # per query head, blocks of 16 x 16

    def tile(x):   # the blocks of 64-row (or 64-key) tile x
        return slice(4 * x, 4 * x + 4)

    for key_tile in (0, 2, 3):
        layout[:, tile(0), tile(key_tile)] = True
    layout[:, tile(2), :] = rng.random((2, 4, 14)) < 0.5
    layout[:, tile(3), :] = True
    layout[0, tile(3), tile(3)] = False
    layout[:, :, tile(1)] = False
    bm = numba_flash.BlockMask(layout, (16, 16))
    q, do = (rng.standard_normal((1, 2, n_q, d)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, n_k, d)).astype(np.float16) for _ in range(2))
    _check_wgmma_backward(q, k, v, do, causal, dq_mode, False, bm)


def _check_wgmma_backward(q, k, v, do, causal, dq_mode, token_major, block_mask=None):
    """The wgmma backward of (q, k, v, do) (host arrays; on a Hopper GPU as tensors of the same strides) with dQ
    summed in ``dq_mode``, against float64 within ``backward_tolerance``; a deterministic mode run twice, bitwise
    equal.  With a ``block_mask``, the rows of dQ whose query sees no key and the rows of dK, dV whose key no
    query sees (of any head of its group) are exactly 0."""
    import numba_flash
    import reference
    from tolerances import backward_tolerance

    where, dtype, heads, d = _where(), q.dtype, q.shape[1], q.shape[3]
    group = heads // k.shape[1]
    n_q, n_k = q.shape[2], k.shape[2]
    dense = None if block_mask is None else np.broadcast_to(block_mask.to_dense(n_q, n_k), q.shape[:2] + (n_q, n_k))
    out, lse = reference.attention(q, k, v, causal=causal, mask=dense)
    out, lse = out.astype(dtype), lse.astype(np.float32)
    arguments = (q, k, v, out, lse, do)

    def gradients():
        with wgmma_dq(dq_mode) as deterministic:
            if where == "hopper":
                on_gpu = [to_gpu(q, token_major), to_gpu(k, token_major), to_gpu(v, token_major), to_gpu(out),
                          to_gpu(lse), to_gpu(do, token_major)]
                return tuple(to_host(x) for x in numba_flash.attention_backward(*on_gpu, causal=causal,
                                                                                block_mask=block_mask,
                                                                                algorithm="wgmma",
                                                                                deterministic=deterministic))
            return numba_flash.attention_backward(*arguments, causal=causal, block_mask=block_mask,
                                                  algorithm="wgmma", deterministic=deterministic)

    grads = gradients()
    expected = reference.attention_backward(q, k, v, do, causal=causal, mask=dense)
    weights = reference.softmax(reference.masked_scores(q, k, causal=causal, mask=dense))
    tolerances = backward_tolerance(q, reference.repeat_kv(k, heads), reference.repeat_kv(v, heads), out, do,
                                    1 / np.sqrt(d), weights, dtype=dtype, group=group)
    for name, got, want, tol in zip(("dq", "dk", "dv"), grads, expected, tolerances):
        assert got.shape == want.shape and got.dtype == dtype, (name, got.shape, got.dtype)
        err = float(np.abs(got.astype(np.float64) - want).max())
        assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g}"
    if block_mask is not None:
        allowed = reference.allowed_mask(n_q, n_k, causal=causal, mask=dense)   # (B, H, N_q, N_k)
        unseen_rows = ~allowed.any(-1)
        unseen_keys = ~allowed.reshape(q.shape[0], heads // group, group, n_q, n_k).any(axis=(2, 3))
        assert np.all(np.asarray(grads[0], np.float64)[unseen_rows] == 0), "dq: a row that sees no key"
        for name, got in zip(("dk", "dv"), grads[1:]):
            assert np.all(np.asarray(got, np.float64)[unseen_keys] == 0), f"{name}: a key no query sees"
    # Bitwise repeatable run to run: a GPU's property (blocks in any order).  The simulator runs blocks in one order,
    # so there the second run can only catch state a call leaves behind: the summing modes' turns and float32 sum.
    from numba_flash.kernels.hopper.dq_sums import UNORDERED_MODES
    if dq_mode not in UNORDERED_MODES and (where == "hopper" or dq_mode != "separate"):
        for got, again in zip(grads, gradients()):
            assert np.array_equal(got.view(np.uint16), again.view(np.uint16))


def test_the_dkdv_kernel_asks_for_three_blocks_a_multiprocessor_only_where_it_measured_faster():
    """The register cap (``dkdv_blocks_per_multiprocessor``): d <= 64, dQ in its own pass, no mods, no element test,
    no packed sequences; everything else keeps launch bounds of one block (no cap)."""
    from numba_flash.kernels.hopper.backward import WARPGROUP, make_wgmma_dkdv

    assert make_wgmma_dkdv(64, "f16", True).launch_bounds == (WARPGROUP, 3)
    assert make_wgmma_dkdv(32, "bf16", False, "separate", True, False).launch_bounds == (WARPGROUP, 3)
    for args in ((128, "f16", True), (96, "bf16", False), (64, "f16", True, "atomic"),
                 (64, "f16", False, "separate", True, True), (64, "f16", True, "separate", False, True, True)):
        assert make_wgmma_dkdv(*args).launch_bounds == (WARPGROUP, 1), args


def test_the_wgmma_backward_rejects_what_it_cannot_run():
    from numba_flash import attention_backward

    def arrays(d=64, dtype=np.float16):
        x = np.zeros((1, 1, 8, d), dtype)
        return x, x, x, x, np.zeros((1, 1, 8), np.float32), x

    # Not a multiple of 16; wider than the 128-column layout (160, 256: the forward's, not the backward's, whose dK and
    # dV accumulators would not fit in a warpgroup's registers).
    for d in (72, 160, 256):
        with pytest.raises(ValueError, match="algorithm='wgmma': the head dim must be one of .* for the wgmma "
                                             f"backward, not {d}"):
            attention_backward(*arrays(d=d), algorithm="wgmma")
    with pytest.raises(ValueError, match="algorithm='wgmma': q, k, v must be float16 or bfloat16 for the wgmma "
                                         "backward"):
        attention_backward(*arrays(dtype=np.float32), algorithm="wgmma")
    with pytest.raises(ValueError, match="block_sizes must be None with algorithm='wgmma'"):
        attention_backward(*arrays(), block_sizes=(64, 64), algorithm="wgmma")
    with pytest.raises(ValueError, match="the wgmma backward has no dropout yet"):
        attention_backward(*arrays(), dropout_p=0.1, seed=1, algorithm="wgmma")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        attention_backward(*arrays(), algorithm="standard")


@pytest.mark.skipif(_where() is None, reason="the wgmma forward needs a Hopper GPU (sm_90a) or the simulator")
@pytest.mark.parametrize("setting, value", [("consumers", 4), ("query", "texture"), ("stages", 5)])
def test_a_bad_setting_of_the_warp_specialised_forward_is_refused_by_name_before_any_launch(setting, value):
    """``NUMBA_FLASH_WGMMA_CONSUMERS``, ``_QUERY`` and ``_STAGES`` outside their choices: a ValueError naming the
    variable (``common.environment_choice``), raised while the call is planned."""
    import numba_flash

    q = np.zeros((1, 1, 8, 64), np.float16)
    if _where() == "hopper":
        import torch
        q = torch.from_numpy(q).cuda()
    options = dict(kernel="specialized", **{setting: value})
    with wgmma_loop(**options), pytest.raises(ValueError, match=f"NUMBA_FLASH_WGMMA_{setting.upper()} must be one of"):
        numba_flash.attention(q, q, q, algorithm="wgmma")
