"""lltm_sequence's engine variants against each other and nn.LSTM, each
variant switched by its environment variable in one process:

* inference: a ``no_grad`` forward (``lltm_op::sequence_inference``) with the
  op's chunk rule against all steps at once
  (``LLTM_OP_SEQUENCE_INFERENCE_CHUNKS=1``), nn.LSTM's no_grad forward, and
  the peak memory of each against a loop of ``lltm_op.lltm`` cells that
  collects its outputs;
* clusters (CUDA, sm_90): the tensor-core forward as thread-block clusters
  (``LLTM_OP_SEQUENCE_CLUSTERS=1``, opt-in) against the global-barrier
  kernel (``=0``, the default), forward alone and forward+backward, with
  nn.LSTM, and whether their outputs are bitwise equal;
* local (CUDA, sm_80+): the rule's tensor-core kernels (block-local, on
  clusters of blocks on sm_90, where the rule takes them: see the README)
  against the global-barrier ones (``LLTM_OP_SEQUENCE_LOCAL=0``): GPU time
  of the recurrent kernels alone per step (torch.profiler, the median of
  the rounds), forward and backward, at T256, S 32 to 256 (a ratio of
  1.00x is a size the rule leaves to the global-barrier kernels);
* resident (CUDA): full-precision float32 (TF32 off for both) on the rule's
  engine, the resident-weight FMA kernels where it takes them, against the
  engine without them (``LLTM_OP_SEQUENCE_RESIDENT=0``: the fused kernels
  that read their weights from L2 every step, or the cuBLAS products) and
  nn.LSTM, forward (``no_grad``) and forward+backward, at T256, B 8 / 64 /
  256, S 128 to 1024 (1.00x: a size the rule leaves to cuBLAS);
* shapes (CUDA, sm_80+): the global-barrier tensor-core kernels (the
  block-local ones off) in the rule's block shape and in each shape forced
  by ``LLTM_OP_SEQUENCE_TC_SHAPE`` (1000 q + bm): GPU time of the recurrent
  kernels alone per step, as the local table measures it ("-": a shape
  whose grid does not fit, so that another path ran).

    python bench/bench_lltm_sequence_variants.py [--table inference|clusters|local|resident|shapes] [--repeat N]
        [--quick]

F = S throughout. Synchronized wall time per call, median, the variants of a
size timed in alternating rounds. float32: ours full float32, nn.LSTM at
torch's defaults (cuDNN TF32). --quick: tiny sizes on the CPU (inference
table only), a smoke run.
"""

from __future__ import annotations

import argparse

import torch
from bench_lltm_sequence import loop_of, peak_mib, with_flags  # this folder: run as python bench/<script>.py
from lltm_op import lltm, lltm_sequence
from opscommon.bench import interleaved_wall_times_us

INFERENCE_SIZES = [(64, 8, 128), (64, 64, 256), (64, 256, 512), (256, 64, 512), (1024, 8, 128), (1024, 64, 256)]
INFERENCE_SIZES += [(1024, 256, 512)]
CLUSTER_SIZES = [(T, B, S) for T in (1024, 64) for B in (8, 64, 256) for S in (128, 256, 512)]
LOCAL_SIZES = [(256, B, S) for S in (32, 64, 96, 128, 256) for B in (8, 64, 256)]
RESIDENT_SIZES = [(256, B, S) for S in (128, 256, 512, 1024) for B in (8, 64, 256)]
SHAPE_CASES = [
    (1024, 8, 1024, torch.float16),
    (1024, 8, 1024, torch.bfloat16),
    (1024, 8, 1024, torch.float32),
    (1024, 64, 1024, torch.float16),
    (256, 256, 1024, torch.bfloat16),
]
TC_SHAPES = [1016, 2016, 4016, 1032, 2032, 1064, 2064, 4064, 2128, 4128]
QUICK_SIZES = [(8, 4, 16), (40, 2, 8)]


def make(T, B, S, dtype, device, grad=False):
    gen = torch.Generator().manual_seed(T + B + S)
    x = torch.randn(T, B, S, generator=gen)
    w = torch.randn(3 * S, 2 * S, generator=gen) / S**0.5
    b = torch.randn(3 * S, generator=gen) / S**0.5
    h, c = torch.randn(B, S, generator=gen), torch.randn(B, S, generator=gen)
    return [t.to(device, dtype).requires_grad_(grad) for t in (x, w, b, h, c)]


def lstm_of(S, dtype, device):
    lstm = torch.nn.LSTM(S, S).to(device, dtype)
    lstm.flatten_parameters()
    return lstm


def inference_table(device, sizes, dtypes, repeat):
    print(
        "| T B S dtype | default | all steps at once | nn.LSTM | ratio | "
        "peak MiB: default | all at once | loop of cells |"
    )
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for T, B, S in sizes:
        for dtype in dtypes:
            args = make(T, B, S, dtype, device)
            lstm = lstm_of(S, dtype, device)
            state = (args[3][None], args[4][None])

            def ours():
                return lltm_sequence(*args)

            fns = {
                "default": ours,
                "one": with_flags(ours, inference_chunks="1"),
                "lstm": lambda lstm=lstm, x=args[0], state=state: lstm(x, state),
            }
            with torch.no_grad():
                ms = {k: v / 1e3 for k, v in interleaved_wall_times_us(fns, warmup=3, repeat=repeat).items()}
                mib = {k: peak_mib(fns[k], device) for k in ("default", "one")}
                mib["loop"] = peak_mib(lambda args=args: loop_of(lltm)(*args), device)
            peaks = " | ".join("n/a" if v is None else f"{v:.1f}" for v in mib.values())
            print(
                f"| T{T} B{B} S{S} {str(dtype)[6:]} | {ms['default']:.3f} ms | {ms['one']:.3f} ms | "
                f"{ms['lstm']:.3f} ms | {ms['default'] / ms['lstm']:.2f}x | {peaks} |",
                flush=True,
            )


def sequence_calls(T, B, S, dtype):
    """lltm_sequence and nn.LSTM (same sizes, on CUDA) as four calls: each
    one's no_grad forward and its forward+backward (the gradients of the
    outputs' and h_n's sums with respect to every argument)."""
    args = make(T, B, S, dtype, "cuda", grad=True)
    lstm = lstm_of(S, dtype, "cuda")
    state = [t.detach()[None].requires_grad_() for t in args[3:]]
    lstm_args = [args[0], *state, *lstm.parameters()]

    def fwd():
        with torch.no_grad():
            return lltm_sequence(*args)

    def fwd_bwd():
        out, (h_n, c_n) = lltm_sequence(*args)
        return torch.autograd.grad(out.float().sum() + h_n.float().sum(), args)

    def lstm_fwd():
        with torch.no_grad():
            return lstm(args[0], tuple(state))

    def lstm_fwd_bwd():
        out, (h_n, c_n) = lstm(args[0], tuple(state))
        return torch.autograd.grad(out.float().sum() + h_n.float().sum(), lstm_args)

    return fwd, fwd_bwd, lstm_fwd, lstm_fwd_bwd


def cluster_table(sizes, dtypes, repeat):
    print(
        "| T B S dtype | fwd clusters | fwd global | nn.LSTM fwd | fwd ratio | "
        "f+b clusters | f+b global | nn.LSTM f+b | f+b ratio | same bits |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for T, B, S in sizes:
        for dtype in dtypes:
            fwd, fwd_bwd, lstm_fwd, lstm_fwd_bwd = sequence_calls(T, B, S, dtype)
            fns = {
                "fwd clusters": with_flags(fwd, clusters="1"),
                "fwd global": with_flags(fwd, clusters="0"),
                "lstm fwd": lstm_fwd,
                "f+b clusters": with_flags(fwd_bwd, clusters="1"),
                "f+b global": with_flags(fwd_bwd, clusters="0"),
                "lstm f+b": lstm_fwd_bwd,
            }
            ms = {k: v / 1e3 for k, v in interleaved_wall_times_us(fns, warmup=3, repeat=repeat).items()}
            same = torch.equal(fns["fwd clusters"]()[0], fns["fwd global"]()[0])
            print(
                f"| T{T} B{B} S{S} {str(dtype)[6:]} | {ms['fwd clusters']:.3f} | {ms['fwd global']:.3f} | "
                f"{ms['lstm fwd']:.3f} | {ms['fwd clusters'] / ms['lstm fwd']:.2f}x | {ms['f+b clusters']:.3f} | "
                f"{ms['f+b global']:.3f} | {ms['lstm f+b']:.3f} | {ms['f+b clusters'] / ms['lstm f+b']:.2f}x | "
                f"{'yes' if same else 'no'} |",
                flush=True,
            )


def recurrent_kernel_us(fn, steps: int, repeat: int) -> dict[str, float]:
    """GPU time per step of the sequence's recurrent kernels in one call of
    fn (forward: "forward_tc", backward: "backward_tc" kernels), median over
    `repeat` profiled calls."""
    fn()
    torch.cuda.synchronize()
    times = {"forward": [], "backward": []}
    for _ in range(repeat):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        for kind in times:
            us = sum(e.device_time for e in prof.events() if f"{kind}_tc" in e.name and e.device_time > 0)
            times[kind].append(us / steps)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def local_table(sizes, repeat):
    print("| T B S dtype (us a step) | fwd local | fwd global | ratio | bwd local | bwd global | ratio |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for T, B, S in sizes:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            args = make(T, B, S, dtype, "cuda", grad=True)

            def fwd_bwd():
                out, (h_n, c_n) = lltm_sequence(*args)
                torch.autograd.grad(out.float().sum() + h_n.float().sum(), args)

            # float32 runs the tensor-core kernels on TF32 only.
            got = {
                way: recurrent_kernel_us(with_flags(fwd_bwd, local=flag, tf32=True), T, repeat)
                for way, flag in (("local", "1"), ("global", "0"))
            }
            name = "f32 TF32" if dtype == torch.float32 else str(dtype)[6:]
            lf, lb = got["local"]["forward"], got["local"]["backward"]
            gf, gb = got["global"]["forward"], got["global"]["backward"]
            print(
                f"| T{T} B{B} S{S} {name} | {lf:.2f} | {gf:.2f} | {lf / gf:.2f}x | {lb:.2f} | {gb:.2f} | "
                f"{lb / gb:.2f}x |",
                flush=True,
            )


def resident_table(sizes, repeat):
    print(
        "| T B S | fwd | fwd without | nn.LSTM fwd | fwd ratio (without) | "
        "f+b | f+b without | nn.LSTM f+b | f+b ratio (without) |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for T, B, S in sizes:
        fwd, fwd_bwd, lstm_fwd, lstm_fwd_bwd = sequence_calls(T, B, S, torch.float32)
        full = {"tf32": False, "cudnn_tf32": False}
        fns = {
            "fwd": with_flags(fwd, **full),
            "fwd without": with_flags(fwd, resident="0", **full),
            "lstm fwd": with_flags(lstm_fwd, **full),
            "f+b": with_flags(fwd_bwd, **full),
            "f+b without": with_flags(fwd_bwd, resident="0", **full),
            "lstm f+b": with_flags(lstm_fwd_bwd, **full),
        }
        ms = {k: v / 1e3 for k, v in interleaved_wall_times_us(fns, warmup=2, repeat=repeat).items()}
        print(
            f"| T{T} B{B} S{S} | {ms['fwd']:.3f} | {ms['fwd without']:.3f} | {ms['lstm fwd']:.3f} | "
            f"{ms['fwd'] / ms['lstm fwd']:.2f}x ({ms['fwd without'] / ms['lstm fwd']:.2f}x) | {ms['f+b']:.3f} | "
            f"{ms['f+b without']:.3f} | {ms['lstm f+b']:.3f} | "
            f"{ms['f+b'] / ms['lstm f+b']:.2f}x ({ms['f+b without'] / ms['lstm f+b']:.2f}x) |",
            flush=True,
        )
        torch.cuda.empty_cache()


def shapes_table(cases, repeat):
    print("| T B S dtype (us a step) | block shape | fwd | bwd |")
    print("|---|---|---|---|", flush=True)
    for T, B, S, dtype in cases:
        args = make(T, B, S, dtype, "cuda", grad=True)

        def fwd_bwd():
            out, (h_n, c_n) = lltm_sequence(*args)
            torch.autograd.grad(out.float().sum() + h_n.float().sum(), args)

        name = "f32 TF32" if dtype == torch.float32 else str(dtype)[6:]
        for shape in [None, *TC_SHAPES]:
            flags = {"local": "0", "tf32": True}
            if shape is not None:
                flags["tc_shape"] = str(shape)
            got = recurrent_kernel_us(with_flags(fwd_bwd, **flags), T, repeat)
            label = "the rule's" if shape is None else f"q{shape // 1000} bm{shape % 1000}"
            cells = [f"{got[k]:.2f}" if got[k] > 0 else "-" for k in ("forward", "backward")]
            print(f"| T{T} B{B} S{S} {name} | {label} | {cells[0]} | {cells[1]} |", flush=True)
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--table",
        choices=["inference", "clusters", "local", "resident", "shapes"],
        default=None,
        help="one table (default: all)",
    )
    parser.add_argument("--repeat", type=int, default=15, help="timed rounds per size")
    parser.add_argument("--quick", action="store_true", help="tiny sizes on the CPU (smoke run)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}", flush=True)
    if args.table in (None, "inference"):
        sizes = QUICK_SIZES if device == "cpu" else INFERENCE_SIZES
        dtypes = [torch.float32] if device == "cpu" else [torch.bfloat16, torch.float16, torch.float32]
        inference_table(device, sizes, dtypes, args.repeat)
    if args.table in (None, "clusters"):
        if device != "cuda" or torch.cuda.get_device_capability()[0] < 9:
            print("clusters: needs a CUDA device of sm_90 or newer (skipped)")
        else:
            cluster_table(CLUSTER_SIZES, [torch.float16, torch.bfloat16], args.repeat)
    if args.table in (None, "local"):
        if device != "cuda" or torch.cuda.get_device_capability()[0] < 8:
            print("local: needs a CUDA device of sm_80 or newer (skipped)")
        else:
            local_table(LOCAL_SIZES, min(args.repeat, 5))
    if args.table in (None, "resident"):
        if device != "cuda":
            print("resident: needs a CUDA device (skipped)")
        else:
            resident_table(RESIDENT_SIZES, min(args.repeat, 5))
    if args.table in (None, "shapes"):
        if device != "cuda" or torch.cuda.get_device_capability()[0] < 8:
            print("shapes: needs a CUDA device of sm_80 or newer (skipped)")
        else:
            shapes_table(SHAPE_CASES, min(args.repeat, 5))


if __name__ == "__main__":
    main()
