"""numba_flash.torch: the autograd function against float64 references and as a drop-in for SDPA.

Runs in both modes: CPU tensors through the simulator, CUDA tensors on a GPU
(zero-copy, on torch's current stream).
"""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_flash
import numba_flash.torch as nft
import reference
from numba_flash import BlockMask, dropout_mask
from strategies import BFLOAT16, SIZES, VARLEN_DTYPES, dtype_name, head_dims, packed_problems
from tolerances import (FLOAT64_AGREEMENT, MODEL_GRADIENT_RTOL, MODEL_LOSS_RTOL, assert_close_to_reference,
                        backward_tolerance)

DEVICE = "cpu" if numba_flash.in_simulator() else "cuda"
TORCH_DTYPES = {np.float32: torch.float32, np.float16: torch.float16}


def tensor(x, requires_grad=True):
    return torch.tensor(x, device=DEVICE, requires_grad=requires_grad)


def check_gradients(q, k, v, do, grads, dtype, scale=None, causal=False, mask=None, keep=None, dropout_p=0.0):
    """grads (dq, dk, dv) against the float64 reference, under the backward's derived tolerance."""
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    out, _ = reference.attention(q, k, v, scale=scale, causal=causal, mask=mask, dropout_keep=keep, dropout_p=dropout_p)
    expected = reference.attention_backward(q, k, v, do, scale=scale, causal=causal, mask=mask, dropout_keep=keep,
                                            dropout_p=dropout_p)
    weights = reference.softmax(reference.masked_scores(q, k, scale=scale, causal=causal, mask=mask))
    tolerances = backward_tolerance(q, k, v, out.astype(dtype), do, scale, weights, 1 / (1 - dropout_p), dtype=dtype)
    for name, got, want, tol in zip(("dq", "dk", "dv"), grads, expected, tolerances):
        got = got.detach().cpu().double().numpy()
        err = float(np.abs(got - want).max())
        assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g}"


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@settings(max_examples=max(4, settings.default.max_examples // 2))  # each example runs a forward and a backward
@given(data=st.data())
def test_forward_and_gradients_match_float64(dtype, data):
    batch, heads = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    n_q, n_k = data.draw(st.integers(1, SIZES.max_n["flash2"])), data.draw(st.integers(1, SIZES.max_n["flash2"]))
    d = data.draw(head_dims())
    causal = data.draw(st.booleans())
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    q = rng.standard_normal((batch, heads, n_q, d)).astype(dtype)
    k, v = (rng.standard_normal((batch, heads, n_k, d)).astype(dtype) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(dtype)
    tq, tk, tv = tensor(q), tensor(k), tensor(v)
    out = nft.attention(tq, tk, tv, causal=causal)
    assert out.shape == tq.shape and out.dtype == TORCH_DTYPES[dtype] and out.device.type == DEVICE
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal)
    assert_close_to_reference(out.detach().cpu().numpy(), None, ref_out, ref_lse, q, k, v, 1 / np.sqrt(d), dtype)
    out.backward(tensor(do, requires_grad=False))
    check_gradients(q, k, v, do, (tq.grad, tk.grad, tv.grad), dtype, causal=causal)


def test_torch_math_attention_in_float64_agrees_with_the_reference():
    # The reference the other tests use is torch's own math attention in float64.
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 9, 8)) for _ in range(3))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        torch_out = torch.nn.functional.scaled_dot_product_attention(*(torch.tensor(x) for x in (q, k, v)),
                                                                     is_causal=True)
    np.testing.assert_allclose(torch_out.numpy(), reference.attention(q, k, v, causal=True)[0], rtol=FLOAT64_AGREEMENT, atol=FLOAT64_AGREEMENT)


def test_dropout_and_block_masks_pass_through_autograd():
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((1, 2, 20, 8)).astype(np.float32) for _ in range(4))
    bm = BlockMask(rng.random((2, 3, 3)) < 0.7, (8, 8))
    tq, tk, tv = tensor(q), tensor(k), tensor(v)
    out = nft.attention(tq, tk, tv, block_mask=bm, dropout_p=0.25, seed=99)
    keep = dropout_mask(q.shape[:-1] + (20,), 0.25, 99)
    dense = bm.to_dense(20, 20)
    ref_out, ref_lse = reference.attention(q, k, v, mask=dense, dropout_keep=keep, dropout_p=0.25)
    assert_close_to_reference(out.detach().cpu().numpy(), None, ref_out, ref_lse, q, k, v, 1 / np.sqrt(8),
                              weight_scale=1 / 0.75)
    out.backward(tensor(do, requires_grad=False))
    check_gradients(q, k, v, do, (tq.grad, tk.grad, tv.grad), np.float32, mask=dense, keep=keep, dropout_p=0.25)


class Block(torch.nn.Module):
    """A pre-norm transformer block whose attention function is a parameter."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))

    def forward(self, x, attention):
        batch, n, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, n, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = attention(q, k, v).transpose(1, 2).reshape(batch, n, width)
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


def test_drop_in_for_scaled_dot_product_attention_in_a_transformer_block():
    torch.manual_seed(0)
    width, heads, n = (16, 2, 12) if numba_flash.in_simulator() else (256, 4, 200)
    block = Block(width, heads).to(DEVICE)
    x = torch.randn(2, n, width, device=DEVICE)
    target = torch.randn(2, n, width, device=DEVICE)

    def loss_and_grads(attention):
        block.zero_grad()
        loss = torch.nn.functional.mse_loss(block(x, attention), target)
        loss.backward()
        return loss.item(), {name: p.grad.clone() for name, p in block.named_parameters()}

    def sdpa(q, k, v):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    torch.backends.cuda.matmul.allow_tf32 = False  # torch's float32 reference in float32
    ref_loss, ref_grads = loss_and_grads(sdpa)
    loss, grads = loss_and_grads(lambda q, k, v: nft.attention(q, k, v, causal=True))
    # Both sides compute in float32 and differ only in summation order inside the attention.
    assert abs(loss - ref_loss) <= MODEL_LOSS_RTOL * abs(ref_loss)
    for name, ref in ref_grads.items():
        err = float((grads[name] - ref).abs().max())
        assert err <= MODEL_GRADIENT_RTOL * float(ref.abs().max()), f"{name}: {err:.3g}"


def test_bad_tensors_are_rejected_before_any_launch():
    good = torch.zeros(1, 4, 8, device=DEVICE)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        nft.attention(np.zeros((1, 4, 8), np.float32), good, good)
    if not numba_flash.in_simulator():  # CPU tensors are welcome on a GPU, but not mixed with CUDA ones
        with pytest.raises(ValueError, match="q, k, v must be on one device, got q on cuda:0, k on cpu"):
            nft.attention(good, torch.zeros(1, 4, 8), good)
    with pytest.raises(TypeError, match="k must be a (CUDA or )?CPU tensor.*got one on meta"):
        nft.attention(good, torch.zeros(1, 4, 8, device="meta"), good)
    with pytest.raises(ValueError, match="algorithm"):
        nft.attention(good, good, good, algorithm="standard")
    with pytest.raises(TypeError, match="dtype"):
        nft.attention(good.double(), good.double(), good.double())


@pytest.mark.gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cpu_tensors_on_a_gpu_are_computed_there_and_come_back(dtype):
    # CPU tensors in, CPU tensors out (O and every gradient, in the inputs' dtype), with the bits of the same
    # call on CUDA tensors: eagerly, under torch.compile, and for packed sequences (cu_seqlens on the CPU too).
    torch.manual_seed(5)
    q = torch.randn(2, 4, 77, 64, dtype=dtype)
    k, v = torch.randn(2, 2, 77, 64, dtype=dtype), torch.randn(2, 2, 77, 64, dtype=dtype)   # grouped heads
    cu = torch.tensor([0, 30, 77], dtype=torch.int32)

    def dense(q, k, v):
        return nft.attention(q, k, v, causal=True)

    def packed(q, k, v):   # the batch's two heads of q as two packed sequences of 77 rows
        pack = [x[0].transpose(0, 1) for x in (q, k, v)]
        return nft.attention_varlen(*pack, cu.to(q.device), cu.to(q.device), causal=True)

    for fn in (dense, torch.compile(dense, fullgraph=True, backend="aot_eager"), packed):
        results = {}
        for device in ("cpu", "cuda"):
            leaves = [x.to(device).detach().requires_grad_() for x in (q, k, v)]   # leaves of their own
            out = fn(*leaves)
            out.backward(torch.ones_like(out))
            results[device] = [out] + [x.grad for x in leaves]
        for name, got, want in zip(("out", "dq", "dk", "dv"), results["cpu"], results["cuda"]):
            assert got.device.type == "cpu" and got.dtype == dtype, (name, got.device, got.dtype)
            assert torch.equal(got, want.cpu()), (name, float((got.float() - want.cpu().float()).abs().max()))


@pytest.mark.gpu_only
def test_a_backward_on_autograds_thread_with_memory_from_torchs_cache():
    # torch binds its CUDA context to a thread at the thread's first runtime call.  A fresh process: a backward
    # of CPU tensors (run on the GPU from this thread) leaves its memory in torch's cache; the backward of CUDA
    # tensors then runs on autograd's device thread, whose every allocation comes from that cache, so our
    # launches are that thread's first CUDA work (CUDA_ERROR_INVALID_CONTEXT before the plan bound a context).
    code = textwrap.dedent("""
        import torch
        import numba_flash.torch as nft
        inputs = [torch.randn(2, 4, 77, 64) for _ in range(3)]
        for device in ("cpu", "cuda"):
            leaves = [x.to(device).detach().requires_grad_() for x in inputs]   # leaves of their own
            out = nft.attention(*leaves, causal=True)
            out.backward(torch.ones_like(out))
            print(device, "ok", float(leaves[0].grad.abs().sum()) > 0)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "cuda ok True" in result.stdout, result.stdout + result.stderr[-3000:]


@pytest.mark.gpu_only
def test_kernels_run_on_torchs_current_stream():
    rng = np.random.default_rng(4)
    q, k, v = (torch.tensor(rng.standard_normal((2, 2, 300, 64)).astype(np.float32), device="cuda") for _ in range(3))
    expected = nft.attention(q, k, v)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy: a launch on another stream would overtake it
        q2 = q * 1  # made on the side stream, after the sleep
        out = nft.attention(q2, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out, expected)


class GroupedBlock(torch.nn.Module):
    """Attention as models hold it: projections to (B, N, H, d), grouped key/value heads, no copies."""

    def __init__(self, width, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.q = torch.nn.Linear(width, width)
        self.kv = torch.nn.Linear(width, 2 * kv_heads * self.head_dim)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x, attention):
        batch, n, _ = x.shape
        q = self.q(x).view(batch, n, self.heads, self.head_dim).transpose(1, 2)       # strided views
        k, v = self.kv(x).view(batch, n, 2, self.kv_heads, self.head_dim).unbind(2)
        y = attention(q, k.transpose(1, 2), v.transpose(1, 2))
        return self.proj(y.transpose(1, 2).reshape(batch, n, -1))


def sdpa_gqa(q, k, v):
    """torch's math attention with enable_gqa semantics (its reference)."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_grouped_strided_heads_and_16_bit_types_through_autograd(dtype):
    torch.manual_seed(1)
    width, heads, kv_heads, n = (32, 4, 2, 12) if numba_flash.in_simulator() else (256, 8, 2, 300)
    block = GroupedBlock(width, heads, kv_heads).to(DEVICE, dtype)
    x = torch.randn(2, n, width, device=DEVICE, dtype=dtype)

    def output_and_grads(attention):
        block.zero_grad()
        y = block(x, attention)
        y.float().square().mean().backward()
        return y.detach().double(), {name: p.grad.double() for name, p in block.named_parameters()}

    out, grads = output_and_grads(lambda q, k, v: nft.attention(q, k, v, causal=True))
    torch_out, torch_grads = output_and_grads(sdpa_gqa)  # torch's own attention in the same dtype
    block64 = GroupedBlock(width, heads, kv_heads).to(DEVICE, torch.float64)
    block64.load_state_dict(block.state_dict())
    block, x = block64, x.double()
    ref_out, ref_grads = output_and_grads(sdpa_gqa)
    # The model's own rounding in dtype dominates both: ours must be as close to float64 as torch's
    # attention in the same dtype is, within a factor of 4 (and one ulp of the largest entry).
    u = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]

    def close_as_torch(got, theirs, ref, name):
        err, torch_err = float((got - ref).abs().max()), float((theirs - ref).abs().max())
        assert err <= 4 * torch_err + u * float(ref.abs().max()), f"{name}: {err:.3g} (torch: {torch_err:.3g})"

    close_as_torch(out, torch_out, ref_out, "output")
    for name, ref in ref_grads.items():
        close_as_torch(grads[name], torch_grads[name], ref, name)


@pytest.mark.gpu_only
def test_strided_inputs_are_read_in_place():
    # A (B, N, H, d) tensor viewed as (B, H, N, d) reaches the kernel with no copy: torch records no
    # allocation for it (the only new memory is O and lse).
    x = torch.randn(2, 256, 4, 64, device="cuda")
    q = x.transpose(1, 2)
    nft.attention(q, q, q)  # plan and compile
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    out = nft.attention(q, q, q)
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    assert allocations == 2, f"{allocations} allocations (O and lse expected)"
    torch.testing.assert_close(out, nft.attention(q.contiguous(), q.contiguous(), q.contiguous()), rtol=0, atol=0)


def test_torch_compile_compiles_a_model_that_calls_it():
    # numba_flash::attention is a custom operator: Dynamo traces through it (fullgraph: no graph break),
    # and the compiled model gives eager's results.
    torch._dynamo.reset()
    torch.manual_seed(2)
    width, heads, n = (16, 2, 12) if numba_flash.in_simulator() else (128, 4, 200)
    block = Block(width, heads).to(DEVICE)
    x = torch.randn(2, n, width, device=DEVICE, requires_grad=True)
    bm = BlockMask(np.tril(np.ones((-(-n // 8), -(-n // 8)), bool)), (8, 8))

    def attention(q, k, v):
        return nft.attention(q, k, v, causal=True, block_mask=bm, dropout_p=0.1, seed=7)

    def run(model):
        out = model(x, attention)
        grads = torch.autograd.grad(out.square().sum(), [x] + list(block.parameters()))
        return out, grads

    eager_out, eager_grads = run(block)
    # aot_eager runs the traced graph with eager kernels: the same bits.  Inductor (GPU) also generates
    # its own kernels for the rest of the block, whose float32 sums round differently.
    for backend in ("aot_eager",) if numba_flash.in_simulator() else ("aot_eager", "inductor"):
        torch._dynamo.reset()
        out, grads = run(torch.compile(block, fullgraph=True, backend=backend))
        for got, want in zip((out,) + grads, (eager_out,) + eager_grads):
            if backend == "aot_eager":
                assert torch.equal(got, want)
            else:
                assert float((got - want).abs().max()) <= MODEL_GRADIENT_RTOL * float(want.abs().max())


def test_a_compiled_graphs_first_call_already_has_its_block_mask():
    # The mask's key is given when it is made (``numba_flash._registry``), so Dynamo reads a constant: a registration
    # traced as plain code was a side effect replayed after the graph ran, and the first call ran without the mask.
    # The mask here is not implied by anything else in the call, so dropping it changes the result.  (torch 2.11's
    # Dynamo also refused the registration written as ``assume_constant_result``: a BlockMask is no constant.)
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 24, 16, device=DEVICE) for _ in range(3))
    bm = BlockMask(np.eye(3, dtype=bool) | np.eye(3, k=1, dtype=bool), (8, 8))
    compiled = torch.compile(lambda q, k, v: nft.attention(q, k, v, block_mask=bm), fullgraph=True,
                             backend="aot_eager")
    want = nft.attention(q, k, v, block_mask=bm)
    assert not torch.equal(want, nft.attention(q, k, v))
    assert torch.equal(compiled(q, k, v), want)


def test_the_custom_operator_passes_torchs_own_checks():
    # torch.library.opcheck: schema, fake (meta) implementation, autograd registration.
    q, k, v = (torch.randn(1, 2, 16, 8, device=DEVICE, requires_grad=True) for _ in range(3))
    args = (q, k, v, "true", None, -1, 0.0, 0, 0, "flash2", None, True, -1, -1, [])
    torch.library.opcheck(torch.ops.numba_flash.attention.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.gpu_only
def test_cuda_graph_replays_a_block_bit_for_bit():
    # Forward and backward of a transformer block captured with torch.cuda.graph and replayed equal
    # the eager step bit for bit (the same dropout seed: the same mask).
    torch.manual_seed(3)
    block = Block(128, 4).cuda()
    static_x = torch.randn(2, 256, 128, device="cuda", requires_grad=True)

    def step():
        out = block(static_x, lambda q, k, v: nft.attention(q, k, v, causal=True, dropout_p=0.1, seed=11))
        out.square().mean().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream: plans, compilation, allocator
        for _ in range(3):
            block.zero_grad(set_to_none=True)
            static_x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    block.zero_grad(set_to_none=True)
    static_x.grad = None
    eager_out = step().detach().clone()
    eager_grads = [p.grad.clone() for p in block.parameters()] + [static_x.grad.clone()]

    block.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    for p in block.parameters():
        p.grad.zero_()
    static_x.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, eager_out)
    for got, want in zip([p.grad for p in block.parameters()] + [static_x.grad], eager_grads):
        assert torch.equal(got, want)


def _torch_tensor(x, requires_grad=False):
    """A NumPy array (bfloat16 through ml_dtypes) as a tensor on DEVICE."""
    if x.dtype == BFLOAT16:
        t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to(DEVICE).requires_grad_(requires_grad)


def _numpy(t):
    t = t.detach().cpu()
    return t.view(torch.int16).numpy().view(BFLOAT16) if t.dtype == torch.bfloat16 else t.numpy()


@pytest.mark.parametrize("dtype", VARLEN_DTYPES, ids=dtype_name)
# Each example: three forwards and three backwards.  In the simulator two a dtype (CI's time; six in all): what is
# tested here is the plumbing, the kernels' results against float64 are test_varlen.py's.
@settings(max_examples=2 if numba_flash.in_simulator() else max(3, settings.default.max_examples // 3))
@given(data=st.data())
def test_packed_sequences_through_autograd_and_torch_compile(dtype, data):
    # The autograd function and the custom operator give the bits of numba_flash.attention_varlen and
    # attention_varlen_backward (tested against float64 in test_varlen.py), with cu_seqlens on the device.
    p = data.draw(packed_problems(dtype=dtype))
    do = _torch_tensor(np.asarray(np.random.default_rng(0).standard_normal(p.q.shape), dtype=dtype))
    cu_q, cu_k = _torch_tensor(p.cu_q), _torch_tensor(p.cu_k)
    options = dict(causal=p.causal, scale=p.scale)
    want_out, want_lse = numba_flash.attention_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, return_lse=True, **options)
    want_grads = numba_flash.attention_varlen_backward(p.q, p.k, p.v, want_out, want_lse, _numpy(do), p.cu_q, p.cu_k,
                                                       **options)

    def run(attention):
        q, k, v = (_torch_tensor(x, requires_grad=True) for x in (p.q, p.k, p.v))
        out = attention(q, k, v)
        out.backward(do)
        return (out,) + tuple(x.grad for x in (q, k, v))

    def varlen(q, k, v):
        return nft.attention_varlen(q, k, v, cu_q, cu_k, **options)

    torch._dynamo.reset()
    for results in (run(varlen), run(torch.compile(varlen, fullgraph=True, backend="aot_eager"))):
        for got, want in zip(results, (want_out,) + tuple(want_grads)):
            np.testing.assert_array_equal(_numpy(got).view(np.uint8), np.asarray(want).view(np.uint8))


def test_a_key_whose_mask_is_gone_is_an_error_not_a_call_without_the_mask():
    import gc

    from numba_flash._registry import registered

    bm = BlockMask(np.eye(2, dtype=bool), (8, 8))
    key = bm.key
    assert registered(key) is bm and registered(-1) is None
    del bm
    gc.collect()
    with pytest.raises(RuntimeError, match=f"key {key} no longer exists"):
        registered(key)
