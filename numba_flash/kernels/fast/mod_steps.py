"""A call's score_mod and mask_mod as the kernels' steps: small device functions of one score entry.

The kernels have four array parameters for the mods, MOD0 .. MOD3: the score_mod's arrays first, then the
mask_mod's (``numba_flash.mods.MAX_MOD_ARRAYS``); unused slots hold a placeholder.  Each step takes all four and
hands the user's function its own::

    score_step(score, b, h, q_idx, kv_idx, MOD0, MOD1, MOD2, MOD3) -> float32     (natural units, as the user's)
    mask_step(b, h, q_idx, kv_idx, MOD0, ..., MOD3) -> bool
    slope_step(score, b, h, q_idx, kv_idx, MOD0, ..., MOD3) -> float32             d score_mod / d score

The user's functions are registered with ``numba.extending.register_jitable`` (so that any Numba target, the
CUDA kernels and the CPU check in ``_validation.check_mods``, can call them); the steps themselves are
``numba.cuda.jit(device=True)`` functions that LLVM always inlines (``inlined_device_function``).  A kernel
specialisation depends on a ``ModSteps`` only through its ``key``: the functions and the arrays' dtypes and ranks,
never their values.
"""
from dataclasses import dataclass, field

import numpy as np
from numba import float32
from numba.extending import register_jitable

from ...mods import MAX_MOD_ARRAYS, derivative, jitable
from ...runtime.arrays import kernel_array, placeholder
from ...runtime.launch import inlined_device_function
from .common import LOG2_E, NEG_INF
from .primitives import exp2

SLOTS = tuple(f"MOD{i}" for i in range(MAX_MOD_ARRAYS))


def _step(name, scalars, fn, first, count, cast):
    """A generated device function ``name(*scalars, MOD0..MOD3)`` returning ``cast(fn(*scalars, its arrays))``."""
    arrays = ", ".join(SLOTS[first:first + count])
    source = (f"def {name}({', '.join(scalars + SLOTS)}):\n"
              f"    return cast(fn({', '.join(scalars)}{', ' if arrays else ''}{arrays}))\n")
    namespace = {"fn": jitable(fn), "cast": cast}
    exec(compile(source, f"<numba_flash {name}>", "exec"), namespace)
    return namespace[name], source


@register_jitable
def _as_bool(x):
    return x != 0


@dataclass(frozen=True)
class ModSteps:
    """The compiled steps of one (score_mod, mask_mod) pair; ``slots``: (dtype, ndim) of MOD0 .. MOD3."""

    key: tuple
    name: str
    has_score: bool
    has_mask: bool
    slots: tuple
    score_step: object = field(compare=False, repr=False)
    mask_step: object = field(compare=False, repr=False)
    slope_step: object = field(compare=False, repr=False)
    sources: tuple = field(compare=False, repr=False)

    def __hash__(self):
        return hash(self.key)

    def kernel_arrays(self):
        """The kernel's ``arrays`` entries for the slots."""
        return {slot: spec for slot, spec in zip(SLOTS, self.slots)}


def _slot_specs(score_mod, mask_mod):
    arrays = (score_mod.arrays if score_mod else ()) + (mask_mod.arrays if mask_mod else ())
    specs = [(np.dtype(str(a.dtype).replace("torch.", "")).name, len(a.shape)) for a in arrays]
    return tuple(specs + [("float32", 1)] * (MAX_MOD_ARRAYS - len(specs)))


def mod_steps(score_mod, mask_mod, backward=False):
    """The ``ModSteps`` of a checked pair of Mods (either may be None; None for neither)."""
    if score_mod is None and mask_mod is None:
        return None
    key = (score_mod.signature if score_mod else None, mask_mod.signature if mask_mod else None,
           _slot_specs(score_mod, mask_mod), backward)
    return _cached_steps(key, score_mod, mask_mod, backward)


_STEPS = {}


def _cached_steps(key, score_mod, mask_mod, backward):
    """One ``ModSteps`` per key (the kernels' lru caches then see the same object for the same mods)."""
    steps = _STEPS.get(key)
    if steps is None:
        steps = _build(key, score_mod, mask_mod, backward)
        _STEPS[key] = steps
    return steps


def _build(key, score_mod, mask_mod, backward):
    n_score = len(score_mod.arrays) if score_mod else 0
    sources, score_step, mask_step, slope_step = [], None, None, None
    scalars = ("score", "b", "h", "q_idx", "kv_idx")
    if score_mod:
        score_step, source = _step("score_step", scalars, score_mod.fn, 0, n_score, float32)
        sources.append(source)
        if backward:
            slope_step, source = _step("slope_step", scalars, derivative(score_mod), 0, n_score, float32)
            sources.append(source)
    if mask_mod:
        mask_step, source = _step("mask_step", scalars[1:], mask_mod.fn, n_score, len(mask_mod.arrays), _as_bool)
        sources.append(source)
    name = "_".join(m.name for m in (score_mod, mask_mod) if m)
    wrap = (lambda f: None if f is None else inlined_device_function(f))
    return ModSteps(key, name, score_mod is not None, mask_mod is not None, _slot_specs(score_mod, mask_mod),
                    wrap(score_step), wrap(mask_step), wrap(slope_step), tuple(sources))


#: A kernel's MOD0 .. MOD3 parameters without mods: float32 placeholders.
NO_MOD_SLOTS = {slot: np.float32 for slot in SLOTS}


def slot_arrays(MODS):
    """A kernel's ``arrays`` entries for MOD0 .. MOD3: the mods' (dtype, ndim), or float32 placeholders."""
    return MODS.kernel_arrays() if MODS is not None else NO_MOD_SLOTS


def slot_arguments(mods):
    """A launch's MOD0 .. MOD3 for a call's ``mods`` (``call.mods``: a (score_mod, mask_mod) pair, or None): the
    mods' arrays on the device (NumPy ones copied once per plan, CUDA ones in place), placeholders after them."""
    score_mod, mask_mod = mods if mods else (None, None)
    arrays = [kernel_array(a) for a in (score_mod.arrays if score_mod else ()) + (mask_mod.arrays if mask_mod else ())]
    arrays += [placeholder(np.float32)] * (MAX_MOD_ARRAYS - len(arrays))
    return dict(zip(SLOTS, arrays))


def mods_suffix(MODS):
    """What a kernel specialisation's name says of its mods: "_mods_<names>", or nothing."""
    return f"_mods_{MODS.name}" if MODS is not None else ""


@inlined_device_function
def inside(index, end):
    """A row or key as the mods see it: ``index`` inside its sequence (``index < end``), else 0."""
    return index if index < end else index - index


def entry_steps(MODS):
    """The kernels' per-entry steps for ``MODS`` (a ``ModSteps``; None gives steps that are never called).

    ``mod_args`` is (b, h, scale, MOD0, MOD1, MOD2, MOD3): the batch and query head, the softmax scale (float32),
    the mods' arrays.  ``visible``: whether the entry is inside both sequences, the causal mask and the masks.
    ``row`` and ``key``: the entry's, each ``inside`` its sequence (the caller's part).

    * ``mod_allows(visible, row, key, mod_args)``: ``visible`` AND the mask_mod's verdict.
    * ``mod_score(x, visible, row, key, mod_args)``: the logit in log2 units, score_mod(scale x, ...) log2(e), of
      the unscaled product x = q . k; -inf where not visible.
    * ``mod_weight(x, lse2, visible, row, key, mod_args)``: (P, d score_mod / d score), P = exp2(mod_score -
      lse2) (the backward); (0, 0) where not visible.

    No step branches on ``visible``: as FlexAttention's, a mod is evaluated at every entry of a tile the kernel
    tests, hidden ones too (their results discarded), at indices inside the sequences (a row or key past its
    sequence is seen as 0), so that its array reads stay in bounds.  Called only where visible, as they were
    before, each entry's reads sat behind a branch of their own: NVVM could neither merge the same read repeated
    (a softcap's cap, ALiBi's slope; 32 a tile and thread) nor overlap the others' latencies.  And the indices do
    not depend on ``visible``, so reads that depend on the row alone (or the key) are made once per row (or key):
    a document mask's, say (``docs/mods.md``, Speed).
    """
    HAS_MASK_MOD = MODS is not None and MODS.has_mask
    HAS_SCORE_MOD = MODS is not None and MODS.has_score
    HAS_SLOPE = HAS_SCORE_MOD and MODS.slope_step is not None
    # The steps as closure variables of their own (Numba types a closure's functions, not a Python object's fields).
    mask_step = MODS.mask_step if HAS_MASK_MOD else None
    score_step = MODS.score_step if HAS_SCORE_MOD else None
    slope_step = MODS.slope_step if HAS_SLOPE else None

    @inlined_device_function
    def mod_allows(visible, row, key, mod_args):
        if HAS_MASK_MOD:
            b, h, _, MOD0, MOD1, MOD2, MOD3 = mod_args
            verdict = mask_step(b, h, row, key, MOD0, MOD1, MOD2, MOD3)
            return visible and verdict
        return visible

    @inlined_device_function
    def mod_score(x, visible, row, key, mod_args):
        b, h, scale, MOD0, MOD1, MOD2, MOD3 = mod_args
        score = score_step(x * scale, b, h, row, key, MOD0, MOD1, MOD2, MOD3)
        return score * float32(LOG2_E) if visible else float32(NEG_INF)

    @inlined_device_function
    def mod_weight(x, lse2, visible, row, key, mod_args):
        b, h, scale, MOD0, MOD1, MOD2, MOD3 = mod_args
        score = x * scale
        p = exp2(score_step(score, b, h, row, key, MOD0, MOD1, MOD2, MOD3) * float32(LOG2_E) - lse2)
        slope = slope_step(score, b, h, row, key, MOD0, MOD1, MOD2, MOD3) if HAS_SLOPE else float32(1)
        return (p, slope) if visible else (float32(0), float32(0))

    return mod_allows, mod_score, mod_weight
