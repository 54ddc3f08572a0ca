"""Packed sequences (``attention_varlen`` and its backward) on the Hopper kernels (``kernels/hopper``, VARLEN), against
the float64 reference per sequence (``reference/varlen.py``), and which kernels ``algorithm="flash2"`` picks for them.

In the simulator the wgmma kernels run through ``wgmma.py``'s twins, every thread of a block a Python thread, so the
shapes stay within two tiles each way and the examples are few (the whole file takes well under a minute on one core
in the ``sim`` profile); on a Hopper GPU (the ``gpu`` profile) the same tests draw longer sequences, every head dim of
the kernels' scope and more examples, with strided operands."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_flash import mods
import reference
from strategies import cumulative
from test_hopper import _where
from tolerances import assert_close_to_reference, backward_tolerance

#: Causal alignments as ``attention_varlen`` spells them: True is bottom-right, as flash-attn's varlen.
CAUSAL = (False, True, "top_left", "bottom_right")
needs_wgmma = pytest.mark.skipif(_where() is None, reason="the wgmma kernels need a Hopper GPU (sm_90a) or the "
                                                          "simulator")


def alignment(causal):
    """One sequence's causal argument as ``attention`` spells it (True: bottom-right)."""
    return "bottom_right" if causal is True else causal


class Packed:
    """A packed batch: q (total_q, H_q, d), k and v (total_k, H_kv, d) as host arrays, the bounds, and ``strided``:
    whether, on a GPU, the operands are views of wider rows and heads (padding between heads and rows)."""

    def __init__(self, lengths_q, lengths_k, heads, kv_heads, d, dtype, causal, seed, strided=False):
        rng = np.random.default_rng(seed)
        self.cu_q, self.cu_k = cumulative(lengths_q), cumulative(lengths_k)
        self.q = rng.standard_normal((sum(lengths_q), heads, d)).astype(dtype)
        self.k, self.v = (rng.standard_normal((sum(lengths_k), kv_heads, d)).astype(dtype) for _ in range(2))
        self.do = rng.standard_normal(self.q.shape).astype(dtype)
        self.causal, self.dtype, self.strided = causal, dtype, strided
        self.batch = len(lengths_q)

    def rows(self, b):
        return slice(self.cu_q[b], self.cu_q[b + 1])

    def keys(self, b):
        return slice(self.cu_k[b], self.cu_k[b + 1])

    def operands(self, *xs):
        """xs as the call takes them: host arrays in the simulator; on a Hopper GPU torch tensors, views of wider
        heads and rows where ``strided`` (row stride and head stride multiples of 16 bytes, as the kernels need)."""
        if _where() != "hopper":
            return xs
        import torch

        def device(x):
            if x.dtype == np.float32:
                return torch.from_numpy(x).cuda()
            kind = torch.float16 if x.dtype == np.float16 else torch.bfloat16
            if not self.strided:
                return torch.from_numpy(x.view(np.int16)).cuda().view(kind)
            wide = np.zeros((x.shape[0], x.shape[1] + 1, x.shape[2] + 8), x.dtype)
            wide[:, :x.shape[1], :x.shape[2]] = x
            return torch.from_numpy(wide.view(np.int16)).cuda().view(kind)[:, :x.shape[1], :x.shape[2]]

        return tuple(device(x) for x in xs)


def to_host(x):
    if hasattr(x, "cpu"):
        from test_hopper import to_host as tensor_to_host
        return tensor_to_host(x)
    return np.asarray(x)


@st.composite
def packed_batches(draw, kernel="backward"):
    """1-3 sequences (4 on a GPU) of 0 to ``longest`` queries and keys each, lengths 0 and 1 often, N_q != N_k per
    sequence, grouped heads, a head dim of the ``kernel``'s scope (the simulator: one on the 64- and one on the
    128-column layout), float16 or bfloat16, every causal alignment."""
    import ml_dtypes

    from numba_flash.kernels.hopper.common import BLOCK_N, FORWARD_HEAD_DIMS, HEAD_DIMS

    hopper = _where() == "hopper"
    longest = 3 * BLOCK_N + 9 if hopper else BLOCK_N + 6   # the simulator: at most two tiles each way
    batch = draw(st.integers(1, 4 if hopper else 3))
    length = st.one_of(st.sampled_from([0, 1]), st.integers(0, longest))
    lengths_q = draw(st.lists(length, min_size=batch, max_size=batch).filter(any))
    lengths_k = draw(st.lists(length, min_size=batch, max_size=batch).filter(any))
    kv_heads = draw(st.integers(1, 2 if hopper else 1))
    group = draw(st.sampled_from([1, 2, 3] if hopper else [1, 2]))
    head_dims = FORWARD_HEAD_DIMS if kernel == "forward" else HEAD_DIMS
    d = draw(st.sampled_from(head_dims if hopper else (16, 80)))   # 80: the 128-column layout, its pad zero
    dtype = draw(st.sampled_from([np.float16, ml_dtypes.bfloat16]))
    causal = draw(st.sampled_from(CAUSAL))
    return Packed(lengths_q, lengths_k, kv_heads * group, kv_heads, d, dtype, causal, draw(st.integers(0, 2 ** 32 - 1)),
                  strided=draw(st.booleans()))


def check_forward(p, out, lse):
    """(O, lse) of a packed call against the float64 reference, sequence by sequence: a sequence without keys gives
    O = 0 and lse = -inf exactly."""
    heads, d = p.q.shape[1], p.q.shape[2]
    assert out.shape == p.q.shape and out.dtype == p.dtype and lse.shape == (heads, p.q.shape[0])
    for b in range(p.batch):
        rows, keys = p.rows(b), p.keys(b)
        if rows.stop == rows.start:
            continue
        if keys.stop == keys.start:
            assert np.all(out[rows].astype(np.float32) == 0) and np.all(np.isneginf(lse[:, rows])), f"sequence {b}"
            continue
        q = np.swapaxes(p.q[rows], 0, 1).astype(np.float64)
        k, v = (reference.repeat_kv(np.swapaxes(x[keys], 0, 1).astype(np.float64), heads) for x in (p.k, p.v))
        ref_out, ref_lse = reference.attention(q, k, v, causal=alignment(p.causal))
        assert_close_to_reference(np.swapaxes(out[rows], 0, 1), lse[:, rows], ref_out, ref_lse, q, k, v,
                                  1 / np.sqrt(d), p.dtype)


def run_forward(p, overlap=False, warpgroups=1):
    """The wgmma forward of p, its products waited for at once or overlapping the softmax, in blocks of one
    warpgroup or two (``strategies.wgmma_loop``)."""
    import numba_flash
    from strategies import wgmma_loop

    q, k, v = p.operands(p.q, p.k, p.v)
    with wgmma_loop(overlap, warpgroups):
        out, lse = numba_flash.attention_varlen(q, k, v, p.cu_q, p.cu_k, causal=p.causal, algorithm="wgmma",
                                                return_lse=True)
    return to_host(out), to_host(lse)


@needs_wgmma
@settings(max_examples=max(3, settings.default.max_examples // 2))
@given(p=packed_batches("forward"), overlap=st.booleans(), warpgroups=st.sampled_from([1, 2]))
def test_the_wgmma_forward_of_packed_sequences_matches_the_float64_reference(p, overlap, warpgroups):
    """Both loops and warpgroup counts (a block of two warpgroups: 128 query rows of one sequence)."""
    check_forward(p, *run_forward(p, overlap, warpgroups))


@needs_wgmma
@pytest.mark.parametrize("d, warpgroups", [(16, 1), (256, 2)])
def test_the_wgmma_forward_of_packed_sequences_covers_the_edges(d, warpgroups):
    """Fixed edges: an empty sequence, one without keys, one of a single query and key, one over two query tiles
    and two key tiles (N_q != N_k, ragged), grouped heads, bottom-right causal (queries past the keys see none of
    them in the first rows); on the 64- and the 256-column layout (there in blocks of two warpgroups, its default)."""
    p = Packed([0, 3, 1, 70], [4, 0, 1, 66], 2, 1, d, np.float16, True, 1, strided=True)
    check_forward(p, *run_forward(p, warpgroups=warpgroups))


def check_backward(p, grads):
    """(dQ, dK, dV) of a packed call against the float64 reference, sequence by sequence within
    ``backward_tolerance`` (dK and dV summed over each group of query heads): a sequence in which no query sees a
    key has gradients exactly 0."""
    heads, d = p.q.shape[1], p.q.shape[2]
    group = heads // p.k.shape[1]
    for got, like in zip(grads, (p.q, p.k, p.v)):
        assert got.shape == like.shape and got.dtype == p.dtype, (got.shape, got.dtype)
    for b in range(p.batch):
        rows, keys = p.rows(b), p.keys(b)
        if rows.stop == rows.start or keys.stop == keys.start:
            for grad, where in zip(grads, (rows, keys, keys)):
                assert np.all(grad[where].astype(np.float32) == 0), f"sequence {b}: a gradient without attention"
            continue
        q, do = (np.swapaxes(x[rows], 0, 1).astype(np.float64) for x in (p.q, p.do))
        k, v = (np.swapaxes(x[keys], 0, 1).astype(np.float64) for x in (p.k, p.v))
        k_all, v_all = reference.repeat_kv(k, heads), reference.repeat_kv(v, heads)
        out, _ = reference.attention(q, k_all, v_all, causal=alignment(p.causal))
        expected = reference.attention_backward(q, k, v, do, causal=alignment(p.causal))
        weights = reference.softmax(reference.masked_scores(q, k_all, causal=alignment(p.causal)))
        tolerances = backward_tolerance(q, k_all, v_all, out.astype(p.dtype), do, 1 / np.sqrt(d), weights,
                                        dtype=p.dtype, group=group)
        for name, grad, where, want, tol in zip(("dq", "dk", "dv"), grads, (rows, keys, keys), expected, tolerances):
            err = float(np.abs(np.swapaxes(grad[where], 0, 1).astype(np.float64) - want).max())
            assert err <= tol, f"sequence {b} {name}: max error {err:.3g} > tolerance {tol:.3g}"


def run_backward(p, dq_mode, algorithm="wgmma"):
    """The packed backward of p with the wgmma backward's dQ summed in ``dq_mode`` (``strategies.wgmma_dq``), from
    the float64 reference's O and lse rounded as the forward would give them."""
    import numba_flash
    from strategies import wgmma_dq

    out, lse = reference.attention_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, causal=p.causal)
    out, lse = out.astype(p.dtype), lse.astype(np.float32)
    arguments = p.operands(p.q, p.k, p.v, out, lse, p.do)
    with wgmma_dq(dq_mode) as deterministic:
        grads = numba_flash.attention_varlen_backward(*arguments, p.cu_q, p.cu_k, causal=p.causal,
                                                      algorithm=algorithm, deterministic=deterministic)
    return tuple(to_host(x) for x in grads)


@needs_wgmma
@settings(max_examples=max(3, settings.default.max_examples // 4))   # each example: three kernels
@given(p=packed_batches(), dq_mode=st.sampled_from(["separate", "ordered", "atomic"]))
def test_the_wgmma_backward_of_packed_sequences_matches_the_float64_reference(p, dq_mode):
    """Each way of summing dQ (``backward.DQ_MODES``): in a pass of its own, in the dK/dV kernel in the order of
    the sequence's own key tiles (a turn counted wrong waits forever), or unordered."""
    check_backward(p, run_backward(p, dq_mode))


@needs_wgmma
@pytest.mark.parametrize("dq_mode, causal", [("separate", True), ("ordered", "top_left")])
def test_the_wgmma_backward_of_packed_sequences_covers_the_edges(dq_mode, causal):
    """The forward's fixed edges (an empty sequence, one without keys, one without queries, a single query and
    key, two query and key tiles with N_q != N_k), grouped heads, both alignments; dQ in its own pass, and summed
    in the dK/dV kernel in the order of each sequence's key tiles."""
    p = Packed([0, 3, 0, 1, 70], [4, 0, 5, 1, 66], 2, 1, 16, np.float16, causal, 2, strided=True)
    check_backward(p, run_backward(p, dq_mode))


@needs_wgmma
def test_packed_sequences_of_equal_lengths_give_the_bits_of_the_batched_wgmma_call():
    """Sequences of one length are a (batch, H, N, d) batch: the wgmma kernels must give the same bits packed as
    batched (O, lse, and the gradients: every sum in the same order), grouped heads, causal bottom-right."""
    import numba_flash

    batch, n_q, n_k = 2, 37, 45
    p = Packed([n_q] * batch, [n_k] * batch, 2, 1, 16, np.float16, True, 3)

    def batched(x, n):
        return np.ascontiguousarray(np.swapaxes(x.reshape((batch, n) + x.shape[1:]), 1, 2))

    def packed(x):
        return np.ascontiguousarray(np.swapaxes(x, 1, 2)).reshape((-1,) + x.shape[1:2] + x.shape[3:])

    out, lse = run_forward(p)
    qb, kb, vb, dob = batched(p.q, n_q), batched(p.k, n_k), batched(p.v, n_k), batched(p.do, n_q)
    out_b, lse_b = (to_host(x) for x in numba_flash.attention(*p.operands(qb, kb, vb), causal="bottom_right",
                                                              algorithm="wgmma", return_lse=True))
    np.testing.assert_array_equal(out.view(np.uint16), packed(out_b).view(np.uint16))
    np.testing.assert_array_equal(lse, np.swapaxes(lse_b, 0, 1).reshape(lse.shape))
    grads = numba_flash.attention_varlen_backward(*p.operands(p.q, p.k, p.v, out, lse, p.do), p.cu_q, p.cu_k,
                                                  causal=True, algorithm="wgmma")
    grads_b = numba_flash.attention_backward(*p.operands(qb, kb, vb, out_b, lse_b, dob), causal="bottom_right",
                                             algorithm="wgmma")
    for got, want in zip(grads, grads_b):
        np.testing.assert_array_equal(to_host(got).view(np.uint16), packed(to_host(want)).view(np.uint16))


def test_flash2_picks_the_wgmma_forward_for_packed_sequences_where_it_takes_the_batched_call(monkeypatch, hopper_lookalike):
    """Which forward ``attention_varlen(..., algorithm="flash2")`` lays out on a device made to look like an H200
    (nothing launched): wgmma wherever the batched call of the same head dim and causality would take it
    (``AUTOMATIC_SCOPE``), mma.sync elsewhere and on other GPUs; "wgmma" asks for it."""
    from numba_flash import api
    from numba_flash.kernels.hopper import forward as hopper

    device = hopper_lookalike

    def kernel(d=64, dtype=np.float16, causal=False, algorithm="flash2", block_sizes=None, dropout_p=0.0,
               score_mod=None):
        q = np.zeros((70, 2, d), dtype)
        plan = api._VarlenForwardPlan((q, q, q), (causal, None, dropout_p, block_sizes, algorithm, score_mod, None,
                                                  (2, 40, 40)))
        return plan.launch.kernel.name

    monkeypatch.setattr(hopper, "AUTOMATIC_SCOPE", {(64, False), (128, True)})
    assert kernel(algorithm="wgmma") == "wgmma_forward_d64_f16_varlen"
    assert kernel(d=128, causal="top_left", algorithm="wgmma") == "wgmma_forward_d128_f16_causal_varlen"
    assert kernel(d=128, algorithm="wgmma") == "wgmma_forward_d128_f16_varlen"   # outside AUTOMATIC_SCOPE: asked for
    assert kernel() == "wgmma_forward_d64_f16_varlen"
    assert kernel(d=128, causal=True, dtype=np.dtype("bfloat16")) == "wgmma_forward_d128_bf16_causal_varlen"
    for outside in (kernel(d=128), kernel(causal=True), kernel(d=32), kernel(dtype=np.float32),
                    kernel(dropout_p=0.1), kernel(block_sizes=(64, 64)), kernel(score_mod=mods.softcap(2.0))):
        assert outside.startswith("flash2_forward") and "_varlen" in outside, outside
    device.compute_capability = (8, 0)
    assert kernel().startswith("flash2_forward")


def test_flash2_picks_the_wgmma_backward_for_packed_sequences_where_it_takes_the_batched_call(monkeypatch, hopper_lookalike):
    """The backward's pick, the forward's (``backward.chosen_for``): wgmma for packed sequences where the batched
    call would take it, mma.sync elsewhere, summing dQ as the batched call would (``DQ_MODE``, ``deterministic``)."""
    from numba_flash import api
    from numba_flash.kernels.hopper import backward as hopper_backward
    from numba_flash.kernels.hopper import forward as hopper


    def kernel(d=64, causal=False, algorithm="flash2", deterministic=True, score_mod=None):
        x = np.zeros((70, 2, d), np.float16)
        plan = api._VarlenBackwardPlan((x, x, x, x, np.zeros((2, 70), np.float32), x),
                                       (causal, None, 0.0, None, algorithm, deterministic, score_mod, None,
                                        (2, 40, 40)))
        launches = plan.launches
        return (launches.dkdv if isinstance(launches, hopper_backward.SummedDq) else launches[1]).kernel.name

    monkeypatch.setattr(hopper, "AUTOMATIC_SCOPE", {(64, False), (128, True)})
    assert kernel(algorithm="wgmma") == "wgmma_backward_dkdv_d64_f16_varlen"
    # Outside the scope: asked for; dense at d = 128, deterministic, by the bulk kernel's ordered adds.
    assert kernel(d=128, algorithm="wgmma") == "wgmma_backward_dkdv_d128_f16_dq_bulk_ordered_varlen"
    assert kernel() == "wgmma_backward_dkdv_d64_f16_varlen"
    assert kernel(d=128, causal=True) == "wgmma_backward_dkdv_d128_f16_causal_varlen"
    assert kernel(d=128).startswith("flash2_backward_dkdv") and kernel(d=32).startswith("flash2_backward_dkdv")
    assert kernel(score_mod=mods.softcap(2.0)).startswith("flash2_backward_dkdv")   # mods: mma.sync for now
    monkeypatch.setattr(hopper_backward, "DQ_MODE", "atomic")   # NUMBA_FLASH_WGMMA_DQ=atomic
    assert kernel(deterministic=False) == "wgmma_backward_dkdv_d64_f16_dq_atomic_varlen"
    assert kernel() == "wgmma_backward_dkdv_d64_f16_varlen"
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        kernel(deterministic=None)


def test_packed_calls_reject_what_the_wgmma_kernels_cannot_run(no_launch):
    import numba_flash

    q = np.zeros((7, 2, 64), np.float16)
    kv = np.zeros((9, 1, 64), np.float16)
    cu_q, cu_k = np.array([0, 3, 7], np.int32), np.array([0, 4, 9], np.int32)
    with pytest.raises(ValueError, match=r"algorithm must be one of \('flash2', 'wgmma'\), got 'flash1'"):
        numba_flash.attention_varlen(q, kv, kv, cu_q, cu_k, algorithm="flash1")
    with pytest.raises(ValueError, match="algorithm='wgmma': q, k, v must be float16 or bfloat16"):
        numba_flash.attention_varlen(*(x.astype(np.float32) for x in (q, kv, kv)), cu_q, cu_k, algorithm="wgmma")
    with pytest.raises(ValueError, match="algorithm='wgmma': the head dim must be one of"):
        numba_flash.attention_varlen(q[..., :40], kv[..., :40], kv[..., :40], cu_q, cu_k, algorithm="wgmma")
    with pytest.raises(ValueError, match="algorithm='wgmma': the wgmma forward has no dropout yet"):
        numba_flash.attention_varlen(q, kv, kv, cu_q, cu_k, dropout_p=0.1, seed=1, algorithm="wgmma")
    with pytest.raises(ValueError, match="block_sizes must be None with algorithm='wgmma'"):
        numba_flash.attention_varlen(q, kv, kv, cu_q, cu_k, block_sizes=(64, 64), algorithm="wgmma")
    lse = np.zeros((2, 7), np.float32)
    with pytest.raises(ValueError, match=r"algorithm must be one of \('flash2', 'wgmma'\), got 'standard'"):
        numba_flash.attention_varlen_backward(q, kv, kv, q, lse, q, cu_q, cu_k, algorithm="standard")
    with pytest.raises(ValueError, match="algorithm='wgmma': the wgmma backward has no dropout yet"):
        numba_flash.attention_varlen_backward(q, kv, kv, q, lse, q, cu_q, cu_k, dropout_p=0.1, seed=1,
                                              algorithm="wgmma")
