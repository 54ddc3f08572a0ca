"""Ring attention (context parallelism): one sequence's attention across the ranks of a torch.distributed group.

Liu, Zaharia and Abbeel, *Ring Attention with Blockwise Transformers for
Near-Infinite Context* (2023); the zigzag layout and the backward's
travelling gradients as in zhuzilin/ring-flash-attention.

    import numba_flash.torch as nft
    from numba_flash.ring import ring_shard

    # in each of W processes (torchrun), after torch.cuda.set_device(local_rank) and init_process_group:
    q, k, v = (ring_shard(x, rank, W).requires_grad_() for x in (q_full, k_full, v_full))  # (B, H, N / W, d)
    out = nft.ring_attention(q, k, v, causal=True)          # this rank's rows of O
    out.backward(ring_shard(grad_full, rank, W))            # q.grad, k.grad, v.grad: this rank's shards

The ring
--------
Each of the W ranks holds the queries, keys and values of N / W positions.
Its keys and values go round the ring: at step t rank r holds the K/V shard
of rank s = r - t (mod W), computes attention of its own queries against it
with numba-flash's flash2 forward (``return_lse``: the row log-sum-exp
comes with the partial output), and passes the shard on to rank r + 1 while
receiving the next one from rank r - 1.  The transfer for step t + 1 is
started before step t's attention and waited for after it, so communication
hides behind computation when the attention takes longer than the transfer.
No rank ever holds more than two K/V shards, and no N x N matrix exists
anywhere: memory per GPU is linear in N / W.

Merging partial results
-----------------------
A query row's partial output over key set A is O_A = sum_{j in A} exp(s_j -
lse_A) v_j with lse_A = log sum_{j in A} exp(s_j).  Over A and B together:
lse = log(exp(lse_A) + exp(lse_B)) and O = exp(lse_A - lse) O_A +
exp(lse_B - lse) O_B.  ``merge_by_lse`` adds each part into a running
(O, lse) in place, in float32 whatever the inputs' type, the weights
computed after subtracting the larger lse (no overflow).  A part with lse =
-inf (it saw no key) weighs nothing; a row that saw no key anywhere keeps
O = 0, lse = -inf, which is also where the running result starts.

Causal masks and the layout
---------------------------
With a causal mask, rank r's queries see none of the keys after them.  Cut
into W contiguous shards ("contiguous"), rank r would see all of ranks
s < r, half of its own and nothing of s > r: rank W - 1 works W times as
long as rank 0.  "zigzag" cuts the sequence into 2W chunks and gives rank r
chunks r and 2W - 1 - r (concatenated in that order), one early and one late.
Then, for K/V from rank s:

* s = r: causal attention on the local concatenation (its top-left mask
  is exactly the global one: chunk r precedes chunk 2W - 1 - r);
* s < r: chunk s precedes both local chunks and chunk 2W - 1 - s follows
  both: all local queries against the first half of the K/V shard;
* s > r: both chunks of s follow chunk r and precede chunk 2W - 1 - r: the
  second half of the local queries against the whole K/V shard.

Every step is N / W x N / (2W) query-key pairs on every rank: equal work.
Without a causal mask every rank sees every key and the layout only says
which positions a rank holds.  ``ring_positions`` says which (for
positional encodings), ``ring_shard`` and ``ring_unshard`` cut and rejoin a
full sequence.

The backward
------------
With the final O and the global lse saved by the forward, P_ij = exp(s_ij -
lse_i) is exact for any subset of keys, and D_i = rowsum(dO_i o O_i) is
global too.  So numba-flash's flash2 backward, given the global O and lse,
computes exact partial gradients of the local queries against the K/V
shard held: dQ adds up locally; dK and dV of a shard belong to its home
rank, so they travel round the ring with it: rank r adds its part to the
running dK, dV of the shard it holds and passes them on; after W steps
and one last hop every shard's gradients are home.  Partial results (O,
dQ, dK, dV) add up in float32 when the inputs are 16-bit.

On a GPU, torch's NCCL process group runs every send and receive on its
own stream, after the work already queued on the current stream; waiting
for it (``Work.wait``) makes the current stream wait, not the host.  So
the kernels and the transfers overlap without a stream of ours: the
transfer of step t + 1 waits only for step t - 1's kernels, which step t's
attention must wait for anyway.  With gloo (CPU, the simulator) the
transfers run on gloo's threads.

Departures from ring-flash-attention
------------------------------------
* One loop for both layouts (``_visible_part`` says which queries see
  which keys at each step) instead of one module per layout; non-causal
  attention is accepted with either layout (ring-flash-attention asserts
  causal for zigzag), since a model shards its sequence once for all its layers.
* The merge subtracts the larger lse first and handles -inf (a row with no
  visible key); ring-flash-attention's ``lse + log(1 + exp(block_lse -
  lse))`` starts from the first part and assumes finite lse.
* Every argument is checked, by the checks ``numba_flash.attention`` uses,
  before the first message is sent: a bad call raises on every rank instead
  of leaving its neighbours waiting.
* The transfers are tagged by kind (K/V, or their gradients), so gloo,
  which matches messages by tag, never takes one for the other.
* Not here (yet): dropout, block masks, sliding windows, variable-length
  sequences, lse as an output, torch.compile.
"""
import math

from ._torch_calls import backward, check_tensors, forward, torch  # first: names the extra if torch is missing
from ._validation import check_attention_args
from .runtime.arrays import describe

import torch.distributed as dist  # noqa: E402,I001

__all__ = ["LAYOUTS", "Neighbours", "RingAttentionFunction", "merge_by_lse", "ring_attention", "ring_positions",
           "ring_shard", "ring_unshard"]

#: How a sequence is cut between the ranks (see the module docstring).
LAYOUTS = ("zigzag", "contiguous")

#: Message tags of the two kinds of transfer (gloo matches messages by tag; NCCL, by order, which is the same
#: on every rank).
KV_TAG, GRADIENT_TAG = 0, 2


# ---------------------------------------------------------------- the layout

def ring_positions(length, rank, world, layout="zigzag", device=None):
    """The positions (int64, in order) of a ``length``-long sequence that ``rank`` of ``world`` holds.

    "zigzag": chunks ``rank`` and ``2 * world - 1 - rank`` of ``2 * world``
    equal chunks, in that order; "contiguous": chunk ``rank`` of ``world``.
    For rotary or other positional encodings of a shard.  E.g. length 8,
    world 2, zigzag: rank 0 holds [0, 1, 6, 7], rank 1 [2, 3, 4, 5].
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not (isinstance(world, int) and world >= 1):
        raise ValueError(f"world must be a positive int, got {world!r}")
    if not (isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
    chunks = 2 * world if layout == "zigzag" else world
    if length % chunks:
        raise ValueError(f"the sequence length {length} must be a multiple of {chunks} for layout={layout!r} "
                         f"over {world} ranks ({'2 x world chunks' if layout == 'zigzag' else 'one chunk per rank'})")
    chunk = length // chunks
    held = (rank, chunks - 1 - rank) if layout == "zigzag" else (rank,)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in held])


def ring_shard(x, rank, world, layout="zigzag", dim=-2):
    """``rank``'s shard of a full sequence ``x`` (positions along ``dim``; (B, H, N, d) by default), a copy."""
    return x.index_select(dim, ring_positions(x.shape[dim], rank, world, layout, x.device))


def ring_unshard(shards, layout="zigzag", dim=-2):
    """The full sequence from every rank's shard (a list in rank order, e.g. from ``dist.all_gather``)."""
    world = len(shards)
    shape = list(shards[0].shape)
    shape[dim] *= world
    full = shards[0].new_empty(shape)
    for rank, shard in enumerate(shards):
        full.index_copy_(dim, ring_positions(shape[dim], rank, world, layout, full.device), shard)
    return full


def _visible_part(rank, source, shard_length, causal, layout):
    """Which local query rows see which rows of ``source``'s K/V shard, and whether causally.

    Returns (query rows, key rows, causal) as slices of the shard, or None
    where no local query sees any of those keys.
    """
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if source == rank:
        return everything, everything, True
    if layout == "contiguous":
        return (everything, everything, False) if source < rank else None
    half = shard_length // 2
    if source < rank:   # chunk s precedes both local chunks; chunk 2W - 1 - s follows both
        return everything, slice(None, half), False
    return slice(half, None), everything, False   # both chunks of s lie between the local ones


# ---------------------------------------------------------------- merging by log-sum-exp

def merge_by_lse(out, lse, partial_out, partial_lse):
    """Add a partial attention result over other keys into a running one, in place: (out, lse) becomes theirs
    over both key sets.

    out: (..., N, d) and lse: (..., N), the running result, float32 (or
    float64), views of larger tensors if need be (the zigzag steps merge
    half of each head's rows); partial_out: (..., N, d) of any float dtype and
    partial_lse: (..., N), e.g. from ``numba_flash.attention(...,
    return_lse=True)``.  With lse' = log(exp(lse) + exp(partial_lse)),
    out' = exp(lse - lse') out + exp(partial_lse - lse') partial_out, both
    weights computed after subtracting the larger lse.  A side with lse =
    -inf saw no key and weighs nothing; both -inf leaves O = 0, lse = -inf.
    NaN in an lse makes its row NaN.

    The rule of flash-decoding's merge (``kernels/fast/cache.py``,
    ``tile_merger``), written again in torch because that merge reads every
    split stacked in one (splits, rows, d) float32 buffer: the ring would
    copy both sides into one at every step, and the zigzag steps merge every
    other half of each head's rows.  One difference: the kernel leaves out a
    split of weight 0, so that no NaN in its O reaches the row; here a side
    of weight 0 is multiplied by 0, as one call's kernels multiply a weight
    that underflowed to 0: a NaN value row reaches every query allowed to see
    it, as in one call, and an empty side adds nothing (its O is 0, by
    numba-flash's rule for rows that see no key).
    """
    largest = torch.maximum(lse, partial_lse)
    shift = torch.where(largest == -math.inf, 0.0, largest)   # no key on either side: every weight exp(-inf) = 0
    weight, partial_weight = torch.exp(lse - shift), torch.exp(partial_lse - shift)
    total = weight + partial_weight
    inverse = torch.where(total != 0, 1 / total, 0.0)
    out.mul_((weight * inverse)[..., None]).addcmul_(partial_out, (partial_weight * inverse)[..., None])
    lse.copy_(torch.where(total != 0, shift + torch.log(total), -math.inf))


# ---------------------------------------------------------------- the ring

class Neighbours:
    """This rank's place in the ring of ``group``'s ranks: it sends to rank + 1 and receives from rank - 1."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def pass_on(self, tensors, tag):
        """Start sending ``tensors`` (contiguous) to the next rank and receiving as many like them from the
        previous one; returns ``arrival``, whose call waits for both and gives the received tensors.

        Tags ``tag``, ``tag + 1``, ...; in a ring of one the next rank is this one: nothing moves.
        """
        if self.world == 1:
            return lambda: tensors
        received = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in tensors]
        following, preceding = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        operations = ([dist.P2POp(dist.isend, x, group=self.group, group_peer=following, tag=tag + i)
                       for i, x in enumerate(tensors)]
                      + [dist.P2POp(dist.irecv, x, group=self.group, group_peer=preceding, tag=tag + i)
                         for i, x in enumerate(received)])
        works = dist.batch_isend_irecv(operations)

        def arrival():
            for work in works:
                work.wait()
            return received

        return arrival


def _options(causal, scale):
    """numba_flash.torch's options for one part: flash2, no dropout, no block mask."""
    return dict(causal=causal, scale=scale, block_mask=None, dropout_p=0.0, seed=0, algorithm="flash2",
                block_sizes=None)


def _ring_forward(q, k, v, neighbours, causal, scale, layout):
    """(O in q's dtype, lse float32) of the local queries against every rank's keys."""
    rank, world = neighbours.rank, neighbours.world
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
    held = (k, v)
    for step in range(world):
        last = step == world - 1
        if not last:
            arrival = neighbours.pass_on(held, KV_TAG)   # the next shard travels while this one is used
        part = _visible_part(rank, (rank - step) % world, q.shape[-2], causal, layout)
        if part is not None:
            rows, keys, part_causal = part
            partial_out, partial_lse = forward(
                q[..., rows, :], held[0][..., keys, :], held[1][..., keys, :], _options(part_causal, scale))
            merge_by_lse(out[..., rows, :], lse[..., rows], partial_out, partial_lse)
        if not last:
            held = arrival()
    return out.to(q.dtype), lse


def _ring_backward(q, k, v, out, lse, grad_out, neighbours, causal, scale, layout):
    """(dq, dk, dv) of the local shards, from the global O and lse."""
    rank, world = neighbours.rank, neighbours.world
    if grad_out.stride(-1) != 1:   # e.g. the expanded gradient of out.sum(): every stride 0
        grad_out = grad_out.contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    held = (k, v)
    for step in range(world):
        last = step == world - 1
        if not last:
            kv_arrival = neighbours.pass_on(held, KV_TAG)
        part = _visible_part(rank, (rank - step) % world, q.shape[-2], causal, layout)
        if part is not None:
            rows, keys, part_causal = part
            partial_dq, partial_dk, partial_dv = backward(
                q[..., rows, :], held[0][..., keys, :], held[1][..., keys, :], out[..., rows, :],
                lse[..., rows].contiguous(), grad_out[..., rows, :], _options(part_causal, scale))
        # The held shard's dK, dV so far: nothing at its home rank (step 0), else what the previous rank added.
        if step == 0:
            dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in held)
        else:
            dk, dv = gradient_arrival()
        if part is not None:
            dq[..., rows, :].add_(partial_dq)
            dk[..., keys, :].add_(partial_dk)
            dv[..., keys, :].add_(partial_dv)
        # Onward with the shard they belong to; after the last step this hop takes them home.
        gradient_arrival = neighbours.pass_on((dk, dv), GRADIENT_TAG)
        if not last:
            held = kv_arrival()
    dk, dv = gradient_arrival()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """Ring attention with numba-flash's forward and backward at every step (see the module docstring).

    ``apply(q, k, v, neighbours, causal, scale, layout)``; ``neighbours`` has
    ``rank``, ``world`` and ``pass_on(tensors, tag) -> arrival`` (``Neighbours``
    over a process group; ``experiments/tuning/ring_scaling.py`` passes stand-ins
    that do not communicate, to time the computation alone).
    """

    @staticmethod
    def forward(ctx, q, k, v, neighbours, causal, scale, layout):
        k, v = k.contiguous(), v.contiguous()   # sent as they are: send and receive take contiguous memory
        out, lse = _ring_forward(q, k, v, neighbours, causal, scale, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = (neighbours, causal, scale, layout)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, out, lse, grad_out, *ctx.ring)
        return dq, dk, dv, None, None, None, None


# ---------------------------------------------------------------- the public function

def _check_arguments(q, k, v, causal, scale, layout):
    """Every check that needs no communication: the library's own on the local call, and the ring's."""
    check_tensors((("q", q), ("k", k), ("v", v)))
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False (the mask over the whole sequence), got {causal!r}")
    operands = [describe(name, x.detach()) for name, x in (("q", q), ("k", k), ("v", v))]
    for direction in (False, True):   # the forward's checks, then the backward's
        check_attention_args(*operands, causal=causal, scale=scale, block_mask=None, dropout_p=0.0, seed=0,
                             algorithm="flash2", block_sizes=None, backward=direction)
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(f"q, k and v must be this rank's shards of one sequence, of equal lengths N / world; "
                         f"got {q.shape[-2]} query and {k.shape[-2]} key positions")
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"layout='zigzag' needs an even shard length (two chunks per rank), got q with "
                         f"{q.shape[-2]} positions; use ring_shard to cut the sequence")
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        raise ValueError(f"q is on {q.device} but this process's current device is cuda:"
                         f"{torch.cuda.current_device()}: call torch.cuda.set_device({q.device.index}) first "
                         f"(numba-flash and NCCL work on the current device)")


def _check_group(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group: torch.distributed is not initialised; call torch.distributed.init_process_group "
                         "in each process first (one process per shard)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError("group: this process is not one of its ranks")


def ring_attention(q, k, v, *, group=None, causal=False, scale=None, layout="zigzag"):
    """Attention of one sequence sharded over the ranks of ``group``; each rank gets its shard of O.

    Each rank passes its shards q: (..., H_q, N / W, d), k and v: (...,
    H_kv, N / W, d) of the whole sequence's q, k, v, cut as ``layout`` says
    (``ring_shard``), of one dtype (float32, float16, bfloat16), on the
    device numba-flash computes on (a GPU: the current one; CPU tensors in
    the simulator).  H_q a multiple of H_kv (grouped-query attention).  Every
    rank calls it with the same shapes and options.

    causal: the causal mask over the whole sequence (query i sees key j iff
    j <= i, positions as ``ring_positions`` gives them).  layout: "zigzag"
    (the default: equal work on every rank under a causal mask; the shard
    length must be even) or "contiguous".  scale: as ``numba_flash.attention``
    (default 1/sqrt(d)).  group: a torch.distributed process group (default:
    the default group), initialised; NCCL on GPUs, gloo on the CPU.

    Returns this rank's shard of O (q's shape and dtype), differentiable:
    its backward gives every rank the gradients of its own q, k and v
    shards.  Bad arguments raise ValueError or TypeError before anything is
    sent (all ranks raise alike when their arguments agree).
    """
    _check_arguments(q, k, v, causal, scale, layout)
    _check_group(group)
    return RingAttentionFunction.apply(q, k, v, Neighbours(group), causal, scale, layout)
