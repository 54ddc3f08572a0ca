"""The Hopper path (``kernels/hopper``).  Host-side facts that need no GPU: the swizzle, the descriptor's bits,
the accumulator layout.  Whatever issues ``wgmma`` runs only on a Hopper GPU (the simulator has no warpgroup
instructions): the forward against the float64 reference here, the layouts in ``experiments/wgmma_layouts.py``."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numba_flash.kernels.hopper.wgmma import ATOM_BYTES, SWIZZLE_128B, accumulator_entries, descriptor, swizzle_128


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


@pytest.mark.skipif(_where() is None, reason="the wgmma forward needs a Hopper GPU (sm_90a) or the simulator")
@given(data=st.data())
def test_the_wgmma_forward_matches_the_float64_reference(data):
    import ml_dtypes

    import reference
    from numba_flash.kernels.hopper.forward import BLOCK_M, HEAD_DIMS, wgmma_attention
    from tolerances import assert_close_to_reference

    where = _where()
    # In the simulator: up to three tiles each way (every thread of a block is a Python thread).
    longest = 200 if where == "hopper" else 2 * BLOCK_M + 5
    batch = data.draw(st.integers(1, 2))
    kv_heads = data.draw(st.integers(1, 2 if where == "hopper" else 1))
    heads = kv_heads * data.draw(st.sampled_from([1, 2, 3]))          # grouped-query heads
    n_q, n_k = data.draw(st.integers(1, longest)), data.draw(st.integers(1, longest))
    d = data.draw(st.sampled_from(HEAD_DIMS))
    dtype = data.draw(st.sampled_from([np.float16, ml_dtypes.bfloat16]))
    causal = data.draw(st.sampled_from([False, True, "bottom_right"]))
    token_major = data.draw(st.booleans())   # q, k, v as (B, N, H, d) memory viewed as (B, H, N, d)
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))

    def operand(h, n):
        if token_major:
            return rng.standard_normal((batch, n, h, d)).astype(dtype).transpose(0, 2, 1, 3)
        return rng.standard_normal((batch, h, n, d)).astype(dtype)

    q, k, v = operand(heads, n_q), operand(kv_heads, n_k), operand(kv_heads, n_k)
    if where == "hopper":
        import torch
        as_torch = {np.float16: torch.float16, ml_dtypes.bfloat16: torch.bfloat16}[dtype]

        def to_gpu(x):  # the same strides on the GPU
            memory = np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if token_major else x
            tensor = torch.from_numpy(memory.view(np.int16)).cuda().view(as_torch)
            return tensor.transpose(1, 2) if token_major else tensor

        out, lse = wgmma_attention(to_gpu(q), to_gpu(k), to_gpu(v), causal=causal)
        out, lse = out.view(torch.int16).cpu().numpy().view(dtype), lse.cpu().numpy()
    else:
        out, lse = wgmma_attention(q, k, v, causal=causal)
    host = [x.astype(np.float64) for x in (q, k, v)]
    ref_out, ref_lse = reference.attention(*host, causal=causal)
    expanded = [reference.repeat_kv(x, heads) for x in host[1:]]
    assert_close_to_reference(out, lse, ref_out, ref_lse, host[0], *expanded, 1 / np.sqrt(d), dtype)


def test_the_wgmma_forward_rejects_what_it_cannot_run():
    from numba_flash.kernels.hopper.forward import wgmma_attention

    def arrays(d=64, dtype=np.float16, n_k=8):
        return (np.zeros((1, 1, 8, d), dtype), np.zeros((1, 1, n_k, d), dtype), np.zeros((1, 1, n_k, d), dtype))

    with pytest.raises(ValueError, match="head dim"):
        wgmma_attention(*arrays(d=32))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        wgmma_attention(*arrays(dtype=np.float32))
    with pytest.raises(ValueError, match="k and v"):
        q, k, _ = arrays()
        wgmma_attention(q, k, np.zeros((1, 1, 9, 64), np.float16))
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        q = np.zeros((1, 3, 8, 64), np.float16)
        wgmma_attention(q, np.zeros((1, 2, 8, 64), np.float16), np.zeros((1, 2, 8, 64), np.float16))
    with pytest.raises(ValueError, match="causal"):
        wgmma_attention(*arrays(), causal="diagonal")
    with pytest.raises(ValueError, match="scale"):
        wgmma_attention(*arrays(), scale=-1.0)
