"""The Hopper path (``kernels/hopper``).  Host-side facts that need no GPU: the swizzle, the descriptor's bits,
the accumulator layout.  Whatever issues ``wgmma`` runs only on a Hopper GPU (the simulator has no warpgroup
instructions): the forward against the float64 reference here, the layouts in ``experiments/wgmma_layouts.py``."""
import importlib.util
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numba_flash.kernels.hopper.wgmma import ATOM_BYTES, SWIZZLE_128B, descriptor, swizzle_128


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
    path = os.path.join(os.path.dirname(__file__), "..", "experiments", "wgmma_layouts.py")
    spec = importlib.util.spec_from_file_location("wgmma_layouts", path)
    layouts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layouts)
    for n in (64, 128):
        registers = np.arange(128 * (n // 2), dtype=np.float64).reshape(128, n // 2) + 1
        matrix = layouts.accumulator_to_matrix(registers, n)
        assert sorted(matrix.ravel()) == sorted(registers.ravel())
        # Thread 0 holds rows 0 and 8, columns 0-1 of each 8-column block (mma.sync's C fragment per block).
        assert matrix[0, 0] == registers[0, 0] and matrix[8, 1] == registers[0, 3] and matrix[0, 8] == registers[0, 4]


def _hopper_gpu():
    """torch, when it has a CUDA GPU of compute capability 9.0 and the simulator is off; else None."""
    from numba_flash import in_simulator

    if in_simulator():
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) else None


@pytest.mark.skipif(_hopper_gpu() is None, reason="the wgmma forward needs a Hopper GPU (sm_90a)")
@given(data=st.data())
def test_the_wgmma_forward_matches_the_float64_reference(data):
    import ml_dtypes

    import reference
    from numba_flash.kernels.hopper.forward import HEAD_DIMS, wgmma_attention
    from tolerances import assert_close_to_reference

    torch = _hopper_gpu()
    batch, heads = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    n_q, n_k = data.draw(st.integers(1, 200)), data.draw(st.integers(1, 200))
    d = data.draw(st.sampled_from(HEAD_DIMS))
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16]))
    causal = data.draw(st.sampled_from([False, True, "bottom_right"]))
    generator = torch.Generator(device="cuda").manual_seed(data.draw(st.integers(0, 2 ** 31 - 1)))
    q, k, v = (torch.randn(shape, generator=generator, device="cuda", dtype=dtype)
               for shape in ((batch, heads, n_q, d), (batch, heads, n_k, d), (batch, heads, n_k, d)))
    out, lse = wgmma_attention(q, k, v, causal=causal)
    host = [x.float().cpu().numpy().astype(np.float64) for x in (q, k, v)]
    ref_out, ref_lse = reference.attention(*host, causal=causal)
    numpy_dtype = np.float16 if dtype == torch.float16 else ml_dtypes.bfloat16
    assert_close_to_reference(out.float().cpu().numpy(), lse.cpu().numpy(), ref_out, ref_lse, *host, 1 / np.sqrt(d),
                              numpy_dtype)
