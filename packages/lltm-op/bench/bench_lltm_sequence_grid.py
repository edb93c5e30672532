"""lltm_sequence against nn.LSTM (cuDNN) over a grid of sizes: the sequence
engine's scoreboard.

    python bench/bench_lltm_sequence_grid.py [--out DIR] [--quick] [--repeat N]
        [--T 64,256,1024] [--B 8,64,256] [--S 128,256,512,1024] [--dtypes bf16,f16,f32]
        [--f32-precision TF32,full] [--global-column] [--no-cublas-column]

For every (T, B, S = F, dtype) of the grid: forward+backward of a whole
sequence (gradients of every output with respect to every input) and the
forward alone under ``torch.no_grad`` (inference), synchronized wall time,
median, each variant timed in alternating rounds in one process:

* ``lltm_sequence``: the default engine choice (the tensor-core persistent
  kernels where they apply, see the README's rule);
* ``lltm_sequence, cuBLAS path``: one cuBLAS product and one cell kernel a
  step (``LLTM_OP_SEQUENCE_FUSED=0``), the fallback (``--no-cublas-column``
  leaves it out: it takes most of a whole grid's time, "-" in the table);
* ``nn.LSTM``: cuDNN, one layer, same T, B, input and hidden size;
* with ``--global-column``, ``lltm_sequence, global barrier``: the
  tensor-core kernels without the block-local variant
  (``LLTM_OP_SEQUENCE_LOCAL=0``), to compare the two where the local one runs.

The LLTM has three gates to the LSTM's four: at equal efficiency it takes
0.75x nn.LSTM's time, the target ratio. float32 is compared at one
precision both ways: TF32 for both (``torch.backends.cuda.matmul.allow_tf32``
and ``torch.backends.cudnn.allow_tf32``) and full float32 for both.

Also: the recurrent product's achieved TFLOP/s (2 * B * S * 3S per step
forward, twice that backward, over the measured time: a lower bound of what
the engine reaches, the input products and the cell are not counted), and
that as a fraction of the GPU's dense peak for the dtype (tensor cores for
bfloat16, float16 and TF32, the FMA units for full float32; "-" on a GPU
this script has no figures for).

--quick: two tiny sizes on the CPU (a smoke run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_lltm_sequence import with_flags  # this folder: run as python bench/<script>.py
from lltm_op import lltm_sequence
from opscommon.bench import interleaved_wall_times_us

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
OURS = "lltm_sequence"
CUBLAS = "lltm_sequence, cuBLAS path"
GLOBAL = "lltm_sequence, global barrier"
LSTM = "nn.LSTM"


def make_inputs(T, B, S, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    F = S

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype).requires_grad_()

    args = [
        rnd(T, B, F),
        rnd(3 * S, S + F, scale=S**-0.5),
        rnd(3 * S, scale=0.1),
        rnd(B, S),
        rnd(B, S),
    ]
    lstm = torch.nn.LSTM(F, S, device=device, dtype=dtype)
    lstm.flatten_parameters()
    hx = (rnd(1, B, S), rnd(1, B, S))
    grads = [torch.randn(T, B, S, generator=gen).to(device, dtype)] + [
        torch.randn(B, S, generator=gen).to(device, dtype) for _ in range(2)
    ]
    return args, lstm, hx, grads


def variants(args, lstm, hx, grads, global_column=False, cublas_column=True):
    x = args[0]

    def ours_train():
        out, (h, c) = lltm_sequence(*args)
        torch.autograd.backward([out, h, c], grads)

    def ours_infer():
        with torch.no_grad():
            lltm_sequence(*args)

    def lstm_train():
        out, (h, c) = lstm(x, hx)
        torch.autograd.backward([out, h[0], c[0]], grads)

    def lstm_infer():
        with torch.no_grad():
            lstm(x, hx)

    groups = {
        "forward+backward": {
            OURS: ours_train,
            CUBLAS: with_flags(ours_train, fused="0"),
            LSTM: lstm_train,
        },
        "forward": {
            OURS: ours_infer,
            CUBLAS: with_flags(ours_infer, fused="0"),
            LSTM: lstm_infer,
        },
    }
    if not cublas_column:
        for group in groups.values():
            del group[CUBLAS]
    if global_column:
        groups["forward+backward"][GLOBAL] = with_flags(ours_train, local="0")
        groups["forward"][GLOBAL] = with_flags(ours_infer, local="0")
    return groups


# Dense peak TFLOP/s from NVIDIA's data sheets (no sparsity): 16-bit and
# TF32 tensor cores, float32 FMA. Matched on the name torch reports.
PEAK_TFLOPS = {
    "H100 80GB HBM3": {"bf16": 989.4, "f16": 989.4, "f32 TF32": 494.7, "f32 full": 66.9},
    "H200": {"bf16": 989.4, "f16": 989.4, "f32 TF32": 494.7, "f32 full": 66.9},
    "H100 PCIe": {"bf16": 756.5, "f16": 756.5, "f32 TF32": 378.0, "f32 full": 51.2},
    "A100": {"bf16": 312.0, "f16": 312.0, "f32 TF32": 156.0, "f32 full": 19.5},
}


def peak_tflops(device_name: str, dtype_label: str) -> float | None:
    """The dense peak of `dtype_label` ("bf16", "f16", "f32 TF32", "f32 full")
    on the named GPU, or None where this table has no figure."""
    for key, peaks in PEAK_TFLOPS.items():
        if key in device_name:
            return peaks.get(dtype_label)
    return None


def ms_or_dash(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3f}"


def peak_or_dash(row: dict) -> str:
    """A row's recurrent TFLOP/s as a percentage of the dense peak, or "-"."""
    fraction = row.get("peak_fraction")
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--T", default="64,256,1024")
    p.add_argument("--B", default="8,64,256")
    p.add_argument("--S", default="128,256,512,1024")
    p.add_argument("--dtypes", default="bf16,f16,f32")
    p.add_argument(
        "--f32-precision",
        default="TF32,full",
        help="float32's comparisons: TF32 for both, full float32 for both (default: both ways)",
    )
    p.add_argument("--global-column", action="store_true", help="also time the global-barrier kernels")
    p.add_argument("--no-cublas-column", action="store_true", help="do not time the cuBLAS path")
    a = p.parse_args()
    device = "cpu" if a.quick or not torch.cuda.is_available() else "cuda"
    if a.quick:
        grid = [(4, 3, 16, "f32"), (3, 5, 16, "bf16")]
    else:
        ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
        grid = [(T, B, S, d) for d in a.dtypes.split(",") for S in ints(a.S) for B in ints(a.B) for T in ints(a.T)]
    f32_ways = {"TF32": True, "full": False}
    precisions = {"f32": [(w, f32_ways[w]) for w in a.f32_precision.split(",")]}
    rows = []
    header = (
        f"{'T':>5} {'B':>4} {'S':>5} {'dtype':>9} {'mode':>16} {'ours ms':>8} {'cuBLAS':>8} "
        f"{'LSTM ms':>8} {'ratio':>6} {'TFLOP/s':>7} {'peak':>6}" + (f" {'global':>8}" if a.global_column else "")
    )
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device: {device_name}, torch {torch.__version__}")
    print(header)
    for T, B, S, dname in grid:
        dtype = DTYPES[dname]
        for label, tf32 in precisions.get(dname, [("", None)]):
            if tf32 is not None:
                torch.backends.cuda.matmul.allow_tf32 = tf32
                torch.backends.cudnn.allow_tf32 = tf32
            try:
                args, lstm, hx, grads = make_inputs(T, B, S, dtype, device)
                fns = variants(args, lstm, hx, grads, a.global_column, not a.no_cublas_column)
                for mode, group in fns.items():
                    times = interleaved_wall_times_us(group, warmup=2, repeat=a.repeat)
                    flops = 2 * T * B * S * 3 * S * (3 if mode == "forward+backward" else 1)
                    ratio = times[OURS] / times[LSTM]
                    tflops = flops / (times[OURS] * 1e-6) / 1e12
                    dlabel = dname + (f" {label}" if label else "")
                    peak = peak_tflops(device_name, dlabel)
                    row = {
                        "T": T,
                        "B": B,
                        "S": S,
                        "F": S,
                        "dtype": dlabel,
                        "mode": mode,
                        "ours_ms": times[OURS] / 1e3,
                        "cublas_ms": times[CUBLAS] / 1e3 if CUBLAS in times else None,
                        "lstm_ms": times[LSTM] / 1e3,
                        "ratio_vs_lstm": ratio,
                        "recurrent_tflops": tflops,
                        "peak_fraction": tflops / peak if peak else None,
                    }
                    if GLOBAL in times:
                        row["global_ms"] = times[GLOBAL] / 1e3
                    rows.append(row)
                    print(
                        f"{T:>5} {B:>4} {S:>5} {dlabel:>9} {mode:>16} {row['ours_ms']:>8.3f} "
                        f"{ms_or_dash(row['cublas_ms']):>8} {row['lstm_ms']:>8.3f} {ratio:>6.2f} {tflops:>7.1f} "
                        f"{peak_or_dash(row):>6}" + (f" {row['global_ms']:>8.3f}" if "global_ms" in row else ""),
                        flush=True,
                    )
                del args, lstm, hx, grads, fns
            finally:
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.allow_tf32 = True
            if device == "cuda":
                torch.cuda.empty_cache()
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "lltm_sequence_grid.json").write_text(json.dumps(rows, indent=1))
        md = [
            f"device: {device_name}, torch {torch.__version__}; command: python bench/bench_lltm_sequence_grid.py "
            + ("--quick" if a.quick else f"--T {a.T} --B {a.B} --S {a.S} --dtypes {a.dtypes}")
            + (f" --f32-precision {a.f32_precision}" if "f32" in a.dtypes and not a.quick else "")
            + f" --repeat {a.repeat}"
            + (" --global-column" if a.global_column else "")
            + (" --no-cublas-column" if a.no_cublas_column else ""),
            "",
            "| T | B | S = F | dtype | mode | lltm_sequence ms | cuBLAS path ms | nn.LSTM ms | ratio | TFLOP/s "
            "| of peak |" + (" global barrier ms |" if a.global_column else ""),
        ]
        md.append("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if a.global_column else ""))
        for r in rows:
            md.append(
                f"| {r['T']} | {r['B']} | {r['S']} | {r['dtype']} | {r['mode']} | {r['ours_ms']:.3f} | "
                f"{ms_or_dash(r['cublas_ms'])} | {r['lstm_ms']:.3f} | {r['ratio_vs_lstm']:.2f} | "
                f"{r['recurrent_tflops']:.1f} | {peak_or_dash(r)} |"
                + (f" {r['global_ms']:.3f} |" if "global_ms" in r else "")
            )
        (out / "lltm_sequence_grid.md").write_text("\n".join(md) + "\n")
        plot(rows, out / "lltm_sequence_grid.png")


def plot(rows, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written")
        return
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(7 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for dtype in dict.fromkeys(r["dtype"] for r in rows):
            pts = [r for r in rows if r["mode"] == mode and r["dtype"] == dtype]
            xs = [r["T"] * r["B"] * r["S"] * r["S"] for r in pts]
            ax.scatter(xs, [r["ratio_vs_lstm"] for r in pts], label=dtype, s=14)
        ax.axhline(0.75, linestyle="--", color="gray", label="target 0.75")
        ax.axhline(1.0, linestyle=":", color="gray")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T * B * S^2 (recurrent work)")
        ax.set_ylabel("lltm_sequence / nn.LSTM time")
        ax.set_title(mode)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
