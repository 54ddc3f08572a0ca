"""transformers' softcap, sliding_window and attention sinks (s_aux) through numba_flash.mods: randomly initialised
Gemma-2-, Mistral- and gpt-oss-style models against attn_implementation="eager", float32."""
import copy

import pytest
import torch

import numba_flash
import numba_flash.integrations.transformers as numba_flash_hf
from tolerances import MODEL_GRADIENT_RTOL, MODEL_LOSS_RTOL

transformers = pytest.importorskip("transformers")

DEVICE = "cpu" if numba_flash.in_simulator() else "cuda"
SMALL = numba_flash.in_simulator()   # every simulated CUDA thread is a Python thread: tiny models there
WINDOW = 4 if SMALL else 16          # smaller than every sequence below: the window hides keys
HEAD_DIM = 8 if SMALL else 64
numba_flash_hf.register()


def gemma2_config():
    size = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2) if SMALL else \
        dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    # Layers alternate sliding and full attention; weights 10x the default and a softcap of 1 so that tanh bends
    # the logits (with Gemma 2's 50, or the default initialisation, it would leave them as they are).
    return transformers.Gemma2Config(vocab_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                                     query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW, attn_logit_softcapping=1.0,
                                     initializer_range=0.2,
                                     final_logit_softcapping=30.0, max_position_embeddings=128, pad_token_id=0,
                                     bos_token_id=None, eos_token_id=None, **size)


def mistral_config():
    size = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1) if SMALL else \
        dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    return transformers.MistralConfig(vocab_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                                      sliding_window=WINDOW, max_position_embeddings=128, bos_token_id=None,
                                      eos_token_id=None, **size)


def gpt_oss_config():
    size = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2) if SMALL else \
        dict(hidden_size=256, intermediate_size=256, num_hidden_layers=4)
    return transformers.GptOssConfig(vocab_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                                     sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1,
                                     max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
                                     pad_token_id=0, **size)


MODELS = {"gemma2": ("Gemma2ForCausalLM", gemma2_config), "mistral": ("MistralForCausalLM", mistral_config),
          "gpt_oss": ("GptOssForCausalLM", gpt_oss_config)}


def pair(name):
    """The same randomly initialised model with eager and with numba-flash attention (float32)."""
    class_name, config = MODELS[name]
    model_class = getattr(transformers, class_name, None)
    if model_class is None:
        pytest.skip(f"the installed transformers has no {class_name}")
    torch.manual_seed(0)
    reference = model_class._from_config(copy.deepcopy(config()), attn_implementation="eager").to(DEVICE)
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 1.0)   # sink logits that take a visible share of each row
    ours = model_class._from_config(copy.deepcopy(config()), attn_implementation=numba_flash_hf.NAME).to(DEVICE)
    ours.load_state_dict(reference.state_dict())
    torch.backends.cuda.matmul.allow_tf32 = False   # both sides in float32
    return reference.eval(), ours.eval()


def tokens(batch, n):
    return torch.randint(0, 96, (batch, n), generator=torch.Generator().manual_seed(1)).to(DEVICE)


def close(got, want, rtol=MODEL_GRADIENT_RTOL):
    return float((got - want).abs().max()) <= rtol * float(want.abs().max())


def loss_and_grads(model, ids):
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                  if p.grad is not None}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_and_gradients_match_eager(name):
    reference, ours = pair(name)
    ids = tokens(2, 10 if SMALL else 100)
    want_logits, want_loss, want_grads = loss_and_grads(reference, ids)
    logits, loss, grads = loss_and_grads(ours, ids)
    assert close(logits, want_logits)
    assert abs(loss - want_loss) <= MODEL_LOSS_RTOL * abs(want_loss)
    assert grads.keys() == want_grads.keys()
    for parameter, want in want_grads.items():
        err = float((grads[parameter] - want).abs().max())
        assert err <= MODEL_GRADIENT_RTOL * float(want.abs().max()), f"{parameter}: {err:.3g}"


def test_an_off_by_one_window_or_a_missing_softcap_fails(monkeypatch):
    # The comparison above can fail: a window one key wider, or logits without their cap, move the logits far
    # beyond the tolerance.
    reference, ours = pair("gemma2")
    ids = tokens(1, 10 if SMALL else 100)
    with torch.no_grad():
        want = reference(ids).logits
        window_mask = numba_flash_hf.window_mask
        monkeypatch.setattr(numba_flash_hf, "window_mask", lambda window, offset=0: window_mask(window + 1, offset))
        assert not close(ours(ids).logits, want, 100 * MODEL_GRADIENT_RTOL)
        monkeypatch.undo()
        for layer in ours.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        assert not close(ours(ids).logits, want, 100 * MODEL_GRADIENT_RTOL)


def test_missing_sinks_fail():
    reference, ours = pair("gpt_oss")
    ids = tokens(1, 10 if SMALL else 100)
    with torch.no_grad():
        want = reference(ids).logits
        assert close(ours(ids).logits, want)
        for layer in ours.model.layers:
            layer.self_attn.sinks.fill_(-1e4)   # sinks that take no share of any row
        assert not close(ours(ids).logits, want, 100 * MODEL_GRADIENT_RTOL)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_padded_sliding_window_batches_match_eager(name):
    # Left padding and the window in one mask: the element-wise path, with the softcap or the sinks.
    reference, ours = pair(name)
    n = 10 if SMALL else 64
    ids = tokens(2, n)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        want = reference(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    assert close(got[real], want[real])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_generation_gives_eagers_tokens(name, cache):
    # The prompt is longer than the window and the new tokens cross it again; a static cache's full-attention
    # steps with a softcap take the KV-cache kernel with it as a score_mod, those with sinks or a window the
    # general path.
    reference, ours = pair(name)
    ids = tokens(1, 6 if SMALL else 40)
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=3 if SMALL else 32, do_sample=False,
                   pad_token_id=0, cache_implementation=cache, disable_compile=True)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **options), reference.generate(ids, **options))


def test_window_mask_is_transformers_sliding_window():
    masking_utils = pytest.importorskip("transformers.masking_utils")
    rule = masking_utils.sliding_window_causal_mask_function(3)
    mod = numba_flash_hf.window_mask(3, 2)
    for q in range(4):
        for kv in range(6):
            want = bool(rule(0, 0, torch.tensor(q + 2), torch.tensor(kv)))   # query q sits at position q + 2
            assert bool(mod.fn(0, 0, q, kv, mod.arrays[0])) == want, (q, kv)


def test_static_cache_softcap_layers_take_the_kv_cache_kernel(monkeypatch):
    # Gemma 2's full-attention layers (a softcap, no window) decode a static cache on the KV-cache kernel, the
    # softcap its score_mod; the sliding layers take the general path.  The tokens are eager's (the greedy test).
    calls = []
    cache_attention = numba_flash_hf.cache_attention
    monkeypatch.setattr(numba_flash_hf, "cache_attention",
                        lambda *args: calls.append(args[6]) or cache_attention(*args))
    _, ours = pair("gemma2")
    ids = tokens(1, 6)
    with torch.no_grad():
        ours.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0,
                      cache_implementation="static", disable_compile=True)
    assert calls and all(score_mod is not None and score_mod.name == "softcap" for score_mod in calls)
