"""Small fixes that let numba-cuda 0.30 run on the NumPy versions we meet.

Imported first by ``numba_flash/__init__.py``, before anything compiles a
kernel.
"""
import numpy as np

# numba-cuda 0.30.4 registers an overload for ``np.row_stack`` when its array
# module is first imported (at the first kernel compile).  NumPy 2.5 removed
# ``row_stack`` (an alias of ``vstack`` since NumPy 2.0), so that import fails
# with AttributeError (NVIDIA/numba-cuda#907, closed without a fix).  Putting
# the alias back is harmless: it is the function NumPy itself used to export.
if not hasattr(np, "row_stack"):

    def row_stack(tup, *, dtype=None, casting="same_kind"):
        """Alias of :func:`numpy.vstack`, restored for numba-cuda 0.30."""
        return np.vstack(tup, dtype=dtype, casting=casting)

    np.row_stack = row_stack
