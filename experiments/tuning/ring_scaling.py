"""Ring attention on several GPUs: speed against one GPU, computation against communication, the longest sequence.

For (B, H, N, d) = (1, 16, 131072, 128) float16 with a causal mask, zigzag layout:

* forward, and forward + backward, on one GPU (``numba_flash.torch.attention``
  on the whole sequence) and on W GPUs (``numba_flash.torch.ring_attention``,
  each rank holding N / W positions): CUDA events, median after warm-ups;
  the ring's time is its slowest rank's, every repeat starting from a barrier;
* the same ring with its K/V standing still (every step's attention, no
  communication: ``StandStill``) and with every transfer waited for as soon
  as it starts (no overlap: ``WaitAtOnce``), and one hop of K, V and of the
  float32 dK, dV alone: with overlap the ring takes about its computation's
  time, without it about computation plus communication;
* the longest N: N doubled from 131072 on 1 and on W GPUs, forward +
  backward once each, with the peak of ``torch.cuda.max_memory_allocated``
  per GPU, until it runs out of memory or of the time budget (attention
  time grows as N^2: a size predicted, from the last one, to overrun the
  budget is not run; its memory, linear in N, is extrapolated and marked so).

    torchrun --nproc-per-node 2 experiments/tuning/ring_scaling.py     # 1 GPU and 2 GPUs
    PYTHONPATH=$PWD python3 experiments/tuning/ring_scaling.py         # 1 GPU only
    PYTHONPATH=$PWD python3 experiments/tuning/ring_scaling.py --quick # a tiny case (runs in the simulator, times nothing)

Writes experiments/tuning/results/ring_scaling.{md,csv} and ring_scaling_longest.csv
(``ring_scaling_quick`` with --quick), from rank 0.  Prints tables, asserts
nothing about speed.
"""
import os

# NVLink multicast stays off on the shared machines (NCCL's NVLS and torch's symmetric memory both use it);
# before torch.distributed creates any communicator.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import time  # noqa: E402

import numba_flash  # noqa: E402
from numba_flash.tools.report import markdown_header, markdown_table, write_csv  # noqa: E402
from numba_flash.tools.timing import time_ms  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")
FULL = dict(batch=1, heads=16, n=131072, d=128, repeats=5, warmup=2, search_seconds=150.0, search_limit=1 << 24)
QUICK = dict(batch=1, heads=1, n=16, d=8, repeats=1, warmup=0, search_seconds=0.0, search_limit=64)
GIB = 2 ** 30


def attention_flop(batch, heads, n, d, backward):
    """FLOPs of causal attention over n positions: 4 n^2 d per head for S = QK^T and PV, halved by the mask;
    the backward adds 2.5 times that (dV, dP, dQ, dK and the recomputed S: "2.0 (bwd) + 0.5 (recompute)")."""
    forward = 4 * n * n * d * batch * heads / 2
    return forward * (3.5 if backward else 1.0)


class StandStill:
    """Neighbours that move nothing: every step 'receives' the shard it holds, so the ring runs exactly its
    steps' attention (the same shapes, the same parts) without communicating."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def pass_on(self, tensors, tag):
        return lambda: tensors


class WaitAtOnce:
    """The ring's neighbours, every transfer waited for as soon as it starts: communication, then computation."""

    def __init__(self, neighbours):
        self.neighbours, self.rank, self.world = neighbours, neighbours.rank, neighbours.world

    def pass_on(self, tensors, tag):
        received = self.neighbours.pass_on(tensors, tag)()
        return lambda: received


class Run:
    """This process's part of the experiment: its rank, its device, the sizes, and how it times and agrees."""

    def __init__(self, config):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.config = torch, dist, config
        self.simulator = numba_flash.in_simulator()
        self.rank, self.world = self.join_group()
        self.device = torch.device("cpu") if self.simulator else torch.device("cuda", torch.cuda.current_device())
        self.dtype = torch.float32 if self.simulator else torch.float16
        self.shape = tuple(config[key] for key in ("batch", "heads", "n", "d"))

    def join_group(self):
        """(rank, world): the process group torchrun described (or the caller's), or a world of one."""
        torch, dist = self.torch, self.dist
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            timeout = datetime.timedelta(minutes=30)   # rank 0 times one GPU alone while the others wait
            if self.simulator:
                dist.init_process_group("gloo", timeout=timeout)
            else:
                device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
                torch.cuda.set_device(device)   # before numba-flash's first launch: Numba uses the current device
                dist.init_process_group("nccl", timeout=timeout, device_id=device)
        if dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def say(self, *what):
        if self.rank == 0:
            print(*what, flush=True)

    def over_ranks(self, value, smallest=False, gpus=None):
        """The largest (or smallest) of ``value`` over the ranks at work (all, unless ``gpus`` is 1): the
        slowest rank's time, the fullest GPU; every rank then takes the same decisions."""
        if (gpus or self.world) == 1:
            return value
        box = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(box, op=self.dist.ReduceOp.MIN if smallest else self.dist.ReduceOp.MAX)
        return float(box.item())

    def synchronize(self):
        if not self.simulator:
            self.torch.cuda.synchronize()

    def median_ms(self, run, align):
        """Median of ``run()`` over the repeats, after the warm-ups; ``align``: a barrier before each run, so
        that every rank starts together (the ring's time is then the slowest rank's)."""
        return time_ms(run, repeats=self.config["repeats"], warmup=self.config["warmup"],
                       setup=self.dist.barrier if align else None)

    def inputs(self, length):
        """q, k, v (requiring gradients) and dO of ``length`` positions, standard normal."""
        batch, heads, _, d = self.shape
        generator = self.torch.Generator(device=self.device).manual_seed(self.rank)
        q, k, v, grad_out = (self.torch.randn(batch, heads, length, d, generator=generator, device=self.device,
                                              dtype=self.dtype) for _ in range(4))
        return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad_out

    def timings(self, configuration, attend, gpus):
        """A row: forward and forward + backward of ``attend(q, k, v)`` on N / ``gpus`` positions."""
        torch = self.torch
        q, k, v, grad_out = self.inputs(self.shape[2] // gpus)
        align = gpus > 1
        with torch.no_grad():
            forward = self.over_ranks(self.median_ms(lambda: attend(q, k, v), align), gpus=gpus)
        both = self.over_ranks(self.median_ms(lambda: torch.autograd.grad(attend(q, k, v), (q, k, v), grad_out),
                                              align), gpus=gpus)
        flop = attention_flop(*self.shape, backward=True)
        row = {"configuration": configuration, "GPUs": gpus, "forward ms": f"{forward:.2f}",
               "forward+backward ms": f"{both:.2f}", "TFLOP/s per GPU (fwd+bwd)": f"{flop / gpus / both / 1e9:.1f}"}
        self.say(row)
        return row

    def hop(self, what, tensors, tag, neighbours):
        """A row: one hop of ``tensors`` round the ring, alone."""
        ms = self.over_ranks(self.median_ms(lambda: neighbours.pass_on(tensors, tag)(), align=True))
        megabytes = sum(x.numel() * x.element_size() for x in tensors) / 1e6
        return {"one hop of": what, "MB": f"{megabytes:.1f}", "ms": f"{ms:.3f}", "GB/s": f"{megabytes / ms:.1f}"}

    def longest(self, attend, gpus):
        """Rows of the longest-N search of ``attend`` on ``gpus`` GPUs (1: the whole sequence; more: the ring).

        A ring whose next size is predicted not to fit is not run: one rank
        running out of memory would leave the others waiting for its messages.
        """
        torch, config = self.torch, self.config
        if self.simulator:
            capacity = None
        else:   # what torch's allocator could hold: free memory and what it already has
            torch.cuda.empty_cache()
            capacity = self.over_ranks(torch.cuda.mem_get_info(self.device)[0]
                                       + torch.cuda.memory_reserved(self.device), smallest=True, gpus=gpus)
        rows, spent, last = [], 0.0, None
        n = config["n"]
        while n <= config["search_limit"]:
            entry = {"GPUs": gpus, "N": n, "positions per GPU": n // gpus}
            if last is not None:
                ratio = n / last["N"]
                seconds = last["seconds"] * ratio ** 2
                peak = None if last["peak"] is None else last["peak"] * ratio
                fits = capacity is None or peak < capacity
                if not fits or spent + seconds > config["search_seconds"]:
                    entry.update({"peak GiB per GPU": "n/a (simulator)" if peak is None else f"~{peak / GIB:.1f}",
                                  "seconds": f"~{seconds:.0f}",
                                  "result": ("not run: over the time budget" + ("" if peak is None else ", would fit")
                                             if fits else "not run: would not fit")})
                    rows.append(entry)
                    if not fits or peak is None:
                        break
                    spent = config["search_seconds"]   # from here on, extrapolation only
                    last = dict(N=n, seconds=seconds, peak=peak)
                    n *= 2
                    continue
            if not self.simulator:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            try:
                q, k, v, grad_out = self.inputs(n // gpus)
                torch.autograd.grad(attend(q, k, v), (q, k, v), grad_out)
                del q, k, v, grad_out
                self.synchronize()
            except torch.OutOfMemoryError:   # one GPU only (see above)
                entry["result"] = "out of memory"
                rows.append(entry)
                break
            seconds = self.over_ranks(time.perf_counter() - start, gpus=gpus)
            peak = None if self.simulator else self.over_ranks(torch.cuda.max_memory_allocated(self.device), gpus=gpus)
            spent += seconds
            entry.update({"peak GiB per GPU": "n/a (simulator)" if peak is None else f"{peak / GIB:.2f}",
                          "seconds": f"{seconds:.1f}", "result": "ran"})
            rows.append(entry)
            self.say(entry)
            last = dict(N=n, seconds=seconds, peak=peak)
            n *= 2
        return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--search-seconds", type=float, default=None,
                        help="time budget of each world size's longest-N search (default 150; --quick 0: one size)")
    args = parser.parse_args(argv)
    if numba_flash.in_simulator() and not args.quick:
        print("needs a GPU (or --quick)")
        return 2
    config = dict(QUICK if args.quick else FULL)
    if args.search_seconds is not None:
        config["search_seconds"] = args.search_seconds
    run = Run(config)
    torch, dist, rank, world = run.torch, run.dist, run.rank, run.world

    import numba_flash.torch as nft
    from numba_flash.ring import GRADIENT_TAG, KV_TAG, Neighbours, RingAttentionFunction

    def whole(q, k, v):
        return nft.attention(q, k, v, causal=True)

    def ring_with(neighbours):
        return lambda q, k, v: RingAttentionFunction.apply(q, k, v, neighbours, True, None, "zigzag")

    rows, hops = [], []
    if rank == 0:   # one GPU: rank 0 alone, the others wait
        rows.append(run.timings("numba_flash.torch.attention, whole sequence", whole, 1))
    if world > 1:
        dist.barrier()
        neighbours = Neighbours(None)
        rows.append(run.timings("ring_attention, zigzag", lambda q, k, v: nft.ring_attention(q, k, v, causal=True),
                                world))
        rows.append(run.timings("ring, computation only (K/V stand still)", ring_with(StandStill(rank, world)),
                                world))
        rows.append(run.timings("ring, each transfer waited for at once", ring_with(WaitAtOnce(neighbours)), world))
        q, k, v, _ = run.inputs(run.shape[2] // world)
        dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=run.device) for x in (k, v))
        hops = [run.hop("K, V", (k.detach(), v.detach()), KV_TAG, neighbours),
                run.hop("float32 dK, dV", (dk, dv), GRADIENT_TAG, neighbours)]
        run.say(hops)

    device_name = "numba-cuda simulator" if run.simulator else torch.cuda.get_device_name()
    command = ("python3 experiments/tuning/ring_scaling.py --quick" if args.quick else
               f"torchrun --nproc-per-node {world} experiments/tuning/ring_scaling.py" if world > 1 else
               "python3 experiments/tuning/ring_scaling.py")
    stem = os.path.join(args.out, "ring_scaling_quick" if args.quick else "ring_scaling")
    batch, heads, n, d = run.shape

    def write(longest):
        """The results so far, from rank 0 (written before the search too: a search cut short loses nothing)."""
        if rank != 0:
            return
        one_gpu = float(rows[0]["forward+backward ms"])
        for entry in rows:
            entry["speed-up over 1 GPU (fwd+bwd)"] = f"{one_gpu / float(entry['forward+backward ms']):.2f}x"
        os.makedirs(args.out, exist_ok=True)
        write_csv(stem + ".csv", rows)
        if longest:
            write_csv(stem + "_longest.csv", longest)
        with open(stem + ".md", "w") as f:
            f.write(markdown_header("Ring attention across GPUs", command,
                                    f"{world} x {device_name}" if world > 1 else device_name,
                                    timer="simulator wall clock (not a measurement)" if run.simulator else
                                    f"CUDA events, median of {config['repeats']} after {config['warmup']} warm-ups; "
                                    "ring rows: the slowest rank, each repeat after a barrier"))
            f.write(f"\n(B, H, N, d) = ({batch}, {heads}, {n}, {d}), {str(run.dtype).replace('torch.', '')}, "
                    f"causal, zigzag layout.  TFLOP/s counts causal attention's 2 N^2 d H forward FLOPs times 3.5 "
                    f"(the backward's 2.5), divided between the GPUs.\n\n")
            f.write(markdown_table(rows))
            if hops:
                f.write("\nCommunication alone, the slowest rank (the forward makes W - 1 hops of K, V; the "
                        "backward W - 1 of K, V and W of dK, dV):\n\n" + markdown_table(hops))
            if longest:
                f.write("\n## Longest sequence\n\nForward + backward once per N, N doubled from "
                        f"{n}, peak memory the largest rank's; a size predicted (time ~ N^2 from the last one) "
                        f"to overrun the {config['search_seconds']:.0f} s budget is not run, its memory (linear in "
                        "N) extrapolated.\n\n" + markdown_table(longest))
        print("wrote", stem + ".md", flush=True)

    write(None)
    longest = []
    if rank == 0:
        longest += run.longest(whole, 1)
    if world > 1:
        dist.barrier()
        longest += run.longest(ring_with(Neighbours(None)), world)
    write(longest)
    return 0


if __name__ == "__main__":
    main()
