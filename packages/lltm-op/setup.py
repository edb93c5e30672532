"""Build lltm-op's stable-ABI extension through opscommon's build helper."""

import re
from pathlib import Path

from setuptools import setup

from opscommon.build import setup_kwargs

ROOT = Path(__file__).parent.resolve()
VERSION = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)

setup(**setup_kwargs("lltm_op", VERSION, ROOT))
