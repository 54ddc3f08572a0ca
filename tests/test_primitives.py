"""The warp-level primitives behind the fast kernels, against NumPy.

In the simulator these check the Python twins; on the GPU, the inline-PTX
intrinsics.  Both must agree with the PTX ISA's fragment layouts, which the
kernels below spell out independently of ``primitives.py``.
"""
import numpy as np
import pytest
from numba import cuda

from numba_flash.kernels.fast.primitives import (
    bf16_to_f32, copy_async16, copy_async_wait_all, exp2, f32_as_u32, half_to_f32, ldmatrix_x2, ldmatrix_x2_trans,
    ldmatrix_x4, mma_bf16, mma_f16, mma_tf32, pack_bf16x2, pack_half2, shfl_xor, tf32_round, u32_as_f32,
)
from strategies import BFLOAT16
from tolerances import EX2_APPROX_ATOL, EX2_APPROX_RTOL, SPLIT_TF32_EXTRA, product_tolerance


def _tf32(x):
    """NumPy model of tf32_round (cvt.rna.tf32.f32): finite values to nearest, ties away from zero;
    infinities and NaN unrounded; the low 13 bits cleared."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    finite = (bits & 0x7F800000) != 0x7F800000
    return (np.where(finite, bits + 0x1000, bits) & 0xFFFFE000).astype(np.uint32).view(np.float32)


@cuda.jit
def _mma_tf32_kernel(a, b, c, d, split):
    lane = cuda.threadIdx.x
    g, t = lane >> 2, lane & 3
    a_vals = (a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4])
    b_vals = (b[t, g], b[t + 4, g])
    acc = (c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
    a_big = (tf32_round(a_vals[0]), tf32_round(a_vals[1]), tf32_round(a_vals[2]), tf32_round(a_vals[3]))
    b_big = (tf32_round(b_vals[0]), tf32_round(b_vals[1]))
    if split:
        # 3xTF32: A B ~ A_big B_big + A_big B_small + A_small B_big
        a_small = (tf32_round(a_vals[0] - u32_as_f32(a_big[0])), tf32_round(a_vals[1] - u32_as_f32(a_big[1])),
                   tf32_round(a_vals[2] - u32_as_f32(a_big[2])), tf32_round(a_vals[3] - u32_as_f32(a_big[3])))
        b_small = (tf32_round(b_vals[0] - u32_as_f32(b_big[0])), tf32_round(b_vals[1] - u32_as_f32(b_big[1])))
        acc = mma_tf32(a_small[0], a_small[1], a_small[2], a_small[3], b_big[0], b_big[1],
                       acc[0], acc[1], acc[2], acc[3])
        acc = mma_tf32(a_big[0], a_big[1], a_big[2], a_big[3], b_small[0], b_small[1],
                       acc[0], acc[1], acc[2], acc[3])
    acc = mma_tf32(a_big[0], a_big[1], a_big[2], a_big[3], b_big[0], b_big[1],
                   acc[0], acc[1], acc[2], acc[3])
    d[g, 2 * t], d[g, 2 * t + 1] = acc[0], acc[1]
    d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = acc[2], acc[3]


@pytest.mark.parametrize("split", [False, True], ids=["1xtf32", "3xtf32"])
def test_mma_tf32_matches_fragment_layout(split):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, np.float32)
    _mma_tf32_kernel[1, 32](a, b, c, d, split)
    exact = a.astype(np.float64) @ b.astype(np.float64) + c
    if split:
        # Dropping A_small B_small and rounding the small parts: float32-class accuracy.
        assert np.all(np.abs(d - exact) <= product_tolerance(a, b, c, extra=SPLIT_TF32_EXTRA))
    else:
        # One tf32 product is as good as its rounded operands: compare with
        # the exact product of those, and show it is far from float32 accuracy.
        rounded_a, rounded_b = _tf32(a), _tf32(b)
        rounded = rounded_a.astype(np.float64) @ rounded_b.astype(np.float64) + c
        assert np.all(np.abs(d - rounded) <= product_tolerance(rounded_a, rounded_b, c))
        assert np.any(np.abs(d - exact) > product_tolerance(a, b, c, extra=SPLIT_TF32_EXTRA))


def _mma_16bit_kernel(mma, pack):
    @cuda.jit
    def kernel(a, b, c, d):
        lane = cuda.threadIdx.x
        g, t = lane >> 2, lane & 3
        a0 = pack(a[g, 2 * t], a[g, 2 * t + 1])
        a1 = pack(a[g + 8, 2 * t], a[g + 8, 2 * t + 1])
        a2 = pack(a[g, 2 * t + 8], a[g, 2 * t + 9])
        a3 = pack(a[g + 8, 2 * t + 8], a[g + 8, 2 * t + 9])
        b0 = pack(b[2 * t, g], b[2 * t + 1, g])
        b1 = pack(b[2 * t + 8, g], b[2 * t + 9, g])
        acc = mma(a0, a1, a2, a3, b0, b1, c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
        d[g, 2 * t], d[g, 2 * t + 1] = acc[0], acc[1]
        d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = acc[2], acc[3]

    return kernel


@pytest.mark.parametrize("dtype, mma, pack", [(np.float16, mma_f16, pack_half2), (BFLOAT16, mma_bf16, pack_bf16x2)],
                         ids=["float16", "bfloat16"])
def test_mma_16bit_matches_fragment_layout(dtype, mma, pack):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((16, 16)).astype(dtype).astype(np.float32)
    b = rng.standard_normal((16, 8)).astype(dtype).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, np.float32)
    _mma_16bit_kernel(mma, pack)[1, 32](a, b, c, d)
    # Inputs are exact in their type, so only float32 accumulation error remains.
    assert np.all(np.abs(d - (a.astype(np.float64) @ b + c)) <= product_tolerance(a, b, c))


@cuda.jit
def _shfl_kernel(x, out):
    lane = cuda.threadIdx.x % 32
    warp = cuda.threadIdx.x // 32
    for k in range(5):
        out[k, warp * 32 + lane] = shfl_xor(x[warp * 32 + lane], 1 << k)


def test_shfl_xor_swaps_lanes_within_each_warp():
    x = np.arange(64, dtype=np.float32) * 1.5
    out = np.zeros((5, 64), np.float32)
    _shfl_kernel[1, 64](x, out)
    lanes = np.arange(64)
    for k in range(5):
        np.testing.assert_array_equal(out[k], x[(lanes & ~31) | ((lanes & 31) ^ (1 << k))])


@cuda.jit
def _bits_kernel(x, bits, back, halves, bf16s):
    i = cuda.grid(1)
    if i < x.size:
        bits[i] = f32_as_u32(x[i])
        back[i] = u32_as_f32(bits[i])
        pair = pack_half2(x[i], -x[i])
        halves[i, 0] = half_to_f32(pair)
        halves[i, 1] = half_to_f32(pair >> 16)
        pair = pack_bf16x2(x[i], -x[i])
        bf16s[i, 0] = bf16_to_f32(pair)
        bf16s[i, 1] = bf16_to_f32(pair >> 16)


def test_bit_casts_and_16bit_packing():
    x = np.array([0.0, -0.0, 1.0, -2.5, 3.1415927, 1e-30, 65504.0, 7e4, 1.00390625, 1.01171875, np.inf, np.nan],
                 np.float32)
    bits = np.zeros(x.size, np.uint32)
    back = np.zeros_like(x)
    halves = np.zeros((x.size, 2), np.float32)
    bf16s = np.zeros((x.size, 2), np.float32)
    _bits_kernel[1, 32](x, bits, back, halves, bf16s)
    np.testing.assert_array_equal(bits, x.view(np.uint32))
    np.testing.assert_array_equal(back.view(np.uint32), x.view(np.uint32))
    with np.errstate(over="ignore", invalid="ignore"):
        # Rounded to nearest (even on ties: 1.00390625 and 1.01171875 are bfloat16 ties), as NumPy's casts.
        np.testing.assert_array_equal(halves[:, 0], x.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(halves[:, 1], (-x).astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(bf16s[:, 0], x.astype(BFLOAT16).astype(np.float32))
        np.testing.assert_array_equal(bf16s[:, 1], (-x).astype(BFLOAT16).astype(np.float32))


@cuda.jit
def _exp2_kernel(x, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = exp2(x[i])


def test_exp2_keeps_nan_and_infinities():
    # The kernels mask with -inf and must let NaN through (no fast-math assumptions).
    x = np.array([0.0, 1.0, -1.5, 10.0, -np.inf, np.inf, np.nan, -200.0], np.float32)
    out = np.full(x.size, -1.0, np.float32)
    _exp2_kernel[1, 32](x, out)
    with np.errstate(over="ignore"):
        expected = np.exp2(x.astype(np.float64))
    finite = np.isfinite(expected)
    # ex2.approx: 2 ulp (2^-22 relative); subnormal results flush to 0 (ftz).
    assert np.all(np.abs(out[finite] - expected[finite]) <= EX2_APPROX_RTOL * expected[finite] + EX2_APPROX_ATOL)
    assert out[4] == 0 and out[5] == np.inf and np.isnan(out[6])


@cuda.jit
def _round_kernel(x, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = tf32_round(x[i])


#: Non-finite bit patterns: the GPU's canonical NaN (what arithmetic on a NaN returns; a rounding
#: add once carried it into the sign bit, giving -0), a negative NaN, numpy's NaN, the infinities.
NON_FINITE_BITS = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800000, 0xFF800000]


def test_tf32_round_is_nearest_ties_away_and_keeps_non_finite_values():
    rng = np.random.default_rng(3)
    finite = np.concatenate([rng.standard_normal(200).astype(np.float32),
                             # exact ties: the dropped bits are 0x1000
                             (np.array([1.0, -3.0], np.float32).view(np.uint32) | 0x1000).view(np.float32),
                             # the largest float32 rounds up to infinity, as cvt.rna does
                             np.array([np.finfo(np.float32).max], np.float32)])
    x = np.concatenate([finite, np.array(NON_FINITE_BITS, np.uint32).view(np.float32)])
    out = np.zeros(x.size, np.uint32)
    _round_kernel[1, 256](x, out)
    np.testing.assert_array_equal(out.view(np.uint32), _tf32(x).view(np.uint32))
    rounded = out.view(np.float32)
    ordinary = np.abs(finite) < np.finfo(np.float32).max
    assert np.all(np.abs(rounded[:finite.size][ordinary] - finite[ordinary]) <= np.abs(finite[ordinary]) * 2.0 ** -11)
    assert np.isinf(rounded[finite.size - 1])
    tail = rounded[finite.size:]
    assert np.isnan(tail[:3]).all() and list(tail[3:]) == [np.inf, -np.inf]


ROW_WORDS = 4      # an ldmatrix row: 8 16-bit elements
WORDS = 1024       # the shared tile the test reads from


@cuda.jit
def _ldmatrix_kernel(words, row_starts, out, variant):
    # Two warps, each lane naming where "its" row starts (any 16-byte aligned word): out[lane, j] is register j.
    tile = cuda.shared.array(WORDS, dtype=np.uint32)
    for i in range(cuda.threadIdx.x, WORDS, cuda.blockDim.x):
        tile[i] = words[i]
    cuda.syncthreads()
    lane = cuda.threadIdx.x
    # The address in two parts (index + offset), as the kernels give it.
    if variant == 4:
        r0, r1, r2, r3 = ldmatrix_x4(tile, row_starts[lane] - 4 * variant, 4 * variant)
        out[lane, 0], out[lane, 1], out[lane, 2], out[lane, 3] = r0, r1, r2, r3
    elif variant == 2:
        r0, r1 = ldmatrix_x2(tile, row_starts[lane] - 4 * variant, 4 * variant)
        out[lane, 0], out[lane, 1] = r0, r1
    else:
        r0, r1 = ldmatrix_x2_trans(tile, row_starts[lane], 0)
        out[lane, 0], out[lane, 1] = r0, r1


def _half(words, row, column):
    """16-bit element ``column`` of the 8-element row that starts at word ``row``."""
    return (int(words[row + column // 2]) >> (16 * (column % 2))) & 0xFFFF


@pytest.mark.parametrize("variant", [2, 4, -2], ids=["x2", "x4", "x2.trans"])
def test_ldmatrix_gives_each_lane_its_rows_words(variant):
    rng = np.random.default_rng(4)
    words = rng.integers(0, 2**32, WORDS, dtype=np.uint64).astype(np.uint32)
    # 64 lanes (two warps) name distinct rows in shuffled order, so a twin that reads the wrong lane's
    # address or the wrong word fails.
    row_starts = (rng.permutation(WORDS // ROW_WORDS)[:64] * ROW_WORDS).astype(np.int64)
    out = np.zeros((64, 4), np.uint32)
    _ldmatrix_kernel[1, 64](words, row_starts, out, variant)
    for lane in range(64):
        warp, g, t = lane // 32, (lane % 32) >> 2, lane & 3
        rows = row_starts[32 * warp:32 * warp + 32]
        for j in range(abs(variant)):   # PTX ISA: matrix j's rows start where lanes 8j .. 8j + 7 say
            if variant > 0:             # word t of row g: elements (g, 2t) and (g, 2t + 1)
                expected = words[rows[8 * j + g] + t]
            else:                       # .trans: elements (2t, g) and (2t + 1, g)
                expected = _half(words, rows[8 * j + 2 * t], g) | (_half(words, rows[8 * j + 2 * t + 1], g) << 16)
            assert out[lane, j] == expected, (lane, j)


CHUNKS = 96        # 16-byte chunks of the copy test: three per thread of one warp
TILE_WORDS = 4 * CHUNKS


@cuda.jit
def _copy_async_kernel(source, sources, valid, out):
    # Thread l copies chunks l, l + 32, l + 64 of the shared tile from the chunks ``sources`` names (or zeros),
    # then the tile goes back out through ordinary loads after the wait and a barrier.
    tile = cuda.shared.array(TILE_WORDS, dtype=np.uint32)
    for i in range(cuda.threadIdx.x, TILE_WORDS, cuda.blockDim.x):
        tile[i] = 0xDEADBEEF              # what a copy that never lands leaves behind
    cuda.syncthreads()
    for c in range(cuda.threadIdx.x, CHUNKS, cuda.blockDim.x):
        copy_async16(tile, 4 * c, source, 4 * sources[c], valid[c] != 0)
    copy_async_wait_all()
    cuda.syncthreads()
    for i in range(cuda.threadIdx.x, TILE_WORDS, cuda.blockDim.x):
        out[i] = tile[i]


def test_copy_async_lands_each_chunk_or_zeros():
    rng = np.random.default_rng(5)
    source = rng.integers(0, 2**32, 4 * 4 * CHUNKS, dtype=np.uint64).astype(np.uint32)
    sources = rng.permutation(4 * CHUNKS)[:CHUNKS].astype(np.int64)   # any chunk of the source, shuffled
    valid = (rng.random(CHUNKS) < 0.7).astype(np.int32)
    out = np.zeros(4 * CHUNKS, np.uint32)
    _copy_async_kernel[1, 32](source, sources, valid, out)
    expected = np.where(valid[:, None] != 0, source.reshape(-1, 4)[sources], 0).ravel()
    np.testing.assert_array_equal(out, expected)


def _pair_nan_kernel(has_nan):
    @cuda.jit
    def kernel(words, out):
        start = cuda.grid(1)
        for i in range(start, words.size, cuda.gridsize(1)):
            out[i] = 1 if has_nan(words[i]) else 0
    return kernel


@pytest.mark.parametrize("precision, dtype", [("f16", np.float16), ("bf16", BFLOAT16)])
def test_the_packed_nan_test_finds_exactly_the_nan_elements(precision, dtype):
    """``common.pair_has_nan`` against NumPy on every 16-bit pattern in each half, beside an infinity and a
    NaN in the other (the largest magnitudes, where a carry between the halves would show)."""
    from numba_flash.kernels.fast.common import pair_has_nan

    every = np.arange(1 << 16, dtype=np.uint32)
    infinity = int(np.array(np.inf, dtype).view(np.uint16))
    nan = int(np.array(np.nan, dtype).view(np.uint16)) | 0x7FFF       # the largest NaN magnitude
    words = np.concatenate([every | (infinity << 16), (every << 16) | infinity, every | (0xFFFF << 16),
                            (every << 16) | nan])
    out = np.zeros(words.size, np.int32)
    _pair_nan_kernel(pair_has_nan(precision))[4, 32](words, out)
    halves = words.view(np.uint16).reshape(-1, 2).view(dtype)
    np.testing.assert_array_equal(out.astype(bool), np.isnan(halves.astype(np.float32)).any(axis=1))


def test_the_simulators_block_barrier_holds_every_thread_until_the_last_and_breaks_on_abort():
    """``runtime.simulator.BlockBarrier`` (the simulator's syncthreads, named barriers and warp rooms; plain Python,
    so it runs anywhere): no thread passes generation r before all have arrived at it and the action has run r + 1
    times; ``arrive`` counts without waiting; ``leave`` lets the rest go on without the thread that left; ``abort``
    breaks the threads waiting."""
    import threading

    from numba_flash.runtime.simulator import BlockBarrier

    parties, rounds = 6, 40
    actions, seen, errors = [], [], []
    barrier = BlockBarrier(parties, action=lambda: actions.append(len(actions)))

    def member(index):
        for r in range(rounds):
            seen.append((index, r))
            barrier.wait()
            if len(actions) != r + 1 or sum(1 for _, x in seen if x == r) != parties:
                errors.append((index, r, len(actions)))

    threads = [threading.Thread(target=member, args=(i,)) for i in range(parties)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and len(actions) == rounds

    passed = []
    named = BlockBarrier(3)

    def waiter():
        named.wait()
        passed.append(1)

    waiting = [threading.Thread(target=waiter) for _ in range(2)]
    for thread in waiting:
        thread.start()
    named.arrive()   # the third party, a producer that does not wait
    for thread in waiting:
        thread.join(60)
    assert passed == [1, 1]

    broken = []

    def stuck(at):
        try:
            at.wait()
        except threading.BrokenBarrierError:
            broken.append(1)

    left = BlockBarrier(3)
    waiting = [threading.Thread(target=stuck, args=(left,)) for _ in range(2)]
    for thread in waiting:
        thread.start()
    left.leave()     # two parties left: the two waiting go on
    for thread in waiting:
        thread.join(60)
    assert not broken and not any(thread.is_alive() for thread in waiting)

    aborted = BlockBarrier(3)
    waiting = [threading.Thread(target=stuck, args=(aborted,)) for _ in range(2)]
    for thread in waiting:
        thread.start()
    while len(aborted._gates) < 2:   # both waiting
        threading.Event().wait(0.01)
    aborted.abort()
    for thread in waiting:
        thread.join(60)
    assert broken == [1, 1]
