"""How a decoding call is laid out on the GPU: a small model of the machine instead of a table tuned on one shape.

``decode_plan(batch, q_heads, kv_heads, n_q, n_k_max, head_dim, dtype_bytes, ...)`` returns a ``DecodePlan``: whether
the query heads of a group are packed as the rows of one tile, the tile (B_r, B_c), the warps of a block (rows per
warp, key warps), the K/V buffers and the number of thread blocks that share each tile's keys (splits, merged by
log-sum-exp in the same launch: ``kernels/fast/cache.py``).  Host-side arithmetic only: it runs (and is tested)
without a GPU.

The decisions, in order
-----------------------
1. **Pack the group.**  The G = H_q / H_kv query heads that read one key/value head, N_q new queries each, become
   the G N_q rows of that head's tile (row g N_q + i: query i of head h_kv G + g), so that each K/V tile is read
   from memory once per group instead of G times (issue 47 found MQA, G = 32, reading K/V at 5% of the copy rate).
   q must allow the view: one query (N_q = 1: the heads are the rows, any strides), or heads N_q rows apart
   (``packable``, as C-ordered q is).  Otherwise each query head keeps its own tile (the unpacked path).  The
   kernel's causal mask takes each row's own query index i = row mod N_q (``forward.py``, QUERY_GROUPS), and so do
   a call's mods, with its query head h_kv G + g (causal or not).
2. **The tile.**  Rows R = G N_q (packed) or N_q.  16-bit tiles whose rows start on 16-byte boundaries travel
   by cp.async (``streamed``): up to d = 128, one warp owns 16 rows and ``DECODE_KEY_WARPS`` warps of the block
   take turns along the keys (cuDNN's layout; ``tiling.DECODE_KEY_WARPS``), B_c = 32 or wider
   (``tiling.DECODE_STREAMED_KEYS``).  More rows take ceil(R / 16) such tiles, each reading the group's K/V
   (the later reads mostly from L2).  That beat one tile of all R rows in 16-row warps without key warps at
   every multi-query shape timed (H100, 2026-12-07, (B, 32, 1, N, d), one query: 1.55-2.51x less GPU time, e.g.
   (4, 32, 1, 8192, 128) 20.1 us against 46.3; ``experiments/tuning/results/decode_mqa_tiles_h100.md``): a
   block of two warps keeps too few bytes in flight.  Those tiles do R / 16 times the arithmetic per K/V byte, and
   their blocks wait on their own instructions: they take eight key warps of 16-key tiles instead of four of 32
   (``tiling.DECODE_SHARED_KV_KEY_WARPS``: the same keys in flight, twice the warps to issue) where a
   multiprocessor holds as many of those blocks (``shared_kv_layout``).  At d = 128 it does (one block of either
   fills the shared memory).  At nine multi-query shapes with one new query (six at d = 128, three at 64) eight warps
   took 1.00-1.24x less GPU time, none more.  At d = 64 the eight warps' registers halve the blocks held, and with
   four new queries whole calls took up to 1.5x longer ((64, 32, 1, 8192, 64): 283 us against 184;
   (16, 32, 1, 32768, 64), one wave of blocks either way: 273 against 195), though with one query up to 1.2x less
   (H100, 2026-12-07, ``experiments/tuning/results/decode_grid_bfloat16_d64_q*_eight_key_warps_h100.md`` against
   the files without "eight_key_warps"): four warps stay there, a rule from measurements that the occupancy
   explains only in part.  The model below does not rank the warps (it counts bytes in flight and multiply-adds,
   not issue slots).  d = 256, float32 and
   unaligned rows: ``tiling.decode_block_sizes`` (one block of ceil(R / 16) * 16 rows, at most 128, in 16-row warps;
   float32 and unaligned tiles wait in registers).
   A paged cache takes the widest B_c that divides its page.
3. **The splits**, from an estimate of the call's time (``estimate``), the S in 1 .. ``MOST_SPLITS`` that
   minimises

       T(S) = ceil(waves) * WAVE_FIXED_S + max(memory, compute) + (S > 1) * (SPLIT_FIXED_S + merge(S))

   * blocks = B * H_kv' * q_tiles * S (H_kv' = H_q unpacked); a multiprocessor holds as many at once as its
     shared memory (228 KB on the H200, 1 KB reserved per block), its 2048 threads and its 64K registers (255
     per thread assumed) allow: slots = 132 x that; waves = blocks / slots.
   * memory: the K/V bytes over the rate that a wave's bytes in flight sustain.  Each block keeps (buffers - 1)
     rounds of key_warps x B_c keys in flight (2 d bytes each per key and element size); Little's law makes the
     rate rise with the bytes in flight, modelled as COPY_BANDWIDTH x q / (1 + q), q = in flight /
     HALF_RATE_BYTES.  HALF_RATE_BYTES = 1.3 MB fits two H200 measurements at (B, H_q, H_kv, N, d) = (16, 32,
     8, 8192, 128): 128 blocks of four key warps (16.8 MB in flight) at 0.96-1.02 of the copy rate (the fit:
     0.93; ``docs/decoding.md``), 768 one-warp blocks with one 8 KB tile each in flight (6.3 MB) at 0.84 (the
     fit: 0.83; ``experiments/tuning/results/decode_h200.md``); and no faster than the bytes in flight over
     DRAM_LATENCY_S (what bounds a few blocks).
   * compute: per key and 16-row fragment, d / 64 mma.m16n8k16 of MMA_CYCLES each plus SOFTMAX_CYCLES, on
     min(4, warps resident) of a multiprocessor's four schedulers at CLOCK_HZ, the blocks spread evenly.  Small
     for R <= 16; it is what bounds a tile of many rows (MQA with N_q = 4: 128 rows, 128 multiply-adds per K/V
     element).
   * merge: the last split block of a tile reads every split's partial O and lse, MERGE_GROUP splits' loads
     of 16 bytes in flight per thread (``cache.tile_merger``), each group one L2_LATENCY_S: a merge of many
     splits of many rows is slow, so big groups take fewer splits.
   * WAVE_FIXED_S (a block's prologue and epilogue: the length read, Q and the first tiles, the key warps'
     merge and the writes) makes a second, partial wave cost what it does on the H200: (B, H_q, H_kv, N) =
     (1, 32, 8, 8192) took 0.0189 ms at 16 splits (one block per SM) against 0.0197 at 24
     (``experiments/tuning/results/decode_breakdown_h200.md``, 2026-12-03).
   Ties (within TIE) go to fewer splits.

The constants are the H200's (132 SMs, 4.24 TB/s copy rate measured in the process of issue 47's table) and
estimates from the hardware's published rates (MMA_CYCLES, SOFTMAX_CYCLES, L2_LATENCY_S); they rank choices, they do
not predict times to better than some tens of percent.  What is measured of the model and what not: docs/decoding.md.
"""
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Tuple

from .tiling import (DECODE_KEY_WARPS, DECODE_KV_STAGES, DECODE_SHARED_KV_KEY_WARPS, DECODE_SHARED_KV_KEYS,
                     DECODE_STREAMED_KEYS, ROWS_PER_WARP, cdiv, decode_block_sizes, flash2_forward_smem,
                     padded_head_dim, page_key_tile)

#: Multiprocessors of the H200 (and H100 SXM).
MULTIPROCESSORS = 132
#: Shared memory a multiprocessor holds, and a block may opt into, on the H200 (compute capability 9.0).
SHARED_BYTES_PER_MULTIPROCESSOR = 233472
SHARED_BYTES_PER_BLOCK = 232448
#: Shared memory the hardware reserves per resident block.
SHARED_BYTES_RESERVED = 1024
THREADS_PER_MULTIPROCESSOR = 2048
REGISTERS_PER_MULTIPROCESSOR = 65536
#: Registers per thread assumed of a decoding kernel (ptxas gives the key-warp kernels 255 at d = 128).
REGISTERS_PER_THREAD = 255
#: Bytes per second of a device-to-device copy (read + written) on the H200 (issue 47's table, 2026-12-04).
COPY_BANDWIDTH = 4.24e12
#: Bytes in flight at which a stream of cp.async reaches half the copy rate (the module docstring's fit).
HALF_RATE_BYTES = 1.3e6
#: Latency of a DRAM read with the memory otherwise idle, seconds (an estimate): few bytes in flight stream no faster
#: than they come back.
DRAM_LATENCY_S = 0.8e-6
#: SM clock of the H200 (boost), Hz.
CLOCK_HZ = 1.98e9
#: Cycles of one mma.m16n8k16 (2048 multiply-adds) on one of a multiprocessor's four schedulers (an estimate:
#: Hopper's 1024 dense 16-bit multiply-adds per cycle per multiprocessor, a quarter per scheduler).
MMA_CYCLES = 8
#: Cycles per key and 16-row fragment of the online softmax (an estimate: half an exp2 per lane on the MUFU unit's 4
#: per cycle per scheduler, the max, the FMA and the row sums).
SOFTMAX_CYCLES = 8
#: Latency of an L2 load under load, seconds (an estimate): the merging block waits one per group of splits.
L2_LATENCY_S = 0.3e-6
#: Loads of 16 bytes that a merging thread keeps in flight (``cache.MERGE_GROUP``).
MERGE_LOADS = 16
#: Fixed time of a wave of blocks, seconds (see the module docstring).
WAVE_FIXED_S = 3e-6
#: Fixed time a split adds (partial results written, fences, the arrival count), seconds.
SPLIT_FIXED_S = 1e-6
#: The most splits considered (the merge reads them in groups of MERGE_LOADS; more only lengthen it).
MOST_SPLITS = 256
#: Relative margin within which fewer splits win.
TIE = 0.005


@dataclass(frozen=True)
class DecodePlan:
    """A decoding call's layout (``decode_plan``)."""

    packed: bool                   # the query heads of a group are the rows of one tile
    rows: int                      # query rows per (batch, tile head): G N_q packed, else N_q
    block_sizes: Tuple[int, int]   # (B_r, B_c)
    warp_rows: int                 # query rows a warp owns (16 or 32)
    key_warps: int                 # warps of a block sharing its rows, taking turns along the keys
    kv_stages: int                 # K/V buffers (the register path has one)
    splits: int                    # blocks sharing each tile's keys
    estimate_us: float = float("nan")   # the model's time of the call, microseconds
    times_us: Tuple[float, ...] = field(default=(), compare=False)   # T(S) for S = 1, 2, ... (the model's)

    @property
    def warps(self):
        """Warps per block."""
        return self.block_sizes[0] // self.warp_rows * self.key_warps

    def __str__(self):
        """A short description for tables: ``packed 32 rows, 32x32 tile, 2 warps, 12 splits``."""
        rows = f"{'packed ' if self.packed else ''}{self.rows} row{'s' if self.rows > 1 else ''}"
        warps = (f"{self.key_warps} key warps" if self.key_warps > 1 else
                 f"{self.warps} warp{'s' if self.warps > 1 else ''}")
        return (f"{rows}, {self.block_sizes[0]}x{self.block_sizes[1]} tile, {warps}, {self.splits} "
                f"split{'s' if self.splits > 1 else ''}")


def packs(q_heads, kv_heads, n_q, packable=True):
    """Whether the query heads of a group become the rows of one tile: a group of more than one head, and q's
    heads N_q rows apart where N_q > 1 (``packable``)."""
    return q_heads > kv_heads and (n_q == 1 or packable)


def _precision(dtype_bytes):
    return "tf32x3" if dtype_bytes == 4 else "f16"


def default_tile(rows, head_dim, dtype_bytes, streamed, page_size=None):
    """(B_r, B_c, rows per warp) of the library's tile for ``rows`` query rows (the module docstring, 2)."""
    precision = _precision(dtype_bytes)
    key_warps_tile = streamed and padded_head_dim(head_dim, precision) <= 128
    block_m, block_n = decode_block_sizes(min(rows, ROWS_PER_WARP) if key_warps_tile else rows, head_dim, precision)
    if key_warps_tile:
        block_n = max(block_n, DECODE_STREAMED_KEYS)
    if page_size is not None:
        block_n = page_key_tile(block_n, page_size, precision)
    return block_m, block_n, ROWS_PER_WARP


def fitting_key_warps(block_sizes, head_dim, dtype_bytes, stages, shared_bytes=SHARED_BYTES_PER_BLOCK,
                      most=DECODE_KEY_WARPS):
    """The most key warps (at most ``most``) whose buffers fit ``shared_bytes``, for a 16-bit tile of one warp's rows
    that streams ``stages`` buffers; 1 if none but one fits."""
    precision = _precision(dtype_bytes)
    d_pad = padded_head_dim(head_dim, precision)
    for warps in range(most, 1, -1):
        if flash2_forward_smem(*block_sizes, d_pad, precision, stages=stages, key_warps=warps).bytes <= shared_bytes:
            return warps
    return 1


def resident_blocks(shared_bytes, threads):
    """Blocks of a kernel that one H200 multiprocessor holds at once (shared memory, threads, registers)."""
    by_shared = SHARED_BYTES_PER_MULTIPROCESSOR // (shared_bytes + SHARED_BYTES_RESERVED)
    by_threads = THREADS_PER_MULTIPROCESSOR // threads
    by_registers = REGISTERS_PER_MULTIPROCESSOR // (threads * (REGISTERS_PER_THREAD + 1))
    return max(1, min(by_shared, by_threads, by_registers, 32))


def shared_kv_layout(tile, warps, head_dim, dtype_bytes, stages, shared_bytes, page_size=None):
    """(B_c, key warps) of the library's tiles where several of them read their group's K/V (the module docstring,
    2): ``DECODE_SHARED_KV_KEY_WARPS`` warps of ``DECODE_SHARED_KV_KEYS``-key tiles where they fit and a multiprocessor
    holds as many of their blocks as of ``warps`` warps of ``tile``; else ``tile``'s keys and ``warps``."""
    keys = DECODE_SHARED_KV_KEYS
    if page_size is not None:
        keys = page_key_tile(keys, page_size, _precision(dtype_bytes))
    narrow = (tile[0], keys)
    more = fitting_key_warps(narrow, head_dim, dtype_bytes, stages, shared_bytes, most=DECODE_SHARED_KV_KEY_WARPS)
    if more > warps and (_block(narrow, head_dim, dtype_bytes, ROWS_PER_WARP, more, stages)[2]
                         >= _block(tile, head_dim, dtype_bytes, ROWS_PER_WARP, warps, stages)[2]):
        return keys, more
    return tile[1], warps


@lru_cache(maxsize=256)
def _block(block_sizes, head_dim, dtype_bytes, warp_rows, key_warps, stages):
    """(padded d, threads, blocks resident per multiprocessor) of a decoding block."""
    precision = _precision(dtype_bytes)
    d_pad = padded_head_dim(head_dim, precision)
    threads = 32 * (block_sizes[0] // warp_rows) * key_warps
    shared = flash2_forward_smem(*block_sizes, d_pad, precision, stages=stages, key_warps=key_warps).bytes
    return d_pad, threads, resident_blocks(shared, threads)


def estimate(splits, *, tiles, n_k, head_dim, dtype_bytes, block_sizes, warp_rows, key_warps, stages, rows,
             multiprocessors=MULTIPROCESSORS):
    """The model's time of a decoding call in seconds (the module docstring, 3): ``tiles`` query tiles (batch x
    heads of tiles x tiles per head), each split into ``splits`` blocks over ``n_k`` keys; ``rows`` query rows per
    head (those of a tile: min(B_r, rows))."""
    block_m, block_n = block_sizes
    d_pad, threads, resident = _block(block_sizes, head_dim, dtype_bytes, warp_rows, key_warps, stages)
    slots = multiprocessors * resident
    blocks = tiles * splits
    active = min(blocks, slots)                           # blocks at work at once (a wave)
    key_bytes = 2 * head_dim * dtype_bytes                # a key's K and V rows
    block_bytes = cdiv(n_k, splits) * key_bytes
    in_flight = min(block_bytes, max(1, stages - 1) * key_warps * block_n * key_bytes)
    q = active * in_flight / HALF_RATE_BYTES
    rate = min(COPY_BANDWIDTH * q / (1 + q), active * in_flight / DRAM_LATENCY_S)   # Little's law: no faster than
    memory = blocks * block_bytes / rate                                             # one latency per bytes in flight
    # (A block that ends makes room for the next: past the first wave the multiprocessors stay busy, so the
    # stream's time counts waves as fractions; each started wave pays its fixed time.)
    per_multiprocessor = cdiv(active, multiprocessors)
    warps = per_multiprocessor * threads // 32
    fragment_cycles = head_dim / 64 * MMA_CYCLES + SOFTMAX_CYCLES
    compute = (blocks / multiprocessors * cdiv(n_k, splits) * (block_m // ROWS_PER_WARP) * fragment_cycles
               / (min(4, warps) * CLOCK_HZ))
    time = cdiv(blocks, slots) * WAVE_FIXED_S + max(memory, compute)
    if splits > 1:
        tile_rows = min(block_m, rows)
        loads = cdiv(splits, MERGE_LOADS) * MERGE_LOADS * tile_rows * (d_pad // 4)   # 16-byte loads of the merge
        in_flight_loads = min(threads, tile_rows * d_pad // 4) * MERGE_LOADS
        time += SPLIT_FIXED_S + math.ceil(loads / in_flight_loads) * L2_LATENCY_S
    return time


def decode_plan(batch, q_heads, kv_heads, n_q, n_k_max, head_dim, dtype_bytes, *, multiprocessors=MULTIPROCESSORS,
                shared_bytes=SHARED_BYTES_PER_BLOCK, packable=True, aligned=True, page_size=None,
                block_sizes: Optional[Tuple[int, int]] = None, num_splits=0, key_warps=0, kv_stages=0):
    """The layout of a decoding call (the module docstring): q (batch, q_heads, n_q, head_dim) against caches of
    ``n_k_max`` keys per entry (a paged cache: its table's pages times ``page_size``) in elements of
    ``dtype_bytes`` bytes (4: float32, 2: float16 / bfloat16).

    packable: q's heads lie N_q rows apart (C order), so that a group's queries can be viewed as rows.  aligned:
    every row of q and the caches starts on a 16-byte boundary.  The user's ``block_sizes``, ``num_splits``
    (capped so that every warp of every split has a key tile), ``key_warps`` and ``kv_stages`` (0: the library's)
    are taken as given; their validity is ``_validation.check_decode_layout``'s question."""
    streamed = dtype_bytes == 2 and aligned
    packed = packs(q_heads, kv_heads, n_q, packable)
    group = q_heads // kv_heads
    rows = group * n_q if packed else n_q
    heads = kv_heads if packed else q_heads
    tile_rows, tile_keys, warp_rows = default_tile(rows, head_dim, dtype_bytes, streamed, page_size)
    if block_sizes is not None:
        tile_rows, tile_keys = block_sizes
    stages = (kv_stages or DECODE_KV_STAGES) if streamed else 1
    one_warp = tile_rows <= ROWS_PER_WARP
    if key_warps:
        warps = key_warps
    elif streamed and one_warp:
        warps = fitting_key_warps((tile_rows, tile_keys), head_dim, dtype_bytes, stages, shared_bytes)
        if block_sizes is None and rows > tile_rows:   # several of the library's tiles read the group's K/V
            tile_keys, warps = shared_kv_layout((tile_rows, tile_keys), warps, head_dim, dtype_bytes, stages,
                                                shared_bytes, page_size)
    else:
        warps = 1
    tiles = batch * heads * cdiv(rows, tile_rows)
    key_tiles = cdiv(n_k_max, tile_keys)
    most = max(1, cdiv(key_tiles, warps))          # every warp of every split has a key tile
    common = dict(tiles=tiles, n_k=n_k_max, head_dim=head_dim, dtype_bytes=dtype_bytes,
                  block_sizes=(tile_rows, tile_keys), warp_rows=warp_rows, key_warps=warps, stages=stages, rows=rows,
                  multiprocessors=multiprocessors)
    if num_splits:
        splits = min(num_splits, most)
        times = (estimate(splits, **common),)
        best = times[0]
    else:
        times = tuple(estimate(s, **common) for s in range(1, min(most, MOST_SPLITS) + 1))
        best = min(times)
        splits = next(s for s, t in enumerate(times, 1) if t <= best * (1 + TIE))
        best = times[splits - 1]
    return DecodePlan(packed, rows, (tile_rows, tile_keys), warp_rows, warps, stages, splits, best * 1e6,
                      tuple(t * 1e6 for t in times))


__all__ = ["DecodePlan", "decode_plan", "default_tile", "estimate", "fitting_key_warps", "packs", "resident_blocks",
           "shared_kv_layout"]
