"""Decoding with warps taking turns along the keys: (tiles, kv_stages, key_warps, splits) against one-warp blocks,
with torch's cuDNN and flash backends beside them (GPU time, four sets of q and caches read in turn, so that L2
cannot serve one step from the last).  With ``--baseline DIR`` (another copy of the package, e.g. an earlier
commit's) the same rows of that copy are timed in the same process.

    PYTHONPATH=$PWD python3 experiments/tuning/decode_key_warps.py [--case B,H_q,H_kv,N ...] [--quick] [--baseline DIR]
                                                            [--configs 'default;16,32,3,2,1'] [--out FILE]

Default case: issue 16's (16, 32, 8, 8192), d = 128, float16.  ``--quick``: QUICK_CONFIGS on the first case, the
defaults alone on the others.  Results: results/decode_key_warps_h200.md (H200), results/decode_key_warps_h100.md
(H100, the short caches with many blocks, 2026-12-07).
"""
import argparse
import itertools

import numpy as np
from decode_breakdown import D, SETS, make_sets, peer, rotating_timer   # this folder's: the same data and peers
from torch.nn.attention import SDPBackend

import numba_flash
from numba_flash.tools.bench import load_baseline

#: (tiles, kv_stages, key_warps, splits); None / 0: the library's choice.
CONFIGS = [(None, 0, 0, 0), ((16, 16), 2, 1, 0)] + [
    (tiles, stages, warps, splits)
    for tiles, stage_list in (((16, 16), (2, 3, 4)), ((16, 32), (2, 3)), ((16, 64), (2,)))
    for stages, warps, splits in itertools.product(stage_list, (2, 4, 8), (1, 2))]
#: The rows the baseline runs too: the defaults and the best of the last sweep.
BASELINE_CONFIGS = [(None, 0, 0, 0), ((16, 32), 3, 4, 1)]
QUICK_CONFIGS = [(None, 0, 0, 0), ((16, 32), 3, 4, 1), ((16, 32), 2, 4, 1), ((16, 16), 4, 4, 1), ((16, 64), 2, 2, 1),
                 ((16, 64), 3, 2, 1)]


def parse_configs(text):
    """``--configs``: 'default' (the library's choice) or B_r,B_c,kv_stages,key_warps,splits, ';'-separated."""
    configs = []
    for item in text.split(";"):
        if item.strip() == "default":
            configs.append(CONFIGS[0])
        else:
            rows, keys, stages, warps, splits = map(int, item.split(","))
            configs.append(((rows, keys), stages, warps, splits))
    return configs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="B,H_q,H_kv,N (d = 128), one or more")
    parser.add_argument("--quick", action="store_true", help="QUICK_CONFIGS, then the defaults of further cases")
    parser.add_argument("--configs", default=None, type=parse_configs,
                        help="the configs of every case instead: 'default' or B_r,B_c,kv_stages,key_warps,splits, "
                             "separated by ';'")
    parser.add_argument("--baseline", default=None, help="another copy of the package, timed beside this one")
    parser.add_argument("--out", default=None, help="markdown file for the table")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    baseline = load_baseline(args.baseline) if args.baseline else None
    tables = []
    for index, case in enumerate(args.case or ["16,32,8,8192"]):
        configs = args.configs or ((QUICK_CONFIGS if index == 0 else CONFIGS[:1]) if args.quick else CONFIGS)
        tables.append(run_case(tuple(map(int, case.split(","))), configs, baseline, args.repeats))
    text = "\n\n".join(tables)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def run_case(case, configs, baseline, repeats):
    """The table of one case: each config of this tree (and of the baseline where in BASELINE_CONFIGS), torch's
    backends timed before and after."""
    b, h, hk, n = case
    timed = rotating_timer(make_sets(b, h, hk, n), repeats)
    lengths = np.full(b, n, np.int32)
    rows = []

    def ours(package, label, config):
        tiles, stages, warps, splits = config
        try:
            ms = timed(lambda x: package.attention_with_kv_cache(x["q"], x["k"], x["v"], lengths, block_sizes=tiles,
                                                                 num_splits=splits, kv_stages=stages,
                                                                 key_warps=warps))
        except ValueError as exc:   # buffers beyond shared memory: refused before any launch
            ms = f"refused ({str(exc)[:60]}...)"
        rows.append((label, "default" if tiles is None else str(tiles), stages, warps, splits, ms))
        print(case, rows[-1], flush=True)

    peers = [("torch cuDNN", SDPBackend.CUDNN_ATTENTION), ("torch flash", SDPBackend.FLASH_ATTENTION)]
    before = {name: timed(peer(backend)) for name, backend in peers}
    print(case, "peers", before, flush=True)
    for config in configs:
        ours(numba_flash, "this tree", config)
        if baseline is not None and config in BASELINE_CONFIGS:
            ours(baseline, baseline.label, config)
    after = {name: timed(peer(backend)) for name, backend in peers}
    fastest = min(min(before.values()), min(after.values()))
    lines = [f"Case (B, H_q, H_kv, N_q, N, d) = ({b}, {h}, {hk}, 1, {n}, {D}) float16; GPU time, median of "
             f"{repeats}, {SETS} caches in turn.  " + ", ".join(f"{name} {before[name]:.4f} / {after[name]:.4f} ms"
                                                               for name, _ in peers) + " (before / after).",
             "", "| package | tiles | kv_stages | key_warps | splits | ms | vs fastest torch |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {label} | {tiles} | {stages} | {warps} | {splits} | "
              + (f"{ms:.4f} | {fastest / ms:.2f}x |" if isinstance(ms, float) else f"{ms} | |")
              for label, tiles, stages, warps, splits, ms in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
