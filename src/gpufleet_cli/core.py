"""The controller-side core (``plugins/plugin_utils`` of the gpufleet.fleet collection), imported for the CLI.

The CLI runs the collection's playbooks (a checkout's, else ``gpufleet.fleet.<name>`` from the installed
collection), so it takes the core from that same collection: one version of the decisions for the playbooks, the
summary callback and the CLI's report, and no copy of it in the gpufleet pip package. The import is an ordinary
one of ``ansible_collections.gpufleet.fleet.plugins.plugin_utils``: each directory Ansible looks for collections
in (the checkout's ``collections/``, then ``collections_path`` from ansible.cfg or ANSIBLE_COLLECTIONS_PATH, then
the default ``~/.ansible/collections:/usr/share/ansible/collections``) is put on ``sys.path``, and
``ansible_collections`` (a namespace package, as the collection loader treats it) resolves to the first that
holds gpufleet/fleet.
"""
from __future__ import annotations

import importlib
import os
import sys

PACKAGE = "ansible_collections.gpufleet.fleet.plugins.plugin_utils"
_DEFAULT_PATHS = ("~/.ansible/collections", "/usr/share/ansible/collections")


class CoreMissing(ImportError):
    """The gpufleet.fleet collection is nowhere Ansible looks for it."""


def collection_roots(project=None, environ=None):
    """Directories holding ``ansible_collections/`` to look in, in Ansible's order: the checkout's
    ``collections/`` (``project``), ANSIBLE_COLLECTIONS_PATH (or the older ANSIBLE_COLLECTIONS_PATHS), else the
    configured ``collections_path`` (ansible.cfg as Ansible finds it), else Ansible's default."""
    environ = os.environ if environ is None else environ
    roots = [os.path.join(project, "collections")] if project else []
    value = environ.get("ANSIBLE_COLLECTIONS_PATH") or environ.get("ANSIBLE_COLLECTIONS_PATHS")
    if value:
        roots += value.split(os.pathsep)
    else:
        try:
            from ansible import constants as C
            roots += list(C.COLLECTIONS_PATHS or [])
        except Exception:  # noqa: BLE001 - no ansible-core, or a config it refuses: its defaults
            roots += list(_DEFAULT_PATHS)
    out = []
    for root in roots:
        root = os.path.abspath(os.path.expanduser(root)) if root else ""
        if root and root not in out:
            out.append(root)
    return out


def _holds_core(root):
    return os.path.isfile(os.path.join(root, "ansible_collections", "gpufleet", "fleet", "plugins", "plugin_utils",
                                       "run.py"))


def load(name="run", project=None, environ=None):
    """``ansible_collections.gpufleet.fleet.plugins.plugin_utils.<name>`` from the collection the CLI runs.

    Already importable (a test, Ansible's collection loader): that one. Else the first of
    :func:`collection_roots` that holds the collection goes on ``sys.path``. Raises :class:`CoreMissing`
    naming where it looked."""
    module = PACKAGE + "." + name
    try:
        return importlib.import_module(module)
    except ImportError:
        pass
    roots = collection_roots(project, environ)
    for root in roots:
        if _holds_core(root):
            if root not in sys.path:
                sys.path.append(root)
            importlib.invalidate_caches()
            return importlib.import_module(module)
    raise CoreMissing("the gpufleet.fleet collection is not installed where Ansible looks for collections (%s): "
                      "install it (ansible-galaxy collection install gpufleet-fleet-*.tar.gz) or run gpufleet from "
                      "a checkout" % ":".join(roots))
