"""gpufleet filters for what root runs on a host (issue 31): which interpreters preflight must judge before root
runs them. Plain functions, unit-tested in tests/unit/test_filter_gpufleet_trust.py; nothing here touches a host.

- ``gpufleet_root_interpreters(become, login_user, python, patch_path)`` -> dict: ``self`` (bool: Ansible's own
  interpreter on the host, ``ansible_python_interpreter``, runs as root for some task of the run) and
  ``interpreters`` (label -> path of other interpreters root runs: ``sglang_python``, which the NCCL patch runs to
  find sglang).
"""
from __future__ import annotations

from ansible.errors import AnsibleFilterError


def _bool(value):
    if isinstance(value, str):
        return value.strip().lower() in ("true", "yes", "1", "on")
    return bool(value)


def gpufleet_root_interpreters(become, login_user, python="", patch_path=""):
    """Which interpreters root runs on a host in this run.

    ``become``: name -> the become (bool or its text) of each step that runs modules with become (preflight,
    stop, the NCCL patch and its copies, the systemd launch): any of them true runs ``ansible_python_interpreter``
    as root, and so does a root login (every task). The NCCL patch runs ``python`` (``sglang_python``) itself to
    find sglang (``locate_sglang``), as root with the key ``patch`` true or a root login, unless ``patch_path``
    names the file.
    """
    if not isinstance(become, dict):
        raise AnsibleFilterError("gpufleet_root_interpreters: expected a dict of become flags, got %r" % (become,))
    root_login = str(login_user or "").strip() == "root"
    interpreters = {}
    if python and not patch_path and (root_login or _bool(become.get("patch", False))):
        interpreters["sglang_python"] = python
    return {"self": root_login or any(_bool(v) for v in become.values()), "interpreters": interpreters}


class FilterModule(object):
    """gpufleet trust filters."""

    def filters(self):
        return {"gpufleet_root_interpreters": gpufleet_root_interpreters}
