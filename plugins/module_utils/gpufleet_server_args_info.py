# -*- coding: utf-8 -*-
# gpufleet: sglang_server_args_info's read as a plain function (sglang_server_args_info and
# sglang_fleet_check_info call it): the inventory's launch args resolved against the installed SGLang.
from __future__ import absolute_import, division, print_function

import os

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang import (
    SGLangLocateError,
    locate_package,
    read_sglang_version,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang_args import (
    SglangArgsError,
    check_launch_args,
    parse_help,
    read_speculative_algorithms,
    read_static,
)

C_ENV = {"LC_ALL": "C", "LANG": "C", "COLUMNS": "100000", "PYTHONDONTWRITEBYTECODE": "1"}


class ArgsInfoError(Exception):
    """The launch args cannot be resolved; ``kwargs`` are the fail_json arguments besides ``msg``."""

    def __init__(self, msg, **kwargs):
        super(ArgsInfoError, self).__init__(msg)
        self.msg = msg
        self.kwargs = kwargs


def find_package(module, python, package_dir):
    """(package_dir, version) of the sglang to check. Raises :class:`ArgsInfoError` when it cannot be found."""
    if package_dir:
        if not os.path.isfile(os.path.join(package_dir, "srt", "server_args.py")):
            raise ArgsInfoError("%s is not an sglang package directory (no srt/server_args.py)" % package_dir)
        return package_dir, read_sglang_version(package_dir)[0]

    def run(argv):
        return module.run_command(argv, environ_update=C_ENV)

    try:
        # here: a module's environment is the one the interpreter would start in (no second start of it).
        found = locate_package(python, run=run, here=True)
    except SGLangLocateError as exc:
        raise ArgsInfoError(str(exc), rc=getattr(exc, "rc", None), stdout=getattr(exc, "stdout", ""),
                            stderr=getattr(exc, "stderr", ""))
    return found["package_dir"], found["version"]


def read_help(module, python, timeout_s):
    """Options listed by ``<python> -m sglang.launch_server --help``. Raises :class:`ArgsInfoError` if it cannot
    run."""
    argv = [python, "-m", "sglang.launch_server", "--help"]
    timeout_bin = module.get_bin_path("timeout")
    run_argv = [timeout_bin, str(timeout_s)] + argv if timeout_bin else argv
    rc, stdout, stderr = module.run_command(run_argv, environ_update=C_ENV)
    if rc == 124 and timeout_bin:
        raise ArgsInfoError("%s did not finish within %d s (help_timeout_s)" % (" ".join(argv), timeout_s),
                            rc=rc, stdout=stdout, stderr=stderr)
    if rc != 0:
        raise ArgsInfoError("%s failed (rc=%s); help mode imports sglang, which needs its full dependencies "
                            "(torch, CUDA); use mode=static on hosts without them" % (" ".join(argv), rc),
                            rc=rc, stdout=stdout, stderr=stderr)
    options = parse_help(stdout)
    if not options:
        raise ArgsInfoError("no options found in the output of %s" % " ".join(argv), rc=rc, stdout=stdout,
                            stderr=stderr)
    return options, " ".join(argv)


def resolve_server_args(module, p):
    """sglang_server_args_info's result for the options ``p`` (its argument_spec's keys: python, package_dir,
    launch_args, host, port, mode, help_timeout_s, extra_speculative_algorithms, extra_choices). ``module``: what
    is used of an AnsibleModule (``run_command``, ``get_bin_path``, ``warn``). Raises :class:`ArgsInfoError` (its
    ``kwargs`` hold the result so far)."""
    if p["port"] is not None and not 0 < p["port"] < 65536:
        raise ArgsInfoError("port must be between 1 and 65535, got %d" % p["port"])
    package_dir, version = find_package(module, p["python"], p["package_dir"])
    result = dict(changed=False, sglang_version=version, sglang_path=package_dir)

    options, style, files, allow_abbrev, mode_used = [], "help", [], True, "help"
    static_problem = None
    if p["mode"] in ("static", "auto"):
        try:
            static = read_static(package_dir)
        except SglangArgsError as exc:
            # A layout this reader does not know (file moved or unparsable): --help still knows the flags.
            if p["mode"] == "static" or not p["python"]:
                raise ArgsInfoError("cannot read the launch options of sglang %s: %s" % (version or "?", exc),
                                    **result)
            static = {"options": [], "style": "help", "files": [], "allow_abbrev": True}
            static_problem = str(exc)
        options, style, files = static["options"], static["style"], static["files"]
        allow_abbrev, mode_used = static["allow_abbrev"], "static"
        if not options and p["mode"] == "static":
            raise ArgsInfoError("no argument definitions recognised in %s (sglang %s); try mode=help"
                                % (", ".join(files), version or "?"), **result)
    if not options:
        if not p["python"]:
            raise ArgsInfoError("no argument definitions recognised in %s and help mode needs python"
                                % package_dir, **result)
        options, command = read_help(module, p["python"], p["help_timeout_s"])
        style, files, mode_used = "help", [command], "help"
        if static_problem:
            module.warn("static reading failed (%s); the flags were checked against --help" % static_problem)

    # None: SGLang checks the value after parsing against names not found in this release (given_unchecked).
    algorithms = read_speculative_algorithms(package_dir)
    known = {"--speculative-algorithm": sorted(set(algorithms) | set(
        a.upper() for a in p["extra_speculative_algorithms"])) if algorithms else None}
    extra = dict((key, value if isinstance(value, list) else [value]) for key, value in p["extra_choices"].items())
    checked = check_launch_args(options, p["launch_args"], host=p["host"], port=p["port"],
                                allow_abbrev=allow_abbrev, known_values=known, extra_choices=extra)
    result.update(
        source_files=files, style=style, mode_used=mode_used, option_count=len(options) + (
            0 if any("--help" in o["option_strings"] for o in options) else 1),
        valid=checked["valid"], errors=checked["errors"], flag_warnings=checked["warnings"],
        resolved=checked["resolved"], values=checked["values"], dest_values=checked["dest_values"],
        argv=checked["argv"] if checked["valid"] else [],
        options_unchecked=sorted(set(u["option"] for u in checked["unchecked"])),
        given_unchecked=checked["unchecked"],
    )
    return result
