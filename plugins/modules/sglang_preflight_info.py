#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: everything the restart's preflight judges a host by, read in one module call.
from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: sglang_preflight_info
short_description: Read in one call what the restart's preflight judges a host by
description:
  - >-
    Reads, in one module call, what C(roles/sglang_preflight) decides a refusal by: the launch arguments resolved
    against the installed SGLang as M(gpufleet.fleet.sglang_server_args_info) resolves them, the NCCL patch's
    answer in check mode as M(gpufleet.fleet.sglang_nccl_patch) gives it, the launcher and the local model
    directories (as M(ansible.builtin.stat) reports them, without following a link), the GPUs as
    M(gpufleet.fleet.nvidia_gpu_info) reads them (processes, no NVLink, no Xid), what the stop would end as
    M(gpufleet.fleet.sglang_stop) lists it in check mode, and the host measurement of
    M(gpufleet.fleet.sglang_host_info) (disk, /dev/shm, the port, GPU memory after the stop, write access,
    ownership, model files, the launch record, the restart lock).
  - >-
    Each part is returned under its own key, shaped as the result of the module that reads it alone (the same
    module_utils functions do the reading): a part that fails carries C(failed) and C(msg) and the others are
    still read. The refusal is decided on the controller (the C(gpufleet.fleet.gpufleet_preflight) filter).
  - >-
    Two reads stay outside this call, for the user they run as: the check that root runs only code root owns
    (as the login user, before any call with become) and, when the NCCL patch runs as another user than this
    call, its write access (M(gpufleet.fleet.sglang_host_info) with that user); and the stop preview when the
    stop runs as another user (pass its result in O(stop_preview)).
  - Never changes anything; runs the same in check mode.
version_added: "0.1.0"
author: gpufleet maintainers (!UNKNOWN)
options:
  gather:
    description:
      - >-
        Parts to read. C(sglang) the launch arguments and the NCCL patch's answer (they run O(python)); C(host)
        the launcher, the model directories, the GPUs, the stop preview and the host measurement.
      - >-
        Root must never run O(python) here: with become, read C(sglang) in a call without become (the login user)
        and C(host) in a second call with become, giving it the first call's result in O(sglang_read).
    type: list
    elements: str
    choices: [sglang, host]
    default: [sglang, host]
  root_interpreter_self:
    description:
      - >-
        First check that root may run this module's interpreter and its virtualenv (as
        M(gpufleet.fleet.sglang_host_info) does with the same option); when it may not, return only
        RV(root_code) and read nothing else. Run this call as the login user, before any call with become.
    type: bool
    default: false
  root_interpreters:
    description:
      - >-
        Other interpreters root runs in this restart, name -> path, checked first as with
        O(root_interpreter_self).
    type: dict
    default: {}
  sglang_read:
    description:
      - >-
        The result of an earlier call that gathered C(sglang) (its C(args) and C(patch)), for a call that gathers
        only C(host).
    type: dict
  python:
    description:
      - Python of the SGLang virtualenv (launch arguments; the NCCL patch unless O(nccl_patch_path) is set).
    type: path
  launch_args:
    description:
      - The inventory's C(sglang_launch_args), resolved against the installed SGLang.
    type: dict
    default: {}
  host:
    description:
      - The server's C(--host) (launch argument check, and which port listeners conflict).
    type: str
    default: 127.0.0.1
  port:
    description:
      - The server's C(--port) (launch argument check, and its listeners).
    type: int
  args_mode:
    description:
      - How the launch arguments are checked, as the O(gpufleet.fleet.sglang_server_args_info#module:mode) option.
    type: str
    choices: [static, help, auto]
    default: auto
  help_timeout_s:
    description:
      - Seconds the C(--help) run of the launcher may take.
    type: int
    default: 300
  extra_speculative_algorithms:
    description:
      - Speculative algorithms accepted beside the release's own.
    type: list
    elements: str
    default: []
  extra_choices:
    description:
      - Choices accepted beside the release's own, per flag.
    type: dict
    default: {}
  nccl_patch_path:
    description:
      - The file the NCCL patch writes, when given instead of finding SGLang's files through O(python).
    type: path
  nccl_env:
    description:
      - The NCCL variables (C(sglang_nccl_env)) the patch writes.
    type: dict
    default: {}
  nccl_env_unchecked:
    description:
      - Names in O(nccl_env) whose values are taken as given (C(sglang_nccl_env_unchecked)).
    type: list
    elements: str
    default: []
  nccl_hand_edits:
    description:
      - How hand-typed lines of a managed variable are judged, as the patch would (C(sglang_nccl_patch_hand_edits)).
    type: str
    choices: [refuse, take_over]
    default: refuse
  nccl_backup:
    description:
      - Whether the patch keeps a backup beside each file (its bytes count in the free-space check).
    type: bool
    default: false
  patch_write_access:
    description:
      - >-
        Check here that the NCCL patch can write the files it would change (the patch runs as the user of this
        call); otherwise check them with a call as the patch's user.
    type: bool
    default: false
  launcher:
    description:
      - The launcher's first word (C(sglang_launcher[0])); only an absolute path is looked at.
    type: str
  path_flags:
    description:
      - SGLang flags whose values are model paths (C(model-path), C(tokenizer-path), ...).
    type: list
    elements: str
    default: []
  expected_gpus:
    description:
      - GPUs the host must show, as O(gpufleet.fleet.nvidia_gpu_info#module:expected_count).
    type: int
  gpu_backend:
    description:
      - GPU backend, as in M(gpufleet.fleet.nvidia_gpu_info).
    type: str
    choices: [auto, nvml, nvidia-smi]
    default: auto
  gpu_timeout_s:
    description:
      - Time limit for the whole GPU read, in seconds.
    type: float
    default: 30
  stop_pid_file:
    description:
      - The pid file the stop reads (C(sglang_stop_pid_file)); unset for the systemd method.
    type: path
  stop_users:
    description:
      - Users whose processes the stop may end (empty is the user of this call).
    type: list
    elements: str
    default: []
  stop_remove_stale_shm:
    description:
      - Whether the stop removes stale segments in C(/dev/shm) (C(sglang_stop_remove_stale_shm)).
    type: bool
    default: true
  stop_preview:
    description:
      - >-
        The result of M(gpufleet.fleet.sglang_stop) in check mode run as the stop's user, when that differs from
        this call's; the stop is then not previewed here.
    type: dict
  measure:
    description:
      - >-
        Options of M(gpufleet.fleet.sglang_host_info) for the host measurement; O(port), O(host), the stop
        preview, the GPUs, the model directories and the patch's files come from this call.
    type: dict
    default: {}
    suboptions:
      paths:
        description: Paths whose filesystem's free space is reported.
        type: list
        elements: path
        default: []
      shm_path:
        description: The shared-memory filesystem NCCL and SGLang use.
        type: path
        default: /dev/shm
      pid_file:
        description: Pid file of the managed server (C(launch_method=process)); a missing file means no managed server.
        type: path
      systemd_unit:
        description: Unit whose C(MainPID) is the managed server (C(launch_method=systemd)), read with C(systemctl show).
        type: str
      max_used_mib:
        description:
          - Used memory per GPU, MiB, at or below which the wait counts a GPU as free (C(gpu_memory_wait_max_used_mib)).
        type: int
        default: 1024
      world_size:
        description:
          - tp-size x pp-size of the server to start (sglang_launch_args). Above 1, C(host.gpu_after_stop.tp_balance) says
            whether SGLang's TP memory-balance check would refuse to start beside memory the stop leaves.
        type: int
        default: 1
      server_env:
        description:
          - The server's extra environment (C(sglang_launch_extra_env)); C(SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=false)
            there switches SGLang's balance check off.
        type: dict
        default: {}
      write_dirs:
        description: Directories that will be written into, created when missing (e.g. the state directory).
        type: list
        elements: path
        default: []
      model_markers:
        description:
          - Flag (with dashes) to the file names one of which its directory must hold; unlisted flags need C(config.json).
        type: dict
        default: {}
      lock_dir:
        description:
          - "The restart lock directory (C(gpufleet_lock)) to read, not take: C(host.restart_lock) names who holds it. A
            preflight asks so that a host another run is restarting is refused for that reason, not for the GPU
            memory, port and C(/dev/shm) that run's stop and launch hold at that moment."
        type: path
      lock_lease_s:
        description:
          - With O(measure.lock_dir), the lease (s) assumed for a lock written by an earlier release without lease fields
            (judged by its mtime, as C(gpufleet_lock) judges it with the lease asked for). Locks with a lease carry
            their own.
        type: int
        default: 300
      owned_paths:
        description:
          - "Files and directories gpufleet trusts (variable name to path: C(sglang_state_dir), C(launch.json), the key
            file). Each one that exists, and every directory above it, must belong to root or to the user the module
            runs as, and be writable by nobody else (a directory with the sticky bit above it may be): the module
            C(gpufleet_trust) (StrictModes' rule, sticky directories excepted) says why in its docstring. A missing
            one is fine, unless another user could create it first (C(host.ownership))."
        type: dict
        default: {}
      launch_record:
        description:
          - "A launch record (C(sglang_launch_record_file)) to read for a rollback: its ownership as O(measure.owned_paths)
            judges it, then its content against gpufleet's schema (module_utils C(gpufleet_launch_record)); returned
            only when both pass (C(host.launch_record))."
        type: path
      launch_unit_dir:
        description: Where the rollback writes the recorded unit (C(sglang_launch_unit_dir)); C(host.launch_record.record.unit_path) is always in it.
        type: path
        default: /etc/systemd/system
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Read-only; runs the same in check mode.
  diff_mode:
    support: none
    details: Changes nothing, so there is nothing to diff.
  platform:
    support: full
    details: Linux hosts with C(/proc).
    platforms: posix
requirements:
  - psutil
  - nvidia-ml-py (for the NVML backend; C(auto) falls back to nvidia-smi without it)
seealso:
  - module: gpufleet.fleet.sglang_server_args_info
  - module: gpufleet.fleet.sglang_nccl_patch
  - module: gpufleet.fleet.nvidia_gpu_info
  - module: gpufleet.fleet.sglang_stop
  - module: gpufleet.fleet.sglang_host_info
"""

EXAMPLES = r"""
- name: Read what the preflight judges
  gpufleet.fleet.sglang_preflight_info:
    python: /opt/sglang/.venv/bin/python
    launch_args: {model-path: /models/Llama-3.1-8B-Instruct, tp-size: 8}
    port: 30000
    launcher: /opt/sglang/.venv/bin/python
    path_flags: [model-path, tokenizer-path]
    stop_pid_file: /var/lib/gpufleet/sglang.pid
    measure:
      paths: [/var/lib/gpufleet]
      pid_file: /var/lib/gpufleet/sglang.pid
      lock_dir: /var/lib/gpufleet/restart.lock
  register: read
"""

RETURN = r"""
gathered:
  description: The parts read in this call.
  returned: always
  type: list
  elements: str
root_code:
  description:
    - >-
      What makes root's run of these interpreters unsafe (entries as M(gpufleet.fleet.sglang_host_info) returns
      them); when not empty nothing else was read.
  returned: when O(root_interpreter_self) is true or O(root_interpreters) is not empty
  type: list
  elements: dict
args:
  description: The M(gpufleet.fleet.sglang_server_args_info) result (or C(failed) and C(msg)).
  returned: when C(sglang) is gathered
  type: dict
patch:
  description:
    - >-
      The M(gpufleet.fleet.sglang_nccl_patch) answer in check mode: C(changed) whether it would change a file,
      C(paths), C(files) per file, C(sglang_version), C(hand_edits); C(failed) and C(msg) where it would fail.
  returned: when C(sglang) is gathered
  type: dict
launcher:
  description: C(path), C(exists) and C(executable) of O(launcher) (only an absolute one).
  returned: when C(host) is gathered and O(launcher) is an absolute path
  type: dict
model_paths:
  description:
    - >-
      The model path flags' values, C(key) (the flag's destination, e.g. C(model_path)), C(value), C(local)
      (starts with C(/) or C(.)), and for a local one C(exists) and C(isdir).
  returned: when C(host) is gathered
  type: list
  elements: dict
gpu:
  description: The M(gpufleet.fleet.nvidia_gpu_info) result (or C(failed), C(msg) and C(error_class)).
  returned: when C(host) is gathered
  type: dict
stop_preview:
  description: The M(gpufleet.fleet.sglang_stop) result in check mode (or C(failed) and C(msg)).
  returned: when C(host) is gathered
  type: dict
host:
  description: The M(gpufleet.fleet.sglang_host_info) result (or C(failed) and C(msg)).
  returned: when C(host) is gathered
  type: dict
"""

import gc
import os
import stat

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_host_measure import (
    MEASURE_OPTIONS,
    MeasureError,
    measure,
    root_code,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_host_reads import (
    PYTHON_NOT_SET,
    failed,
    locate,
    read_args,
    read_gpu,
    runner,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_nccl_check import preview_patch
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_procs import HAS_PSUTIL, PSUTIL_IMPORT_ERROR
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_module
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang_hand_edits import HAND_EDIT_MODES
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_stop_plan import StopPlanError, plan_stop

PARTS = ["sglang", "host"]
MEASURE_KEYS = [
    'paths',
    'shm_path',
    'pid_file',
    'systemd_unit',
    'max_used_mib',
    'world_size',
    'server_env',
    'write_dirs',
    'model_markers',
    'lock_dir',
    'lock_lease_s',
    'owned_paths',
    'launch_record',
    'launch_unit_dir',
]


class PartFailed(Exception):
    """A part's read called fail_json (run_command does, for a command that cannot run): that part failed."""

    def __init__(self, result):
        super(PartFailed, self).__init__(result.get("msg"))
        self.result = result


def part(module, read, *args):
    """``read(module, *args)``, with a fail_json inside it making only that part's result a failure (shaped as
    the failed module's result) instead of ending the module."""
    real = module.fail_json

    def fail(msg=None, **kwargs):
        if "exception" in kwargs:
            kwargs["exception"] = str(kwargs["exception"])
        raise PartFailed(failed(msg, **kwargs))
    module.fail_json = fail
    try:
        return read(module, *args)
    except PartFailed as exc:
        return exc.result
    finally:
        module.fail_json = real


def path_stat(path):
    """``exists``, ``isdir``, ``executable`` of ``path`` as ansible.builtin.stat reports them (a link is not
    followed for ``isdir``; ``executable`` is os.access's X_OK)."""
    try:
        st = os.lstat(path)
    except OSError:
        return {"exists": False}
    return {"exists": True, "isdir": stat.S_ISDIR(st.st_mode), "executable": os.access(path, os.X_OK)}


def model_paths(resolved, path_flags):
    """The model path flags' string values from the resolved launch arguments (``dest_values``)."""
    dests = set(flag.replace("-", "_") for flag in path_flags)
    out = []
    for key, value in (resolved.get("dest_values") or {}).items():
        if key in dests and isinstance(value, str):
            entry = {"key": key, "value": value, "local": value.startswith(("/", "."))}
            if entry["local"]:
                entry.update((k, v) for k, v in path_stat(value).items() if k != "executable")
            out.append(entry)
    return out


def read_patch(module, p, package=None):
    if not (p["nccl_patch_path"] or p["python"]):
        return failed("one of the following is required: path, python (%s)" % PYTHON_NOT_SET)
    out = preview_patch(python=None if p["nccl_patch_path"] else p["python"], path=p["nccl_patch_path"] or None,
                        env=p["nccl_env"], unchecked=p["nccl_env_unchecked"], hand_edits=p["nccl_hand_edits"],
                        backup=p["nccl_backup"], run=runner(module, LANG="C"), here=True, package=package)
    for warning in out.pop("warnings", []):
        module.warn(warning)
    return out


def read_host_gpu(module, p):
    if not HAS_PSUTIL:
        return failed(missing_required_lib("psutil") + " (or set processes: false)",
                      exception=str(PSUTIL_IMPORT_ERROR), error_class="missing_library")
    return read_gpu(module, p["gpu_backend"], p["gpu_timeout_s"], nvlink=False, expected_count=p["expected_gpus"])


def read_stop(p):
    if not HAS_PSUTIL:
        return failed(missing_required_lib("psutil"), exception=str(PSUTIL_IMPORT_ERROR))
    try:
        return plan_stop(pid_file=p["stop_pid_file"], users=p["stop_users"],
                         remove_stale_shm=p["stop_remove_stale_shm"])
    except StopPlanError as exc:
        return failed(exc.msg, **exc.result)


def measure_options(p, result, patch):
    """sglang_host_info's options for this call: O(measure), with what this call read."""
    opts = dict((key, spec.get("default")) for key, spec in MEASURE_OPTIONS.items())
    opts.update((key, value) for key, value in (p["measure"] or {}).items() if value is not None)
    model_dirs = dict((e["key"], e["value"]) for e in result["model_paths"] if e.get("isdir"))
    # The local model directories are measured after the first path (the state directory) and before the others.
    opts.update(port=p["port"], host=p["host"], model_dirs=model_dirs,
                paths=list(opts["paths"][:1]) + list(model_dirs.values()) + list(opts["paths"][1:]),
                stop_preview=result["stop_preview"] if "msg" not in result["stop_preview"] else None,
                gpu_info=result["gpu"] if "gpus" in result["gpu"] else None,
                replace_files=list(patch.get("paths") or []) if p["patch_write_access"] and "msg" not in patch
                else [])
    return opts


def gather(module, p):
    """The module's result for its options ``p`` (every part caught: a failed part does not stop the others)."""
    parts = [name for name in PARTS if name in (p["gather"] or [])]
    result = {"changed": False, "gathered": []}
    if p["root_interpreter_self"] or p["root_interpreters"]:
        result["root_code"] = root_code(p["root_interpreters"], p["root_interpreter_self"])
        if result["root_code"]:
            return result
    if "sglang" in parts:
        # SGLang is located once, for the launch args and the NCCL patch plan.
        package = None if p["nccl_patch_path"] else part(module, locate, p["python"])
        package = package if package and package.get("package_dir") else None  # not found: each read says why
        result["args"] = part(module, read_args, p["python"], p["launch_args"], p["host"], p["port"], p["args_mode"],
                              p["help_timeout_s"], p["extra_speculative_algorithms"], p["extra_choices"], package)
        result["patch"] = part(module, read_patch, p, package)
    if "host" in parts:
        earlier = p["sglang_read"] or {}
        args, patch = result.get("args", earlier.get("args") or {}), result.get("patch", earlier.get("patch") or {})
        if (p["launcher"] or "").startswith("/"):
            result["launcher"] = dict(path_stat(p["launcher"]), path=p["launcher"])
        result["model_paths"] = model_paths(args, p["path_flags"])
        result["gpu"] = part(module, read_host_gpu, p)
        result["stop_preview"] = p["stop_preview"] if p["stop_preview"] is not None else read_stop(p)
        try:
            result["host"] = measure(measure_options(p, result, patch), run_command=lambda argv: module.run_command(
                argv, environ_update={"LC_ALL": "C"}), get_bin_path=module.get_bin_path)
        except MeasureError as exc:
            result["host"] = failed(exc.msg, **exc.kwargs)
    result["gathered"] = parts
    return result


def main():
    measure_spec = dict((key, MEASURE_OPTIONS[key]) for key in MEASURE_KEYS)
    module = AnsibleModule(
        argument_spec=dict(
            gather=dict(type="list", elements="str", choices=PARTS, default=list(PARTS)),
            root_interpreter_self=dict(type="bool", default=False),
            root_interpreters=dict(type="dict", default={}),
            sglang_read=dict(type="dict"),
            python=dict(type="path"),
            launch_args=dict(type="dict", default={}),
            host=dict(type="str", default="127.0.0.1"),
            port=dict(type="int"),
            args_mode=dict(type="str", choices=["static", "help", "auto"], default="auto"),
            help_timeout_s=dict(type="int", default=300),
            extra_speculative_algorithms=dict(type="list", elements="str", default=[]),
            extra_choices=dict(type="dict", default={}),
            nccl_patch_path=dict(type="path"),
            nccl_env=dict(type="dict", default={}),
            nccl_env_unchecked=dict(type="list", elements="str", default=[]),
            nccl_hand_edits=dict(type="str", choices=list(HAND_EDIT_MODES), default="refuse"),
            nccl_backup=dict(type="bool", default=False),
            patch_write_access=dict(type="bool", default=False),
            launcher=dict(type="str"),
            path_flags=dict(type="list", elements="str", default=[]),
            expected_gpus=dict(type="int"),
            gpu_backend=dict(type="str", choices=["auto", "nvml", "nvidia-smi"], default="auto"),
            gpu_timeout_s=dict(type="float", default=30),
            stop_pid_file=dict(type="path"),
            stop_users=dict(type="list", elements="str", default=[]),
            stop_remove_stale_shm=dict(type="bool", default=True),
            stop_preview=dict(type="dict"),
            measure=dict(type="dict", default={}, options=measure_spec),
        ),
        supports_check_mode=True,
    )
    redact_module(module)  # no API key in any result, message or warning (issue 31)
    p = module.params
    if p["measure"].get("pid_file") and p["measure"].get("systemd_unit"):
        module.fail_json(msg="parameters are mutually exclusive: measure.pid_file|measure.systemd_unit")
    for key in ("expected_gpus", "gpu_timeout_s"):
        if p[key] is not None and p[key] < 0:
            module.fail_json(msg="%s must be 0 or more (got %s)" % (key, p[key]))
    module.exit_json(**gather(module, p))


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
