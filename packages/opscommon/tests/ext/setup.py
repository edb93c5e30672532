"""A tiny op package built with opscommon.build, for the build tests."""

from pathlib import Path

from opscommon.build import setup_kwargs
from setuptools import setup

setup(
    name="opscommon-tiny",
    version="0.0.0",
    packages=[],
    **setup_kwargs("opscommon_tiny", "0.0.0", Path(__file__).parent.resolve()),
)
