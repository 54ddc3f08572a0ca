"""Algorithm 1, line 1: choosing the block sizes B_r and B_c from the SRAM size M.

The paper sets B_c = ceil(M / 4d) and B_r = min(ceil(M / 4d), d), with M
counted in *elements*.  The 4 makes room for four d-wide tiles of that many
rows; in our literal kernel those are Q_i, K_j, V_j and the B_r x B_c score
tile S_ij (B_r <= d makes S_ij no larger than one d-wide tile of B_c rows).

Hardware and problem limits then clamp the result, each for a stated reason:

* **N**: a tile taller than the sequence only wastes SRAM, so B_r <= N_q
  and B_c <= N_k.
* **SRAM**: the ceilings can overshoot M by a few elements; we shrink B_c
  (then B_r) until Q_i, K_j, V_j and S_ij fit in M.
* **threads per block**: the literal kernel gives each row of Q_i its own
  thread, so B_r <= the device's maximum threads per block (1024).  Since
  B_r <= d this only bites for head dims above 1024.
"""
import math

import numpy as np

from .runtime.device import device_limits


def flash1_sram_elements(block_rows, block_cols, head_dim):
    """Elements the literal kernel keeps in shared memory: Q_i, K_j, V_j and S_ij."""
    return (block_rows + 2 * block_cols) * head_dim + block_rows * block_cols


def line1_block_sizes(head_dim, *, sram_bytes=None, dtype=np.float32, n_q=None, n_k=None):
    """(B_r, B_c) by Algorithm 1, line 1, clamped as the module docstring explains.

    sram_bytes: the SRAM budget M in bytes; default: the shared memory one
    thread block may use on the current device without opting in (48 KiB on
    recent NVIDIA GPUs).  dtype: element type, which converts bytes to
    elements.  n_q, n_k: sequence lengths, for the N clamp (optional).
    """
    if head_dim < 1:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    limits = device_limits()
    if sram_bytes is None:
        sram_bytes = limits.shared_bytes_per_block
    m_elements = int(sram_bytes) // np.dtype(dtype).itemsize
    if m_elements < 4 * head_dim:
        raise ValueError(f"sram_bytes={sram_bytes} holds {m_elements} elements, fewer than the "
                         f"4*d = {4 * head_dim} that one row each of Q_i, K_j, V_j and S_ij need")

    block_cols = math.ceil(m_elements / (4 * head_dim))
    block_rows = min(math.ceil(m_elements / (4 * head_dim)), head_dim)

    block_rows = min(block_rows, limits.max_threads_per_block)
    if n_q is not None:
        block_rows = max(1, min(block_rows, n_q))
    if n_k is not None:
        block_cols = max(1, min(block_cols, n_k))
    while flash1_sram_elements(block_rows, block_cols, head_dim) > m_elements:
        if block_cols > 1:
            block_cols -= 1
        else:
            block_rows -= 1
    return block_rows, block_cols


def flash1_backward_sram_elements(block_rows, block_cols, head_dim):
    """Elements the literal backward keeps in shared memory: Q_i, dO_i, K_j, V_j, dK_j, dV_j, P_ij, dS_ij."""
    return (2 * block_rows + 4 * block_cols) * head_dim + 2 * block_rows * block_cols


def flash1_backward_block_sizes(head_dim, *, sram_bytes=None, dtype=np.float32, n_q=None, n_k=None):
    """(B_r, B_c) for Algorithm 4: line 1's blocks, shrunk until the backward's tiles fit.

    The backward keeps twice as many tiles on chip as the forward (Q_i, dO_i,
    K_j, V_j, dK_j, dV_j, P_ij, dS_ij), so line 1's sizes do not fit; we
    shrink B_c and B_r alternately (keeping them balanced) until they do.
    """
    m_elements = int(device_limits().shared_bytes_per_block if sram_bytes is None else sram_bytes)
    m_elements //= np.dtype(dtype).itemsize
    block_rows, block_cols = line1_block_sizes(head_dim, sram_bytes=sram_bytes, dtype=dtype, n_q=n_q, n_k=n_k)
    while flash1_backward_sram_elements(block_rows, block_cols, head_dim) > m_elements:
        if block_cols >= block_rows and block_cols > 1:
            block_cols -= 1
        elif block_rows > 1:
            block_rows -= 1
        else:
            raise ValueError(f"head dim {head_dim} is too large for the backward's tiles in {m_elements} elements")
    return block_rows, block_cols
