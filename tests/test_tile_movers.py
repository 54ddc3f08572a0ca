"""How the fast kernels move tiles into shared memory, against NumPy.

``common.tile_copier`` (cp.async, 16-bit pairs) is checked directly here, over tile heights, head
dims, block sizes and ragged edges: the kernels' own tests reach it only at their tile shapes.
"""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from numba import cuda, uint32

from numba_flash.kernels.fast.common import tile_copier
from numba_flash.tiling import row_stride

SENTINEL = 0xDEADBEEF   # what shared memory holds where nothing may be written


@given(rows=st.sampled_from([16, 32, 48, 64]), d_pad=st.sampled_from([16, 32, 48, 80, 128, 160, 256]),
       warps=st.sampled_from([1, 2, 4]), data=st.data())
def test_tile_copier_lands_the_rows_and_zeros_outside_them(rows, d_pad, warps, data):
    threads = 32 * warps
    head_dim = 8 * data.draw(st.integers(1, d_pad // 8), label="head_dim / 8")     # 16-byte rows (VEC)
    rows_valid = data.draw(st.integers(1, rows), label="rows_valid")
    stride = head_dim + 8 * data.draw(st.integers(0, 3), label="row padding / 8")  # elements
    base = 8 * data.draw(st.integers(0, 5), label="first row / 8")
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    source = rng.integers(0, 2 ** 32, (base + rows * stride) // 2 + 8, dtype=np.uint64).astype(np.uint32)
    rs = row_stride(d_pad, True)
    copy_rows, wait_rows = tile_copier(rows, d_pad, threads)

    @cuda.jit
    def kernel(x, out):
        tile = cuda.shared.array(0, uint32)
        for i in range(cuda.threadIdx.x, out.size, cuda.blockDim.x):
            tile[i] = SENTINEL
        cuda.syncthreads()
        copy_rows(tile, 0, x, base, stride, rows_valid, head_dim, cuda.threadIdx.x)
        wait_rows()
        cuda.syncthreads()
        for i in range(cuda.threadIdx.x, out.size, cuda.blockDim.x):
            out[i] = tile[i]

    out = np.zeros(rows * rs, np.uint32)
    kernel[1, threads, 0, 4 * out.size](source, out)
    got = out.reshape(rows, rs)
    words = d_pad // 2
    expected = np.zeros((rows, words), np.uint32)
    for r in range(rows_valid):
        start = (base + r * stride) // 2
        expected[r, :head_dim // 2] = source[start:start + head_dim // 2]
    np.testing.assert_array_equal(got[:, :words], expected)
    assert np.all(got[:, words:] == SENTINEL), "a copy wrote into a row's bank padding"
