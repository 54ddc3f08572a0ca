"""Training end to end: a small character-level GPT with numba-flash attention and with torch's SDPA.

Both runs start from the same weights and see the same batches; only the
attention differs (``numba_flash.torch.attention`` against
``F.scaled_dot_product_attention``, both causal, grouped key/value heads).
The text is every machine's: the Python standard library's own sources,
read as bytes (a vocabulary of 256).  The loss curves should lie on top of
each other; the table gives the time per step and tokens per second.

    PYTHONPATH=$PWD python3 experiments/paper/train_gpt.py [--steps 300] [--dtype bfloat16]
    PYTHONPATH=$PWD python3 experiments/paper/train_gpt.py --quick     # a few steps of a tiny model (runs in the simulator)

Writes experiments/paper/results/train_gpt.{csv,md,png} (``_quick`` with --quick).
"""
import argparse
import math
import os
import sysconfig
import time
from dataclasses import dataclass

import numpy as np

import numba_flash
from numba_flash.tools.report import markdown_header, markdown_table, pyplot, save_figure, write_csv

RESULTS = os.path.join(os.path.dirname(__file__), "results")


@dataclass(frozen=True)
class Shape:
    layers: int
    width: int
    heads: int
    kv_heads: int
    context: int
    batch: int


#: --size: the model of the first measurements (d = 64), a larger one (d = 128, context 2048, GQA 4:1), and a tiny
#: one the simulator can run (--quick).
SIZES = {"small": Shape(layers=6, width=384, heads=6, kv_heads=2, context=512, batch=32),
         "large": Shape(layers=12, width=1024, heads=8, kv_heads=2, context=2048, batch=8)}
QUICK = Shape(layers=1, width=16, heads=2, kv_heads=1, context=16, batch=2)


def corpus(limit):
    """The first ``limit`` bytes of the standard library's .py files, in sorted order (the same on every run)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, size = [], 0
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py") and size < limit:
                with open(os.path.join(folder, name), "rb") as f:
                    chunk = f.read()
                chunks.append(chunk)
                size += len(chunk)
    return np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8)


def build_model(shape, attention):
    """A pre-norm GPT whose attention is ``attention(q, k, v)`` on (B, H, N, d) and (B, H_kv, N, d) tensors."""
    import torch
    from torch import nn

    head_dim = shape.width // shape.heads

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(shape.width), nn.LayerNorm(shape.width)
            self.q = nn.Linear(shape.width, shape.width, bias=False)
            self.kv = nn.Linear(shape.width, 2 * shape.kv_heads * head_dim, bias=False)
            self.out = nn.Linear(shape.width, shape.width, bias=False)
            self.mlp = nn.Sequential(nn.Linear(shape.width, 4 * shape.width), nn.GELU(),
                                     nn.Linear(4 * shape.width, shape.width))

        def forward(self, x):
            b, n, _ = x.shape
            h = self.norm1(x)
            # (B, N, H, d) projections viewed as (B, H, N, d): strided, no copy.
            q = self.q(h).view(b, n, shape.heads, head_dim).transpose(1, 2)
            k, v = self.kv(h).view(b, n, 2, shape.kv_heads, head_dim).permute(2, 0, 3, 1, 4)
            x = x + self.out(attention(q, k, v).transpose(1, 2).reshape(b, n, shape.width))
            return x + self.mlp(self.norm2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(256, shape.width)
            self.position = nn.Embedding(shape.context, shape.width)
            self.blocks = nn.ModuleList(Block() for _ in range(shape.layers))
            self.norm = nn.LayerNorm(shape.width)
            self.head = nn.Linear(shape.width, 256, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return GPT()


def attentions(torch, device):
    """numba-flash, torch SDPA as it picks its backend, and on a GPU SDPA held to cuDNN (its fastest backend on the
    H200, which it does not pick by itself)."""
    import numba_flash.torch as nft
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    runs = {"numba-flash": lambda q, k, v: nft.attention(q, k, v, causal=True),
            "torch SDPA": lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)}
    if device == "cuda":
        runs["torch SDPA cuDNN"] = cudnn
    return runs


def train(name, attention, shape, data, steps, dtype, device, seed=0):
    """Losses and per-step seconds of one run (the same weights and batches for every attention)."""
    import torch

    torch.manual_seed(seed)
    model = build_model(shape, attention).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    batches = np.random.default_rng(seed).integers(0, data.size - shape.context - 1, (steps, shape.batch))
    text = torch.as_tensor(data.astype(np.int64), device=device)
    offsets = torch.arange(shape.context + 1, device=device)
    losses, seconds = [], []
    autocast = torch.autocast(device_type=device, dtype=getattr(torch, dtype), enabled=dtype != "float32")
    for step in range(steps):
        window = text[torch.as_tensor(batches[step], device=device)[:, None] + offsets]
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast:
            logits = model(window[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    print(f"{name}: final loss {losses[-1]:.3f}, median step {1e3 * np.median(seconds):.1f} ms", flush=True)
    return losses, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"),
                        help="autocast dtype of the matrix products (and so of q, k, v)")
    parser.add_argument("--size", default="small", choices=tuple(SIZES), help="the model (see SIZES)")
    parser.add_argument("--quick", action="store_true", help="a few steps of a tiny model (the simulator can run it)")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    import torch

    simulator = numba_flash.in_simulator()
    if simulator and not args.quick:
        print("needs a GPU (or --quick): every simulated CUDA thread is a Python thread")
        return 2
    shape, steps = (QUICK, 3) if args.quick else (SIZES[args.size], args.steps)
    dtype = "float32" if simulator else args.dtype   # CPU autocast has no float16 matmuls
    device = "cpu" if simulator else "cuda"
    data = corpus(200_000 if args.quick else 20_000_000)
    runs = {}
    for name, attention in attentions(torch, device).items():
        try:
            runs[name] = train(name, attention, shape, data, steps, dtype, device)
        except RuntimeError as exc:   # e.g. a backend that does not take this call
            print(f"{name}: not run ({str(exc).splitlines()[0][:80]})")

    suffix = "_quick" if args.quick else "" if args.size == "small" else f"_{args.size}"
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "train_gpt" + suffix)
    names = list(runs)
    write_csv(stem + ".csv", [{"step": i, **{f"loss {name}": runs[name][0][i] for name in names},
                               **{f"seconds {name}": runs[name][1][i] for name in names}} for i in range(steps)])
    tokens = shape.batch * shape.context
    warm = slice(min(10, steps - 1), None)   # the first steps compile kernels
    table = [{"attention": name, "final loss": f"{runs[name][0][-1]:.4f}",
              "mean loss, last 10% of steps": f"{np.mean(runs[name][0][-max(1, steps // 10):]):.4f}",
              "median step ms": f"{1e3 * np.median(runs[name][1][warm]):.1f}",
              "tokens/s": f"{tokens / np.median(runs[name][1][warm]):,.0f}"} for name in names]
    reference = np.asarray(runs["torch SDPA"][0])
    gap = float(np.max(np.abs(np.asarray(runs["numba-flash"][0]) - reference)))
    device_name = "numba-cuda simulator" if simulator else numba_flash.device_limits().name
    with open(stem + ".md", "w") as f:
        f.write(markdown_header("Training a small GPT: numba-flash against torch SDPA",
                                "python3 experiments/paper/train_gpt.py" + (" --quick" if args.quick else
                                                                      f" --size {args.size} --steps {steps} --dtype {dtype}"),
                                device_name, timer="wall clock per step, synchronised"))
        f.write(f"\n{shape.layers} layers, width {shape.width}, {shape.heads} query heads sharing {shape.kv_heads} "
                f"key/value heads (d = {shape.width // shape.heads}), context {shape.context}, batch {shape.batch}, "
                f"{steps} steps of AdamW (lr 3e-4) on the standard library's sources as bytes; autocast {dtype}.  "
                f"Same initial weights and batches.  Largest loss difference at any step: {gap:.4f}.  Step times "
                f"exclude the first {warm.start} steps (kernel compilation).\n\n")
        f.write(markdown_table(table))
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for name in names:
            ax.plot(runs[name][0], label=name, alpha=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (nats per byte)")
        ax.set_ylim(top=min(max(max(r[0]) for r in runs.values()), math.log(256) + 0.5))
        ax.legend()
        save_figure(fig, stem)
    print("wrote", stem + ".md")
    return 0


if __name__ == "__main__":
    main()
