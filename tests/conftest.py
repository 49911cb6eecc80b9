"""Shared pytest set-up: make the project's module_utils importable the way Ansible ships them.

Ansible serves files from ``plugins/module_utils`` as ``ansible.module_utils.<name>``; unit tests import
them the same way, so a module file can be loaded directly and its ``main()`` driven.
"""
import os
import sys

import ansible.module_utils

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MU = os.path.join(ROOT, "plugins", "module_utils")
if _MU not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(_MU)
for _p in (ROOT, os.path.join(ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
