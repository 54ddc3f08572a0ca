"""numba-flash for PyTorch: differentiable attention on torch tensors, eager, in CUDA graphs and under torch.compile.

    import numba_flash.torch as nft
    out = nft.attention(q, k, v, causal=True)      # q: (..., H_q, N, d), k, v: (..., H_kv, N, d) CUDA tensors
    out.sum().backward()                            # gradients from the flash2 backward
    out = nft.attention_varlen(q, k, v, cu_q, cu_k)  # packed sequences: q (total_q, H_q, d), cu_q int32 (B + 1,)

``attention`` is a drop-in for ``torch.nn.functional.scaled_dot_product_attention``
without an attention-mask tensor (use ``causal`` and ``block_mask``;
grouped-query heads as SDPA's ``enable_gqa=True``).  On a GPU:

* zero-copy: the kernels read q, k, v in place (any strides whose last
  dimension is contiguous, such as a (B, N, H, d) tensor transposed to
  (B, H, N, d)) and write O, lse and the gradients into tensors from torch's
  caching allocator;
* the kernels run on torch's current stream, ordered with the rest of the
  model's work, with no host synchronisation: a model that calls it can be
  captured in a CUDA graph (``torch.cuda.graph``) once it has run eagerly
  (the first call of each shape builds its launch, which a capture may not do);
* the forward saves q, k, v, O and lse (one float32 per row) for the
  backward, which recomputes P tile by tile: nothing N x N is ever stored;
* float32, float16 and bfloat16 (float32 accumulation), as ``numba_flash.attention``;
* under ``torch.compile`` it is the custom operator ``numba_flash::attention``
  (with ``numba_flash::attention_backward`` as its gradient), with fake
  implementations for tracing, so ``torch.compile(model, fullgraph=True)``
  compiles a model that calls it.  Eager calls skip the operator's dispatch
  and call the same autograd function directly.

CPU tensors are welcome too: on a GPU they are copied to the current CUDA
device, computed there, and O and the gradients come back to the CPU in
the inputs' dtype (a copy each way: for convenience, not speed).  In Numba's
CUDA simulator (no GPU) CPU tensors run the kernels in the simulator,
through NumPy: slow, but the same code path for tests.

torch is an optional dependency: ``pip install 'numba-flash[torch]'``.
"""
import numpy as np

from ._bias_gradient import learned_table, table_gradient
from ._registry import new_key, registered
from ._torch_calls import backward as _backward
from ._torch_calls import backward_and_table_sums as _backward_and_table_sums
from ._torch_calls import check_tensors as _check_tensors
from ._torch_calls import forward as _forward
from ._torch_calls import torch
from .ring import ring_attention  # noqa: F401  (one sequence over many GPUs: numba_flash/ring.py)
from .runtime.device import in_simulator
from .mods import Mod, as_mod
from .sparsity.block_mask import BlockMask

__all__ = ["attention", "attention_varlen", "FlashAttentionFunction", "SinkAttentionFunction"]

class FlashAttentionFunction(torch.autograd.Function):
    """O = softmax(scale q k^T) v with numba-flash's forward and backward kernels.

    ``apply(q, k, v, options, table)`` for ``attention``; ``apply(q, k, v, options, None, cu_seqlens_q,
    cu_seqlens_k)`` for ``attention_varlen`` (packed sequences).  ``table``: the score_mod's relative-bias table when
    it learns (``_bias_gradient.learned_table``), else None.
    """

    @staticmethod
    def forward(ctx, q, k, v, options, table, *sequences):
        out, lse = _forward(q, k, v, options, sequences)
        ctx.save_for_backward(q, k, v, out, lse, table, *sequences)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, table, *sequences = ctx.saved_tensors
        if ctx.needs_input_grad[4]:
            dq, dk, dv, d_table = _backward_and_table(q, k, v, out, lse, grad_out, table, ctx.options, sequences)
        else:
            (dq, dk, dv), d_table = _backward(q, k, v, out, lse, grad_out, ctx.options, sequences), None
        return (dq, dk, dv, None, d_table) + (None,) * len(sequences)


def _backward_and_table(q, k, v, out, lse, grad_out, table, options, sequences=()):
    """(dq, dk, dv, d L / d table) for a lone relative_position_bias whose table learns: the table's gradient summed
    by the backward's dQ kernel (mma.sync or wgmma) where it can (``kernels/fast/bias_table.py``), else on torch ops
    (``_table_gradient``)."""
    fused = None if sequences else _backward_and_table_sums(q, k, v, out, lse, grad_out, options)
    if fused is None:
        return (*_backward(q, k, v, out, lse, grad_out, options, sequences),
                _table_gradient(q, k, v, out, lse, grad_out, table, options, sequences))
    dq, dk, dv, sums = fused
    return dq, dk, dv, sums.sum((0, 2)).to(table.device, table.dtype)


def _table_gradient(q, k, v, out, lse, grad_out, table, options, sequences=()):
    """d L / d table of relative_position_bias (``_bias_gradient``), the call's causal mask and block mask applied;
    packed sequences (``sequences`` = cu_seqlens_q, cu_seqlens_k) one after another, each with its own indices and
    its causal mask aligned bottom-right, their gradients added in order."""
    if sequences:
        starts_q, starts_k = (x.cpu().tolist() for x in sequences)
        gradient = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
        for b in range(len(starts_q) - 1):
            rows, keys = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
            if rows.start < rows.stop and keys.start < keys.stop:
                per_head = [x[span].transpose(0, 1) for x, span in ((q, rows), (k, keys), (v, keys), (out, rows))]
                gradient += table_gradient(*per_head, lse[:, rows], grad_out[rows].transpose(0, 1), table,
                                           options["scale"], "bottom_right" if options["causal"] else False, None)
        return gradient.to(table.dtype)
    block_mask = options.get("block_mask")
    allowed = None if block_mask is None else torch.from_numpy(
        np.ascontiguousarray(block_mask.to_dense(q.shape[-2], k.shape[-2])))
    return table_gradient(q, k, v, out, lse, grad_out, table, options["scale"], options["causal"],
                          allowed).to(table.dtype)


# ---------------------------------------------------------------- the custom operator (torch.compile)
#
# A custom operator's arguments are tensors and plain values.  A BlockMask
# or a Mod travels as its integer key (``numba_flash._registry``: given when
# it was made, so Dynamo reads it as a constant and registers nothing while
# it traces); a plain function as a mod, as a key made for it once; the mods'
# torch arrays beside them (``_mod_arrays``); the seed as two 32-bit words.

#: Plain functions handed over as score_mods or mask_mods, and their keys (kept alive: a graph holds the key).
_FUNCTION_KEYS = {}
#: A plain function's Mod, made once (outside Dynamo: ``Mod`` reads the function's signature), so that what is kept
#: on a Mod (a mask_mod's tile classes, ``sparsity/mod_tiles.py``) serves every call of the compiled graph.
_FUNCTION_MODS = {}


@torch.library.custom_op("numba_flash::relative_bias_table_gradient_varlen", mutates_args=())
def _varlen_table_gradient_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                              grad_out: torch.Tensor, table: torch.Tensor, causal: str, scale: float | None,
                              cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """Packed sequences' ``_table_gradient`` as an operator of the compiled graphs' backward: one opaque node (the
    lengths are read on the host, which a traced graph cannot do), whose bits are eager mode's."""
    causal = {"false": False, "true": True}.get(causal, causal)
    return _table_gradient(q, k, v, out, lse, grad_out, table, dict(causal=causal, scale=scale),
                           (cu_seqlens_q, cu_seqlens_k))


@_varlen_table_gradient_op.register_fake
def _(q, k, v, out, lse, grad_out, table, causal, scale, cu_seqlens_q, cu_seqlens_k):
    return torch.empty_like(table)


def _mask_key(block_mask):
    """A BlockMask (or None) as the operators' integer key (-1: none)."""
    return -1 if block_mask is None else block_mask.key


def _mod_key(mod):
    """A score_mod or mask_mod (or None) as the operators' integer key (-1: none; ``_MADE_IN_GRAPH``: a Mod made
    inside the compiled region, which Dynamo hands over without its key, so the call takes the eager path)."""
    if mod is None:
        return -1
    if isinstance(mod, Mod):
        return mod.key if "key" in vars(mod) else _MADE_IN_GRAPH
    return _function_key(mod)


@torch.compiler.assume_constant_result
def _function_key(fn):
    """A plain function's key, made the first time it comes, while Dynamo traces (a function, unlike other objects,
    is a constant to every Dynamo version we run under)."""
    if fn not in _FUNCTION_KEYS:
        _FUNCTION_KEYS[fn] = new_key(fn)
    return _FUNCTION_KEYS[fn]


#: ``_mod_key``'s answer for a Mod that Dynamo built while tracing (an object without its fields yet).
_MADE_IN_GRAPH = -2


def _mod_arrays(*mods):
    """The torch tensors among the mods' arrays: the operators' ``mod_arrays``, graph inputs under torch.compile
    (so that an in-place update of one, a batch's new document ids say, is ordered before the call).  The operator
    runs the registered Mods, whose arrays are these tensors."""
    return [a for mod in mods if isinstance(mod, Mod) for a in mod.arrays if isinstance(a, torch.Tensor)]


def _registered_mod(key, kind):
    """The Mod under ``key`` (None for -1); a plain function's made once."""
    mod = registered(key)
    if mod is None or isinstance(mod, Mod):
        return mod
    if key not in _FUNCTION_MODS:
        _FUNCTION_MODS[key] = as_mod(mod, kind)
    return _FUNCTION_MODS[key]


def _options(causal, scale, mask_key, dropout_p, seed_low, seed_high, algorithm, block_sizes, deterministic,
             score_key=-1, mask_mod_key=-1):
    causal = {"false": False, "true": True}.get(causal, causal)
    options = dict(causal=causal, scale=scale, block_mask=registered(mask_key), dropout_p=dropout_p,
                   seed=seed_low | (seed_high << 32), algorithm=algorithm,
                   block_sizes=None if block_sizes is None else tuple(block_sizes), deterministic=deterministic)
    return _with_mods(options, score_key, mask_mod_key)


def _with_mods(options, score_key, mask_mod_key):
    """``options`` with the registered mods (as the eager calls pass them: only where there are some)."""
    score_mod, mask_mod = _registered_mod(score_key, "score_mod"), _registered_mod(mask_mod_key, "mask_mod")
    if score_mod is not None or mask_mod is not None:
        options.update(score_mod=score_mod, mask_mod=mask_mod)
    return options


@torch.library.custom_op("numba_flash::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: str, scale: float | None, mask_key: int,
                  dropout_p: float, seed_low: int, seed_high: int, algorithm: str,
                  block_sizes: list[int] | None, deterministic: bool, score_key: int, mask_mod_key: int,
                  mod_arrays: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _forward(q, k, v, _options(causal, scale, mask_key, dropout_p, seed_low, seed_high, algorithm,
                                          block_sizes, deterministic, score_key, mask_mod_key))
    return out, lse


@_attention_op.register_fake
def _(q, k, v, causal, scale, mask_key, dropout_p, seed_low, seed_high, algorithm, block_sizes, deterministic,
      score_key, mask_mod_key, mod_arrays):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("numba_flash::attention_backward", mutates_args=())
def _attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           grad_out: torch.Tensor, causal: str, scale: float | None, mask_key: int, dropout_p: float,
                           seed_low: int, seed_high: int, algorithm: str, deterministic: bool, score_key: int,
                           mask_mod_key: int,
                           mod_arrays: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _backward(q, k, v, out, lse, grad_out, _options(causal, scale, mask_key, dropout_p, seed_low,
                                                                 seed_high, algorithm, None, deterministic,
                                                                 score_key, mask_mod_key))
    return dq, dk, dv


@_attention_backward_op.register_fake
def _(q, k, v, out, lse, grad_out, causal, scale, mask_key, dropout_p, seed_low, seed_high, algorithm, deterministic,
      score_key, mask_mod_key, mod_arrays):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


@torch.library.custom_op("numba_flash::attention_backward_and_table", mutates_args=())
def _attention_table_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                 lse: torch.Tensor, grad_out: torch.Tensor, causal: str, scale: float | None,
                                 mask_key: int, dropout_p: float, seed_low: int, seed_high: int, algorithm: str,
                                 deterministic: bool, score_key: int, mask_mod_key: int,
                                 mod_arrays: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                          torch.Tensor]:
    """``_attention_backward_op`` and the gradient of the score_mod's relative-bias table (its only mod array), in one
    operator: eager mode's ``_backward_and_table``, bits included."""
    return _backward_and_table(q, k, v, out, lse, grad_out, mod_arrays[0],
                               _options(causal, scale, mask_key, dropout_p, seed_low, seed_high, algorithm, None,
                                        deterministic, score_key, mask_mod_key))


@_attention_table_backward_op.register_fake
def _(q, k, v, out, lse, grad_out, causal, scale, mask_key, dropout_p, seed_low, seed_high, algorithm, deterministic,
      score_key, mask_mod_key, mod_arrays):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)) + (
        torch.empty_like(mod_arrays[0]),)


def _table_learns(score_key, mask_mod_key, dropout_p):
    """Whether an operator call's score_mod is a relative_position_bias whose table needs its gradient (whatever the
    grad mode: AOTAutograd traces the setup without grad)."""
    return mask_mod_key == -1 and learned_table(registered(score_key), None, dropout_p, grad_mode=False) is not None


def _setup_context(ctx, inputs, output):
    q, k, v, *options, mod_arrays = inputs
    ctx.save_for_backward(q, k, v, *output, *mod_arrays)
    ctx.options = options
    ctx.table_learns = _table_learns(options[-2], options[-1], options[3])


def _op_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, *mod_arrays = ctx.saved_tensors
    (causal, scale, mask_key, dropout_p, seed_low, seed_high, algorithm, _, deterministic, score_key,
     mask_mod_key) = ctx.options
    arguments = (q, k, v, out, lse, grad_out, causal, scale, mask_key, dropout_p, seed_low, seed_high, algorithm,
                 deterministic, score_key, mask_mod_key, mod_arrays)
    d_arrays = [None] * len(mod_arrays)
    if ctx.table_learns:   # (relative_position_bias alone: its table is the only mod array)
        dq, dk, dv, d_arrays[0] = _attention_table_backward_op(*arguments)
    else:
        dq, dk, dv = _attention_backward_op(*arguments)
    return (dq, dk, dv) + (None,) * 11 + (d_arrays,)


_attention_op.register_autograd(_op_backward, setup_context=_setup_context)


def _varlen_options(causal, scale, dropout_p, seed_low, seed_high, algorithm, block_sizes, deterministic,
                    score_key=-1, mask_mod_key=-1):
    causal = {"false": False, "true": True}.get(causal, causal)
    options = dict(causal=causal, scale=scale, dropout_p=dropout_p, seed=seed_low | (seed_high << 32),
                   algorithm=algorithm, block_sizes=None if block_sizes is None else tuple(block_sizes),
                   deterministic=deterministic)
    return _with_mods(options, score_key, mask_mod_key)


@torch.library.custom_op("numba_flash::attention_varlen", mutates_args=())
def _attention_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, causal: str, scale: float | None, dropout_p: float,
                         seed_low: int, seed_high: int, algorithm: str, block_sizes: list[int] | None,
                         deterministic: bool, score_key: int, mask_mod_key: int,
                         mod_arrays: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _forward(q, k, v, _varlen_options(causal, scale, dropout_p, seed_low, seed_high, algorithm,
                                                 block_sizes, deterministic, score_key, mask_mod_key),
                        (cu_seqlens_q, cu_seqlens_k))
    return out, lse


@_attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dropout_p, seed_low, seed_high, algorithm, block_sizes,
      deterministic, score_key, mask_mod_key, mod_arrays):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


@torch.library.custom_op("numba_flash::attention_varlen_backward", mutates_args=())
def _attention_varlen_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                  lse: torch.Tensor, grad_out: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                  cu_seqlens_k: torch.Tensor, causal: str, scale: float | None, dropout_p: float,
                                  seed_low: int, seed_high: int, algorithm: str, deterministic: bool, score_key: int,
                                  mask_mod_key: int,
                                  mod_arrays: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _backward(q, k, v, out, lse, grad_out, _varlen_options(causal, scale, dropout_p, seed_low,
                                                                        seed_high, algorithm, None, deterministic,
                                                                        score_key, mask_mod_key),
                           (cu_seqlens_q, cu_seqlens_k))
    return dq, dk, dv


@_attention_varlen_backward_op.register_fake
def _(q, k, v, out, lse, grad_out, cu_seqlens_q, cu_seqlens_k, causal, scale, dropout_p, seed_low, seed_high,
      algorithm, deterministic, score_key, mask_mod_key, mod_arrays):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options, mod_arrays = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens_q, cu_seqlens_k, *mod_arrays)
    ctx.options = options
    ctx.table_learns = _table_learns(options[-2], options[-1], options[2])


def _varlen_op_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *mod_arrays = ctx.saved_tensors
    causal, scale, dropout_p, seed_low, seed_high, algorithm, _, deterministic, score_key, mask_mod_key = ctx.options
    dq, dk, dv = _attention_varlen_backward_op(q, k, v, out, lse, grad_out, cu_seqlens_q, cu_seqlens_k, causal,
                                               scale, dropout_p, seed_low, seed_high, algorithm, deterministic,
                                               score_key, mask_mod_key, mod_arrays)
    d_arrays = [None] * len(mod_arrays)
    if ctx.table_learns:   # (relative_position_bias alone: its table is the only mod array)
        d_arrays[0] = _varlen_table_gradient_op(q, k, v, out, lse, grad_out, mod_arrays[0], causal, scale,
                                                cu_seqlens_q, cu_seqlens_k)
    return (dq, dk, dv) + (None,) * 12 + (d_arrays,)


_attention_varlen_op.register_autograd(_varlen_op_backward, setup_context=_varlen_setup_context)


# ---------------------------------------------------------------- the public function

def attention(q, k, v, *, causal=False, scale=None, block_mask=None, dropout_p=0.0, seed=0, algorithm="flash2",
              block_sizes=None, deterministic=True, score_mod=None, mask_mod=None, sinks=None):
    """Differentiable ``numba_flash.attention`` on torch tensors (see the module docstring).

    q: (..., H_q, N_q, d), k and v: (..., H_kv, N_k, d), torch tensors on
    one device (CUDA, or CPU: computed on the GPU, results on the CPU; CPU
    only in the simulator) of one dtype: float32, float16 or
    bfloat16 (16-bit ones need algorithm="flash2").  Arguments as for
    ``numba_flash.attention``; ``block_sizes`` applies to the forward (the
    backward uses its own defaults).  flash2 reads strided inputs in place;
    the literal algorithms get contiguous copies.  Returns O with q's shape,
    dtype and device; ``O.backward()`` computes the gradients of q, k and v
    with ``algorithm``'s backward (flash2: the fast one, on Hopper's
    warpgroup instructions where the call is in their scope; flash1:
    Algorithm 4, float32; wgmma: the forward and backward on Hopper's
    warpgroup instructions, 16-bit, d a multiple of 16 up to 128).
    ``deterministic``: as for ``numba_flash.attention_backward`` (today both
    values give the same bits on every run: determinism measured free).

    ``score_mod``, ``mask_mod``: as for ``numba_flash.attention`` (``numba_flash.mods``), on the kernels the
    algorithm picks (wgmma or ``mma.sync``, as without mods) forward and backward; q, k and v get their gradients
    through the mods, and a lone ``relative_position_bias``'s table gets its own (summed by the wgmma dQ kernel where
    the backward runs it, else ``_bias_gradient``: ``_backward_and_table``; another mod array that requires grad is a
    TypeError).  Under ``torch.compile`` (``fullgraph=True`` too) the mods travel
    through the custom operators as integer keys (a Mod's given when it was made: ``_registry``), with the torch
    tensors among their arrays as the operators' inputs (an in-place update of one is ordered before the call); a
    new Mod object (or function) is a new key, and Dynamo recompiles for it: define mods once.

    ``sinks``: attention sinks (gpt-oss), a float tensor (H_q,) of logits, one per query head, that join each row's
    softmax denominator with no value: O' = O exp(lse - lse'), lse' = logaddexp(lse, sinks[h]).  Differentiable in
    q, k, v and the sinks (``SinkAttentionFunction``); eager only (a graph break under ``torch.compile``).
    """
    _check_tensors((("q", q), ("k", k), ("v", v)))
    if algorithm not in ("flash2", "flash1", "wgmma"):
        raise ValueError(f"algorithm must be 'flash2', 'flash1' or 'wgmma' (the algorithms with a backward; flash2's "
                         f"forward runs on wgmma by itself on Hopper GPUs), got {algorithm!r}")
    if algorithm == "flash1" or in_simulator():
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if sinks is not None:
        heads = q.shape[-3] if q.dim() > 2 else 1
        if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (heads,):
            raise ValueError(f"sinks must be a tensor of one logit per query head ({heads},), "
                             f"got {getattr(sinks, 'shape', type(sinks).__name__)}")
        options = dict(causal=causal, scale=scale, block_mask=block_mask, dropout_p=dropout_p, seed=seed,
                       algorithm=algorithm, block_sizes=block_sizes, deterministic=deterministic,
                       score_mod=score_mod, mask_mod=mask_mod)
        if learned_table(score_mod, mask_mod, dropout_p) is not None:
            raise TypeError("relative_position_bias's table learns only without sinks (detach it, or leave out "
                            "the sinks)")
        return _sink_attention(q, k, v, sinks, options)
    options = dict(causal=causal, scale=scale, block_mask=block_mask, dropout_p=dropout_p, seed=seed,
                   algorithm=algorithm, block_sizes=block_sizes, deterministic=deterministic)
    if score_mod is not None or mask_mod is not None:
        options.update(score_mod=score_mod, mask_mod=mask_mod)
    if torch.compiler.is_compiling():
        if block_mask is not None and not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a numba_flash.BlockMask or None, got {type(block_mask).__name__}")
        score_key, mask_mod_key = _mod_key(score_mod), _mod_key(mask_mod)
        if _MADE_IN_GRAPH in (score_key, mask_mod_key):
            return _eager_attention(q, k, v, options)
        learned_table(score_mod, mask_mod, dropout_p)   # (an array that cannot learn: its TypeError, now)
        out, _ = _attention_op(q, k, v, str(causal).lower(), scale, _mask_key(block_mask), float(dropout_p),
                               seed & 0xFFFFFFFF, seed >> 32, algorithm,
                               None if block_sizes is None else list(block_sizes), bool(deterministic),
                               score_key, mask_mod_key, _mod_arrays(score_mod, mask_mod))
        return out
    return FlashAttentionFunction.apply(q, k, v, options, learned_table(score_mod, mask_mod, dropout_p))


class SinkAttentionFunction(torch.autograd.Function):
    """Attention with sinks: one logit s_h per query head joins the softmax's denominator, with no value.

    Forward: (O, lse) of the kernels, then lse' = logaddexp(lse, s_h) and O' = O exp(lse - lse').  Backward: the
    kernels' backward on O' and lse' gives dq, dk, dv as they are (P = exp(S - lse') are the weights, and the sink's
    column, with no value, adds nothing to dO V^T); d L / d s_h = -sum over the head's rows of
    exp(s_h - lse') rowsum(dO o O').
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, options):
        out, lse = _forward(q, k, v, options)
        column = _per_row(sinks, lse)
        new_lse = torch.logaddexp(lse, column)
        factor = torch.where(torch.isneginf(lse), torch.zeros_like(lse), torch.exp(lse - new_lse))
        out = (out.float() * factor[..., None]).to(out.dtype)
        ctx.save_for_backward(q, k, v, out, new_lse, sinks)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, grad_out, ctx.options)
        p_sink = torch.exp(_per_row(sinks, lse) - lse)                 # the sink's weight in each row
        terms = -p_sink * (grad_out.float() * out.float()).sum(-1)     # (..., H, N_q), or (N_q,) for one head
        dsinks = terms.reshape((-1,) + tuple(sinks.shape) + terms.shape[-1:]).sum((0, 2))
        return dq, dk, dv, dsinks.to(sinks.dtype), None


def _per_row(sinks, lse):
    """The sink logits as float32 broadcasting against lse (..., H, N_q): (H, 1), or a scalar for 2-D inputs."""
    column = sinks.detach().to(torch.float32)
    return column.reshape((-1, 1)) if lse.dim() >= 2 else column.reshape(())


@torch.compiler.disable
def _eager_attention(q, k, v, options, *sequences):
    """A call whose mods were made inside the compiled region (``_mod_key``): the autograd function, eagerly (a
    graph break), where Dynamo hands them over built."""
    table = learned_table(options.get("score_mod"), options.get("mask_mod"), options["dropout_p"])
    return FlashAttentionFunction.apply(q, k, v, options, table, *sequences)


@torch.compiler.disable
def _sink_attention(q, k, v, sinks, options):
    """A call with sinks: ``SinkAttentionFunction``, eagerly (a graph break under torch.compile)."""
    return SinkAttentionFunction.apply(q, k, v, sinks, options)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None, dropout_p=0.0, seed=0,
                     block_sizes=None, algorithm="flash2", deterministic=True, score_mod=None, mask_mod=None):
    """Differentiable ``numba_flash.attention_varlen`` on torch tensors: sequences of different lengths packed
    without padding, q (total_q, H_q, d), k and v (total_k, H_kv, d), sequence b in rows cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1] - 1 (and cu_seqlens_k for keys), as flash-attn's ``flash_attn_varlen_func``.

    q, k, v: CUDA or CPU tensors, as for ``attention``.
    cu_seqlens_q, cu_seqlens_k: int32 tensors of batch + 1 entries on q's device; they are read on the host
    to be checked (one small copy per call).  ``causal=True`` aligns each sequence's mask bottom-right, as
    flash-attn does.  Returns O shaped like q; ``O.backward()`` gives q, k and v their gradients.
    ``algorithm`` ("flash2" or "wgmma") and ``deterministic``: as for ``numba_flash.attention_varlen`` and
    ``numba_flash.attention_varlen_backward`` (flash2 keeps packed sequences on mma.sync for now; "wgmma" runs the
    forward and backward on Hopper's warpgroup instructions).  ``score_mod``, ``mask_mod``: as for
    ``numba_flash.attention_varlen`` (indices within each sequence), differentiable in q, k and v as ``attention``'s
    mods are (a lone ``relative_position_bias``'s table too), and under ``torch.compile`` as they are.
    """
    _check_tensors((("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)))
    if in_simulator():
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    options = dict(causal=causal, scale=scale, dropout_p=dropout_p, seed=seed, algorithm=algorithm,
                   block_sizes=block_sizes, deterministic=deterministic)
    if score_mod is not None or mask_mod is not None:
        options.update(score_mod=score_mod, mask_mod=mask_mod)
    if torch.compiler.is_compiling():
        score_key, mask_mod_key = _mod_key(score_mod), _mod_key(mask_mod)
        if _MADE_IN_GRAPH in (score_key, mask_mod_key):
            return _eager_attention(q, k, v, options, cu_seqlens_q, cu_seqlens_k)
        learned_table(score_mod, mask_mod, dropout_p)   # (an array that cannot learn: its TypeError, now)
        out, _ = _attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, str(causal).lower(), scale,
                                      float(dropout_p), seed & 0xFFFFFFFF, seed >> 32, algorithm,
                                      None if block_sizes is None else list(block_sizes), bool(deterministic),
                                      score_key, mask_mod_key, _mod_arrays(score_mod, mask_mod))
        return out
    return FlashAttentionFunction.apply(q, k, v, options, learned_table(score_mod, mask_mod, dropout_p),
                                        cu_seqlens_q, cu_seqlens_k)
