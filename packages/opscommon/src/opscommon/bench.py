"""Benchmark helpers shared by every op package's ``bench/`` script.

Timing follows the usual rules for asynchronous devices: warm up, time with
CUDA events (device time) or synchronize around a host clock (wall time per
call), repeat, report the median. Results are rows of a table printed as text,
and optionally written as Markdown, JSON and a PNG plot of throughput against
size with the copy-bandwidth roofline drawn.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class Row:
    """One measured point of a benchmark table."""

    op: str  # e.g. "round_ste"
    variant: str  # e.g. "round_op", "torch composite", "copy (roofline)"
    mode: str  # e.g. "forward", "forward+backward"
    dtype: str
    size: str  # a label: "2^20", "B16 F32 S128"
    median_us: float
    numel: int = 0
    bytes_moved: int = 0  # fewest bytes the work must move, for throughput
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes_moved / (self.median_us * 1e-6) / 1e9 if self.bytes_moved else float("nan")


def device_time_us(fn: Callable[[], object], warmup: int = 5, repeat: int = 30, inner: int | None = None) -> float:
    """Median device time per call, in microseconds (CUDA events), or the
    median wall time on the CPU.

    Each sample times ``inner`` back-to-back calls between two events and
    divides: the time per call in a stream of calls, where the host's launch
    overhead overlaps the previous call's GPU work, as in a real program.
    The start event is recorded after one call already enqueued, so the GPU
    is busy when the timed calls start: the host's work for the first of
    them overlaps that call, as in a training loop, instead of being timed
    on an idle GPU (with a long call, such as a training step with its
    backward, that start-up latency would otherwise be added to each of
    only a few calls). ``inner=None`` picks enough calls for a sample of
    about 2 ms, at least 3 and at most 50; ``inner=1`` times single calls
    (each still started behind one call in flight).
    """
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        return wall_time_us(fn, warmup=0, repeat=repeat)

    def sample(calls: int) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        fn()  # in flight while the timed calls are enqueued
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / calls

    if inner is None:
        single = statistics.median(sample(1) for _ in range(5))
        inner = max(3, min(50, int(2000.0 / max(single, 1e-3)) + 1))
    return statistics.median(sample(inner) for _ in range(repeat))


def wall_time_us(fn: Callable[[], object], warmup: int = 10, repeat: int = 200, sync: bool = True) -> float:
    """Median wall time of one synchronized call, in microseconds."""

    def synchronize() -> None:
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def interleaved_wall_times_us(
    fns: Mapping[str, Callable[[], object]], warmup: int = 10, repeat: int = 200, sync: bool = True
) -> dict[str, float]:
    """Median wall time of one synchronized call of each function, measured
    in alternating rounds (one call of each per round, the order rotating).

    On a shared or virtual machine the host's speed drifts by tens of percent
    over seconds; timing the variants one after the other would fold that
    drift into their ratio, alternating them spreads it over all alike."""

    def synchronize() -> None:
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()

    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    synchronize()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeat):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            synchronize()
            times[name].append((time.perf_counter() - t0) * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def interleaved_host_times_us(
    fns: Mapping[str, Callable[[], object]], calls: int = 200, rounds: int = 21, warmup: int = 50
) -> dict[str, float]:
    """Host time per call with the calls enqueued back to back (no
    synchronization between them, one synchronization before each batch of
    ``calls``), in alternating rounds: the cost a program pays on the host
    for each call while the device runs behind it. Median over rounds."""

    def synchronize() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    synchronize()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            fn = fns[name]
            synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) * 1e6 / calls)
    synchronize()
    return {name: statistics.median(t) for name, t in times.items()}


def per_call_rows(
    op: str, variants: Mapping[str, Callable[[], object]], dtype: str, size: str, numel: int, label: str = ""
) -> list[Row]:
    """Rows of the per-call host cost of small calls, every variant
    interleaved with the others: mode "host enqueue/call{label}" (back to
    back) and "sync wall/call{label}" (one synchronized call)."""
    enqueue = interleaved_host_times_us(variants)
    wall = interleaved_wall_times_us(variants, warmup=20, repeat=400)
    rows = []
    for name in variants:
        rows.append(
            Row(
                op=op,
                variant=name,
                mode=f"host enqueue/call{label}",
                dtype=dtype,
                size=size,
                numel=numel,
                median_us=enqueue[name],
            )
        )
        rows.append(
            Row(
                op=op,
                variant=name,
                mode=f"sync wall/call{label}",
                dtype=dtype,
                size=size,
                numel=numel,
                median_us=wall[name],
            )
        )
    return rows


def autograd_function_floor(
    fn: Callable[..., torch.Tensor], arity: int, make_apply: Callable[[type], Callable] | None = None
) -> Callable[..., torch.Tensor]:
    """``fn`` (a torch op) wrapped in the smallest autograd.Function there is
    (identity backward to each of its ``arity`` inputs): with inputs that
    require grad, the per-call floor of any op whose autograd is written in
    Python, as the ops' autograd must be on the LibTorch stable ABI.
    ``make_apply`` turns the Function into its callable (default: its
    ``apply``; an op package's ``_runtime.function_apply`` for the route its
    own ops take)."""

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            return fn(*args)

        @staticmethod
        def backward(ctx, grad):
            return (grad,) * arity

    return (make_apply or (lambda f: f.apply))(Floor)


def copy_time_us(nbytes: int, device: str = "cuda", **kw) -> float:
    """Device time of a device-to-device copy moving ``nbytes`` bytes (read +
    written): the roofline a memory-bound kernel moving as many is held to."""
    n = max(1, nbytes // 2)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = device_time_us(lambda: dst.copy_(src), **kw)
    return us


def format_table(rows: Sequence[Row], baseline: str | None = None) -> str:
    """A plain-text table; with ``baseline``, each row's speed-up against the
    row of that variant with the same op, mode, dtype and size."""
    base = {}
    if baseline:
        base = {(r.op, r.mode, r.dtype, r.size): r.median_us for r in rows if r.variant == baseline}
    header = ["op", "mode", "dtype", "size", "variant", "median us", "GB/s"]
    if baseline:
        header.append(f"x vs {baseline}")
    lines = [header]
    for r in rows:
        line = [
            r.op,
            r.mode,
            r.dtype,
            r.size,
            r.variant,
            f"{r.median_us:.1f}",
            "-" if not r.bytes_moved else f"{r.gbps:.0f}",
        ]
        if baseline:
            b = base.get((r.op, r.mode, r.dtype, r.size))
            line.append(f"{b / r.median_us:.2f}" if b else "-")
        lines.append(line)
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = []
    for i, line in enumerate(lines):
        out.append("  ".join(str(c).rjust(w) for c, w in zip(line, widths)))
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def to_markdown(rows: Sequence[Row], baseline: str | None = None) -> str:
    text = format_table(rows, baseline).splitlines()
    cells = [[c for c in line.split("  ") if c.strip()] for line in text if not set(line) <= {"-", " "}]
    md = ["| " + " | ".join(c.strip() for c in cells[0]) + " |", "|" + "---|" * len(cells[0])]
    md += ["| " + " | ".join(c.strip() for c in row) + " |" for row in cells[1:]]
    return "\n".join(md) + "\n"


def write_results(
    rows: Sequence[Row], out_dir: str | Path, name: str, baseline: str | None = None, plot_roofline: str | None = None
) -> None:
    """Write ``name.md``, ``name.json`` and, where matplotlib is installed and
    rows carry byte counts, ``name.png`` (throughput against elements, one
    line per variant, the ``plot_roofline`` variant drawn dashed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(to_markdown(rows, baseline))
    (out / f"{name}.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    plotted = [r for r in rows if r.bytes_moved and r.numel]
    if not plotted:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written")
        return
    panels = sorted({(r.mode, r.dtype) for r in plotted})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (mode, dtype) in zip(axes[0], panels):
        for variant in dict.fromkeys(r.variant for r in plotted):
            pts = sorted(
                (r.numel, r.gbps) for r in plotted if r.variant == variant and r.mode == mode and r.dtype == dtype
            )
            if pts:
                style = "--" if variant == plot_roofline else "-o"
                ax.plot(*zip(*pts), style, label=variant, markersize=3)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("elements")
        ax.set_ylabel("GB/s (bytes read + written)")
        ax.set_title(f"{name}: {mode}, {dtype}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)
    plt.close(fig)
