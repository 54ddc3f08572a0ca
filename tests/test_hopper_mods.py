"""score_mod / mask_mod (numba_flash.mods) on the wgmma kernels (``kernels/hopper``), against the float64 reference
(reference/mods.py).

The built-ins and their compositions drawn as in tests/test_mods.py (``score_mods``, ``mask_mods``), over ragged
shapes of one to two 64-row tiles in the simulator (up to three on a GPU), grouped heads, both causal alignments and
block masks; the forward in each of its loops (plain, overlapped, two warpgroups: ``wgmma_loop``), the gradients in
each way of summing dQ (``wgmma_dq``).  A window off by one must fail the same comparison; ``algorithm="flash2"``
must take the wgmma kernels with mods wherever it takes them without.  Simulator budget: few examples, small head
dims (each example compiles new specialisations, and the simulator runs each of a warpgroup's threads in Python).
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import float32

import numba_flash
from numba_flash import mods
from reference import mods as ref
from strategies import wgmma_dq, wgmma_loop
from test_hopper import _where, to_gpu, to_host
from test_mods import mask_mods, score_mods
from tolerances import assert_close_to_reference, backward_tolerance

pytestmark = pytest.mark.skipif(_where() is None, reason="the wgmma kernels need a Hopper GPU (sm_90a) or the simulator")

ON_GPU = _where() == "hopper"


def run(fn, *arrays, **options):
    """``fn`` (numba_flash.attention or attention_backward) on host arrays: as they are in the simulator, as torch
    CUDA tensors on a Hopper GPU, results back on the host."""
    if not ON_GPU:
        return fn(*arrays, **options)
    results = fn(*(to_gpu(x) for x in arrays), **options)
    return tuple(to_host(x) for x in results) if isinstance(results, tuple) else to_host(results)


@st.composite
def wgmma_problems(draw):
    """(q, k, v, causal, block_mask, score_mod, mask_mod): float16 or bfloat16, ragged lengths, grouped heads."""
    import ml_dtypes

    # The simulator: one or two 64-row tiles each way, ragged (even its first, simplest example).
    lengths = st.integers(1, 200) if ON_GPU else st.integers(40, 80)
    batch = draw(st.integers(1, 2))
    kv_heads, group = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    heads = kv_heads * group
    n_q, n_k = draw(lengths), draw(lengths)
    d = draw(st.sampled_from([64, 96, 128] if ON_GPU else [16, 32]))
    dtype = draw(st.sampled_from([np.float16, ml_dtypes.bfloat16]))
    causal = draw(st.sampled_from([False, True, "bottom_right"]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    q = rng.standard_normal((batch, heads, n_q, d)).astype(dtype)
    k, v = (rng.standard_normal((batch, kv_heads, n_k, d)).astype(dtype) for _ in range(2))
    block_mask = None
    if draw(st.booleans()):   # blocks that cut the 64 x 64 tiles: the element test and the mask_mod's together
        rows, keys = draw(st.sampled_from([16, 48, 64])), draw(st.sampled_from([16, 40, 64]))
        layout = rng.random((-(-n_q // rows), -(-n_k // keys))) < 0.7
        block_mask = numba_flash.BlockMask(layout, (rows, keys))
    score_mod = draw(score_mods(heads))
    used = len(score_mod.arrays) if score_mod else 0
    mask_mod = draw(mask_mods(n_q, n_k, mods.MAX_MOD_ARRAYS - used))
    if score_mod is None and mask_mod is None:
        mask_mod = mods.sliding_window(draw(st.integers(1, 70)))
    return q, k, v, causal, block_mask, score_mod, mask_mod


def dense_mask(block_mask, q, k):
    return None if block_mask is None else block_mask.to_dense(q.shape[-2], k.shape[-2])


def mod_logits(q, k, causal, dense, score_mod, mask_mod):
    """|score| + |score_mod(score)| at its largest over allowed entries (``tolerances.mod_logit_error``)."""
    if score_mod is None:
        return None
    raw, s, allowed, _ = ref._scores(q.astype(np.float64), k.astype(np.float64), 1 / np.sqrt(q.shape[-1]), causal,
                                     dense, score_mod, mask_mod)
    return float(np.max(np.where(allowed, np.abs(raw) + np.abs(s), 0.0), initial=0.0))


def expanded(x, heads):
    return np.repeat(x.astype(np.float64), heads // x.shape[1], axis=1)


def check_forward(q, k, v, causal, block_mask, score_mod, mask_mod, kernel_mask_mod=None):
    """The wgmma forward with the mods (the kernel's mask_mod ``kernel_mask_mod`` if given: a mutant) against the
    float64 reference of ``score_mod``, ``mask_mod``."""
    out, lse = run(numba_flash.attention, q, k, v, causal=causal, block_mask=block_mask, score_mod=score_mod,
                   mask_mod=kernel_mask_mod or mask_mod, algorithm="wgmma", return_lse=True)
    dense = dense_mask(block_mask, q, k)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    want, want_lse = ref.attention(q64, k64, v64, causal=causal, mask=dense, score_mod=score_mod, mask_mod=mask_mod)
    assert out.shape == q.shape and out.dtype == q.dtype
    heads = q.shape[1]
    assert_close_to_reference(out, lse, want, want_lse, q64, expanded(k, heads), expanded(v, heads),
                              1 / np.sqrt(q.shape[-1]), q.dtype,
                              mod_logits=mod_logits(q, k, causal, dense, score_mod, mask_mod))


@settings(max_examples=max(2, settings.default.max_examples // 6))   # each example: new kernels, slow simulator
@given(data=st.data())
def test_the_wgmma_forward_with_mods_matches_the_float64_reference(data):
    """Every loop of the forward: products waited for or overlapping the softmax, blocks of one or two warpgroups."""
    from numba_flash.kernels.hopper.forward import WARPGROUP_COUNTS

    problem = data.draw(wgmma_problems())
    with wgmma_loop(data.draw(st.booleans()), data.draw(st.sampled_from(WARPGROUP_COUNTS))):
        check_forward(*problem)


def check_gradients(q, k, v, causal, block_mask, score_mod, mask_mod, do, dq_mode):
    """dQ, dK, dV of the wgmma backward with dQ summed in ``dq_mode`` against float64 within ``backward_tolerance``;
    returns them."""
    dense = dense_mask(block_mask, q, k)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
    out, lse = ref.attention(q64, k64, v64, causal=causal, mask=dense, score_mod=score_mod, mask_mod=mask_mod)
    out, lse = out.astype(q.dtype), lse.astype(np.float32)
    with wgmma_dq(dq_mode) as deterministic:
        grads = run(numba_flash.attention_backward, q, k, v, out, lse, do, causal=causal, block_mask=block_mask,
                    score_mod=score_mod, mask_mod=mask_mod, algorithm="wgmma", deterministic=deterministic)
    expected = ref.attention_backward(q64, k64, v64, do64, causal=causal, mask=dense, score_mod=score_mod,
                                      mask_mod=mask_mod)
    _, s, _, _ = ref._scores(q64, k64, 1 / np.sqrt(q.shape[-1]), causal, dense, score_mod, mask_mod)
    heads = q.shape[1]
    tolerances = backward_tolerance(q64, expanded(k, heads), expanded(v, heads), out, do, 1 / np.sqrt(q.shape[-1]),
                                    ref.softmax(s), dtype=q.dtype, group=heads // k.shape[1],
                                    mod_logits=mod_logits(q, k, causal, dense, score_mod, mask_mod))
    for name, got, want, tol in zip(("dq", "dk", "dv"), grads, expected, tolerances):
        assert got.shape == want.shape and got.dtype == q.dtype, (name, got.shape, got.dtype)
        err = float(np.abs(got.astype(np.float64) - want).max())
        assert err <= tol, f"{name} ({dq_mode}): max error {err:.3g} > tolerance {tol:.3g}"
    return grads


@settings(max_examples=max(2, settings.default.max_examples // 6))   # each example: three kernels
@given(data=st.data())
def test_the_wgmma_gradients_with_mods_match_the_float64_reference(data):
    """dQ, dK, dV in each way of summing dQ: dS = P (dP - D) d score_mod / d score, 0 where masked."""
    from numba_flash.kernels.hopper.dq_sums import DQ_MODES

    problem = data.draw(wgmma_problems())
    dq_mode = data.draw(st.sampled_from(DQ_MODES))
    do = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1))).standard_normal(problem[0].shape)
    check_gradients(*problem, do.astype(problem[0].dtype), dq_mode)


def both_mods_problem(heads=2):
    """Grouped heads (``heads`` query heads on one key/value head), bottom-right causal, ragged lengths over two tiles, a block mask that cuts the tiles, a
    composed score_mod (ALiBi, then a cap) and an or-ed mask_mod (a window, or a prefix): every step at once."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, heads, 70, 16)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, 75, 16)).astype(np.float16) for _ in range(2))
    block_mask = numba_flash.BlockMask(rng.random((2, 2)) < 0.8, (48, 40))
    score_mod = mods.compose(mods.alibi(mods.alibi_slopes(heads) * np.float32(4)), mods.softcap(2.0))
    mask_mod = mods.sliding_window(9) | mods.prefix_lm(5)
    return q, k, v, "bottom_right", block_mask, score_mod, mask_mod


@pytest.mark.parametrize("overlap, warpgroups", [(True, 1), (False, 2)])
def test_the_forwards_other_loops_take_both_mods(overlap, warpgroups):
    with wgmma_loop(overlap, warpgroups):   # (two warpgroups: one head, 256 threads a block are slow to simulate)
        check_forward(*both_mods_problem(heads=warpgroups % 2 + 1))


@pytest.mark.parametrize("dq_mode", ["separate", "ordered", "atomic"])
def test_every_way_of_summing_dq_takes_both_mods(dq_mode):
    problem = both_mods_problem()
    do = np.random.default_rng(6).standard_normal(problem[0].shape).astype(np.float16)
    check_gradients(*problem, do, dq_mode)


def _position_only(score, b, h, q_idx, kv_idx):
    return score * float32(0) - float32(abs(q_idx - kv_idx)) * float32(0.25)   # d / d score = 0


def test_a_score_mod_that_drops_the_score_passes_no_gradient_to_q_and_k():
    """A score_mod whose derivative is 0 (a positional logit alone) makes dS = P (dP - D) 0 = 0: dQ and dK exactly 0
    in the dK/dV and the dQ kernel, dV as the reference's (the weights are the bias's softmax)."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 2, 70, 16)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, 66, 16)).astype(np.float16) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(np.float16)
    dq, dk, _ = check_gradients(q, k, v, True, None, mods.Mod(_position_only), None, do, "separate")
    assert np.all(dq == 0) and np.all(dk == 0)


@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_a_score_mod_reaches_the_tiles_that_need_no_test(causal):
    """64 query rows against 130 keys: key tile 0 is whole (every entry allowed, inside both sequences: the forward's
    untested path, ``score_entry``'s WHOLE), tile 2 ragged (and, bottom-right, tile 1 crossed by the diagonal):
    the score_mod must reach both kinds (ALiBi then a cap of 2, which changes every score)."""
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 2, 64, 16)).astype(np.float16)
    k, v = (rng.standard_normal((1, 2, 130, 16)).astype(np.float16) for _ in range(2))
    score_mod = mods.compose(mods.alibi(mods.alibi_slopes(2)), mods.softcap(2.0))
    check_forward(q, k, v, causal, None, score_mod, None)


def _window_off_by_one(b, h, q_idx, kv_idx, window):
    return q_idx - window[0] <= kv_idx and kv_idx <= q_idx   # one key too many


def test_a_window_off_by_one_fails_the_comparison():
    """The kernel gets the mutant window, the reference the true one: the forward comparison must fail (and pass
    with the true window: the element test of a window's partly covered tiles decides it)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 1, 70, 16)).astype(np.float16) for _ in range(3))
    window = mods.sliding_window(3)
    check_forward(q, k, v, False, None, None, window)
    mutant = mods.Mod(_window_off_by_one, *window.arrays, name="sliding_window_mutant")
    with pytest.raises(AssertionError):
        check_forward(q, k, v, False, None, None, window, kernel_mask_mod=mutant)


def test_flash2_picks_the_wgmma_kernels_with_mods_where_it_picks_them_without(hopper_lookalike):
    """On a device made to look like an H100 (plans built, nothing launched): the wgmma forward and backward with
    a score_mod, a mask_mod or both, wherever flash2 takes them without mods; mma.sync where it does not."""
    from numba_flash import api

    device = hopper_lookalike
    softcap, window = mods.softcap(30.0), mods.sliding_window(16)

    def kernels(d=64, dtype=np.float16, score_mod=None, mask_mod=None, dropout_p=0.0):
        x = np.zeros((1, 2, 70, d), dtype)
        lse = np.zeros((1, 2, 70), np.float32)
        forward = api._ForwardPlan((x, x, x), (False, None, None, dropout_p, "flash2", None, score_mod, mask_mod))
        backward = api._BackwardPlan((x, x, x, x, lse, x), (False, None, None, dropout_p, "flash2", None, True,
                                                            score_mod, mask_mod))
        return forward.launch.kernel.name, backward.launches[1].kernel.name

    assert kernels(score_mod=softcap) == ("wgmma_forward_d64_f16_mods_softcap",
                                          "wgmma_backward_dkdv_d64_f16_mods_softcap")
    assert kernels(mask_mod=window)[0] == "wgmma_forward_d64_f16_sparse_mods_sliding_window"
    assert kernels(d=128, dtype=np.dtype("bfloat16"), score_mod=softcap, mask_mod=window) == (
        "wgmma_forward_d128_bf16_sparse_mods_softcap_sliding_window",
        "wgmma_backward_dkdv_d128_bf16_sparse_mods_softcap_sliding_window")
    # d = 256 takes the wgmma forward without mods, not with them
    assert kernels(d=256)[0].startswith("wgmma")
    for outside in (kernels(d=32, score_mod=softcap), kernels(dtype=np.float32, mask_mod=window),
                    kernels(score_mod=softcap, dropout_p=0.1), kernels(d=256, score_mod=softcap)):
        assert all(name.startswith("flash2") for name in outside), outside
    device.compute_capability = (8, 0)
    assert all(name.startswith("flash2") for name in kernels(score_mod=softcap, mask_mod=window))
