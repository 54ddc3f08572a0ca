"""Greedy generation through Hugging Face transformers with a static KV cache: numba-flash against SDPA.

A randomly initialised Llama-style model (no download: the config is built here), ``MODEL`` below: hidden
2048, 16 layers, 32 query heads sharing 8 key/value heads (GQA, groups of 4), head dim d = 128 (``head_dim``
set, so the query projection is 2048 -> 4096), MLP 8192, vocabulary 32000: 1.27 B parameters.  For each
dtype (bfloat16, float16) and batch (1, 32): a prompt of ``PROMPT`` random tokens per row (no padding), then
``NEW`` tokens by greedy decoding, ``generate(..., cache_implementation="static", do_sample=False)``, once with
``attn_implementation="sdpa"`` and once with numba-flash's (``numba_flash.integrations.transformers``, whose
static-cache steps call ``attention_with_kv_cache`` with the lengths on the GPU).  Same weights both sides.

Both sides run eagerly (``disable_compile=True``: on a GPU generate would otherwise torch.compile a static
cache's decoding forward, where numba-flash's static-cache path does not run); ``--compiled-sdpa`` adds SDPA
under that compilation (CUDA graphs, generate's default on a GPU) as a further row, and ``--element-wise``
numba-flash with its static-cache path off (every layer reads the mask on the host as a 1 x 1 BlockMask, as
before that path).

Decode time = (time of generate with NEW tokens) - (time of generate with 1 token, i.e. the prompt's forward
and the first token), each the median of ``REPEATS`` whole generate calls after a warm-up (host clock after a
synchronisation: generate is host-driven).  Decode
tokens/s = batch * (NEW - 1) / decode time.  ``agree``: the share of generated tokens equal to SDPA's in that
dtype (16-bit rounding may make greedy paths part ways; the exactness check is the float32 one).  Before the
timings, a small float32 model (``CHECK_MODEL``, batch 2) must give SDPA's tokens exactly, static and dynamic
cache.

    PYTHONPATH=$PWD python3 experiments/tuning/generate_bench.py [--element-wise] [--compiled-sdpa]   # GPU
    PYTHONPATH=$PWD python3 experiments/tuning/generate_bench.py --quick             # tiny, in the simulator

Writes ``results/generate_bench_<device>.md`` (``generate_bench_quick.md`` with --quick) with the command,
the device and the date, and prints the table.
"""
import argparse
import contextlib
import copy
import os
import re
import statistics
import time

import numba_flash

RESULTS = os.path.join(os.path.dirname(__file__), "results")
REPEATS = 5
PROMPT, NEW = 128, 128
BATCHES = (1, 32)
DTYPES = ("bfloat16", "float16")
#: ~1B parameters shape-wise, Llama 3.2 1B's widths with d = 128 (32 x 128 = 4096 query features).
MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)
#: The float32 exactness check: small enough to run in seconds on a GPU.
CHECK_MODEL = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
CHECK_PROMPT, CHECK_NEW = 32, 32
#: --quick: a model the simulator runs in seconds (every simulated GPU thread is a Python thread).
QUICK_MODEL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
QUICK = dict(prompt=6, new=3, batches=(1, 2), dtypes=("float32",), repeats=1, check_prompt=5, check_new=3)


def models(transformers, torch, shape, dtype, device):
    """The same randomly initialised Llama with SDPA and with numba-flash attention, in ``dtype``, eval mode."""
    import numba_flash.integrations.transformers as numba_flash_hf

    numba_flash_hf.register()
    config = transformers.LlamaConfig(bos_token_id=None, eos_token_id=None, pad_token_id=None, **shape)
    torch.manual_seed(0)
    with torch.device(device):   # initialised where they run: a CPU takes minutes over 1.27 B random weights
        reference = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa",
                                                               dtype=dtype)
        ours = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config),
                                                          attn_implementation=numba_flash_hf.NAME, dtype=dtype)
    ours.load_state_dict(reference.state_dict())
    return reference.eval(), ours.eval()


def greedy(model, ids, new, cache="static", compiled=False):
    # disable_compile: on a GPU generate would torch.compile a static cache's forward (CUDA graphs); both
    # sides run eagerly here (numba-flash's static-cache path is eager only), --compiled-sdpa adds that row.
    options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                   attention_mask=ids.new_ones(ids.shape), cache_implementation=cache, disable_compile=not compiled)
    return model.generate(ids, **options)


@contextlib.contextmanager
def element_wise_masks(active):
    """With ``active``, numba-flash's static-cache path off: every layer reads the mask as a 1 x 1 BlockMask on
    the host, as the integration did before that path (its first chunk's mask, None then, given as now)."""
    import numba_flash.integrations.transformers as numba_flash_hf

    saved = numba_flash_hf._cache_lengths
    if active:
        numba_flash_hf._cache_lengths = lambda *args: None
    try:
        yield
    finally:
        numba_flash_hf._cache_lengths = saved


def seconds(run, repeats, synchronize):
    """Median wall time of ``run()`` over ``repeats`` calls after one warm-up (compiles, allocates)."""
    run()
    samples = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def check_float32(transformers, torch, shape, prompt, new, device):
    """Whether numba-flash gives SDPA's greedy tokens exactly in float32, static and dynamic cache (batch 2)."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    reference, ours = models(transformers, torch, shape, torch.float32, device)
    ids = torch.randint(0, shape["vocab_size"], (2, prompt), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        return {cache: bool(torch.equal(greedy(ours, ids, new, cache), greedy(reference, ids, new, cache)))
                for cache in ("static", "dynamic")}


def device_tag(name):
    """A results-file suffix for a device name: h200 for an NVIDIA H200, else the name in lower case."""
    match = re.search(r"[A-Z]\d{2,4}", name.upper())
    return match.group(0).lower() if match else re.sub(r"\W+", "_", name.lower()).strip("_")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, float32 (the simulator's run)")
    parser.add_argument("--dtypes", help=f"comma-separated (default {','.join(DTYPES)})")
    parser.add_argument("--batches", help=f"comma-separated (default {','.join(map(str, BATCHES))})")
    parser.add_argument("--repeats", type=int, help=f"timed generate calls per point (default {REPEATS})")
    parser.add_argument("--element-wise", action="store_true",
                        help="also time numba-flash with its static-cache path off (the mask as a 1 x 1 BlockMask)")
    parser.add_argument("--compiled-sdpa", action="store_true",
                        help="also time SDPA under generate's own torch.compile of the static-cache forward (GPU)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    import torch
    import transformers

    simulator = numba_flash.in_simulator()
    if simulator and not args.quick:
        print("needs a GPU (or --quick)")
        return 2
    quick = QUICK if args.quick else dict(prompt=PROMPT, new=NEW, batches=BATCHES, dtypes=DTYPES, repeats=REPEATS,
                                          check_prompt=CHECK_PROMPT, check_new=CHECK_NEW)
    shape = QUICK_MODEL if args.quick else MODEL
    batches = tuple(int(x) for x in args.batches.split(",")) if args.batches else quick["batches"]
    dtypes = tuple(args.dtypes.split(",")) if args.dtypes else quick["dtypes"]
    repeats = args.repeats or quick["repeats"]
    prompt, new = quick["prompt"], quick["new"]
    device = "cpu" if simulator else "cuda"
    synchronize = (lambda: None) if simulator else torch.cuda.synchronize
    device_name = "numba-cuda simulator" if simulator else numba_flash.device_limits().name

    exact = check_float32(transformers, torch, QUICK_MODEL if args.quick else CHECK_MODEL, quick["check_prompt"],
                          quick["check_new"], device)
    print("float32 tokens identical to sdpa:", exact, flush=True)

    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        reference, ours = models(transformers, torch, shape, dtype, device)
        parameters = sum(p.numel() for p in ours.parameters())
        for batch in batches:
            ids = torch.randint(0, shape["vocab_size"], (batch, prompt),
                                generator=torch.Generator().manual_seed(batch)).to(device)
            tokens, times = {}, {}
            runs = [("sdpa", reference, False), ("numba-flash", ours, False)]
            if args.element_wise:
                runs.append(("numba-flash, element-wise mask", ours, False))
            if args.compiled_sdpa:
                runs.append(("sdpa, torch.compile", reference, True))
            for name, model, compiled in runs:
                with torch.no_grad(), element_wise_masks(name.endswith("element-wise mask")):
                    tokens[name] = greedy(model, ids, new, compiled=compiled)[:, prompt:]
                    first = seconds(lambda: greedy(model, ids, 1, compiled=compiled), repeats, synchronize)
                    whole = seconds(lambda: greedy(model, ids, new, compiled=compiled), repeats, synchronize)
                times[name] = (first, whole - first)
            for name, (first, decode) in times.items():
                agree = float((tokens[name] == tokens["sdpa"]).float().mean())
                row = dict(dtype=dtype_name, batch=batch, attention=name, prefill_ms=f"{first * 1e3:.1f}",
                           decode_ms_per_step=f"{decode / (new - 1) * 1e3:.2f}",
                           decode_tokens_per_s=f"{batch * (new - 1) / decode:.0f}",
                           vs_sdpa=f"{times['sdpa'][1] / decode:.2f}",
                           agree=f"{agree:.3f}" if name != "sdpa" else "")
                rows.append(row)
                print(row, flush=True)
        del reference, ours
        if not simulator:
            torch.cuda.empty_cache()

    from numba_flash.tools.report import markdown_header, markdown_table

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "generate_bench_quick.md" if args.quick else
                        f"generate_bench_{device_tag(device_name)}.md")
    command = "PYTHONPATH=$PWD python3 experiments/tuning/generate_bench.py" + (" --quick" if args.quick else "")
    for flag, given in (("--dtypes", args.dtypes), ("--batches", args.batches), ("--repeats", args.repeats)):
        if given:
            command += f" {flag} {given}"
    command += (" --element-wise" if args.element_wise else "") + (" --compiled-sdpa" if args.compiled_sdpa else "")
    described = ", ".join(f"{key} {value}" for key, value in shape.items())
    table = markdown_table(rows)
    with open(path, "w") as f:
        f.write(markdown_header("Greedy generation with a static cache: numba-flash against SDPA", command,
                                device_name, timer=f"host clock around whole generate calls, median of {repeats}"
                                + (" (simulator: not a measurement)" if simulator else "")))
        f.write(f"\nRandomly initialised Llama ({described}; {parameters / 1e9:.2f} B parameters), transformers "
                f"{transformers.__version__}, torch {torch.__version__}; prompt {prompt} tokens per row, {new} new "
                f"tokens, greedy, static cache, eager.  decode = generate({new}) - generate(1); tokens/s = batch x "
                f"{new - 1} / decode.  vs_sdpa: SDPA's decode time over this row's (> 1: faster).  agree: share of "
                f"generated tokens equal to SDPA's in that dtype.\n\n"
                f"float32 check ({'the same tiny model' if args.quick else 'a small model'}, batch 2, greedy): "
                f"tokens identical to SDPA's with a static cache: {exact['static']}, with a dynamic cache: "
                f"{exact['dynamic']}.\n\n")
        f.write(table)
    print(table)
    print("wrote", path)
    return 0 if all(exact.values()) else 1


if __name__ == "__main__":
    main()
