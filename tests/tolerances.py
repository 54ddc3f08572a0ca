"""How far a kernel may be from the float64 reference, and why.

All tolerances come from one forward error model, evaluated on the actual
inputs (u is the unit roundoff of float32, 2^-24):

1. Each logit s_ij = tau * q_i . k_j is a length-d dot product.  In float32
   its error is at most (2d + 16) u |tau| sum_x |q_ix k_jx|: a factor 2 over
   the textbook gamma_d covers tensor-core accumulation, and 16 u covers
   the scaling and 3xTF32's per-product error (2^-21).  Call the largest
   such bound ``ds``.
2. Shifting a logit by ds moves its softmax weight by a relative factor of
   at most exp(2 ds) - 1 (numerator and normaliser each move by exp(ds)).
   exp/log, the online rescales (one per key block, at most N_k) and the
   normaliser's sum add (N_k + 16) u.
3. O_i = sum_j P_ij v_j: the weights' relative error times max|v|, plus the
   length-N_k sum's (N_k + 4) u max|v|.

For 16-bit inputs (float16, bfloat16: exact in their type, float32
arithmetic inside) the fast kernel also rounds P to the input type before
the P V product (u16 relative per weight: 2^-11 for float16, 2^-8 for
bfloat16) and rounds O to it (u16 relative): both added below.

lse = log sum_j exp(s_ij) moves by at most ds plus the sum's rounding.
Bugs (a wrong mask, a missed rescale, a wrong lane) give errors orders of
magnitude above these bounds; the tests would catch them.
"""
import os

import ml_dtypes
import numpy as np

U32 = 2.0 ** -24
U16 = 2.0 ** -11
UBF16 = 2.0 ** -8
#: Results are float32 (or float16): a true value below the output type's
#: smallest subnormal can only come out as 0 (e.g. gradients scaled by
#: scale = 1e-150, which itself rounds to 0 in float32), so every bound
#: allows that much absolutely.
TINY32 = float(np.finfo(np.float32).smallest_subnormal)
#: 3xTF32 (A_big B_big + A_big B_small + A_small B_big, the small parts rounded
#: to tf32 too): ~2^-21 relative per product, 16 u with the scaling's rounding.
SPLIT_TF32_EXTRA = 16 * U32


def unit_roundoff(dtype):
    """u of a result type: 2^-24 float32, 2^-11 float16, 2^-8 bfloat16."""
    return {"float32": U32, "float16": U16, "bfloat16": UBF16}[np.dtype(dtype).name]


def smallest_subnormal(dtype):
    return float(ml_dtypes.finfo(dtype).smallest_subnormal)


def product_tolerance(a, b, c, extra=0.0):
    """Elementwise bound on |fl(A B + C) - (A B + C)| for float32 accumulation over A's k columns.

    The textbook gamma_(k+1) = (k + 1) u of |A||B| + |C| (doubled for the
    tensor cores' truncating accumulator), plus ``extra`` relative to the same
    magnitude (the operands' own rounding, e.g. 3xTF32's 2^-21).
    """
    a, b, c = (np.abs(np.asarray(x, dtype=np.float64)) for x in (a, b, c))
    return (2 * (a.shape[-1] + 1) * U32 + extra) * (a @ b + c)


def logit_error(q, k, scale):
    """Largest bound on |s_ij - s_ij(exact)| over all (i, j); step 1 above."""
    q = np.abs(np.asarray(q, dtype=np.float64))
    k = np.abs(np.asarray(k, dtype=np.float64))
    d = q.shape[-1]
    magnitude = abs(scale) * (q @ np.swapaxes(k, -1, -2))
    return (2 * d * U32 + SPLIT_TF32_EXTRA) * float(magnitude.max())


def mod_logit_error(mod_logits):
    """The error a score_mod adds to a logit (``numba_flash.mods``), on top of ``logit_error`` of its input.

    ``mod_logits``: the largest |score| + |score_mod(score)| over allowed entries.  A mod whose derivative in the
    score is at most 1 in size (every built-in and their compositions: softcap's is 1 - tanh^2, a bias's 1) passes
    its input's error on undiminished, and adds its own float32 rounding: a handful of operations (a quotient,
    tanh, a product; a bias read, a product and a sum), each u of at most |score| + |result|, and the conversion
    to log2 units; 8 u covers them.  None (no score_mod): 0.
    """
    return 0.0 if mod_logits is None else 8 * U32 * float(mod_logits)


def forward_tolerance(q, k, v, scale, dtype=np.float32, weight_scale=1.0, mod_logits=None):
    """(tol_O, tol_lse): absolute bounds on the output and log-sum-exp errors.

    weight_scale: the largest dropout weight 1/(1 - p) (1 without dropout);
    the weights of O = (P * Z) V, and so their errors, grow by that factor.
    mod_logits: with a score_mod, ``mod_logit_error``'s magnitude (None without).
    """
    n_k = np.shape(k)[-2]
    v_max = float(np.abs(np.asarray(v, dtype=np.float64)).max()) * weight_scale
    ds = logit_error(q, k, scale) + mod_logit_error(mod_logits)
    weight_rel = np.expm1(2 * ds) + (n_k + 16) * U32
    tol_o = (weight_rel + (n_k + 4) * U32) * v_max + smallest_subnormal(dtype)
    tol_lse = ds + (n_k + 16) * U32
    if np.dtype(dtype) != np.float32:
        tol_o += 2 * unit_roundoff(dtype) * v_max
    return tol_o, tol_lse


def assert_close_to_reference(out, lse, ref_out, ref_lse, q, k, v, scale, dtype=np.float32, weight_scale=1.0,
                              mod_logits=None):
    """Compare a kernel's (O, lse) with the float64 reference under the model above."""
    tol_o, tol_lse = forward_tolerance(q, k, v, scale, dtype, weight_scale, mod_logits)
    out = np.asarray(out, dtype=np.float64)
    _log_error(dtype, np.abs(out - ref_out).max(initial=0.0), tol_o)
    assert np.all(np.isfinite(out)), "output has NaN or inf"
    err_o = np.abs(out - ref_out).max()
    assert err_o <= tol_o, f"max |O - O_ref| = {err_o:.3g} > tolerance {tol_o:.3g}"
    if lse is not None:
        lse = np.asarray(lse, dtype=np.float64)
        empty = np.isneginf(ref_lse)
        assert np.array_equal(np.isneginf(lse), empty), "lse is -inf exactly where no key is allowed"
        assert not np.any(np.isnan(lse)), "lse has NaN"
        err_lse = np.abs(lse[~empty] - ref_lse[~empty]).max(initial=0.0)
        assert err_lse <= tol_lse, f"max |lse - lse_ref| = {err_lse:.3g} > tolerance {tol_lse:.3g}"
    return err_o


def constant_rows_tolerance(n_k, dtype, value_max):
    """Bound on |O - c| when every value row is the same vector c.

    sum_j P_ij c / l = c exactly because the weights sum to l, so only rounding
    remains: the weighted sum and l are each sums of N_k float32 terms ((N_k + 4) u
    each); 3xTF32 products add ~8 u each; 16-bit inputs also round every weight
    and the output (one u16 each).
    """
    rel = (2 * n_k + 24) * U32
    if np.dtype(dtype) != np.float32:
        rel += 2 * unit_roundoff(dtype)
    return rel * value_max


#: Two float64 evaluations of the same formula in different orders (the
#: reference against SciPy, the tiled Algorithm 1 against the whole-matrix one):
#: the test shapes sum at most a few hundred terms, a few hundred u64 = 2^-53
#: each, far below this; a wrong formula misses it by many orders of magnitude.
FLOAT64_AGREEMENT = 1e-12


def central_difference_tolerance(eps, loss_scale):
    """(rtol, atol) for a float64 gradient against (f(x + eps) - f(x - eps)) / (2 eps).

    Truncation is O(eps^2) relative; cancellation adds u64 |f| / eps absolutely
    (u64 = 2^-53), with |f| <= loss_scale.
    """
    return 100 * eps ** 2 + 1e-9, 10 * 2.0 ** -53 * loss_scale / eps


#: ex2.approx.ftz.f32 (the fast kernels' exp): at most 2 ulp, 2^-22 relative
#: (PTX ISA); subnormal results flush to 0, so the smallest normal is allowed absolutely.
EX2_APPROX_RTOL = 4 * U32
EX2_APPROX_ATOL = float(np.finfo(np.float32).tiny)

#: A float32 model run twice, once with our attention and once with torch's math
#: attention: the attentions differ by summation order (~1e-6 relative, the
#: bound of forward_tolerance at these sizes); the layers around them carry that
#: through a few products, which stays two orders of magnitude under these.
#: A wrong mask or gradient changes the loss and gradients at order 1.
MODEL_LOSS_RTOL = 1e-5
MODEL_GRADIENT_RTOL = 1e-4

#: ``numba-flash demo``'s shape (N = 20, d = 8, standard normal) in float32:
#: forward_tolerance gives ~1e-6 there; 1e-5 leaves room for the algorithms'
#: different orders and still fails any real bug (errors of order 1).
DEMO_MAX_ERROR = 1e-5


#: The longest sequence the float32 accuracy of flash2 is held to (tests/test_scale.py).
LONG_N = 65536


def long_sequence_tolerance(backward=False, n_max=LONG_N, smallest_tile=16):
    """One bound on the relative (Frobenius) error of flash2's float32 results for every N <= n_max.

    For standard-normal q, k, v at d = 64 (tests/test_scale.py), in units of u = 2^-24:

    * each logit is a d-long 3xTF32 dot product: its rounding is that of a
      float32 sum, ~ sqrt(d) u = 8 u of |s| ~ 1 relative, and moves its weight
      by as much; ex2.approx adds 2^-22 = 4 u per weight: 12 u together;
    * each key tile's P V runs in a fresh tensor-core chain of at most 3 tile
      / 8 truncating steps (tiles of 16 to 128 keys: <= 48 u relative, biased
      but the same for every tile, so it does not grow with the number of tiles);
    * the tiles' partial results add into O (and l) on the float32 units,
      rounding to nearest: T <= n_max / smallest_tile adds whose errors are
      independent and zero-mean, so their sum is within lambda sqrt(T) u of
      the magnitude with probability >= 1 - 2 exp(-lambda^2 / 2) (Higham and
      Mary, "A new approach to probabilistic rounding error analysis", 2019);
      lambda = 6: sqrt(4096) 6 u = 384 u.

    The bound is the sum at the longest N tested, 444 u ~ 2.6e-5, and holds for
    every shorter one: it does not grow with N.  The kernels before this model
    (one chain across all key tiles) measured 4.7e-4 at N = 65536, 18 times
    over it.  The backward (dQ, dK, dV: the same chains, twice the products)
    gets twice the bound.
    """
    tiles = n_max // smallest_tile
    bound = (12 + 48 + 6 * np.sqrt(tiles)) * U32
    return 2 * bound if backward else bound


def _log_error(dtype, err, tol):
    """With NUMBA_FLASH_ERROR_LOG set, append each comparison's error (for the GPU report)."""
    path = os.environ.get("NUMBA_FLASH_ERROR_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{np.dtype(dtype).name} {err:.6g} {tol:.6g}\n")


def ring_tolerances(tol_o, tol_lse, gradient_tolerances, value_max, dtype, world):
    """Bounds on |ring attention - one call on the whole sequence| for O and each gradient, from one call's
    bounds: ``forward_tolerance``'s (tol_o, tol_lse) and ``backward_tolerance``'s, inputs of ``dtype``, values
    at most ``value_max`` in size, ``world`` ranks.

    Both results are within their own bound of the exact one.  The ring's O
    merges ``world`` partial results, each one call on fewer keys (within
    tol_o, its lse within tol_lse), with weights exp(lse_s - lse): each off by
    a factor of at most exp(2 tol_lse), and by 8 u per merge (exp, log, the
    sum, the product, the quotient), so O is within (1 + e) tol_o + e
    value_max with e = expm1(2 tol_lse) + 8 world u.  With 16-bit inputs each
    partial O comes rounded to the input type before the merge and the merged
    O is rounded again: one more u16 value_max.  The ring's gradients sum
    ``world`` partial backward calls, each within its own bound, which is at
    most the whole call's (fewer keys, smaller column sums of P); their
    float32 sum and final rounding add at most one bound more: world + 1
    times the whole call's, and world + 2 with the whole call's own.
    """
    merge = np.expm1(2 * tol_lse) + 8 * world * U32
    ring_o = (1 + merge) * tol_o + merge * value_max
    if np.dtype(dtype) != np.float32:
        ring_o += unit_roundoff(dtype) * value_max
    return [tol_o + ring_o] + [(world + 2) * tol for tol in gradient_tolerances]


def _score_gradient_error(q, k, v, o, do, scale, weights, weight_scale, dtype, mod_logits):
    """(e_P, B_dP, B_D, per_weight) of ``backward_tolerance``'s model (absolute inputs): a dS entry is off by at
    most P_ij per_weight."""
    d = q.shape[-1]
    u = unit_roundoff(dtype)
    finite_lse = np.max(np.abs(np.where(weights.sum(-1) > 0, np.log(np.maximum(weights.sum(-1), 1e-300)), 0)))
    e_s = logit_error(q, k, scale) + 4 * U32 * (1 + finite_lse) + mod_logit_error(mod_logits)
    e_p = np.expm1(2 * e_s) + 16 * u + (0.0 if mod_logits is None else 8 * U32)
    b_dp = float((do @ np.swapaxes(v, -1, -2)).max())
    b_d = float(np.sum(do * o, axis=-1).max())
    e_dp, e_d = (d + 8) * u * b_dp, (d + 8) * u * b_d
    return e_p, b_dp, b_d, weight_scale * (e_p * (b_dp + b_d) + e_dp + e_d)


def table_gradient_tolerance(q, k, v, o, do, scale, weights, reach, dtype=np.float32, mod_logits=None):
    """Bounds (H, 2 reach + 1) on the errors of relative_position_bias's table gradient, bin by bin: bin c of head h
    sums the dS entries of clamped distance c, each off by at most P_ij times ``backward_tolerance``'s per-weight
    error, so the bin by its share of P's mass (the reference ``weights``, (..., H, N_q, N_k)) times that error, plus
    the float32 rounding of sums of up to B N_q N_k terms of size at most P_ij (B_dP + B_D).  (The kernels keep P and
    dS in float32 for it; the 16-bit u of the model, for O and dO rounded to the input type, is the looser bound.)"""
    q, k, v, o, do = (np.abs(np.asarray(x, dtype=np.float64)) for x in (q, k, v, o, do))
    batch, n_q, n_k = int(np.prod(q.shape[:-3])) if q.ndim > 3 else 1, q.shape[-2], k.shape[-2]
    _, b_dp, b_d, per_weight = _score_gradient_error(q, k, v, o, do, scale, weights, 1.0, dtype, mod_logits)
    distance = np.clip(np.arange(n_k)[None, :] - np.arange(n_q)[:, None], -reach, reach) + reach
    flat = np.asarray(weights, np.float64).reshape(-1, weights.shape[-3], n_q * n_k)
    mass = np.stack([flat[..., distance.ravel() == c].sum(axis=(0, 2)) for c in range(2 * reach + 1)], axis=-1)
    return mass * (per_weight + (batch * n_q * n_k + 4) * U32 * (b_dp + b_d)) + TINY32


def backward_tolerance(q, k, v, o, do, scale, weights, weight_scale=1.0, dtype=np.float32, group=1, mod_logits=None):
    """(tol_dQ, tol_dK, tol_dV): first-order bounds on the gradient errors, from the inputs.

    16-bit: the flash2 backward rounds each P and dS entry to the input type
    for its tensor-core products, O and dO arrive rounded to it, and the
    results are rounded to it: every relative rounding below is then at
    most that type's u instead of U32 (the logits stay float32-accurate:
    16-bit inputs are exact and the products accumulate in float32), plus
    half an ulp of each result.

    ``weights`` is the reference P (undropped, float64).  With e_P the
    relative error of a weight (as in the forward model: logits, exp and the
    float32 lse the backward starts from), B_dP = max |dO_i . v_j| summed
    magnitudes and B_D = max |dO_i . O_i| likewise, each dS entry is off by at
    most P_ij Z (e_P (B_dP + B_D) + e_dP + e_D) with e_dP, e_D the dot
    products' (d + 8) u rounding.  dQ sums N_k such entries with weights
    summing to 1 per row; dK and dV sum over queries, where a column's
    weights add up to at most the largest column sum of P.  With grouped
    query heads (k, v given repeated per query head) dK and dV add ``group``
    heads' gradients, and so their bounds.

    ``mod_logits``: with a score_mod whose derivative is at most 1 in size (``mod_logit_error``), its rounding
    joins the logits' error, and dS's factor d score_mod / d score, computed in float32, adds 8 u to e_P.
    """
    q, k, v, o, do = (np.abs(np.asarray(x, dtype=np.float64)) for x in (q, k, v, o, do))
    n_q, n_k = q.shape[-2], k.shape[-2]
    u = unit_roundoff(dtype)
    e_p, b_dp, b_d, per_weight = _score_gradient_error(q, k, v, o, do, scale, weights, weight_scale, dtype,
                                                       mod_logits)
    column_sum = float(weights.sum(axis=-2).max())
    tol_dq = abs(scale) * k.max() * (per_weight + (n_k + 4) * u * weight_scale * (b_dp + b_d))
    tol_dk = abs(scale) * q.max() * column_sum * (per_weight + (n_q + 4) * u * weight_scale * (b_dp + b_d))
    tol_dv = do.max() * column_sum * weight_scale * (e_p + (n_q + 4) * u)
    tiny = TINY32
    if np.dtype(dtype) != np.float32:
        # Rounding the result to its 16-bit type: u of its magnitude (bounded as
        # the sums above are), down to the type's smallest subnormal.
        tiny = smallest_subnormal(dtype)
        tol_dq += u * abs(scale) * k.max() * weight_scale * (b_dp + b_d)
        tol_dk += u * abs(scale) * q.max() * column_sum * weight_scale * (b_dp + b_d)
        tol_dv += u * do.max() * column_sum * weight_scale
    return tol_dq + tiny, group * tol_dk + tiny, group * tol_dv + tiny
