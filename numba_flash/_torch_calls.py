"""What the torch faces share: checking tensors and running the API's forward and backward on them.

``numba_flash.torch`` (autograd, custom operators) and ``numba_flash.ring``
(ring attention) both call the kernels through this module, and neither
imports the other for it.

Where the tensors live:

* CUDA tensors on a GPU: the API takes and returns torch tensors itself
  (zero copy, torch's current stream);
* CPU tensors on a GPU: copied to the current CUDA device, computed there,
  and the results copied back to the CPU in the inputs' dtype;
* CPU tensors in Numba's CUDA simulator (no GPU): through NumPy (bfloat16 as
  its bits, through ml_dtypes), the same code path as on a GPU for tests.
"""
import ml_dtypes
import numpy as np

from . import api
from ._optional import require
from .runtime.device import in_simulator

torch = require("torch", "torch", "numba_flash.torch")

#: (forward, backward) of the API, for dense calls and for packed variable-length ones.
_API = {False: (api.attention, api.attention_backward), True: (api.attention_varlen, api.attention_varlen_backward)}


def check_tensors(named):
    """Torch tensors, all on one device: CUDA or CPU on a GPU, CPU in the simulator."""
    devices = set()
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if in_simulator() and x.device.type != "cpu":
            raise TypeError(f"{name} must be a CPU tensor (numba-flash is running in the CUDA simulator), "
                            f"got one on {x.device}")
        if x.device.type not in ("cpu", "cuda"):
            raise TypeError(f"{name} must be a CUDA or CPU tensor, got one on {x.device}")
        devices.add(x.device)
    if len(devices) > 1:
        raise ValueError(f"{', '.join(name for name, _ in named)} must be on one device, got "
                         f"{', '.join(f'{name} on {x.device}' for name, x in named)}")


def _run(fn, tensors, **options):
    """``fn`` (a function of the API) on torch tensors, torch tensors back on the inputs' device (None stays None)."""
    if in_simulator():
        results = fn(*(_to_numpy(x) for x in tensors), **options)
        return None if results is None else tuple(_from_numpy(x) for x in _results(results))
    if tensors[0].device.type == "cuda":
        return fn(*tensors, **options)
    gpu = torch.device("cuda", torch.cuda.current_device())
    results = fn(*(x.to(gpu) for x in tensors), **options)
    return None if results is None else tuple(x.cpu() for x in _results(results))


def _results(results):
    """An API function's results as a tuple (the forward with return_lse and the backward give tuples)."""
    return results if isinstance(results, tuple) else (results,)


def _to_numpy(x):
    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def _from_numpy(x):
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x))


def forward(q, k, v, options, sequences=()):
    """(O, lse) of ``api.attention`` (or ``attention_varlen`` with ``sequences`` = (cu_seqlens_q, cu_seqlens_k))."""
    options = {name: value for name, value in options.items() if name != "deterministic"}   # the backward's
    return _run(_API[bool(sequences)][0], (q, k, v) + tuple(sequences), return_lse=True, **options)


def backward(q, k, v, out, lse, grad_out, options, sequences=()):
    """(dq, dk, dv) of ``api.attention_backward`` (or ``attention_varlen_backward``), the backward's own tiles."""
    options = dict(options, block_sizes=None)
    return _run(_API[bool(sequences)][1], (q, k, v, out, lse, _strided(grad_out)) + tuple(sequences), **options)


def backward_and_table_sums(q, k, v, out, lse, grad_out, options):
    """(dq, dk, dv, sums) of ``api._attention_backward_and_table_sums`` (the relative-bias table's gradient summed by
    the dQ kernel, to be added over axes 0 and 2), or None where the call's backward does not sum it."""
    options = {name: options.get(name) for name in ("causal", "scale", "block_mask", "algorithm", "deterministic",
                                                     "score_mod")}
    return _run(api._attention_backward_and_table_sums, (q, k, v, out, lse, _strided(grad_out)), **options)


def _strided(grad_out):
    """dL/dO with a contiguous last dimension (the expanded gradient of out.sum() has every stride 0)."""
    return grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
