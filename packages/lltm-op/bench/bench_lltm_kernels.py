"""The LLTM cell kernels at large size against the device's copy bandwidth,
and the step's ways of forming the gates' matrix product.

    python bench/bench_lltm_kernels.py [--batch 4096] [--features 1024] [--state 2048] [--out DIR]

Device time (CUDA events, median). For float32, bfloat16 and float16:

* cell_forward and cell_backward_from_new_cell: bytes each must move (read
  gates, bias and the cell, write new_h and new_cell; read both output
  gradients, gates, bias and new_cell, write d_gates and d_old_cell), the
  time, and the fraction of a device copy moving the same bytes;
* the gates product three ways, forward and forward+backward: cat([old_h,
  input]) then mm (today's step), addmm of the two products into one buffer
  (no cat), and mm on a preallocated [B, S+F] buffer that old_h and input
  are copied into;
* the step (lltm forward+backward) against its three matrix products alone,
  run eagerly and as CUDA graph replays (GPU time without the host's work).
"""

from __future__ import annotations

import argparse

import lltm_op
import torch
from opscommon.bench import Row, copy_time_us, device_time_us, format_table, write_results

_fwd = torch.ops.lltm_op.cell_forward.default
_bwd = torch.ops.lltm_op.cell_backward_from_new_cell.default


def _graphed(fn):
    """``fn`` captured in a CUDA graph (after warm-up calls on a side
    stream, as capture requires): a callable that replays it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--state", type=int, default=2048)
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    B, F, S = args.batch, args.features, args.state
    dev = "cuda"
    label = f"B{B} F{F} S{S}"
    rows: list[Row] = []
    summary = []
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        es = torch.empty((), dtype=dtype).element_size()
        gates = torch.randn(B, 3 * S, device=dev, dtype=dtype)
        bias = torch.randn(3 * S, device=dev, dtype=dtype)
        cell = torch.randn(B, S, device=dev, dtype=dtype)
        gh, gc = torch.randn_like(cell), torch.randn_like(cell)
        with torch.no_grad():
            _, new_c = _fwd(gates, bias, cell)
        kernels = {
            "cell_forward": (lambda: _fwd(gates, bias, cell), (3 * S + S + 2 * S) * B * es + 3 * S * es),
            "cell_backward": (
                lambda: _bwd(gh, gc, gates, bias, new_c),
                (2 * S + 3 * S + S + 3 * S + S) * B * es + 2 * 3 * S * es,
            ),
        }
        for name, (fn, nbytes) in kernels.items():
            us = device_time_us(fn)
            copy_us = copy_time_us(nbytes)
            frac = copy_us / us
            rows.append(
                Row(
                    op=name,
                    variant="lltm_op",
                    mode="kernel",
                    dtype=dname,
                    size=label,
                    numel=B * S,
                    bytes_moved=nbytes,
                    median_us=us,
                    extra={"fraction_of_copy": frac, "copy_us": copy_us},
                )
            )
            summary.append(f"{name:14s} {dname:9s} {us:8.1f} us  copy {copy_us:8.1f} us  fraction of copy {frac:.2f}")
        gates = cell = gh = gc = new_c = None
        # the gates product, three ways
        x = torch.randn(B, F, device=dev, dtype=dtype, requires_grad=True)
        h = torch.randn(B, S, device=dev, dtype=dtype, requires_grad=True)
        w = (torch.randn(3 * S, S + F, device=dev, dtype=dtype) * 0.02).requires_grad_()
        dg = torch.randn(B, 3 * S, device=dev, dtype=dtype)
        buf = torch.empty(B, S + F, device=dev, dtype=dtype)

        def cat_mm(x=x, h=h, w=w):
            return torch.mm(torch.cat((h, x), 1), w.t())

        def two_mm(x=x, h=h, w=w):
            return torch.addmm(torch.mm(x, w[:, S:].t()), h, w[:, :S].t())

        def prealloc(x=x, h=h, w=w, buf=buf):
            with torch.no_grad():
                buf[:, :S].copy_(h)
                buf[:, S:].copy_(x)
            return torch.mm(buf, w.t())

        def mm_bwd_two(x=x, h=h, w=w):
            x, h, w = x.detach(), h.detach(), w.detach()
            # what a no-cat backward does: dX pieces and dW into slices of one buffer
            dw = torch.empty_like(w)
            torch.mm(dg.t(), h, out=dw[:, :S])
            torch.mm(dg.t(), x, out=dw[:, S:])
            return dg.mm(w[:, :S]), dg.mm(w[:, S:]), dw

        variants = {"cat+mm": cat_mm, "mm+addmm (no cat)": two_mm, "prealloc buffer+mm": prealloc}
        for name, fn in variants.items():
            with torch.no_grad():
                rows.append(
                    Row(op="gates", variant=name, mode="forward", dtype=dname, size=label, median_us=device_time_us(fn))
                )
        for name, fn in variants.items():
            if name.startswith("prealloc"):
                continue
            rows.append(
                Row(
                    op="gates",
                    variant=name,
                    mode="forward+backward",
                    dtype=dname,
                    size=label,
                    median_us=device_time_us(lambda fn=fn: torch.autograd.grad(fn(), (x, h, w), dg)),
                )
            )
        rows.append(
            Row(
                op="gates",
                variant="no-cat backward products (dW slices out=)",
                mode="backward",
                dtype=dname,
                size=label,
                median_us=device_time_us(mm_bwd_two),
            )
        )
        buf = None
        # the step against its three matrix products
        b = torch.zeros(3 * S, device=dev, dtype=dtype, requires_grad=True)
        c = torch.randn(B, S, device=dev, dtype=dtype, requires_grad=True)
        inputs = (x, w, b, h, c)
        g2 = (torch.randn(B, S, device=dev, dtype=dtype), torch.randn(B, S, device=dev, dtype=dtype))
        X = torch.cat((h, x), 1).detach()
        wd, bd = w.detach(), b.detach()

        def step():
            return torch.autograd.grad(lltm_op.lltm(*inputs), inputs, g2)

        def mms():
            return torch.addmm(bd, X, wd.t()), dg.mm(wd), dg.t().mm(X)

        # Eagerly, and as CUDA graph replays: GPU time alone, no host work
        # (what torch.compile's "reduce-overhead" mode or a captured training
        # step runs). Eagerly, a step whose host work (autograd engine
        # included) takes as long as its kernels is host-bound.
        for how, run in (("", lambda fn: fn), (", CUDA graph replay", _graphed)):
            step_us, mm_us = device_time_us(run(step)), device_time_us(run(mms))
            common = {"op": "lltm step", "mode": "forward+backward", "dtype": dname, "size": label}
            rows.append(
                Row(variant="lltm_op" + how, median_us=step_us, extra={"x_matmuls_only": step_us / mm_us}, **common)
            )
            rows.append(Row(variant="matmuls only" + how, median_us=mm_us, **common))
            summary.append(
                f"lltm step fwd+bwd {dname:9s}{how.replace(',', '')} {step_us:8.1f} us, "
                f"matmuls alone {mm_us:8.1f} us: {step_us / mm_us:.3f}x"
            )
        inputs = x = h = w = b = c = X = dg = None
        torch.cuda.empty_cache()
    print(
        f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
        f"lltm_op {lltm_op.__version__}; TF32 {torch.backends.cuda.matmul.allow_tf32}"
    )
    print(format_table(rows))
    print("\n".join(summary))
    if args.out:
        write_results(rows, args.out, "lltm_kernels")
        with open(f"{args.out}/lltm_kernels_summary.txt", "w") as f:
            f.write("\n".join(summary) + "\n")


if __name__ == "__main__":
    main()
