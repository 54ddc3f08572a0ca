"""The three ways a fast kernel can be launched on a GPU give the same bits.

``runtime/launch.py``: the direct launch calls ``cuLaunchKernel`` through ctypes on a parameter
buffer laid out once; where libcuda cannot be loaded that way it calls cuda-python's binding on the
same buffer; with ``NUMBA_FLASH_LAUNCH=dispatcher`` (or if numba-cuda's internals change shape)
Numba's dispatcher launches the kernel from ordinary arguments.  Each mode builds its own plans,
so the plan cache is emptied between them.
"""
import numpy as np
import pytest

import numba_flash
from numba_flash import api
from numba_flash.runtime import launch

pytestmark = pytest.mark.gpu_only


def _results(monkeypatch, mode, native):
    api._PLANS.clear()
    monkeypatch.setattr(launch, "LAUNCH_MODE", mode)
    if not native:
        monkeypatch.setattr(launch, "libcuda", lambda: None)
    rng = np.random.default_rng(11)
    q, k, v, do = (rng.standard_normal((2, 3, 200, 64)).astype(np.float16) for _ in range(4))
    options = dict(causal=True, dropout_p=0.1, seed=5)
    out, lse = numba_flash.attention(q, k, v, return_lse=True, **options)
    grads = numba_flash.attention_backward(q, k, v, out, lse, do, **options)
    api._PLANS.clear()
    return (out, lse) + tuple(grads)


@pytest.mark.parametrize("mode, native", [("direct", False), ("dispatcher", True)],
                         ids=["cuda-python binding", "Numba dispatcher"])
def test_launch_paths_agree_bit_for_bit(monkeypatch, mode, native):
    with monkeypatch.context() as patch:
        expected = _results(patch, "direct", True)
    got = _results(monkeypatch, mode, native)
    for name, a, b in zip(("O", "lse", "dq", "dk", "dv"), expected, got):
        np.testing.assert_array_equal(a, b, err_msg=name)
