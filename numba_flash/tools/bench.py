"""``numba-flash bench``: our kernels against torch's attention backends, and the host time of a call.

Everything runs in one process on one GPU.  Each (shape, dtype, causal)
case draws three sets of random inputs on the device and rotates through
them (so repeated runs do not just re-read the L2 cache), warms every
implementation up (compilation and autotuning stay out of the numbers) and
reports the median of ``--repeats`` runs timed with CUDA events.

Throughput counts the forward pass's two matrix products: 4 * N_q * N_k * d
FLOPs per (batch, head), halved for causal attention (half the scores are
skipped).  ``--backward`` times the backward instead (through autograd, ours
via ``numba_flash.torch``), and forward + backward, counting the usual 2.5x
the forward's FLOPs for the backward's five products and 3.5x for both
(FlashAttention-2's convention; our deterministic backward does seven).  The peak for "% of peak" is the H200's: 67 TFLOP/s for float32
FMA and 989 TFLOP/s for dense 16-bit tensor-core math (datasheet).

FlexAttention (``torch.nn.attention.flex_attention`` under ``torch.compile``,
a causal ``BlockMask`` for causal cases) runs beside torch's SDPA backends
where torch has it; its compilation happens in the warm-up.

``--baseline DIR`` also times another copy of the package (a source tree
whose package folder is DIR, e.g. an earlier commit unpacked by ``git
archive``) in the same process: before/after numbers of one run.  Repeat it
to time several copies (variants of one change) side by side.
``--host`` measures what a call costs the host instead: a loop of
``--calls`` calls with one synchronisation at the end (``run_host``).
"""
import contextlib
import csv
import datetime
import os
import platform
from dataclasses import dataclass
from functools import partial

import numpy as np

from .. import attention, device_limits, in_simulator
from ..tiling import flash2_default_block_sizes, precision_of
from .timing import time_ms

#: (batch, heads, N, d): the shapes issue #3 asks for.
DEFAULT_SHAPES = [(8, 16, 1024, 64), (4, 16, 4096, 64), (2, 16, 8192, 128), (1, 16, 16384, 64)]
DEFAULT_DTYPES = "float32,float16,bfloat16"
PEAK_TFLOPS = {"float32": 67.0, "float16": 989.0, "bfloat16": 989.0}
TORCH_BACKENDS = ("MATH", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION")
SHORT_NAMES = {"MATH": "torch-math", "EFFICIENT_ATTENTION": "torch-efficient",
               "FLASH_ATTENTION": "torch-flash", "CUDNN_ATTENTION": "torch-cudnn"}
#: Every peer the forward benchmark can time beside us (``--peers`` picks some: FlexAttention in float32
#: at d = 128 takes about 2 s a call on the H200, torch's math backend tens of ms).
PEERS = (*SHORT_NAMES.values(), "flex-attention")


@dataclass
class Row:
    shape: tuple
    dtype: str
    causal: bool
    implementation: str
    ms: float          # nan when the implementation does not run this case
    note: str = ""
    flop_factor: float = 1.0  # FLOPs relative to the forward's: 2.5 backward, 3.5 forward + backward

    @property
    def tflops(self):
        b, h, n, d = self.shape
        flops = self.flop_factor * 4.0 * n * n * d * b * h * (0.5 if self.causal else 1.0)
        return flops / (self.ms * 1e-3) / 1e12


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _inputs(shape, dtype, sets, torch):
    """``sets`` random (q, k, v) triples on the device (torch tensors if torch is there)."""
    rng = np.random.default_rng(0)
    triples = []
    for _ in range(sets):
        if torch is not None:
            triples.append(tuple(torch.randn(shape, device="cuda", dtype=getattr(torch, dtype)) for _ in range(3)))
        else:
            from numba import cuda
            triples.append(tuple(cuda.to_device(rng.standard_normal(shape).astype(dtype)) for _ in range(3)))
    return triples


_FLEX = {}


#: FlexAttention's smallest head dim (torch's inductor refuses smaller: "embedding dimension ... must be
#: at least 16", seen on the H200 with torch 2.11).
FLEX_MIN_HEAD_DIM = 16


def flex_attention(torch, causal, n_q, n_k, head_dim, block_mask=None):
    """FlexAttention compiled once per process, with a causal block mask (top-left) when ``causal``, or
    numba-flash's ``block_mask`` (a 2-D layout) as FlexAttention's own; None when this torch has none or
    the head dim is below ``FLEX_MIN_HEAD_DIM``."""
    if head_dim < FLEX_MIN_HEAD_DIM:
        return None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention as flex
    except ImportError:
        return None
    if "compiled" not in _FLEX:
        # The backward benchmark replays one autograd graph (retain_graph=True), which a compiled backward
        # with donated buffers refuses (it did at d = 128 on torch 2.11).  Not yet re-run on a GPU.
        import torch._functorch.config as functorch_config
        if hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False
        # One static compilation per shape, dtype and mask: a benchmark run asks for more than dynamo's default
        # of 8, past which it ran FlexAttention eagerly (scores materialised: 42 ms for a 3 ms backward, H200,
        # 2026-12-02), and a recompilation for a second shape otherwise compiles a dynamic-shape kernel.
        import torch._dynamo.config as dynamo_config
        dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 256)
        dynamo_config.accumulated_cache_size_limit = max(dynamo_config.accumulated_cache_size_limit, 1024)
        _FLEX["compiled"] = torch.compile(flex, dynamic=False)
    compiled = _FLEX["compiled"]
    if block_mask is not None:
        layout = torch.as_tensor(block_mask.layout, device="cuda")
        rows, cols = block_mask.block_size
        mask = create_block_mask(lambda b, h, q, k: layout[q // rows, k // cols], None, None, n_q, n_k,
                                 device="cuda", BLOCK_SIZE=(rows, cols))
    elif causal:
        mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, n_q, n_k, device="cuda")
    else:
        mask = None
    return lambda q, k, v: compiled(q, k, v, block_mask=mask)


def _time_rotating(fn, triples, repeats, device_only=False):
    state = {"i": 0}

    def setup():
        state["i"] = (state["i"] + 1) % len(triples)

    return time_ms(lambda: fn(*triples[state["i"]]), repeats=repeats, warmup=3, setup=setup, device_only=device_only)


def _ours(algorithm, shape, dtype, causal):
    """attention by ``algorithm`` (flash2, flash1, standard, wgmma), or by "mma": flash2 held to the mma.sync
    kernel (by its default tile sizes: explicit ones are that kernel's) where flash2 itself picks wgmma."""
    if algorithm == "mma":
        blocks = flash2_default_block_sizes(shape[3], precision_of(dtype), causal=causal)
        return partial(attention, algorithm="flash2", block_sizes=blocks)
    return partial(attention, algorithm=algorithm)


def run_case(shape, dtype, causal, algorithms, repeats, torch, baselines=(), peers=PEERS, device_only=False):
    """The forward of ours, the baselines and the peers on one case; ``device_only``: GPU time alone
    (``time_ms``), without what the host spends issuing each call."""
    triples = _inputs(shape, dtype, 3, torch)
    timed = partial(_time_rotating, triples=triples, repeats=repeats, device_only=device_only)
    rows = []
    for algorithm in algorithms:
        ours = _ours(algorithm, shape, dtype, causal)
        try:
            ms = timed(lambda q, k, v: ours(q, k, v, causal=causal))
            rows.append(Row(shape, dtype, causal, algorithm, ms))
        except (TypeError, ValueError) as exc:  # wgmma: a dtype or head dim outside its scope
            rows.append(Row(shape, dtype, causal, algorithm, float("nan"), str(exc).splitlines()[0][:60]))
    for baseline in baselines:
        name = f"flash2@{baseline.label}"
        try:
            ms = timed(lambda q, k, v: baseline.attention(q, k, v, causal=causal))
            rows.append(Row(shape, dtype, causal, name, ms))
        except (TypeError, ValueError) as exc:  # e.g. a dtype the baseline does not take
            rows.append(Row(shape, dtype, causal, name, float("nan"), str(exc).splitlines()[0][:60]))
    if torch is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        for backend in TORCH_BACKENDS:
            name = SHORT_NAMES[backend]
            if name not in peers:
                continue
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    ms = timed(lambda q, k, v: sdpa(q, k, v, is_causal=causal))
                rows.append(Row(shape, dtype, causal, name, ms))
            except (RuntimeError, torch.OutOfMemoryError) as exc:  # backend unavailable for this case
                rows.append(Row(shape, dtype, causal, name, float("nan"), str(exc).splitlines()[0][:60]))
        flex = flex_attention(torch, causal, shape[2], shape[2], shape[3]) if "flex-attention" in peers else None
        if flex is not None:
            try:
                rows.append(Row(shape, dtype, causal, "flex-attention", timed(flex)))
            except Exception as exc:  # noqa: BLE001  (Triton and inductor raise their own types)
                rows.append(Row(shape, dtype, causal, "flex-attention", float("nan"), str(exc).splitlines()[0][:60]))
    del triples
    return rows


#: Backward targets of issue #5 (float32): ours against torch's backends, speed-up wanted.
BACKWARD_SHAPES = [(4, 16, 4096, 64), (2, 16, 8192, 128)]
BACKWARD_TARGETS = (("torch-math", 1.5), ("torch-efficient", 1.0))
BACKWARD_BACKENDS = ("MATH", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION")


def run_backward_case(shape, dtype, causal, repeats, torch, baselines=(), peers=PEERS, device_only=False):
    """Backward and forward + backward through autograd: flash2 (numba_flash.torch; on Hopper its wgmma backward), with
    deterministic=False too where that changes the kernel (16-bit), and torch's backends."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from .. import torch as nft

    tdtype = getattr(torch, dtype)
    q, k, v = (torch.randn(shape, device="cuda", dtype=tdtype, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device="cuda", dtype=tdtype)
    implementations = [("flash2", lambda: nft.attention(q, k, v, causal=causal))]
    if dtype != "float32":   # dQ's parts added in any order (Hopper's backward; elsewhere the same kernel as flash2)
        implementations.append(("flash2-nondeterministic",
                                lambda: nft.attention(q, k, v, causal=causal, deterministic=False)))
    for baseline in baselines:
        implementations.append((f"flash2@{baseline.label}",
                                partial(baseline.torch.attention, q, k, v, causal=causal)))
    for backend in (b for b in BACKWARD_BACKENDS if SHORT_NAMES[b] in peers):
        def call(backend=backend):
            with sdpa_kernel(getattr(SDPBackend, backend)):
                return sdpa(q, k, v, is_causal=causal)
        implementations.append((SHORT_NAMES[backend], call))
    flex = flex_attention(torch, causal, shape[2], shape[2], shape[3]) if "flex-attention" in peers else None
    if flex is not None:
        implementations.append(("flex-attention", lambda: flex(q, k, v)))
    rows = []
    for name, forward in implementations:
        try:
            backward_ms = time_ms(partial(torch.autograd.grad, forward(), (q, k, v), grad_out, retain_graph=True),
                                  repeats=repeats, warmup=3, device_only=device_only)  # the partial frees the graph
            both_ms = time_ms(lambda: torch.autograd.grad(forward(), (q, k, v), grad_out), repeats=repeats, warmup=3,
                              device_only=device_only)
            rows.append(Row(shape, dtype, causal, f"{name} bwd", backward_ms, flop_factor=2.5))
            rows.append(Row(shape, dtype, causal, f"{name} fwd+bwd", both_ms, flop_factor=3.5))
        except Exception as exc:  # noqa: BLE001  (unavailable for this case; Triton raises its own types)
            note = str(exc).splitlines()[0][:60]
            rows.append(Row(shape, dtype, causal, f"{name} bwd", float("nan"), note, 2.5))
            rows.append(Row(shape, dtype, causal, f"{name} fwd+bwd", float("nan"), note, 3.5))
    return rows


#: Shapes of the host-time loop: the smallest call (all host), and one that models train at (where the
#: GPU sets the pace once the launch queue is full: the host column then shows the GPU's time).
HOST_SHAPES = [(1, 1, 128, 64), (8, 16, 1024, 64)]


@dataclass
class HostRow:
    shape: tuple
    dtype: str
    implementation: str
    host_us: float       # per call, the loop's host time (nothing waits for the GPU)
    total_us: float      # per call, until the GPU has finished too


def run_host(shape, dtype, calls, torch, baselines=()):
    """Host time per call: ``calls`` calls back to back, one synchronisation at the end.

    numba-flash's forward on torch tensors and on Numba arrays, forward and
    backward through ``numba_flash.torch``, and torch's flash backend the same
    ways (its fastest path); the baselines' where given.
    """
    import gc
    import time

    from numba import cuda
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from .. import torch as nft

    tdtype = getattr(torch, dtype)
    q, k, v, grad = (torch.randn(shape, device="cuda", dtype=tdtype) for _ in range(4))
    trained = tuple(x.clone().requires_grad_() for x in (q, k, v))
    views = tuple(cuda.as_cuda_array(x) for x in (q, k, v))

    def step(attention_function):
        """A training step's attention: forward, then backward into q.grad, k.grad, v.grad."""
        def call():
            attention_function(*trained).backward(grad)
        return call

    # (name, call, torch's backend to select around the whole loop, or None)
    cases = [
        ("numba-flash forward, torch tensors", lambda: attention(q, k, v), None),
        ("numba-flash forward, Numba arrays", lambda: attention(*views), None),
        ("numba-flash forward+backward", step(nft.attention), None),
        ("torch-flash forward", lambda: sdpa(q, k, v), SDPBackend.FLASH_ATTENTION),
        ("torch-flash forward+backward", step(sdpa), SDPBackend.FLASH_ATTENTION),
    ]
    for baseline in baselines:
        cases += [(f"flash2@{baseline.label} forward, torch tensors", partial(baseline.attention, q, k, v), None),
                  (f"flash2@{baseline.label} forward+backward", step(baseline.torch.attention), None)]
    rows = []
    for name, call, backend in cases:
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            try:
                for _ in range(10):  # compile, plan, warm the allocators
                    call()
            except (RuntimeError, TypeError, ValueError) as exc:
                note = str(exc).splitlines()[0][:50]
                rows.append(HostRow(shape, dtype, f"{name} ({note})", float("nan"), float("nan")))
                continue
            torch.cuda.synchronize()
            # A full garbage collection now, not inside the loop: after the first calls compiled
            # kernels (many new objects), one would land in the first timed loop and cost more
            # than its 1000 calls (seen on the H200: the first loop of a run at 184 us per call, every
            # later one at 18-27 us).
            gc.collect()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            host = time.perf_counter() - start
            torch.cuda.synchronize()
            total = time.perf_counter() - start
        rows.append(HostRow(shape, dtype, name, 1e6 * host / calls, 1e6 * total / calls))
    for x in trained:
        x.grad = None
    return rows


def format_host_table(rows):
    lines = ["| shape (B,H,N,d) | dtype | call | host us per call | us per call with the GPU |", "|---|---|---|---|---|"]
    lines += [f"| {r.shape} | {r.dtype} | {r.implementation} | {r.host_us:.1f} | {r.total_us:.1f} |" for r in rows]
    return "\n".join(lines)


def load_baseline(path):
    """Another copy of numba-flash (a package folder, e.g. an earlier commit's) imported beside this one."""
    import importlib
    import sys

    folder, name = os.path.split(os.path.abspath(path))
    sys.path.insert(0, folder)
    module = importlib.import_module(name)
    module.torch = importlib.import_module(name + ".torch")
    module.label = name.rsplit("_", 1)[-1]
    return module


def backward_target_summary(rows):
    """Issue #5's float32 backward targets, checked on these rows (lines of text)."""
    ms = {(r.shape, r.dtype, r.causal, r.implementation): r.ms for r in rows}
    lines = []
    for (shape, dtype, causal, impl), ours in ms.items():
        if impl != "flash2 bwd" or dtype != "float32":
            continue
        for baseline, target in BACKWARD_TARGETS:
            theirs = ms.get((shape, dtype, causal, f"{baseline} bwd"), float("nan"))
            if not np.isnan(theirs):
                ratio = theirs / ours
                lines.append(f"{shape} causal={causal}: flash2 backward is {ratio:.2f}x {baseline}'s "
                             f"(target {target:.1f}x: {'met' if ratio >= target else 'missed'})")
    return lines


def format_table(rows, baseline="flash2"):
    """A markdown table: one line per (case, implementation), ratios against ``baseline``."""
    lines = ["| shape (B,H,N,d) | dtype | causal | implementation | ms | TFLOP/s | % of peak | "
             f"{baseline} speed-up |", "|---|---|---|---|---|---|---|---|"]
    cases = {}
    for row in rows:
        cases.setdefault((row.shape, row.dtype, row.causal), []).append(row)
    for (shape, dtype, causal), group in cases.items():
        for r in group:
            # Each row is compared with ours of the same kind (forward, bwd or fwd+bwd).
            kind = r.implementation.partition(" ")[2]
            ours = next((o for o in group if o.implementation == (f"{baseline} {kind}" if kind else baseline)), None)
            if np.isnan(r.ms):
                lines.append(f"| {shape} | {dtype} | {causal} | {r.implementation} | n/a | | | {r.note} |")
                continue
            ratio = f"{r.ms / ours.ms:.2f}x" if ours is not None and r is not ours else ""
            lines.append(f"| {shape} | {dtype} | {causal} | {r.implementation} | {r.ms:.3f} | {r.tflops:.1f} | "
                         f"{100 * r.tflops / PEAK_TFLOPS[dtype]:.0f}% | {ratio} |")
    return "\n".join(lines)


def target_summary(rows):
    """Issue #3's float32 targets, checked on these rows (lines of text)."""
    lines = []
    ms = {(r.shape, r.dtype, r.causal, r.implementation): r.ms for r in rows}
    for (shape, dtype, causal, impl), ours in ms.items():
        if impl != "flash2" or dtype != "float32":
            continue
        for baseline, target in (("torch-math", 2.0), ("torch-efficient", 1.0)):
            theirs = ms.get((shape, dtype, causal, baseline), float("nan"))
            if not np.isnan(theirs):
                ratio = theirs / ours
                lines.append(f"{shape} causal={causal}: flash2 is {ratio:.2f}x {baseline} "
                             f"(target {target:.1f}x: {'met' if ratio >= target else 'missed'})")
    for (shape, dtype, causal, impl), ours in ms.items():
        if impl == "flash2" and causal and shape[2] == 8192:
            full = ms.get((shape, dtype, False, "flash2"))
            if full:
                lines.append(f"{shape} {dtype}: causal is {full / ours:.2f}x faster than non-causal (target 1.6x)")
    return lines


#: Issue 15's 16-bit targets: flash2 against torch's flash backend (FlashAttention-2), forward and fwd+bwd.
SIXTEEN_BIT_TARGETS = {"": 0.8, "fwd+bwd": 0.6}
#: ``--sixteen-bit``: issue 15's shapes, the forward at all three (dense and causal), forward + backward at
#: the first two, in float16 and bfloat16, with torch's flash and cuDNN backends and FlexAttention beside.
SIXTEEN_BIT_FORWARD_SHAPES = [(4, 16, 4096, 64), (2, 16, 8192, 128), (1, 16, 16384, 64)]
SIXTEEN_BIT_BACKWARD_SHAPES = SIXTEEN_BIT_FORWARD_SHAPES[:2]
SIXTEEN_BIT_PEERS = ("torch-flash", "torch-cudnn", "flex-attention")


def sixteen_bit_summary(rows):
    """flash2's speed in float16/bfloat16 against torch-flash (issue 15's targets) and FlexAttention (lines)."""
    ms = {(r.shape, r.dtype, r.causal, r.implementation): r.ms for r in rows}
    lines = []
    for (shape, dtype, causal, impl), ours in ms.items():
        kind = impl.partition(" ")[2]
        if impl.partition(" ")[0] != "flash2" or dtype == "float32" or kind not in SIXTEEN_BIT_TARGETS:
            continue
        suffix = f" {kind}" if kind else ""
        target = SIXTEEN_BIT_TARGETS[kind]
        flash = ms.get((shape, dtype, causal, f"torch-flash{suffix}"), float("nan"))
        flex = ms.get((shape, dtype, causal, f"flex-attention{suffix}"), float("nan"))
        if not np.isnan(flash):
            ratio = flash / ours
            lines.append(f"{shape} {dtype} causal={causal}{suffix}: flash2 is {ratio:.2f}x torch-flash (target "
                         f"{target:.1f}x: {'met' if ratio >= target else 'missed'})"
                         + ("" if np.isnan(flex) else f", {flex / ours:.2f}x FlexAttention"))
    return lines


def write_results(rows, out_dir, tag, command, backward=False, device_only=False):
    os.makedirs(out_dir, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    inputs = ("one set of inputs per case (through autograd, as training runs it)" if backward
              else "fresh inputs rotated among 3 sets")
    region = ("GPU time only (the stream held while the host issues each call: `time_ms(device_only=True)`)"
              if device_only else "the whole call, host time to the first launch included")
    header = (f"Command: `{command}`  \nDevice: {device_limits().name}  \nDate: {stamp}  \n"
              f"Host: {platform.node()}; median of CUDA-event timings of {region}, {inputs}.\n")
    csv_path = os.path.join(out_dir, f"{tag}.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["batch", "heads", "n", "d", "dtype", "causal", "implementation", "ms", "tflops", "note"])
        for r in rows:
            writer.writerow([*r.shape, r.dtype, r.causal, r.implementation, f"{r.ms:.4f}",
                             "" if np.isnan(r.ms) else f"{r.tflops:.2f}", r.note])
    md_path = os.path.join(out_dir, f"{tag}.md")
    with open(md_path, "w") as f:
        title, issue, summary = (("Backward attention benchmark", 5, backward_target_summary(rows)) if backward
                                 else ("Forward attention benchmark", 3, target_summary(rows)))
        f.write(f"# {title}\n\n{header}\n{format_table(rows)}\n\n## Targets (issue #{issue})\n\n")
        f.write("".join(f"- {line}\n" for line in summary))
        sixteen = sixteen_bit_summary(rows)
        if sixteen:
            f.write("\n## 16-bit targets (issue 15)\n\n" + "".join(f"- {line}\n" for line in sixteen))
    return csv_path, md_path


def main(args):
    if in_simulator():
        print("The benchmark needs a GPU (it times CUDA kernels); the simulator has none.")
        return 2
    torch = _torch()
    if torch is None:
        print("torch with CUDA is not importable: timing numba-flash only.")
    if args.backward and torch is None:
        print("The backward benchmark runs through autograd: it needs torch with CUDA.")
        return 2
    baselines = [load_baseline(path) for path in args.baseline or ()]
    if args.host:
        rows = []
        for shape in [tuple(s) for s in args.shape] if args.shape else HOST_SHAPES:
            for dtype in args.dtypes.split(","):
                new = run_host(shape, dtype, args.calls, torch, baselines)
                rows.extend(new)
                print(format_host_table(new).split("\n", 2)[2], flush=True)
        table = format_host_table(rows)
        print(table)
        if args.out:
            path = os.path.join(args.out, f"{args.tag}.md")
            with open(path, "w") as f:
                f.write(f"# Host time per call\n\nCommand: `{args.command or 'numba-flash bench --host'}`  \n"
                        f"Device: {device_limits().name}  \nDate: {datetime.date.today().isoformat()}  \n"
                        f"{args.calls} calls back to back, one synchronisation at the end.\n\n{table}\n")
            print("wrote", path)
        return 0
    algorithms = args.algorithms.split(",")
    peers = args.peers.split(",") if args.peers else (SIXTEEN_BIT_PEERS if args.sixteen_bit else PEERS)
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise SystemExit(f"--peers: unknown {', '.join(unknown)} (known: {', '.join(PEERS)})")
    if args.sixteen_bit:   # (backward?, shapes): the forward's cases, then forward + backward's
        if args.backward or args.shape:
            raise SystemExit("--sixteen-bit chooses its own shapes and runs forward and backward: "
                             "leave out --shape and --backward")
        dtypes = "float16,bfloat16" if args.dtypes == DEFAULT_DTYPES else args.dtypes
        plan = [(False, SIXTEEN_BIT_FORWARD_SHAPES), (True, SIXTEEN_BIT_BACKWARD_SHAPES)]
    else:
        dtypes = args.dtypes
        plan = [(args.backward, [tuple(s) for s in args.shape] if args.shape else
                 (BACKWARD_SHAPES if args.backward else DEFAULT_SHAPES))]
    rows = []
    for backward, shapes in plan:
        for dtype in dtypes.split(","):
            for shape in shapes:
                for causal in (False, True):
                    if backward:
                        new = run_backward_case(shape, dtype, causal, args.repeats, torch, baselines, peers,
                                                args.device_time)
                    else:
                        new = run_case(shape, dtype, causal, algorithms, args.repeats, torch, baselines, peers,
                                       args.device_time)
                    rows.extend(new)
                    print(format_table(new).split("\n", 2)[2], flush=True)
    table = format_table(rows)
    print(table)
    print("\n".join((backward_target_summary(rows) if args.backward else target_summary(rows))
                    + sixteen_bit_summary(rows)))
    if args.out:
        paths = write_results(rows, args.out, args.tag, args.command or "numba-flash bench",
                              args.backward and not args.sixteen_bit, args.device_time)
        print("wrote", *paths)
    return 0
