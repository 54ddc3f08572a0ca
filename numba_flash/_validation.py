"""Every check on user input, in one place, before anything is launched.

``check_attention_args`` turns the arguments of ``attention`` (and the shared
part of ``attention_backward``) into an ``AttentionCall`` whose fields the
kernels can trust, or raises a ValueError/TypeError that names the
offending argument.  The defaults live here too: the algorithm, the scale,
and (through ``tiling``) the tiles.
"""
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from ._checks import positive_int_pair
from .decode_plan import fitting_key_warps, packs
from .runtime.arrays import Operand, Strides, c_strides, is_c_contiguous, view_strides
from .runtime.device import device_limits
from .sparsity.block_mask import BlockMask
from .tiling import (DECODE_KV_STAGES, FLASH2_MAX_HEAD_DIM, PRECISION, ROWS_PER_WARP,
                     decode_default_block_sizes, page_key_tile,
                     flash1_backward_block_sizes, flash1_backward_shared_bytes, flash1_shared_bytes, flash2_backward_shared_bytes,
                     flash2_default_block_sizes, flash2_forward_smem, flash2_threads, k_step, line1_block_sizes,
                     padded_head_dim)

ALGORITHMS = ("standard", "flash1", "flash2")
#: The forward also takes "wgmma": flash2's loop on Hopper's warpgroup instructions (kernels/hopper), forced.
FORWARD_ALGORITHMS = ALGORITHMS + ("wgmma",)
BACKWARD_ALGORITHMS = ("flash1", "flash2")
#: The backward also takes "wgmma": flash2's backward on Hopper's warpgroup instructions (kernels/hopper), asked for.
GRADIENT_ALGORITHMS = BACKWARD_ALGORITHMS + ("wgmma",)
#: Packed sequences (``attention_varlen`` and its backward): flash2 (mma.sync, or on Hopper what its pick says) and
#: "wgmma" asked for; the literal kernels read no sequence bounds.
VARLEN_ALGORITHMS = ("flash2", "wgmma")
#: dtypes each algorithm accepts (the fast kernel also takes the 16-bit types).
DTYPES = {"standard": ("float32",), "flash1": ("float32",), "flash2": ("float32", "float16", "bfloat16")}
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


#: Rows per page of a paged KV cache: multiples of PAGE_ROWS_STEP from PAGE_ROWS_MIN to PAGE_ROWS_MAX (vLLM's 16 to
#: flash-attn 2's 256).  A key tile must lie in one page (``kernels/fast/forward.py``, PAGED), and the 16-bit key tile
#: is a multiple of 16 keys.
PAGE_ROWS_MIN, PAGE_ROWS_MAX, PAGE_ROWS_STEP = 16, 256, 16


@dataclass(frozen=True)
class Paging:
    """A paged KV cache: k_cache and v_cache are pools (``pages``, H_kv, ``page_size``, d), and key j of entry b is row
    j % page_size of page block_table[b, j // page_size]; the table (int32) has ``max_pages`` columns, its rows
    ``table_stride`` elements apart, ``table_extent`` elements from its first to one past its last."""

    page_size: int
    pages: int
    max_pages: int
    table_stride: int
    table_extent: int

    @property
    def keys(self):
        """The most keys an entry holds: its row of the table full."""
        return self.max_pages * self.page_size


@dataclass(frozen=True)
class Varlen:
    """Batch entries of different lengths, read from per-call bounds arrays (``kernels/fast/common.py``,
    ``sequence_bounds``): flash-attn's packed layout (q (total_q, H, d), k and v (total_k, H_kv, d), sequence b
    in rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1: cumulative bounds, step 1), or a KV cache (``kv_cache``: the
    key bounds array holds cache_seqlens, entry b's keys 0 .. cache_seqlens[b] + new_keys - 1; its queries the
    call's N_q)."""

    batch: int
    longest_q: int
    longest_k: int
    bottom_right: bool          # causal aligned bottom-right in each entry (else top-left)
    q_step: int = 1             # entry b's bounds are bounds[b * step], bounds[b * step + 1]
    k_step: int = 1
    lse_strides: Tuple[int, int] = (0, 0)   # lse row r of (b, h) at b * lse_strides[0] + h * lse_strides[1] + first + r
    q_bounds_size: int = 0
    k_bounds_size: int = 0
    packed: bool = True         # q, k, v (total, heads, d) (else (batch, heads, N, d) with batch strides)
    kv_cache: bool = False      # the key bounds are a KV cache's lengths before the call's new keys
    new_keys: int = 0           # ... and each entry gains this many
    paging: Optional[Paging] = None   # a KV cache in pages (else each entry's rows are contiguous)
    #: A KV cache's query heads packed as rows (``decode_plan.py``): the rows of a (batch, key/value head) are its
    #: group's queries, row g * head_queries + i query i of the group's head g; 0: the rows are one head's queries.
    head_queries: int = 0


@dataclass(frozen=True)
class AttentionCall:
    """A validated call: shapes, dtype and options the kernels can rely on.

    q is (*batch_shape, heads, n_q, head_dim) viewed as (batch, heads, n_q, d)
    (inputs of 2 dims have one head and no batch); k and v have
    ``kv_heads`` heads, a divisor of ``heads`` (grouped-query attention).
    """

    algorithm: str
    batch_shape: Tuple[int, ...]
    heads: int
    kv_heads: int
    n_q: int
    n_k: int
    head_dim: int
    dtype: str
    scale: float
    causal: bool
    causal_offset: int          # key j visible to query i iff j <= i + causal_offset
    block_sizes: Optional[Tuple[int, int]]
    kind: str                   # "torch", "cuda" or "host"
    q_shape: Tuple[int, ...]
    kv_shape: Tuple[int, ...]
    strides: Tuple[Strides, Strides, Strides]   # of q, k, v (host inputs: C order after the copy)
    vec: bool                   # every row of q, k, v starts on a 16-byte boundary
    block_mask: Optional[BlockMask] = None
    dropout_p: float = 0.0
    #: Variable-length calls: batch_shape is (sequences,), n_q and n_k the packed totals, the strides'
    #: batch entry 0 (the kernels find each sequence's rows from cu_seqlens).
    varlen: Optional[Varlen] = None
    #: (score_mod, mask_mod) as ``numba_flash.mods.Mod``s (either None), or None without mods (``check_mods``).
    mods: Optional[tuple] = None

    @property
    def batch(self):
        return int(math.prod(self.batch_shape))   # (not np.prod: microseconds a call, which decoding pays)

    @property
    def longest_q(self):
        """The most queries one (batch, head) has: the grid's query tiles cover it."""
        return self.n_q if self.varlen is None else self.varlen.longest_q

    @property
    def longest_k(self):
        return self.n_k if self.varlen is None else self.varlen.longest_k

    @property
    def kernel_shapes(self):
        """q's and k's shapes as the kernels' (batch, heads, rows, d) views see them (what their extents span)."""
        if self.varlen is None or not self.varlen.packed:
            return self.q_shape, self.kv_shape
        return (1, self.heads, self.n_q, self.head_dim), (1, self.kv_heads, self.n_k, self.head_dim)

    def result_strides(self, operand):
        """``Strides`` of a new C-contiguous result shaped like q (``operand="q"``: O, dQ) or k ("kv": dK, dV)."""
        heads, shape = (self.heads, self.q_shape) if operand == "q" else (self.kv_heads, self.kv_shape)
        if self.varlen is not None and self.varlen.packed:  # (total, heads, d): rows heads * d apart, heads d apart
            return Strides(0, self.head_dim if heads > 1 else 0, heads * self.head_dim)
        return view_strides("result", shape, c_strides(shape))

    @property
    def batch_heads(self):
        return self.batch * self.heads

    @property
    def group(self):
        return self.heads // self.kv_heads

    @property
    def precision(self):
        return PRECISION[self.dtype]

    @property
    def on_device(self):
        return self.kind != "host"


def check_algorithm(algorithm, algorithms=ALGORITHMS):
    if algorithm not in algorithms:
        raise ValueError(f"algorithm must be one of {algorithms}, got {algorithm!r}")


def check_loop(algorithm, algorithms, block_sizes, wgmma_tiles):
    """The algorithm whose checks the call takes, one of ``algorithms``: flash2's for "wgmma", which takes no
    block_sizes (its tiles are ``wgmma_tiles``)."""
    check_algorithm(algorithm, algorithms)
    if algorithm != "wgmma":
        return algorithm
    if block_sizes is not None:
        raise ValueError(f"block_sizes must be None with algorithm='wgmma' (its tiles are {wgmma_tiles[0]} x "
                         f"{wgmma_tiles[1]}), got {block_sizes!r}")
    return "flash2"


def check_deterministic(deterministic):
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")


def check_kinds_and_dtypes(q, k, v, algorithm):
    """q, k, v (``Operand``s) of one kind, library, device and dtype, a dtype ``algorithm`` takes."""
    if not q.on_device == k.on_device == v.on_device:
        raise TypeError("q, k and v must all be host arrays (NumPy) or all CUDA arrays, not a mix")
    if len({x.kind for x in (q, k, v)}) > 1:
        raise TypeError(f"q, k and v must be arrays of one library (got {q.kind}, {k.kind}, {v.kind}): results "
                        f"come back as torch tensors for torch inputs, as Numba device arrays otherwise")
    if q.kind == "torch" and not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one CUDA device, got cuda:{q.device}, cuda:{k.device}, "
                         f"cuda:{v.device}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype == "bfloat16" and q.kind == "cuda":
        raise TypeError("q, k, v are bfloat16 Numba/CUDA-interface arrays, which numba-cuda cannot copy or type: "
                        "pass torch tensors (or host arrays, through ml_dtypes)")
    if q.dtype not in DTYPES[algorithm]:
        supported = ", ".join(DTYPES[algorithm])
        hint = " (16-bit inputs need algorithm='flash2')" if q.dtype in DTYPES["flash2"] else ""
        raise TypeError(f"q, k, v have dtype {q.dtype}; algorithm={algorithm!r} supports {supported}{hint}")


def check_grouped_heads(heads, kv_heads, kv_names="k, v"):
    """Query heads must come in whole groups per key/value head (grouped-query attention)."""
    if heads % kv_heads:
        raise ValueError(f"q has {heads} heads and {kv_names} {kv_heads}: grouped-query attention needs the query "
                         f"heads to be a multiple of the key/value heads")


def check_ranks(named, ndim, form):
    """Each (name, ``Operand``) has ``ndim`` dimensions (``form`` names them) and none of them empty."""
    for name, x in named:
        if len(x.shape) != ndim:
            raise ValueError(f"{name} must be {form}, got shape {x.shape}")
        if 0 in x.shape:
            raise ValueError(f"{name} has an empty dimension: shape {x.shape}")


def sixteen_byte_rows(operands, strides, head_dim, dtype):
    """Whether every row of the operands starts on a 16-byte boundary (the kernels' VEC: 16-byte loads)."""
    elements = 4 if dtype == "float32" else 8
    return head_dim % elements == 0 and all(
        x.aligned and all(s % elements == 0 for s in (st.batch, st.head, st.row)) for x, st in zip(operands, strides))


def check_operands(q, k, v, algorithm):
    """Kinds, dtypes and shapes of q, k, v (``Operand``s); returns (batch_shape, heads, kv_heads, n_q, n_k, d)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., N, d), got shape {x.shape}")
        if 0 in x.shape:
            raise ValueError(f"{name} has an empty dimension: shape {x.shape}")
    check_kinds_and_dtypes(q, k, v, algorithm)
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        raise ValueError(f"q, k and v must have the same head dim d, got {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (..., H_kv, N_k, d), got {k.shape} and {v.shape}")
    if len(q.shape) != len(k.shape) or q.shape[:-3] != k.shape[:-3]:
        raise ValueError(f"q, k and v must have equal leading (batch) dims before the heads, "
                         f"got {q.shape[:-2]}, {k.shape[:-2]}, {v.shape[:-2]}")
    heads = q.shape[-3] if len(q.shape) > 2 else 1
    kv_heads = k.shape[-3] if len(k.shape) > 2 else 1
    check_grouped_heads(heads, kv_heads, "k, v have")
    if heads != kv_heads and algorithm != "flash2":
        raise ValueError(f"grouped-query attention ({heads} query heads, {kv_heads} key/value heads) needs "
                         f"algorithm='flash2'; the literal kernels read equal heads")
    return q.shape[:-3], heads, kv_heads, q.shape[-2], k.shape[-2], q.shape[-1]


def operand_strides(name, x, algorithm):
    """(batch, head, row) element strides of a device operand, or a ValueError naming it."""
    if not x.on_device:
        return view_strides(name, x.shape, c_strides(x.shape))
    if x.strides[-1] != 1 and x.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {x.strides}")
    if any(s < 0 for s in x.strides):
        raise ValueError(f"{name} has negative strides {x.strides}; pass a copy")
    if algorithm != "flash2" and not is_c_contiguous(x.shape, x.strides):
        raise ValueError(f"{name} must be C-contiguous for algorithm={algorithm!r} (strides {x.strides} for shape "
                         f"{x.shape}); flash2 takes strided CUDA inputs, or pass a contiguous copy")
    return view_strides(name, x.shape, x.strides)


def check_scale(scale, head_dim):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def check_causal(causal, n_q, n_k):
    """(causal, offset): key j is visible to query i iff j <= i + offset (top-left: 0; bottom-right: N_k - N_q)."""
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal), 0
    if isinstance(causal, str):
        if causal not in CAUSAL_ALIGNMENTS:
            raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")
        return True, (n_k - n_q if causal == "bottom_right" else 0)
    raise TypeError(f"causal must be a bool, 'top_left' or 'bottom_right', got {type(causal).__name__}")


def _check_flash1_blocks(block_rows, block_cols, head_dim, backward):
    limits = device_limits()
    if block_rows > limits.max_threads_per_block:
        raise ValueError(f"block_sizes: B_r={block_rows} exceeds {limits.max_threads_per_block} threads per block "
                         f"(flash1 gives each query row of a block its own thread)")
    needed = (flash1_backward_shared_bytes if backward else flash1_shared_bytes)(block_rows, block_cols, head_dim)
    if needed > limits.shared_bytes_per_block:
        tiles = "Q_i, dO_i, K_j, V_j, dK_j, dV_j, P_ij and dS_ij" if backward else "Q_i, K_j, V_j and S_ij"
        raise ValueError(f"block_sizes {(block_rows, block_cols)} need {needed} bytes of shared memory for "
                         f"{tiles} at d={head_dim}; the limit is {limits.shared_bytes_per_block}")


def _check_flash2_blocks(block_rows, block_cols, head_dim, dtype, backward):
    """One check of flash2 tiles for both passes: warps of 16 rows, mma-wide columns, threads, shared memory."""
    limits = device_limits()
    precision = PRECISION[dtype]
    # The forward streams B_c keys in mma-wide tiles; the backward streams them in tiles of warps too.
    col_step = ROWS_PER_WARP if backward else k_step(precision)
    for name, size, step, why in (("B_r", block_rows, ROWS_PER_WARP, "one warp per 16 rows"),
                                  ("B_c", block_cols, col_step, "the width of the tensor-core tiles")):
        if size % step:
            raise ValueError(f"block_sizes: flash2{' backward' if backward else ''} needs {name} to be a multiple "
                             f"of {step} for {dtype} ({why}), got {size}")
    if flash2_threads(block_rows) > limits.max_threads_per_block:
        raise ValueError(f"block_sizes: B_r={block_rows} needs {flash2_threads(block_rows)} threads per block; "
                         f"the limit is {limits.max_threads_per_block}")
    d_pad = padded_head_dim(head_dim, precision)
    needed = (flash2_backward_shared_bytes(block_rows, block_cols, d_pad, precision) if backward
              else flash2_forward_smem(block_rows, block_cols, d_pad, precision).bytes)
    if needed > limits.shared_bytes_per_block_optin:
        raise ValueError(f"block_sizes {(block_rows, block_cols)} need {needed} bytes of shared memory"
                         f"{' in the flash2 backward' if backward else ''} at d={head_dim} ({dtype}); the limit is "
                         f"{limits.shared_bytes_per_block_optin}")


def check_block_sizes(block_sizes, algorithm, head_dim, n_q, n_k, dtype, backward=False, causal=False):
    """Explicit (B_r, B_c), or the algorithm's default (for the call's dtype and causality); None for 'standard'."""
    if algorithm == "standard":
        if block_sizes is not None:
            raise ValueError("block_sizes applies to the flash algorithms; algorithm='standard' "
                             "materialises S and P and has no (B_r, B_c)")
        return None
    if algorithm == "flash2" and head_dim > FLASH2_MAX_HEAD_DIM:
        raise ValueError(f"head dim d={head_dim} exceeds flash2's maximum of {FLASH2_MAX_HEAD_DIM}")
    if block_sizes is None:
        if algorithm == "flash1":
            if backward:
                return flash1_backward_block_sizes(head_dim, n_q=n_q, n_k=n_k)
            return line1_block_sizes(head_dim, n_q=n_q, n_k=n_k)
        return flash2_default_block_sizes(head_dim, PRECISION[dtype], backward=backward, causal=causal)
    block_rows, block_cols = positive_int_pair("block_sizes", block_sizes)
    if algorithm == "flash1":
        _check_flash1_blocks(block_rows, block_cols, head_dim, backward)
    else:
        _check_flash2_blocks(block_rows, block_cols, head_dim, dtype, backward)
    return block_rows, block_cols


def check_block_mask(block_mask, leading_shape, n_q, n_k):
    """A BlockMask whose layout's leading dims broadcast to q's (batch..., heads) dims."""
    if block_mask is None:
        return None
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a numba_flash.BlockMask or None, got {type(block_mask).__name__}")
    block_mask.check_covers(n_q, n_k)
    leading = block_mask.layout.shape[:-2]
    try:
        broadcast = np.broadcast_shapes(leading, tuple(leading_shape))
    except ValueError:
        broadcast = None
    if broadcast != tuple(leading_shape):
        raise ValueError(f"block_mask: layout leading dims {leading} do not broadcast to the batch and head dims "
                         f"{tuple(leading_shape)} of q")
    return block_mask


def check_dropout(dropout_p, seed):
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer, got {type(seed).__name__}")
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a number, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def check_attention_args(q, k, v, *, causal, scale, block_mask, dropout_p, seed, algorithm, block_sizes,
                         backward=False):
    """Validate a call to ``attention`` (or the shared part of ``attention_backward``); q, k, v are ``Operand``s."""
    check_algorithm(algorithm, BACKWARD_ALGORITHMS if backward else ALGORITHMS)
    batch_shape, heads, kv_heads, n_q, n_k, head_dim = check_operands(q, k, v, algorithm)
    strides = tuple(operand_strides(name, x, algorithm) for name, x in (("q", q), ("k", k), ("v", v)))
    is_causal, offset = check_causal(causal, n_q, n_k)
    scale = check_scale(scale, head_dim)
    dropout_p = check_dropout(dropout_p, seed)
    leading = q.shape[:-2]
    block_mask = check_block_mask(block_mask, leading, n_q, n_k)
    if block_mask is not None and algorithm == "flash1":
        # Algorithm 5 as written: the kernel's tiles are the mask's blocks.
        if block_sizes is not None and tuple(block_sizes) != block_mask.block_size:
            raise ValueError(f"block_sizes {tuple(block_sizes)} differ from the block mask's {block_mask.block_size}; "
                             f"flash1 runs Algorithm 5 with tiles equal to the mask's blocks")
        try:
            block_sizes = check_block_sizes(block_mask.block_size, algorithm, head_dim, n_q, n_k, q.dtype, backward,
                                            is_causal)
        except ValueError as exc:
            raise ValueError(f"block_mask: flash1 runs Algorithm 5 with tiles equal to the mask's blocks "
                             f"{block_mask.block_size}, and they cannot: {exc}; use algorithm='flash2' (any "
                             f"mask with any tiles) or smaller mask blocks") from None
    else:
        block_sizes = check_block_sizes(block_sizes, algorithm, head_dim, n_q, n_k, q.dtype, backward, is_causal)
    vec = sixteen_byte_rows((q, k, v), strides, head_dim, q.dtype)
    return AttentionCall(algorithm, tuple(batch_shape), heads, kv_heads, n_q, n_k, head_dim, q.dtype, scale,
                         is_causal, offset, block_sizes, q.kind, tuple(q.shape), tuple(k.shape), strides, vec,
                         block_mask, dropout_p)


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k):
    """Host copies (int64 NumPy) of a packed batch's sequence bounds, checked against the packed totals.

    Sequence b is rows cu[b] .. cu[b + 1] - 1: each array starts at 0, never decreases (empty sequences
    are allowed) and ends at its total; both describe the same number of sequences.
    """
    bounds = []
    for name, x, total, operand in (("cu_seqlens_q", cu_seqlens_q, total_q, "q"),
                                    ("cu_seqlens_k", cu_seqlens_k, total_k, "k and v")):
        if x.ndim != 1 or x.size < 2:
            raise ValueError(f"{name} must be 1-D with one entry per sequence plus one (batch + 1 >= 2), got shape "
                             f"{x.shape}")
        if not np.issubdtype(x.dtype, np.integer):
            raise TypeError(f"{name} must hold integers (int32, as flash-attn's), got {x.dtype}")
        x = x.astype(np.int64)
        if x[0] != 0:
            raise ValueError(f"{name} must start at 0, got {x[0]}")
        steps = np.diff(x)
        if np.any(steps < 0):
            at = int(np.argmax(steps < 0))
            raise ValueError(f"{name} must not decrease (sequence b is rows {name}[b] .. {name}[b + 1] - 1), but "
                             f"{name}[{at}] = {x[at]} > {name}[{at + 1}] = {x[at + 1]}")
        if x[-1] != total:
            raise ValueError(f"{name} must end at the {total} rows of {operand} (total, heads, d), got {x[-1]}")
        bounds.append(x)
    if bounds[0].size != bounds[1].size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
                         f"{bounds[0].size - 1} and {bounds[1].size - 1}")
    return tuple(bounds)


def check_causal_varlen(causal):
    """(causal, bottom_right) for a packed batch: True aligns each sequence's mask bottom-right, as flash-attn."""
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal), bool(causal)
    if isinstance(causal, str):
        if causal not in CAUSAL_ALIGNMENTS:
            raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")
        return True, causal == "bottom_right"
    raise TypeError(f"causal must be a bool, 'top_left' or 'bottom_right', got {type(causal).__name__}")


def check_varlen_args(q, k, v, lengths, *, causal, scale, dropout_p, seed, block_sizes, backward=False):
    """Validate a packed (variable-length) call: q (total_q, H_q, d), k, v (total_k, H_kv, d) ``Operand``s;
    ``lengths`` = (sequences, longest query sequence, longest key sequence), from ``check_cu_seqlens``."""
    check_ranks((("q", q), ("k", k), ("v", v)), 3, "packed as (total, heads, d) for variable-length attention")
    check_kinds_and_dtypes(q, k, v, "flash2")
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        raise ValueError(f"q, k and v must have the same head dim d, got {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (total_k, H_kv, d), got {k.shape} and {v.shape}")
    (total_q, heads, head_dim), (total_k, kv_heads, _) = q.shape, k.shape
    check_grouped_heads(heads, kv_heads, "k, v have")
    strides = [_packed_strides(name, x) for name, x in (("q", q), ("k", k), ("v", v))]
    is_causal, bottom_right = check_causal_varlen(causal)
    scale = check_scale(scale, head_dim)
    dropout_p = check_dropout(dropout_p, seed)
    batch, longest_q, longest_k = lengths
    block_sizes = check_block_sizes(block_sizes, "flash2", head_dim, longest_q, longest_k, q.dtype, backward,
                                    is_causal)
    vec = sixteen_byte_rows((q, k, v), strides, head_dim, q.dtype)   # packed: batch stride 0
    return AttentionCall("flash2", (batch,), heads, kv_heads, total_q, total_k, head_dim, q.dtype, scale, is_causal,
                         0, block_sizes, q.kind, tuple(q.shape), tuple(k.shape), tuple(strides), vec, None, dropout_p,
                         Varlen(batch, longest_q, longest_k, bottom_right, lse_strides=(0, total_q),
                                q_bounds_size=batch + 1, k_bounds_size=batch + 1))


def check_block_table(block_table, q, k_cache):
    """A paged cache's ``Paging`` from its block table (an ``Operand``: int32 (B, max_pages), on the host or a GPU
    array of q's kind) and the pool k_cache (pages, H_kv, page_size, d), or an error naming the argument.  Its
    values are checked per call (``check_block_table_pages``), where the table and the lengths are on the host."""
    batch = q.shape[0]
    if block_table.on_device and block_table.kind != q.kind:
        raise TypeError(f"block_table is a {block_table.kind} array on the GPU and q a {q.kind} array: pass a table "
                        f"of q's kind, or one on the host")
    if len(block_table.shape) != 2 or 0 in block_table.shape:
        raise ValueError(f"block_table must be (batch, max_pages) with max_pages >= 1, got shape {block_table.shape}")
    if block_table.dtype != "int32":
        raise TypeError(f"block_table must be int32 (as flash-attn's), got {block_table.dtype}")
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table must have one row per batch entry ({batch}), got shape {block_table.shape}")
    max_pages = block_table.shape[1]
    stride = max_pages
    if block_table.on_device:
        row_stride, column_stride = block_table.strides
        if (column_stride != 1 and max_pages > 1) or row_stride < 0 or block_table.device != q.device:
            raise ValueError(f"block_table on the GPU must have contiguous rows (strides (s, 1)) on q's device "
                             f"({q.device}), got strides {block_table.strides} on device {block_table.device}")
        stride = row_stride
    page_size = k_cache.shape[2]
    if not (PAGE_ROWS_MIN <= page_size <= PAGE_ROWS_MAX and page_size % PAGE_ROWS_STEP == 0):
        raise ValueError(f"k_cache: with a block_table the caches are pools (pages, H_kv, page_size, d) whose page "
                         f"size is a multiple of {PAGE_ROWS_STEP} from {PAGE_ROWS_MIN} to {PAGE_ROWS_MAX}, got "
                         f"{page_size} (shape {k_cache.shape})")
    return Paging(page_size, k_cache.shape[0], max_pages, stride, (batch - 1) * stride + max_pages)


def check_block_table_pages(block_table, lengths, paging):
    """Every page that a host block table names for keys 0 .. lengths[b] - 1 of entry b lies in the pool."""
    used = np.arange(paging.max_pages) < (lengths[:, None] + paging.page_size - 1) // paging.page_size
    outside = used & ((block_table < 0) | (block_table >= paging.pages))
    if outside.any():
        b, i = (int(x) for x in np.argwhere(outside)[0])
        first, last = i * paging.page_size, min(lengths[b], (i + 1) * paging.page_size) - 1
        raise ValueError(f"block_table[{b}, {i}] = {block_table[b, i]} is no page of the pool's {paging.pages} "
                         f"(0 .. {paging.pages - 1}), and entry {b} keeps its keys {first} .. {last} there")


def check_cache_args(q, k_cache, v_cache, k_new, v_new, *, causal, scale, block_sizes, num_splits, kv_stages=0,
                     block_table=None):
    """Validate a decoding call's arrays and options (``attention_with_kv_cache``): q (B, H_q, N_q, d), the caches
    (B, H_kv, N_max, d), or with ``block_table`` (an ``Operand``, ``check_block_table``) pools (pages, H_kv,
    page_size, d), k_new and v_new (B, H_kv, N_new, d) or None (``Operand``s), ``num_splits`` a non-negative int (0:
    chosen by the library), ``kv_stages`` 0 (the library's) or the K/V buffers wanted (at least 2); whether the
    buffers and key warps fit the call is ``check_decode_layout``'s question.  The lengths (and a host table's
    pages) are checked per call by ``check_cache_seqlens`` (and ``check_block_table_pages``).

    Returns the call the kernels run.  Grouped heads (``decode_plan.packs``: one query per head, or q's heads N_q
    rows apart) run as H_kv heads of group * N_q query rows each (q viewed as (B, H_kv, group * N_q,
    d): row g N_q + i is query i of the group's head g; with one query the heads are the rows, ``q_sh`` apart), so
    that each key/value tile is read once per group; ``call.q_shape`` is that view (its C order is q's), and
    ``call.varlen.head_queries`` is N_q.  Other strides keep a tile per query head (each reads the group's K/V).
    """
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    if k_new is not None:
        named += [("k_new", k_new), ("v_new", v_new)]
    check_ranks(named, 4, "(batch, heads, N, d)")
    for name, x in named[1:]:
        if x.on_device != q.on_device or x.kind != q.kind:
            raise TypeError(f"{name} must be the same kind of array as q ({q.kind}), got {x.kind}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    check_kinds_and_dtypes(q, k_cache, v_cache, "flash2")
    if type(num_splits) is not int:   # bool is no count of splits
        raise TypeError(f"num_splits must be an int (0: chosen by the library), got {num_splits!r}")
    if num_splits < 0:
        raise ValueError(f"num_splits must not be negative (0: chosen by the library), got {num_splits}")
    if type(kv_stages) is not int:
        raise TypeError(f"kv_stages must be an int (0: chosen by the library), got {kv_stages!r}")
    if kv_stages < 0 or kv_stages == 1:
        raise ValueError(f"kv_stages must be 0 (chosen by the library) or at least 2 buffers, got {kv_stages}")
    batch, heads, n_q, head_dim = q.shape
    _, kv_heads, n_max, _ = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {k_cache.shape} and {v_cache.shape}")
    paging = None if block_table is None else check_block_table(block_table, q, k_cache)
    if paging is not None:
        n_max = paging.keys   # the keys an entry's row of the table can hold
        if k_cache.shape[3] != head_dim:
            raise ValueError(f"the caches must be pools (pages, H_kv, page_size, d={head_dim}) like q, got "
                             f"{k_cache.shape}")
    elif k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
        raise ValueError(f"the caches must be (batch={batch}, H_kv, N_max, d={head_dim}) like q, got {k_cache.shape}")
    if k_new is not None:
        if k_new.shape != v_new.shape:
            raise ValueError(f"k_new and v_new must have one shape, got {k_new.shape} and {v_new.shape}")
        if k_new.shape[:2] != (batch, kv_heads) or k_new.shape[3] != head_dim:
            raise ValueError(f"k_new must be (batch={batch}, H_kv={kv_heads}, N_new, d={head_dim}), got "
                             f"{k_new.shape}")
    check_grouped_heads(heads, kv_heads, "the caches")
    strides = [operand_strides(name, x, "flash2") for name, x in named[:3]]
    is_causal, bottom_right = check_causal_varlen(causal)
    scale = check_scale(scale, head_dim)
    group = heads // kv_heads
    q_shape = (batch, heads, n_q, head_dim)
    if n_q == 1 and (bottom_right or not is_causal):
        is_causal = False   # one query at the end of the cache sees every key
    head_queries = 0
    if packs(heads, kv_heads, n_q, strides[0].head == n_q * strides[0].row):
        # the group's queries share the rows of one tile: row g N_q + i at g q_sh + i q_sn = (g N_q + i) q_sn
        head_queries = n_q
        row = strides[0].head if n_q == 1 else strides[0].row
        q_shape, n_q, heads = (batch, kv_heads, group * n_q, head_dim), group * n_q, kv_heads
        strides[0] = Strides(strides[0].batch, strides[0].head * group, row)
    if head_dim > FLASH2_MAX_HEAD_DIM:
        raise ValueError(f"head dim d={head_dim} exceeds flash2's maximum of {FLASH2_MAX_HEAD_DIM}")
    if block_sizes is None:
        block_sizes = decode_default_block_sizes(n_q, head_dim, PRECISION[q.dtype])
        if paging is not None:
            block_sizes = (block_sizes[0], page_key_tile(block_sizes[1], paging.page_size, PRECISION[q.dtype]))
    block_sizes = check_block_sizes(block_sizes, "flash2", head_dim, n_q, n_max, q.dtype, False, is_causal)
    if paging is not None and paging.page_size % block_sizes[1]:
        raise ValueError(f"block_sizes {block_sizes}: each key tile must lie in one page of a paged cache, so B_c "
                         f"must divide the page size {paging.page_size}")
    vec = sixteen_byte_rows((q, k_cache, v_cache), strides, head_dim, q.dtype)
    sequences = Varlen(batch, n_q, n_max, bottom_right, q_step=0, k_step=0, lse_strides=(heads * n_q, n_q),
                       k_bounds_size=batch, packed=False, kv_cache=True,
                       new_keys=0 if k_new is None else k_new.shape[2], paging=paging, head_queries=head_queries)
    return AttentionCall("flash2", (batch,), heads, kv_heads, n_q, n_max, head_dim, q.dtype, scale, is_causal, 0,
                         block_sizes, q.kind, q_shape, tuple(k_cache.shape), tuple(strides), vec, None, 0.0,
                         sequences)


def streamed(call):
    """Whether a decoding call's K/V tiles travel by cp.async into several buffers (16-bit tiles whose rows start
    on 16-byte boundaries); otherwise they wait in registers, one tile ahead."""
    return call.precision != "tf32x3" and call.vec


def check_decode_layout(call, kv_stages, key_warps):
    """(K/V buffers, key warps) for a decoding call checked by ``check_cache_args``: those asked for, or the
    library's where 0 (``tiling.DECODE_KV_STAGES``, ``tiling.DECODE_KEY_WARPS``, fewer warps where they do not fit).

    Several buffers need tiles that travel by cp.async (16-bit, rows on 16-byte boundaries); key warps also need
    a tile of one warp's rows (forward.py's KEY_WARPS); and what is asked for must fit in shared memory."""
    if type(key_warps) is not int:
        raise TypeError(f"key_warps must be an int (0: chosen by the library), got {key_warps!r}")
    if key_warps < 0:
        raise ValueError(f"key_warps must not be negative (0: chosen by the library), got {key_warps}")
    streams = streamed(call)
    block_m, block_n = call.block_sizes
    if kv_stages and not streams:
        raise ValueError(f"kv_stages={kv_stages}: only 16-bit tiles whose rows start on 16-byte boundaries travel "
                         "by cp.async into several buffers (these go through registers, one tile ahead); leave "
                         "kv_stages at 0")
    one_warp = block_m <= ROWS_PER_WARP
    if key_warps > 1 and not (streams and one_warp):
        raise ValueError(f"key_warps={key_warps}: warps take turns along the keys only for 16-bit tiles whose rows "
                         f"start on 16-byte boundaries, of at most {ROWS_PER_WARP} query rows (block_sizes "
                         f"{tuple(call.block_sizes)}, {call.dtype}); leave key_warps at 0")
    stages = kv_stages or DECODE_KV_STAGES
    d_pad = padded_head_dim(call.head_dim, call.precision)
    limit = device_limits().shared_bytes_per_block_optin

    def needed(warps):
        return flash2_forward_smem(block_m, block_n, d_pad, call.precision, stages=stages if streams else 1,
                                   key_warps=warps).bytes

    if key_warps or kv_stages:
        warps = key_warps or 1
        if needed(warps) > limit:
            raise ValueError(f"kv_stages={kv_stages}, key_warps={key_warps} at block_sizes {tuple(call.block_sizes)}, "
                             f"d={call.head_dim}: the buffers need {needed(warps)} bytes of shared memory; the limit "
                             f"is {limit}")
        if key_warps:
            return stages, warps
    if streams and one_warp:
        return stages, fitting_key_warps(call.block_sizes, call.head_dim, 2, stages, limit)
    return stages, 1


def check_new_keys(k_new, v_new):
    """New keys come with their values, or neither comes."""
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together (the new keys and their values), or neither")


def check_cache_seqlens(cache_seqlens, batch, n_new, n_max, paging=None):
    """The keys each cache entry holds after appending ``n_new``, from a host integer array, or a ValueError; an
    entry holds at most ``n_max`` keys (a paged cache's: ``paging.keys``)."""
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must have one length per batch entry, shape ({batch},), got "
                         f"{cache_seqlens.shape}")
    if not np.issubdtype(cache_seqlens.dtype, np.integer):
        raise TypeError(f"cache_seqlens must hold integers (int32, as flash-attn's), got {cache_seqlens.dtype}")
    if np.any(cache_seqlens < 0):
        raise ValueError(f"cache_seqlens must not be negative, got {cache_seqlens.tolist()}")
    lengths = cache_seqlens.astype(np.int64) + n_new
    if np.any(lengths > n_max):
        b = int(np.argmax(lengths > n_max))
        room = (f"the caches' {n_max} rows" if paging is None else
                f"the {paging.max_pages} pages of {paging.page_size} rows of its block_table row")
        raise ValueError(f"cache overflow: cache_seqlens[{b}] = {cache_seqlens[b]} keys and {n_new} new ones do not "
                         f"fit in {room}")
    return lengths


def check_device_cache_seqlens(lengths, call, device):
    """cache_seqlens that stay on the GPU (an ``Operand``): their kind, shape, dtype and layout against the
    validated call on ``device``.  Their values are the kernels' to check (``kernels/fast/cache.py``: an
    entry out of range gets NaN)."""
    batch = call.batch
    if lengths.kind != call.kind:
        raise TypeError(f"cache_seqlens on the GPU must be a {call.kind} array like q (or a host array), "
                        f"got a {lengths.kind} one")
    if lengths.shape != (batch,):
        raise ValueError(f"cache_seqlens must have one length per batch entry, shape ({batch},), got "
                         f"{lengths.shape}")
    if lengths.dtype != "int32":
        raise TypeError(f"cache_seqlens on the GPU must be int32 (as flash-attn's), got {lengths.dtype}")
    if lengths.device != device or (batch > 1 and lengths.strides != (1,)):
        raise ValueError(f"cache_seqlens on the GPU must be a contiguous array on q's device ({device})")


def check_backward_operands(call, o, lse, do):
    """o, lse, do (``Operand``s) against a validated backward call: kind, shape, dtype, strides."""
    lse_shape = (call.heads, call.n_q) if call.varlen else call.q_shape[:-1]
    for name, x, shape, dtype in (("o", o, call.q_shape, call.dtype), ("do", do, call.q_shape, call.dtype),
                                  ("lse", lse, lse_shape, "float32")):
        if x.on_device != call.on_device or (x.on_device and x.kind != call.kind):
            raise TypeError(f"{name} must be a {call.kind} array like q, k and v")
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
        if x.dtype != dtype:
            raise TypeError(f"{name} must have dtype {dtype}, got {x.dtype}")
    if call.on_device and not is_c_contiguous(lse.shape, lse.strides):
        raise ValueError(f"lse must be C-contiguous (strides {lse.strides} for shape {lse.shape})")
    if call.varlen:
        return tuple(_packed_strides(name, x) for name, x in (("o", o), ("do", do)))
    return tuple(operand_strides(name, x, call.algorithm) for name, x in (("o", o), ("do", do)))


def _packed_strides(name, x):
    """``Strides`` of a packed (total, heads, d) operand: no batch stride (cu_seqlens place the sequences)."""
    rows, head, last = x.strides if x.on_device else c_strides(x.shape)
    if last != 1 and x.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {x.strides}")
    if rows < 0 or head < 0:
        raise ValueError(f"{name} has negative strides {x.strides}; pass a copy")
    return Strides(0, head if x.shape[1] > 1 else 0, rows)


__all__ = ["ALGORITHMS", "AttentionCall", "FORWARD_ALGORITHMS", "Operand", "PRECISION", "Paging", "Strides",
           "VARLEN_ALGORITHMS", "Varlen", "check_attention_args", "check_backward_operands", "check_block_sizes",
           "check_block_table", "check_block_table_pages", "check_cache_args", "check_cache_seqlens",
           "check_deterministic", "check_loop",
           "check_decode_layout", "check_device_cache_seqlens", "check_new_keys", "check_cu_seqlens", "check_varlen_args"]


# ---------------------------------------------------------------- score_mod / mask_mod (numba_flash/mods.py)

#: Element types a mod's arrays may have (what Numba and the kernels' parameter slots take).
MOD_ARRAY_DTYPES = ("float32", "float64", "int32", "int64", "uint8", "int8", "int16", "uint32", "bool")
_CHECKED_MODS = {}


def _numba_reason(exc):
    """Numba's message, without its long traceback-like tail of frames."""
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("During:")]
    return "\n    ".join(lines[:12])


def _check_compiles(mod, kind):
    """Compile ``mod``'s step on the CPU for its argument types (the kernels' scalars are float32 and int64): a
    TypeError naming it and quoting Numba's reason if Numba cannot, or if it returns something other than a scalar
    (a number for a score_mod, a bool for a mask_mod).  Cached per function and array types."""
    import numba
    from numba import types

    key = (kind, mod.signature)
    if key in _CHECKED_MODS:
        return
    from .mods import jitable

    arrays = []
    for i, a in enumerate(mod.arrays):
        dtype = str(a.dtype).replace("torch.", "")
        if dtype not in MOD_ARRAY_DTYPES:
            raise TypeError(f"{kind} {mod.name}: array {i} has dtype {dtype}; mods read arrays of "
                            f"{', '.join(MOD_ARRAY_DTYPES)}")
        arrays.append(types.Array(numba.from_dtype(np.dtype(dtype)), len(a.shape), "C"))
    scalars = ((types.float32,) if kind == "score_mod" else ()) + (types.int64,) * 4
    fn = jitable(mod.fn)
    try:
        dispatcher = numba.njit(fn)
        dispatcher.compile(scalars + tuple(arrays))
    except Exception as exc:  # numba.core.errors.TypingError and friends
        raise TypeError(f"{kind} {mod.name}: Numba cannot compile it for (scalars, arrays) = "
                        f"({', '.join(map(str, scalars + tuple(arrays)))}):\n    {_numba_reason(exc)}") from None
    result = dispatcher.nopython_signatures[-1].return_type
    if kind == "score_mod" and not isinstance(result, (types.Float, types.Integer)):
        raise TypeError(f"score_mod {mod.name} returns {result}, not a scalar number")
    if kind == "mask_mod" and not isinstance(result, (types.Boolean, types.Integer)):
        raise TypeError(f"mask_mod {mod.name} returns {result}, not a bool")
    _CHECKED_MODS[key] = True


def check_mods(score_mod, mask_mod, *, algorithm, backward=False, varlen=False):
    """The (score_mod, mask_mod) of a call as checked ``Mod``s, or None for neither; TypeError for a bad mod (wrong
    arity, arrays that are not arrays, a function Numba cannot compile, a non-scalar result, a derivative that
    cannot be traced in a backward), ValueError for a call outside the mods' scope -- all before any launch."""
    from .mods import MAX_MOD_ARRAYS, as_mod, derivative

    if score_mod is None and mask_mod is None:
        return None
    score_mod, mask_mod = as_mod(score_mod, "score_mod"), as_mod(mask_mod, "mask_mod")
    if algorithm not in ("flash2", "wgmma"):
        raise ValueError(f"score_mod/mask_mod run on algorithm='flash2' or 'wgmma', not {algorithm!r}")
    if varlen and algorithm == "wgmma":
        raise ValueError("score_mod/mask_mod on packed sequences run on algorithm='flash2' (the mma.sync kernels), "
                         "not 'wgmma' yet")
    count = sum(len(m.arrays) for m in (score_mod, mask_mod) if m is not None)
    if count > MAX_MOD_ARRAYS:
        raise ValueError(f"score_mod and mask_mod read {count} arrays together; the kernels take at most "
                         f"{MAX_MOD_ARRAYS} (stack tables into one array)")
    for kind, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if mod is not None:
            _check_compiles(mod, kind)
    if backward and score_mod is not None:
        if score_mod.grad is not None:
            _check_compiles(type(score_mod)(score_mod.grad, *score_mod.arrays, name=f"grad of {score_mod.name}"),
                            "score_mod")
        else:
            derivative(score_mod)   # TypeError asking for grad= when the tracer cannot follow it
    return (score_mod, mask_mod)


def mod_extents(call):
    """(query heads, query positions, key positions) that a call's mods may see: the batched call's H_q, N_q, N_k; a
    packed call's longest sequences; a KV cache's N_max for both (query i of entry b is at position L_b - N_q + i),
    its query heads unpacked (``Varlen.head_queries``)."""
    sequences = call.varlen
    if sequences is None:
        return call.heads, call.n_q, call.n_k
    if sequences.kv_cache:
        packed = call.n_q // sequences.head_queries if sequences.head_queries else 1
        return call.heads * packed, call.n_k, call.n_k
    return call.heads, sequences.longest_q, sequences.longest_k


def check_mod_shapes(mods, call):
    """ValueError if a mod's arrays do not fit the call (a built-in's ``Mod.fits``, for ``mod_extents``: the kernels
    read them unchecked); ``call`` with ``mods`` attached, or ``call`` itself without mods."""
    if not mods:
        return call
    from dataclasses import replace

    for mod in mods:
        problem = mod.fits(*mod_extents(call)) if mod is not None and mod.fits else None
        if problem:
            raise ValueError(f"{mod.kind} {mod.name}: {problem}")
    return replace(call, mods=mods)
