"""Argument checks shared by the API, block masks and mask generators."""
import numbers

import numpy as np


def positive_int_pair(name, value):
    """``value`` as a pair of positive ints, or a TypeError/ValueError naming ``name``."""
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in value)):
        raise TypeError(f"{name} must be a pair of integers (B_r, B_c), got {value!r}")
    rows, cols = (int(b) for b in value)
    if rows <= 0 or cols <= 0:
        raise ValueError(f"{name} must be positive, got {(rows, cols)}")
    return rows, cols


def boolean_grid(name, array, last_axes):
    """``array`` as a boolean NumPy array of shape (..., *last_axes) with no empty dimension."""
    array = np.asarray(array)
    if array.dtype != np.bool_:
        raise ValueError(f"{name} must be boolean, got dtype {array.dtype}")
    if array.ndim < 2:
        raise ValueError(f"{name} must have shape (..., {', '.join(last_axes)}), got {array.shape}")
    if 0 in array.shape:
        raise ValueError(f"{name} has an empty dimension: shape {array.shape}")
    return array
