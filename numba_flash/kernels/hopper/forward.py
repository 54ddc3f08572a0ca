"""The attention forward on Hopper's warpgroup tensor cores: step 2 of the README's Hopper plan.

Not yet run on a GPU and not yet chosen by ``numba_flash.attention``: it is reached only through
``wgmma_attention`` below, which ``tests/test_hopper.py`` checks against the float64 reference in
the simulator (through ``wgmma.py``'s twins, which read operands by its layout table) and on a
Hopper GPU, where ``experiments/wgmma_layouts.py`` first settles whether that table is the
hardware's.  Scope of this step: float16 and bfloat16, d = 64 or 128, dense or causal (top-left
or bottom-right), grouped heads, any strides with contiguous 16-byte rows, a positive scale; no
block mask, dropout, packed sequences or NaN propagation yet (the ``mma.sync`` kernel in
``kernels/fast`` does all of those).

One thread block is one warpgroup (128 threads) and owns 64 query rows; each warp owns 16 of them,
and its lanes hold S and O in the layout of ``mma.sync``'s C fragments (``wgmma.py``), so the
online softmax below is the fast forward's, over 64-key tiles::

    Q_i -> shared (swizzled, once); K_0, V_0 -> stage 0                       cp.async
    for j in key tiles:
        land K_j, V_j; start K_{j+1}, V_{j+1} into the other stage             cp.async, one barrier
        S = Q_i K_j^T                    wgmma m64n64k16 x d/16, both operands from shared memory
        mask (causal diagonal, the last tile's keys past N_k), m, P = exp2(c S - m), l, alpha
        O = alpha O;  O += P V_j         wgmma m64n{d}k16 x 4, P from registers, V_j transposed
    O / l, lse

Each product group is waited for before its accumulator is read (``wgmma_wait(0)``); overlapping
the softmax of tile j with the products of tile j + 1 is step 3 of the plan.

Barriers and fences, each where it sits:

* after a thread's ``cp.async`` copies land (``copy_async_wait_all``), ``fence_proxy_async``: the
  copies are ordinary writes, and the tensor cores read shared memory through the async proxy;
  then ``syncthreads``: every thread's part of the tile is there, and every warp has finished the
  products of tile j - 1 (each waited for its own), so its buffer may be refilled.
* ``wgmma_fence`` before the products of S (the zeroed accumulator) and of O (the rescaled
  accumulator and P's registers, written by ordinary instructions just before).
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32

from ..._validation import check_attention_args
from ...runtime import arrays as _arrays
from ...runtime.device import in_simulator
from ...runtime.launch import cuda_kernel, inlined_device_function, launch
from ...tiling import cdiv
from ..fast.common import LOG2_E, NEG_INF, ceil_div, operand_extent, tile_coordinates
from ..fast.fragments import sixteen_bit_ops
from ..fast.primitives import copy_async16, copy_async_wait_all, exp2, shfl_xor, store_word
from .wgmma import (ROW_BYTES, SWIZZLE_128B, descriptor_device, enable_sm90a, fence_proxy_async, shared_address,
                    staged_offset_device, swizzle_128_device, wgmma_commit, wgmma_fence, wgmma_rs, wgmma_ss,
                    wgmma_wait)

THREADS = 128            # one warpgroup
BLOCK_M = 64             # query rows per block: wgmma's M
BLOCK_N = 64             # keys per tile: N of S = Q K^T, and four k-steps of O += P V
HEAD_DIMS = (64, 128)
#: Descriptor byte offsets (leading, stride).  K-major (Q, K): 8-row groups 1024 bytes apart, the
#: leading offset unused.  MN-major (V): the 64-column tiles of V (BLOCK_N rows each) apart, and the
#: 8-row groups along the keys.  Both as wgmma.py's table has them, pending experiments/wgmma_layouts.py.
K_MAJOR_OFFSETS = (16, 1024)
V_OFFSETS = (BLOCK_N * ROW_BYTES, 1024)


def tile_bytes(head_dim):
    """Bytes of a 64-row tile of d 16-bit columns (as d / 64 swizzled tiles of 64 columns)."""
    return BLOCK_N * head_dim * 2


def shared_bytes(head_dim):
    """Q, and K and V in two stages, plus slack to start the tiles on a 1024-byte boundary."""
    return 5 * tile_bytes(head_dim) + 1024


@lru_cache(maxsize=None)
def make_wgmma_forward(D, ELEMENT, CAUSAL):
    """The kernel for head dim D (64 or 128), ELEMENT "f16" or "bf16", causal or not."""
    _, pack = sixteen_bit_ops(ELEMENT)
    S_REGISTERS, O_REGISTERS = BLOCK_N // 2, D // 2
    P_WORDS = S_REGISTERS // 2                # P as 16-bit pairs
    CHUNKS = BLOCK_N * D // 8                # 16-byte chunks of a tile
    ROW_CHUNKS = D // 8
    TILE_WORDS = tile_bytes(D) // 4
    K_STEPS = D // 16
    scores_by_keys = wgmma_ss(BLOCK_N, ELEMENT, False)     # S = Q K^T: both K-major
    weights_by_values = wgmma_rs(D, ELEMENT, True)         # O += P V: P in registers, V MN-major
    wait_all_products = wgmma_wait(0)

    @inlined_device_function
    def start_tile(smem, at, X, first, row_stride, rows_valid, tid):
        """64 rows of X (flat 16-bit pairs; the first at element ``first``, rows ``row_stride`` elements apart)
        on their way by cp.async to the swizzled tile at word ``at`` (zeros past rows_valid)."""
        for i in range(CHUNKS // THREADS):
            chunk = tid + i * THREADS
            row, col = chunk // ROW_CHUNKS, (chunk % ROW_CHUNKS) * 8
            inside = row < rows_valid
            source = (first + row * row_stride + col) // 2 if inside else first // 2
            copy_async16(smem, at + swizzle_128_device(staged_offset_device(row, col, BLOCK_N)) // 4, X, source, inside)

    @inlined_device_function
    def k_major_descriptor(address, step):
        """The descriptor of k-step ``step`` (16 columns) of a K-major tile at shared address ``address``."""
        return descriptor_device(address + (step // 4) * BLOCK_N * ROW_BYTES + (step % 4) * 32, K_MAJOR_OFFSETS[0],
                                 K_MAJOR_OFFSETS[1], SWIZZLE_128B)

    def kernel(Q, K, V, O, LSE, q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn, heads, group,
               n_q, n_k, q_tiles, causal_offset, scale_log2):
        # Q, K, V, O: flat 16-bit pairs, element (b, h, n, x) at b sb + h sh + n sn + x (rows 16-byte aligned);
        # key/value head h // group serves query head h; LSE: (batch * heads, n_q) float32.
        tile, h, b, bh = tile_coordinates(cuda.blockIdx.x, q_tiles, heads, CAUSAL)
        q_tile = q_tiles - 1 - tile if CAUSAL else tile   # rank 0: the longest tile
        q0 = q_tile * BLOCK_M
        tid = cuda.threadIdx.x
        warp, g, t = tid // 32, (tid % 32) // 4, tid % 4
        c_log2 = float32(scale_log2)
        smem = cuda.shared.array(0, uint32)
        base = shared_address(smem)
        pad = ((1024 - (base & 1023)) & 1023) // 4       # words to the first 1024-byte boundary
        q_at = pad
        kv_at = pad + TILE_WORDS                          # K stage s at kv_at + 2 s TILE_WORDS, V one tile on

        n_tiles = ceil_div(n_k, BLOCK_N)
        if CAUSAL:  # no key beyond the last row's diagonal
            n_tiles = min(n_tiles, max(0, ceil_div(min(q0 + BLOCK_M, n_q) + causal_offset, BLOCK_N)))
        k_first = b * k_sb + (h // group) * k_sh      # key 0 of this head's K (and V below)
        v_first = b * v_sb + (h // group) * v_sh
        start_tile(smem, q_at, Q, b * q_sb + h * q_sh + q0 * q_sn, q_sn, n_q - q0, tid)
        if n_tiles > 0:
            start_tile(smem, kv_at, K, k_first, k_sn, n_k, tid)
            start_tile(smem, kv_at + TILE_WORDS, V, v_first, v_sn, n_k, tid)

        m_i = cuda.local.array(2, float32)                # this lane's rows g and g + 8 (of 16 warp)
        l_i = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        s = cuda.local.array(S_REGISTERS, float32)
        acc = cuda.local.array(O_REGISTERS, float32)
        p_words = cuda.local.array(P_WORDS, uint32)   # P, packed: wgmma's A operand
        for r in range(2):
            m_i[r] = float32(NEG_INF)
            l_i[r] = float32(0)
        for i in range(O_REGISTERS):
            acc[i] = float32(0)

        for j in range(n_tiles):
            k0 = j * BLOCK_N
            stage = (j % 2) * 2 * TILE_WORDS
            copy_async_wait_all()
            fence_proxy_async()   # cp.async's writes, before the tensor cores read them
            cuda.syncthreads()    # tile j whole; every warp done with tile j - 1's buffer
            if j + 1 < n_tiles:
                other = kv_at + 2 * TILE_WORDS - stage
                k1 = k0 + BLOCK_N
                start_tile(smem, other, K, k_first + k1 * k_sn, k_sn, n_k - k1, tid)
                start_tile(smem, other + TILE_WORDS, V, v_first + k1 * v_sn, v_sn, n_k - k1, tid)
            k_address = base + (kv_at + stage) * 4
            v_address = k_address + TILE_WORDS * 4

            # ---- S = Q_i K_j^T ----
            for i in range(S_REGISTERS):
                s[i] = float32(0)
            wgmma_fence()
            for step in range(K_STEPS):
                scores_by_keys(s, k_major_descriptor(base + q_at * 4, step), k_major_descriptor(k_address, step))
            wgmma_commit()
            wait_all_products()

            # ---- mask: keys past N_k, and the causal diagonal ----
            if CAUSAL or k0 + BLOCK_N > n_k:
                for i in range(S_REGISTERS):
                    row = q0 + 16 * warp + g + 8 * ((i % 4) // 2)
                    key = k0 + 8 * (i // 4) + 2 * t + i % 2
                    if key >= n_k or (CAUSAL and key > row + causal_offset):
                        s[i] = float32(NEG_INF)

            # ---- online softmax (scores in log2 units; the scale inside the exponent's FMA) ----
            for r in range(2):
                m_tile = float32(NEG_INF)
                for i in range(S_REGISTERS):
                    if (i % 4) // 2 == r:
                        m_tile = max(m_tile, s[i])
                m_tile = max(m_tile, shfl_xor(m_tile, 1))   # the four lanes of a row
                m_tile = max(m_tile, shfl_xor(m_tile, 2))
                m_new = max(m_i[r], m_tile * c_log2)
                shift = m_new if m_new != float32(NEG_INF) else float32(0)   # no key yet: exp2(-inf) = 0
                alpha[r] = exp2(m_i[r] - shift)
                row_sum = float32(0)
                for i in range(S_REGISTERS):
                    if (i % 4) // 2 == r:
                        p = exp2(cuda.fma(s[i], c_log2, -shift))
                        s[i] = p
                        row_sum += p
                l_i[r] = alpha[r] * l_i[r] + row_sum
                m_i[r] = m_new

            # ---- O = alpha O + P V_j ----
            for i in range(O_REGISTERS):
                acc[i] *= alpha[(i % 4) // 2]
            # P as 16-bit pairs, all of it before the first product: a register the products still read
            # is not rewritten while they are in flight.  Pair x of k-step `step`: the A layout's
            # (g, 2t), (g + 8, 2t), (g, 2t + 8), (g + 8, 2t + 8), i.e. S's 8-key blocks 2 step and 2 step + 1.
            for x in range(P_WORDS):
                p_words[x] = pack(s[2 * x], s[2 * x + 1])
            wgmma_fence()   # the rescaled accumulator and P's registers, before the products read them
            for step in range(BLOCK_N // 16):
                weights_by_values(acc, (p_words[4 * step], p_words[4 * step + 1], p_words[4 * step + 2],
                                        p_words[4 * step + 3]),
                                  descriptor_device(v_address + step * 16 * ROW_BYTES, V_OFFSETS[0], V_OFFSETS[1],
                                                    SWIZZLE_128B))
            wgmma_commit()
            wait_all_products()

        # ---- O / l and lse, once ----
        for r in range(2):
            l_row = l_i[r]
            l_row += shfl_xor(l_row, 1)
            l_row += shfl_xor(l_row, 2)
            row = q0 + 16 * warp + g + 8 * r
            inv_l = float32(1) / l_row if l_row != float32(0) else float32(0)
            if row < n_q:
                for block in range(D // 8):
                    i = 4 * block + 2 * r
                    store_word(O, (b * o_sb + h * o_sh + row * o_sn + 8 * block + 2 * t) // 2,
                               pack(acc[i] * inv_l, acc[i + 1] * inv_l))
                if t == 0:
                    LSE[bh * n_q + row] = (m_i[r] * float32(1 / LOG2_E) + math.log(l_row)
                                           if l_row != float32(0) else float32(NEG_INF))

    return cuda_kernel(kernel, f"wgmma_forward_d{D}_{ELEMENT}" + ("_causal" if CAUSAL else ""),
                       launch_bounds=(THREADS, 1))


def wgmma_attention(q, k, v, *, causal=False, scale=None):
    """(O, lse) by the wgmma forward, for what ``numba_flash.attention`` takes (checked by the same
    ``check_attention_args``: torch CUDA tensors, Numba device arrays, NumPy arrays; grouped heads; any
    strides whose last dimension is contiguous; causal False, True, "top_left" or "bottom_right") within
    this step's scope: float16 or bfloat16, d in HEAD_DIMS, rows on 16-byte boundaries, a positive scale.
    In the simulator it runs through the twins of ``wgmma.py``; on a GPU it needs compute capability 9.0
    and compiles for sm_90a (``wgmma.enable_sm90a``: process-wide)."""
    operands = tuple(_arrays.describe(name, x) for name, x in zip("qkv", (q, k, v)))
    call = check_attention_args(*operands, causal=causal, scale=scale, block_mask=None, dropout_p=0.0, seed=0,
                                algorithm="flash2", block_sizes=None)
    if call.precision == "tf32x3":
        raise TypeError(f"q, k, v must be float16 or bfloat16 on the wgmma path, not {call.dtype}")
    if call.head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS} on the wgmma path, not {call.head_dim}")
    if not call.scale > 0:
        raise ValueError(f"scale must be positive on the wgmma path, not {call.scale}")
    if not call.vec:
        raise ValueError("q, k and v must have rows that start on 16-byte boundaries on the wgmma path")
    if not in_simulator():
        if cuda.get_current_device().compute_capability != (9, 0):
            raise ValueError("the wgmma path needs a GPU of compute capability 9.0 (H100, H200)")
        enable_sm90a()
    kernel = make_wgmma_forward(call.head_dim, call.precision, call.causal)
    if call.kind == "torch":
        stream = _arrays.current_torch_stream(operands[0].device)
    else:
        stream = _arrays.stream_of(q)
    if call.kind == "host":
        q, k, v = (_arrays.to_device(x) for x in (q, k, v))
    result_kind = "torch" if call.kind == "torch" else "cuda"
    o = _arrays.empty(result_kind, call.q_shape, call.dtype, stream, operands[0].device)
    lse = _arrays.empty(result_kind, call.q_shape[:-1], "float32", stream, operands[0].device)
    shapes = (call.q_shape, call.kv_shape, call.kv_shape, call.q_shape)
    words = [_arrays.flat_view(x, np.uint32, operand_extent(shape, strides, pairs=True))
             for x, shape, strides in zip((q, k, v, o), shapes, call.strides + (call.result_strides("q"),))]
    q_tiles = cdiv(call.n_q, BLOCK_M)
    if q_tiles and call.batch_heads:
        arguments = [*words, _arrays.flat_view(lse, np.float32, call.batch_heads * call.n_q)]
        for strides in call.strides + (call.result_strides("q"),):
            arguments += [strides.batch, strides.head, strides.row]
        arguments += [call.heads, call.group, call.n_q, call.n_k, q_tiles, call.causal_offset, call.scale * LOG2_E]
        launch(kernel, q_tiles * call.batch_heads, THREADS, tuple(arguments), dynamic_shared_bytes=shared_bytes(
            call.head_dim), stream=_arrays.numba_stream(stream))
    if call.kind == "host":
        return _arrays.to_host(o, call.dtype), _arrays.to_host(lse, "float32")
    return o, lse
