"""The host-side facts of the Hopper path (``kernels/hopper/wgmma.py``): the swizzle, the descriptor's bits and
the accumulator layout.  Whatever issues ``wgmma`` runs only on a Hopper GPU (``experiments/wgmma_layouts.py``
checks the layouts there against NumPy); these need none."""
import importlib.util
import os

import numpy as np

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
