"""score_mod / mask_mod when decoding from a KV cache (attention_with_kv_cache), against the float64 reference
(reference/mods.py) on each entry's whole sequence.

The mods see query i of entry b at its position L_b - N_q + i (L_b = cache_seqlens[b] + N_new, the keys after the
append), key j at j, b the batch row and h the query head.  So entry b is compared with the reference over all L_b
positions (queries of zeros before the call's N_q, which are the sequence's last), as batch entry b of a batch of
zeros, and only its last N_q rows are read: a sliding window then decodes as it trains.  Contiguous and paged caches,
N_q 1 and > 1, grouped heads packed as rows, split keys and key warps; a window off by one and a kernel that hands
the mods the call's row index instead of the position must fail.  Simulator budget: few examples of tiny caches.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_flash
from numba_flash import mods
from reference import mods as ref
from strategies import VARLEN_DTYPES, arrays
from test_mods import _window_off_by_one, mask_mods, score_mods
from test_paged_cache import paged_copy
from tolerances import assert_close_to_reference


@st.composite
def cache_mod_problems(draw):
    """q (B, H_q, N_q, d), caches (B, H_kv, N_max, d) with lengths L_b >= N_q after the append (the call's queries
    are the sequence's last), new keys or none, causal (bottom-right) or not, the library's layout or drawn
    splits and key warps, contiguous or paged; a score_mod and a mask_mod (``test_mods``' compositions)."""
    dtype = draw(st.sampled_from(VARLEN_DTYPES))
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.sampled_from((1, 3)))
    n_q = draw(st.sampled_from((1, 3)))
    n_new = draw(st.sampled_from((0, n_q)))
    n_max = draw(st.sampled_from((16, 37)))
    d = 16
    seqlens = np.array([draw(st.integers(max(0, n_q - n_new), n_max - n_new)) for _ in range(batch)], np.int32)
    q = arrays(draw, (batch, heads, n_q, d), dtype)
    k_cache, v_cache = (arrays(draw, (batch, kv_heads, n_max, d), dtype) for _ in range(2))
    new = (None, None) if n_new == 0 else tuple(arrays(draw, (batch, kv_heads, n_new, d), dtype) for _ in range(2))
    paged = draw(st.booleans())
    positions = -(-n_max // 16) * 16 if paged else n_max   # a paged entry's N_max: its row of the table full
    score_mod = draw(score_mods(heads))
    used = len(score_mod.arrays) if score_mod else 0
    mask_mod = draw(mask_mods(positions, positions, mods.MAX_MOD_ARRAYS - used))
    options = dict(causal=draw(st.booleans()), num_splits=draw(st.sampled_from((0, 1, 3))),
                   key_warps=draw(st.sampled_from((0, 1, 4) if dtype != np.float32 else (0, 1))))
    return q, k_cache, v_cache, seqlens, new, score_mod, mask_mod, options, paged


def decode(problem, kernel_mods=None):
    """The call (the mods ``kernel_mods`` when given: mutants) -> (O, lse, the caches after the append)."""
    q, k_cache, v_cache, seqlens, (k_new, v_new), score_mod, mask_mod, options, paged = problem
    score_mod, mask_mod = kernel_mods or (score_mod, mask_mod)
    options = dict(options, k_new=k_new, v_new=v_new, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    n_new = 0 if k_new is None else k_new.shape[2]
    for b, start in enumerate(seqlens if n_new else ()):
        expected_k[b, :, start:start + n_new] = k_new[b]
        expected_v[b, :, start:start + n_new] = v_new[b]
    if paged:
        # (one table for both pools: the same shuffle of pages)
        (k_cache, table), (v_cache, _) = (paged_copy(x, 16, np.random.default_rng(int(seqlens.sum())))
                                          for x in (k_cache, v_cache))
        options["block_table"] = table
    out, lse = numba_flash.attention_with_kv_cache(q, k_cache, v_cache, seqlens, **options)
    return out, lse, expected_k, expected_v


def check(problem, kernel_mods=None):
    q, _, _, seqlens, (k_new, _), score_mod, mask_mod, options, _ = problem
    out, lse, k_all, v_all = decode(problem, kernel_mods)
    batch, heads, n_q, d = q.shape
    group = heads // k_all.shape[1]
    for b, length in enumerate(seqlens + (0 if k_new is None else k_new.shape[2])):
        # Entry b's whole sequence: its queries at positions L_b - N_q .. L_b - 1, zeros before.
        queries = np.zeros((b + 1, heads, length, d))
        queries[b, :, length - n_q:] = q[b]
        keys, values = (np.zeros((b + 1,) + x.shape[1:2] + (length, d)) for x in (k_all, v_all))
        keys[b], values[b] = k_all[b, :, :length], v_all[b, :, :length]
        want, want_lse = ref.attention(queries, keys, values, causal=options["causal"], score_mod=score_mod,
                                       mask_mod=mask_mod)
        logits = None
        if score_mod is not None:
            raw, s, allowed, _ = ref._scores(queries, keys, None, options["causal"], None, score_mod, mask_mod)
            last = (b, slice(None), slice(length - n_q, None))
            logits = float(np.max(np.where(allowed[last], np.abs(raw[last]) + np.abs(s[last]), 0.0), initial=0.0))
        k, v = (np.repeat(x[b, :, :length], group, axis=0) for x in (k_all, v_all))
        assert_close_to_reference(out[b], lse[b], want[b, :, length - n_q:], want_lse[b, :, length - n_q:], q[b], k,
                                  v, 1 / np.sqrt(d), q.dtype, mod_logits=logits)


@settings(max_examples=6)
@given(problem=cache_mod_problems())
def test_decoding_with_mods_matches_the_reference_on_the_sequences_last_rows(problem):
    check(problem)


def serving_problem(heads=4, kv_heads=1, n_q=3, paged=True, causal=True, score_mod=None, mask_mod=None, seed=3):
    """A fixed GQA call: three entries (long, short, as short as its queries), new keys, pages."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((3, heads, n_q, 16)).astype(np.float16)
    k_cache, v_cache = (rng.standard_normal((3, kv_heads, 48, 16)).astype(np.float16) for _ in range(2))
    new = tuple(rng.standard_normal((3, kv_heads, n_q, 16)).astype(np.float16) for _ in range(2))
    seqlens = np.array([40, 9, 0], np.int32)
    return (q, k_cache, v_cache, seqlens, new, score_mod, mask_mod, dict(causal=causal, num_splits=2, key_warps=0),
            paged)


@pytest.mark.parametrize("n_q, paged", [(1, False), (3, True)], ids=["one query", "three queries paged"])
def test_sliding_window_and_softcap_decode_without_a_mask_tensor(n_q, paged):
    # Gemma 2's local layers: a window of 8 keys (the query's own included) and a softcap, grouped heads packed.
    problem = serving_problem(n_q=n_q, paged=paged, score_mod=mods.softcap(2.0), mask_mod=mods.sliding_window(8))
    check(problem)
    plans = [p for p in numba_flash.api._PLANS.values() if isinstance(p, numba_flash.api._CachePlan)
             and p.user_shape == problem[0].shape and p.call.mods is not None]
    assert plans and all(p.call.varlen.head_queries == n_q for p in plans)   # the group's queries share a tile


def _alibi_from_rows(score, b, h, q_idx, kv_idx, slopes):
    return score + slopes[h] * float(kv_idx - (q_idx % 3))   # as if q_idx were the call's row i, not L_b - N_q + i


def test_a_window_off_by_one_or_row_indices_fail_the_comparison():
    window, slopes = mods.sliding_window(5), mods.alibi_slopes(4)
    problem = serving_problem(mask_mod=window, score_mod=mods.alibi(slopes))
    check(problem)   # the true mods pass
    mutants = [(mods.alibi(slopes), mods.Mod(_window_off_by_one, *window.arrays, name="window_mutant")),
               (mods.Mod(_alibi_from_rows, slopes, name="alibi_mutant"), window)]
    for kernel_mods in mutants:
        with pytest.raises(AssertionError):
            check(problem, kernel_mods)


def test_mods_on_a_cache_are_checked_before_any_launch(no_launch):
    q, k_cache, v_cache, seqlens, _, _, _, _, _ = serving_problem()
    with pytest.raises(ValueError, match="alibi: slopes"):   # one slope per query head (4), not per packed row
        numba_flash.attention_with_kv_cache(q, k_cache, v_cache, seqlens, score_mod=mods.alibi(mods.alibi_slopes(1)))
    with pytest.raises(ValueError, match="document"):   # ids for every position of the cache (48)
        numba_flash.attention_with_kv_cache(q, k_cache, v_cache, seqlens,
                                            mask_mod=mods.document(np.zeros(40, np.int32)))
    with pytest.raises(TypeError, match="score_mod"):
        numba_flash.attention_with_kv_cache(q, k_cache, v_cache, seqlens, score_mod=mods.causal_mask)
