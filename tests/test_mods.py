"""score_mod / mask_mod (numba_flash.mods) in the mma.sync kernels, against the float64 reference (reference/mods.py).

Random compositions of the built-ins with random parameters over ragged shapes (N_q != N_k, lengths that are not
multiples of the tiles, 1), dtypes, grouped heads, causal and block masks; forward and gradients.  Mutants (a
window off by one, a transposed bias table) must fail the same comparison; bad mods raise TypeError before any
launch.  Simulator budget: tiny shapes and few examples (each composition is a new kernel specialisation).
"""
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_flash
from numba_flash import api, mods
from reference import mods as ref
from strategies import BFLOAT16, arrays, problems
from test_hopper import _where
from tolerances import assert_close_to_reference, backward_tolerance

#: Longest N_q, N_k drawn: the simulator runs every CUDA thread as a Python thread; on a GPU the reference (one
#: Python call per entry and mod) bounds it.
MAX_N = 16 if numba_flash.in_simulator() else 160


def heads_of(q):
    return q.shape[-3] if q.ndim > 2 else 1


@st.composite
def score_mods(draw, heads):
    """None, or a built-in score_mod (or two composed) with drawn parameters."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    reach = draw(st.integers(0, 4))
    choices = {
        "softcap": lambda: mods.softcap(draw(st.sampled_from([0.5, 2.0, 30.0]))),
        "alibi": lambda: mods.alibi((mods.alibi_slopes(heads) * draw(st.sampled_from([1.0, 4.0])))
                                    .astype(np.float32)),
        "relative_position_bias": lambda: mods.relative_position_bias(
            rng.standard_normal((heads, 2 * reach + 1)).astype(np.float32)),
    }
    names = draw(st.lists(st.sampled_from([None] + sorted(choices)), min_size=1, max_size=2, unique=True))
    built = [choices[name]() for name in names if name is not None]
    if not built:
        return None
    return built[0] if len(built) == 1 else mods.compose(*built)


@st.composite
def mask_mods(draw, n_q, n_k, arrays_left):
    """None, or a built-in mask_mod (or two combined by and/or) with drawn parameters, reading at most
    ``arrays_left`` arrays."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    choices = {
        "sliding_window": (1, lambda: mods.sliding_window(draw(st.integers(1, 6)))),
        "prefix_lm": (1, lambda: mods.prefix_lm(draw(st.integers(0, 6)))),
        "document": (2, lambda: mods.document(np.sort(rng.integers(0, 3, n_q)).astype(np.int32),
                                              np.sort(rng.integers(0, 3, n_k)).astype(np.int32))),
        "causal": (0, lambda: mods.causal_mask),
    }
    names = draw(st.lists(st.sampled_from([None] + sorted(choices)), min_size=1, max_size=2, unique=True))
    names = [n for n in names if n is not None]
    while sum(choices[n][0] for n in names) > arrays_left:
        names.pop()
    built = [choices[name][1]() for name in names]
    if not built:
        return None
    if len(built) == 1:
        return built[0]
    return (mods.and_masks if draw(st.booleans()) else mods.or_masks)(*built)


@st.composite
def modded_problems(draw, dtype, backward=False):
    p = draw(problems(algorithm="flash2", dtype=dtype, max_n=MAX_N, backward=backward))
    score_mod = draw(score_mods(heads_of(p.q)))
    used = len(score_mod.arrays) if score_mod else 0
    mask_mod = draw(mask_mods(p.q.shape[-2], p.k.shape[-2], mods.MAX_MOD_ARRAYS - used))
    return p, score_mod, mask_mod


def mod_logits(p, score_mod, mask_mod):
    """|score| + |score_mod(score)| at its largest over allowed entries (``tolerances.mod_logit_error``)."""
    if score_mod is None:
        return None
    raw, s, allowed, _ = ref._scores(p.q, p.k, p.scale, p.causal, None, score_mod, mask_mod)
    return float(np.max(np.where(allowed, np.abs(raw) + np.abs(s), 0.0), initial=0.0))


def check_forward(p, score_mod, mask_mod, dtype):
    out, lse = numba_flash.attention(p.q, p.k, p.v, causal=p.causal, scale=p.scale, block_sizes=p.block_sizes,
                                     score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    want, want_lse = ref.attention(p.q, p.k, p.v, causal=p.causal, scale=p.scale, score_mod=score_mod,
                                   mask_mod=mask_mod)
    assert out.shape == p.q.shape and out.dtype == dtype
    assert_close_to_reference(out, lse, want, want_lse, p.q, p.expanded(p.k), p.expanded(p.v), p.effective_scale,
                              dtype, mod_logits=mod_logits(p, score_mod, mask_mod))


@settings(max_examples=8)
@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float16, BFLOAT16]))
def test_forward_with_mods_matches_the_float64_reference(data, dtype):
    p, score_mod, mask_mod = data.draw(modded_problems(dtype))
    check_forward(p, score_mod, mask_mod, dtype)


def check_gradients(p, score_mod, mask_mod, dtype, do, block_mask=None):
    dense = None if block_mask is None else block_mask.to_dense(p.q.shape[-2], p.k.shape[-2])
    out, lse = ref.attention(p.q, p.k, p.v, causal=p.causal, scale=p.scale, score_mod=score_mod, mask_mod=mask_mod,
                             mask=dense)
    out, lse = out.astype(dtype), lse.astype(np.float32)
    grads = numba_flash.attention_backward(p.q, p.k, p.v, out, lse, do, causal=p.causal, scale=p.scale,
                                           block_sizes=p.block_sizes, score_mod=score_mod, mask_mod=mask_mod,
                                           block_mask=block_mask)
    expected = ref.attention_backward(p.q, p.k, p.v, do, causal=p.causal, scale=p.scale, score_mod=score_mod,
                                      mask_mod=mask_mod, mask=dense)
    _, s, _, _ = ref._scores(p.q, p.k, p.scale, p.causal, dense, score_mod, mask_mod)
    weights = ref.softmax(s)
    tolerances = backward_tolerance(p.q, p.expanded(p.k), p.expanded(p.v), out, do, p.effective_scale, weights,
                                    dtype=dtype, group=p.group, mod_logits=mod_logits(p, score_mod, mask_mod))
    for name, got, want, tol in zip(("dq", "dk", "dv"), grads, expected, tolerances):
        assert got.shape == want.shape and got.dtype == dtype
        err = float(np.abs(got.astype(np.float64) - want).max())
        assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g}"


@settings(max_examples=5)
@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float16, BFLOAT16]))
def test_gradients_with_mods_match_the_float64_reference(data, dtype):
    p, score_mod, mask_mod = data.draw(modded_problems(dtype, backward=True))
    check_gradients(p, score_mod, mask_mod, dtype, arrays(data.draw, p.q.shape, dtype))


def fixed_problem(n_q=13, n_k=11, heads=2, kv_heads=1, d=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, heads, n_q, d)).astype(np.float32)
    k = rng.standard_normal((1, kv_heads, n_k, d)).astype(np.float32)
    v = rng.standard_normal((1, kv_heads, n_k, d)).astype(np.float32)
    from strategies import Problem
    return Problem(q, k, v, False, None, None)


def test_the_traced_derivative_agrees_with_central_differences():
    # The tracer (numba_flash.mods.derivative) against numbers: the reference's two slopes of every built-in.
    p = fixed_problem()
    table = np.random.default_rng(1).standard_normal((2, 5)).astype(np.float32)
    for score_mod in (mods.softcap(1.5), mods.alibi(mods.alibi_slopes(2)), mods.relative_position_bias(table),
                      mods.compose(mods.relative_position_bias(table), mods.softcap(3.0)),
                      mods.Mod(lambda s, b, h, i, j: mods.sigmoid(s) * 2 + mods.where(s > 0, s * s, -s) + max(s, 0.1)
                               + mods.log(1 + mods.exp(s)))):
        raw, _, allowed, _ = ref._scores(p.q, p.k, None, False, None, score_mod, None)
        traced = ref.score_slopes(score_mod, raw, allowed)
        numeric = ref.score_slopes(score_mod, raw, allowed, slope="numeric")
        np.testing.assert_allclose(traced, numeric, rtol=1e-6, atol=1e-7, err_msg=score_mod.name)


# ---------------------------------------------------------------- mutants: a mod wrong by one index fails the tests

def _window_off_by_one(b, h, q_idx, kv_idx, window):
    return q_idx - window[0] <= kv_idx and kv_idx <= q_idx   # one key too many


def _bias_transposed(score, b, h, q_idx, kv_idx, bias):
    reach = (bias.shape[1] - 1) // 2
    return score + bias[h, min(max(q_idx - kv_idx, -reach), reach) + reach]   # distance with the wrong sign


def test_a_mutant_window_or_bias_fails_the_comparison():
    # The kernel gets the mutant; the reference keeps the true built-in: the forward comparison must fail.
    p = fixed_problem()
    table = np.random.default_rng(2).standard_normal((2, 7)).astype(np.float32)
    cases = [(None, mods.sliding_window(3), _window_off_by_one),
             (mods.relative_position_bias(table), None, _bias_transposed)]
    for score_mod, mask_mod, mutant in cases:
        check_forward(p, score_mod, mask_mod, np.float32)   # the true mod passes
        kernel_mod = score_mod or mask_mod
        mutated = mods.Mod(mutant, *kernel_mod.arrays, name=kernel_mod.name + "_mutant")
        out = numba_flash.attention(p.q, p.k, p.v, score_mod=mutated if score_mod else None,
                                    mask_mod=mutated if mask_mod else None)
        want, want_lse = ref.attention(p.q, p.k, p.v, score_mod=score_mod, mask_mod=mask_mod)
        with pytest.raises(AssertionError):
            assert_close_to_reference(out, None, want, want_lse, p.q, p.expanded(p.k), p.expanded(p.v),
                                      p.effective_scale, mod_logits=mod_logits(p, score_mod, mask_mod))


def test_mods_combine_with_block_mask_and_dropout():
    # block_mask ANDs with mask_mod; dropout's Z applies to the modded weights (lse stays undropped).
    p = fixed_problem(n_q=17, n_k=19)
    layout = np.array([[1, 0], [1, 1]], bool)
    bm = numba_flash.BlockMask(layout, (9, 10))
    score_mod, mask_mod = mods.softcap(1.0), mods.prefix_lm(4)
    out, lse = numba_flash.attention(p.q, p.k, p.v, block_mask=bm, score_mod=score_mod, mask_mod=mask_mod,
                                     causal="bottom_right", return_lse=True)
    dense = bm.to_dense(17, 19)
    want, want_lse = ref.attention(p.q, p.k, p.v, mask=dense, causal="bottom_right", score_mod=score_mod,
                                   mask_mod=mask_mod)
    assert_close_to_reference(out, lse, want, want_lse, p.q, p.expanded(p.k), p.expanded(p.v), p.effective_scale,
                              mod_logits=8.0)
    keep = numba_flash.dropout_mask(p.q.shape[:-1] + (19,), 0.25, 7)
    out = numba_flash.attention(p.q, p.k, p.v, dropout_p=0.25, seed=7, score_mod=score_mod, mask_mod=mask_mod)
    want, want_lse = ref.attention(p.q, p.k, p.v, score_mod=score_mod, mask_mod=mask_mod, dropout_keep=keep,
                                   dropout_p=0.25)
    assert_close_to_reference(out, None, want, want_lse, p.q, p.expanded(p.k), p.expanded(p.v), p.effective_scale,
                              weight_scale=1 / 0.75, mod_logits=8.0)
    # Gradients with the block mask: each backward pass's tile lists are the mask_mod's ANDed with the block mask's.
    do = np.random.default_rng(6).standard_normal(p.q.shape).astype(np.float32)
    p.causal = "bottom_right"
    check_gradients(p, score_mod, mask_mod, np.float32, do, block_mask=bm)


def test_a_fully_masked_row_gives_zero_and_minus_infinity():
    p = fixed_problem(n_q=5, n_k=6)
    out, lse = numba_flash.attention(p.q, p.k, p.v, mask_mod=lambda b, h, i, j: i != 2, return_lse=True)
    assert np.all(out[..., 2, :] == 0) and np.all(np.isneginf(lse[..., 2]))
    assert np.all(np.isfinite(lse[..., [0, 1, 3, 4]]))


def test_attention_sinks_join_the_denominator():
    # gpt-oss: one logit per head with no value; O' = O exp(lse - lse'), lse' = logaddexp(lse, s_h).
    p = fixed_problem(n_q=4, n_k=5)
    sinks = np.array([0.5, -1.0])
    out, lse = numba_flash.attention(p.q, p.k, p.v, return_lse=True)
    o2, lse2 = mods.apply_sinks(out, lse, sinks)
    s = ref._scores(p.q, p.k, None, False, None, None, None)[1]
    full = np.concatenate([s, np.broadcast_to(sinks.reshape(1, 2, 1, 1), s.shape[:-1] + (1,))], axis=-1)
    weights = ref.softmax(full)[..., :-1]
    np.testing.assert_allclose(o2, weights @ np.repeat(p.v.astype(np.float64), 2, axis=1), atol=1e-5)


# ---------------------------------------------------------------- bad mods: TypeError naming the mod, before launch

def test_bad_mods_raise_type_errors_before_any_launch(no_launch):
    p = fixed_problem(n_q=3, n_k=3)
    call = (lambda **kw: numba_flash.attention(p.q, p.k, p.v, **kw))
    with pytest.raises(TypeError, match="takes 3 parameters"):
        call(score_mod=lambda s, b, h: s)                          # wrong arity
    with pytest.raises(TypeError, match="mask_mod=.*score mod"):
        call(mask_mod=lambda s, b, h, i, j: s)                     # a score_mod passed as the mask
    with pytest.raises(TypeError, match="score_mod tuple_score returns .*not a scalar"):
        def tuple_score(score, b, h, q_idx, kv_idx):
            return (score, score)
        call(score_mod=tuple_score)
    with pytest.raises(TypeError, match="score_mod uses_a_dict: Numba cannot compile it"):
        def uses_a_dict(score, b, h, q_idx, kv_idx):
            return {"a": score}["a"] + object()
        call(score_mod=uses_a_dict)
    with pytest.raises(TypeError, match="not an array"):
        mods.Mod(lambda s, b, h, i, j, c: s * c, 2.0)
    with pytest.raises(ValueError, match="alibi: slopes has shape .3,., the call .2,."):   # reads out of bounds
        call(score_mod=mods.alibi(mods.alibi_slopes(3)))
    with pytest.raises(ValueError, match="document: 2 query and 2 key document ids for N_q = 3"):
        call(mask_mod=mods.sliding_window(2) & mods.document(np.zeros(2, np.int32)))
    with pytest.raises(ValueError, match="float16 or bfloat16 for the wgmma forward"):   # (mods run there; float32 not)
        call(score_mod=mods.softcap(1.0), algorithm="wgmma")
    with pytest.raises(ValueError, match="flash2"):
        call(score_mod=mods.softcap(1.0), algorithm="standard")


def test_an_untraceable_score_mod_asks_for_grad(no_launch):
    p = fixed_problem(n_q=3, n_k=3)

    def branchy(score, b, h, q_idx, kv_idx):
        if score > 0:          # a Python if on the score: the tracer cannot follow it
            return score
        return 0.5 * score

    with pytest.raises(TypeError, match="branchy.*grad="):
        numba_flash.attention_backward(p.q, p.k, p.v, p.q, p.q[..., 0], p.q, score_mod=branchy)


def test_gradients_with_grouped_heads_and_an_explicit_grad():
    # GQA (dK, dV summed over the group) with a traced softcap and alibi, and a Mod given its own grad=.
    p = fixed_problem(n_q=13, n_k=17, heads=2, kv_heads=1)
    p.causal = "bottom_right"
    do = np.random.default_rng(3).standard_normal(p.q.shape).astype(np.float32)
    check_gradients(p, mods.compose(mods.softcap(2.0), mods.alibi(mods.alibi_slopes(2))), mods.sliding_window(4),
                    np.float32, do)

    def soft_sign(score, b, h, q_idx, kv_idx):
        return score / (1.0 + abs(score))

    def soft_sign_grad(score, b, h, q_idx, kv_idx):   # 1 / (1 + |s|)^2, at most 1 (``tolerances.mod_logit_error``)
        return 1.0 / ((1.0 + abs(score)) * (1.0 + abs(score)))

    explicit = mods.Mod(soft_sign, grad=soft_sign_grad)
    assert mods.derivative(explicit) is soft_sign_grad
    check_gradients(p, explicit, None, np.float32, do)


# ---------------------------------------------------------------- numba_flash.torch

def test_torch_attention_with_mods_is_differentiable():
    torch = pytest.importorskip("torch")
    import numba_flash.torch as nft

    p = fixed_problem(n_q=9, n_k=12, heads=2, kv_heads=1)
    table = torch.from_numpy(np.random.default_rng(4).standard_normal((2, 5)).astype(np.float32))
    score_mod = mods.compose(mods.relative_position_bias(table), mods.softcap(2.0))
    mask_mod = mods.or_masks(mods.sliding_window(3), mods.prefix_lm(2))
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in (p.q, p.k, p.v))
    do = np.random.default_rng(5).standard_normal(p.q.shape).astype(np.float32)

    def run(q, k, v):
        return nft.attention(q, k, v, causal=True, score_mod=score_mod, mask_mod=mask_mod)

    # Under torch.compile the mods travel through the custom operators (fullgraph: no graph break), their keys made
    # while Dynamo traces, so that the compiled graph's first call already has them: the same results.
    torch._dynamo.reset()
    for fn in (run, torch.compile(run, fullgraph=True, backend="aot_eager")):
        for x in (q, k, v):
            x.grad = None
        out = fn(q, k, v)
        out.backward(torch.from_numpy(do))
        want, _ = ref.attention(p.q, p.k, p.v, causal=True, score_mod=score_mod, mask_mod=mask_mod)
        np.testing.assert_allclose(out.detach().numpy(), want, atol=1e-5)
        expected = ref.attention_backward(p.q, p.k, p.v, do, causal=True, score_mod=score_mod, mask_mod=mask_mod)
        for x, g in zip((q, k, v), expected):
            np.testing.assert_allclose(x.grad.numpy(), g, atol=1e-5)


def test_mods_under_torch_compile_made_outside_inside_or_replaced():
    torch = pytest.importorskip("torch")
    import numba_flash.torch as nft

    p = fixed_problem(n_q=9, n_k=12, heads=2, kv_heads=2)
    q, k, v = (torch.from_numpy(x) for x in (p.q, p.k, p.v))
    window = mods.sliding_window(3)

    def eager(mask_mod, causal=False):
        return nft.attention(q, k, v, causal=causal, mask_mod=mask_mod)

    torch._dynamo.reset()
    # A Mod made outside, and a plain function made inside the compiled function: no graph break.
    outside = torch.compile(lambda q, k, v: nft.attention(q, k, v, mask_mod=window), fullgraph=True,
                            backend="aot_eager")
    inside = torch.compile(lambda q, k, v: nft.attention(q, k, v, mask_mod=lambda b, h, i, j: j <= i - 2),
                           fullgraph=True, backend="aot_eager")
    assert torch.equal(outside(q, k, v), eager(window))
    assert torch.equal(inside(q, k, v), eager(lambda b, h, i, j: j <= i - 2))
    # A Mod built inside the compiled region (Dynamo hands it over unbuilt): the call runs eagerly, as it should.
    built_inside = torch.compile(lambda q, k, v: nft.attention(q, k, v, mask_mod=mods.prefix_lm(4)),
                                 backend="aot_eager")
    assert torch.equal(built_inside(q, k, v), eager(mods.prefix_lm(4)))
    # Another Mod on the same compiled function: its own results, not the first one's.
    swapped = torch.compile(lambda q, k, v, m: nft.attention(q, k, v, mask_mod=m), fullgraph=True,
                            backend="aot_eager")
    assert torch.equal(swapped(q, k, v, window), eager(window))
    assert torch.equal(swapped(q, k, v, mods.prefix_lm(4)), eager(mods.prefix_lm(4)))
    assert not torch.equal(eager(window), eager(mods.prefix_lm(4)))


# ---------------------------------------------------------------- mask_mod -> tile visits (sparsity/mod_tiles.py)

def test_a_mask_mods_empty_tiles_are_not_listed_and_full_ones_skip_the_test():
    from numba_flash.sparsity.mod_tiles import classify_tiles, mod_mask_arguments

    # A window of 8 keys at N = 64 in 16 x 16 tiles: each query tile sees its own tile (partial: the diagonal) and
    # the one before it (partial for the window's edge), never more.
    window = mods.sliding_window(8)
    visit, partly = classify_tiles(window, 1, 1, 64, 64, (16, 16))
    expected = np.eye(4, dtype=bool) | np.eye(4, k=-1, dtype=bool)
    assert np.array_equal(visit[0], expected) and np.array_equal(partly[0], expected)
    # Document mask: whole tiles inside a document are full; the lists carry that bit (entry & 1 = partly masked).
    docs = np.repeat(np.arange(2), 32).astype(np.int32)
    lists = mod_mask_arguments(mods.document(docs), None, (1, 1), 64, 64, (16, 16), None, "forward")
    entries = lists.tile_entries.copy_to_host()
    assert list(entries >> 1) == [0, 1, 0, 1, 2, 3, 2, 3] and not (entries & 1).any() and not lists.partly
    # A ragged length: the last tile's 8 x 8 entries inside the sequences are all allowed, so it is full too.
    visit, partly = classify_tiles(mods.document(docs[:40]), 1, 1, 40, 40, (16, 16))
    assert visit[0].sum() == 5 and not partly.any()


def test_torch_attention_sinks_and_their_gradient():
    # Against torch's own float64 math: the sink's logit as an extra column of S with a zero value row.
    torch = pytest.importorskip("torch")
    import numba_flash.torch as nft

    p = fixed_problem(n_q=7, n_k=9, heads=2, kv_heads=1)
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in (p.q, p.k, p.v))
    out = nft.attention(q, k, v, causal=True, score_mod=mods.softcap(3.0), sinks=sinks)
    do = torch.from_numpy(np.random.default_rng(7).standard_normal(p.q.shape).astype(np.float32))
    out.backward(do)

    q64, k64, v64 = (torch.from_numpy(x.astype(np.float64)).requires_grad_() for x in (p.q, p.k, p.v))
    s64 = sinks.detach().double().requires_grad_()
    kr, vr = k64.repeat_interleave(2, dim=1), v64.repeat_interleave(2, dim=1)
    s = 3.0 * torch.tanh((q64 @ kr.transpose(-1, -2)) / np.sqrt(8) / 3.0)
    s = s.masked_fill(~torch.ones(7, 9, dtype=torch.bool).tril(), -torch.inf)
    full = torch.cat([s, s64.reshape(1, 2, 1, 1).expand(1, 2, 7, 1)], dim=-1)
    want = torch.softmax(full, dim=-1)[..., :-1] @ vr
    want.backward(do.double())
    np.testing.assert_allclose(out.detach().numpy(), want.detach().numpy(), atol=1e-5)
    for got, expected in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad), (sinks.grad, s64.grad)):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=2e-5)


def test_a_mask_that_reads_b_or_h_is_classified_per_head():
    from numba_flash.sparsity.mod_tiles import batch_and_head_reads, classify_tiles

    assert batch_and_head_reads((mods.sliding_window(3) | mods.prefix_lm(2)).fn) == (False, False)   # once, broadcast

    def head_window(b, h, q_idx, kv_idx):   # head 0 sees 1 key, head 1 the 17 up to its own
        return q_idx - (1 + 16 * h) < kv_idx and kv_idx <= q_idx + b

    assert batch_and_head_reads(head_window) == (True, True)
    visit, _ = classify_tiles(mods.Mod(head_window), 2, 2, 32, 32, (16, 16))
    assert visit.shape == (4, 2, 2) and visit[0].sum() == 2 and visit[1].sum() == 3 and visit[2].sum() == 3
    p = fixed_problem(n_q=21, n_k=18, heads=2, kv_heads=1)
    p.q = np.concatenate([p.q, p.q[:, ::-1]])    # two batch entries
    p.k, p.v = (np.concatenate([x, x]) for x in (p.k, p.v))
    check_forward(p, None, mods.Mod(head_window), np.float32)


# ---------------------------------------------------------------- the relative-bias table learns (numba_flash.torch)

def _table_reference(torch, q, k, v, table, do, causal, allowed_blocks):
    """(O, gradients of q, k, v and the table, P, |score| + |score_mod(score)| at its largest) in float64 by torch's
    autograd, the bias added to every scaled score by its clamped distance."""
    q, k, v, table = (x.detach().double().requires_grad_() for x in (q, k, v, table))
    group = q.shape[-3] // k.shape[-3]
    keys, values = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    n_q, n_k, reach = q.shape[-2], k.shape[-2], (table.shape[1] - 1) // 2
    raw = q @ keys.transpose(-1, -2) / q.shape[-1] ** 0.5
    distance = (torch.arange(n_k)[None, :] - torch.arange(n_q)[:, None]).clamp(-reach, reach) + reach
    scores = raw + table[:, distance]
    allowed = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        allowed = allowed.tril(0 if causal is True else n_k - n_q)
    if allowed_blocks is not None:
        allowed = allowed & allowed_blocks
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num()
    out = weights @ values
    grads = torch.autograd.grad(out, (q, k, v, table), do.double())
    logits = float(torch.where(allowed, raw.abs() + scores.abs(), 0.0).detach().max()) if allowed.any() else 0.0
    return out.detach(), grads, weights.detach(), logits


@settings(max_examples=6)
@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float16, BFLOAT16]))
def test_the_relative_bias_table_gets_the_float64_gradient(data, dtype):
    """d L / d table through ``numba_flash.torch.attention`` against float64 autograd: ragged lengths, N_q != N_k,
    grouped heads, both causal alignments, block masks, reaches shorter and longer than the sequences (every distance
    clamped, or none); on a GPU, the same bits on a second run.  Each of the three ways it can be summed: by the
    wgmma dQ kernel (16-bit, where it runs), by the mma.sync dQ kernel (its default tiles; the test below takes others)
    (``kernels/fast/bias_table.py``;
    the torch path, ``_bias_gradient``, is then not called), and on the torch path (the kernels' sums refused)."""
    torch = pytest.importorskip("torch")
    import numba_flash.torch as nft
    from tolerances import table_gradient_tolerance

    draw = data.draw
    wgmma = dtype != np.float32 and _where() is not None
    path = draw(st.sampled_from(["wgmma", "mma.sync", "torch"] if wgmma else ["mma.sync", "torch"]))
    kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    longest = 80 if path == "wgmma" else 50   # (the wgmma kernels' tiles are 64 rows: two of them)
    n_q, n_k = draw(st.integers(1, longest)), draw(st.integers(1, longest))
    d = draw(st.sampled_from([16] if path == "wgmma" else [8, 16]))
    reach, causal = draw(st.integers(0, 60)), draw(st.sampled_from([False, True, "bottom_right"]))
    batch = draw(st.integers(1, 2))
    blocks = draw(st.one_of(st.none(), st.integers(0, 2 ** 32 - 1)))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    torch_dtype = {np.float32: torch.float32, np.float16: torch.float16}.get(dtype, torch.bfloat16)
    q, do = (torch.from_numpy(rng.standard_normal((batch, heads, n_q, d))).to(torch_dtype) for _ in "qo")
    k, v = (torch.from_numpy(rng.standard_normal((batch, kv_heads, n_k, d))).to(torch_dtype) for _ in "kv")
    table = torch.from_numpy(rng.standard_normal((heads, 2 * reach + 1)).astype(np.float32)).requires_grad_()
    block_mask = None if blocks is None else numba_flash.BlockMask(
        np.random.default_rng(blocks).random((heads, -(-n_q // 16), -(-n_k // 16))) < 0.7, (16, 16))
    allowed_blocks = None if block_mask is None else torch.from_numpy(block_mask.to_dense(n_q, n_k))

    def table_gradient():
        out = nft.attention(q, k, v, causal=causal, block_mask=block_mask,
                            algorithm="wgmma" if path == "wgmma" else "flash2",
                            score_mod=mods.relative_position_bias(table))
        if path == "torch":
            with mock.patch.object(nft, "_backward_and_table_sums", return_value=None):
                return out, torch.autograd.grad(out, table, do)[0]
        with mock.patch.object(nft, "_table_gradient", side_effect=AssertionError("the torch path ran")):
            return out, torch.autograd.grad(out, table, do)[0]

    out, got = table_gradient()
    _, grads, weights, logits = _table_reference(torch, q, k, v, table, do, causal, allowed_blocks)
    as_numpy = lambda x: x.detach().double().numpy()   # noqa: E731
    tol = table_gradient_tolerance(as_numpy(q), as_numpy(k.repeat_interleave(group, 1)),
                                   as_numpy(v.repeat_interleave(group, 1)), as_numpy(out), as_numpy(do),
                                   d ** -0.5, weights.numpy(), reach, dtype=dtype, mod_logits=logits)
    err = (got.double() - grads[3]).abs().numpy()
    assert got.dtype == table.dtype and got.shape == table.shape
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert np.all(err <= tol), f"table gradient, bin {worst}: error {err[worst]:.3g} > tolerance {tol[worst]:.3g}"
    if not numba_flash.in_simulator():   # (run to run on a GPU; the simulator runs every block in one order)
        assert torch.equal(got, table_gradient()[1])


@pytest.mark.parametrize("tiles, dtype, reach, causal", [
    ((16, 16), np.float32, 3, True), ((16, 32), np.float16, 40, "bottom_right"), ((32, 16), BFLOAT16, 0, False),
    pytest.param((64, 32), np.float32, 9, False, marks=pytest.mark.gpu_only),
    pytest.param((32, 64), np.float16, 70, True, marks=pytest.mark.gpu_only)])
def test_the_mma_sync_dq_kernel_sums_the_table_for_any_tiles(tiles, dtype, reach, causal):
    """The mma.sync dQ kernel's table sums (``kernels/fast/bias_table.py``) at tiles of B_r query rows and B_c keys
    either way round: more diagonals (B_r + B_c - 1) than threads (2 B_r) at (16, 32) and (32, 64), ragged lengths of
    several tiles, grouped heads, a reach of 0 (every distance in the two edge bins at once), of 3 (some clamped) and
    one past every distance (70; in the simulator 40, its distances -35 .. 39); the sums over batch entries and query
    tiles against float64 autograd within ``table_gradient_tolerance``, the kernel's dQ, dK, dV those of the same call
    without the table.  O and lse come from the float64 reference (the backward is tested on its own)."""
    torch = pytest.importorskip("torch")
    from tolerances import table_gradient_tolerance

    rng = np.random.default_rng(5)
    # The simulator's tiles (16 and 32 each way) over two or three ragged tiles each way: shorter lengths do.
    n_q, n_k = (36, 40) if numba_flash.in_simulator() else (45, 70)
    batch, heads, kv_heads, d = 2, 2, 1, 16
    q, do = (rng.standard_normal((batch, heads, n_q, d)).astype(dtype) for _ in "qo")
    k, v = (rng.standard_normal((batch, kv_heads, n_k, d)).astype(dtype) for _ in "kv")
    table = rng.standard_normal((heads, 2 * reach + 1)).astype(np.float32)
    bias = mods.relative_position_bias(table)
    out, lse = ref.attention(q, k, v, causal=causal, score_mod=bias)
    out, lse = out.astype(dtype), lse.astype(np.float32)
    options = dict(causal=causal, scale=None, block_mask=None, algorithm="flash2", deterministic=True,
                   score_mod=bias, block_sizes=tiles)
    *grads, sums = api._attention_backward_and_table_sums(q, k, v, out, lse, do, **options)
    assert sums.shape == (batch, heads, -(-n_q // tiles[0]), 2 * reach + 1)
    expected = numba_flash.attention_backward(q, k, v, out, lse, do, causal=causal, score_mod=bias,
                                              block_sizes=tiles)
    for got, want in zip(grads, expected):
        assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    as_torch = lambda x: torch.from_numpy(np.asarray(x, np.float64))   # noqa: E731
    _, reference_grads, weights, logits = _table_reference(torch, *(as_torch(x) for x in (q, k, v, table, do)),
                                                           causal, None)
    tol = table_gradient_tolerance(q, np.repeat(k, heads, 1), np.repeat(v, heads, 1), out, do, d ** -0.5,
                                   weights.numpy(), reach, dtype=dtype, mod_logits=logits)
    err = np.abs(np.asarray(sums, np.float64).sum((0, 2)) - reference_grads[3].numpy())
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert np.all(err <= tol), f"bin {worst}: error {err[worst]:.3g} > tolerance {tol[worst]:.3g}"


def test_the_relative_bias_table_learns_under_torch_compile_and_other_mod_arrays_refuse_to():
    torch = pytest.importorskip("torch")
    import numba_flash.torch as nft

    p = fixed_problem(n_q=9, n_k=12, heads=2, kv_heads=1)
    q, k, v = (torch.from_numpy(x) for x in (p.q, p.k, p.v))
    table = torch.from_numpy(np.random.default_rng(4).standard_normal((2, 7)).astype(np.float32)).requires_grad_()
    bias = mods.relative_position_bias(table)

    def loss(q, k, v):
        return (nft.attention(q, k, v, causal=True, score_mod=bias) ** 2).sum()

    eager = torch.autograd.grad(loss(q, k, v), table)[0]
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v), table)[0]
    assert torch.count_nonzero(eager) > 0 and torch.equal(compiled, eager)
    # Where no gradient is computed for an array that asks for one: a TypeError naming the mod, before any launch.
    for kwargs in (dict(score_mod=mods.compose(bias, mods.softcap(5.0))), dict(score_mod=bias, dropout_p=0.5),
                   dict(score_mod=bias, mask_mod=mods.sliding_window(3)),
                   dict(score_mod=bias, sinks=torch.zeros(2))):
        with pytest.raises(TypeError, match="relative_position_bias"):
            nft.attention(q, k, v, **kwargs)
    with torch.no_grad():   # (no gradient asked for: runs)
        nft.attention(q, k, v, score_mod=mods.compose(bias, mods.softcap(5.0)))


def test_the_relative_bias_table_learns_through_packed_sequences():
    """attention_varlen: each sequence's distances its own (indices from its start, causal bottom-right), the
    sequences' gradients added: against float64 autograd per sequence; an empty sequence adds nothing."""
    torch = pytest.importorskip("torch")
    import numba_flash.torch as nft
    from tolerances import table_gradient_tolerance

    rng = np.random.default_rng(7)
    lengths_q, lengths_k, heads, kv_heads, d, reach = [5, 0, 19, 21], [7, 4, 12, 30], 4, 2, 8, 6
    cu_q, cu_k = (torch.tensor(np.concatenate([[0], np.cumsum(x)]), dtype=torch.int32)
                  for x in (lengths_q, lengths_k))
    q, do = (torch.from_numpy(rng.standard_normal((sum(lengths_q), heads, d)).astype(np.float32)) for _ in "qo")
    k, v = (torch.from_numpy(rng.standard_normal((sum(lengths_k), kv_heads, d)).astype(np.float32)) for _ in "kv")
    table = torch.from_numpy(rng.standard_normal((heads, 2 * reach + 1)).astype(np.float32)).requires_grad_()
    for causal in (False, True):
        out = nft.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, score_mod=mods.relative_position_bias(table))
        got = torch.autograd.grad(out, table, do)[0]
        want, tol = torch.zeros(table.shape, dtype=torch.float64), np.zeros(table.shape)
        for b in range(len(lengths_q)):
            rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            if rows.start == rows.stop:
                continue
            per_head = [x[span].transpose(0, 1)[None] for x, span in ((q, rows), (k, keys), (v, keys), (do, rows))]
            seq_out, grads, weights, logits = _table_reference(torch, *per_head[:3], table, per_head[3],
                                                              "bottom_right" if causal else False, None)
            want += grads[3]
            tol += table_gradient_tolerance(*(x.numpy() for x in per_head[:1]),
                                            per_head[1].repeat_interleave(heads // kv_heads, 1).numpy(),
                                            per_head[2].repeat_interleave(heads // kv_heads, 1).numpy(),
                                            seq_out.numpy(), per_head[3].numpy(), d ** -0.5, weights.numpy(),
                                            reach, mod_logits=logits)
        err = (got.double() - want).abs().numpy()
        assert np.all(err <= tol), f"causal={causal}: table gradient errors {err} above tolerances {tol}"
