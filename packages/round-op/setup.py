"""Build this op package's stable-ABI extension with opscommon's build helper.

Generated from tools/templates/op/setup.py (every op's setup.py is this file).
The helper comes from, in this order: the copy an sdist carries
(``_opscommon/``), the repository's ``packages/opscommon``, or an installed
``opscommon`` (a conda host environment, ``--no-build-isolation``). It is
never resolved from a package index.
"""

import re
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()
for helper in (ROOT / "_opscommon", ROOT.parent / "opscommon" / "src"):
    if (helper / "opscommon" / "build.py").is_file():
        sys.path.insert(0, str(helper))
        break
try:
    from opscommon.build import setup_kwargs
except ImportError:
    sys.exit(
        "error: opscommon's build helper not found: build this package from its sdist or "
        "from the repository (packages/<op>), or run "
        "`pip install --no-build-isolation packages/opscommon` first"
    )

PYPROJECT = (ROOT / "pyproject.toml").read_text()
NAME = re.search(r'^name = "(.+)"', PYPROJECT, re.M).group(1)
VERSION = re.search(r'^version = "(.+)"', PYPROJECT, re.M).group(1)

setup(**setup_kwargs(NAME.replace("-", "_"), VERSION, ROOT))
