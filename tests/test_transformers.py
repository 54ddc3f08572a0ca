"""numba-flash inside Hugging Face transformers: randomly initialised models against attn_implementation="sdpa"."""
import copy

import pytest
import torch

import numba_flash
import numba_flash.integrations.transformers as numba_flash_hf
from tolerances import MODEL_GRADIENT_RTOL, MODEL_LOSS_RTOL

transformers = pytest.importorskip("transformers")

DEVICE = "cpu" if numba_flash.in_simulator() else "cuda"
SMALL = numba_flash.in_simulator()   # every simulated CUDA thread is a Python thread: tiny models there
numba_flash_hf.register()


def llama_config():
    size = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2) if SMALL else \
        dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    # Grouped-query attention: 4 query heads share 2 key/value heads.
    return transformers.LlamaConfig(vocab_size=96, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=128, bos_token_id=None, eos_token_id=None, **size)


def gpt2_config():
    size = dict(n_embd=32, n_layer=2) if SMALL else dict(n_embd=256, n_layer=4)
    # No dropout anywhere: the two implementations draw different random masks.
    return transformers.GPT2Config(vocab_size=96, n_positions=128, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0,
                                   embd_pdrop=0.0, bos_token_id=None, eos_token_id=None, **size)


MODELS = {"llama": (transformers.LlamaForCausalLM, llama_config), "gpt2": (transformers.GPT2LMHeadModel, gpt2_config)}


def pair(name):
    """The same randomly initialised model with sdpa and with numba-flash attention (float32)."""
    model_class, config = MODELS[name]
    torch.manual_seed(0)
    reference = model_class._from_config(copy.deepcopy(config()), attn_implementation="sdpa").to(DEVICE)
    ours = model_class._from_config(copy.deepcopy(config()), attn_implementation=numba_flash_hf.NAME).to(DEVICE)
    ours.load_state_dict(reference.state_dict())
    assert ours.config._attn_implementation == numba_flash_hf.NAME
    torch.backends.cuda.matmul.allow_tf32 = False   # both sides in float32
    return reference, ours


def tokens(batch, n):
    return torch.randint(0, 96, (batch, n), generator=torch.Generator().manual_seed(1)).to(DEVICE)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_and_gradients_match_sdpa(name):
    reference, ours = pair(name)
    ids = tokens(2, 12 if SMALL else 100)

    def loss_and_grads(model):
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want_logits, want_loss, want_grads = loss_and_grads(reference)
    logits, loss, grads = loss_and_grads(ours)
    # Both sides compute in float32 and differ only in summation order inside the attention.
    assert float((logits - want_logits).abs().max()) <= MODEL_GRADIENT_RTOL * float(want_logits.abs().max())
    assert abs(loss - want_loss) <= MODEL_LOSS_RTOL * abs(want_loss)
    for parameter, want in want_grads.items():
        err = float((grads[parameter] - want).abs().max())
        assert err <= MODEL_GRADIENT_RTOL * float(want.abs().max()), f"{parameter}: {err:.3g}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_padded_batches_match_sdpa_where_there_are_tokens(name):
    # Left padding (as for generation): the padding mask reaches numba-flash as an element-wise block mask.
    reference, ours = pair(name)
    n = 10 if SMALL else 64
    ids = tokens(3, n)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, : n // 2] = 0
    with torch.no_grad():
        want = reference(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    assert float((got - want)[real].abs().max()) <= MODEL_GRADIENT_RTOL * float(want[real].abs().max())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_generation_gives_sdpas_tokens(name):
    # Decoding attends each new token to the cache: one query against every cached key (bottom-right causal).
    reference, ours = pair(name)
    ids = tokens(2, 6 if SMALL else 16)
    # In the simulator 4 new tokens: the prompt's causal forward, then three decoding steps against the cache.
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4 if SMALL else 32, do_sample=False,
                   pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **options), reference.generate(ids, **options))


def test_what_numba_flash_does_not_implement_is_refused():
    q = torch.zeros(1, 2, 4, 8, device=DEVICE)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="sliding_window"):
        numba_flash_hf.attention_forward(module, q, q, q, None, sliding_window=2)
    with pytest.raises(ValueError, match="output_attentions"):
        numba_flash_hf.attention_forward(module, q, q, q, None, output_attentions=True)
    with pytest.raises(ValueError, match="boolean masks"):
        numba_flash_hf.attention_forward(module, q, q, q, torch.zeros(1, 1, 4, 4, device=DEVICE))
