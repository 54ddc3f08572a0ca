"""Programmable attention: score and mask modifications written in Python (FlexAttention's ``score_mod`` and
``mask_mod``), compiled by Numba into the ``mma.sync`` kernels and, on Hopper, the ``wgmma`` ones.

A mod is a plain Python function of scalars, plus the arrays it reads::

    score_mod(score, b, h, q_idx, kv_idx, *arrays) -> score     score = scale * q_i . k_j (natural units)
    mask_mod(b, h, q_idx, kv_idx, *arrays) -> bool              True: query q_idx may attend to key kv_idx

b is the batch index, h the *query* head (grouped-query attention: key/value head h // group), q_idx and kv_idx
the row and key within the sequence.  The kind follows the number of scalar parameters (5 or 4), as in
FlexAttention.

**Arrays are explicit trailing parameters.**  ``Mod(fn, *arrays)`` binds them: ``fn`` is called with them after
its scalars, in that order.  They are the mod's *run-time* data (slopes, tables, document ids, a soft-cap's
value): a Mod with the same function and arrays of the same dtypes and ranks reuses the compiled kernel, whatever
the values.  Values captured from an enclosing scope (a closure's cells, globals) are *compile-time constants*
for Numba: a new value is a new kernel.  The built-ins therefore keep their parameters in arrays (``softcap(30)``
and ``softcap(50)`` share one kernel).  Arrays may be NumPy arrays (copied to the GPU once per plan), torch CUDA
tensors or Numba device arrays (used in place when C-contiguous, so an optimiser's in-place update is seen by the
next call).  A plain function passed as ``score_mod=`` / ``mask_mod=`` is wrapped as ``Mod(fn)``.

Inside a mod use scalars, arithmetic, comparisons, ``and``/``or``/``not``, ``where(c, a, b)``, ``min``/``max``,
``abs`` and ``math.exp``/``log``/``tanh``/``sqrt`` (or ``exp``, ``log``, ``tanh``, ``sigmoid`` from this
module), and index the arrays with integer expressions.  The same function runs in three places: compiled by
Numba into the kernels (``numba.cuda.jit(device=True)``, always inlined), evaluated element by element by the
float64 NumPy reference (``reference/mods.py``), and traced once on symbolic dual numbers (``derivative``) to
generate d score_mod / d score for the backward.  A score_mod whose derivative cannot be traced (a Python
``if`` on the score, an unsupported function) needs ``grad=``: a function of the same parameters returning the
derivative.

Where mods run: the forward and backward of ``algorithm="flash2"`` (the ``mma.sync`` kernels; on a Hopper GPU the
``wgmma`` ones wherever flash2 takes those without mods) and of ``algorithm="wgmma"``.  Packed sequences
(``attention_varlen``, its backward, ``numba_flash.torch.attention_varlen``; ``mma.sync`` only) hand the mods each
sequence's indices (b its index in the pack, q_idx and kv_idx from its start); KV caches
(``attention_with_kv_cache``) the query's position in its entry, L_b - N_q + i.  Neither classifies a mask_mod's
tiles: it is evaluated on every visited tile's elements.  Gradients into the mods' arrays: a lone
``relative_position_bias``'s table learns through ``numba_flash.torch`` (summed by the backward's dQ kernel, mma.sync
or wgmma, ``kernels/fast/bias_table.py``; for packed sequences and the rest ``numba_flash/_bias_gradient.py``); other
arrays that require grad are refused (a TypeError); sinks, which ``numba_flash.torch.attention(..., sinks=)`` applies
after the kernel, learn too.

Not yet (this slice) besides: packed sequences on ``wgmma``, and tile lists for packed sequences and caches.

A batched call's mask_mod tiles are classified on the GPU (empty, full, partial: ``numba_flash/sparsity/
mod_tiles.py``) at a call's first use of its shape; ``numba_flash.tile_mask(mask_mod, batch, heads, n_q, n_k)`` does
it once ahead, returning a ``TileMask`` that calls take as their ``mask_mod`` (FlexAttention's
``create_block_mask``).  See ``docs/mods.md``.
"""
import inspect
import math
import numbers

import numpy as np
from numba import float32
from numba.core import types as numba_types
from numba.extending import register_jitable

from ._registry import new_key

#: The most arrays a call's score_mod and mask_mod read together (kernel parameter slots MOD0..MOD3).
MAX_MOD_ARRAYS = 4
SCORE, MASK = "score_mod", "mask_mod"
_SCALARS = {SCORE: ("score", "b", "h", "q_idx", "kv_idx"), MASK: ("b", "h", "q_idx", "kv_idx")}


# ---------------------------------------------------------------- helpers a mod may call (Numba, NumPy and the tracer)

@register_jitable
def where(condition, if_true, if_false):
    """``if_true`` where ``condition`` holds, else ``if_false`` (differentiable through the tracer)."""
    return if_true if condition else if_false


@register_jitable
def sigmoid(x):
    """1 / (1 + exp(-x))."""
    return 1.0 / (1.0 + math.exp(-x))


@register_jitable
def exp(x):
    return math.exp(x)


@register_jitable
def log(x):
    return math.log(x)


@register_jitable
def tanh(x):
    return math.tanh(x)


_REGISTERED = set()


def jitable(fn):
    """``fn`` (and a combinator's parts) made callable from Numba-compiled code of any target (``register_jitable``:
    the CUDA kernels, and the CPU code that checks mods and classifies a mask_mod's tiles)."""
    for part in getattr(fn, "__numba_flash_parts__", ()):
        jitable(part)
    if fn not in _REGISTERED:
        register_jitable(fn)
        _REGISTERED.add(fn)
    return fn


# ---------------------------------------------------------------- the Mod object

class Mod:
    """A score_mod or mask_mod: ``fn`` and the arrays it reads (its trailing parameters).

    ``grad``: for a score_mod, an optional function of the same parameters returning d fn / d score (when given,
    the tracer is not used).  ``name``: what errors and kernel names call it (default ``fn.__name__``).
    ``fits``: optional ``fits(heads, n_q, n_k)`` -> None, or what is wrong with the arrays for a call of H_q
    ``heads`` and those lengths (the built-ins check that their reads stay inside their arrays; a kernel does not).
    """

    def __init__(self, fn, *arrays, grad=None, name=None, fits=None):
        if isinstance(fn, Mod):
            raise TypeError(f"Mod({fn.name}) is already a Mod")
        if not callable(fn):
            raise TypeError(f"a mod must be a Python function, got {type(fn).__name__}")
        self.fn, self.arrays, self.grad, self.fits = fn, tuple(arrays), grad, fits
        self.name = name or getattr(fn, "__name__", "mod")
        if self.name == "<lambda>":
            self.name = "lambda"
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            raise TypeError(f"mod {self.name}: cannot read its parameters") from None
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY) for p in params):
            raise TypeError(f"mod {self.name}: takes *args, **kwargs or keyword-only parameters; a mod's parameters "
                            f"are its scalars, then one per array")
        scalars = len(params) - len(self.arrays)
        if scalars == 5:
            self.kind = SCORE
        elif scalars == 4:
            self.kind = MASK
        else:
            raise TypeError(f"mod {self.name}: takes {len(params)} parameters for {len(self.arrays)} arrays; a "
                            f"score_mod takes (score, b, h, q_idx, kv_idx, *arrays), a mask_mod (b, h, q_idx, kv_idx, "
                            f"*arrays)")
        if grad is not None and self.kind != SCORE:
            raise TypeError(f"mod {self.name}: grad= is for a score_mod (a mask_mod has no derivative)")
        for i, a in enumerate(self.arrays):
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                raise TypeError(f"mod {self.name}: array {i} is a {type(a).__name__}, not an array (scalars "
                                f"belong in a one-element array: values captured otherwise are compile-time "
                                f"constants)")
        #: How ``numba_flash.torch``'s operators name this mod (``_registry``).
        self.key = new_key(self)

    def __repr__(self):
        return f"Mod({self.name}, {len(self.arrays)} arrays, {self.kind})"

    def __and__(self, other):
        return and_masks(self, other)

    def __or__(self, other):
        return or_masks(self, other)

    @property
    def signature(self):
        """What the compiled code depends on: the function, and each array's dtype and rank (not its values)."""
        return (self.fn, self.grad, tuple((_dtype_name(a), len(a.shape)) for a in self.arrays))

    def host_arrays(self):
        """The arrays as float64/int64 NumPy arrays (the reference's copies)."""
        return tuple(_host_copy(a) for a in self.arrays)


def as_mod(mod, kind):
    """``mod`` (a Mod, a plain function, or None) as a Mod of ``kind``, or a TypeError naming it."""
    if mod is None:
        return None
    if not isinstance(mod, Mod):
        if not callable(mod):
            raise TypeError(f"{kind} must be a function or numba_flash.mods.Mod, got {type(mod).__name__}")
        mod = Mod(mod)
    if mod.kind != kind:
        raise TypeError(f"{kind}={mod.name}: a {mod.kind.replace('_', ' ')} ({'5' if mod.kind == SCORE else '4'} "
                        f"scalar parameters) where a {kind.replace('_', ' ')} was expected")
    return mod


def _dtype_name(a):
    return str(a.dtype).replace("torch.", "")


def _host_copy(a):
    if hasattr(a, "detach"):   # torch
        a = a.detach().cpu().float().numpy() if "bfloat16" in str(a.dtype) else a.detach().cpu().numpy()
    elif hasattr(a, "copy_to_host"):
        a = a.copy_to_host()
    a = np.asarray(a)
    if a.dtype.kind == "f":
        return a.astype(np.float64)
    if a.dtype.kind in "iub":
        return a.astype(np.int64)
    return a


# ---------------------------------------------------------------- combinators (generated source, one function each)

def _combined(name, kind, parts, body):
    """A Mod whose function calls ``parts``' functions: ``body`` formats each part's call from its array names."""
    scalars = _SCALARS[kind]
    arrays, calls, namespace = [], [], {}
    for i, part in enumerate(parts):
        names = [f"a{i}_{j}" for j in range(len(part.arrays))]
        arrays += names
        namespace[f"f{i}"] = part.fn
        # score_mods are chained by ``compose``, which puts each part's score in front of its other arguments
        calls.append(f"f{i}({', '.join(scalars[1:] if kind == SCORE else scalars)}{''.join(', ' + n for n in names)})")
    source = f"def {name}({', '.join(scalars + tuple(arrays))}):\n    return {body(calls)}\n"
    exec(compile(source, f"<numba_flash.mods.{name}>", "exec"), namespace)
    fn = namespace[name]
    fn.__numba_flash_source__ = source
    fn.__numba_flash_parts__ = tuple(part.fn for part in parts)
    checks = [part.fits for part in parts if part.fits is not None]

    def fits(heads, n_q, n_k):
        return next((m for m in (check(heads, n_q, n_k) for check in checks) if m), None)

    return Mod(fn, *(a for part in parts for a in part.arrays), name=name, fits=fits if checks else None)


def _each(calls):
    """Each part's verdict as a bool, all evaluated (``&``, ``|``: no short circuit, so that the compiled mask has no
    branch per part and its array reads are not each behind one: ``kernels/fast/mod_steps.entry_steps``)."""
    return [f"bool({call})" for call in calls]


def and_masks(*masks):
    """A mask_mod that attends where every mask does."""
    masks = [as_mod(m, MASK) for m in masks]
    if not masks:
        raise TypeError("and_masks needs at least one mask_mod")
    return _combined("and_" + "_".join(m.name for m in masks), MASK, masks, lambda calls: " & ".join(_each(calls)))


def or_masks(*masks):
    """A mask_mod that attends where any mask does."""
    masks = [as_mod(m, MASK) for m in masks]
    if not masks:
        raise TypeError("or_masks needs at least one mask_mod")
    return _combined("or_" + "_".join(m.name for m in masks), MASK, masks, lambda calls: " | ".join(_each(calls)))


def compose(*score_mods):
    """A score_mod applying ``score_mods`` in order (the first sees the scaled score, each the last's result)."""
    mods = [as_mod(m, SCORE) for m in score_mods]
    if not mods:
        raise TypeError("compose needs at least one score_mod")

    def body(calls):
        expression = "score"
        for call in calls:
            opening = call.index("(") + 1
            expression = call[:opening] + expression + ", " + call[opening:]
        return expression

    return _combined("_then_".join(m.name for m in mods), SCORE, mods, body)


# ---------------------------------------------------------------- built-ins

def _param(value, dtype, name, what):
    a = np.asarray(value, dtype=dtype).reshape(1)
    if not np.isfinite(a).all():
        raise ValueError(f"{name}: {what} must be finite, got {value!r}")
    return a


def _softcap(score, b, h, q_idx, kv_idx, cap):
    return cap[0] * math.tanh(score * cap[1])


def softcap(cap):
    """score -> cap * tanh(score / cap) (Gemma 2: cap 50 on the attention logits).  d/dscore = 1 - tanh^2.

    Its array holds (cap, 1 / cap) in float32: a multiply by the reciprocal where a division by the cap would cost an
    IEEE division (a multi-instruction sequence) per entry."""
    if not isinstance(cap, numbers.Real) or not cap > 0:
        raise ValueError(f"softcap: cap must be a positive number, got {cap!r}")
    value = _param(cap, np.float32, "softcap", "cap")
    return Mod(_softcap, np.concatenate([value, np.float32(1) / value]), name="softcap")


def _alibi(score, b, h, q_idx, kv_idx, slopes):
    # Each index converted on its own (float32 * int64 would be float64 arithmetic): a key's conversion serves every
    # row of a tile and a row's every key, where float32(kv_idx - q_idx) converted a 64-bit integer per entry.  The
    # same value below 2^24 positions, where both conversions and the difference are exact.
    return score + slopes[h] * (float32(kv_idx) - float32(q_idx))


def alibi_slopes(heads):
    """ALiBi's slopes m_h for ``heads`` heads (Press et al.; the reference ``get_slopes``): 2^(-8 (h + 1) / H) for H
    a power of two, otherwise those of the nearest lower power c, then every other slope of 2c's, H - c of them."""
    def power_of_two(n):
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    c = 2 ** int(math.floor(math.log2(heads)))
    slopes = power_of_two(c)
    if c < heads:
        slopes += power_of_two(2 * c)[0::2][:heads - c]
    return np.asarray(slopes, dtype=np.float32)


def alibi(slopes):
    """score -> score + slopes[h] * (kv_idx - q_idx): a linear bias by distance, per query head (<= 0 under causal).
    ``slopes``: (H_q,) float32 (``alibi_slopes(H)`` gives the paper's)."""
    return Mod(_alibi, slopes, name="alibi", fits=lambda heads, n_q, n_k: None if tuple(slopes.shape) == (heads,)
               else f"alibi: slopes has shape {tuple(slopes.shape)}, the call ({heads},) (one per query head)")


def _relative_position_bias(score, b, h, q_idx, kv_idx, bias):
    reach = (bias.shape[1] - 1) // 2
    return score + bias[h, min(max(kv_idx - q_idx, -reach), reach) + reach]


def relative_position_bias(bias):
    """score -> score + bias[h, clamp(kv_idx - q_idx, -D, D) + D] for a table ``bias`` (H_q, 2 D + 1): a learned
    bias per head and distance, distances beyond D clamped to D (T5-style, without buckets).  A torch table that
    requires grad gets its gradient through ``numba_flash.torch.attention`` when it is the call's only mod."""
    shape = tuple(bias.shape)
    if len(shape) != 2 or shape[1] % 2 != 1:
        raise ValueError(f"relative_position_bias: bias must be (heads, 2 D + 1), got shape {shape}")
    return Mod(_relative_position_bias, bias, name="relative_position_bias",
               fits=lambda heads, n_q, n_k: None if shape[0] == heads else
               f"relative_position_bias: bias has {shape[0]} rows, the call {heads} query heads")


def relative_bias_reach(mod):
    """D of a ``relative_position_bias`` Mod's (H, 2 D + 1) table, or None for any other mod."""
    if isinstance(mod, Mod) and mod.fn is _relative_position_bias:
        return (mod.arrays[0].shape[1] - 1) // 2
    return None


def _sliding_window(b, h, q_idx, kv_idx, window):
    return q_idx - window[0] < kv_idx and kv_idx <= q_idx


def sliding_window(window):
    """Attend iff q_idx - window < kv_idx <= q_idx: ``window`` keys, the query's own included (transformers'
    convention; attention-gym's ``sliding_window(W)`` is this with W + 1)."""
    if not isinstance(window, numbers.Integral) or window < 1:
        raise ValueError(f"sliding_window: window must be a positive int, got {window!r}")
    return Mod(_sliding_window, np.asarray([window], np.int32), name="sliding_window")


def _document(b, h, q_idx, kv_idx, q_docs, kv_docs):
    return q_docs[q_idx] == kv_docs[kv_idx]


def document(doc_ids, kv_doc_ids=None):
    """Attend iff query and key lie in the same document: doc_ids[q_idx] == kv_doc_ids[kv_idx] (int32 (N_q,) and
    (N_k,); kv_doc_ids defaults to doc_ids).  With ``causal=True``: packed causal training."""
    kv_doc_ids = doc_ids if kv_doc_ids is None else kv_doc_ids
    for name, ids in (("doc_ids", doc_ids), ("kv_doc_ids", kv_doc_ids)):
        if len(ids.shape) != 1:
            raise ValueError(f"document: {name} must be 1-D (one id per position), got shape {tuple(ids.shape)}")
    def fits(heads, n_q, n_k):
        if doc_ids.shape[0] < n_q or kv_doc_ids.shape[0] < n_k:
            return (f"document: {doc_ids.shape[0]} query and {kv_doc_ids.shape[0]} key document ids for N_q = {n_q}, "
                    f"N_k = {n_k}")
        return None

    return Mod(_document, doc_ids, kv_doc_ids, name="document", fits=fits)


def _prefix_lm(b, h, q_idx, kv_idx, prefix):
    return kv_idx < prefix[0] or kv_idx <= q_idx


def prefix_lm(prefix_len):
    """Attend iff kv_idx < prefix_len or kv_idx <= q_idx: the prefix sees itself both ways, the rest is causal."""
    if not isinstance(prefix_len, numbers.Integral) or prefix_len < 0:
        raise ValueError(f"prefix_lm: prefix_len must be a non-negative int, got {prefix_len!r}")
    return Mod(_prefix_lm, np.asarray([prefix_len], np.int32), name="prefix_lm")


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


#: Attend iff kv_idx <= q_idx (as ``causal=True``, but as a mask_mod to combine with others).
causal_mask = Mod(_causal, name="causal")


# ---------------------------------------------------------------- pictures

def draw(mod, n_q=12, n_k=None, b=0, h=0, score=0.0):
    """A mask_mod (or score_mod) drawn as text, rows q_idx, columns kv_idx (attention-gym's pictures): a mask_mod's
    ``#`` where it attends and ``.`` where not; a score_mod's value at ``score`` rounded to one decimal.  Evaluated in
    Python, on the host copies of the arrays."""
    n_k = n_q if n_k is None else n_k
    mod = mod if isinstance(mod, Mod) else Mod(mod)
    arrays = mod.host_arrays()
    rows = []
    for i in range(n_q):
        if mod.kind == MASK:
            rows.append("".join("#" if mod.fn(b, h, i, j, *arrays) else "." for j in range(n_k)))
        else:
            rows.append(" ".join(f"{float(mod.fn(score, b, h, i, j, *arrays)):5.1f}" for j in range(n_k)))
    return "\n".join(rows)


# ---------------------------------------------------------------- attention sinks (a post-step, not a mod)

def apply_sinks(o, lse, sinks):
    """Attention sinks (gpt-oss): a per-head logit s_h joins each row's softmax denominator with no value.  Given the
    forward's o (..., H, N, d) and lse (..., H, N) as float64/float32 NumPy arrays and ``sinks`` (H,), returns
    (o', lse') with lse' = logaddexp(lse, s_h) and o' = o exp(lse - lse').  The backward needs no change: run it
    with o' and lse' (the sink's column has no value, so D = rowsum(dO o') accounts for it); d L / d s_h =
    -sum over rows of exp(s_h - lse') rowsum(dO o o')."""
    sinks = np.asarray(sinks, dtype=np.float64).reshape(-1, 1)
    lse64 = np.asarray(lse, dtype=np.float64)
    new_lse = np.logaddexp(lse64, sinks)
    factor = np.exp(lse64 - new_lse)
    return (np.asarray(o, dtype=np.float64) * factor[..., None]).astype(np.asarray(o).dtype), \
        new_lse.astype(np.asarray(lse).dtype)


__all__ = ["Mod", "MAX_MOD_ARRAYS", "alibi", "alibi_slopes", "and_masks", "apply_sinks", "causal_mask", "compose",
           "derivative", "derivative_source", "document", "draw", "exp", "log", "or_masks", "prefix_lm",
           "relative_position_bias", "sigmoid", "sliding_window", "softcap", "tanh", "where"]


# ---------------------------------------------------------------- d score_mod / d score, by tracing on dual numbers

class Untraceable(Exception):
    """The tracer met something it cannot follow symbolically (the caller asks for ``grad=``)."""


def _text(x):
    if isinstance(x, Dual):
        return x.value
    if isinstance(x, bool):
        return repr(x)
    if isinstance(x, numbers.Integral):
        return repr(int(x))
    if isinstance(x, numbers.Real):
        return repr(float(x))
    raise Untraceable(f"a {type(x).__name__} value")


def _slope(x):
    """The derivative's expression of ``x`` (None: it does not depend on the score)."""
    return x.slope if isinstance(x, Dual) else None


def _sum(*terms):
    terms = [t for t in terms if t is not None]
    return None if not terms else " + ".join(f"({t})" for t in terms)


class Dual:
    """A symbolic dual number: ``value`` and ``slope`` are Python expressions (the slope d value / d score, or None
    for 0).  Evaluating a score_mod on Duals writes the source of its derivative; a Python ``if`` on one (its
    truth) cannot be followed and raises ``Untraceable``."""

    def __init__(self, value, slope=None, boolean=False):
        self.value, self.slope, self.boolean = value, slope, boolean

    def __bool__(self):
        raise Untraceable("a Python if/and/or/not on a value (write where(c, a, b); min, max are traced)")

    def __index__(self):
        raise Untraceable("a traced value used where Python needs an int")

    __int__ = __float__ = __index__

    def _binary(self, other, op, slope, swap=False):
        a, b = (other, self) if swap else (self, other)
        return Dual(f"({_text(a)} {op} {_text(b)})", slope(a, b))

    def __add__(self, o):
        return self._binary(o, "+", lambda a, b: _sum(_slope(a), _slope(b)))

    def __radd__(self, o):
        return self._binary(o, "+", lambda a, b: _sum(_slope(a), _slope(b)), True)

    def __sub__(self, o):
        return self._binary(o, "-", lambda a, b: _sum(_slope(a), _neg(_slope(b))))

    def __rsub__(self, o):
        return self._binary(o, "-", lambda a, b: _sum(_slope(a), _neg(_slope(b))), True)

    def __mul__(self, o):
        return self._binary(o, "*", _product_slope)

    def __rmul__(self, o):
        return self._binary(o, "*", _product_slope, True)

    def __truediv__(self, o):
        return self._binary(o, "/", _quotient_slope)

    def __rtruediv__(self, o):
        return self._binary(o, "/", _quotient_slope, True)

    def __floordiv__(self, o):
        return self._binary(o, "//", _flat)

    def __rfloordiv__(self, o):
        return self._binary(o, "//", _flat, True)

    def __mod__(self, o):
        return self._binary(o, "%", _flat)

    def __pow__(self, o):
        if isinstance(o, Dual):
            raise Untraceable("a power with a traced exponent")
        return Dual(f"({self.value} ** {_text(o)})",
                    None if self.slope is None else f"{_text(o)} * ({self.value} ** ({_text(o)} - 1)) * ({self.slope})")

    def __neg__(self):
        return Dual(f"(-{self.value})", _neg(self.slope))

    def __pos__(self):
        return self

    def __abs__(self):
        return _where(self >= 0, self, -self)

    def _compare(self, o, op):
        if self.boolean or (isinstance(o, Dual) and o.boolean):
            raise Untraceable("a comparison of conditions")
        return Dual(f"({_text(self)} {op} {_text(o)})", None, boolean=True)

    def __lt__(self, o):
        return self._compare(o, "<")

    def __le__(self, o):
        return self._compare(o, "<=")

    def __gt__(self, o):
        return self._compare(o, ">")

    def __ge__(self, o):
        return self._compare(o, ">=")

    def __eq__(self, o):
        return self._compare(o, "==")

    def __ne__(self, o):
        return self._compare(o, "!=")

    __hash__ = None


def _neg(slope):
    return None if slope is None else f"(-({slope}))"


def _flat(a, b):
    if _slope(a) is not None or _slope(b) is not None:
        raise Untraceable("// or % of a value that depends on the score")
    return None


def _product_slope(a, b):
    return _sum(None if _slope(a) is None else f"({_slope(a)}) * {_text(b)}",
                None if _slope(b) is None else f"{_text(a)} * ({_slope(b)})")


def _quotient_slope(a, b):
    return _sum(None if _slope(a) is None else f"({_slope(a)}) / {_text(b)}",
                None if _slope(b) is None else f"(-{_text(a)} * ({_slope(b)}) / ({_text(b)} * {_text(b)}))")


def _where(condition, if_true, if_false):
    if isinstance(condition, Dual) and not condition.boolean:
        raise Untraceable("where(c, ...) with a condition that is not a comparison")
    c = _text(condition)
    slope_true, slope_false = _slope(if_true), _slope(if_false)
    slope = None
    if slope_true is not None or slope_false is not None:
        slope = f"(({slope_true or '0.0'}) if {c} else ({slope_false or '0.0'}))"
    return Dual(f"({_text(if_true)} if {c} else {_text(if_false)})", slope)


def _least(a, b, *rest):
    if rest:
        return _least(_least(a, b), *rest)
    if not isinstance(a, Dual) and not isinstance(b, Dual):
        return min(a, b)
    return _where(Dual(f"({_text(a)} <= {_text(b)})", None, True), a, b)


def _greatest(a, b, *rest):
    if rest:
        return _greatest(_greatest(a, b), *rest)
    if not isinstance(a, Dual) and not isinstance(b, Dual):
        return max(a, b)
    return _where(Dual(f"({_text(a)} >= {_text(b)})", None, True), a, b)


def _unary(name, slope):
    """A traced math function: value name(x), slope slope(value text, x text) times x's slope."""
    def traced(x):
        if not isinstance(x, Dual):
            return getattr(math, name)(x) if name != "sigmoid" else 1.0 / (1.0 + math.exp(-x))
        value = f"math.{name}({x.value})" if name != "sigmoid" else f"(1.0 / (1.0 + math.exp(-{x.value})))"
        return Dual(value, None if x.slope is None else f"({slope(value, x.value)}) * ({x.slope})")
    return traced


class _TracedMath:
    exp = staticmethod(_unary("exp", lambda v, x: v))
    log = staticmethod(_unary("log", lambda v, x: f"1.0 / {x}"))
    tanh = staticmethod(_unary("tanh", lambda v, x: f"1.0 - {v} * {v}"))
    sqrt = staticmethod(_unary("sqrt", lambda v, x: f"0.5 / {v}"))
    fabs = staticmethod(abs)
    pi, e, inf = math.pi, math.e, math.inf

    def __getattr__(self, name):
        raise Untraceable(f"math.{name}")


_SIGMOID = _unary("sigmoid", lambda v, x: f"{v} * (1.0 - {v})")
_TRACED = {where: _where, sigmoid: _SIGMOID, exp: _TracedMath.exp, log: _TracedMath.log, tanh: _TracedMath.tanh,
           math.exp: _TracedMath.exp, math.log: _TracedMath.log, math.tanh: _TracedMath.tanh,
           math.sqrt: _TracedMath.sqrt, np.exp: _TracedMath.exp, np.log: _TracedMath.log, np.tanh: _TracedMath.tanh,
           np.sqrt: _TracedMath.sqrt}


class _TracedArray:
    """An array parameter while tracing: its real shape, and element reads as expressions (constant in the score)."""

    def __init__(self, name, shape):
        self.name, self.shape = name, tuple(int(n) for n in shape)
        self.ndim = len(self.shape)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        for i in index:
            if _slope(i) is not None:
                raise Untraceable("an array indexed by a value that depends on the score")
        return Dual(f"{self.name}[{', '.join(_text(i) for i in index)}]")


class _TracedModule:
    """A module a mod reads functions from (``numba_flash.mods``, ``numpy``): its traced functions swapped in."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return _traced_value(getattr(self._module, name))


def _traced_value(value):
    """A function a mod calls, as the tracer calls it: a traced one, a cast to a Numba number type as the identity
    (its derivative is 1), else itself."""
    if isinstance(value, numba_types.Number):
        return _cast
    try:
        return _TRACED.get(value, value)
    except TypeError:   # unhashable
        return value


def _cast(x):
    return x


def _traced_function(fn):
    """``fn`` with the functions it reads from its globals (and a combinator's parts) swapped for traced ones."""
    import types

    names = dict(fn.__globals__)
    for name in fn.__code__.co_names:
        value = names.get(name)
        if value is math:
            names[name] = _TracedMath()
        elif isinstance(value, types.ModuleType):
            names[name] = _TracedModule(value)
        elif callable(value) and not isinstance(value, type):
            traced = _traced_value(value)
            if traced is not value:
                names[name] = traced
            elif name in ("min", "max", "abs"):
                pass
            elif getattr(value, "__code__", None) is not None:
                names[name] = _traced_function(value)
    names.update(min=_least, max=_greatest, abs=abs)
    return types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, fn.__closure__)


def derivative_source(mod):
    """The Python source of d mod / d score (a function ``d_<name>(score, b, h, q_idx, kv_idx, A0, ...)``), traced on
    ``Dual``s, or ``Untraceable`` saying what stopped the tracer."""
    arrays = [_TracedArray(f"A{i}", a.shape) for i, a in enumerate(mod.arrays)]
    score = Dual("score", "1.0")
    try:
        result = _traced_function(mod.fn)(score, Dual("b"), Dual("h"), Dual("q_idx"), Dual("kv_idx"), *arrays)
    except Untraceable:
        raise
    except Exception as exc:   # a function the tracer's values cannot pass through
        raise Untraceable(f"{type(exc).__name__}: {exc}") from None
    if isinstance(result, Dual) and result.boolean:
        raise Untraceable("the score_mod returns a condition")
    slope = _slope(result) if isinstance(result, Dual) else None
    params = ", ".join(["score", "b", "h", "q_idx", "kv_idx"] + [a.name for a in arrays])
    return f"def d_{mod.name}({params}):\n    return {slope or '0.0'}\n"


def derivative(mod):
    """d mod / d score as a Python function of the score_mod's parameters: ``mod.grad`` if given, else traced
    (``derivative_source``); TypeError asking for ``grad=`` when the tracer cannot follow the function."""
    if mod.grad is not None:
        return mod.grad
    try:
        source = derivative_source(mod)
    except Untraceable as exc:
        raise TypeError(f"score_mod {mod.name}: cannot derive d {mod.name} / d score automatically ({exc}); pass "
                        f"Mod(fn, *arrays, grad=dfn) with dfn(score, b, h, q_idx, kv_idx, *arrays) -> the derivative")
    namespace = {"math": math}
    exec(compile(source, f"<numba_flash.mods.d_{mod.name}>", "exec"), namespace)
    fn = namespace[f"d_{mod.name}"]
    fn.__numba_flash_source__ = source
    return fn
