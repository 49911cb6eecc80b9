"""Render roles/sglang_launch/templates/sglang.service.j2 as the role does: with gpufleet's filters under their
FQCN (gpufleet.fleet.<name>), as a role in the installed collection names them. Shared by the unit tests that read
the unit back (test_filter_gpufleet, test_gpufleet_unit_values, test_gpufleet_launch_record)."""
import os

import jinja2

from plugins.filter import gpufleet as f

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "roles", "sglang_launch", "templates")


def render_unit(values):
    """The unit text the template writes for ``values`` (the role's variables it reads)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), trim_blocks=True, keep_trailing_newline=True)
    env.filters.update({"gpufleet.fleet." + name: fn for name, fn in f.FilterModule().filters().items()})
    return env.get_template("sglang.service.j2").render(**values)
