"""Where a small decoding call's time goes: the whole call, the GPU's part and the host's, ours beside torch's backends.

For each (B, H_q, H_kv, N, d), bfloat16, one new query, caches full, lengths on the GPU: ``time_ms`` of the whole
call (CUDA events around an idle stream: host work included), of the GPU work alone (``device_only``: the stream held
while the host issues the call), and the host's microseconds per call (500 calls back to back, wall clock, no
synchronisation inside), for ``numba_flash.attention_with_kv_cache`` and torch SDPA's cuDNN and flash backends
(``enable_gqa``); then the device time of ours at forced ``num_splits``.  One process.

    PYTHONPATH=$PWD python3 experiments/tuning/decode_host_split.py

Prints; results: ``results/decode_host_split_h100.md``.  Needs a GPU and torch.
"""
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import numba_flash
from numba_flash.tools.timing import time_ms

#: (B, H_q, H_kv, N, d): issue 47's short cache, MQA and tuned case.
CASES = [(1, 32, 8, 2048, 128), (4, 32, 1, 8192, 128), (16, 32, 8, 8192, 128)]
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


def inputs(batch, heads, kv_heads, n, d):
    q = torch.randn(batch, heads, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    return q, k, v, torch.full((batch,), n, dtype=torch.int32, device="cuda")


def main():
    for case in CASES:
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
                parts.append(f"{name}: whole={time_ms(run, repeats=30) * 1e3:.1f} "
                             f"device={time_ms(run, repeats=30, device_only=True) * 1e3:.1f} host={host_us(run):.1f}")
            except RuntimeError:   # the backend refuses these shapes
                parts.append(f"{name}: refused")
        print(case, " | ".join(parts), flush=True)
    for case in SPLIT_CASES:
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
