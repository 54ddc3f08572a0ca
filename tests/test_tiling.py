"""Algorithm 1, line 1 as code: the block-size rule and its clamps; flash2's staged shared memory."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numba_flash import line1_block_sizes
from numba_flash.runtime.device import device_limits
from numba_flash.tiling import (flash1_sram_elements, flash2_dkdv_smem, flash2_dq_smem, flash2_forward_smem,
                                flash2_stages)


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


LAYOUTS = [(flash2_forward_smem, "K", ("K", "V")), (flash2_dq_smem, "K", ("K", "V")),
           (flash2_dkdv_smem, "Q", ("Q", "DO", "LSE2", "D_I"))]


@pytest.mark.parametrize("layout, first, streamed", LAYOUTS, ids=["forward", "dq", "dkdv"])
@given(rows=st.sampled_from([16, 32, 64, 128]), cols=st.sampled_from([16, 32, 64, 128]),
       d_pad=st.sampled_from([16, 64, 80, 128, 256]))
def test_a_second_stage_repeats_the_streamed_tiles_at_one_offset(layout, first, streamed, rows, cols, d_pad):
    one, two = layout(rows, cols, d_pad, "f16", 1), layout(rows, cols, d_pad, "f16", stages=2)
    stride = two.offset(first + "_STAGE1") - two.offset(first)
    for name in streamed:   # every streamed tile moves by the same offset, kept 16-byte aligned
        assert two.offset(name + "_STAGE1") - two.offset(name) == stride
        assert two.offset(name + "_STAGE1") % 4 == 0
    assert two.words - one.words == stride         # the second stage adds exactly one copy
    streamed_words = sum(words for name, words in one.tiles if name in streamed)
    assert stride == streamed_words


@pytest.mark.parametrize("layout", [flash2_forward_smem, flash2_dq_smem, flash2_dkdv_smem],
                         ids=["forward", "dq", "dkdv"])
def test_two_stages_only_for_aligned_16_bit_tiles_that_fit(layout):
    assert flash2_stages(layout, 128, 64, 64, precision="f16", vec=True) == 2
    assert flash2_stages(layout, 128, 64, 64, precision="bf16", vec=True) == 2
    assert flash2_stages(layout, 128, 64, 64, precision="f16", vec=False) == 1     # no cp.async
    assert flash2_stages(layout, 128, 64, 64, precision="tf32x3", vec=True) == 1   # split on the way in
    # Tiles whose single stage fits but whose second would not.
    limit = device_limits().shared_bytes_per_block_optin
    big = next((rows, cols) for rows, cols in [(64, 128), (128, 64), (128, 128)]
               if layout(rows, cols, 256, "f16").bytes <= limit < layout(rows, cols, 256, "f16", stages=2).bytes)
    assert flash2_stages(layout, *big, 256, precision="f16", vec=True) == 1
