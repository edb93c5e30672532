"""Throughput of round_op.round_ste against the straight-through composite in
plain PyTorch and a device copy of the same tensor (the roofline).

    python bench/bench_round_ste.py [--max-log2 28] [--out DIR] [--per-call-only]

Prints a table; with --out also writes round_ste.md/.json/.png there.
Then the per-call host cost of small calls (float32, 2^12 and 2^20
elements, round_ste against torch.round, inputs with and without
requires_grad): host enqueue time per call back to back, and the wall time
of one synchronized call, the variants interleaved (round_ste_per_call.md).
"""

from __future__ import annotations

import argparse

import round_op
import torch
from opscommon.bench import Row, autograd_function_floor, device_time_us, format_table, per_call_rows, write_results
from round_op import _runtime


def composite(x: torch.Tensor) -> torch.Tensor:
    return x + ((x >= 0.5).to(x.dtype) - x).detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--min-log2", type=int, default=12)
    parser.add_argument("--max-log2", type=int, default=28)
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--per-call-only", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.per_call_only:
        per_call(device, args.out)
        return
    if device == "cpu":
        args.max_log2 = min(args.max_log2, 24)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for k in range(args.min_log2, args.max_log2 + 1, args.step):
            n = 1 << k
            x = torch.rand(n, device=device, dtype=dtype)
            g = torch.rand(n, device=device, dtype=dtype)
            xg = x.clone().requires_grad_(True)
            nbytes = 2 * n * x.element_size()  # read x, write y
            dst = torch.empty_like(x)
            variants = {
                "copy (roofline)": (lambda: dst.copy_(x), None),
                "round_op": (lambda: round_op.round_ste(x), lambda: round_op.round_ste(xg).backward(g)),
                "torch composite": (lambda: composite(x), lambda: composite(xg).backward(g)),
            }
            for name, (fwd, fwd_bwd) in variants.items():
                common = dict(
                    op="round_ste",
                    variant=name,
                    dtype=str(dtype).replace("torch.", ""),
                    size=f"2^{k}",
                    numel=n,
                    bytes_moved=nbytes,
                )
                rows.append(Row(mode="forward", median_us=device_time_us(fwd), **common))
                # forward+backward moves the forward's bytes plus the gradient's
                # read+write; the copy row stands for the same byte count.
                bwd = fwd_bwd or (lambda: (dst.copy_(x), dst.copy_(g)))
                xg.grad = None
                rows.append(
                    Row(mode="forward+backward", median_us=device_time_us(bwd), **{**common, "bytes_moved": 2 * nbytes})
                )
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    print(format_table(rows, baseline="torch composite"))
    if args.out:
        write_results(rows, args.out, "round_ste", baseline="torch composite", plot_roofline="copy (roofline)")
    per_call(device, args.out)


def per_call(device: str, out: str | None) -> None:
    """Per-call host cost, round_ste against torch.round; target <= 1.25x."""
    rows = []
    # torch.round behind the same Python autograd route round_ste takes.
    floor = autograd_function_floor(torch.round, 1, _runtime.function_apply)
    for k in (12, 20):
        x = torch.rand(1 << k, device=device) * 10
        xg = x.clone().requires_grad_(True)
        for label, t in (("", x), (", requires_grad", xg)):
            rows += per_call_rows(
                "round_ste",
                {
                    "round_op": lambda t=t: round_op.round_ste(t),
                    "torch.round": lambda t=t: torch.round(t),
                    "torch.round in autograd.Function": lambda t=t: floor(t),
                },
                "float32",
                f"2^{k}",
                1 << k,
                label,
            )
    print(format_table(rows, baseline="torch.round"))
    for r in rows:
        if r.variant == "round_op":
            base = next(b for b in rows if b.variant == "torch.round" and b.mode == r.mode and b.size == r.size)
            ratio = r.median_us / base.median_us
            print(
                f"target {r.mode} {r.size}: <= 1.25x torch.round; {r.median_us:.1f} vs "
                f"{base.median_us:.1f} us = {ratio:.2f}x {'PASS' if ratio <= 1.25 else 'FAIL'}"
            )
    if out:
        write_results(rows, out, "round_ste_per_call", baseline="torch.round")


if __name__ == "__main__":
    main()
