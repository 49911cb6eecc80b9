"""gpufleet filter over the NCCL variables SGLang sets on purpose, for roles/sglang_preflight.

- ``gpufleet_nccl_conflicts(nccl_env, launch_args, sglang_version=None, overrides=[], resolved=None,
  server_env=None)`` → list
  of dicts: the variables of ``sglang_nccl_env`` that would replace a value SGLang sets on purpose for the launch
  flags (``--enable-deterministic-inference`` with tp > 1 sets ``NCCL_ALGO=allreduce:tree``, …), one dict per flag
  with ``message``, ``flag``, ``variables``, ``sglang_sets``, ``where``. The decision and its table (release,
  file and line of every write) live in
  ``plugins/module_utils/gpufleet_sglang_nccl_owned.py``; this file only exposes them to templates.
"""
from __future__ import annotations

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang_nccl_owned import nccl_conflicts


def gpufleet_nccl_conflicts(nccl_env, launch_args, sglang_version=None, overrides=None, resolved=None,
                            server_env=None):
    """:func:`nccl_conflicts` with the inventory's ``sglang_nccl_env`` piped in; see there."""
    return nccl_conflicts(sglang_version, launch_args, nccl_env, overrides=overrides, resolved=resolved,
                          server_env=server_env)


class FilterModule(object):
    """gpufleet SGLang NCCL filters."""

    def filters(self):
        return {"gpufleet_nccl_conflicts": gpufleet_nccl_conflicts}
