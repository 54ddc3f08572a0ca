"""Mods gallery: pictures of ``numba_flash.mods``' built-in masks, with their tile classification, and biases.

Each mask is drawn element by element (query q_idx down, key kv_idx across; allowed = dark) for N = 96 queries and
keys, and over it the classification that ``numba_flash.tile_mask`` computes in 16 x 16 blocks -- the same kernel
the attention calls run (in Numba's CUDA simulator without a GPU): empty blocks (never visited) shaded grey, full
ones (visited without the element test) framed green, partial ones (the mask_mod tested per element) framed
orange.  Each bias is drawn as the value a score_mod adds to a score of 0 (ALiBi for two heads, a relative-position
table whose distances beyond D are clamped), and softcap as its curve.  Outputs ``mods_<name>.png`` (about 20-40 KB
each) in ``docs/images/``, which ``docs/mods.md`` shows.  Needs matplotlib, no GPU.

    PYTHONPATH=$PWD python3 experiments/paper/mods_gallery.py [--quick] [--out DIR]
"""
import argparse
import os

import numpy as np
from matplotlib.figure import Figure   # no pyplot: no global backend state
from matplotlib.patches import Patch, Rectangle

import numba_flash
from numba_flash import mods
from numba_flash.sparsity.mod_tiles import ALLOWED, PARTIAL

IMAGES = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "images"))
N, BLOCK = 96, (16, 16)
DOCUMENT_LENGTHS = (40, 24, 32)


def masks(n):
    """(file name, title, mask_mod) of each picture; parameters scaled with ``n`` (96 gives the titles' values)."""
    docs = np.repeat(np.arange(len(DOCUMENT_LENGTHS)), [length * n // N for length in DOCUMENT_LENGTHS])
    docs = np.concatenate([docs, np.full(n - len(docs), docs[-1])]).astype(np.int32)
    window, prefix = n // 4, 3 * n // 8
    return [
        ("causal", "causal_mask", mods.causal_mask),
        ("sliding_window", f"sliding_window({window})", mods.sliding_window(window)),
        ("prefix_lm", f"prefix_lm({prefix})", mods.prefix_lm(prefix)),
        ("document", "document(ids) & causal_mask", mods.document(docs) & mods.causal_mask),
        ("or_document_window", f"document(ids) | sliding_window({n // 6})",
         mods.document(docs) | mods.sliding_window(n // 6)),
        ("and_document_window", f"document(ids) & sliding_window({n // 5})",
         mods.document(docs) & mods.sliding_window(n // 5)),
    ]


def evaluated(mod, n, h=0, score=0.0):
    """A mod at every (q_idx, kv_idx) of head ``h`` (batch 0), in Python on the host copies of its arrays: a mask_mod's
    verdicts, or a score_mod's value at ``score``."""
    arrays = mod.host_arrays()
    if mod.kind == mods.MASK:
        return np.array([[bool(mod.fn(0, h, i, j, *arrays)) for j in range(n)] for i in range(n)])
    return np.array([[float(mod.fn(score, 0, h, i, j, *arrays)) for j in range(n)] for i in range(n)])


def draw_mask(path, title, mask_mod, n, block):
    classes = numba_flash.tile_mask(mask_mod, None, None, n, n, block=block).tile_classes(block)[0, 0]
    figure = Figure(figsize=(3.6, 3.9), dpi=100)
    axes = figure.add_subplot()
    axes.imshow(evaluated(mask_mod, n), cmap="Blues", vmin=0, vmax=1.4, interpolation="nearest")
    counts = {"empty": 0, "full": 0, "partial": 0}
    for (i, j), code in np.ndenumerate(classes):
        corner, size = (j * block[1] - 0.5, i * block[0] - 0.5), (block[1], block[0])
        if not code & ALLOWED:
            counts["empty"] += 1
            axes.add_patch(Rectangle(corner, *size, facecolor="0.55", alpha=0.35, edgecolor="none"))
        else:
            counts["partial" if code == PARTIAL else "full"] += 1
            colour = "tab:orange" if code == PARTIAL else "tab:green"
            axes.add_patch(Rectangle((corner[0] + 0.6, corner[1] + 0.6), size[0] - 1.2, size[1] - 1.2,
                                     fill=False, edgecolor=colour, linewidth=1.6))
    axes.set_xticks(np.arange(0, n + 1, block[1] * 2) - 0.5, np.arange(0, n + 1, block[1] * 2))
    axes.set_yticks(np.arange(0, n + 1, block[0] * 2) - 0.5, np.arange(0, n + 1, block[0] * 2))
    axes.set_xlabel("kv_idx")
    axes.set_ylabel("q_idx")
    axes.set_title(title, fontsize=9)
    axes.legend(handles=[Patch(facecolor="0.55", alpha=0.35, label=f"empty {counts['empty']}"),
                         Patch(fill=False, edgecolor="tab:green", label=f"full {counts['full']}"),
                         Patch(fill=False, edgecolor="tab:orange", label=f"partial {counts['partial']}")],
                loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=7, frameon=False)
    figure.subplots_adjust(left=0.15, right=0.97, top=0.93, bottom=0.2)
    figure.savefig(path)


def draw_biases(path, title, panels, n):
    """``panels``: (subtitle, score_mod, head); each drawn as the bias it adds to a score of 0, on its own scale."""
    figure = Figure(figsize=(max(3.6 * len(panels), 4.4), 3.4), dpi=100)
    for index, (subtitle, mod, h) in enumerate(panels):
        value = evaluated(mod, n, h)
        reach = float(np.abs(value).max()) or 1.0
        axes = figure.add_subplot(1, len(panels), index + 1)
        image = axes.imshow(value, cmap="RdBu", vmin=-reach, vmax=reach, interpolation="nearest")
        axes.set_xlabel("kv_idx")
        axes.set_ylabel("q_idx")
        axes.set_title(subtitle, fontsize=9)
        figure.colorbar(image, ax=axes, shrink=0.8, label="added to the score" if index == len(panels) - 1 else None)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path)


def draw_softcap(path, caps):
    score = np.linspace(-60, 60, 481)
    figure = Figure(figsize=(4.2, 3.2), dpi=100)
    axes = figure.add_subplot()
    axes.plot(score, score, color="0.6", linestyle="--", linewidth=1, label="no cap")
    for cap in caps:
        mod = mods.softcap(cap)
        arrays = mod.host_arrays()
        axes.plot(score, [mod.fn(s, 0, 0, 0, 0, *arrays) for s in score], label=f"softcap({cap:g})")
    axes.set_ylim(-65, 65)
    axes.set_xlabel("score = scale q . k")
    axes.set_ylabel("score_mod(score)")
    axes.set_title("softcap: cap tanh(score / cap)", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 32 in blocks of 8, files mods_*_quick.png")
    parser.add_argument("--out", default=IMAGES, help="directory for the pictures (default docs/images)")
    args = parser.parse_args(argv)
    n, block = (32, (8, 8)) if args.quick else (N, BLOCK)
    suffix = "_quick" if args.quick else ""
    os.makedirs(args.out, exist_ok=True)
    written = []
    for name, title, mask_mod in masks(n):
        written.append(f"mods_{name}{suffix}.png")
        draw_mask(os.path.join(args.out, written[-1]), title, mask_mod, n, block)
    heads, reach = 8, 8
    table = np.random.default_rng(0).standard_normal((heads, 2 * reach + 1)).astype(np.float32)
    bias_n = n // 3
    written.append(f"mods_alibi{suffix}.png")
    slopes = mods.alibi_slopes(heads)
    draw_biases(os.path.join(args.out, written[-1]), f"alibi(alibi_slopes({heads})), N = {bias_n}",
                [(f"head {h}: slope {slopes[h]:.3f}", mods.alibi(slopes), h) for h in (0, heads - 1)], bias_n)
    written.append(f"mods_relative_position_bias{suffix}.png")
    draw_biases(os.path.join(args.out, written[-1]),
                f"relative_position_bias, D = {reach} (a random table)",
                [("head 0", mods.relative_position_bias(table), 0)], bias_n)
    written.append(f"mods_softcap{suffix}.png")
    draw_softcap(os.path.join(args.out, written[-1]), (10.0, 30.0))
    for name in written:
        print("wrote", os.path.join(args.out, name))
    return written


if __name__ == "__main__":
    main()
