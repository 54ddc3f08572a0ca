"""numba-flash as an attention implementation of Hugging Face ``transformers``.

    import numba_flash.integrations.transformers as numba_flash_hf
    numba_flash_hf.register()   # once: "numba_attention" joins transformers' attention and mask registries
    model = AutoModelForCausalLM.from_config(config, attn_implementation=numba_flash_hf.NAME)

Every model whose attention goes through transformers' ``AttentionInterface``
(Llama, Mistral, Qwen, GPT-2, ...) then runs ``numba_flash.torch.attention``:
grouped key/value heads are read as they are (no ``repeat_kv``), and the
backward is numba-flash's.  Masks, as transformers builds them for us (its
``sdpa_mask`` through ``attention_mask``, registered under our name):

* no mask: a causal layer attends causally, aligned bottom-right (a chunk of
  new queries after a cache sees every cached key; one query sees them all),
  a bidirectional one attends to every key.  (``attention_mask`` never hands
  over None where SDPA's top-left ``is_causal`` would differ from that: a
  static cache's first chunk against its whole max_cache_len keys gets a mask.)
* a static cache (``cache_implementation="static"``): transformers hands every
  layer the whole cache, max_cache_len keys, of which the first
  L = cache length before the call + N_q hold keys, and a mask saying so.
  Where the mask is transformers' plain causal one with no padding inside
  the L keys, ``attention_mask`` tags it with L per batch row (an int32
  tensor computed on the GPU, once per forward) and every layer calls
  ``numba_flash.attention_with_kv_cache`` (q against the cache, lengths L,
  causal bottom-right, no append: transformers already wrote the cache), with
  no host synchronisation per layer and no mask read;
* a boolean mask that is exactly the bottom-right causal pattern: as no mask,
  without reading it;
* any other boolean mask (padding, packed sequences, sliding windows built
  into the mask): element by element, as a ``BlockMask`` of 1 x 1 blocks.
  This copies the mask to the host (a synchronisation) and lists its tiles
  there: exact, but slower than an unmasked call.  A query row that may see
  no key gives zeros (transformers' SDPA path gives such padding rows other
  values; they are never read).

The static-cache path runs eagerly: on a GPU, transformers' ``generate``
compiles a static cache's forward with ``torch.compile`` unless given
``disable_compile=True``, and a compiled forward takes the general path.

Whether a static cache's rows are padded is on the GPU.  By default
(``READ_PADDING = True``) ``attention_mask`` reads one boolean per forward
(not per layer), only when a 2-D padding mask is given (transformers 5.25's
``generate`` gives none where its mask is all ones): padded batches (left
padding) take the element-wise path, exactly.  With ``READ_PADDING = False``
nothing is read: every row is assumed unpadded within its L keys, and the
assumption is checked on the GPU: a row whose padding mask hides one of its
first L keys gets length -1, which the kernel answers with NaN in its rows
(never a silently wrong token).  ``CHECK_STATIC_CACHE = True`` (for tests and
debugging) also compares, at every layer, the mask with the pattern the
lengths stand for, on the host, and raises where they differ.

Arguments passed through ``numba_flash.mods`` (issue 46):

* ``softcap`` (Gemma 2): ``mods.softcap(cap)`` as the score_mod, after the
  scaling and before the mask, as transformers' eager path;
* ``sliding_window`` W (Mistral, Gemma 2's sliding layers, gpt-oss): key j is
  visible to query i iff j <= i and j > i - W in absolute positions
  (transformers' ``sliding_window_causal_mask_function``: W keys, the query's
  own included).  transformers builds that window into the mask it gives us;
  where the mask is exactly the bottom-right causal window pattern, the call
  runs with the window as a mask_mod (``window_mask``, offset N_k - N_q),
  without reading the mask; any other mask (padding) element by element, as
  above; no mask (every key inside the window) as plain causal;
* ``s_aux`` / ``sinks`` (gpt-oss): ``numba_flash.torch.attention(sinks=)``,
  differentiable in the sink logits.

A static cache's fast path (``attention_with_kv_cache``) takes the softcap as
its score_mod (the kernel's mods see a query at its position in the cache).
A call with sinks or a window still goes through the general path (the
window's mask_mod where the mask is its pattern, otherwise the mask element by
element), so ``generate`` works, more slowly: a sliding layer's mask is not the
plain causal one that ``attention_mask`` tags with lengths, and sinks need the
lse after the kernel.

Arguments numba-flash does not implement (position biases, ``head_mask``,
``output_attentions``) raise a ValueError naming them.
"""
import functools
import inspect

import numpy as np

from .._optional import require

torch = require("torch", "transformers", "numba_flash.integrations.transformers")

from .. import api
from .. import mods
from .. import torch as numba_flash_torch
from .._torch_calls import _run, check_tensors
from ..sparsity.block_mask import BlockMask

#: The name models ask for: ``attn_implementation="numba_attention"``.  Not "numba_flash": transformers
#: treats any name containing "flash" as a flash-attn kernel to fetch from its hub.
NAME = "numba_attention"

#: Keyword arguments transformers may pass that change the result and that we do not implement.
_UNSUPPORTED = ("position_bias", "head_mask")

#: Read on the host, once per forward, whether a static cache's padding mask pads any row inside its keys
#: (then the exact element-wise path); False: assume not, checked on the GPU (a padded row gives NaN).
READ_PADDING = True

#: Compare every static-cache call's mask with its lengths on the host (a synchronisation per layer), raising
#: where they differ: for tests and debugging.
CHECK_STATIC_CACHE = False

#: The attribute of a mask tensor built by ``attention_mask`` that holds its rows' key counts L (int32, (B,)).
_LENGTHS = "_numba_flash_cache_lengths"


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' attention-function signature: query (B, H_q, N_q, d), key and value (B, H_kv, N_k, d);
    returns (attention output (B, N_q, H_q, d), None)."""
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"numba_flash attention does not implement {name}={kwargs[name]!r}; use "
                             f"attn_implementation='sdpa' for this model")
    if kwargs.get("output_attentions"):
        raise ValueError("numba_flash attention never forms the attention weights: output_attentions=True needs "
                         "attn_implementation='eager'")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    n_q, n_k = query.shape[-2], key.shape[-2]
    softcap = kwargs.get("softcap")
    score_mod = mods.softcap(float(softcap)) if softcap is not None else None
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None:
        sinks = sinks.to(query.device)
    window = kwargs.get("sliding_window")
    if window is not None and not causal:
        raise ValueError(f"numba_flash attention implements sliding_window={window!r} for causal layers only")
    block_mask = mask_mod = None
    alignment = "bottom_right" if causal else False
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            raise ValueError(f"numba_flash attention takes boolean masks (transformers' sdpa_mask), got "
                             f"{attention_mask.dtype}")
        # Eager only: under torch.compile (transformers' generate compiles a static cache's forward on a GPU
        # unless told disable_compile=True) the call takes the general path.  The KV-cache kernel takes the
        # softcap as its score_mod; a call with sinks or a window takes the general path.
        lengths = None if torch.compiler.is_compiling() else getattr(attention_mask, _LENGTHS, None)
        if (lengths is not None and causal and not dropout and sinks is None and window is None
                and lengths.device == query.device and _fits_cache_call(query, key, value, attention_mask)):
            return cache_attention(query, key, value, lengths, attention_mask, scaling, score_mod), None
        if window is not None and _is_bottom_right_window(attention_mask, n_q, n_k, int(window)):
            mask_mod, alignment = window_mask(int(window), n_k - n_q), False
        elif not _is_bottom_right_causal(attention_mask, n_q, n_k):
            block_mask = BlockMask(attention_mask.detach().cpu().numpy(), (1, 1))
            alignment = False   # the mask says everything
    elif window is not None and n_k > int(window):
        # transformers gives no mask only where every key lies inside the window; a direct call may not.
        mask_mod, alignment = window_mask(int(window), n_k - n_q), False
    seed = int(torch.randint(0, 2 ** 62, ())) if dropout > 0 else 0
    out = numba_flash_torch.attention(query, key, value, causal=alignment, scale=scaling, block_mask=block_mask,
                                      dropout_p=float(dropout), seed=seed, score_mod=score_mod, mask_mod=mask_mod,
                                      sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def _window(b, h, q_idx, kv_idx, window):
    position = q_idx + window[1]
    return kv_idx <= position and kv_idx > position - window[0]


@functools.lru_cache(maxsize=64)
def window_mask(window, offset=0):
    """A mask_mod: query i (at position i + offset among the keys) sees key j iff i + offset - window < j <= i +
    offset: transformers' sliding-window causal mask, bottom-right aligned for offset = N_k - N_q.  One Mod per
    (window, offset), kept: a Mod keeps its tile classification (a host loop over the (N_q, N_k) grid), so every
    layer and every forward of one shape reuses it."""
    return mods.Mod(_window, np.asarray([window, offset], np.int32), name="sliding_window")


def _is_bottom_right_window(mask, n_q, n_k, window):
    """Whether every batch and head of a (B, H, N_q, N_k) boolean mask is the bottom-right causal window."""
    i = torch.arange(n_q, device=mask.device)[:, None] + (n_k - n_q)
    j = torch.arange(n_k, device=mask.device)[None, :]
    return bool((mask == ((j <= i) & (j > i - window))).all())


def _fits_cache_call(query, key, value, mask):
    """Whether a tagged mask still describes this call (its shape: (B, 1, N_q, N_k)) and the call needs no
    gradient (the KV-cache kernel has no backward)."""
    batch, n_q, n_k = query.shape[0], query.shape[-2], key.shape[-2]
    grads = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    return mask.dim() == 4 and tuple(mask.shape[::2]) == (batch, n_q) and mask.shape[-1] == n_k and not grads


def cache_attention(query, key, value, lengths, mask=None, scaling=None, score_mod=None):
    """One layer's attention against a static cache: row b's query i sees keys j < L_b with
    j <= i + L_b - N_q (``numba_flash.attention_with_kv_cache``, no append; ``score_mod``: a softcap's, or any
    of ``numba_flash.mods``).  Returns (B, N_q, H_q, d).

    ``lengths``: int32 (B,) on the query's device, L_b (-1: the row gets NaN).  With
    ``CHECK_STATIC_CACHE`` the mask is compared with that pattern on the host first."""
    if CHECK_STATIC_CACHE and mask is not None:
        check_cache_mask(mask, lengths)
    check_tensors((("query", query), ("key", key), ("value", value), ("cache_seqlens", lengths)))
    out, _ = _run(api.attention_with_kv_cache, (query, key, value, lengths), causal="bottom_right",
                 scale=scaling, return_lse=True, score_mod=score_mod)
    return out.transpose(1, 2).contiguous()


def check_cache_mask(mask, lengths):
    """Raise a ValueError unless every row b of a (B, 1 or H, N_q, N_k) boolean mask is the KV-cache pattern of
    length L_b = lengths[b]: key j visible to query i iff j < L_b and j <= i + L_b - N_q (a synchronisation)."""
    n_q, n_k = mask.shape[-2:]
    i = torch.arange(n_q, device=mask.device)[:, None]
    j = torch.arange(n_k, device=mask.device)[None, :]
    length = lengths.to(mask.device, torch.int64)[:, None, None, None]
    want = (j < length) & (j <= i + length - n_q)
    bad = (mask != want).flatten(1).any(1)
    if bool(bad.any()):
        raise ValueError(f"numba_flash's static-cache path: the mask of batch rows "
                         f"{bad.nonzero().flatten().tolist()} is not the pattern of their cache lengths "
                         f"{lengths.tolist()}")


def _is_bottom_right_causal(mask, n_q, n_k):
    """Whether every batch and head of a (B, H, N_q, N_k) boolean mask is the bottom-right causal pattern."""
    causal = torch.ones(n_q, n_k, dtype=torch.bool, device=mask.device).tril(diagonal=n_k - n_q)
    return bool((mask == causal).all())


def attention_mask(*args, **kwargs):
    """transformers' ``sdpa_mask`` (the boolean (B, 1, N_q, N_k) mask, or None for plain causal attention),
    with two differences:

    * None only where bottom-right causal attention is meant (N_q = N_k, or one query seeing every key):
      SDPA's ``is_causal`` is top-left, which also covers a static cache's first chunk against its whole
      max_cache_len keys, where bottom-right would let queries see the empty rows at the end;
    * a static cache's plain causal mask (``mask_function`` transformers' ``causal_mask_function``, no key
      offset, more keys than queries) is tagged with each row's L = q_offset + N_q (``_LENGTHS``), where no
      row is padded inside its L keys (``READ_PADDING``), for ``attention_forward``'s KV-cache path.

    Takes sdpa_mask's arguments as the installed transformers names them: (batch_size, q_length, kv_length,
    q_offset, ...) in recent releases, (batch_size, cache_position, kv_length, ...) in earlier ones.
    """
    masking_utils = require("transformers.masking_utils", "transformers", "attention_mask")
    given = kwargs   # transformers names every argument (no inspect on its path: torch.compile may trace it)
    if args:
        arguments = dict(inspect.signature(masking_utils.sdpa_mask).bind(*args, **kwargs).arguments)
        given = dict(arguments, **arguments.pop("kwargs", {}))
    q_length, length = _query_span(given)
    kv_length, kv_offset = given["kv_length"], given.get("kv_offset", 0)
    if q_length != kv_length and q_length != 1:
        given = dict(given, allow_is_causal_skip=False)
    mask = masking_utils.sdpa_mask(**given)
    mask_function = given.get("mask_function", masking_utils.causal_mask_function)
    if (mask is None or mask_function is not masking_utils.causal_mask_function or kv_offset != 0
            or kv_length <= q_length or mask.dim() != 4 or mask.shape[1] != 1):
        return mask
    lengths = _cache_lengths(given["batch_size"], kv_length, length, given.get("attention_mask"), mask.device)
    if lengths is not None:
        # generate makes the mask contiguous, which copies sdpa_mask's expanded view and would lose the tag.
        mask = mask.contiguous()
        setattr(mask, _LENGTHS, lengths)
    return mask


def _query_span(given):
    """(N_q, L) from sdpa_mask's arguments: L = the cache's length before the call + N_q, the keys the call's
    last query sees, an int or a tensor on the GPU (never read here).  Recent transformers pass q_length and
    q_offset (a static cache's length tensor), earlier ones cache_position (the queries' positions)."""
    if given.get("cache_position") is not None:
        positions = given["cache_position"]
        return positions.shape[0], positions[-1:] + 1
    return given["q_length"], given.get("q_offset", 0) + given["q_length"]


def _cache_lengths(batch_size, kv_length, length, padding, device):
    """Each row's key count L as int32 (B,) on ``device``, computed there (``length`` may be a tensor on the
    GPU: a static cache's length); a row whose 2-D padding mask hides one of its first L keys gets -1.
    None where ``READ_PADDING`` finds such a row (one host read)."""
    if isinstance(length, torch.Tensor):
        lengths = length.to(device=device, dtype=torch.int32).reshape(1).expand(batch_size).contiguous()
    else:
        lengths = torch.full((batch_size,), int(length), dtype=torch.int32, device=device)
    if padding is None:
        return lengths
    padding = padding.to(device=device, dtype=torch.bool)[:, :kv_length]
    keys = torch.arange(padding.shape[-1], device=device)
    # Causal attention hides keys j >= L from every query, so only keys j < L must be unpadded (a 2-D mask
    # narrower than L: transformers pads it with False up to kv_length).
    unpadded = (padding | (keys[None, :] >= lengths[:, None])).all(-1) & (lengths <= padding.shape[-1])
    if READ_PADDING and not bool(unpadded.all()):
        return None
    return torch.where(unpadded, lengths, torch.full_like(lengths, -1))


def register():
    """Add ``NAME`` to transformers' attention and mask registries (idempotent)."""
    AttentionInterface = require("transformers", "transformers", "register").AttentionInterface
    masking_utils = require("transformers.masking_utils", "transformers", "register")

    AttentionInterface.register(NAME, attention_forward)
    masking_utils.AttentionMaskInterface.register(NAME, attention_mask)


__all__ = ["NAME", "READ_PADDING", "CHECK_STATIC_CACHE", "attention_forward", "attention_mask", "cache_attention",
           "check_cache_mask", "register", "window_mask"]
