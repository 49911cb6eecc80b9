# -*- coding: utf-8 -*-
# gpufleet: DCGM's background health watches, read with `dcgmi health -c -j`.
"""What NVIDIA DCGM's health watches say about a host, read once with ``dcgmi health -c -j`` and normalized.

:func:`read_dcgm_health` runs dcgmi (argv list, no shell, ``LC_ALL=C``, bounded in time as nvidia-smi is:
:func:`bounded_run`, so a dcgmi blocked on a wedged GPU or host engine is abandoned) and returns
:func:`parse_health_check`'s answer, a plain dict::

    {"status": "ok" | "absent" | "not_found" | "hostengine_down" | "no_watches" | "timeout" | "error"
               | "malformed",
     "dcgmi": the binary run (or the name asked for), "rc": its exit status,
     "overall": "pass" | "warn" | "fail" | "unknown", "overall_text": dcgmi's word ("Healthy", ...),
     "incidents": [{"entity_group": "GPU", "entity_id": "3", "gpu": 3 (None unless a GPU),
                    "system": "memory", "system_text": "Memory system",
                    "health": "warn" | "fail" | "unknown", "health_text": "Failure", "message": DCGM's text}],
     "msg": what went wrong, dcgmi's own words (not "ok")}

The JSON relied on (DCGM 4.6.0, NVIDIA/DCGM commit 72fa3fe; read, not copied):

* ``dcgmi/DcgmiOutput.{h,cpp}``: ``--json`` prints DcgmiOutputJson, a jsoncpp document
  ``{"header": [...], "body": {section: node}}``; a node is ``{"value": str, "children": {name: node},
  "overflow": [str, ...]}`` with each key present only when set.
* ``dcgmi/Health.cpp`` (``Health::CheckWatches``, ``GenerateOutputFromResponse``, ``HandleOneEntity``,
  ``AddErrorMessage``): header ``["Health Monitor Report"]``; body ``"Overall Health"`` with value
  ``Healthy`` | ``Warning`` | ``Failure`` (``Internal error`` for any other result); then one section per entity
  group named by ``DcgmFieldsGetEntityGroupString`` (``GPU``, ``Switch``, ``GPU_I``, ``ConnectX``, ...), whose
  children are entity ids (``"3"``) with the entity's worst health as value and a child ``Errors`` holding one
  child per health system (``PCIe system``, ``NVLINK system``, ``Memory system``, ``SM system``, ``InfoROM
  system``, ``Thermal system``, ``Power system``, ``Driver``, ``ConnectX system``; DCGM's incidents of all systems,
  such as Xid 79, are labelled ``Internal error``): the system's worst health as value, and DCGM's message(s)
  for it (several joined with ", ") cut into lines of at most 54 characters in ``overflow``.
* Failures print on stdout, exit status 256 + the dcgmReturn_t: no host engine (``dcgmi/Command.cpp``):
  "Error: unable to establish a connection to the specified host: localhost" / "Error: Unable to connect to
  host engine. Host engine connection invalid/disconnected." (DCGM_ST_CONNECTION_NOT_VALID, -21: rc 235); no
  watches set: "Error: Health watches not enabled. Please enable watches." (DCGM_ST_GENERIC_ERROR, -3: rc 253).
* NVIDIA's reference page ``dcgmi health``
  (https://docs.nvidia.com/datacenter/dcgm/latest/reference/command-line-reference/dcgmi/dcgmi-health.html):
  ``--check [--group] [--json]`` evaluates the retained samples of the watches ``--set`` enabled
  (``dcgmi health -s a``: PCIe, memory, InfoROM, thermal, power, NVLink, driver, ...); watches stay set in the
  host engine after dcgmi exits; some systems need about 60 s of samples before the first meaningful check.

Nothing here imports Ansible.
"""
from __future__ import annotations

import json
import os
import re

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_errors import CallTimedOut, bounded_run

#: dcgmi's arguments: check the watches of the default group (all GPUs), as JSON.
DCGMI_ARGS = ("health", "-c", "-j")
#: dcgmi's system labels (Health::HelperSystemToString) -> the system's short name in reason codes.
SYSTEMS = {"PCIe system": "pcie", "NVLINK system": "nvlink", "PMU system": "pmu", "MCU system": "mcu",
           "Memory system": "memory", "SM system": "sm", "InfoROM system": "inforom", "Thermal system": "thermal",
           "Power system": "power", "Driver": "driver", "ConnectX system": "connectx",
           "Internal error": "other"}
#: dcgmi's health words (Health::HelperHealthToString).
HEALTH = {"Healthy": "pass", "Warning": "warn", "Failure": "fail"}
HEALTH_RANK = {"pass": 0, "unknown": 1, "warn": 1, "fail": 2}
OVERALL_KEY = "Overall Health"
_HOSTENGINE_RE = re.compile(r"Unable to connect to host engine|unable to establish a connection|"
                            r"Host engine connection invalid", re.I)
_NO_WATCHES_RE = re.compile(r"Health watches not enabled", re.I)


def _first_lines(text, limit=400):
    lines = [line.strip() for line in str(text or "").splitlines() if line.strip()]
    return " ".join(lines)[:limit]


def _node_text(node):
    """An incident's message: the node's overflow lines joined again (dcgmi cut them at 54 characters)."""
    parts = [str(p).strip() for p in (node.get("overflow") or []) if str(p).strip()]
    return " ".join(parts)


def _incidents(body):
    out = []
    for group, section in body.items():
        if group == OVERALL_KEY or not isinstance(section, dict):
            continue
        for entity_id, entity in sorted((section.get("children") or {}).items(),
                                        key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0,
                                                        kv[0])):
            if not isinstance(entity, dict):
                continue
            gpu = int(entity_id) if group == "GPU" and entity_id.isdigit() else None
            systems = ((entity.get("children") or {}).get("Errors") or {}).get("children") or {}
            if not systems:  # an entity without its Errors: say what dcgmi said of it
                systems = {"": entity}
            for label, node in systems.items():
                if not isinstance(node, dict):
                    continue
                health_text = str(node.get("value") or entity.get("value") or "")
                out.append({"entity_group": group, "entity_id": entity_id, "gpu": gpu,
                            "system": SYSTEMS.get(label, "other"), "system_text": label,
                            "health": HEALTH.get(health_text, "unknown"), "health_text": health_text,
                            "message": _node_text(node)})
    return out


def parse_health_check(rc, stdout, stderr="", dcgmi="dcgmi"):
    """Normalize one run of ``dcgmi health -c -j`` (exit status ``rc``, its ``stdout`` and ``stderr``): see the
    module docstring for the shape. Never raises."""
    result = {"dcgmi": dcgmi, "rc": rc, "overall": None, "overall_text": None, "incidents": []}
    said = _first_lines("%s\n%s" % (stdout or "", stderr or ""))
    if rc != 0:
        if _NO_WATCHES_RE.search(said):
            status = "no_watches"
        elif _HOSTENGINE_RE.search(said):
            status = "hostengine_down"
        else:
            status = "error"
        result.update(status=status, msg=said or "dcgmi exited %s without a message" % rc)
        return result
    try:
        doc = json.loads(stdout or "")
    except ValueError as exc:
        result.update(status="malformed", msg="not JSON (%s): %s" % (exc, said[:300] or "no output"))
        return result
    body = doc.get("body") if isinstance(doc, dict) else None
    overall = (body or {}).get(OVERALL_KEY) if isinstance(body, dict) else None
    if not isinstance(overall, dict) or "value" not in overall:
        result.update(status="malformed", msg="JSON without body.\"%s\".value: %s" % (OVERALL_KEY, said[:300]))
        return result
    result.update(status="ok", overall_text=str(overall["value"]),
                  overall=HEALTH.get(str(overall["value"]), "unknown"), incidents=_incidents(body))
    return result


def locate_dcgmi(dcgmi, which):
    """The dcgmi binary to run: ``dcgmi`` itself when it is a path (None when not executable there), else
    ``which(dcgmi)`` (None when it is not on PATH)."""
    if "/" in dcgmi:
        return dcgmi if os.path.isfile(dcgmi) and os.access(dcgmi, os.X_OK) else None
    return which(dcgmi)


def read_dcgm_health(dcgmi, timeout_s, which, run=bounded_run):
    """``dcgmi health -c -j`` normalized (:func:`parse_health_check`). ``dcgmi``: a name looked up with
    ``which(name) -> path|None`` or a path; a name not found is ``absent`` (DCGM not installed: nothing to
    say), a path not found ``not_found``. ``run(argv, timeout_s) -> (rc, stdout, stderr)`` (raises
    CallTimedOut: ``timeout``)."""
    path = locate_dcgmi(dcgmi, which)
    if path is None:
        if "/" in dcgmi:
            return {"status": "not_found", "dcgmi": dcgmi, "incidents": [],
                    "msg": "%s is not an executable file" % dcgmi}
        return {"status": "absent", "dcgmi": dcgmi, "incidents": []}
    try:
        rc, out, err = run([path] + list(DCGMI_ARGS), float(timeout_s))
    except CallTimedOut as exc:
        return {"status": "timeout", "dcgmi": path, "incidents": [],
                "msg": "%s did not finish in %g s (a host engine or GPU that does not answer); stopped waiting for "
                       "it" % (" ".join([path] + list(DCGMI_ARGS)), exc.seconds)}
    return parse_health_check(rc, out, err, path)
