"""Stand-in for NVIDIA DCGM's ``dcgmi health -c -j`` on a lab host (stdlib only).

Installed as ``<host dir>/bin/dcgmi`` (on the PATH of the host's SSH sessions) only while the host's ``dcgmi``
fault knob is set (``lab.py fault HOST dcgmi=fail``; :func:`sync_dcgmi`), so a lab host without the knob has no
dcgmi, as a host without DCGM installed. The knob (HOST_DIR/faults.json, read on every call) is a state or
``{"state": STATE, "gpu": N}`` (default GPU :data:`DEFAULT_GPU`):

=================  ===========================================================================================
pass               health watches set, nothing found: ``Overall Health`` Healthy, no incident (rc 0)
warn               a Warning incident of the PCIe system on GPU N (DCGM_FR_PCI_REPLAY_RATE's text)
fail               a Failure incident of the Memory system on GPU N (DCGM_FR_VOLATILE_DBE_DETECTED's text)
no_watches         no health watch set: dcgmi's "Error: Health watches not enabled. ..." (rc 253)
hostengine_down    nv-hostengine not running: dcgmi's two connection errors (rc 235)
malformed          a truncated document (what a dcgmi killed mid-write would leave)
hang               never answers (sleeps 600 s): a host engine or GPU that does not answer
=================  ===========================================================================================

Shaped after NVIDIA's documentation and source, read, not copied:

* NVIDIA DCGM reference, ``dcgmi health``
  (https://docs.nvidia.com/datacenter/dcgm/latest/reference/command-line-reference/dcgmi/dcgmi-health.html):
  ``dcgmi health --check [--group] [--json]`` checks the watches ``--set`` enabled (``-s a``: all systems) for
  the default group of all GPUs on the local host engine.
* NVIDIA/DCGM 4.6.0 (commit 72fa3fe), ``dcgmi/Health.cpp``: the report's header ``Health Monitor Report``,
  ``Overall Health`` ``Healthy|Warning|Failure``, one section per entity group (``GPU``), per entity id its worst
  health and ``Errors`` with one node per system (``PCIe system``, ``Memory system``, ...) whose message is cut
  into lines of at most 54 characters (``AddErrorMessage``); ``dcgmi/DcgmiOutput.{h,cpp}``: the JSON of
  ``DcgmiOutputJson`` (``header``, ``body``; nodes with ``value``, ``children``, ``overflow``; jsoncpp's styled
  writer: keys sorted, three-space indent); ``dcgmi/Command.cpp`` and ``main_dcgmi.cpp``: errors on stdout, exit
  status 256 + dcgmReturn_t (DCGM_ST_CONNECTION_NOT_VALID -21, DCGM_ST_GENERIC_ERROR -3);
  ``dcgmlib/dcgm_errors.h``: the incident texts (DCGM_FR_*_MSG).
"""
import json
import os
import sys
import textwrap
import time

HOST_DIR_ENV = "GPUFLEET_LAB_HOST_DIR"
DEFAULT_GPU = 3
STATES = ("pass", "warn", "fail", "no_watches", "hostengine_down", "malformed", "hang")
# (system label, health, DCGM_FR_*_MSG text for GPU n) per incident state
INCIDENTS = {
    "warn": ("PCIe system", "Warning", "Detected more than 8 PCIe replays per minute for GPU {gpu} : 12"),
    "fail": ("Memory system", "Failure", "Detected 2 volatile double-bit ECC error(s) in GPU {gpu}."),
}
NO_WATCHES = "Error: Health watches not enabled. Please enable watches. \n"
HOSTENGINE_DOWN = ("Error: unable to establish a connection to the specified host: localhost\n"
                   "Error: Unable to connect to host engine. Host engine connection invalid/disconnected.\n")
MESSAGE_WIDTH = 54  # Health.cpp MAX_SIZE_OF_HEALTH_INFO


def knob(host_dir):
    """(state, gpu) from the host's faults.json ``dcgmi`` knob; (None, gpu) when it is not set."""
    try:
        with open(os.path.join(host_dir, "faults.json")) as fh:
            value = json.load(fh).get("dcgmi")
    except (OSError, ValueError):
        value = None
    if isinstance(value, dict):
        return value.get("state"), int(value.get("gpu", DEFAULT_GPU))
    return value, DEFAULT_GPU


def report(state, gpu):
    """The ``dcgmi health -c -j`` document for ``state`` (pass, warn, fail)."""
    body = {"Overall Health": {"value": "Healthy"}}
    if state in INCIDENTS:
        system, health, text = INCIDENTS[state]
        body["Overall Health"]["value"] = health
        body["GPU"] = {"children": {str(gpu): {"value": health, "children": {"Errors": {"children": {
            system: {"value": health, "overflow": textwrap.wrap(text.format(gpu=gpu), MESSAGE_WIDTH)}}}}}}}
    return {"header": ["Health Monitor Report"], "body": body}


def styled(doc):
    """jsoncpp's toStyledString layout, near enough: keys sorted, three-space indent, ``"key" : value``."""
    return json.dumps(doc, indent=3, sort_keys=True, separators=(",", " : ")) + "\n"


def run(argv, host_dir):
    """(stdout, rc) of ``dcgmi ARGV`` on the host whose directory is ``host_dir``."""
    args = list(argv)
    if not (args[:1] == ["health"] and {"-c", "--check"} & set(args) and {"-j", "--json"} & set(args)):
        return "lab stand-in: only `dcgmi health -c -j` is simulated (got: %s)\n" % " ".join(args), 2
    state, gpu = knob(host_dir)
    if state == "hang":
        time.sleep(600)
    if state == "no_watches":
        return NO_WATCHES, 253
    if state == "hostengine_down":
        return HOSTENGINE_DOWN, 235
    text = styled(report("fail", gpu))
    if state == "malformed":
        return text[:len(text) // 2], 0
    return styled(report(state, gpu)), 0


def main(argv=None, host_dir=None):
    host_dir = host_dir or os.environ.get(HOST_DIR_ENV, "")
    out, rc = run(sys.argv[1:] if argv is None else argv, host_dir)
    sys.stdout.write(out)
    sys.stdout.flush()
    return rc


def check_knob(value):
    """Raise ValueError unless ``value`` is a ``dcgmi`` knob value (None/False: not set)."""
    if value in (None, False):
        return
    state = value.get("state") if isinstance(value, dict) else value
    gpu = value.get("gpu", DEFAULT_GPU) if isinstance(value, dict) else DEFAULT_GPU
    if state not in STATES or not isinstance(gpu, int) or isinstance(gpu, bool) or not 0 <= gpu < 8:
        raise ValueError("dcgmi=%s: the state is one of %s, the gpu 0..7 (e.g. {\"state\": \"fail\", \"gpu\": 3})"
                         % (json.dumps(value), "|".join(STATES)))


def sync_dcgmi(host_dir, faults, python):
    """Install ``<host dir>/bin/dcgmi`` (run by ``python -IS``) while ``faults`` has a ``dcgmi`` knob; remove it
    otherwise (no DCGM on the host)."""
    path = os.path.join(host_dir, "bin", "dcgmi")
    value = faults.get("dcgmi")
    check_knob(value)
    if value in (None, False):
        if os.path.exists(path):
            os.remove(path)
        return None
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write("#!%s -IS\n# gpufleet lab: stand-in dcgmi (tests/lab/standin/dcgmi_standin.py)\nimport sys\n"
                 "sys.path.insert(0, %r)\nimport dcgmi_standin\nsys.exit(dcgmi_standin.main(host_dir=%r))\n"
                 % (python, os.path.dirname(os.path.abspath(__file__)), host_dir))
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    sys.exit(main())
