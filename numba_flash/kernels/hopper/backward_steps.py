"""What the wgmma backward's kernels are made of: one warpgroup's products, its softmax gradient steps, its stores.

``backward.py`` builds the dK/dV, dQ and convert kernels from these, ``specialized_dkdv.py`` the dK/dV kernel whose
warps have roles; the module docstring of ``backward.py`` tells the story (which product reads what, in which
layout).  Every accumulator here is a warpgroup's (``wgmma.py``'s layout: each warp 16 of the tile's 64 rows, its
lanes mma.sync's C fragment per 8 columns), every tile a 64-row one of ``common.py``.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32

from ...runtime.launch import Kernel, inlined_device_function
from ..fast.common import lane_entry, log2_lse
from ..fast.fragments import sixteen_bit_ops
from ..fast.primitives import exp2, f32_as_u32, load_word, store_word, u32_as_f32
from .common import BLOCK_N, S_REGISTERS, k_step_bytes, mn_step_bytes, tile_bytes, tile_copier
from .wgmma import advanced_device, wgmma_commit, wgmma_fence, wgmma_rs, wgmma_ss, wgmma_wait

WARPGROUP = 128          # threads of a warpgroup: a block of the one-warpgroup kernels


@lru_cache(maxsize=None)
def products(HEAD_DIM, ELEMENT):
    """(issue_scores, pack_pairs, issue_weighted) of one warpgroup for head dim HEAD_DIM: a step's two score-like
    products, an accumulator packed as the next product's A operand, and that product."""
    K_STEPS = HEAD_DIM // 16
    scores_by_rows = wgmma_ss(BLOCK_N, ELEMENT, False)      # S = A B^T over d: both tiles K-major
    first_scores = wgmma_ss(BLOCK_N, ELEMENT, False, fresh=True)
    weights_by_rows = wgmma_rs(HEAD_DIM, ELEMENT, True)     # acc += A B: A in registers, B MN-major
    _, pack = sixteen_bit_ops(ELEMENT)

    @inlined_device_function
    def issue_scores(s, a_desc, b_desc, dp, da_desc, db_desc):
        """s = A B^T, then dp = dA dB^T, over d (four 64-row tiles), a commit group each: s may be waited for alone
        (``wait_all_but_one``) while dp's products run.  Each first k-step overwrites its accumulator (``fresh``):
        zeros moved into dp's registers after s's products were issued would make ptxas wait for them."""
        wgmma_fence()   # the registers the previous products left, before these write them
        first_scores(s, a_desc, b_desc)
        for step in range(1, K_STEPS):
            scores_by_rows(s, advanced_device(a_desc, k_step_bytes(step)), advanced_device(b_desc, k_step_bytes(step)))
        wgmma_commit()
        first_scores(dp, da_desc, db_desc)
        for step in range(1, K_STEPS):
            scores_by_rows(dp, advanced_device(da_desc, k_step_bytes(step)),
                           advanced_device(db_desc, k_step_bytes(step)))
        wgmma_commit()

    @inlined_device_function
    def pack_pairs(words, s):
        """A 64 x 64 accumulator as the A operand of the next product: 16-bit pairs, k-step x in words 4x .. 4x + 3
        (the A layout's (g, 2t), (g + 8, 2t), (g, 2t + 8), (g + 8, 2t + 8): the accumulator's 8-column blocks 2x
        and 2x + 1)."""
        for x in range(S_REGISTERS // 2):
            words[x] = pack(s[2 * x], s[2 * x + 1])

    @inlined_device_function
    def issue_weighted(acc, words, b_desc):
        """acc += A B for A packed in ``words`` (64 x 64) and B the MN-major tile of ``b_desc``: four k-steps."""
        for step in range(BLOCK_N // 16):
            weights_by_rows(acc, (words[4 * step], words[4 * step + 1], words[4 * step + 2], words[4 * step + 3]),
                            advanced_device(b_desc, mn_step_bytes(step)))

    return issue_scores, pack_pairs, issue_weighted


@lru_cache(maxsize=None)
def row_store(HEAD_DIM, ELEMENT):
    """``store_rows(X, first, row_stride, acc, rows_valid, factor, warp, g, t)``: this lane's rows of a 64 x
    HEAD_DIM accumulator times ``factor``, as 16-bit pairs into X (element (r, x) at first + r row_stride + x)."""
    _, pack = sixteen_bit_ops(ELEMENT)

    @inlined_device_function
    def store_rows(X, first, row_stride, acc, rows_valid, factor, warp, g, t):
        for r in range(2):
            row = 16 * warp + g + 8 * r
            if row < rows_valid:
                for block in range(HEAD_DIM // 8):
                    i = 4 * block + 2 * r
                    store_word(X, (first + row * row_stride + 8 * block + 2 * t) // 2,
                               pack(acc[i] * factor, acc[i + 1] * factor))

    return store_rows


wait_all_products = wgmma_wait(0)
wait_all_but_one = wgmma_wait(1)


@lru_cache(maxsize=None)
def steps(HEAD_DIM, ELEMENT):
    """What every dK/dV and dQ kernel is made of, for head dim HEAD_DIM: (registers of a 64 x HEAD_DIM accumulator,
    words of a tile, start_tile (by a warpgroup), issue_scores, pack_pairs, issue_weighted, store_rows)."""
    return (HEAD_DIM // 2, tile_bytes(HEAD_DIM) // 4, tile_copier(HEAD_DIM, WARPGROUP)[1], *products(HEAD_DIM, ELEMENT),
            row_store(HEAD_DIM, ELEMENT))


@lru_cache(maxsize=None)
def step_copier(HEAD_DIM, THREADS):
    """``start_step(smem, at, scalars_at, Q, dO, LSE, D, q_first, do_first, q_sn, do_sn, lse_first, q0, n_q, tid)``
    by THREADS threads (tid: 0 .. THREADS - 1; at least 64): a step's Q_i and dO_i on their way by cp.async into the
    stage at word ``at`` (Q_i, then dO_i), their rows' lse (log2 units; +inf past N_q, so that P = 0) and D stored at
    ``scalars_at`` and ``scalars_at + BLOCK_N`` (plain stores: whatever publishes the landed tiles publishes them
    too)."""
    TILE_WORDS = tile_bytes(HEAD_DIM) // 4
    start_tile = tile_copier(HEAD_DIM, THREADS)[1]

    @inlined_device_function
    def start_step(smem, at, scalars_at, Q, dO, LSE, D, q_first, do_first, q_sn, do_sn, lse_first, q0, n_q, tid):
        start_tile(smem, at, Q, q_first + q0 * q_sn, q_sn, n_q - q0, tid)
        start_tile(smem, at + TILE_WORDS, dO, do_first + q0 * do_sn, do_sn, n_q - q0, tid)
        if tid < BLOCK_N:
            row = q0 + tid
            inside = row < n_q
            store_word(smem, scalars_at + tid,
                       f32_as_u32(log2_lse(LSE[lse_first + row]) if inside else float32(math.inf)))
            store_word(smem, scalars_at + BLOCK_N + tid, f32_as_u32(D[lse_first + row] if inside else float32(0)))

    return start_step


@lru_cache(maxsize=None)
def transposed_scores(CAUSAL, ELEMENT_TEST):
    """(probabilities, score_gradients): the softmax's gradient steps of a dK/dV kernel on a 64 x 64 tile of S^T
    (keys along the rows, query rows along the columns), the query rows' lse (log2 units) and D read from shared
    memory at ``scalars_at`` and ``scalars_at + BLOCK_N``.  ELEMENT_TEST: a tile's hidden entries come as a word of
    bits (``backward.element_test``); without it the causal diagonal and the last keys are tested where ``masked``."""

    @inlined_device_function
    def probabilities(st, smem, scalars_at, k0, q0, n_k, causal_offset, c_log2, masked, hidden, warp, g, t):
        """st: S^T -> P^T = exp2(c S^T - lse), 0 where the key may not be seen (``masked``, block-uniform: a tile
        the causal diagonal crosses, or the last keys' ragged one); with the element test, where bit i of
        ``hidden`` is set (``element_test``: a tile a block mask covers only partly too)."""
        for i in range(S_REGISTERS):
            key, column = lane_entry(i, g, t, warp)
            p = exp2(cuda.fma(st[i], c_log2, -u32_as_f32(load_word(smem, scalars_at + column))))
            if ELEMENT_TEST:
                if (hidden >> uint32(i)) & uint32(1):
                    p = float32(0)
            elif masked and (k0 + key >= n_k or (CAUSAL and k0 + key > q0 + column + causal_offset)):
                p = float32(0)
            st[i] = p

    @inlined_device_function
    def score_gradients(dpt, st, smem, scalars_at, warp, g, t):
        """dpt: dP^T -> dS^T = P^T o (dP^T - D), for P^T in st (with a score_mod, P^T o d score_mod / d score)."""
        for i in range(S_REGISTERS):
            _, column = lane_entry(i, g, t, warp)
            dpt[i] = st[i] * (dpt[i] - u32_as_f32(load_word(smem, scalars_at + BLOCK_N + column)))

    return probabilities, score_gradients


def backward_kernel(fn, name, results, scratch=None, blocks=1, threads=WARPGROUP):
    """A wgmma backward kernel as a ``Kernel``: 16-bit operands and results as pairs, lse and D float32,
    and ``scratch`` ({name: dtype}: scratch arrays, and a block mask's lists and layout); ``blocks``: the blocks
    ptxas must fit on a multiprocessor (the launch bounds' minimum: a register cap above 1), of ``threads``."""
    return Kernel(fn, name, arrays=dict(Q=np.uint32, K=np.uint32, V=np.uint32, dO=np.uint32, LSE=np.float32,
                                        D=np.float32, **{x: np.uint32 for x in results}, **(scratch or {})),
                  floats=("scale", "scale_log2"), launch_bounds=(threads, blocks))
