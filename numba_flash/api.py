"""The public API of numba-flash."""
import numpy as np
from numba import cuda

from .runtime import arrays as _arrays
from ._validation import check_attention_args, check_backward_args
from .dropout import kernel_args as dropout_kernel_args
from .kernels.literal.flash1_backward import flash1_backward
from .kernels.literal.flash1_forward import flash1_forward
from .kernels.fast.backward import backward_mask_args, flash2_backward
from .kernels.fast.forward import block_mask_args, flash2_forward
from .kernels.literal.standard_attention import standard_attention


def attention(q, k, v, *, causal=False, scale=None, block_mask=None, dropout_p=0.0, seed=0,
              algorithm="flash2", block_sizes=None, return_lse=False):
    """Exact attention softmax(scale * q k^T) v, computed on the GPU.

    Parameters
    ----------
    q : array (..., N_q, d);  k, v : arrays (..., N_k, d)
        Equal leading dims (batch, heads, ...); float32, or float16 with
        ``algorithm="flash2"`` (float32 accumulation, output float16).
        All NumPy arrays (copied to
        the GPU and back; NumPy arrays are returned) or all CUDA arrays
        (anything with ``__cuda_array_interface__``: Numba, torch, CuPy;
        used in place, and Numba device arrays are returned).
    causal : bool
        Query i attends to key j only if j <= i (top-left aligned, like
        torch's ``scaled_dot_product_attention(is_causal=True)``), also when
        N_q != N_k.
    scale : float, optional
        Multiplies the logits; default 1/sqrt(d).
    algorithm : {"flash2", "flash1", "standard"}
        "standard" is the paper's Algorithm 0 (S and P materialised in device
        memory), "flash1" its Algorithm 1 written literally, "flash2" the fast
        FlashAttention-2 loop order on tensor cores (the default).
    block_sizes : (B_r, B_c), optional
        Tile sizes for the flash algorithms.  flash1: any pair whose tiles
        fit in 48 KiB of shared memory; default Algorithm 1's line 1
        (``numba_flash.line1_block_sizes``).  flash2: B_r a multiple of 16,
        B_c a multiple of 8 (float32) or 16 (float16), fitting in the
        device's opt-in shared memory; default measured per (d, dtype)
        on the H200 ((16, 16) in the simulator, where small tiles are fast).
    return_lse : bool
        Also return the row log-sum-exp lse = m + log(l) (float32, natural
        log); -inf for a row that may attend to no key (its output is 0).
    block_mask : numba_flash.BlockMask, optional
        Block-sparse attention (the paper's Algorithm 5): element (i, j) is
        allowed iff ``layout[..., i // B_r, j // B_c]``; the layout's leading
        dims broadcast to q's batch dims and its grid must be exactly
        (ceil(N_q / B_r), ceil(N_k / B_c)).  Combines with ``causal`` (AND).
        flash1 runs with tiles equal to the mask's blocks and skips zero
        tiles; flash2 visits, per query tile, only the key tiles that touch
        a non-zero block (any tile shape); standard masks S element-wise.
    dropout_p, seed : float in [0, 1), int in [0, 2**64)
        Dropout on the attention weights (Algorithm 2): each entry of P is
        dropped with probability dropout_p and the kept ones scaled by
        1/(1 - dropout_p); lse is that of the undropped weights.  Which
        entries are kept is a pure function of (seed, batch*head index,
        query row, key column): ``numba_flash.dropout_mask(shape, p, seed)``
        returns that mask on the host, bit for bit.

    Returns
    -------
    O, or (O, lse) with ``return_lse=True``.
    """
    call = check_attention_args(q, k, v, causal=causal, scale=scale, block_mask=block_mask,
                                dropout_p=dropout_p, seed=seed, algorithm=algorithm,
                                block_sizes=block_sizes)
    q3, k3, v3 = (_arrays.as_heads(x, call.on_device) for x in (q, k, v))
    o = _arrays.empty((call.batch_heads, call.n_q, call.head_dim), call.dtype)
    lse = _arrays.empty((call.batch_heads, call.n_q), np.float32)
    run_forward(call, q3, k3, v3, o, lse)
    out = _arrays.deliver(o, call.batch_shape, call.on_device)
    if return_lse:
        return out, _arrays.deliver(lse, call.batch_shape, call.on_device)
    return out


def attention_backward(q, k, v, o, lse, do, *, causal=False, scale=None, block_mask=None, dropout_p=0.0, seed=0,
                       algorithm="flash2", block_sizes=None):
    """Gradients (dq, dk, dv) of sum(O * do) for O = attention(q, k, v, ...).

    ``o`` and ``lse`` are what ``attention(..., return_lse=True)`` returned
    for the same arguments (the backward recomputes P from q, k and lse and
    never materialises N x N); ``do`` is dL/dO.  causal, scale, block_mask,
    dropout_p and seed must be those of the forward call (dropout regenerates
    the same mask from the seed).  Results have the shapes, dtype and kind
    (NumPy or CUDA) of q, k, v.

    algorithm: "flash2" (the default) is the fast backward on tensor cores,
    float32 or float16, bitwise deterministic (no atomics); "flash1" is
    Algorithm 4 written literally (float32).  block_sizes: for "flash1" the
    (B_r, B_c) of Algorithm 4 (default: ``flash1_backward_block_sizes``);
    for "flash2" the tile a thread block owns (B_r queries in the dQ pass,
    B_r keys in the dK/dV pass) and the tile it streams (B_c), both
    multiples of 16 (default: (128, 64) for float16 up to d = 128, but
    (64, 32) up to d = 64 when causal; for float32 (128, 64) up to d = 64,
    (64, 32) up to d = 128; (32, 16) above d = 128; (16, 16) in the
    simulator; the measurements are in kernels/flash2_backward.py).
    """
    call = check_backward_args(q, k, v, o, lse, do, causal=causal, scale=scale, block_mask=block_mask,
                               dropout_p=dropout_p, seed=seed, algorithm=algorithm, block_sizes=block_sizes)
    q3, k3, v3, o3, do3 = (_arrays.as_heads(x, call.on_device) for x in (q, k, v, o, do))
    bh, n_q, n_k, d = call.batch_heads, call.n_q, call.n_k, call.head_dim
    dq = _arrays.empty((bh, n_q, d), call.dtype)
    dk = _arrays.empty((bh, n_k, d), call.dtype)
    dv = _arrays.empty((bh, n_k, d), call.dtype)
    run_backward(call, q3, k3, v3, o3, do3, _arrays.as_rows(lse, call.on_device), dq, dk, dv)
    return tuple(_arrays.deliver(x, call.batch_shape, call.on_device) for x in (dq, dk, dv))


def run_forward(call, q, k, v, o, lse, *, empty=_arrays.empty, stream=0):
    """Launch the forward of a validated ``call`` on device arrays q, o (BH, N_q, d), k, v (BH, N_k, d), lse (BH, N_q).

    ``empty(shape, dtype)`` allocates the scratch buffers some algorithms
    need (S and P, or l and m); ``stream``: the CUDA stream to launch on.
    """
    bh, n_q, n_k = call.batch_heads, call.n_q, call.n_k
    layout = _device_layout(call)
    dropout = _dropout_args(call)
    if call.algorithm == "standard":
        s = empty((bh, n_q, n_k), np.float32)
        p = empty((bh, n_q, n_k), np.float32)
        mask = None if layout is None else (layout, call.block_mask.block_size)
        standard_attention(q, k, v, o, lse, s, p, scale=call.scale, causal=call.causal, mask=mask,
                           dropout=dropout, stream=stream)
    elif call.algorithm == "flash1":
        l = empty((bh, n_q), np.float32)
        m = empty((bh, n_q), np.float32)
        flash1_forward(q, k, v, o, l, m, lse, scale=call.scale, causal=call.causal,
                       block_sizes=call.block_sizes, mask=layout, dropout=dropout, stream=stream)
    else:
        flash2_forward(q, k, v, o, lse, scale=call.scale, causal=call.causal, block_sizes=call.block_sizes,
                       mask=_flash2_tile_lists(call, block_mask_args), dropout=dropout, stream=stream)


def run_backward(call, q, k, v, o, do, lse, dq, dk, dv, *, empty=_arrays.empty, stream=0):
    """Launch the backward of a validated ``call`` on device arrays (as ``run_forward``); writes dq, dk, dv."""
    if call.algorithm == "flash1":
        flash1_backward(q, k, v, o, do, lse, dq, dk, dv, scale=call.scale, causal=call.causal,
                        block_sizes=call.block_sizes, mask=_device_layout(call), dropout=_dropout_args(call),
                        stream=stream)
    else:
        dsum = empty((call.batch_heads, call.n_q), np.float32)
        flash2_backward(q, k, v, o, do, lse, dq, dk, dv, dsum, scale=call.scale, causal=call.causal,
                        block_sizes=call.block_sizes, mask=_flash2_tile_lists(call, backward_mask_args),
                        dropout=_dropout_args(call), stream=stream)


def _per_head_layout(call):
    """The block mask's layout broadcast to one (T_r, T_c) grid per batch*head (bool), or None."""
    if call.block_mask is None:
        return None
    grid = call.block_mask.grid_for(call.n_q, call.n_k)
    return np.ascontiguousarray(
        np.broadcast_to(call.block_mask.layout, call.batch_shape + grid).reshape((call.batch_heads,) + grid))


def _device_layout(call):
    """The per-head layout as a uint8 device array, or None; kept on the mask for later calls."""
    if call.block_mask is None:
        return None
    return call.block_mask.prepared(("layout", call.batch_shape, call.n_q, call.n_k),
                                    lambda: cuda.to_device(_per_head_layout(call).view(np.uint8)))


def _flash2_tile_lists(call, build):
    """flash2's block-mask arguments from ``build`` (forward or backward tile lists), or None; kept on the mask."""
    if call.block_mask is None:
        return None
    key = (build.__name__, call.batch_shape, call.n_q, call.n_k, tuple(call.block_sizes), call.causal)
    return call.block_mask.prepared(key, lambda: build(
        _per_head_layout(call), _device_layout(call), call.block_mask.block_size, tuple(call.block_sizes),
        call.n_q, call.n_k, call.causal))


def _dropout_args(call):
    return dropout_kernel_args(call.dropout_p, call.seed) if call.dropout_p > 0 else None
