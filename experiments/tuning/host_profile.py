"""Where the host time of a call goes: loops of calls under cProfile.

``numba-flash bench --host`` says how long a call keeps the host; this
script says where that time goes, for the three calls it times at the
smallest size (1, 1, 128, 64) float16: the forward on torch tensors, the
forward on Numba device arrays, and a training step (forward and backward
through ``numba_flash.torch``), and the backward alone (in a step it runs on
autograd's device thread, out of the profiler's sight).  Prints, per call, the 15 functions with the
most time of their own; then, without the profiler (which inflates every
Python call), microseconds per call of the pieces a forward is made of, each
in a loop of its own: the plan lookup, a result from torch's allocator,
torch's current stream, one kernel launch, and the whole call; and a
training step's pieces: autograd's own floor (an identity Function),
torch's flash step and ours, with and without accumulation into .grad.
``decode``: the same for decoding calls (``attention_with_kv_cache``,
bfloat16, one new query, lengths on the GPU) at ``DECODE_SHAPES``, beside
the host time of torch SDPA's cuDNN and flash backends.  Needs a GPU and
torch; prints only.

    PYTHONPATH=$PWD python3 experiments/tuning/host_profile.py [decode]
"""
import cProfile
import pstats
import sys
import time

import torch
from numba import cuda

import numba_flash
import numba_flash.torch as nft

SHAPE = (1, 1, 128, 64)
CALLS = 2000
#: (B, H_q, H_kv, N, d) of decoding calls: MQA with splits, GQA with splits, GQA without.
DECODE_SHAPES = [(4, 32, 1, 8192, 128), (1, 32, 8, 2048, 128), (16, 32, 8, 8192, 128)]


def profiled(name, call, rows=15):
    """``call`` CALLS times under cProfile (after a warm-up): the functions with the most time of their own."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALLS):
        call()
    profile.disable()
    torch.cuda.synchronize()
    print(f"==== {name}: {CALLS} calls", flush=True)
    pstats.Stats(profile).sort_stats("tottime").print_stats(rows)


def decode():
    """Decoding calls' host time: where it goes (cProfile), then its pieces and torch's calls, no profiler."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from numba_flash import api
    from numba_flash.runtime import arrays

    for batch, heads, kv_heads, n, d in DECODE_SHAPES:
        q = torch.randn(batch, heads, 1, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        seqlens = torch.full((batch,), n, device="cuda", dtype=torch.int32)
        shape = (batch, heads, kv_heads, n, d)
        ours = lambda: numba_flash.attention_with_kv_cache(q, k, v, seqlens)   # noqa: E731
        profiled(f"decoding {shape}", ours, rows=12)
        options = (True, None, None, 0, 0, 0, None, None, None)
        plan = api._plan(api._CachePlan, (q, k, v), options)
        stream = arrays.current_torch_stream(q.device.index)
        rows = {
            "plan lookup (signatures and key)": lambda: api._plan(api._CachePlan, (q, k, v), options),
            "lengths' check (check_device_cache_seqlens)": lambda: api.check_device_cache_seqlens(
                arrays.describe("cache_seqlens", seqlens), plan.call, plan.device),
            "torch's current stream": lambda: plan.stream((q, k, v)),
            "torch.empty (the result)": lambda: plan.empty(plan.user_shape, plan.call.dtype, stream),
            "the scratch (per stream)": lambda: plan.scratch(stream),
            "the whole call (attention_with_kv_cache)": ours,
        }
        print(f"==== pieces of decoding {shape} ({plan.plan}), {CALLS} calls each, no profiler", flush=True)
        for name, call in rows.items():
            print(f"{per_call_us(call):8.2f} us  {name}", flush=True)
        for backend, name in ((SDPBackend.CUDNN_ATTENTION, "torch cuDNN"), (SDPBackend.FLASH_ATTENTION, "torch flash")):
            with sdpa_kernel(backend):
                try:
                    print(f"{per_call_us(lambda: sdpa(q, k, v, enable_gqa=heads != kv_heads)):8.2f} us  {name}",
                          flush=True)
                except RuntimeError as error:
                    print(f"     n/a  {name}: {str(error).splitlines()[0][:80]}", flush=True)


def main():
    if sys.argv[1:] == ["decode"]:
        decode()
        return
    q, k, v, grad = (torch.randn(SHAPE, device="cuda", dtype=torch.float16) for _ in range(4))
    trained = tuple(x.clone().requires_grad_() for x in (q, k, v))
    views = tuple(cuda.as_cuda_array(x) for x in (q, k, v))
    out, lse = numba_flash.attention(q, k, v, return_lse=True)
    calls = {
        "forward, torch tensors": lambda: numba_flash.attention(q, k, v),
        "forward, Numba arrays": lambda: numba_flash.attention(*views),
        "forward and backward (numba_flash.torch)": lambda: nft.attention(*trained).backward(grad),
        # The step's backward runs on autograd's device thread, which the profiler does not see: alone here.
        "backward alone (api.attention_backward)": lambda: numba_flash.attention_backward(q, k, v, out, lse, grad),
    }
    for name, call in calls.items():
        profiled(name, call)
    pieces(q, k, v)
    step_pieces(q, k, v, grad)


def per_call_us(call):
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / CALLS


def pieces(q, k, v):
    """The forward's pieces on torch tensors, each timed alone (host microseconds per call)."""
    from numba_flash import api
    from numba_flash.runtime import arrays

    options = (False, None, None, 0.0, "flash2", None)
    plan = api._plan(api._ForwardPlan, (q, k, v), options)
    stream = arrays.current_torch_stream(q.device.index)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device="cuda", dtype=torch.float32)
    rows = {
        "plan lookup (signatures and key)": lambda: api._plan(api._ForwardPlan, (q, k, v), options),
        "torch.empty (one result)": lambda: torch.empty(q.shape, device=q.device, dtype=q.dtype),
        "torch's current stream": lambda: arrays.current_torch_stream(q.device.index),
        "one launch (Launch.__call__)": lambda: plan.launch(stream, q, k, v, o, lse, 0, 0),
        "the whole forward (numba_flash.attention)": lambda: numba_flash.attention(q, k, v),
    }
    print(f"==== pieces of a forward at {SHAPE} float16, {CALLS} calls each, no profiler", flush=True)
    for name, call in rows.items():
        print(f"{per_call_us(call):8.2f} us  {name}", flush=True)



class _Identity(torch.autograd.Function):
    """The cheapest differentiable op of three inputs: what any custom op's training step costs at least."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, grad_out, grad_out


def step_pieces(q, k, v, grad):
    """A training step's pieces (host microseconds per step, no profiler): what autograd costs with any op,
    torch's own step, and ours, with and without gradient accumulation into .grad."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    trained = tuple(x.clone().requires_grad_() for x in (q, k, v))
    out, lse = numba_flash.attention(q, k, v, return_lse=True)

    def fresh(step):
        """The step with .grad cleared first, so the engine assigns instead of adding."""
        def call():
            for x in trained:
                x.grad = None
            step()
        return call

    rows = {
        "clearing three .grad fields": fresh(lambda: None),
        "autograd floor: an identity Function, forward + backward (accumulating)":
            lambda: _Identity.apply(*trained).backward(grad),
        "autograd floor, .grad cleared": fresh(lambda: _Identity.apply(*trained).backward(grad)),
        "autograd floor, torch.autograd.grad": lambda: torch.autograd.grad(_Identity.apply(*trained), trained, grad),
        "numba-flash backward alone (api.attention_backward)":
            lambda: numba_flash.attention_backward(q, k, v, out, lse, grad),
        "numba-flash forward through FlashAttentionFunction (no backward)": lambda: nft.attention(*trained),
        "numba-flash step (accumulating)": lambda: nft.attention(*trained).backward(grad),
        "numba-flash step, .grad cleared": fresh(lambda: nft.attention(*trained).backward(grad)),
        "numba-flash step, torch.autograd.grad": lambda: torch.autograd.grad(nft.attention(*trained), trained, grad),
    }
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        rows.update({
            "torch flash forward (requires_grad inputs)": lambda: sdpa(*trained),
            "torch flash step (accumulating)": lambda: sdpa(*trained).backward(grad),
            "torch flash step, .grad cleared": fresh(lambda: sdpa(*trained).backward(grad)),
            "torch flash step, torch.autograd.grad": lambda: torch.autograd.grad(sdpa(*trained), trained, grad),
        })
        print(f"==== a training step's pieces at {SHAPE} float16, {CALLS} calls each, no profiler", flush=True)
        for name, call in rows.items():
            print(f"{per_call_us(call):8.2f} us  {name}", flush=True)


if __name__ == "__main__":
    main()
