"""Plain NumPy float64 references for numba-flash.

Short enough to check by eye; every kernel is tested against these.
"""
from .attention import allowed_mask, attention, softmax
from .tiled import flash1_tiled

__all__ = ["allowed_mask", "attention", "softmax", "flash1_tiled"]
