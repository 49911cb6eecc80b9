"""gpufleet launch profile filters: load, apply and render a named profile (issue 34).

The decisions live in plugins/plugin_utils/profile.py (tests: tests/unit/plugins/plugin_utils/test_profile.py);
these are their names in playbooks/restart.yml, playbooks/tune.yml and playbooks/tasks/profile_save.yml. They run
on the controller.
"""
from __future__ import annotations

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import profile

gpufleet_profile_read = profile.read_profile
gpufleet_profile_apply = profile.apply_profile
gpufleet_profile_render = profile.render_profile
gpufleet_profile_save_plan = profile.save_plan
gpufleet_profile_check_name = profile.check_name


class FilterModule(object):
    """gpufleet launch profile filters."""

    def filters(self):
        return {
            "gpufleet_profile_read": gpufleet_profile_read,
            "gpufleet_profile_apply": gpufleet_profile_apply,
            "gpufleet_profile_render": gpufleet_profile_render,
            "gpufleet_profile_save_plan": gpufleet_profile_save_plan,
            "gpufleet_profile_check_name": gpufleet_profile_check_name,
        }
