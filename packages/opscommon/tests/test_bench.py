"""opscommon.bench: the timing helpers call what they are given as documented."""

from __future__ import annotations

from opscommon.bench import Row, format_table, interleaved_wall_times_us


def test_interleaved_rounds_call_each_function_once_per_round_in_rotating_order():
    order: list[str] = []
    fns = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    times = interleaved_wall_times_us(fns, warmup=2, repeat=6)
    assert set(times) == {"a", "b", "c"}
    assert all(t >= 0 for t in times.values())
    assert order[:6] == ["a", "b", "c"] * 2  # warm-up, in the given order
    rounds = [order[6 + 3 * i : 9 + 3 * i] for i in range(6)]
    assert rounds[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)


def test_format_table_gives_ratios_against_the_baseline():
    rows = [
        Row(op="x", variant="base", mode="forward", dtype="float32", size="2^4", median_us=10.0),
        Row(op="x", variant="ours", mode="forward", dtype="float32", size="2^4", median_us=5.0),
    ]
    table = format_table(rows, baseline="base")
    assert "x vs base" in table
    assert table.splitlines()[-1].split()[-1] == "2.00"
