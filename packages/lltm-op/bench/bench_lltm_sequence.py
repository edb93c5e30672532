"""The LLTM over whole sequences: lltm_op.lltm_sequence against a loop of
lltm_op cells, a loop of pure-PyTorch cells, torch.compile of that loop and
nn.LSTM (cuDNN) of the same sizes.

    python bench/bench_lltm_sequence.py [--out DIR] [--quick] [--no-compile] [--repeat N] [--modules-only]

Forward+backward of a whole sequence (gradients of outputs, h_n and c_n,
random, with respect to input, weights, bias, h_0 and c_0; nn.LSTM: input,
h_0, c_0 and its four parameters), synchronized wall time per call, median,
all variants of a size timed in alternating rounds in one process. Also the
peak GPU memory of one forward+backward of each, above its inputs.

float32 matrix products: torch's default is full float32 (cuBLAS without
TF32, `torch.backends.cuda.matmul.allow_tf32=False`) while cuDNN's default
for nn.LSTM is TF32 (`torch.backends.cudnn.allow_tf32=True`). At float32 the
table therefore also has lltm_sequence with TF32 matrix products and nn.LSTM
without TF32, so each comparison is made at one precision.

At the small size, lltm_sequence's CUDA step paths are also timed on their
own: fused (LLTM_OP_SEQUENCE_FUSED=1: the persistent kernels), a fused kernel
launched per step (and LLTM_OP_SEQUENCE_PERSISTENT=0) and cuBLAS
(LLTM_OP_SEQUENCE_FUSED=0).

Then the module rows (alone with --modules-only): ``LLTMSequence`` against
``nn.LSTM`` with the same arguments, forward+backward (gradients of the
output and final states with respect to every parameter): two layers,
bidirectional; and on a ``PackedSequence`` of variable lengths (uniform in
[T/4, T], unsorted, packed once, the same for both) with one layer and with
two layers, bidirectional. A packed row names its number of segments of
constant batch size and also times LLTMSequence's packed routes by name:
one op call per layer and direction with the op's batch_sizes ("one call",
the default), and one op call per segment, layer and direction
("segments", the route under forward AD, torch.func, autocast and
torch.compile).

--quick: tiny sizes on the CPU, a smoke run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import lltm_op
import torch
from lltm_op import lltm, lltm_reference, lltm_sequence
from lltm_op._runtime import BUILD_INFO
from opscommon.bench import interleaved_wall_times_us

SIZES = [
    ((64, 16, 32, 128), torch.float32),
    ((32, 256, 512, 1024), torch.float32),
    ((32, 256, 512, 1024), torch.bfloat16),
]
QUICK_SIZES = [((8, 4, 8, 16), torch.float32), ((4, 8, 16, 32), torch.bfloat16)]

OURS = "lltm_sequence"
OURS_TF32 = "lltm_sequence, TF32"
OURS_FUSED = "lltm_sequence, fused path"
OURS_STEPS = "lltm_sequence, fused kernel per step"
OURS_CUBLAS = "lltm_sequence, cuBLAS path"
CELLS = "loop of lltm_op cells"
PURE = "loop of pure cells"
COMPILED = "torch.compile(loop)"
LSTM = "nn.LSTM (cuDNN)"
LSTM_NO_TF32 = "nn.LSTM (cuDNN), no TF32"


def loop_of(cell):
    def run(x, w, b, h, c):
        outs = []
        for t in range(x.shape[0]):
            h, c = cell(x[t], w, b, h, c)
            outs.append(h)
        return torch.stack(outs), h, c

    return run


def sequence(x, w, b, h, c):
    outputs, (h_n, c_n) = lltm_sequence(x, w, b, h, c)
    return outputs, h_n, c_n


def with_flags(fn, *, tf32=None, cudnn_tf32=None, **env):
    """fn run with torch's TF32 flags / LLTM_OP_SEQUENCE_<NAME> variables
    (fused="1", persistent="0") set, then restored."""
    names = {f"LLTM_OP_SEQUENCE_{k.upper()}": v for k, v in env.items()}

    def run():
        old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        old_env = {k: os.environ.get(k) for k in names}
        if tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        if cudnn_tf32 is not None:
            torch.backends.cudnn.allow_tf32 = cudnn_tf32
        os.environ.update(names)
        try:
            return fn()
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
            for k, v in old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return run


def peak_mib(fn, device) -> float | None:
    if device != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2**20


def make_inputs(T, B, F, S, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    stdv = 1.0 / S**0.5
    f32 = dict(generator=gen, dtype=torch.float32)
    args = [
        torch.randn(T, B, F, **f32),
        (torch.rand(3 * S, S + F, **f32) * 2 - 1) * stdv,
        (torch.rand(3 * S, **f32) * 2 - 1) * stdv,
        torch.randn(B, S, **f32),
        torch.randn(B, S, **f32),
    ]
    args = [a.to(device=device, dtype=dtype).requires_grad_() for a in args]
    grads = [torch.randn(T, B, S, **f32), torch.randn(B, S, **f32), torch.randn(B, S, **f32)]
    return args, [g.to(device=device, dtype=dtype) for g in grads]


MODULE_SIZES = [((64, 32, 256, 256), torch.bfloat16), ((64, 32, 256, 256), torch.float32)]
QUICK_MODULE_SIZES = [((6, 4, 8, 16), torch.float32)]


def module_rows(device: str, sizes, repeat: int) -> tuple[list[str], list[dict]]:
    """LLTMSequence against nn.LSTM with the same arguments on the same
    input: 2 layers bidirectional (padded), and a PackedSequence of variable
    lengths (uniform in [T/4, T], packed once, unsorted) with one layer and
    with 2 layers bidirectional. Returns Markdown table lines and records."""
    import lltm_op.rnn as rnn
    from torch.nn.utils.rnn import pack_padded_sequence

    # The packed routes by name, each timed as a column of its own: "one
    # call", the op's batch_sizes (the default); "segments", one op call per
    # run of equal batch sizes (under forward AD / autocast / torch.compile).
    routes = {"one call": True, "segments": False}
    lines = [
        "| module case | T, B, F, S, dtype | LLTMSequence | nn.LSTM | ratio |"
        + "".join(f" LLTMSequence, {r} |" for r in routes),
        "|---|---|---|---|---|" + "---|" * len(routes),
    ]

    def by_route(fn, one_call: bool):
        def run():
            real = rnn._packed_plan
            rnn._packed_plan = lambda inp, bidirectional, _: real(inp, bidirectional, one_call)
            try:
                return fn()
            finally:
                rnn._packed_plan = real

        return run

    records = []
    for (T, B, F, S), dtype in sizes:
        dname = str(dtype).replace("torch.", "")
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(T, B, F, generator=gen).to(device, dtype)
        lengths = torch.randint(max(1, T // 4), T + 1, (B,), generator=gen)
        packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
        # Runs of equal batch sizes: the segment path's op calls per layer
        # and direction (the default packed path makes one).
        segments = len(torch.unique_consecutive(packed.batch_sizes))
        two = dict(num_layers=2, bidirectional=True)
        cases = {
            "2 layers, bidirectional": (two, x),
            f"packed, lengths U[T/4, T] ({segments} segments)": ({}, packed),
            f"packed, 2 layers, bidirectional ({segments} segments)": (two, packed),
        }
        for case, (kw, inp) in cases.items():
            ours = lltm_op.LLTMSequence(F, S, **kw).to(device, dtype)
            lstm = torch.nn.LSTM(F, S, **kw).to(device, dtype)
            lstm.flatten_parameters()

            def run(m, inp=inp):
                out, (h, c) = m(inp)
                data = out.data if hasattr(out, "batch_sizes") else out
                params = list(m.parameters())
                torch.autograd.grad((data.float().square().sum() + h.float().sum() + c.float().sum()), params)

            fns = {"ours": lambda m=ours: run(m), "lstm": lambda m=lstm: run(m)}
            if hasattr(inp, "batch_sizes"):
                for route, one_call in routes.items():
                    fns[route] = by_route(lambda m=ours: run(m), one_call)
            times = interleaved_wall_times_us(fns, warmup=3, repeat=repeat)
            ratio = times["ours"] / times["lstm"]
            extra = "".join(f" {times[r] / 1e3:.3f} ms |" if r in times else " |" for r in routes)
            lines.append(
                f"| {case} | T{T} B{B} F{F} S{S} {dname} | {times['ours'] / 1e3:.3f} ms | "
                f"{times['lstm'] / 1e3:.3f} ms | {ratio:.2f}x |{extra}"
            )
            records.append(
                {
                    "case": case,
                    "size": f"T{T} B{B} F{F} S{S} {dname}",
                    "ms": {
                        "LLTMSequence": times["ours"] / 1e3,
                        "nn.LSTM": times["lstm"] / 1e3,
                        **{f"LLTMSequence, {r}": times[r] / 1e3 for r in routes if r in times},
                    },
                    "ratio": ratio,
                }
            )
            print(lines[-1], flush=True)
            del ours, lstm
    return lines, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for lltm_sequence.md / .json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes on the CPU (smoke run)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile(loop)")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds per size")
    parser.add_argument(
        "--modules-only", action="store_true", help="only the LLTMSequence against nn.LSTM rows (2 layers, packed)"
    )
    parser.add_argument(
        "--module-size",
        default=None,
        help="T,B,F,S[,dtype] of the module rows (default: T64 B32 F256 S256 bf16 and f32; tiny on the CPU)",
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    sizes = QUICK_SIZES if device == "cpu" else SIZES
    repeat = args.repeat or (5 if device == "cpu" else 60)

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    build = f"CUDA {BUILD_INFO['cuda']}" if BUILD_INFO.get("cuda") else "CPU"
    header = (
        f"device: {name}; torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
        f"{torch.backends.cudnn.version()}); lltm_op {lltm_op.__version__} ({build} build)"
    )
    print(header, flush=True)

    results = []
    for (T, B, F, S), dtype in [] if args.modules_only else sizes:
        dname = str(dtype).replace("torch.", "")
        label = f"T{T} B{B} F{F} S{S} {dname}"
        inputs, grads = make_inputs(T, B, F, S, dtype, device)
        lstm = torch.nn.LSTM(F, S).to(device=device, dtype=dtype)
        # One contiguous weight buffer for cuDNN (otherwise nn.LSTM compacts
        # its weights on every call: a bfloat16 run on an H100 warned so).
        lstm.flatten_parameters()
        h0, c0 = (t.detach().unsqueeze(0).requires_grad_() for t in inputs[3:])
        lstm_inputs = [inputs[0], h0, c0, *lstm.parameters()]
        lstm_grads = [grads[0], grads[1].unsqueeze(0), grads[2].unsqueeze(0)]

        def fwd_bwd(fn):
            # the closures die with `variants`, before the `del` at the end of the loop
            return lambda: torch.autograd.grad(fn(*inputs), inputs, grads)  # noqa: F821

        def lstm_fwd_bwd():
            out, (h_n, c_n) = lstm(inputs[0], (h0, c0))  # noqa: F821
            return torch.autograd.grad((out, h_n, c_n), lstm_inputs, lstm_grads)

        variants = {
            OURS: fwd_bwd(sequence),
            CELLS: fwd_bwd(loop_of(lltm)),
            PURE: fwd_bwd(loop_of(lltm_reference)),
        }
        if not args.no_compile:
            compiled = torch.compile(loop_of(lltm_reference), fullgraph=True, dynamic=False)
            variants[COMPILED] = fwd_bwd(compiled)
        variants[LSTM] = lstm_fwd_bwd
        if device == "cuda" and dtype == torch.float32:
            variants[OURS_TF32] = with_flags(fwd_bwd(sequence), tf32=True)
            variants[LSTM_NO_TF32] = with_flags(lstm_fwd_bwd, cudnn_tf32=False)
        if device == "cuda" and (T, B, F, S) == (64, 16, 32, 128):
            variants[OURS_FUSED] = with_flags(fwd_bwd(sequence), fused="1")
            variants[OURS_STEPS] = with_flags(fwd_bwd(sequence), fused="1", persistent="0")
            variants[OURS_CUBLAS] = with_flags(fwd_bwd(sequence), fused="0")
        # Correctness of what is timed, once: ours against the loop of cells.
        got = variants[OURS]()
        want = variants[CELLS]()
        worst = max(
            ((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30)).item() for g, w in zip(got, want)
        )
        del got, want
        print(
            f"{label}: compiling/warming up {len(variants)} variants "
            f"(lltm_sequence vs loop of cells, worst gradient rel. diff {worst:.2e})",
            flush=True,
        )
        times = interleaved_wall_times_us(variants, warmup=3, repeat=repeat)
        memory = {v: peak_mib(fn, device) for v, fn in variants.items()}
        row = {
            "size": label,
            "T": T,
            "B": B,
            "F": F,
            "S": S,
            "dtype": dname,
            "worst_rel_diff": worst,
            "ms": {v: t / 1e3 for v, t in times.items()},
            "peak_mib": memory,
        }
        results.append(row)
        for v in variants:
            mem = "" if memory[v] is None else f"  peak {memory[v]:8.1f} MiB"
            print(f"  {v:32s} {times[v] / 1e3:9.3f} ms{mem}", flush=True)
        del variants, inputs, grads, lstm
        gc.collect()

    columns = [OURS, CELLS, PURE, COMPILED, LSTM, OURS_TF32, LSTM_NO_TF32, OURS_FUSED, OURS_STEPS, OURS_CUBLAS]
    columns = [c for c in columns if any(c in r["ms"] for r in results)]
    lines = ["| T, B, F, S, dtype | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for r in results:
        cells = [f"{r['ms'][c]:.3f} ms" if c in r["ms"] else "-" for c in columns]
        lines.append(f"| {r['size']} | " + " | ".join(cells) + " |")
    lines += ["", "ratios (same run):", ""]
    for r in results:
        ms, mem = r["ms"], r["peak_mib"]
        parts = [f"vs {LSTM}: {ms[OURS] / ms[LSTM]:.2f}x", f"vs {CELLS}: {ms[OURS] / ms[CELLS]:.3f}x"]
        if OURS_TF32 in ms:
            parts.append(f"TF32 vs {LSTM}: {ms[OURS_TF32] / ms[LSTM]:.2f}x")
            parts.append(f"vs {LSTM_NO_TF32}: {ms[OURS] / ms[LSTM_NO_TF32]:.2f}x")
        if mem.get(OURS) is not None:
            parts.append(
                f"peak memory vs {CELLS}: {mem[OURS]:.1f} / {mem[CELLS]:.1f} MiB = {mem[OURS] / mem[CELLS]:.2f}x"
            )
        lines.append(f"- {r['size']}: " + "; ".join(parts))
    if not results:  # --modules-only
        lines = []
    lines += ["", "modules (LLTMSequence against nn.LSTM, forward+backward, same run):", ""]
    module_sizes = QUICK_MODULE_SIZES if device == "cpu" else MODULE_SIZES
    if args.module_size:
        parts = args.module_size.split(",")
        dtype = getattr(torch, parts[4]) if len(parts) > 4 else torch.float32
        module_sizes = [(tuple(int(v) for v in parts[:4]), dtype)]
    module_lines, modules = module_rows(device, module_sizes, max(3, repeat // 4))
    lines += module_lines
    table = "\n".join(lines)
    print()
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tf32 = (
            f"float32 matmul TF32 default: torch.backends.cuda.matmul.allow_tf32="
            f"{torch.backends.cuda.matmul.allow_tf32}, torch.backends.cudnn.allow_tf32="
            f"{torch.backends.cudnn.allow_tf32}"
        )
        (out / "lltm_sequence.md").write_text(
            f"{header}\n\n{tf32}\n\nforward+backward of a whole sequence, synchronized wall time, median\n\n{table}\n"
        )
        record = {"header": header, "results": results, "modules": modules}
        (out / "lltm_sequence.json").write_text(json.dumps(record, indent=1))
        print(f"wrote {out / 'lltm_sequence.md'}")


if __name__ == "__main__":
    main()
