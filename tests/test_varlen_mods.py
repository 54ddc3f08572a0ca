"""score_mod / mask_mod on packed sequences (attention_varlen, its backward, numba_flash.torch.attention_varlen),
against the float64 reference (reference/mods.py) applied to each sequence on its own.

The mods see each sequence's indices: b its index in the pack, q_idx and kv_idx counted from its first query and key
(the causal mask, when asked for, keeps its alignment).  Sequence b is compared as batch entry b of a reference
batch whose other entries are zeros, so that the reference hands the mods the same b.  Ragged lengths (0 and 1
included), grouped heads, every causal alignment; random compositions of the built-ins (``test_mods``' strategies)
AND a mask that reads b.  A window off by one and a kernel that counted q_idx from the pack's first row must fail.
Simulator budget: few examples of tiny packs (each composition is a new kernel specialisation).
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_flash
from numba_flash import mods
from reference import mods as ref
from strategies import VARLEN_DTYPES, arrays, dtype_name, packed_problems
from test_mods import _window_off_by_one, mask_mods, score_mods
from tolerances import assert_close_to_reference, backward_tolerance

varlen_dtypes = pytest.mark.parametrize("dtype", VARLEN_DTYPES, ids=dtype_name)
#: Longest sequence drawn: the simulator's usual sizes; on a GPU the reference, which calls the mods in Python once
#: per entry (and per earlier sequence: see ``at_batch``), bounds it.
MAX_N = None if numba_flash.in_simulator() else 96


def _keys_per_sequence(b, h, q_idx, kv_idx, limits):
    return kv_idx < limits[b]


def keys_per_sequence(limits):
    """A mask_mod that reads b: sequence b's queries see its first limits[b] keys (int32 (batch,))."""
    return mods.Mod(_keys_per_sequence, np.asarray(limits, np.int32), name="keys_per_sequence")


@st.composite
def packed_mod_problems(draw, dtype, backward=False):
    """A packed batch (``packed_problems``), a score_mod, and a mask_mod: the built-ins' compositions, or one that
    reads b, or both ANDed."""
    p = draw(packed_problems(dtype=dtype, backward=backward, max_n=MAX_N))
    score_mod = draw(score_mods(p.q.shape[1]))
    used = len(score_mod.arrays) if score_mod else 0
    n_q, n_k = p.longest
    mask_mod = draw(mask_mods(n_q, n_k, mods.MAX_MOD_ARRAYS - used - 1))
    if draw(st.booleans()):
        per_sequence = keys_per_sequence([draw(st.integers(0, n_k)) for _ in range(p.batch)])
        mask_mod = per_sequence if mask_mod is None else mods.and_masks(mask_mod, per_sequence)
    return p, score_mod, mask_mod


def effective_scale(p):
    return 1 / np.sqrt(p.q.shape[-1]) if p.scale is None else p.scale


def alignment(causal):
    """A packed call's causal argument for one sequence as ``attention`` spells it (True: bottom-right)."""
    return "bottom_right" if causal is True else causal


def at_batch(x, b):
    """Sequence b's (heads, n, d) as entry b of a (b + 1, heads, n, d) float64 batch of zeros."""
    batch = np.zeros((b + 1,) + x.shape)
    batch[b] = x
    return batch


def sequence_reference(p, b, score_mod, mask_mod, do=None):
    """The reference's (O, lse) of sequence b (and with ``do`` its (dq, dk, dv)), the mods seeing b, and its
    |score| + |score_mod(score)| bound (``tolerances.mod_logit_error``; None without a score_mod)."""
    q, k, v = (at_batch(x, b) for x in p.sequence(b))
    options = dict(scale=p.scale, causal=alignment(p.causal), score_mod=score_mod, mask_mod=mask_mod)
    out, lse = ref.attention(q, k, v, **options)
    logits = None
    if score_mod is not None:
        raw, s, allowed, _ = ref._scores(q, k, p.scale, alignment(p.causal), None, score_mod, mask_mod)
        logits = float(np.max(np.where(allowed[b], np.abs(raw[b]) + np.abs(s[b]), 0.0), initial=0.0))
    grads = None if do is None else [g[b] for g in ref.attention_backward(q, k, v, at_batch(do, b), **options)]
    return out[b], lse[b], logits, grads


def check_forward(p, score_mod, mask_mod, dtype, kernel_mask_mod=None):
    """The packed call (its mask_mod ``kernel_mask_mod`` when given: a mutant) against the reference per sequence."""
    out, lse = numba_flash.attention_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, causal=p.causal, scale=p.scale,
                                            block_sizes=p.block_sizes, score_mod=score_mod,
                                            mask_mod=kernel_mask_mod or mask_mod, return_lse=True)
    assert out.shape == p.q.shape and out.dtype == dtype and lse.shape == (p.q.shape[1], p.q.shape[0])
    heads = p.q.shape[1]
    for b in range(p.batch):
        q, k, v = p.sequence(b)
        rows = p.rows(b)
        if q.shape[1] == 0:
            continue
        if k.shape[1] == 0:   # nothing to attend to
            assert np.all(out[rows].astype(np.float32) == 0) and np.all(np.isneginf(lse[:, rows]))
            continue
        want, want_lse, logits, _ = sequence_reference(p, b, score_mod, mask_mod)
        expand = (lambda x: np.repeat(x, heads // x.shape[0], axis=0))
        assert_close_to_reference(np.swapaxes(out[rows], 0, 1), lse[:, rows], want, want_lse, q, expand(k),
                                  expand(v), effective_scale(p), dtype, mod_logits=logits)


@varlen_dtypes
@settings(max_examples=5)
@given(data=st.data())
def test_packed_sequences_with_mods_match_the_reference_per_sequence(dtype, data):
    p, score_mod, mask_mod = data.draw(packed_mod_problems(dtype))
    check_forward(p, score_mod, mask_mod, dtype)


@varlen_dtypes
@settings(max_examples=3)
@given(data=st.data())
def test_packed_gradients_with_mods_match_the_reference_per_sequence(dtype, data):
    p, score_mod, mask_mod = data.draw(packed_mod_problems(dtype, backward=True))
    do = arrays(data.draw, p.q.shape, dtype)
    heads = p.q.shape[1]
    references = [None if 0 in (p.rows(b).stop - p.rows(b).start, p.keys(b).stop - p.keys(b).start)
                  else sequence_reference(p, b, score_mod, mask_mod, np.swapaxes(do[p.rows(b)], 0, 1))
                  for b in range(p.batch)]
    out = np.zeros(p.q.shape, dtype)   # the reference's O and lse: the backward is tested on its own
    lse = np.full((heads, p.q.shape[0]), -np.inf, np.float32)
    for b, found in enumerate(references):
        if found is not None:
            out[p.rows(b)] = np.swapaxes(found[0], 0, 1).astype(dtype)
            lse[:, p.rows(b)] = found[1]
    grads = numba_flash.attention_varlen_backward(p.q, p.k, p.v, out, lse, do, p.cu_q, p.cu_k, causal=p.causal,
                                                  scale=p.scale, block_sizes=p.block_sizes, score_mod=score_mod,
                                                  mask_mod=mask_mod)
    for got, like in zip(grads, (p.q, p.k, p.v)):
        assert got.shape == like.shape and got.dtype == dtype
    group = heads // p.k.shape[1]
    for b, found in enumerate(references):
        rows, keys = p.rows(b), p.keys(b)
        if found is None:   # no query sees a key: every gradient of the sequence is 0
            for grad, where in zip(grads, (rows, keys, keys)):
                assert np.all(grad[where].astype(np.float32) == 0)
            continue
        _, _, logits, expected = found
        q, k, v = (at_batch(x, b) for x in p.sequence(b))
        _, s, _, _ = ref._scores(q, k, p.scale, alignment(p.causal), None, score_mod, mask_mod)
        expand = (lambda x: np.repeat(x[b], group, axis=0))
        tolerances = backward_tolerance(q[b], expand(k), expand(v), np.swapaxes(out[rows], 0, 1),
                                        np.swapaxes(do[rows], 0, 1), effective_scale(p), ref.softmax(s)[b],
                                        dtype=dtype, group=group, mod_logits=logits)
        for name, grad, where, want, tol in zip(("dq", "dk", "dv"), grads, (rows, keys, keys), expected, tolerances):
            err = float(np.abs(np.swapaxes(grad[where], 0, 1).astype(np.float64) - want).max(initial=0.0))
            assert err <= tol, f"sequence {b} {name}: max error {err:.3g} > tolerance {tol:.3g}"


def fixed_pack(lengths_q=(5, 0, 9, 1), lengths_k=(7, 3, 9, 1), heads=2, kv_heads=1, d=8, causal=True, seed=0):
    from strategies import PackedProblem, cumulative

    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((sum(n), h, d)).astype(np.float32)
               for n, h in ((lengths_q, heads), (lengths_k, kv_heads), (lengths_k, kv_heads)))
    return PackedProblem(q, k, v, cumulative(list(lengths_q)), cumulative(list(lengths_k)), causal, None, None)


def test_a_window_off_by_one_fails_the_comparison():
    # The kernel gets the mutant, the reference the true window: the comparison must fail.
    p = fixed_pack()
    window = mods.sliding_window(3)
    check_forward(p, None, window, np.float32)   # the true window passes
    mutant = mods.Mod(_window_off_by_one, *window.arrays, name="sliding_window_mutant")
    with pytest.raises(AssertionError):
        check_forward(p, None, window, np.float32, kernel_mask_mod=mutant)


def _from_the_pack_start(b, h, q_idx, kv_idx, starts):
    return kv_idx <= q_idx + starts[b]   # as if q_idx counted from the pack's first row (not the sequence's)


def test_indices_count_from_each_sequence_start():
    # A causal mask_mod gives the bottom-right causal call's result only if q_idx and kv_idx count within each
    # sequence: N_q = N_k per sequence here, so the two alignments agree.
    p = fixed_pack(lengths_q=(6, 4, 9), lengths_k=(6, 4, 9), causal=False)
    out = numba_flash.attention_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, mask_mod=mods.causal_mask)
    want = numba_flash.attention_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, causal=True)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    shifted = mods.Mod(_from_the_pack_start, p.cu_q[:-1].astype(np.int32), name="from_the_pack_start")
    assert not np.allclose(numba_flash.attention_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, mask_mod=shifted), want)


def test_torch_attention_varlen_with_mods_is_differentiable():
    torch = pytest.importorskip("torch")
    import numba_flash.torch as nft

    p = fixed_pack(lengths_q=(5, 3), lengths_k=(7, 3))
    score_mod, mask_mod = mods.softcap(2.0), mods.sliding_window(4)
    q, k, v = (torch.tensor(x, requires_grad=True) for x in (p.q, p.k, p.v))
    cu_q, cu_k = torch.tensor(p.cu_q), torch.tensor(p.cu_k)
    out = nft.attention_varlen(q, k, v, cu_q, cu_k, causal=True, score_mod=score_mod, mask_mod=mask_mod)
    do = np.random.default_rng(1).standard_normal(p.q.shape).astype(np.float32)
    out.backward(torch.tensor(do))
    for b in range(p.batch):
        rows, keys = p.rows(b), p.keys(b)
        want, _, _, (dq, dk, dv) = sequence_reference(p, b, score_mod, mask_mod, np.swapaxes(do[rows], 0, 1))
        np.testing.assert_allclose(np.swapaxes(out.detach().numpy()[rows], 0, 1), want, atol=2e-5)
        for got, where, expected in ((q.grad, rows, dq), (k.grad, keys, dk), (v.grad, keys, dv)):
            np.testing.assert_allclose(np.swapaxes(got.numpy()[where], 0, 1), expected, atol=5e-5)


def test_mods_on_packed_sequences_are_checked_before_any_launch(no_launch):
    p = fixed_pack()
    with pytest.raises(ValueError, match="alibi: slopes"):   # one slope per query head
        numba_flash.attention_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, score_mod=mods.alibi(mods.alibi_slopes(3)))
    with pytest.raises(ValueError, match="document"):   # ids for the longest sequence's positions
        ids = np.zeros(4, np.int32)
        numba_flash.attention_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, mask_mod=mods.document(ids))
    with pytest.raises(TypeError, match="mask_mod"):
        numba_flash.attention_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, mask_mod=mods.softcap(2.0))
    with pytest.raises(ValueError, match="packed sequences run on algorithm='flash2'"):   # not on wgmma yet
        numba_flash.attention_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, algorithm="wgmma", mask_mod=mods.causal_mask)
