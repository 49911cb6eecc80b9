"""The restart preflight's decisions (controller side): from what sglang_preflight_info read on a host (and the
separate reads identity demands), the problems that refuse the host, the notes shown beside them, what the run
keeps for later steps (whether a server ran, the GPU memory others hold, what the old server holds), and the
refusal line.

Plain functions (no Ansible needed), called by the gpufleet_preflight filter (plugins/filter/gpufleet_preflight.py)
from roles/sglang_preflight. The messages are the ones the role wrote in Jinja before (tests assert their words).

``judge(read, settings)`` -> ``{"problems": [str], "notes": [str], "server_ran": bool|None,
"gpu_baseline_mib": {gpu: MiB}, "server_gpus": {"gpus", "world_size", "env"}, "stop_preview": dict,
"model_paths": [str], "refusal": str|None, "fail_msg": [str]}``

``read``: ``args``, ``patch`` (the call that gathered ``sglang``), ``launcher``, ``model_paths``, ``gpu``,
``stop_preview``, ``host`` (the call that gathered ``host``), ``patch_access`` (sglang_host_info as the patch's
user, when that differs; else absent). ``settings``: see :data:`SETTINGS`.
"""
from __future__ import annotations

import json
import re

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_memory import (
    baseline_text,
    unreadable_refusal,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import SGLANG_SECRET_FLAGS, inventory_flag
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang_nccl_owned import nccl_conflicts
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_unit_values import unit_value_problems
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.lock import gpufleet_lock_holder_gone
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.patch import gpufleet_hand_edit_lines

# The role's variables the decision reads (sglang_preflight_<name>), with the value used when one is missing.
SETTINGS = {
    "launch_args": {}, "launch_method": "systemd", "port": 30000, "pid_file": "", "unit_name": "",
    "launcher": [], "allow_hub_ids": False, "min_disk_free_mib": 1024, "min_shm_free_mib": 512,
    "gpu_holders": "refuse", "gpu_max_used_mib": 1024, "gpu_require_no_processes": True, "patch_become": False,
    "nccl_env": {}, "nccl_env_overrides": [], "server_env": {}, "lock_dir": "", "run_id": "", "host": "",
    "world_size": 1,
}

_TRUE = ("true", "yes", "on", "1", "y", "t")


def as_bool(value):
    """Ansible's ``| bool``: True, 1 and the strings yes/on/true/1 (any case) are true."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value == 1
    return str(value).strip().lower() in _TRUE


def text(value):
    """Jinja's ``~`` of one value."""
    return "" if value is None else str(value)


_PORT_RE = re.compile(r"^[0-9]+$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
# sglang_launch_systemd_restart values the unit may take (YAML's no is False, its str "False").
_RESTART_POLICIES = ("no", "on-failure", "False", "false")
_UNSET = object()


def _json(value):
    """Jinja's ``value | string | to_json``: the value's text as a JSON string."""
    return json.dumps(text(value) if value is not None else "None")


def _is_sequence(value):
    return isinstance(value, (list, tuple))


def _number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def variable_problems(v):
    """The inventory problems that refuse a host before anything is read (preflight's first step).

    ``v``: the role's values by the name a user sets (``sglang_launch_args``, ``sglang_python``, ``sglang_launcher``,
    ``sglang_port``, ``sglang_host``, ``sglang_launch_method``, ``sglang_state_dir``, ``sglang_service_user``,
    ``sglang_nccl_env``, ``sglang_api_key``, ``gpufleet_preflight_gpu_holders``, ``gpu_memory_wait_max_used_mib``,
    ``sglang_preflight_min_disk_free_mib``, ``sglang_preflight_min_shm_free_mib``, ``sglang_launch_systemd_restart``,
    ``sglang_launch_stop_timeout_s`` (absent or None: not set), and ``unit_values``: the values rendered into the
    unit or used as paths, checked by :func:`unit_value_problems`). Returns the messages (list of str), in a fixed
    order; none of them shows the API key.
    """
    out = []
    launch_args = v.get("sglang_launch_args")
    if not (isinstance(launch_args, dict) and launch_args):
        out.append("sglang_launch_args is %s: give the SGLang flags as a mapping, at least model-path (e.g. "
                   "{model-path: /models/Llama-3.1-8B-Instruct, tp-size: 8})"
                   % ("empty or null" if not launch_args else "not a mapping"))
    python = v.get("sglang_python")
    if not (isinstance(python, str) and python):
        out.append("sglang_python is not set: give the interpreter of the SGLang virtualenv, e.g. "
                   "/opt/sglang/.venv/bin/python")
    launcher = v.get("sglang_launcher")
    if not (_is_sequence(launcher) and launcher and all(isinstance(a, str) for a in launcher)):
        out.append("sglang_launcher must be a non-empty list of strings, the argv prefix that starts SGLang, e.g. "
                   "[/opt/sglang/.venv/bin/python, -m, sglang.launch_server]")
    port = v.get("sglang_port")
    if not (not isinstance(port, bool) and _PORT_RE.match(text(port)) and 1 <= int(text(port)) <= 65535):
        out.append("sglang_port must be a port number between 1 and 65535, got " + _json(port))
    host = v.get("sglang_host")
    if not (isinstance(host, str) and host):
        out.append("sglang_host must be the bind address, e.g. 127.0.0.1, got " + _json(host))
    method = v.get("sglang_launch_method")
    if method not in ("systemd", "process"):
        out.append("sglang_launch_method must be systemd or process, got " + _json(method))
    state_dir = v.get("sglang_state_dir")
    if not (isinstance(state_dir, str) and state_dir.startswith("/")):
        out.append("sglang_state_dir must be an absolute path, got " + _json(state_dir))
    user = v.get("sglang_service_user")
    if not isinstance(user, str):
        out.append("sglang_service_user must be a user name, got " + _json(user))
    if method == "systemd" and not user:
        out.append("sglang_service_user is not set: the systemd method runs the server as this unprivileged user")
    stop_timeout = v.get("sglang_launch_stop_timeout_s", _UNSET)
    if stop_timeout is not _UNSET and stop_timeout is not None:
        out.append("sglang_launch_stop_timeout_s is no longer used: TimeoutStopSec= of the unit is "
                   "sglang_stop_grace_s, the one stop grace of the stop role and the unit; set sglang_stop_grace_s "
                   "(got %s) and remove sglang_launch_stop_timeout_s" % _json(stop_timeout))
    restart = v.get("sglang_launch_systemd_restart", "on-failure")
    if text(restart if restart is not None else "on-failure") not in _RESTART_POLICIES:
        out.append('sglang_launch_systemd_restart must be "no" or on-failure, got %s: other policies restart a server '
                   "that gpufleet or SGLang itself shut down" % _json(restart))
    nccl_env = v.get("sglang_nccl_env")
    if not isinstance(nccl_env, dict):
        out.append("sglang_nccl_env must be a mapping of variable name to value, e.g. {NCCL_PROTO: LL}")
    bad_names = [text(k) for k in (nccl_env or {}) if not _ENV_NAME_RE.match(text(k))] \
        if isinstance(nccl_env, dict) else []
    if bad_names:
        out.append("sglang_nccl_env has invalid variable names %s: names must match ^[A-Za-z_][A-Za-z0-9_]*$ "
                   "(letters, digits, underscore; not starting with a digit)" % ", ".join(bad_names))
    # An abbreviation SGLang's parser takes for the key flag (api-k, admin-api) puts the key on the argv just the same.
    key_flags = [text(k) for k in launch_args if inventory_flag(text(k), SGLANG_SECRET_FLAGS)] \
        if isinstance(launch_args, dict) else []
    if key_flags:
        out.append("%s in sglang_launch_args would show the key in task output, the unit file and the argv: remove "
                   "it and set sglang_api_key instead, encrypted with ansible-vault (e.g. ansible-vault "
                   "encrypt_string --name sglang_api_key); admin-api-key is not supported by gpufleet"
                   % ", ".join(key_flags))
    if not isinstance(v.get("sglang_api_key"), str):
        out.append("sglang_api_key must be text, one bearer token; the value is not shown here")
    holders = v.get("gpufleet_preflight_gpu_holders")
    if holders not in ("refuse", "warn"):
        out.append("gpufleet_preflight_gpu_holders must be refuse or warn, got " + _json(holders))
    max_used = v.get("gpu_memory_wait_max_used_mib")
    if isinstance(max_used, bool) or not _PORT_RE.match(text(max_used)):
        out.append("gpu_memory_wait_max_used_mib must be a number of MiB (0 or more), got " + _json(max_used))
    disk = _number(v.get("sglang_preflight_min_disk_free_mib"))
    shm = _number(v.get("sglang_preflight_min_shm_free_mib"))
    if disk is None or shm is None or disk < 0 or shm < 0:
        out.append("sglang_preflight_min_disk_free_mib and sglang_preflight_min_shm_free_mib must not be negative")
    out.extend(unit_value_problems(v.get("unit_values") or {}, names=list(v.get("unit_values") or {})))
    return out


def sglang_problems(args, patch, s):
    """Launch flags the installed SGLang refuses, a patch that would fail, NCCL variables SGLang sets itself."""
    out = []
    if "valid" not in args:
        out.append("SGLang not usable: " + text(args.get("msg")))
    version = args.get("sglang_version") or "?"
    out += ["sglang_launch_args (sglang %s): %s" % (version, e.get("message")) for e in args.get("errors") or []]
    if "msg" in patch:
        msg = text(patch["msg"])
        out.append("sglang_nccl_env refused: " + msg[len("invalid env: "):] if msg.startswith("invalid env: ")
                   else "NCCL patch would fail: " + msg)
    conflicts = nccl_conflicts(args.get("sglang_version"), s["launch_args"], s["nccl_env"],
                               overrides=s["nccl_env_overrides"], resolved=args.get("resolved"),
                               server_env=s["server_env"])
    out += [c["message"] for c in conflicts]
    return out


def sglang_notes(args, patch):
    """Hand-typed lines the patch leaves, deprecated flags, values preflight could not check."""
    notes = []
    hand = patch.get("hand_edits") or []
    if [h for h in hand if h.get("action") != "refused"]:
        notes += gpufleet_hand_edit_lines(hand)
    if args.get("flag_warnings"):
        notes += [w["message"] for w in args["flag_warnings"]]
    if args.get("given_unchecked"):
        notes.append("unchecked: " + "; ".join(u["message"] for u in args["given_unchecked"]))
    return notes


def path_problems(launcher, model_paths):
    """A launcher that cannot run; local model paths that are missing or no directory."""
    out = []
    if launcher and not (launcher.get("exists") and launcher.get("executable")):
        out.append("sglang_launcher starts with %s, which %s; fix sglang_launcher (or sglang_python)" % (
            launcher["path"], "is not executable" if launcher.get("exists") else "does not exist on this host"))
    local = [m for m in model_paths if m.get("local")]
    missing = [m for m in local if not m.get("exists")]
    for entry in missing + [m for m in local if m.get("exists") and not m.get("isdir")]:
        out.append("--%s %s: %s; copy the model there or fix sglang_launch_args" % (
            entry["key"].replace("_", "-"), entry["value"],
            "is not a directory" if entry.get("exists") else "does not exist on this host"))
    return out


def hub_id_notes(model_paths, allow_hub_ids):
    if allow_hub_ids:
        return []
    return ["WARNING: --%s %s is not a local path (it does not start with / or .); SGLang will fetch it from the "
            "Hugging Face hub at start, after the old server is stopped. Give a local directory, or set "
            "sglang_preflight_allow_hub_ids=true to accept this." % (m["key"].replace("_", "-"), m["value"])
            for m in model_paths if not m.get("local")]


def gpu_problems(gpu, stop_preview):
    out = []
    if "gpus" not in gpu:
        out.append("GPUs not usable: " + text(gpu.get("msg") or "nvidia_gpu_info failed")
                   + " -- the running server is left as it is; a new one could not start until the GPUs answer"
                   + " (fix the driver, reboot after a driver upgrade, or take the host out of the run)")
    if "msg" in stop_preview:
        out.append("the stop would fail: " + text(stop_preview["msg"]))
    return out


def server_ran(stop_preview):
    """Whether an SGLang server (or a leftover of one) ran when the run began; None when the preview failed."""
    if "msg" in stop_preview or "signalled" not in stop_preview:
        return None
    return len(stop_preview["signalled"]) > 0 or stop_preview.get("main_pid") is not None


def _most_left(after):
    """The most MiB the stop leaves on a GPU a listed holder uses (0 when none)."""
    left = [g["remaining_mib"] for g in after.get("gpus") or []
            if g.get("foreign_listed") and isinstance(g.get("remaining_mib"), (int, float))
            and not isinstance(g.get("remaining_mib"), bool)]
    return (max(left) if left else 0) or 0


def holder_findings(after, s):
    """(problems, notes) for GPU holders the stop would leave."""
    holders = after.get("holders") or []
    max_used = int(s["gpu_max_used_mib"])
    require = as_bool(s["gpu_require_no_processes"])
    most_left = _most_left(after)
    passes = not (require and holders) and int(most_left) <= max_used
    if passes:
        tail = ("; the wait after the stop passes beside it (gpu_memory_wait_require_no_processes is false, at "
                "most %s MiB left on a GPU, gpu_memory_wait_max_used_mib %s)" % (most_left, s["gpu_max_used_mib"]))
    else:
        settings = (["gpu_memory_wait_require_no_processes=false"] if require else []) + (
            ["gpu_memory_wait_max_used_mib=%s (the MiB it leaves on its GPU; now %s)" % (
                most_left, s["gpu_max_used_mib"])] if int(most_left) > max_used else [])
        tail = ("; the wait for free GPU memory after the stop would fail: stop it (or ask its owner) and rerun"
                + ("; if the new server fits beside it, set %s with gpufleet_preflight_gpu_holders=warn"
                   % " and ".join(settings) if settings else ""))
    findings = ["GPU memory held by a process the stop will not end: " + text(h.get("text")) + tail
                for h in holders]
    problems, notes = [], []
    if s["gpu_holders"] == "refuse" or not passes:
        if passes:
            suffix = " (or set gpufleet_preflight_gpu_holders=warn to go ahead)"
        elif s["gpu_holders"] == "warn":
            suffix = " (warn alone does not help: the run would stop the server and then wait in vain)"
        else:
            suffix = ""
        problems = [f + suffix for f in findings]
    if s["gpu_holders"] == "warn" and passes:
        notes = ["WARNING: " + f for f in findings]
    return problems, notes


def patch_write_problems(host, patch, patch_access, s):
    """Files the NCCL patch would change but could not write, as the user it runs as."""
    out = []
    entries = list((patch_access or {}).get("write_access") or []) + [
        e for e in host.get("write_access") or [] if e.get("purpose") == "replace"]
    changing = [f.get("path") for f in patch.get("files") or [] if f.get("changed")]
    for item in entries:
        if item.get("ok") or item.get("path") not in changing:
            continue
        reason = text(item.get("reason"))
        if "read-only filesystem" in reason or "mount point of its own" in reason:
            hint = ("; no user or become changes that: remount it read-write, or put the NCCL block into the file it"
                    " comes from (the image or the bind source) and rerun")
        elif as_bool(s["patch_become"]) or item.get("user") == "root":
            hint = "; the patch runs as root (sglang_nccl_patch_become=true): make that directory writable"
        else:
            hint = ("; the patch runs as the connecting user (ansible_user): make the SGLang virtualenv writable for "
                    + text(item.get("user")) + ", or set sglang_nccl_patch_become=true")
        out.append("NCCL patch could not write " + text(item.get("path")) + ": " + reason + hint)
    if patch_access is not None and "msg" in patch_access:
        out.append("could not check write access to " + ", ".join(patch.get("paths") or []) + ": "
                   + text(patch_access["msg"]))
    return out


def host_problems(host, s):
    """Disk, /dev/shm, the port, model files, the state directory, ownership."""
    out = []
    if "disk" not in host:
        out.append("host measurement failed: " + text(host.get("msg")))
    min_disk = s["min_disk_free_mib"]
    for item in host.get("disk") or []:
        if item["free_mib"] < float(min_disk):
            out.append("%s MiB free on the filesystem of %s (measured at %s); need %s MiB "
                       "(sglang_preflight_min_disk_free_mib): free space there"
                       % (item["free_mib"], item["path"], item["measured_path"], min_disk))
    shm = host.get("shm")
    min_shm = s["min_shm_free_mib"]
    if shm is not None and (not shm["exists"] or shm["free_after_stop_mib"] < float(min_shm)):
        if not shm["exists"]:
            out.append(text(shm["path"]) + " does not exist")
        else:
            out.append("%s MiB free in %s (size %s MiB), %s MiB once the stop has ended the old server and removed "
                       "its segments; need %s MiB (sglang_preflight_min_shm_free_mib). Segments the stop leaves "
                       "there: %s; remove the ones nothing uses, or enlarge the tmpfs"
                       % (shm["free_mib"], shm["path"], shm["size_mib"], shm["free_after_stop_mib"], min_shm,
                          "; ".join(k["text"] for k in shm.get("kept_segments") or []) or "none"))
    managed = host.get("managed_pid")
    where = ("pid file " + text(s["pid_file"])) if s["launch_method"] == "process" else ("unit " + text(s["unit_name"]))
    for item in (host.get("port") or {}).get("listeners") or []:
        if not item.get("conflicts") or item.get("managed"):
            continue
        holder = ("a process whose pid is hidden (run with sglang_preflight_become=true to see it)"
                  if item.get("pid") is None else
                  "pid %s (%s)" % (item["pid"], " ".join(item.get("cmdline") or [])))
        out.append("port %s is held by %s on %s, which is not the SGLang server being replaced (%s: %s); stop it or "
                   "choose another sglang_port" % (s["port"], holder, item.get("address"), where,
                                                   "no server" if managed is None else "pid %s" % managed))
    for item in host.get("model_dirs") or []:
        if not item.get("found"):
            out.append("--%s %s: holds no %s (an empty directory is often a mount point whose filesystem is not "
                       "mounted); mount or copy the model there, or fix sglang_launch_args"
                       % (item["flag"], item["path"], " or ".join(item.get("markers") or [])))
    for item in host.get("write_access") or []:
        if item.get("purpose") == "write" and not item.get("ok"):
            out.append("sglang_state_dir %s: %s; create it writable for that user or choose another sglang_state_dir"
                       % (item["path"], item.get("reason")))
    out += [entry["text"] for entry in host.get("ownership") or []]
    return out


def lock_refusal(lock, others, s):
    """The refusal when another run holds the host's restart lock (None when none holds it)."""
    if not isinstance(lock, dict) or lock.get("expired", True) or (lock.get("run_id") or "") == (s["run_id"] or ""):
        return None
    if gpufleet_lock_holder_gone(lock):
        return None

    def field(key):
        value = lock.get(key)
        return "?" if value is None else text(value)
    line = ("locked by another restart: run %s from %s (pid %s, user %s), lease expires in %d s (%s). Wait for that "
            "run to finish or for its lease to end; if it is certainly gone, run playbooks/unlock.yml -e target=%s"
            % (text(lock.get("run_id")), field("controller"), field("pid"), field("user"),
               int(round(float(lock.get("remaining_s") or 0))), s["lock_dir"], s["host"]))
    if others:
        line += (" (%d other finding(s) not listed: while that run restarts the host, GPU memory, the port and "
                 "/dev/shm show its work)" % others)
    return line


def refusal_line(problems):
    """One line in the user's words for the run's summary."""
    if not problems:
        return None
    return ("preflight refused the host, nothing was stopped or changed: "
            + ("%d problems: " % len(problems) if len(problems) > 1 else "")
            + " | ".join(re.sub(r"\s+", " ", p) for p in problems))


def merge_reads(reads):
    """One read from the role's calls: ``login`` (sglang_preflight_info as the login user), ``become`` (its
    ``host`` part with become, when read apart), ``stop_preview`` (sglang_stop in check mode as the stop's user,
    when that differs) and ``patch_access`` (sglang_host_info as the patch's user, when that differs); a call
    that did not run is None or absent."""
    read = dict(reads.get("login") or {})
    for key, value in (reads.get("become") or {}).items():
        if key not in ("args", "patch"):
            read[key] = value
    if reads.get("become") and "msg" in reads["become"] and "host" not in reads["become"]:
        read["host"] = {"failed": True, "msg": reads["become"]["msg"]}
    if reads.get("stop_preview") is not None:
        read["stop_preview"] = reads["stop_preview"]
    read["patch_access"] = reads.get("patch_access")
    return read


def root_refusal(login):
    """Code root would run that another user can change, or a root-code check that failed: the refusal before any
    read with become (only these problems are noted)."""
    out = [entry["text"] for entry in login.get("root_code") or []]
    if "root_code" not in login and "msg" in login:
        out.append("could not check what root runs: " + text(login["msg"]))
    return out


def fail_msg(problems, s):
    """The failed task's message: the count, then each problem."""
    return ["sglang_preflight on %s found %d problem(s); nothing was stopped or changed:"
            % (s["host"], len(problems))] + list(problems)


def judge(reads, settings):
    """The decision of one host (see the module docstring); ``reads`` as :func:`merge_reads` takes them, with
    ``root_check`` true when the login call checked what root runs."""
    s = dict(SETTINGS)
    s.update((k, v) for k, v in (settings or {}).items() if v is not None)
    if reads.get("root_check"):
        refused = root_refusal(reads.get("login") or {})
        if refused:
            return {"problems": refused, "notes": [], "server_ran": None, "gpu_baseline_mib": {},
                    "server_gpus": {"gpus": [], "world_size": s["world_size"], "env": s["server_env"]},
                    "stop_preview": {}, "model_paths": [], "refusal": refusal_line(refused),
                    "fail_msg": fail_msg(refused, s)}
    read = merge_reads(reads)
    args, patch = read.get("args") or {}, read.get("patch") or {}
    host, gpu, stop_preview = read.get("host") or {}, read.get("gpu") or {}, read.get("stop_preview") or {}
    model_paths = read.get("model_paths") or []
    problems = sglang_problems(args, patch, s)
    notes = sglang_notes(args, patch)
    problems += path_problems(read.get("launcher"), model_paths)
    notes += hub_id_notes(model_paths, as_bool(s["allow_hub_ids"]))
    problems += gpu_problems(gpu, stop_preview)
    problems += host_problems(host, s)
    problems += patch_write_problems(host, patch, read.get("patch_access"), s)
    after = host.get("gpu_after_stop") or {}
    held, warned = holder_findings(after, s)
    problems += held
    notes += warned
    unreadable = unreadable_refusal(list(after.get("unreadable") or []))
    if unreadable:
        problems.append(unreadable)
    if after.get("tp_balance"):
        problems.append(after["tp_balance"])
    baseline = after.get("baseline_mib") or {}
    if baseline:
        notes.append("GPU memory held by processes no GPU list names while the server runs (%s): the old server "
                     "runs beside it, so the wait after the stop waits until each GPU is back to that plus %s MiB "
                     "(the server's own memory released). %s"
                     % (baseline_text(baseline), s["gpu_max_used_mib"],
                        "; ".join(u["text"] for u in after.get("unexplained") or [])))
    locked = lock_refusal(host.get("restart_lock"), len(problems), s)
    if locked:
        problems = [locked]
    return {
        "problems": problems,
        "notes": notes,
        "server_ran": server_ran(stop_preview),
        "gpu_baseline_mib": baseline,
        "server_gpus": {"gpus": after.get("gpus") or [], "world_size": s["world_size"], "env": s["server_env"]},
        "stop_preview": stop_preview,
        # The model paths as SGLang's parser resolved them (hub ids too): what the weight prefetch reads.
        "model_paths": [m["value"] for m in model_paths if isinstance(m.get("value"), str)],
        "refusal": refusal_line(problems),
        "fail_msg": fail_msg(problems, s),
    }
