"""Every check on user input, in one place, before anything is launched.

``check_attention_args`` turns the arguments of ``attention`` into an
``AttentionCall`` whose fields the kernels can trust, or raises a
ValueError/TypeError that names the offending argument.
"""
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from .runtime import arrays as _arrays
from ._checks import positive_int_pair
from .sparsity.block_mask import BlockMask
from .runtime.device import device_limits, in_simulator
from .kernels.literal import flash1_backward as _flash1_backward
from .kernels.literal import flash1_forward as _flash1
from .kernels.fast import backward as _flash2_backward
from .kernels.fast import forward as _flash2
from .tiling import flash1_backward_block_sizes, line1_block_sizes

ALGORITHMS = ("standard", "flash1", "flash2")
#: flash2's default tiles (forward and backward) in the simulator.
SIMULATOR_FLASH2_BLOCK_SIZES = (16, 16)
BACKWARD_ALGORITHMS = ("flash1", "flash2")
#: dtypes each algorithm accepts (the fast kernel also takes float16).
DTYPES = {
    "standard": (np.dtype(np.float32),),
    "flash1": (np.dtype(np.float32),),
    "flash2": (np.dtype(np.float32), np.dtype(np.float16)),
}


@dataclass(frozen=True)
class AttentionCall:
    """A validated call: shapes, dtype and options the kernels can rely on."""

    algorithm: str
    batch_shape: Tuple[int, ...]
    n_q: int
    n_k: int
    head_dim: int
    dtype: np.dtype
    scale: float
    causal: bool
    block_sizes: Optional[Tuple[int, int]]
    on_device: bool
    block_mask: Optional[BlockMask] = None
    dropout_p: float = 0.0
    seed: int = 0

    @property
    def batch_heads(self):
        return int(np.prod(self.batch_shape, dtype=np.int64))


def _shape_and_dtype(name, x):
    interface = _arrays.cuda_interface(x)
    if interface is not None:
        shape = tuple(interface["shape"])
        dtype = np.dtype(interface["typestr"])
        strides = interface.get("strides")
        if strides is not None and tuple(strides) != _c_strides(shape, dtype.itemsize):
            raise ValueError(f"{name} must be C-contiguous on the device (strides {tuple(strides)} "
                             f"for shape {shape}); call .contiguous() or copy it first")
        return shape, dtype, True
    if isinstance(x, np.ndarray):
        return x.shape, x.dtype, False
    raise TypeError(f"{name} must be a NumPy array or a CUDA array (with __cuda_array_interface__), "
                    f"got {type(x).__name__}")


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def check_qkv(q, k, v, algorithm, algorithms=ALGORITHMS):
    """Shapes, dtypes and kinds of q, k, v; returns (batch_shape, n_q, n_k, d, dtype, on_device)."""
    if algorithm not in algorithms:
        raise ValueError(f"algorithm must be one of {algorithms}, got {algorithm!r}")
    (q_shape, q_dtype, q_dev), (k_shape, k_dtype, k_dev), (v_shape, v_dtype, v_dev) = (
        _shape_and_dtype(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    if not q_dev == k_dev == v_dev:
        raise TypeError("q, k and v must all be NumPy arrays or all CUDA arrays, not a mix")
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., N, d), got shape {shape}")
        if 0 in shape:
            raise ValueError(f"{name} has an empty dimension: shape {shape}")
    if not q_dtype == k_dtype == v_dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q_dtype}, {k_dtype}, {v_dtype}")
    if q_dtype not in DTYPES[algorithm]:
        supported = ", ".join(str(t) for t in DTYPES[algorithm])
        hint = " (float16 needs algorithm='flash2')" if q_dtype == np.float16 else ""
        raise TypeError(f"q, k, v have dtype {q_dtype}; algorithm={algorithm!r} supports {supported}{hint}")
    if not q_shape[:-2] == k_shape[:-2] == v_shape[:-2]:
        raise ValueError(f"q, k and v must have equal leading (batch, heads) dims, "
                         f"got {q_shape[:-2]}, {k_shape[:-2]}, {v_shape[:-2]}")
    if k_shape[-2] != v_shape[-2]:
        raise ValueError(f"k and v must have the same length N_k, got {k_shape[-2]} and {v_shape[-2]}")
    if not q_shape[-1] == k_shape[-1] == v_shape[-1]:
        raise ValueError(f"q, k and v must have the same head dim d, got {q_shape[-1]}, {k_shape[-1]}, {v_shape[-1]}")
    return q_shape[:-2], q_shape[-2], k_shape[-2], q_shape[-1], q_dtype, q_dev


def check_scale(scale, head_dim):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def _check_flash1_blocks(block_rows, block_cols, head_dim, backward):
    limits = device_limits()
    if block_rows > limits.max_threads_per_block:
        raise ValueError(f"block_sizes: B_r={block_rows} exceeds {limits.max_threads_per_block} threads per block "
                         f"(flash1 gives each query row of a block its own thread)")
    needed = (_flash1_backward if backward else _flash1).shared_bytes(block_rows, block_cols, head_dim)
    if needed > limits.shared_bytes_per_block:
        tiles = "Q_i, dO_i, K_j, V_j, dK_j, dV_j, P_ij and dS_ij" if backward else "Q_i, K_j, V_j and S_ij"
        raise ValueError(f"block_sizes {(block_rows, block_cols)} need {needed} bytes of shared memory for "
                         f"{tiles} at d={head_dim}; the limit is {limits.shared_bytes_per_block}")


def _check_flash2_blocks(block_rows, block_cols, head_dim, dtype):
    limits = device_limits()
    is_f16 = dtype == np.float16
    layout = _flash2.Flash2Layout(block_rows, block_cols, head_dim, is_f16)
    if block_rows % _flash2.ROWS_PER_WARP:
        raise ValueError(f"block_sizes: flash2 needs B_r to be a multiple of {_flash2.ROWS_PER_WARP} "
                         f"(one warp per 16 query rows), got {block_rows}")
    if layout.threads > limits.max_threads_per_block:
        raise ValueError(f"block_sizes: B_r={block_rows} needs {layout.threads} threads per block; "
                         f"the limit is {limits.max_threads_per_block}")
    step = 16 if is_f16 else 8
    if block_cols % step:
        raise ValueError(f"block_sizes: flash2 needs B_c to be a multiple of {step} for {dtype} "
                         f"(the width of the tensor-core tiles), got {block_cols}")
    if layout.shared_bytes > limits.shared_bytes_per_block_optin:
        raise ValueError(f"block_sizes {(block_rows, block_cols)} need {layout.shared_bytes} bytes of shared "
                         f"memory at d={head_dim} ({dtype}); the limit is {limits.shared_bytes_per_block_optin}")


def _check_flash2_backward_blocks(block_rows, block_cols, head_dim, dtype):
    limits = device_limits()
    for name, size in (("B_r", block_rows), ("B_c", block_cols)):
        if size % _flash2_backward.BLOCK_MULTIPLE:
            raise ValueError(f"block_sizes: the flash2 backward needs {name} to be a multiple of "
                             f"{_flash2_backward.BLOCK_MULTIPLE} (its tiles are rows of warps and "
                             f"tensor-core tiles in both passes), got {size}")
    layout = _flash2_backward.BackwardLayout(block_rows, block_cols, head_dim, dtype == np.float16)
    if layout.threads > limits.max_threads_per_block:
        raise ValueError(f"block_sizes: B_r={block_rows} needs {layout.threads} threads per block; "
                         f"the limit is {limits.max_threads_per_block}")
    if layout.shared_bytes > limits.shared_bytes_per_block_optin:
        raise ValueError(f"block_sizes {(block_rows, block_cols)} need {layout.shared_bytes} bytes of shared "
                         f"memory in the flash2 backward at d={head_dim} ({dtype}); the limit is "
                         f"{limits.shared_bytes_per_block_optin}")


def check_block_sizes(block_sizes, algorithm, head_dim, n_q, n_k, dtype, backward=False, causal=False):
    """Explicit (B_r, B_c), or the algorithm's default (for the call's dtype and causality); None for 'standard'."""
    if algorithm == "standard":
        if block_sizes is not None:
            raise ValueError("block_sizes applies to the flash algorithms; algorithm='standard' "
                             "materialises S and P and has no (B_r, B_c)")
        return None
    if algorithm == "flash2" and head_dim > _flash2.MAX_HEAD_DIM:
        raise ValueError(f"head dim d={head_dim} exceeds flash2's maximum of {_flash2.MAX_HEAD_DIM}")
    if block_sizes is None:
        if algorithm == "flash1":
            if backward:
                return flash1_backward_block_sizes(head_dim, n_q=n_q, n_k=n_k)
            return line1_block_sizes(head_dim, n_q=n_q, n_k=n_k)
        if in_simulator():
            # Every simulated CUDA thread is a Python thread: the smallest legal tiles
            # (one warp) are the fastest there.  The GPU defaults are tuned tiles.
            return SIMULATOR_FLASH2_BLOCK_SIZES
        if backward:
            return _flash2_backward.default_block_sizes(head_dim, dtype, causal)
        return _flash2.default_block_sizes(head_dim, dtype)
    block_rows, block_cols = positive_int_pair("block_sizes", block_sizes)
    if algorithm == "flash1":
        _check_flash1_blocks(block_rows, block_cols, head_dim, backward)
    elif backward:
        _check_flash2_backward_blocks(block_rows, block_cols, head_dim, dtype)
    else:
        _check_flash2_blocks(block_rows, block_cols, head_dim, dtype)
    return block_rows, block_cols


def check_block_mask(block_mask, batch_shape, n_q, n_k):
    if block_mask is None:
        return None
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a numba_flash.BlockMask or None, got {type(block_mask).__name__}")
    block_mask.check_covers(n_q, n_k)
    leading = block_mask.layout.shape[:-2]
    try:
        broadcast = np.broadcast_shapes(leading, tuple(batch_shape))
    except ValueError:
        broadcast = None
    if broadcast != tuple(batch_shape):
        raise ValueError(f"block_mask: layout leading dims {leading} do not broadcast to the batch dims "
                         f"{tuple(batch_shape)} of q")
    return block_mask


def check_attention_args(q, k, v, *, causal, scale, block_mask, dropout_p, seed, algorithm, block_sizes,
                         backward=False):
    """Validate a call to ``attention`` (or the shared part of ``attention_backward``)."""
    batch_shape, n_q, n_k, head_dim, dtype, on_device = check_qkv(
        q, k, v, algorithm, BACKWARD_ALGORITHMS if backward else ALGORITHMS)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale = check_scale(scale, head_dim)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer, got {type(seed).__name__}")
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a number, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    block_mask = check_block_mask(block_mask, batch_shape, n_q, n_k)
    if block_mask is not None and algorithm == "flash1":
        # Algorithm 5 as written: the kernel's tiles are the mask's blocks.
        if block_sizes is not None and tuple(block_sizes) != block_mask.block_size:
            raise ValueError(f"block_sizes {tuple(block_sizes)} differ from the block mask's {block_mask.block_size}; "
                             f"flash1 runs Algorithm 5 with tiles equal to the mask's blocks")
        try:
            block_sizes = check_block_sizes(block_mask.block_size, algorithm, head_dim, n_q, n_k, dtype, backward,
                                            causal)
        except ValueError as exc:
            raise ValueError(f"block_mask: flash1 runs Algorithm 5 with tiles equal to the mask's blocks "
                             f"{block_mask.block_size}, and they cannot: {exc}; use algorithm='flash2' (any "
                             f"mask with any tiles) or smaller mask blocks") from None
    else:
        block_sizes = check_block_sizes(block_sizes, algorithm, head_dim, n_q, n_k, dtype, backward, causal)
    return AttentionCall(algorithm, tuple(batch_shape), n_q, n_k, head_dim, dtype, scale, bool(causal),
                         block_sizes, on_device, block_mask, float(dropout_p), int(seed))


def check_backward_args(q, k, v, o, lse, do, **options):
    """Validate a call to ``attention_backward``: q, k, v as for ``attention``, then o, lse, do."""
    call = check_attention_args(q, k, v, backward=True, **options)
    q_shape = call.batch_shape + (call.n_q, call.head_dim)
    for name, x, shape, dtype in (("o", o, q_shape, call.dtype), ("do", do, q_shape, call.dtype),
                                  ("lse", lse, call.batch_shape + (call.n_q,), np.dtype(np.float32))):
        x_shape, x_dtype, x_dev = _shape_and_dtype(name, x)
        if x_dev != call.on_device:
            raise TypeError(f"{name} must be a {'CUDA' if call.on_device else 'NumPy'} array like q, k and v")
        if tuple(x_shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x_shape)}")
        if x_dtype != dtype:
            raise TypeError(f"{name} must have dtype {dtype}, got {x_dtype}")
    return call
