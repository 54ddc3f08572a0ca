"""Plain NumPy float64 references for numba-flash.

Short enough to check by eye; every kernel is tested against these.
"""
from .attention import allowed_mask, attention, dropout_weights, masked_scores, repeat_kv, softmax
from .gradients import attention_backward
from .tiled import flash1_tiled
from .varlen import attention_varlen, attention_varlen_backward

__all__ = ["allowed_mask", "attention", "attention_backward", "attention_varlen", "attention_varlen_backward",
           "dropout_weights", "masked_scores", "repeat_kv", "softmax", "flash1_tiled"]
