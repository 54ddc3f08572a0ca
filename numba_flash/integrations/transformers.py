"""numba-flash as an attention implementation of Hugging Face ``transformers``.

    import numba_flash.integrations.transformers as numba_flash_hf
    numba_flash_hf.register()   # once: "numba_attention" joins transformers' attention and mask registries
    model = AutoModelForCausalLM.from_config(config, attn_implementation=numba_flash_hf.NAME)

Every model whose attention goes through transformers' ``AttentionInterface``
(Llama, Mistral, Qwen, GPT-2, ...) then runs ``numba_flash.torch.attention``:
grouped key/value heads are read as they are (no ``repeat_kv``), and the
backward is numba-flash's.  Masks, as transformers builds them for us (its
``sdpa_mask``, registered under our name):

* no mask: a causal layer attends causally, aligned bottom-right (a chunk of
  new queries after a cache sees every cached key; one query sees them all),
  a bidirectional one attends to every key;
* a boolean mask that is exactly that causal pattern: the same, without
  reading it;
* any other boolean mask (padding, packed sequences, sliding windows built
  into the mask): element by element, as a ``BlockMask`` of 1 x 1 blocks.
  This copies the mask to the host (a synchronisation) and lists its tiles
  there: exact, but slower than an unmasked call.  A query row that may see
  no key gives zeros (transformers' SDPA path gives such padding rows other
  values; they are never read).

Arguments numba-flash does not implement (``sliding_window``, ``softcap``,
attention sinks, position biases, ``output_attentions``) raise a ValueError
naming them.
"""
from .._optional import require

torch = require("torch", "transformers", "numba_flash.integrations.transformers")

from .. import torch as numba_flash_torch
from ..sparsity.block_mask import BlockMask

#: The name models ask for: ``attn_implementation="numba_attention"``.  Not "numba_flash": transformers
#: treats any name containing "flash" as a flash-attn kernel to fetch from its hub.
NAME = "numba_attention"

#: Keyword arguments transformers may pass that change the result and that we do not implement.
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias", "head_mask")


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
    block_mask = None
    alignment = "bottom_right" if causal else False
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            raise ValueError(f"numba_flash attention takes boolean masks (transformers' sdpa_mask), got "
                             f"{attention_mask.dtype}")
        if not _is_bottom_right_causal(attention_mask, n_q, n_k):
            block_mask = BlockMask(attention_mask.detach().cpu().numpy(), (1, 1))
            alignment = False   # the mask says everything
    seed = int(torch.randint(0, 2 ** 62, ())) if dropout > 0 else 0
    out = numba_flash_torch.attention(query, key, value, causal=alignment, scale=scaling, block_mask=block_mask,
                                      dropout_p=float(dropout), seed=seed)
    return out.transpose(1, 2).contiguous(), None


def _is_bottom_right_causal(mask, n_q, n_k):
    """Whether every batch and head of a (B, H, N_q, N_k) boolean mask is the bottom-right causal pattern."""
    causal = torch.ones(n_q, n_k, dtype=torch.bool, device=mask.device).tril(diagonal=n_k - n_q)
    return bool((mask == causal).all())


def register():
    """Add ``NAME`` to transformers' attention and mask registries (idempotent)."""
    AttentionInterface = require("transformers", "transformers", "register").AttentionInterface
    masking_utils = require("transformers.masking_utils", "transformers", "register")
    AttentionMaskInterface, sdpa_mask = masking_utils.AttentionMaskInterface, masking_utils.sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


__all__ = ["NAME", "attention_forward", "register"]
