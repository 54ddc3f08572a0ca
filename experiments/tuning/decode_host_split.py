"""Where a small decoding call's time goes: the whole call, the GPU's part and the host's, ours beside torch's backends.

For each (B, H_q, H_kv, N, d), bfloat16, one new query, caches full, lengths on the GPU: ``time_ms`` of the whole
call (CUDA events around an idle stream: host work included), of the GPU work alone (``device_only``: the stream held
while the host issues the call), the host's microseconds per call (500 calls back to back, wall clock, no
synchronisation inside), and the GPU durations of the kernels a whole call runs (torch's profiler, each call after
a synchronize: whether a kernel launched on an idle GPU takes longer than ``device_only`` says), for
``numba_flash.attention_with_kv_cache`` and torch SDPA's cuDNN and flash backends (``enable_gqa``); then the device
time of ours at forced ``num_splits``.  One process.

    PYTHONPATH=$PWD python3 experiments/tuning/decode_host_split.py [--cases 'B,H_q,H_kv,N,d;...'] [--split-cases ...]

(``--split-cases ''``: no split sweep.)  The large cases are the decoding grid's short caches with many blocks, whose
whole call trailed cuDNN's by 70-170 us over our GPU time where the GPU time itself tied (H100, 2026-12-07,
``results/decode_key_warps_h100.md``).

Prints; results: ``results/decode_host_split_h100.md``.  Needs a GPU and torch.
"""
import argparse
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import numba_flash
from numba_flash.tools.timing import time_ms

#: (B, H_q, H_kv, N, d): issue 47's short cache, MQA and tuned case; short caches with many blocks.
CASES = [(1, 32, 8, 2048, 128), (4, 32, 1, 8192, 128), (16, 32, 8, 8192, 128), (16, 32, 32, 2048, 128),
         (64, 32, 32, 2048, 128)]
#: (B, H_q, H_kv, N, d) and the splits forced there.
SPLIT_CASES = [(4, 32, 1, 8192, 128), (1, 32, 8, 2048, 128), (1, 64, 8, 32768, 128)]
SPLITS = (0, 8, 16, 33, 66, 132)


def host_us(run, calls=500):
    run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def kernel_us(run, calls=10):
    """(GPU microseconds, kernels) per whole call, each call issued after a synchronize (the GPU idle, as ``time_ms``'s
    whole call): the summed durations of the kernels and copies it ran, from torch's profiler (CUPTI, which sees
    Numba's launches too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(calls):
            torch.cuda.synchronize()
            run()
        torch.cuda.synchronize()
    work = [e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in work) / calls, len(work) / calls


def parse_cases(text):
    """'B,H_q,H_kv,N,d;...' as tuples ('' for none)."""
    return [tuple(map(int, case.split(","))) for case in text.split(";") if case.strip()]


def inputs(batch, heads, kv_heads, n, d):
    q = torch.randn(batch, heads, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    return q, k, v, torch.full((batch,), n, dtype=torch.int32, device="cuda")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=parse_cases, default=CASES, help="'B,H_q,H_kv,N,d;...' (default: CASES)")
    parser.add_argument("--split-cases", type=parse_cases, default=SPLIT_CASES,
                        help="the cases of the split sweep, the same way (default: SPLIT_CASES)")
    args = parser.parse_args()
    for case in args.cases:
        q, k, v, lengths = inputs(*case)
        runs = {"ours": lambda: numba_flash.attention_with_kv_cache(q, k, v, lengths)}
        for name, which in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def run(which=which):
                with sdpa_kernel(which):
                    return sdpa(q, k, v, enable_gqa=q.shape[1] != k.shape[1])
            runs[name] = run
        parts = []
        for name, run in runs.items():
            try:
                kernels, count = kernel_us(run)
                parts.append(f"{name}: whole={time_ms(run, repeats=30) * 1e3:.1f} "
                             f"device={time_ms(run, repeats=30, device_only=True) * 1e3:.1f} host={host_us(run):.1f} "
                             f"kernels={kernels:.1f} ({count:.0f} a call)")
            except RuntimeError:   # the backend refuses these shapes
                parts.append(f"{name}: refused")
        print(case, " | ".join(parts), flush=True)
    for case in args.split_cases:
        q, k, v, lengths = inputs(*case)
        parts = []
        for splits in SPLITS:
            def run(splits=splits):
                numba_flash.attention_with_kv_cache(q, k, v, lengths, num_splits=splits)
            run()
            parts.append(f"{splits}:{time_ms(run, repeats=20, device_only=True) * 1e3:.1f}")
        print(case, "device us by num_splits (0: decode_plan's):", " ".join(parts), flush=True)


if __name__ == "__main__":
    main()
