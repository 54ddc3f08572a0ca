"""The gradient of attention into ``mods.relative_position_bias``'s table, on torch ops (for ``numba_flash.torch``,
where the backward's kernels do not sum it: packed sequences, the modes that sum dQ in the dK/dV kernel, tables
wider than the dQ kernels take; elsewhere the dQ kernels do, ``kernels/fast/bias_table.py``).

With t_ij = scale q_i k_j + bias[h, clamp(j - i, -D, D) + D] and P = softmax(t) over the allowed keys, d L / d bias[h,
c] is the sum of dT = P o (dP - D) over the entries (i, j) of head h, every batch entry, whose clamped distance is c
(dP = dO V^T, D = rowsum(dO o O)).  The mma.sync kernels keep no dT, so this computes it again, a block of query rows
at a time, in float32 (P from q, k, the table and the forward's lse), and sums each block's diagonals with the skew
trick (``diagonal_sums``: row r moved r places along, then a column sum).  Every sum runs in a fixed order, so the
gradient has the same bits run to run.  Cost: two float32 products of N_q x N_k x d per head beyond the kernels'
backward, and a block of (B, H, rows, N_k) float32 scores at a time (``BLOCK_ENTRIES``).
"""
from ._torch_calls import torch
from .mods import Mod, relative_bias_reach

#: Scores of one block of query rows, over batch and heads (float32, a few such arrays live at once).
BLOCK_ENTRIES = 1 << 24


def diagonal_sums(x):
    """x (..., C, N) -> (..., N + C - 1): entry m the sum of x[..., r, r + m - (C - 1)] over the rows r where that
    column exists, in row order (the diagonals of distance j - r = m - (C - 1), lowest first)."""
    *lead, rows, cols = x.shape
    skewed = torch.nn.functional.pad(x.flip(-2), (0, rows))              # row C - 1 - r, then C zeros
    flat = skewed.reshape(*lead, rows * (cols + rows))[..., :rows * (cols + rows - 1)]
    return flat.reshape(*lead, rows, cols + rows - 1).sum(-2)


def binned(sums, first_distance, reach):
    """Diagonal sums (..., M), entry m of distance first_distance + m, added into the 2 reach + 1 bins of the clamped
    distance (the edges take every distance beyond them): (..., 2 reach + 1)."""
    m = sums.shape[-1]
    low, high = -reach - first_distance, reach - first_distance        # entries of distance -reach and reach
    inner = sums[..., max(low, 0):max(min(high + 1, m), 0)]
    bins = sums.new_zeros(sums.shape[:-1] + (2 * reach + 1,))
    start = max(first_distance, -reach) + reach
    bins[..., start:start + inner.shape[-1]] = inner
    if low > 0:
        bins[..., 0] += sums[..., :min(low, m)].sum(-1)
    if high < m - 1:
        bins[..., -1] += sums[..., max(high + 1, 0):].sum(-1)
    return bins


def table_gradient(q, k, v, out, lse, grad_out, table, scale, causal, allowed_blocks):
    """d L / d table for attention(q, k, v, score_mod=relative_position_bias(table), causal=causal) with
    (..., H, N, d) tensors (GQA: k, v with H / group heads), lse the forward's (natural log), out its output and
    grad_out dL/dO; ``allowed_blocks``: a block mask's dense (..., N_q, N_k) booleans as a torch tensor, or None.
    Returns a float32 tensor of the table's shape, on the table's device."""
    q, k, v, out, grad_out = (x.reshape((-1,) + tuple(x.shape[-3:])) if x.dim() > 2 else x[None, None]
                              for x in (q, k, v, out, grad_out))
    lse = (lse.reshape((-1,) + tuple(lse.shape[-2:])) if lse.dim() > 1 else lse[None, None]).float()
    batch, heads, n_q, _ = q.shape
    n_k = k.shape[-2]
    group = heads // k.shape[1]
    keys, values = (x.float().repeat_interleave(group, 1) for x in (k, v))
    bias = table.detach().float().to(q.device)
    reach = (bias.shape[1] - 1) // 2
    scale = float(scale if scale is not None else q.shape[-1] ** -0.5)
    column = torch.arange(n_k, device=q.device)
    step = max(1, min(n_q, BLOCK_ENTRIES // max(1, batch * heads * n_k)))
    gradient = torch.zeros_like(bias)
    for first in range(0, n_q, step):
        rows = torch.arange(first, min(first + step, n_q), device=q.device)
        distance = (column[None, :] - rows[:, None]).clamp(-reach, reach) + reach     # (C, N_k)
        scores = torch.matmul(q[:, :, rows].float(), keys.transpose(-1, -2)) * scale + bias[:, distance]
        allowed = torch.ones_like(distance, dtype=torch.bool)
        if causal:
            allowed = column[None, :] <= rows[:, None] + (0 if causal is True else n_k - n_q)
        if allowed_blocks is not None:
            allowed = allowed & allowed_blocks[..., rows, :].to(q.device)
        row_lse = lse[:, :, rows, None]
        weights = torch.where(allowed & torch.isfinite(row_lse), torch.exp(scores - row_lse), 0.0)
        do = grad_out[:, :, rows].float()
        d_rows = (do * out[:, :, rows].float()).sum(-1, keepdim=True)
        d_scores = weights * (torch.matmul(do, values.transpose(-1, -2)) - d_rows)
        sums = diagonal_sums(d_scores).sum(0)                    # (H, N_k + C - 1), batch entries in order
        gradient += binned(sums, -(first + len(rows) - 1), reach)
    return gradient.to(table.device)


def learned_table(score_mod, mask_mod, dropout_p, grad_mode=True):
    """The relative_position_bias table of this call that needs a gradient (a torch tensor that requires grad, with
    grad enabled), or None; a TypeError for a mod array that requires grad where none is computed.  ``grad_mode``
    False: whatever the grad mode (an autograd formula's setup, which AOTAutograd traces without grad)."""
    if grad_mode and not torch.is_grad_enabled():
        return None
    for mod in (score_mod, mask_mod):
        for i, array in enumerate(mod.arrays if isinstance(mod, Mod) else ()):
            if not (isinstance(array, torch.Tensor) and array.requires_grad):
                continue
            if mod is score_mod and relative_bias_reach(mod) is not None and mask_mod is None and not dropout_p:
                return array
            raise TypeError(f"mod {mod.name}: array {i} requires grad, but gradients into a mod's arrays are computed "
                            f"only for relative_position_bias's table, as the only mod, without dropout (detach the "
                            f"array, or compute this gradient another way)")
    return None
