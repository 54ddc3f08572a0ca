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


# Llama's greedy generation with generate's default (dynamic) cache, unpadded, is the "dynamic-unpadded" case of
# test_greedy_generation_with_each_cache_gives_sdpas_tokens (the same model and prompts, one new token fewer).
@pytest.mark.parametrize("name", sorted(set(MODELS) - {"llama"}))
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
    with pytest.raises(ValueError, match="position_bias"):
        numba_flash_hf.attention_forward(module, q, q, q, None, position_bias=q)
    with pytest.raises(ValueError, match="sliding_window"):   # a bidirectional window: not implemented
        numba_flash_hf.attention_forward(module, q, q, q, None, is_causal=False, sliding_window=2)
    with pytest.raises(ValueError, match="output_attentions"):
        numba_flash_hf.attention_forward(module, q, q, q, None, output_attentions=True)
    with pytest.raises(ValueError, match="boolean masks"):
        numba_flash_hf.attention_forward(module, q, q, q, torch.zeros(1, 1, 4, 4, device=DEVICE))


def prompts(batch, n, padded):
    """Prompt ids and their 2-D attention mask; with ``padded`` the rows after the first are left-padded."""
    ids = tokens(batch, n)
    mask = torch.ones_like(ids)
    if padded:
        for row in range(1, batch):
            mask[row, : row + 1] = 0
    return ids, mask


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_greedy_generation_with_each_cache_gives_sdpas_tokens(cache, padded, monkeypatch):
    # A static cache hands every layer max_cache_len keys; unpadded, the KV-cache kernel runs (checked against
    # the mask at every layer here), padded, the element-wise path.  Float32 both sides.
    monkeypatch.setattr(numba_flash_hf, "CHECK_STATIC_CACHE", True)
    reference, ours = pair("llama")
    ids, mask = prompts(3 if padded else 2, 6 if SMALL else 16, padded)
    # disable_compile: on a GPU generate would torch.compile a static cache's forward, where numba-flash takes
    # the general path.
    options = dict(attention_mask=mask, max_new_tokens=3 if SMALL else 24, do_sample=False, pad_token_id=0,
                   cache_implementation=cache, disable_compile=True)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **options), reference.generate(ids, **options))


def test_static_cache_steps_take_the_kv_cache_kernel(monkeypatch):
    # The routing itself: every layer of the prompt's forward and of each decoding step calls the KV-cache
    # kernel, none builds a block mask (which would read the mask on the host).
    calls, block_masks = [], []
    cache_attention, block_mask = numba_flash_hf.cache_attention, numba_flash_hf.BlockMask
    monkeypatch.setattr(numba_flash_hf, "cache_attention",
                        lambda query, *args, **kw: calls.append(tuple(query.shape)) or cache_attention(query, *args, **kw))
    monkeypatch.setattr(numba_flash_hf, "BlockMask", lambda *args: block_masks.append(args) or block_mask(*args))
    _, ours = pair("llama")
    ids, mask = prompts(2, 5, padded=False)
    new = 3
    with torch.no_grad():
        ours.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                      cache_implementation="static", disable_compile=True)
    layers, heads = ours.config.num_hidden_layers, ours.config.num_attention_heads
    d = ours.config.hidden_size // heads
    assert not block_masks
    assert calls == [(2, heads, 5, d)] * layers + [(2, heads, 1, d)] * (new - 1) * layers


def test_static_cache_mask_is_tagged_only_where_it_is_the_cache_pattern(monkeypatch):
    masking_utils = pytest.importorskip("transformers.masking_utils")
    causal = masking_utils.causal_mask_function
    offset = torch.tensor(4)   # a static cache's length, a tensor as transformers passes it
    # As create_causal_mask calls it for one new token and a static cache: a mask, never None.
    step = dict(q_offset=offset, mask_function=causal, allow_is_causal_skip=False)
    plain = numba_flash_hf.attention_mask(2, 1, 9, **step)
    lengths = getattr(plain, numba_flash_hf._LENGTHS)
    assert lengths.dtype == torch.int32 and lengths.tolist() == [5, 5]
    numba_flash_hf.check_cache_mask(plain, lengths)
    with pytest.raises(ValueError, match="not the pattern"):
        numba_flash_hf.check_cache_mask(plain, torch.tensor([5, 6], dtype=torch.int32))
    # Overlays (and_masks, or_masks) and key offsets are not the plain pattern: no tag.
    window = masking_utils.and_masks(causal, masking_utils.sliding_window_overlay(2))
    assert not hasattr(numba_flash_hf.attention_mask(2, 1, 9, **dict(step, mask_function=window)),
                       numba_flash_hf._LENGTHS)
    # Left padding: read on the host (default), the exact path; assumed away, the padded row gets -1 (NaN).
    padding = torch.ones(2, 5, dtype=torch.bool)
    padding[1, 0] = False
    assert not hasattr(numba_flash_hf.attention_mask(2, 1, 9, attention_mask=padding, **step), numba_flash_hf._LENGTHS)
    monkeypatch.setattr(numba_flash_hf, "READ_PADDING", False)
    assumed = numba_flash_hf.attention_mask(2, 1, 9, attention_mask=padding, **step)
    assert getattr(assumed, numba_flash_hf._LENGTHS).tolist() == [5, -1]
    # A static cache's first chunk against max_cache_len keys is never None (SDPA's top-left is_causal).
    first = numba_flash_hf.attention_mask(2, 3, 9, q_offset=0, mask_function=causal)
    assert getattr(first, numba_flash_hf._LENGTHS).tolist() == [3, 3]


@pytest.mark.parametrize("n_q", [1, 3])
def test_cache_attention_matches_the_element_wise_path(n_q):
    # Random q against a cache of 9 rows, rows holding 5 and 9 keys: the KV-cache kernel against the exact path.
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, n_q, 8, generator=generator).to(DEVICE)
    k, v = (torch.randn(2, 2, 9, 8, generator=generator).to(DEVICE) for _ in range(2))
    lengths = torch.tensor([5, 9], dtype=torch.int32, device=DEVICE)
    i = torch.arange(n_q, device=DEVICE)[:, None]
    j = torch.arange(9, device=DEVICE)[None, :]
    mask = ((j < lengths[:, None, None]) & (j <= i + lengths[:, None, None] - n_q))[:, None]
    module = torch.nn.Module()
    want, _ = numba_flash_hf.attention_forward(module, q, k, v, mask)
    got = numba_flash_hf.cache_attention(q, k, v, lengths, mask)
    assert float((got - want).abs().max()) <= 1e-5
    # A row whose padding was assumed away and found on the GPU (length -1): NaN there on a GPU; in the
    # simulator the lengths reach the host, which refuses them.
    poisoned = torch.tensor([5, -1], dtype=torch.int32, device=DEVICE)
    if SMALL:
        with pytest.raises(ValueError, match="negative"):
            numba_flash_hf.cache_attention(q, k, v, poisoned)
    else:
        out = numba_flash_hf.cache_attention(q, k, v, poisoned)
        assert not torch.isnan(out[0]).any() and torch.isnan(out[1]).all()


def test_query_span_from_either_transformers_signature():
    # Recent transformers pass q_length and q_offset (a static cache's length tensor); earlier ones the queries'
    # positions, cache_position.  Either way L = the last query's position + 1, a tensor where it was one.
    assert numba_flash_hf._query_span(dict(q_length=3, q_offset=4)) == (3, 7)
    n_q, length = numba_flash_hf._query_span(dict(q_length=1, q_offset=torch.tensor(4)))
    assert n_q == 1 and int(length) == 5
    n_q, length = numba_flash_hf._query_span(dict(cache_position=torch.arange(4, 7), q_length=None))
    assert n_q == 3 and length.tolist() == [7]
