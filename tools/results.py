"""Results of the nox sessions: recorded by :class:`Results`, one JSON file
per session in .nox/_results/, and read back here.

    python -m tools.results table [RESULTS_DIR] [--markdown FILE]
        The support-matrix table: rows are torch releases (and the wheel
        builds and CUDA compile lanes), one line per check; columns are
        packages. Exit status 1 if any cell failed or there is nothing to show.

    python -m tools.results summary RESULTS_FILE
        One closing line for one session: "tests: N passed, N failed, N skipped".
        Exit status 1 if the file is missing or anything failed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: python tools/results.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "tools"

from . import ROOT

RESULTS_DIR = ROOT / ".nox" / "_results"
MATRIX_KINDS = ("wheels", "matrix", "cuda_compile")


class Results:
    """Outcomes of one session, written to .nox/_results/<session>.json (the
    matrix table, CI's closing line). ``session`` needs ``name``, ``log`` and
    ``error`` (a nox session)."""

    def __init__(
        self, session: Any, kind: str, row: str = "", label: str = "", results_dir: Path = RESULTS_DIR
    ) -> None:
        self.session = session
        self.data: dict = {
            "session": session.name,
            "kind": kind,
            "row": row,
            "label": label,
            "started": time.time(),
            "items": [],
        }
        results_dir.mkdir(parents=True, exist_ok=True)
        self.path = results_dir / (re.sub(r"[^\w.=-]+", "_", session.name).strip("_") + ".json")
        self.path.unlink(missing_ok=True)

    def add(self, suite: str, check: str, status: str, text: str, detail: str = "", counts: dict | None = None) -> None:
        item = {"suite": suite, "check": check, "status": status, "text": text, "detail": detail}
        if counts is not None:
            item["counts"] = counts
        self.data["items"].append(item)
        mark = {"pass": "ok", "fail": "FAILED", "skip": "skipped"}[status]
        self.session.log(f"[{check}] {suite}: {mark}: {text}" + (f" ({detail})" if detail else ""))

    @property
    def failures(self) -> list[dict]:
        return [i for i in self.data["items"] if i["status"] == "fail"]

    def finish(self) -> None:
        """Write the file, log the closing line; the session fails on any failure."""
        self.data["seconds"] = round(time.time() - self.data["started"])
        self.path.write_text(json.dumps(self.data, indent=1))
        self.session.log(summary_line(self.data))
        if self.failures:
            self.session.error("failed: " + "; ".join(f"{i['check']} {i['suite']}" for i in self.failures))


def _orders() -> dict[str, list[str]]:
    """Row order of each kind of session, as matrix.toml lists them."""
    from . import matrix

    m = matrix.load()
    return {"wheels": m.variants, "matrix": list(m.torches), "cuda_compile": list(m.toolkits)}


def load(results_dir: Path) -> list[dict]:
    runs = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("kind") in MATRIX_KINDS:
            runs.append(data)
    orders = _orders()

    def key(run: dict) -> tuple:
        order = orders.get(run["kind"], [])
        row = run.get("row", "")
        return (MATRIX_KINDS.index(run["kind"]), order.index(row) if row in order else len(order), run["session"])

    return sorted(runs, key=key)


def cell(item: dict) -> str:
    counts = item.get("counts")
    if item["status"] == "pass":
        return f"{counts['passed']} passed" if counts else item["text"]
    if item["status"] == "skip":
        return f"skip: {item['text']}"
    if counts and counts.get("failed"):
        return f"FAIL {counts['failed']} of {sum(counts.values())}"
    return f"FAIL: {item['text']}"


MARK = {"pass": "\u2713", "fail": "\u2717", "skip": "-"}


def code(check: str) -> str:
    """Short name of a check's group in the compact table."""
    group = check.split(":")[0].strip()
    return {"cpu wheel": "W", "source": "S", "source: CUDA": "SC"}.get(
        "source: CUDA" if check.startswith("source: CUDA") else group,
        group.replace(" wheel", "").replace("cuda", "C").replace("nvcc ", "nvcc"),
    )


def compact_cell(items: list[dict]) -> str:
    """One cell of the compact table: a mark per group of checks, the worst wins;
    the number of tests passed after W."""
    groups: dict[str, list[dict]] = {}
    for item in items:
        groups.setdefault(code(item["check"]), []).append(item)
    parts = []
    for name, group in groups.items():
        status = next(s for s in ("fail", "pass", "skip") if any(i["status"] == s for i in group))
        passed = sum(i["counts"]["passed"] for i in group if i.get("counts"))
        parts.append(f"{name}{MARK[status]}" + (f"{passed}" if passed and status == "pass" else ""))
    return " ".join(parts)


def lane_cell(items: list[dict]) -> str:
    """A cell of a wheel-build or compile lane: mark and what happened."""
    if not items:
        return ""
    status = next(s for s in ("fail", "pass", "skip") if any(i["status"] == s for i in items))
    texts = list(dict.fromkeys(i["text"] for i in items if i["status"] == status))
    return f"{MARK[status]} {', '.join(texts)}"


def suite_order(names: set[str]) -> list[str]:
    middle = sorted(n for n in names if n not in ("opscommon", "integration", "all"))
    return [n for n in ("opscommon",) if n in names] + middle + [n for n in ("integration", "all") if n in names]


def render(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *map(line, rows)])


LEGEND = """\
W   the CPU wheel, built once, installed into this torch: its test suite (tests passed)
C.. a CUDA wheel, built once (C13.0: with CUDA 13.0), installed here: must load and register
    its CUDA kernels in a torch of that CUDA major, and refuse with a clear error elsewhere
S   built from source against this torch (CPU variant): loads, kernels registered (or tests)
SC  CUDA variant built from source against this torch: loads with its CUDA kernels
\u2713 passed   \u2717 failed   - skipped (the notes say why)"""


def table(results_dir: Path, markdown: Path | None) -> int:
    runs = load(results_dir)
    if not runs:
        print(f"no matrix results in {results_dir}: run `nox -t matrix` (or the matrix sessions) first")
        return 1
    suites = suite_order({i["suite"] for r in runs for i in r["items"]})
    compact, lanes, detailed, notes = [], [], [], {}
    counts = {"pass": 0, "fail": 0, "skip": 0}
    for run in runs:
        label = run["label"] or run["row"]
        by_suite: dict[str, list[dict]] = {}
        checks: dict[str, dict[str, dict]] = {}
        for item in run["items"]:
            by_suite.setdefault(item["suite"], []).append(item)
            checks.setdefault(item["check"], {})[item["suite"]] = item
            counts[item["status"]] += 1
            if item["status"] != "pass" and item.get("detail"):
                key = (label, item["check"], item["detail"])
                notes.setdefault(key, []).append(item["suite"])
        if run["kind"] == "matrix":
            compact.append([label, *[compact_cell(by_suite.get(s, [])) for s in suites]])
        else:
            lanes.append([label, *[lane_cell(by_suite.get(s, [])) for s in suites]])
        for n, (check, items) in enumerate(checks.items()):
            detailed.append([label if n == 0 else "", check, *[cell(items[s]) if s in items else "" for s in suites]])
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(min(r["started"] for r in runs)))
    minutes = sum(r.get("seconds", 0) for r in runs) / 60
    text = [f"Support matrix: {len(runs)} session(s) since {when}, {minutes:.0f} min in all", ""]
    if compact or lanes:
        text += [render(compact + lanes, ["torch / lane", *suites]), "", LEGEND, ""]
    text += ["Every check:", "", render(detailed, ["torch / lane", "check", *suites]), ""]
    if notes:
        text.append("Notes (failures and skips):")
        for (label, check, detail), where in notes.items():
            text.append(f"- {label}, {check} ({', '.join(where)}): {detail}")
        text.append("")
    text.append(f"matrix: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    out = "\n".join(text)
    print(out)
    if markdown:
        markdown.write_text(out + "\n")
    return 1 if counts["fail"] else 0


def summary_counts(data: dict) -> tuple[int, int, int]:
    """(passed, failed, skipped) of one session's results; any failed check counts."""
    # Test counts where the session ran test suites; its other checks (builds,
    # compiles, loads) count only when they failed. Otherwise: one per check.
    with_counts = any(item.get("counts") for item in data["items"])
    passed = failed = skipped = 0
    for item in data["items"]:
        c = item.get("counts")
        if c:
            passed, failed, skipped = passed + c["passed"], failed + c["failed"], skipped + c["skipped"]
            failed += item["status"] == "fail" and not c["failed"]  # pytest failed outside a test
        elif item["status"] == "fail":
            failed += 1
        elif not with_counts:
            passed += item["status"] == "pass"
            skipped += item["status"] == "skip"
    return passed, failed, skipped


def summary_line(data: dict) -> str:
    """ "tests: N passed, N failed, N skipped" of one session's results."""
    passed, failed, skipped = summary_counts(data)
    return f"{data['kind']}: {passed} passed, {failed} failed, {skipped} skipped"


def summary(path: Path) -> int:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        print(f"{path.name}: no results (the session did not run)")
        return 1
    print(summary_line(data))
    return 1 if summary_counts(data)[1] else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table")
    t.add_argument("results_dir", nargs="?", type=Path, default=RESULTS_DIR)
    t.add_argument("--markdown", type=Path)
    s = sub.add_parser("summary")
    s.add_argument("path", type=Path)
    args = parser.parse_args()
    return table(args.results_dir, args.markdown) if args.cmd == "table" else summary(args.path)


if __name__ == "__main__":
    sys.exit(main())
