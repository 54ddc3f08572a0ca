"""The public API of numba-flash."""
import numpy as np
from numba import cuda

from . import _arrays
from ._validation import check_attention_args
from .kernels.flash1_forward import flash1_forward
from .kernels.flash2_forward import flash2_forward
from .kernels.standard_attention import standard_attention


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
        device's opt-in shared memory; default measured per (d, dtype).
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
    dropout_p, seed
        Reserved for dropout (not implemented yet).

    Returns
    -------
    O, or (O, lse) with ``return_lse=True``.
    """
    call = check_attention_args(q, k, v, causal=causal, scale=scale, block_mask=block_mask,
                                dropout_p=dropout_p, seed=seed, algorithm=algorithm,
                                block_sizes=block_sizes)
    q3, k3, v3 = (_arrays.as_heads(x, call.on_device) for x in (q, k, v))
    bh, n_q, n_k, d = call.batch_heads, call.n_q, call.n_k, call.head_dim
    o = _arrays.empty((bh, n_q, d), call.dtype)
    lse = _arrays.empty((bh, n_q), np.float32)
    layout = None
    if call.block_mask is not None:  # one (T_r, T_c) layout per batch*head
        grid = call.block_mask.grid_for(n_q, n_k)
        layout = np.ascontiguousarray(
            np.broadcast_to(call.block_mask.layout, call.batch_shape + grid).reshape((bh,) + grid))
    if call.algorithm == "standard":
        s = _arrays.empty((bh, n_q, n_k), np.float32)
        p = _arrays.empty((bh, n_q, n_k), np.float32)
        mask = None if layout is None else (cuda.to_device(layout.view(np.uint8)), call.block_mask.block_size)
        standard_attention(q3, k3, v3, o, lse, s, p, scale=call.scale, causal=call.causal, mask=mask)
    elif call.algorithm == "flash1":
        l = _arrays.empty((bh, n_q), np.float32)
        m = _arrays.empty((bh, n_q), np.float32)
        flash1_forward(q3, k3, v3, o, l, m, lse, scale=call.scale, causal=call.causal,
                       block_sizes=call.block_sizes,
                       mask=None if layout is None else cuda.to_device(layout.view(np.uint8)))
    else:
        flash2_forward(q3, k3, v3, o, lse, scale=call.scale, causal=call.causal, block_sizes=call.block_sizes,
                       mask=None if layout is None else (layout, call.block_mask.block_size))
    out = _arrays.deliver(o, call.batch_shape, call.on_device)
    if return_lse:
        return out, _arrays.deliver(lse, call.batch_shape, call.on_device)
    return out
