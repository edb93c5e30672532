"""``nox -s deploy_across [-- FROM TO]``: an AOTInductor package (``.pt2``)
made with the wheels of torch FROM runs with torch TO (default: the everyday
torch of matrix.toml and the next listed series).

The session's own environment gets torch FROM; every package is built there
(CPU) and scripts/deploy_across.py exports each op's deployment model (its
tests/test_deploy_<op>.py) into a ``.pt2`` with sample inputs and eager
outputs. A second environment gets torch TO and the very same wheels; there
each ``.pt2`` runs in a fresh Python and through the C++ runner built against
TO's libtorch, and must give the saved outputs.
"""

from __future__ import annotations

import json
from typing import Any

from . import steps
from .matrix import Matrix
from .packages import COMMON, op_packages
from .results import Results

SCRIPT = steps.SCRIPTS / "deploy_across.py"


def releases(m: Matrix, posargs: list[str]) -> tuple[str, str]:
    """(FROM, TO) series from ``-- FROM TO``, else the everyday torch and the
    series listed after it."""
    series = list(m.torches)
    if posargs:
        if len(posargs) != 2 or any(s not in m.torches for s in posargs):
            raise ValueError(f"usage: nox -s deploy_across -- FROM TO, each one of {', '.join(series)}")
        return posargs[0], posargs[1]
    i = series.index(m.lane_torch)
    if i + 1 >= len(series):
        raise ValueError(f"torch {m.lane_torch} is the newest series in matrix.toml: name FROM and TO")
    return m.lane_torch, series[i + 1]


def deploy_across(session: Any, m: Matrix, old: str, new: str) -> None:
    results = Results(session, "deploy_across", row=f"{old}->{new}")
    # torch FROM: build every package, export and compile the models.
    old_version, _ = steps.install_env(session, m, old)
    wheels = steps.tmp(session, "wheels")
    built = steps.build_and_install(session, op_packages(), results, wheels, check=f"build (torch {old_version})")
    cases = steps.tmp(session, "pt2")
    session.run("python", str(SCRIPT), "export", str(cases), *built)

    # torch TO, in an environment of its own, with the same wheels.
    env = steps.tmp(session, "newer-torch")
    session.run("python", "-m", "venv", "--without-pip", str(env))
    python = env / "bin" / "python"
    wheel_files = [str(w) for w in sorted(wheels.glob("*.whl"))]
    requirements = [f"torch=={m.torches[new].version}", "numpy", *wheel_files]
    if getattr(session.virtualenv, "venv_backend", "") == "uv":
        session.run("uv", "pip", "install", "--python", str(python), *requirements, external=True, silent=True)
    else:
        session.run("python", "-m", "pip", "--python", str(python), "install", *requirements, silent=True)
    new_version = session.run(
        str(python), "-c", "import torch; print(torch.__version__)", external=True, silent=True
    ).strip()
    results.data["label"] = f".pt2 made with torch {old_version}, run with torch {new_version}"
    report = cases / "results.json"
    session.run(str(python), str(SCRIPT), "run", str(cases), "--json", str(report), external=True, success_codes=[0, 1])
    try:
        items = json.loads(report.read_text())
    except (OSError, ValueError):
        items = []
        results.add(COMMON, "run", "fail", "no report", "scripts/deploy_across.py run did not finish")
    for item in items:
        results.add(item["module"].replace("_", "-"), "run", item["status"], item["status"], item["detail"])
    results.finish()
