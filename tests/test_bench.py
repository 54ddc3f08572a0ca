"""The benchmark's tables and target checks (the timing itself needs a GPU; these need none)."""
import math

from numba_flash.tools.bench import Row, backward_target_summary, format_table, sixteen_bit_summary, target_summary

SHAPE = (4, 16, 4096, 64)


def test_forward_and_backward_rows_are_compared_with_ours_of_the_same_kind():
    rows = [Row(SHAPE, "float32", False, "flash2", 2.0), Row(SHAPE, "float32", False, "torch-math", 6.0),
            Row(SHAPE, "float32", False, "flash2 bwd", 4.0, flop_factor=2.5),
            Row(SHAPE, "float32", False, "torch-math bwd", 5.0, flop_factor=2.5),
            Row(SHAPE, "float32", False, "torch-efficient bwd", 3.0, flop_factor=2.5),
            Row(SHAPE, "float32", False, "torch-flash bwd", math.nan, "no float32", 2.5)]
    table = format_table(rows)
    assert "| torch-math | 6.000 |" in table and "| 3.00x |" in table        # forward vs flash2
    assert "| torch-math bwd | 5.000 |" in table and "| 1.25x |" in table    # backward vs flash2 bwd
    assert "| torch-flash bwd | n/a |" in table
    # A backward does 2.5x the forward's FLOPs: same time, 2.5x the TFLOP/s.
    assert math.isclose(rows[2].tflops, 2.5 * Row(SHAPE, "float32", False, "x", 4.0).tflops)
    lines = backward_target_summary(rows)
    assert lines == [f"{SHAPE} causal=False: flash2 backward is 1.25x torch-math's (target 1.5x: missed)",
                     f"{SHAPE} causal=False: flash2 backward is 0.75x torch-efficient's (target 1.0x: missed)"]
    assert target_summary(rows) == [f"{SHAPE} causal=False: flash2 is 3.00x torch-math (target 2.0x: met)"]


def test_sixteen_bit_rows_are_held_to_issue_15s_targets_beside_flex_attention():
    rows = [Row(SHAPE, "float16", True, "flash2", 2.0), Row(SHAPE, "float16", True, "torch-flash", 1.5),
            Row(SHAPE, "float16", True, "flex-attention", 1.0),
            Row(SHAPE, "bfloat16", False, "flash2 fwd+bwd", 5.0, flop_factor=3.5),
            Row(SHAPE, "bfloat16", False, "torch-flash fwd+bwd", 4.0, flop_factor=3.5),
            Row(SHAPE, "bfloat16", False, "flash2 bwd", 3.0, flop_factor=2.5),          # no target of its own
            Row(SHAPE, "float32", False, "flash2", 1.0), Row(SHAPE, "float32", False, "torch-flash", 9.0)]
    assert sixteen_bit_summary(rows) == [
        f"{SHAPE} float16 causal=True: flash2 is 0.75x torch-flash (target 0.8x: missed), 0.50x FlexAttention",
        f"{SHAPE} bfloat16 causal=False fwd+bwd: flash2 is 0.80x torch-flash (target 0.6x: met)"]


def test_flex_attention_is_left_out_below_its_smallest_head_dim():
    # torch's inductor refuses FlexAttention at d < 16; the benchmarks and experiments then show no column.
    from numba_flash.tools.bench import FLEX_MIN_HEAD_DIM, flex_attention

    assert flex_attention(None, False, 32, 32, FLEX_MIN_HEAD_DIM - 8) is None
