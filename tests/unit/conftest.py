"""Unit-test set-up shared by every module test.

ansible-core 2.19+ switches ``module_utils`` into "controller" mode as soon as any controller-side module
(``ansible.errors``, the template engine, ...) has been imported in the process: from then on
``module.warn()`` prints through Display instead of returning ``warnings`` in the result. Tests drive
modules in-process next to filter tests that import controller code, so each test starts in module mode,
as a module runs on a target.
"""
import pytest

try:
    from ansible.module_utils import _internal as _ansible_internal
except ImportError:  # ansible-core < 2.19 has no controller/module split
    _ansible_internal = None


@pytest.fixture(autouse=True)
def _module_side_of_ansible(monkeypatch):
    if _ansible_internal is not None and hasattr(_ansible_internal, "is_controller"):
        monkeypatch.setattr(_ansible_internal, "is_controller", False)
