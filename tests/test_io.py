"""numba_flash.io against the kernels, forward and backward: every byte they move, counted in the simulator.

Each case runs ``attention`` under ``traffic_counter.count_traffic``, which
attributes every element access of every launch to the kernel parameter it
went through, and compares the bytes per launch and per buffer with the
model, exactly; it also compares the device memory the call allocated with
``device_allocations``.  The cases cover N_q != N_k, lengths that are not
multiples of the tiles, head dims off the vector widths (flash2's scalar
path), causal on and off, float16, and a random block mask per algorithm.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import pytest

import numba_flash
from numba_flash import BlockMask, io
from numba_flash.runtime.arrays import placeholder
from numba_flash.tiling import line1_block_sizes
from traffic_counter import count_traffic

# Counts accesses through the simulator's array wrappers (deselected on a GPU: see conftest.py).
simulator_only = pytest.mark.simulator_only

#: For each algorithm, its launches in order: kernel parameter -> the buffer it is (names of io).
BUFFERS = {
    "standard": [{"A": "q", "B": "k", "C": "s"},
                 {"S": "s", "P": "p", "lse": "lse", "layout": "layout"},
                 {"A": "p", "B": "v", "C": "o"}],
    "flash1": [{"Q": "q", "K": "k", "V": "v", "O": "o", "l": "l", "m": "m", "lse": "lse", "M": "layout"}],
    "flash2": [{"Q": "q", "K": "k", "V": "v", "O": "o", "LSE": "lse", "M": "layout",
                "tile_offsets": "tile_offsets", "tile_entries": "tile_entries", "tile_order": "tile_order"}],
}


@dataclass(frozen=True)
class Case:
    algorithm: str
    batch_heads: int
    n_q: int
    n_k: int
    head_dim: int
    causal: bool = False
    block_sizes: Optional[Tuple[int, int]] = None  # flash1 with a mask: the mask's blocks
    dtype: type = np.float32
    mask_block: Optional[Tuple[int, int]] = None   # a random block mask in blocks of this size ...
    density: float = 0.5                            # ... with about this fraction of non-zero blocks

    def __str__(self):
        return (f"{self.algorithm}-{np.dtype(self.dtype).name}-bh{self.batch_heads}-{self.n_q}x{self.n_k}"
                f"-d{self.head_dim}{'-causal' if self.causal else ''}"
                f"{f'-tiles{self.block_sizes[0]}x{self.block_sizes[1]}' if self.block_sizes else ''}"
                f"{f'-mask{self.mask_block[0]}x{self.mask_block[1]}' if self.mask_block else ''}")


CASES = [
    Case("standard", 1, 5, 7, 3),
    Case("standard", 2, 9, 6, 5, causal=True),
    Case("standard", 2, 7, 10, 6, mask_block=(3, 4)),
    Case("standard", 1, 10, 7, 4, causal=True, mask_block=(4, 3)),
    Case("flash1", 2, 13, 17, 5, block_sizes=(4, 6)),
    Case("flash1", 1, 24, 11, 7, causal=True, block_sizes=(5, 3)),
    Case("flash1", 2, 20, 15, 6, mask_block=(4, 5)),
    Case("flash1", 2, 17, 17, 3, causal=True, mask_block=(6, 4)),
    # flash2: d = 12 float32 and d = 16 float16 take the 16-byte vector path, d = 10 and 12 the scalar one.
    Case("flash2", 2, 24, 19, 12, block_sizes=(16, 8)),
    Case("flash2", 1, 21, 24, 10, causal=True, block_sizes=(16, 16)),
    Case("flash2", 2, 19, 24, 16, causal=True, block_sizes=(16, 16), dtype=np.float16),
    Case("flash2", 1, 24, 13, 12, block_sizes=(16, 16), dtype=np.float16),
    Case("flash2", 2, 24, 21, 8, causal=True, block_sizes=(16, 8), mask_block=(5, 3)),
    # Mask blocks that tile the kernel's tiles: tiles wholly covered but on the diagonal, or ragged.
    Case("flash2", 2, 32, 29, 4, causal=True, block_sizes=(16, 8), mask_block=(8, 8), density=0.8),
    Case("flash2", 2, 20, 20, 8, block_sizes=(16, 16), dtype=np.float16, mask_block=(8, 8), density=0.8),
    Case("flash2", 1, 20, 24, 6, block_sizes=(16, 16), dtype=np.float16, mask_block=(4, 6)),
]


def random_layout(case, seed):
    """Random blocks at the case's density, plus two corner cases in head 0: an
    empty block row (rows that attend to nothing), and a block row whose first
    non-zero block is key block 2 (with causality, its first rows see nothing)."""
    grid = (-(-case.n_q // case.mask_block[0]), -(-case.n_k // case.mask_block[1]))
    layout = np.random.default_rng(seed).random((case.batch_heads,) + grid) < case.density
    layout[0, 0, :] = False
    if grid[0] > 1 and grid[1] > 2:
        layout[0, 1, :] = False
        layout[0, 1, 2] = True
    return layout


def allocate_placeholders():
    """The arrays unmasked launches pass for the mask's parameters are allocated once per process, not per call."""
    placeholder(np.int32), placeholder(np.uint8), placeholder(np.uint8, 3)


def counted_buffers(launch, parameters):
    """{buffer: bytes} of a counted launch, for reads and for writes."""
    return ({parameters[p]: n for p, n in launch.reads.items()},
            {parameters[p]: n for p, n in launch.writes.items()})


@simulator_only
@pytest.mark.parametrize("case", CASES, ids=str)
def test_model_matches_every_access_and_allocation(case):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((case.batch_heads, case.n_q, case.head_dim)).astype(case.dtype)
    k, v = (rng.standard_normal((case.batch_heads, case.n_k, case.head_dim)).astype(case.dtype) for _ in range(2))
    mask = None
    block_mask = None
    block_sizes = case.block_sizes
    if case.mask_block is not None:
        layout = random_layout(case, seed=case.n_q * 100 + case.n_k)
        mask, block_mask = (layout, case.mask_block), BlockMask(layout, case.mask_block)
        if case.algorithm == "flash1":
            block_sizes = case.mask_block
    allocate_placeholders()

    with count_traffic() as counter:
        numba_flash.attention(q, k, v, causal=case.causal, block_mask=block_mask, algorithm=case.algorithm,
                              block_sizes=case.block_sizes)

    model = io.attention_traffic(case.algorithm, case.batch_heads, case.n_q, case.n_k, case.head_dim,
                                 block_sizes=block_sizes, dtype=case.dtype, causal=case.causal, mask=mask)
    assert len(counter.launches) == len(model.launches)
    for launch, modelled, parameters in zip(counter.launches, model.launches, BUFFERS[case.algorithm]):
        reads, writes = counted_buffers(launch, parameters)
        assert reads == modelled.reads, launch.kernel
        assert writes == modelled.writes, launch.kernel
    allocated = io.device_allocations(case.algorithm, case.batch_heads, case.n_q, case.n_k, case.head_dim,
                                      dtype=case.dtype, block_sizes=block_sizes, causal=case.causal, mask=mask)
    assert counter.allocated_bytes == sum(allocated.values())


FLASH1_BACKWARD_BUFFERS = [{"Q": "q", "K": "k", "V": "v", "O": "o", "dO": "do", "LSE": "lse", "dQ": "dq", "dK": "dk",
                            "dV": "dv", "M": "layout"}]
#: The flash2 backward's launches: preprocess, dK/dV, dQ.
BACKWARD_BUFFERS = [
    {"O": "o", "dO": "do", "D": "d"},
    {"Q": "q", "K": "k", "V": "v", "dO": "do", "LSE": "lse", "D": "d", "dK": "dk", "dV": "dv", "M": "layout",
     "tile_offsets": "tile_offsets", "tile_entries": "tile_entries"},
    {"Q": "q", "K": "k", "V": "v", "dO": "do", "LSE": "lse", "D": "d", "dQ": "dq", "M": "layout",
     "tile_offsets": "tile_offsets", "tile_entries": "tile_entries"},
]
BACKWARD_CASES = [
    Case("flash1", 2, 13, 17, 5, block_sizes=(4, 6)),
    Case("flash1", 1, 11, 9, 3, causal=True, block_sizes=(5, 3)),
    Case("flash1", 2, 20, 15, 6, mask_block=(4, 5)),
    # d = 12 float32 and d = 16 float16 take the vector path, d = 10 and 6 the scalar one; B_r != B_c.
    Case("flash2", 2, 24, 19, 12, block_sizes=(16, 32)),
    Case("flash2", 1, 21, 40, 10, causal=True, block_sizes=(32, 16)),
    Case("flash2", 2, 37, 24, 16, causal=True, block_sizes=(16, 16), dtype=np.float16),
    Case("flash2", 2, 24, 29, 8, causal=True, block_sizes=(16, 32), mask_block=(5, 3)),
    Case("flash2", 2, 20, 35, 6, block_sizes=(16, 16), dtype=np.float16, mask_block=(8, 8), density=0.7),
]


@simulator_only
@pytest.mark.parametrize("case", BACKWARD_CASES, ids=str)
def test_backward_model_matches_every_access(case):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((case.batch_heads, case.n_q, case.head_dim)).astype(case.dtype)
    k, v = (rng.standard_normal((case.batch_heads, case.n_k, case.head_dim)).astype(case.dtype) for _ in range(2))
    mask = block_mask = None
    if case.mask_block is not None:
        layout = random_layout(case, seed=case.n_q * 100 + case.n_k)
        mask, block_mask = (layout, case.mask_block), BlockMask(layout, case.mask_block)
    o, lse = numba_flash.attention(q, k, v, causal=case.causal, block_mask=block_mask, return_lse=True)
    do = rng.standard_normal(o.shape).astype(case.dtype)
    allocate_placeholders()
    block_sizes = case.mask_block if case.algorithm == "flash1" and mask is not None else case.block_sizes

    with count_traffic() as counter:
        numba_flash.attention_backward(q, k, v, o, lse, do, causal=case.causal, block_mask=block_mask,
                                       block_sizes=block_sizes, algorithm=case.algorithm)

    if case.algorithm == "flash1":
        model = io.flash1_backward_traffic(case.batch_heads, case.n_q, case.n_k, case.head_dim, block_sizes,
                                           causal=case.causal, mask=mask)
        buffers = FLASH1_BACKWARD_BUFFERS
    else:
        model = io.flash2_backward_traffic(case.batch_heads, case.n_q, case.n_k, case.head_dim, block_sizes,
                                           dtype=case.dtype, causal=case.causal, mask=mask)
        buffers = BACKWARD_BUFFERS
    assert len(counter.launches) == len(model.launches) == len(buffers)
    for launch, modelled, parameters in zip(counter.launches, model.launches, buffers):
        reads, writes = counted_buffers(launch, parameters)
        assert reads == modelled.reads, launch.kernel
        assert writes == modelled.writes, launch.kernel


def test_totals_add_up_the_launches():
    traffic = io.standard_traffic(2, 10, 12, 8, causal=True)
    assert traffic.read_bytes == sum(launch.read_bytes for launch in traffic.launches)
    assert traffic.total_bytes == traffic.read_bytes + traffic.write_bytes > 0


def slope(xs, ys):
    return np.polyfit(np.log(xs), np.log(ys), 1)[0]


def test_model_grows_as_theorem_2_says():
    d = 64
    lengths = [2048, 4096, 8192]
    # Quadratic in N: standard (S and P), flash1 (T_c outer passes over Q and O), flash2 (T_r passes over K, V).
    standard = [io.standard_traffic(1, n, n, d, matmul_tile=16).total_bytes for n in lengths]
    flash1 = [io.flash1_traffic(1, n, n, d, (48, 48)).total_bytes for n in lengths]
    flash2 = [io.flash2_traffic(1, n, n, d, (128, 32)).total_bytes for n in lengths]
    for traffic in (standard, flash1, flash2):
        assert slope(lengths, traffic) == pytest.approx(2, abs=0.05)
    # flash1 with Algorithm 1's line-1 tiles: inversely proportional to the SRAM size M.
    sram = [8 * 1024, 16 * 1024, 32 * 1024]
    by_sram = [io.flash1_traffic(1, 4096, 4096, d, line1_block_sizes(d, sram_bytes=m)).total_bytes for m in sram]
    assert slope(sram, by_sram) == pytest.approx(-1, abs=0.1)
    # The paper's leading terms have the same slopes.
    assert slope(lengths, [io.theorem2_standard(n, d) for n in lengths]) == pytest.approx(2, abs=0.05)
    assert slope(sram, [io.theorem2_flash(4096, d, m / 4) for m in sram]) == pytest.approx(-1)
    assert io.proposition4_block_sparse(4096, d, 4096, 1.0) > io.proposition4_block_sparse(4096, d, 4096, 0.1)


def test_flash1_rejects_a_mask_in_other_blocks():
    with pytest.raises(ValueError, match="tiles equal"):
        io.flash1_traffic(1, 8, 8, 4, (4, 4), mask=(np.ones((1, 4, 4), bool), (2, 2)))


def test_backward_model_grows_as_theorem_5_says():
    d, lengths = 64, [2048, 4096, 8192]
    # flash2's backward re-reads Q, dO (dK/dV pass) and K, V (dQ pass) once per tile: quadratic in N.
    backward = [io.flash2_backward_traffic(1, n, n, d, (64, 32)).total_bytes for n in lengths]
    assert slope(lengths, backward) == pytest.approx(2, abs=0.05)
    assert slope(lengths, [io.theorem5_backward(n, d, 4096) for n in lengths]) == pytest.approx(2)
    # Causal visits about half the tiles.
    causal = io.flash2_backward_traffic(1, 4096, 4096, d, (64, 32), causal=True).total_bytes
    assert 0.45 < causal / backward[1] < 0.6
