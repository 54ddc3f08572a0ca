"""Decoding with few sequences: split counts and key tiles around the library's choice, torch's cuDNN and flash
backends beside them (GPU time, four sets of q and caches read in turn, all in one process), and with
``--kernels`` each kernel's GPU time in one step of ours and of cuDNN's (torch.profiler).

    PYTHONPATH=$PWD python3 experiments/tuning/decode_splits.py [--case B,H_q,H_kv,N:S,S,... ...] [--kernels] [--out FILE]

A case's split counts S are timed at (16, 16) and (16, 32) tiles, beside the library's choice ("default").
Default cases: those of results/decode_breakdown_h200.md (session 24), d = 128, float16, one query.
"""
import argparse

import torch
from decode_breakdown import D, SETS, make_sets, peer, rotating_timer   # this folder's: the same data and peers
from torch.nn.attention import SDPBackend
from torch.profiler import ProfilerActivity, profile

import numba_flash

CASES = ["1,32,8,8192:16,24", "4,32,8,32768:4,6", "2,32,8,4096:8,12", "8,32,8,8192:2,3", "1,32,8,32768:16,24",
         "1,32,8,2048:8,16"]
TILES = ((16, 16), (16, 32))


def kernel_times(call, x, steps=20):
    """{kernel name: mean GPU time in us} over ``steps`` calls of ``call(x)`` after a warm-up."""
    for _ in range(5):
        call(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            call(x)
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / e.count for e in prof.key_averages() if e.self_device_time_total > 0}


def run_case(case, kernels, repeats):
    """The table of one case ``B,H_q,H_kv,N:S,S,...``."""
    shape, splits = case.split(":")
    b, h, hk, n = (int(x) for x in shape.split(","))
    sets = make_sets(b, h, hk, n)
    lengths = torch.full((b,), n, dtype=torch.int32, device="cuda")
    timed = rotating_timer(sets, repeats)

    def ours(**options):
        return lambda x: numba_flash.attention_with_kv_cache(x["q"], x["k"], x["v"], lengths, **options)

    lines = [f"Case (B, H_q, H_kv, N_q, N, d) = ({b}, {h}, {hk}, 1, {n}, {D}) float16; GPU time, median of "
             f"{repeats}, {SETS} caches in turn."]
    if kernels:
        for name, call in (("ours", ours()), ("torch cuDNN", peer(SDPBackend.CUDNN_ATTENTION))):
            lines += [f"* {name}: `{kernel[:100]}` {us:.2f} us" for kernel, us in kernel_times(call, sets[0]).items()]
    peers = {name: timed(peer(backend)) for name, backend in (("torch cuDNN", SDPBackend.CUDNN_ATTENTION),
                                                              ("torch flash", SDPBackend.FLASH_ATTENTION))}
    rows = [("default", "", timed(ours()))]
    for count in (int(s) for s in splits.split(",")):
        for tiles in TILES:
            rows.append((count, tiles, timed(ours(block_sizes=tiles, num_splits=count))))
    peers["torch cuDNN (again)"] = timed(peer(SDPBackend.CUDNN_ATTENTION))
    fastest = min(peers.values())
    lines += ["", "| splits | tiles | ms | fastest torch / this |", "|---|---|---|---|"]
    lines += [f"| {name} | | {ms:.4f} | {fastest / ms:.2f}x |" for name, ms in peers.items()]
    lines += [f"| {count} | {tiles} | {ms:.4f} | {fastest / ms:.2f}x |" for count, tiles, ms in rows]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="B,H_q,H_kv,N:S,S,... (d = 128), one or more")
    parser.add_argument("--kernels", action="store_true", help="each kernel's GPU time in one step (torch.profiler)")
    parser.add_argument("--out", default=None, help="markdown file for the tables")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    tables = []
    for case in args.case or CASES:
        tables.append(run_case(case, args.kernels, args.repeats))
        print(tables[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
