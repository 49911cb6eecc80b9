"""Shared pytest set-up: make the project's Python importable the way Ansible loads it.

The repository is also the ``gpufleet.fleet`` collection: ``collections/ansible_collections/gpufleet/fleet`` is a
symlink to the repository root, and ansible.cfg puts ``collections/`` first on ``collections_path``. Modules and
module_utils import ``ansible_collections.gpufleet.fleet.plugins.module_utils.<name>``; putting ``collections/``
on ``sys.path`` lets unit tests import them the same way (plain namespace packages, or Ansible's collection
loader when a test has installed it: both resolve to the same files), load a module file directly and drive
its ``main()``.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIONS = os.path.join(ROOT, "collections")
for _p in (ROOT, os.path.join(ROOT, "tests"), COLLECTIONS):
    if _p not in sys.path:
        sys.path.insert(0, _p)
