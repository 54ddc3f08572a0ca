"""The named steps of a key tile that every wgmma forward shares: the products, the online softmax, the plain masks
and the output.

``forward.py`` (one or two warpgroups that all copy, meeting at block barriers) and ``specialized_forward.py`` (a
producer warpgroup and two consumers that take turns on the tensor cores) differ in who brings the tiles and when
the warpgroups wait; what a warpgroup does with a tile once it is there is the same, and is here.  Each step works on
one warpgroup's 64 query rows, its lanes holding S and O in the layout of ``mma.sync``'s C fragments (``wgmma.py``):
lane (g, t) of warp ``warp`` holds rows 16 warp + g and + 8, and of each 8-key block keys 2t and 2t + 1.

``tile_steps(D, ELEMENT, CAUSAL)`` makes them for head dim D (a multiple of 16 up to 256, on the shared-memory
layout of ``common.layout_dim(D)`` columns) and ELEMENT "f16" or "bf16".
"""
import math
from collections import namedtuple
from functools import lru_cache

from numba import cuda, float32, uint32, uint64

from ...runtime.launch import inlined_device_function
from ...tiling import cdiv
from ..fast.common import NEG_INF, row_lse
from ..fast.fragments import sixteen_bit_ops
from ..fast.primitives import exp2, shfl_xor, store_word
from .common import BLOCK_N, k_step_bytes, mn_step_bytes, tile_bytes
from .wgmma import (advanced_device, staged_offset_device, swizzle_128_device, wgmma_commit, wgmma_fence, wgmma_rs,
                    wgmma_ss)

S_REGISTERS = BLOCK_N // 2   # a lane's scores of a 64 x 64 tile
P_WORDS = S_REGISTERS // 2   # the same as 16-bit pairs: P, the A operand of O += P V


def query_words(head_dim):
    """A lane's 16-bit pairs of its warpgroup's Q tile held as wgmma A fragments (``load_query``): four a k-step."""
    return 4 * cdiv(head_dim, 16)


def value_slices(head_dim):
    """The column widths of O's slices: O = alpha O + P V is one accumulator of m64n{d} up to d = 128 (d / 2
    registers a thread), and above that two, columns 0..127 and 128..d-1, each its own local array and its own
    products (m64n128k16 and m64n{d - 128}k16; the second's V descriptor two 64-column tiles on).  wgmma's N goes to
    256, but the loops over a 128-register array are more than LLVM unrolls (its trip-count limit): the array then
    stays in local memory (a 528-byte stack frame at d = 256, each product's accumulator loaded and stored around it:
    ptxas 13.0, sm_90a, 2026-12-06), where two arrays of 64 are held in registers as at d = 128."""
    return (head_dim,) if head_dim <= 128 else (128, head_dim - 128)


@inlined_device_function
def row_and_key(i, q0, k0, warp, g, t):
    """The query row and key of this lane's score register i (the accumulator layout of wgmma.py)."""
    return q0 + 16 * warp + g + 8 * ((i % 4) // 2), k0 + 8 * (i // 4) + 2 * t + i % 2


TileSteps = namedtuple("TileSteps", "LOW_REGISTERS HIGH_REGISTERS HIGH_ARRAY start_rows issue_scores mask_outside "
                                    "online_softmax poison rescale_and_pack issue_weighted_values store_output "
                                    "load_query issue_scores_from_registers")


@lru_cache(maxsize=None)
def tile_steps(D, ELEMENT, CAUSAL):
    """The steps for head dim D, ELEMENT, causal or not (``TileSteps``; LOW_REGISTERS and HIGH_REGISTERS: a lane's
    registers of O's slices, ``value_slices``, HIGH_ARRAY the second's array length, 1 where there is none)."""
    _, pack = sixteen_bit_ops(ELEMENT)
    SLICES = value_slices(D)
    LOW_REGISTERS, HIGH_REGISTERS = SLICES[0] // 2, (SLICES[1] // 2 if len(SLICES) > 1 else 0)
    HIGH_ARRAY = max(HIGH_REGISTERS, 1)       # (a one-register placeholder where there is no second slice)
    HIGH_V_BYTES = tile_bytes(SLICES[0])      # where V's column 128 starts: two 64-column tiles on
    K_STEPS = cdiv(D, 16)                     # S's k-steps: the pad columns past them are not read
    scores_by_keys = wgmma_ss(BLOCK_N, ELEMENT, False)     # S = Q K^T: both K-major
    registers_by_keys = wgmma_rs(BLOCK_N, ELEMENT, False)   # the same with Q's fragments in registers
    weights_by_values = wgmma_rs(SLICES[0], ELEMENT, True)   # O += P V: P in registers, V MN-major
    weights_by_high_values = wgmma_rs(SLICES[-1], ELEMENT, True)   # (used only with a second slice)

    @inlined_device_function
    def start_rows(m_i, l_i, acc):
        """This lane's rows before their first key: m = -inf, l = 0, O = 0."""
        for r in range(2):
            m_i[r] = float32(NEG_INF)
            l_i[r] = float32(0)
        for i in range(LOW_REGISTERS):
            acc[0][i] = float32(0)
        for i in range(HIGH_REGISTERS):
            acc[1][i] = float32(0)

    @inlined_device_function
    def issue_scores(s, q_desc, k_desc):
        """S = Q_i K_j^T into ``s`` (zeroed first), committed as one group; nothing waits for it."""
        for i in range(S_REGISTERS):
            s[i] = float32(0)
        wgmma_fence()   # the zeroed accumulator, before the products write it
        for step in range(K_STEPS):
            scores_by_keys(s, advanced_device(q_desc, k_step_bytes(step)), advanced_device(k_desc, k_step_bytes(step)))
        wgmma_commit()

    @inlined_device_function
    def load_query(smem, q_at, q_words, warp, g, t):
        """This lane's A fragments of the warpgroup's Q tile (K-major, 128-byte swizzle, at word ``q_at``): pair x of
        k-step ``step`` is the A layout's (g, 2t), (g + 8, 2t), (g, 2t + 8), (g + 8, 2t + 8) of rows 16 warp on."""
        for step in range(K_STEPS):
            for x in range(4):
                row, column = 16 * warp + g + 8 * (x % 2), 16 * step + 2 * t + 8 * (x // 2)
                q_words[4 * step + x] = smem[q_at + swizzle_128_device(staged_offset_device(row, column, BLOCK_N)) // 4]

    @inlined_device_function
    def issue_scores_from_registers(s, q_words, k_desc):
        """``issue_scores`` with Q from this warpgroup's registers (``load_query``): the tensor cores then read only
        K from shared memory."""
        for i in range(S_REGISTERS):
            s[i] = float32(0)
        wgmma_fence()
        for step in range(K_STEPS):
            q = (q_words[4 * step], q_words[4 * step + 1], q_words[4 * step + 2], q_words[4 * step + 3])
            registers_by_keys(s, q, advanced_device(k_desc, k_step_bytes(step)))
        wgmma_commit()

    @inlined_device_function
    def mask_outside(s, q0, k0, n_k, causal_offset, warp, g, t):
        """Scores of keys past N_k and (causal) right of the diagonal to -inf."""
        for i in range(S_REGISTERS):
            row, key = row_and_key(i, q0, k0, warp, g, t)
            if key >= n_k or (CAUSAL and key > row + causal_offset):
                s[i] = float32(NEG_INF)

    @inlined_device_function
    def online_softmax(s, m_i, l_i, alpha, c_log2):
        """Scores in log2 units, the scale inside the exponent's FMA: m, P = exp2(c S - m) in ``s``, l, and
        alpha, the rescale of O, per row."""
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

    @inlined_device_function
    def poison(s, v_nan, hidden, q0, k0, causal_offset, warp, g, t, TESTED):
        """NaN where this lane's key is allowed and its value row held a NaN (``v_nan``: the lane's keys' flags,
        ``fast.common.lane_flags``).  Allowed: bit i of ``hidden`` clear where TESTED (the element test's word),
        else (causal) left of the diagonal."""
        for i in range(S_REGISTERS):
            row, key = row_and_key(i, q0, k0, warp, g, t)
            flagged = (v_nan >> uint64(2 * (i // 4) + i % 2)) & uint64(1)
            if TESTED:
                if flagged and not (hidden >> uint32(i)) & uint32(1):
                    s[i] = float32(math.nan)
            elif flagged and key <= row + causal_offset:
                s[i] = float32(math.nan)

    @inlined_device_function
    def rescale_and_pack(acc, alpha, s, p_words):
        """O = alpha O, and P packed into 16-bit pairs (wgmma's A operand from registers)."""
        low, high = acc   # O's slices (``value_slices``)
        for i in range(LOW_REGISTERS):
            low[i] *= alpha[(i % 4) // 2]
        for i in range(HIGH_REGISTERS):
            high[i] *= alpha[(i % 4) // 2]
        for x in range(P_WORDS):
            p_words[x] = pack(s[2 * x], s[2 * x + 1])

    @inlined_device_function
    def issue_weighted_values(acc, p_words, v_desc):
        """O += P V_j committed as one group; nothing waits for it.  Pair x of k-step ``step``: the A layout's
        (g, 2t), (g + 8, 2t), (g, 2t + 8), (g + 8, 2t + 8), i.e. S's 8-key blocks 2 step and 2 step + 1."""
        low, high = acc
        wgmma_fence()   # the rescaled accumulator and P's registers, before the products read them
        for step in range(BLOCK_N // 16):
            p = (p_words[4 * step], p_words[4 * step + 1], p_words[4 * step + 2], p_words[4 * step + 3])
            weights_by_values(low, p, advanced_device(v_desc, mn_step_bytes(step)))
            if HIGH_REGISTERS > 0:   # columns 128..D-1: V's third and fourth 64-column tiles
                weights_by_high_values(high, p, advanced_device(v_desc, HIGH_V_BYTES + mn_step_bytes(step)))
        wgmma_commit()

    @inlined_device_function
    def store_output(O, LSE, acc, m_i, l_i, q0, n_q, o_first, o_sn, lse_first, warp, g, t):
        """O / l for this lane's rows below n_q (row x of O at element o_first + x o_sn), and their lse at
        LSE[lse_first + row]."""
        for r in range(2):
            l_row = l_i[r]
            l_row += shfl_xor(l_row, 1)
            l_row += shfl_xor(l_row, 2)
            row = q0 + 16 * warp + g + 8 * r
            inv_l = float32(1) / l_row if l_row != float32(0) else float32(0)
            if row < n_q:
                o_row = o_first + row * o_sn   # its element 0
                for block in range(LOW_REGISTERS // 4):   # O's slices (``value_slices``), 8 columns a block
                    i = 4 * block + 2 * r
                    store_word(O, (o_row + 8 * block + 2 * t) // 2, pack(acc[0][i] * inv_l, acc[0][i + 1] * inv_l))
                for block in range(HIGH_REGISTERS // 4):
                    i = 4 * block + 2 * r
                    store_word(O, (o_row + SLICES[0] + 8 * block + 2 * t) // 2,
                               pack(acc[1][i] * inv_l, acc[1][i + 1] * inv_l))
                if t == 0:
                    LSE[lse_first + row] = row_lse(m_i[r], l_row)

    return TileSteps(LOW_REGISTERS, HIGH_REGISTERS, HIGH_ARRAY, start_rows, issue_scores, mask_outside, online_softmax,
                     poison, rescale_and_pack, issue_weighted_values, store_output, load_query,
                     issue_scores_from_registers)


__all__ = ["P_WORDS", "S_REGISTERS", "query_words", "TileSteps", "row_and_key", "tile_steps", "value_slices"]
