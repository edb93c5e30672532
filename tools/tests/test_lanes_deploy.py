"""The support matrix's check that a .pt2 made with one torch release runs
in the later ones (tools/lanes.py, _deploy_across_releases): which releases'
packages each release runs, and the rows it reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import lanes, matrix, steps
from tools import results as results_mod


def _command_failed() -> Exception:
    """What session.run raises for a failed command (nox's, or its stand-in)."""
    try:
        return steps.CommandFailed("exit 1")
    except TypeError:  # subprocess.CalledProcessError without nox
        return steps.CommandFailed(1, "deploy_across.py")


class FakeSession:
    """Records session.run; ``run`` subcommands write the report given by ``reports``."""

    name = "matrix-3.11(torch='2.13')"

    def __init__(self, reports: dict[str, list[dict]]):
        self.reports, self.commands, self.logs, self.errors = reports, [], [], []

    def run(self, *cmd, **kwargs):
        self.commands.append([str(c) for c in cmd])
        if cmd[2] == "run":
            folder = str(cmd[3])
            old = folder.rsplit("/", 1)[-1]
            items = self.reports.get(old)
            if items is not None:  # cmd: python SCRIPT run DIR --json REPORT
                Path(cmd[5]).write_text(json.dumps(items))
            if items is None or any(i["status"] == "fail" for i in items):
                raise _command_failed()
        return ""

    def log(self, text):
        self.logs.append(text)

    def error(self, text):
        self.errors.append(text)


@pytest.fixture
def pt2(tmp_path, monkeypatch):
    root = tmp_path / "pt2"
    monkeypatch.setattr(lanes, "MATRIX_PT2", root)

    def tmp(session, name):
        folder = tmp_path / "tmp" / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    monkeypatch.setattr(steps, "tmp", tmp)
    return root


def _made(root, series, module="round_op"):
    folder = root / series / module
    folder.mkdir(parents=True)
    (folder / "model.pt2").write_bytes(b"")


def _items(r):
    return [(i["suite"], i["check"], i["status"]) for i in r.data["items"]]


def test_first_release_exports_and_has_nothing_to_run(pt2, tmp_path):
    m = matrix.load()
    first = list(m.torches)[0]
    session = FakeSession({})
    r = results_mod.Results(session, "matrix", row=first, results_dir=tmp_path)
    lanes._deploy_across_releases(session, m, r, first, ["round-op"])
    assert [c[2] for c in session.commands] == ["export"]
    assert session.commands[0][3] == str(pt2 / first)
    assert _items(r) == [("round-op", "cpu wheel: .pt2 of earlier torch", "skip")]


def test_later_release_runs_every_earlier_releases_packages(pt2, tmp_path):
    m = matrix.load()
    series = list(m.torches)
    first, second, now, later = series[0], series[1], series[2], series[3]
    for s in (first, second, later):  # `later` is newer than this release: not run
        _made(pt2, s)
    (pt2 / "empty").mkdir()
    ok = {"module": "round_op", "status": "pass", "detail": "equal"}
    bad = {"module": "round_op", "status": "fail", "detail": "differs"}
    session = FakeSession({first: [ok], second: [bad]})
    r = results_mod.Results(session, "matrix", row=now, results_dir=tmp_path)
    lanes._deploy_across_releases(session, m, r, now, ["round-op"])
    assert [(c[2], c[3].rsplit("/", 1)[-1]) for c in session.commands] == [
        ("export", now),
        ("run", first),
        ("run", second),
    ]
    assert _items(r) == [
        ("round-op", f"cpu wheel: .pt2 of torch {first}", "pass"),
        ("round-op", f"cpu wheel: .pt2 of torch {second}", "fail"),
    ]
