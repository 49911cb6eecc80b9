#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: everything playbooks/check.yml judges a host by, read in one module call.
from __future__ import absolute_import, division, print_function

DOCUMENTATION = r"""
---
module: sglang_fleet_check_info
short_description: Read in one call what the fleet check judges a GPU host by
description:
  - >-
    Reads, in one module call, what C(playbooks/check.yml) judges a host by: the GPUs as
    M(gpufleet.fleet.nvidia_gpu_info) reads them (processes, NVLink, Xid events), the managed SGLang server and
    its start time as M(gpufleet.fleet.sglang_host_info) finds it, the server's C(/health_generate) and
    C(/get_server_info) answers, the inventory's launch arguments resolved against the installed SGLang as
    M(gpufleet.fleet.sglang_server_args_info) resolves them, the NCCL block of every file the patch writes as
    M(gpufleet.fleet.sglang_nccl_patch) judges it in check mode, and the NCCL variables of every GPU worker as
    M(gpufleet.fleet.sglang_worker_env_info) reads them.
  - >-
    Each part is returned under its own key, shaped as the result of the module that reads it alone (the same
    module_utils functions do the reading), so a part that fails carries C(failed) and C(msg) and the others are
    still returned. The verdict is made on the controller (the C(gpufleet.fleet.gpufleet_check_verdict) filter).
  - Never changes anything; runs the same in check mode.
version_added: "0.1.0"
author: gpufleet maintainers (!UNKNOWN)
options:
  gather:
    description:
      - >-
        Parts to read. C(server) the managed server (pid, running, start time); C(gpu) the GPUs (and DCGM's health
        watches where O(dcgmi) is found); C(sglang) the server's answers and the launch arguments (the arguments
        only when it answers a generation); C(nccl_files) the NCCL block in SGLang's files; C(nccl_workers) the
        workers' environments (only while the server runs).
      - C(nccl_files) and C(nccl_workers) are read only when O(nccl_env) is not empty.
    type: list
    elements: str
    choices: [server, gpu, sglang, nccl_files, nccl_workers]
    default: [server, gpu, sglang, nccl_files, nccl_workers]
  root_interpreter_self:
    description:
      - >-
        First check that root may run this module's interpreter and its virtualenv (as
        M(gpufleet.fleet.sglang_host_info) does with the same option); when it may not, return only
        RV(root_code) and read nothing else. Run this call as the login user, before any call with become.
    type: bool
    default: false
  pid_file:
    description:
      - Pid file of a server started with the process launch method.
    type: path
  systemd_unit:
    description:
      - systemd unit of a server started with the systemd launch method (its C(MainPID)).
    type: str
  pid:
    description:
      - >-
        The server's pid for C(nccl_workers) when C(server) is not gathered in the same call (a second call with
        become gets it from the first).
    type: int
  backend:
    description:
      - GPU backend, as in M(gpufleet.fleet.nvidia_gpu_info).
    type: str
    choices: [auto, nvml, nvidia-smi]
    default: auto
  gpu_timeout_s:
    description:
      - Time limit for the whole GPU read, in seconds; a hung nvidia-smi is abandoned after it.
    type: float
    default: 30
  dcgmi:
    description:
      - >-
        With C(gpu): NVIDIA DCGM's C(dcgmi), a name looked up on PATH or a path. Where it is found, C(dcgmi health
        -c -j) is run once (no shell) and its answer returned as RV(dcgm); where a name is not found nothing is
        read (DCGM is not installed). An empty string skips the read.
    type: str
    default: dcgmi
    version_added: "0.2.0"
  dcgmi_timeout_s:
    description:
      - >-
        Time limit for C(dcgmi health -c -j), in seconds (it runs beside the GPU read); a dcgmi that does not
        answer is abandoned after it (RV(dcgm) then says C(timeout)).
    type: float
    default: 10
    version_added: "0.2.0"
  xid_window_min:
    description:
      - Minutes of kernel log read for Xid events (0 skips the read).
    type: int
    default: 60
  kmsg_path:
    description:
      - Kernel log in C(/dev/kmsg) record format (default C(/dev/kmsg)).
    type: path
  url:
    description:
      - Base URL of the server, for example C(http://127.0.0.1:30000). Required for C(sglang).
    type: str
  request_timeout_s:
    description:
      - Seconds each of the two requests may take.
    type: int
    default: 30
  api_key:
    description:
      - >-
        The server's API key, sent as C(Authorization: Bearer) with the C(/get_server_info) request. Never
        returned.
    type: str
  python:
    description:
      - Python of the SGLang virtualenv (launch arguments, NCCL block).
    type: path
  launch_args:
    description:
      - The inventory's C(sglang_launch_args), resolved against the installed SGLang.
    type: dict
    default: {}
  host:
    description:
      - The server's C(--host), for the launch argument check.
    type: str
  port:
    description:
      - The server's C(--port), for the launch argument check.
    type: int
  nccl_env:
    description:
      - The NCCL variables (C(sglang_nccl_env)) the block and every worker must hold.
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
      - >-
        How hand-typed lines of a managed variable are judged, as the patch would (C(sglang_nccl_patch_hand_edits)).
    type: str
    choices: [refuse, take_over]
    default: refuse
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
    platforms: posix
requirements:
  - psutil
  - nvidia-ml-py (for the NVML backend; C(auto) falls back to nvidia-smi without it)
seealso:
  - module: gpufleet.fleet.nvidia_gpu_info
  - module: gpufleet.fleet.sglang_host_info
  - module: gpufleet.fleet.sglang_server_args_info
  - module: gpufleet.fleet.sglang_nccl_patch
  - module: gpufleet.fleet.sglang_worker_env_info
"""

EXAMPLES = r"""
- name: Read the host for the fleet check
  gpufleet.fleet.sglang_fleet_check_info:
    pid_file: /var/lib/gpufleet/sglang.pid
    url: http://127.0.0.1:30000
    python: /opt/sglang/venv/bin/python
    launch_args: {tp-size: 8}
    nccl_env: {NCCL_PROTO: Simple}
  register: read

- name: Only the GPUs
  gpufleet.fleet.sglang_fleet_check_info:
    gather: [gpu]
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
      What makes root's run of this interpreter unsafe (entries as M(gpufleet.fleet.sglang_host_info) returns
      them); when not empty nothing else was read.
  returned: when O(root_interpreter_self) is true
  type: list
  elements: dict
host:
  description: The managed server, C(managed_pid) and C(managed_running) (or C(failed) and C(msg)).
  returned: when C(server) is gathered
  type: dict
started:
  description:
    - >-
      When the server started, C(create_time), and when that was read, C(now); both Unix time from this host's
      clock (or C(failed) and C(msg)).
  returned: when C(server) is gathered and the server runs
  type: dict
gpu:
  description: The M(gpufleet.fleet.nvidia_gpu_info) result (or C(failed), C(msg) and C(error_class)).
  returned: when C(gpu) is gathered
  type: dict
dcgm:
  description:
    - >-
      What C(dcgmi health -c -j) said, normalized (DCGM's background health watches; docs/dcgm.md). C(status) is
      C(ok) (read), C(absent) (no dcgmi on PATH: nothing read), C(not_found) (O(dcgmi) names a path that is not
      there), C(hostengine_down) (dcgmi could not connect to nv-hostengine), C(no_watches) (no health watch is
      set), C(timeout), C(error) (another non-zero exit) or C(malformed) (not the JSON dcgmi documents).
    - >-
      C(overall) is C(pass), C(warn), C(fail) or C(unknown) (C(overall_text) is dcgmi's word); C(incidents) lists
      one entry per entity and health system with C(entity_group) (C(GPU), C(Switch), ...), C(entity_id),
      C(gpu) (the GPU id when the entity is a GPU, else null), C(system) (C(pcie), C(nvlink), C(memory),
      C(thermal), C(power), C(inforom), C(driver), C(sm), C(connectx), C(other)), C(system_text), C(health)
      (C(warn), C(fail), C(unknown)), C(health_text) and C(message) (DCGM's text). C(dcgmi) is the binary run,
      C(rc) its exit status, C(msg) what went wrong in dcgmi's own words.
  returned: when C(gpu) is gathered and O(dcgmi) is not empty
  type: dict
  sample:
    status: ok
    dcgmi: /usr/bin/dcgmi
    rc: 0
    overall: fail
    overall_text: Failure
    incidents:
      - entity_group: GPU
        entity_id: "3"
        gpu: 3
        system: memory
        system_text: Memory system
        health: fail
        health_text: Failure
        message: Detected 2 volatile double-bit ECC error(s) in GPU 3.
health:
  description: C(/health_generate) as M(ansible.builtin.uri) returns it, C(status), C(url) and C(msg).
  returned: when C(sglang) is gathered
  type: dict
server_info:
  description: C(/get_server_info) with C(status), C(url), C(msg) and C(json) (the answer).
  returned: when C(sglang) is gathered and the server answered a generation
  type: dict
args:
  description: The M(gpufleet.fleet.sglang_server_args_info) result (or C(failed) and C(msg)).
  returned: when C(sglang) is gathered and the server answered a generation
  type: dict
patch_present:
  description:
    - >-
      The M(gpufleet.fleet.sglang_nccl_patch) answer in check mode with O(nccl_env): C(changed) whether it would
      change a file, C(files) per file, C(sglang_version), C(hand_edits); C(failed) and C(msg) where it would
      fail.
  returned: when C(nccl_files) is gathered and O(nccl_env) is not empty
  type: dict
workers:
  description: The M(gpufleet.fleet.sglang_worker_env_info) result (or C(failed) and C(msg)).
  returned: when C(nccl_workers) is gathered, O(nccl_env) is not empty and the server runs
  type: dict
"""

import gc
import json
import sys
import threading

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.urls import fetch_url
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_dcgm import read_dcgm_health
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_environ import (
    DEFAULT_TITLE_PATTERN,
    WorkerEnvError,
    read_workers,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_host_reads import (
    PYTHON_NOT_SET,
    failed,
    locate,
    read_args,
    read_gpu,
    runner,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_managed_server import (
    ServerFindError,
    find_managed_server,
    process_start,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_nccl_plan import check_block
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_module
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang_hand_edits import HAND_EDIT_MODES
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_trust import root_code_check

PARTS = ["server", "gpu", "sglang", "nccl_files", "nccl_workers"]


def uri_result(url, status, msg, body=None, parse_json=False):
    """One request's result, shaped as ansible.builtin.uri returns it with ``status_code: [200]``: ``url``,
    ``status`` (-1 when no answer came), ``msg`` ("OK (N bytes)", else "Status code was S and not [200]: ..."),
    ``failed`` when not 200, ``json`` (the answer parsed, when ``parse_json`` and it is JSON)."""
    out = {"url": url, "status": status}
    if status == 200:
        out["msg"] = "OK (%s bytes)" % (len(body) if body is not None else "unknown")
        if parse_json and body:
            try:
                out["json"] = json.loads(body.decode("utf-8", "replace") if isinstance(body, bytes) else body)
            except ValueError:
                pass
    else:
        out.update(failed=True, msg="Status code was %s and not [200]: %s" % (status, msg))
    return out


def request(module, url, timeout_s, headers=None, parse_json=False):
    """GET ``url`` with Ansible's fetch_url (proxy, certificates and agent as ansible.builtin.uri uses them)."""
    resp, info = fetch_url(module, url, method="GET", headers=headers or {}, timeout=timeout_s)
    body = None
    if resp is not None:
        try:
            body = resp.read()
        except Exception as exc:  # a connection that drops mid-answer: an answer was not read
            return uri_result(url, -1, "Request failed: %s" % exc)
    return uri_result(url, int(info.get("status", -1)), info.get("msg", ""), body, parse_json)


def gather(module, p):
    """The module's result for its options ``p`` (every part caught: a failed part does not stop the others).
    The GPU read runs in a thread beside the others (its nvidia-smi calls wait on the driver, not on this
    process); SGLang is located once, for the launch args and the NCCL blocks."""
    parts = [name for name in PARTS if name in (p["gather"] or [])]
    result = {"changed": False, "gathered": []}
    if p["root_interpreter_self"]:
        entry = root_code_check("ansible_python_interpreter", sys.executable)
        result["root_code"] = [entry] if entry else []
        if entry:
            return result
    gpu = Background(read_gpu, module, p["backend"], p["gpu_timeout_s"], True, p["xid_window_min"],
                     p["kmsg_path"]) if "gpu" in parts else None
    # DCGM's health watches, beside the GPU read and bounded like it (dcgmi waits on the host engine and the GPUs).
    dcgm = Background(read_dcgm_health, p["dcgmi"], p["dcgmi_timeout_s"], module.get_bin_path) \
        if "gpu" in parts and p["dcgmi"] else None
    pid = p["pid"]
    running = pid is not None
    if "server" in parts:
        try:
            result["host"] = find_managed_server(
                p["pid_file"], p["systemd_unit"], run_command=lambda argv: module.run_command(
                    argv, environ_update={"LC_ALL": "C"}),
                systemctl=module.get_bin_path("systemctl", required=True) if p["systemd_unit"] else None)
        except ServerFindError as exc:
            result["host"] = failed(exc.msg, **exc.kwargs)
        pid, running = result["host"].get("managed_pid"), bool(result["host"].get("managed_running"))
        if running:
            start = process_start(pid)
            result["started"] = failed(start["error"]) if "error" in start else start
    nccl = "nccl_files" in parts and bool(p["nccl_env"])
    package = locate(module, p["python"]) if nccl or "sglang" in parts else None
    if "sglang" in parts:
        base = (p["url"] or "").rstrip("/")
        result["health"] = request(module, base + "/health_generate", p["request_timeout_s"])
        if result["health"]["status"] == 200:
            headers = {"Authorization": "Bearer " + p["api_key"]} if p["api_key"] else {}
            result["server_info"] = request(module, base + "/get_server_info", p["request_timeout_s"], headers,
                                            parse_json=True)
            result["args"] = read_args(module, p["python"], p["launch_args"], p["host"], p["port"],
                                       package=package)
    if nccl:
        result["patch_present"] = check_block(
            python=p["python"], env=p["nccl_env"], unchecked=p["nccl_env_unchecked"], state="present",
            hand_edits=p["nccl_hand_edits"], run=runner(module, LANG="C"), here=True,
            package=package) if p["python"] else failed(
            "one of the following is required: path, python (%s)" % PYTHON_NOT_SET)
    if "nccl_workers" in parts and bool(p["nccl_env"]) and running and pid is not None:
        try:
            result["workers"] = read_workers(pid=pid, title_pattern=DEFAULT_TITLE_PATTERN, expected=p["nccl_env"])
        except WorkerEnvError as exc:
            result["workers"] = failed(exc.msg, **exc.kwargs)
    if gpu is not None:
        result["gpu"] = gpu.result()
    if dcgm is not None:
        result["dcgm"] = dcgm.result()
    result["gathered"] = [name for name in PARTS if name in parts]
    return result


class Background(threading.Thread):
    """``function(*args)`` in a daemon thread; :meth:`result` waits for its return value (or re-raises)."""

    def __init__(self, function, *args):
        super(Background, self).__init__()
        self.daemon = True
        self.function, self.args, self.value, self.error = function, args, None, None
        self.start()

    def run(self):
        try:
            self.value = self.function(*self.args)
        except BaseException as exc:  # handed to the caller's thread by result()
            self.error = exc

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.value


def main():
    module = AnsibleModule(
        argument_spec=dict(
            gather=dict(type="list", elements="str", choices=PARTS, default=list(PARTS)),
            root_interpreter_self=dict(type="bool", default=False),
            pid_file=dict(type="path"),
            systemd_unit=dict(type="str"),
            pid=dict(type="int"),
            backend=dict(type="str", choices=["auto", "nvml", "nvidia-smi"], default="auto"),
            gpu_timeout_s=dict(type="float", default=30),
            dcgmi=dict(type="str", default="dcgmi"),
            dcgmi_timeout_s=dict(type="float", default=10),
            xid_window_min=dict(type="int", default=60),
            kmsg_path=dict(type="path"),
            url=dict(type="str"),
            request_timeout_s=dict(type="int", default=30),
            api_key=dict(type="str", no_log=True),
            python=dict(type="path"),
            launch_args=dict(type="dict", default={}),
            host=dict(type="str"),
            port=dict(type="int"),
            nccl_env=dict(type="dict", default={}),
            nccl_env_unchecked=dict(type="list", elements="str", default=[]),
            nccl_hand_edits=dict(type="str", choices=list(HAND_EDIT_MODES), default="refuse"),
        ),
        mutually_exclusive=[["pid_file", "systemd_unit"]],
        supports_check_mode=True,
    )
    redact_module(module)  # no API key in any result, message or warning (issue 31)
    p = module.params
    if "sglang" in p["gather"] and not p["url"]:
        module.fail_json(msg="url is required to gather sglang (the server's base URL)")
    for key in ("gpu_timeout_s", "dcgmi_timeout_s", "xid_window_min", "request_timeout_s"):
        if p[key] < 0:
            module.fail_json(msg="%s must be 0 or more (got %s)" % (key, p[key]))
    module.exit_json(**gather(module, p))


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
