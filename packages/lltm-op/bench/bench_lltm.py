"""lltm_op against the pure-PyTorch LLTM cell and torch.compile of it.

    python bench/bench_lltm.py [--out DIR] [--quick] [--no-compile] [--device cuda|cpu]

For float32 and bfloat16, at two sizes (batch, input features, state size):

* tutorial (16, 32, 128): wall time per call, synchronized (launch-bound),
  the variants timed in alternating rounds so that drift of the host's
  speed falls on all of them alike;
* large (4096, 1024, 2048): device time (CUDA events), plus the matrix
  products alone (the forward X @ W^T + b and the two backward products
  dG @ W and dG^T @ X, nothing else) and lltm_op's ratio to them.

Modes: "forward" is one training-mode forward (inputs require grad, the graph
is built); "forward+backward" is that plus torch.autograd.grad of both
outputs, with random output gradients, with respect to all five inputs.
Also the peak GPU memory of one forward+backward of each variant, above what
its inputs already hold.

Matrix products run as torch leaves them: float32 without TF32 (the
default; the setting is printed) for every variant alike.

Prints tables; with --out also writes lltm.md and lltm.json there.
--quick: a smoke run on tiny sizes, on the CPU unless --device says otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import lltm_op
import torch
from lltm_op import lltm, lltm_reference
from lltm_op._runtime import BUILD_INFO
from opscommon.bench import Row, device_time_us, format_table, interleaved_wall_times_us, wall_time_us, write_results

SIZES = {"tutorial": (16, 32, 128), "large": (4096, 1024, 2048)}
QUICK_SIZES = {"tutorial": (4, 8, 16), "large": (64, 32, 64)}
PURE = "pure PyTorch"
COMPILED = "torch.compile"
OURS = "lltm_op"
MATMULS = "matmuls only"


def make_inputs(batch, features, state, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    stdv = 1.0 / state**0.5
    f32 = dict(generator=gen, dtype=torch.float32)
    args = [
        torch.randn(batch, features, **f32),
        (torch.rand(3 * state, state + features, **f32) * 2 - 1) * stdv,
        (torch.rand(3 * state, **f32) * 2 - 1) * stdv,
        torch.randn(batch, state, **f32),
        torch.randn(batch, state, **f32),
    ]
    args = [a.to(device=device, dtype=dtype).requires_grad_() for a in args]
    grads = [torch.randn(batch, state, **f32).to(device=device, dtype=dtype) for _ in range(2)]
    return args, grads


def peak_mib(fn, device) -> float | None:
    """Peak memory of one call above what was allocated before it."""
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


def tf32_line() -> str:
    on = torch.backends.cuda.matmul.allow_tf32
    return (
        f"float32 matmul: TF32 {'ON (not the default!)' if on else 'off'} "
        f"(torch.backends.cuda.matmul.allow_tf32={on}, "
        f"float32_matmul_precision={torch.get_float32_matmul_precision()!r}), same for every variant"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for lltm.md / lltm.json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (CPU smoke run)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    quick = args.quick or device == "cpu"
    sizes = QUICK_SIZES if quick else SIZES
    wall_kw = dict(warmup=3, repeat=20) if quick else dict(warmup=20, repeat=300)
    dev_kw = dict(warmup=2, repeat=5) if quick else dict(warmup=5, repeat=30)

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    build = f"CUDA {BUILD_INFO['cuda']}" if BUILD_INFO.get("cuda") else "CPU"
    print(
        f"device: {name}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
        f"lltm_op {lltm_op.__version__} ({build} build)"
    )
    print(tf32_line())
    if quick:
        print(f"quick run: sizes {sizes}")

    rows: list[Row] = []
    memory: list[tuple[str, str, str, float | None]] = []
    ratios: dict[str, float] = {}
    for size_name, (batch, features, state) in sizes.items():
        label = f"B{batch} F{features} S{state}"
        timer = wall_time_us if size_name == "tutorial" else device_time_us
        kw = wall_kw if size_name == "tutorial" else dev_kw
        for dtype in (torch.float32, torch.bfloat16):
            dname = str(dtype).replace("torch.", "")
            inputs, grads = make_inputs(batch, features, state, dtype, device)
            variants = {PURE: lltm_reference, OURS: lltm}
            if not args.no_compile:
                variants[COMPILED] = torch.compile(lltm_reference, fullgraph=True, dynamic=False)
            fwd = {v: (lambda fn=fn, inputs=inputs: fn(*inputs)) for v, fn in variants.items()}
            fwd_bwd = {
                v: (lambda fn=fn, inputs=inputs, grads=grads: torch.autograd.grad(fn(*inputs), inputs, grads))
                for v, fn in variants.items()
            }
            if size_name == "tutorial":
                # launch-bound: the variants alternate, so host drift hits all alike
                fwd_us = interleaved_wall_times_us(fwd, **kw)
                fwd_bwd_us = interleaved_wall_times_us(fwd_bwd, **kw)
            else:
                fwd_us = {v: timer(fn, **kw) for v, fn in fwd.items()}
                fwd_bwd_us = {v: timer(fn, **kw) for v, fn in fwd_bwd.items()}
            for variant in variants:
                common = dict(op="lltm", variant=variant, dtype=dname, size=label, numel=batch * state)
                rows.append(Row(mode="forward", median_us=fwd_us[variant], **common))
                mib = peak_mib(fwd_bwd[variant], device)
                memory.append((label, dname, variant, mib))
                rows.append(
                    Row(mode="forward+backward", median_us=fwd_bwd_us[variant], extra={"peak_mib": mib}, **common)
                )
            if size_name == "large":
                x, w, b, h, c = (t.detach() for t in inputs)
                X = torch.cat((h, x), 1)
                d_gates = torch.randn(batch, 3 * state, device=device, dtype=dtype)

                def mm_fwd():
                    return torch.addmm(b, X, w.t())

                def mm_fwd_bwd():
                    return torch.addmm(b, X, w.t()), d_gates.mm(w), d_gates.t().mm(X)

                common = dict(op="lltm", variant=MATMULS, dtype=dname, size=label, numel=batch * state)
                rows.append(Row(mode="forward", median_us=timer(mm_fwd, **kw), **common))
                rows.append(Row(mode="forward+backward", median_us=timer(mm_fwd_bwd, **kw), **common))
                ours = next(
                    r
                    for r in rows
                    if r.variant == OURS and r.mode == "forward+backward" and r.size == label and r.dtype == dname
                )
                ratios[dname] = ours.median_us / rows[-1].median_us
                ours.extra["x_matmuls_only"] = ratios[dname]
            del inputs, grads, fwd, fwd_bwd
            gc.collect()

    print()
    print(format_table(rows, baseline=PURE))
    mem_lines = ["", "peak memory of one forward+backward, MiB above the inputs:"]
    for label, dname, variant, mib in memory:
        base = next(m for lb, dn, v, m in memory if lb == label and dn == dname and v == PURE)
        rel = f"  ({mib / base:.2f}x pure PyTorch)" if mib is not None and base else ""
        mem_lines.append(
            f"  {label:>18}  {dname:>8}  {variant:>14}  {'n/a (CPU)' if mib is None else f'{mib:10.1f}'}{rel}"
        )
    ratio_lines = ["", f"{OURS} forward+backward / matrix products alone (forward addmm + 2 backward mm), {label}:"]
    ratio_lines += [f"  {dname}: {r:.3f}x" for dname, r in ratios.items()]
    tail = "\n".join(mem_lines + ratio_lines)
    print(tail)
    if args.out:
        write_results(rows, args.out, "lltm", baseline=PURE)
        md = Path(args.out) / "lltm.md"
        header = f"device: {name}; torch {torch.__version__}; lltm_op {lltm_op.__version__}\n\n{tf32_line()}\n\n"
        md.write_text(header + md.read_text() + "\n```\n" + tail.strip("\n") + "\n```\n")
        extra = Path(args.out) / "lltm_summary.json"
        extra.write_text(
            json.dumps(
                {
                    "device": name,
                    "torch": torch.__version__,
                    "tf32": bool(torch.backends.cuda.matmul.allow_tf32),
                    "x_matmuls_only": ratios,
                    "peak_mib": [dict(zip(("size", "dtype", "variant", "mib"), m)) for m in memory],
                },
                indent=1,
            )
        )
        print(f"wrote {md}, {Path(args.out) / 'lltm.json'}, {extra}")


if __name__ == "__main__":
    main()
