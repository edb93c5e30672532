"""Tooling of the monorepo: what the nox sessions, CI and the conda chain run.

The noxfile holds only sessions; the logic lives here, in small modules with
unit tests (``tools/tests``, run by ``nox -s tests-3.11``):

- :mod:`tools.matrix`: matrix.toml, typed and loaded once (the one source of
  the torch floor, the Python floor, the arch list, the torch releases, the
  CUDA toolkits and the wheel variants);
- :mod:`tools.packages`: which folders of packages/ are op packages;
- :mod:`tools.toolkits`: CUDA toolkits (PyPI, Debian, the machine's own);
- :mod:`tools.emulated`, :mod:`tools.freethreaded`: the interpreters of the
  aarch64 (qemu) and free-threaded CPython test lanes;
- :mod:`tools.steps`: build, install and test steps of a session;
- :mod:`tools.wheels`: portability checks of built wheels, per-variant indexes;
- :mod:`tools.results`: results of a session and the matrix report;
- :mod:`tools.scaffold`: ``nox -s new_op -- NAME``;
- :mod:`tools.conda_build`, :mod:`tools.recipes`: the conda chain.

This folder is plain Python run from the repository (never installed): the
noxfile puts the repository root on ``sys.path``.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
