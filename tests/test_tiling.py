"""Algorithm 1, line 1 as code: the block-size rule and its clamps."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numba_flash import line1_block_sizes
from numba_flash.tiling import flash1_sram_elements


def test_paper_rule_on_48_kib_at_d_64():
    # M = 49152 B = 12288 float32; ceil(M / 4d) = 48 and min(48, d) = 48.
    assert line1_block_sizes(64, sram_bytes=48 * 1024) == (48, 48)


def test_float16_counts_twice_the_elements():
    assert line1_block_sizes(64, sram_bytes=48 * 1024, dtype=np.float16) == (64, 96)


@given(d=st.integers(1, 512), sram_kib=st.integers(1, 228),
       n_q=st.one_of(st.none(), st.integers(1, 5000)), n_k=st.one_of(st.none(), st.integers(1, 5000)))
def test_rule_fits_and_is_clamped_only_where_stated(d, sram_kib, n_q, n_k):
    sram = sram_kib * 1024
    m = sram // 4
    if m < 4 * d:
        with pytest.raises(ValueError, match="sram_bytes"):
            line1_block_sizes(d, sram_bytes=sram, n_q=n_q, n_k=n_k)
        return
    b_r, b_c = line1_block_sizes(d, sram_bytes=sram, n_q=n_q, n_k=n_k)
    rule_c = math.ceil(m / (4 * d))
    rule_r = min(rule_c, d)
    assert 1 <= b_r <= min(rule_r, n_q or rule_r, 1024)
    assert 1 <= b_c <= min(rule_c, n_k or rule_c)
    assert flash1_sram_elements(b_r, b_c, d) <= m
    if n_q is None and n_k is None and rule_r <= 1024 and flash1_sram_elements(rule_r, rule_c, d) <= m:
        assert (b_r, b_c) == (rule_r, rule_c)


def test_too_small_sram_is_an_error():
    with pytest.raises(ValueError, match="sram_bytes"):
        line1_block_sizes(128, sram_bytes=1024)
