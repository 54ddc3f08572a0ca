"""Decoding with warps taking turns along the keys: (tiles, kv_stages, key_warps, splits) against one-warp blocks,
with torch cuDNN and flash beside (GPU time, four caches read in turn).  Results: results/decode_key_warps_h200.md.

    PYTHONPATH=$PWD python3 experiments/decode_key_warps.py [B,H_q,H_kv,N]   # default: issue 16's (16, 32, 8, 8192), d = 128
"""
import sys, numpy as np, torch
import numba_flash
from numba_flash.tools.timing import time_ms
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa
b, h, hk, n, d = 16, 32, 8, 8192, 128
if len(sys.argv) > 1:
    b, h, hk, n = map(int, sys.argv[1].split(","))
g = torch.Generator(device="cuda").manual_seed(0)
sets = [dict(q=torch.randn(b, h, 1, d, device="cuda", dtype=torch.float16, generator=g),
             k=torch.randn(b, hk, n, d, device="cuda", dtype=torch.float16, generator=g),
             v=torch.randn(b, hk, n, d, device="cuda", dtype=torch.float16, generator=g)) for _ in range(4)]
turn = [0]
def nxt(): turn[0] += 1
def now(): return sets[turn[0] % 4]
full = np.full(b, n, np.int32)
T = lambda f: time_ms(f, repeats=50, warmup=3, device_only=True, setup=nxt)
def peer(be):
    def f():
        x = now()
        with sdpa_kernel(be):
            sdpa(x["q"], x["k"], x["v"], enable_gqa=True)
    return f
print("case", (b, h, hk, n, d), "cudnn", round(T(peer(SDPBackend.CUDNN_ATTENTION)), 4), "flash", round(T(peer(SDPBackend.FLASH_ATTENTION)), 4), flush=True)
configs = [((16, 16), 2, 1, 0), (None, 0, 0, 0)]
for t, stages_list in (((16, 16), (2, 3, 4)), ((16, 32), (2, 3)), ((16, 64), (2,))):
    for st in stages_list:
        for kw in (2, 4, 8):
            for sp in (1, 2):
                configs.append((t, st, kw, sp))
for t, st, kw, sp in configs:
    def f(t=t, st=st, kw=kw, sp=sp):
        x = now()
        numba_flash.attention_with_kv_cache(x["q"], x["k"], x["v"], full, block_sizes=t, num_splits=sp, kv_stages=st, key_warps=kw)
    try:
        print(t, "stages", st, "key_warps", kw, "splits", sp, round(T(f), 4), flush=True)
    except Exception as e:
        print(t, st, kw, sp, "ERR", str(e)[:120], flush=True)
print("cudnn again", round(T(peer(SDPBackend.CUDNN_ATTENTION)), 4), flush=True)
