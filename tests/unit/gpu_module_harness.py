"""Drive a gpufleet module's ``main()`` in-process, and a replaying ``nvidia-smi`` executable.

ansible-core 2.19 changed how module arguments reach ``AnsibleModule``: ``basic._ANSIBLE_ARGS`` now needs a
serialisation profile beside it, and ``ansible.module_utils.testing.patch_module_args`` does both. Older
cores only need ``_ANSIBLE_ARGS``. :func:`module_args` picks whichever this core has.
"""
import contextlib
import importlib.util
import json
import os
import stat
import sys

from ansible.module_utils import basic
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu as G

try:
    from ansible.module_utils.testing import patch_module_args
except ImportError:  # ansible-core < 2.19
    patch_module_args = None

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNIT_DIR = os.path.dirname(os.path.abspath(__file__))


class ModuleExit(Exception):
    """Raised instead of exit_json/fail_json; ``.result`` holds the keyword arguments, ``.failed``."""

    def __init__(self, result, failed):
        super().__init__(result.get("msg", ""))
        self.result = result
        self.failed = failed


@contextlib.contextmanager
def module_args(args):
    if patch_module_args is not None:
        with patch_module_args(args):
            yield
    else:
        old = basic._ANSIBLE_ARGS
        basic._ANSIBLE_ARGS = json.dumps({"ANSIBLE_MODULE_ARGS": args}).encode()
        try:
            yield
        finally:
            basic._ANSIBLE_ARGS = old


def load_module(name):
    """Import library/<name>.py by path (modules are not a package)."""
    spec = importlib.util.spec_from_file_location("gpufleet_test_" + name, os.path.join(ROOT, "plugins", "modules", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def use_recorded_processes(monkeypatch):
    """Keep this machine's /proc out of a GPU test: no fd holders, pids described from loaded-proc.txt."""
    recorded = recorded_process_info()
    monkeypatch.setattr(G, "find_device_holders", lambda **kw: {})
    monkeypatch.setattr(G, "describe_pids", lambda pids: {p: recorded.get(p) for p in pids})


def run_main(monkeypatch, module, args):
    """Run ``module.main()`` with ``args``; return ModuleExit (result + failed flag)."""

    def exit_json(self, **kwargs):
        # Round-trip through JSON as Ansible does: anything not serialisable (lone surrogates, sets) fails here.
        raise ModuleExit(json.loads(json.dumps(kwargs)), False)

    def fail_json(self, msg, **kwargs):
        kwargs["msg"] = msg
        kwargs.pop("exception", None)
        raise ModuleExit(json.loads(json.dumps(kwargs, default=str)), True)

    monkeypatch.setattr(basic.AnsibleModule, "exit_json", exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", fail_json)
    # Keep this machine's kernel log out of module results unless a test names a log (kmsg_path).
    if "GPUFLEET_KMSG_PATH" not in os.environ:
        monkeypatch.setenv("GPUFLEET_KMSG_PATH", os.devnull)
    with module_args(args):
        try:
            module.main()
        except ModuleExit as done:
            return done
    raise AssertionError("module returned without exit_json/fail_json")


def write_fake_smi(directory, state="loaded", apps_extra=(), fail=None, invalid_fields=(), overrides=None,
                   hang_s=0, call_log=None):
    """Write an executable ``nvidia-smi`` into ``directory`` that replays the recordings (RecordedSmi).

    ``apps_extra`` are raw compute-apps lines given as bytes (to emit invalid UTF-8 as a real driver
    would for a process name); ``overrides`` {field: raw} are printed for every GPU; ``hang_s`` sleeps
    before answering (a wedged GPU); ``call_log`` (a path) gets one line per run, its arguments joined by
    spaces, so a test can count the runs. Returns the directory (prepend it to PATH).
    """
    path = os.path.join(str(directory), "nvidia-smi")
    config = {"state": state, "apps_extra": [a.hex() for a in apps_extra], "fail": fail,
              "invalid_fields": list(invalid_fields), "overrides": overrides or {}, "hang_s": hang_s,
              "call_log": str(call_log) if call_log else None}
    script = """#!%(python)s
import sys
sys.path.insert(0, %(unit)r)
from fake_pynvml import RecordedSmi
cfg = %(cfg)r
if cfg["call_log"]:
    with open(cfg["call_log"], "a") as log:
        log.write(" ".join(sys.argv[1:]) + "\\n")
if cfg["hang_s"]:
    import time
    time.sleep(cfg["hang_s"])
smi = RecordedSmi(state=cfg["state"], fail=cfg["fail"], invalid_fields=cfg["invalid_fields"])
smi.overrides = cfg["overrides"]
rc, out, err = smi(sys.argv)
data = out.encode()
if sys.argv[1:2] and sys.argv[1].startswith("--query-compute-apps"):
    data += b"".join(bytes.fromhex(h) + b"\\n" for h in cfg["apps_extra"])
sys.stdout.buffer.write(data)
sys.stderr.write(err)
sys.exit(rc)
""" % {"python": sys.executable, "unit": UNIT_DIR, "cfg": config}
    with open(path, "w") as fh:
        fh.write(script)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(directory)


def recorded_process_info():
    """``{pid: process_info dict}`` from recordings loaded-proc.txt (the real worker command lines)."""
    from fake_pynvml import recording
    out = {}
    for line in recording("loaded-proc.txt").splitlines():
        head, _, cmd = line.partition(" cmdline=")
        parts = head.split()
        pid = int(parts[1])
        name = parts[2].split("=", 1)[1]
        out[pid] = {"pid": pid, "ppid": 1, "pgid": pid, "name": name, "cmdline": cmd.strip().split(" "),
                    "user": "root", "create_time": 0.0}
    return out


def sglang_on_path(monkeypatch, path):
    """Start the modules of this test as if their interpreter ran with ``PYTHONPATH=path``: the environment a
    command they start gets, and the search path of this process (modules find SGLang in their own process when
    they run on the SGLang interpreter, ``gpufleet_sglang.locate_package(here=True)``)."""
    monkeypatch.setenv("PYTHONPATH", str(path))
    monkeypatch.syspath_prepend(str(path))
