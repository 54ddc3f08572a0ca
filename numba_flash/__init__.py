"""numba-flash: FlashAttention (Dao et al., 2022) as readable Numba CUDA kernels."""
import sys as _sys

from .runtime.mode import use_simulator_if_no_gpu

use_simulator_if_no_gpu()  # before anything imports Numba

from .runtime import compat  # noqa: E402,F401  (must run before numba-cuda compiles anything)
from .runtime.device import in_simulator as _in_simulator  # noqa: E402

if _in_simulator():
    from .runtime import simulator as _simulator

    _simulator.install()

from .api import (attention, attention_backward, attention_varlen, attention_varlen_backward,  # noqa: E402
                  attention_with_kv_cache)
from .sparsity.block_mask import BlockMask  # noqa: E402
from .sparsity.mod_tiles import TileMask, tile_mask  # noqa: E402  (a mask_mod classified once, reused)
from .dropout import dropout_mask  # noqa: E402
from . import masks  # noqa: E402,F401  (numba_flash.masks: the pattern generators)
from . import mods  # noqa: E402,F401  (numba_flash.mods: score_mod / mask_mod and their built-ins)
from .runtime.device import device_limits, in_simulator  # noqa: E402
from .tiling import line1_block_sizes  # noqa: E402
from .tools import io  # noqa: E402  (numba_flash.io: the traffic model, kept at its public path)

_sys.modules[__name__ + ".io"] = io

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "attention_with_kv_cache",
           "BlockMask", "TileMask", "device_limits",
           "dropout_mask", "in_simulator", "line1_block_sizes", "tile_mask"]
__version__ = "0.1.0"
