"""The dropout generator: Philox-4x32-10 known answers, host/device agreement, statistics."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba import cuda, uint32

from numba_flash import dropout_mask
from numba_flash.dropout import philox_4x32_10, philox_device, threshold

# Known-answer vectors of the Random123 distribution (kat_vectors, philox4x32_10).
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, expected):
    words = philox_4x32_10(*(np.uint32(c) for c in counter), *(np.uint32(k) for k in key))
    assert tuple(int(w) for w in words) == expected


@cuda.jit
def _philox_kernel(out, k0, k1):
    i = cuda.grid(1)
    if i < out.shape[0]:
        words = philox_device(uint32(i), uint32(i * 7), uint32(3), uint32(0), uint32(k0), uint32(k1))
        for w in range(4):
            out[i, w] = words[w]


def test_device_generator_is_bit_identical_to_the_host():
    out = np.zeros((64, 4), np.uint32)
    _philox_kernel[2, 32](out, 0xDEADBEEF, 12345)
    i = np.arange(64, dtype=np.uint32)
    host = philox_4x32_10(i, i * np.uint32(7), np.uint32(3), np.uint32(0), np.uint32(0xDEADBEEF), np.uint32(12345))
    np.testing.assert_array_equal(out, np.stack(host, axis=1))


@given(st.sampled_from([0.05, 0.1, 0.5, 0.9]), st.integers(0, 2 ** 64 - 1))
def test_kept_fraction_is_within_a_binomial_bound(p, seed):
    keep = dropout_mask((2, 3, 40, 50), p, seed)
    n = keep.size
    # 5 standard deviations of Binomial(n, 1 - p): fails by chance ~1 in 3.5 million.
    assert abs(keep.sum() - n * (1 - p)) <= 5 * np.sqrt(n * p * (1 - p))


def test_mask_is_deterministic_and_depends_on_every_key_part():
    base = dropout_mask((2, 8, 8), 0.5, 7)
    np.testing.assert_array_equal(base, dropout_mask((2, 8, 8), 0.5, 7))
    assert not np.array_equal(base, dropout_mask((2, 8, 8), 0.5, 8))
    assert not np.array_equal(base[0], base[1])                      # heads differ
    assert not np.array_equal(base[:, 0], base[:, 1])                # rows differ
    # A prefix of a longer sequence has the same mask: entries depend on (row, col) only.
    np.testing.assert_array_equal(dropout_mask((2, 5, 6), 0.5, 7), base[:, :5, :6])


def test_threshold_edges():
    assert threshold(0.0) == 0 and threshold(0.5) == 2 ** 31
    assert dropout_mask((1, 4, 4), 0.0, 1).all()
    with pytest.raises(ValueError, match="p must be"):
        dropout_mask((4, 4), 1.0, 0)
