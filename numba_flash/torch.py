"""numba-flash for PyTorch: differentiable attention on torch tensors.

    import numba_flash.torch as nft
    out = nft.attention(q, k, v, causal=True)      # q, k, v: (..., N, d) CUDA tensors
    out.sum().backward()                            # gradients from the flash2 backward

``attention`` is a drop-in for ``torch.nn.functional.scaled_dot_product_attention``
without an attention-mask tensor (use ``causal`` and ``block_mask``).  On a GPU:

* zero-copy: the kernels read q, k, v and write O, lse and the gradients in
  the tensors' own memory (all allocated by torch's caching allocator);
* the kernels run on torch's current stream, ordered with the rest of the
  model's work;
* the forward saves q, k, v, O and lse (one float32 per row) for the
  backward, which recomputes P tile by tile: nothing N x N is ever stored;
* float32 and float16 (float32 accumulation), as ``numba_flash.attention``.

In Numba's CUDA simulator (no GPU) the same function takes CPU tensors and
runs the kernels in the simulator, through NumPy: slow, not zero-copy, but
the same code path for tests.

torch is an optional dependency: ``pip install torch``.
"""
import numpy as np
import torch
from numba import cuda

from . import api
from ._validation import check_attention_args
from .runtime.device import in_simulator

__all__ = ["attention", "FlashAttentionFunction"]


def _device_view(tensor):
    """A Numba view of a contiguous CUDA tensor (no copy)."""
    return cuda.as_cuda_array(tensor.detach())


class FlashAttentionFunction(torch.autograd.Function):
    """O = softmax(scale q k^T) v with numba-flash's forward and backward kernels."""

    @staticmethod
    def forward(ctx, q, k, v, options):
        if in_simulator():
            out, lse = api.attention(*(x.detach().numpy() for x in (q, k, v)), return_lse=True, **options)
            out, lse = torch.from_numpy(out), torch.from_numpy(lse)
        else:
            call = check_attention_args(q.detach(), k.detach(), v.detach(), **options)
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
            api.run_forward(call, *(_as_heads(x) for x in (q, k, v, out)), _as_rows(lse),
                            empty=_torch_allocator(q.device), stream=_current_stream(q))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        options = dict(ctx.options, block_sizes=None)  # the backward's own tiles
        grad_out = grad_out.contiguous()
        if in_simulator():
            grads = api.attention_backward(*(x.detach().numpy() for x in (q, k, v, out, lse, grad_out)), **options)
            dq, dk, dv = (torch.from_numpy(g) for g in grads)
        else:
            call = check_attention_args(q.detach(), k.detach(), v.detach(), backward=True, **options)
            dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
            api.run_backward(call, *(_as_heads(x) for x in (q, k, v, out, grad_out)), _as_rows(lse),
                             *(_as_heads(x) for x in (dq, dk, dv)), empty=_torch_allocator(q.device),
                             stream=_current_stream(q))
        return dq, dk, dv, None


def _as_heads(tensor):
    return _device_view(tensor).reshape(-1, tensor.shape[-2], tensor.shape[-1])


def _as_rows(tensor):
    return _device_view(tensor).reshape(-1, tensor.shape[-1])


def _current_stream(tensor):
    """torch's current stream on the tensor's device, as a Numba stream."""
    return cuda.external_stream(torch.cuda.current_stream(tensor.device).cuda_stream)


def _torch_allocator(device):
    """Scratch buffers from torch's caching allocator, as Numba views (the tensor lives as long as the view)."""
    torch_dtypes = {np.dtype(np.float32): torch.float32}

    def empty(shape, dtype):
        return _device_view(torch.empty(shape, dtype=torch_dtypes[np.dtype(dtype)], device=device))

    return empty


def attention(q, k, v, *, causal=False, scale=None, block_mask=None, dropout_p=0.0, seed=0, algorithm="flash2",
              block_sizes=None):
    """Differentiable ``numba_flash.attention`` on torch tensors (see the module docstring).

    q: (..., N_q, d), k and v: (..., N_k, d), all CUDA tensors (CPU tensors
    in the simulator) of one dtype, float32 or float16 (float16 needs
    algorithm="flash2").  Arguments as for ``numba_flash.attention``;
    ``block_sizes`` applies to the forward (the backward uses its own
    defaults).  Non-contiguous inputs are made contiguous first (a copy).
    Returns O with q's shape, dtype and device; ``O.backward()`` computes the
    gradients of q, k and v with ``algorithm``'s backward (flash2: the fast,
    deterministic one; flash1: Algorithm 4, float32).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        wanted = "cpu" if in_simulator() else "cuda"
        if x.device.type != wanted:
            raise TypeError(f"{name} must be a {wanted.upper()} tensor"
                            + (" (numba-flash is running in the CUDA simulator)" if in_simulator() else "")
                            + f", got one on {x.device}")
    if algorithm == "standard":
        raise ValueError("algorithm must be 'flash2' or 'flash1' (the algorithms with a backward), got 'standard'")
    options = dict(causal=causal, scale=scale, block_mask=block_mask, dropout_p=dropout_p, seed=seed,
                   algorithm=algorithm, block_sizes=block_sizes)
    return FlashAttentionFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), options)
