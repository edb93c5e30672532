"""lltm_op.lltm_sequence against a Python loop of lltm_op.lltm cells on the
CPU, every floating dtype, forward only (no_grad) and forward+backward.

    python bench/bench_lltm_sequence_cpu.py [--threads 1 0] [--repeat N] [--sizes T,B,F,S ...]
                                            [--dtypes float16 ...] [--out FILE]

Wall time per call, median; both variants of a (size, dtype, pass) timed in
alternating rounds in one process (the host's speed drifts on a shared
machine: interleaving spreads the drift over both alike). ``--threads 0`` is
torch's default thread count. Forward+backward: gradients of outputs, h_n and
c_n (random) with respect to input, weights, bias, h_0 and c_0.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lltm_op
import torch
from lltm_op import lltm, lltm_sequence
from opscommon.bench import interleaved_wall_times_us

SIZES = [(64, 16, 32, 128), (32, 64, 256, 256)]
DTYPES = ["float16", "bfloat16", "float32", "float64"]


def make_inputs(T, B, F, S, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    stdv = 1.0 / S**0.5
    args = [
        torch.randn(T, B, F, generator=gen),
        (torch.rand(3 * S, S + F, generator=gen) * 2 - 1) * stdv,
        (torch.rand(3 * S, generator=gen) * 2 - 1) * stdv,
        torch.randn(B, S, generator=gen),
        torch.randn(B, S, generator=gen),
    ]
    grads = [torch.randn(T, B, S, generator=gen), torch.randn(B, S, generator=gen), torch.randn(B, S, generator=gen)]
    return [a.to(dtype).requires_grad_() for a in args], [g.to(dtype) for g in grads]


def sequence(x, w, b, h, c):
    outputs, (h_n, c_n) = lltm_sequence(x, w, b, h, c)
    return outputs, h_n, c_n


def loop_of_cells(x, w, b, h, c):
    outs = []
    for t in range(x.shape[0]):
        h, c = lltm(x[t], w, b, h, c)
        outs.append(h)
    return torch.stack(outs), h, c


def variants(inputs, grads):
    def forward(fn):
        def run():
            with torch.no_grad():
                return fn(*inputs)

        return run

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(*inputs), inputs, grads)

    return {
        "forward": {"sequence": forward(sequence), "cells": forward(loop_of_cells)},
        "forward+backward": {"sequence": fwd_bwd(sequence), "cells": fwd_bwd(loop_of_cells)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 0], help="0: torch's default")
    parser.add_argument("--repeat", type=int, default=15, help="timed rounds per row")
    parser.add_argument("--sizes", nargs="+", default=None, help="T,B,F,S (default: %(default)s)")
    parser.add_argument("--dtypes", nargs="+", default=DTYPES, choices=DTYPES)
    parser.add_argument("--out", default=None, help="write the table (markdown) here too")
    args = parser.parse_args()
    sizes = [tuple(int(v) for v in s.split(",")) for s in args.sizes] if args.sizes else SIZES
    default_threads = torch.get_num_threads()
    header = f"lltm_op {lltm_op.__version__}, torch {torch.__version__}, CPU, default threads {default_threads}"
    print(header, flush=True)
    lines = [
        "| threads | T, B, F, S | dtype | pass | lltm_sequence | loop of cells | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for threads in args.threads:
        torch.set_num_threads(threads or default_threads)
        for T, B, F, S in sizes:
            for dname in args.dtypes:
                inputs, grads = make_inputs(T, B, F, S, getattr(torch, dname))
                for name, fns in variants(inputs, grads).items():
                    us = interleaved_wall_times_us(fns, warmup=2, repeat=args.repeat, sync=False)
                    ms = {k: v / 1e3 for k, v in us.items()}
                    line = (
                        f"| {threads or default_threads} | {T}, {B}, {F}, {S} | {dname} | {name} | "
                        f"{ms['sequence']:.2f} ms | {ms['cells']:.2f} ms | {ms['sequence'] / ms['cells']:.2f}x |"
                    )
                    lines.append(line)
                    print(line, flush=True)
    torch.set_num_threads(default_threads)
    if args.out:
        Path(args.out).write_text(header + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
