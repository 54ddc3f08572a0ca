"""Test configuration: simulator or GPU, and the Hypothesis profile for each.

The same test files run in Numba's CUDA simulator (CI, no GPU) and on a real
GPU.  Unless NUMBA_ENABLE_CUDASIM is set, importing numba_flash picks the GPU
when the CUDA driver reports one and the simulator otherwise.

Hypothesis profiles (pick one with HYPOTHESIS_PROFILE or --hypothesis-profile):

* ``sim``: tiny shapes, few examples, derandomised so CI is reproducible;
  the default in the simulator.
* ``gpu``: larger shapes and more examples; the default on a GPU.
* ``thorough``: the GPU sizes with many more examples (an opt-in slow tier).

The sizes each profile draws live in ``strategies.SIZES``.
"""
import os

import numba_flash  # noqa: F401,I001  (picks the simulator when there is no GPU, before Numba loads)

from hypothesis import HealthCheck, settings  # noqa: E402
from numba import config  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("sim", max_examples=12, derandomize=True, **_common)
settings.register_profile("gpu", max_examples=20, **_common)
settings.register_profile("thorough", max_examples=500, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "sim" if config.ENABLE_CUDASIM else "gpu"))
