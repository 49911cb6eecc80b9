"""setuptools' hook for the one thing pyproject.toml cannot say: the gpufleet command's version is the collection's,
read from galaxy.yml (the one version source; docs/releasing.md). Everything else is in pyproject.toml."""
import os

import yaml
from setuptools import setup

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "galaxy.yml"), encoding="utf-8") as fh:
    setup(version=str(yaml.safe_load(fh)["version"]))
