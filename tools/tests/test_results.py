"""Results files: the closing line CI reads, and the matrix table."""

from __future__ import annotations

import json

from tools import results


class FakeSession:
    name = "tests-3.11"

    def __init__(self):
        self.logs, self.errors = [], []

    def log(self, text):
        self.logs.append(text)

    def error(self, text):
        self.errors.append(text)


def test_results_file_and_closing_line(tmp_path):
    session = FakeSession()
    r = results.Results(session, "tests", results_dir=tmp_path)
    r.add("round-op", "build", "pass", "built")
    r.add("round-op", "tests", "pass", "3 passed", counts={"passed": 3, "failed": 0, "skipped": 1})
    r.finish()
    assert session.logs[-1] == "tests: 3 passed, 0 failed, 1 skipped" and not session.errors
    assert results.summary(tmp_path / "tests-3.11.json") == 0


def test_a_failure_fails_the_session(tmp_path):
    session = FakeSession()
    r = results.Results(session, "tests", results_dir=tmp_path)
    r.add("lltm-op", "build", "fail", "build failed")
    r.finish()
    assert session.errors and "build lltm-op" in session.errors[0]
    assert results.summary(tmp_path / "tests-3.11.json") == 1


def test_missing_results_fail_the_summary(tmp_path):
    assert results.summary(tmp_path / "none.json") == 1


def test_matrix_table(tmp_path, capsys):
    run = {
        "session": "matrix-3.11(torch='2.13')",
        "kind": "matrix",
        "row": "2.13",
        "label": "torch 2.13.0",
        "started": 0,
        "seconds": 60,
        "items": [
            {
                "suite": "round-op",
                "check": "cpu wheel: tests",
                "status": "pass",
                "text": "",
                "detail": "",
                "counts": {"passed": 7, "failed": 0, "skipped": 0},
            },
            {
                "suite": "round-op",
                "check": "cu130 wheel: load",
                "status": "skip",
                "text": "no toolkit",
                "detail": "why",
            },
        ],
    }
    (tmp_path / "m.json").write_text(json.dumps(run))
    assert results.table(tmp_path, tmp_path / "m.md") == 0
    out = capsys.readouterr().out
    assert "torch 2.13.0" in out and "W\u27137" in out and "matrix: 1 passed, 0 failed, 1 skipped" in out
