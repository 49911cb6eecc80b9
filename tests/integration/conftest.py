"""Shared fixture for integration tests: ``lab``, a running lab fleet reached over real SSH (tests/lab/).

Use it by naming the fixture; tests that do are given the ``lab`` marker automatically (select with
``-m lab``, skip with ``-m "not lab"``)::

    @pytest.mark.lab
    def test_something(lab):
        runner = lab.run_playbook("playbooks/restart.yml", extravars={"x": 1}, limit="gpu-lab-01")
        assert runner.status == "successful"
        assert lab.ok_hosts(runner, task_action="sglang_stop") == set(lab.hosts)

Session-scoped: the lab comes up once per pytest session (per xdist worker) in its own directory,
``/tmp/gpufleet-test-lab-<pid>``, with ``GPUFLEET_TEST_LAB_HOSTS`` hosts (default 4) and SGLang release
``GPUFLEET_TEST_LAB_SGLANG`` (default 0.5.23), and is torn down at the end. ``GPUFLEET_TEST_LAB_DIR=<dir>``
reuses a lab already running there (``tests/lab/lab.py up --lab-dir <dir>``) and leaves it running.
Needs root, sshd, iproute2 (``make setup``); otherwise the tests are skipped with the reason.

``lab`` object (class ``Lab``):

- ``lab_dir`` (str), ``inventory`` (inventory directory: hosts.yml + group_vars/), ``inventory_file``
- ``hosts``: host names in order (``gpu-lab-01`` …); ``host_dirs``: {host: host dir};
  ``host_vars(host)``: that host's inventory variables merged over group_vars (dict: ``ansible_host``,
  ``sglang_python``, ``sglang_launcher``, ``sglang_state_dir``, ``sglang_launch_args``, ``lab_host_dir`` …);
  ``group_vars``: dict.
- ``run_playbook(playbook, extravars=None, limit=None, check=False, diff=False, cmdline=None,
  envvars=None, tags=None)`` → ``ansible_runner.Runner`` (``.status``, ``.rc``, ``.events``, ``.stats``),
  run as AWX does (``ansible_runner.run``, ``ANSIBLE_CONFIG`` = the repository's ansible.cfg). ``playbook``
  may be relative to the repository root.
- ``run_module(module, args=None, hosts="gpu_hosts", extravars=None, check=False)`` → Runner (ad-hoc).
- ``ok_hosts(runner, task_action=None)`` / ``failed_hosts(...)``: host names with ``runner_on_ok`` /
  ``runner_on_failed`` (or unreachable) events, optionally only for tasks whose action ends with
  ``task_action``. ``events(runner, event, task_action=None)``: list of event_data dicts.
- ``exec(host, argv, check=False, input=None, env=None, timeout=120)`` → ``subprocess.CompletedProcess``
  with ``stdout``/``stderr`` as str (undecodable bytes kept via surrogateescape): runs ``argv`` inside the
  host (its network, mount, PID, UTS and IPC namespaces; PATH has the simulated nvidia-smi; ``env`` adds
  variables). Raises ``subprocess.CalledProcessError`` when ``check`` and rc != 0.
- ``fault(host, **knobs)``: sets fault knobs (``lab.py fault``; ``None``/``False`` clears one) and returns the
  host's knobs; ``clear_faults(host=None)``: all knobs off (all hosts when ``host`` is None).
  Knobs: see ``tests/lab/lab.py`` FAULT_KNOBS / tests/lab/README.md.
- ``gpus(host)``: the simulator's current view (list of 8 dicts: ``index``, ``uuid``, ``used_mib``,
  ``apps`` [{pid, name, used_mib}] …) read from the host's state, without SSH.
- ``start_standin(host, extra_env=None, args=None)`` → pid (host PID namespace) of a stand-in server started
  detached with the host's inventory launch args (for tests that need a running server without the
  launch role); ``wait_http(host, path="/health_generate", status=200, timeout_s=30)``; ``stop_server(host)``:
  restart.yml --tags stop,wait on the host, then its port checked free (a server another module left there).

Tests that change a host (faults, patched files, running servers) must undo it: the lab is shared by the
whole session.

``systemd_lab``: the same ``Lab`` object for a lab whose hosts boot Debian's systemd as PID 1
(``lab.py up --init systemd``): inventory with ``sglang_launch_method: systemd``, login user ``gpufleet``
(sudo), service user ``sglang``. Session-scoped, in ``/tmp/gpufleet-test-lab-systemd-<pid>`` with
``GPUFLEET_TEST_SYSTEMD_LAB_HOSTS`` hosts (default 2); ``GPUFLEET_TEST_SYSTEMD_LAB_DIR=<dir>`` reuses a running
one. Skipped with the reason when systemd-nspawn or sudo is missing (``make system-packages LAB_INIT=systemd``).
``systemctl(host, *args)`` runs systemctl inside a host (CompletedProcess); ``unit_props(host, *names)`` →
dict of ``systemctl show`` properties.
"""
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAB_PY = os.path.join(ROOT, "tests", "lab", "lab.py")

def _load_labtool():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpufleet_lab_tool", LAB_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


labtool = _load_labtool()


def _yaml_load(path):
    import yaml
    with open(path) as fh:
        text = fh.read()
    return yaml.safe_load(text)


class Lab:
    """A running lab; see the module docstring for the API."""

    def __init__(self, lab_dir):
        self.lab_dir = os.path.realpath(lab_dir)
        names = labtool.Names(self.lab_dir)
        self._state = labtool.load_state(names)
        if not self._state or not self._state.get("complete"):
            raise RuntimeError("no complete lab in %s" % self.lab_dir)
        self.inventory = os.path.join(self.lab_dir, "inventory")
        self.inventory_file = os.path.join(self.inventory, "hosts.yml")
        doc = _yaml_load(self.inventory_file)
        self._host_vars = doc["all"]["children"]["gpu_hosts"]["hosts"]
        self.group_vars = _yaml_load(os.path.join(self.inventory, "group_vars", "gpu_hosts.yml"))
        self.hosts = list(self._host_vars)
        self.host_dirs = {h: v["lab_host_dir"] for h, v in self._host_vars.items()}
        self._runs = 0

    # -- inventory ------------------------------------------------------------------------------
    def host_vars(self, host):
        merged = dict(self.group_vars)
        merged.update(self._host_vars[host])
        return merged

    def launch_args_expr(self, extra, only=None):
        """A Jinja expression for the extra var ``sglang_launch_args``: every host's own launch args (paths under
        its ``lab_host_dir``) plus ``extra`` (an extra var is one value for all hosts; their paths differ); with
        ``only`` (a host name), ``extra`` for that host alone."""
        first = self.host_vars(self.hosts[0])
        home = first["lab_host_dir"]
        parts = []
        for key, value in first["sglang_launch_args"].items():
            if isinstance(value, str) and value.startswith(home + "/"):
                parts.append("%s: lab_host_dir ~ %s" % (json.dumps(key), json.dumps(value[len(home):])))
            else:
                parts.append("%s: %s" % (json.dumps(key), json.dumps(value)))
        if only is not None:
            return "{{ {%s} | combine(%s if inventory_hostname == %s else {}) }}" % (
                ", ".join(parts), json.dumps(extra), json.dumps(only))
        return "{{ {%s} | combine(%s) }}" % (", ".join(parts), json.dumps(extra))

    def _entry(self, host):
        return labtool.host_entry(self._state, host)

    # -- ansible-runner ---------------------------------------------------------------------------
    def _private_dir(self):
        self._runs += 1
        base = os.path.join(self.lab_dir, "runner")
        os.makedirs(base, exist_ok=True)
        return tempfile.mkdtemp(prefix="run%03d-" % self._runs, dir=base)

    def _envvars(self, extra=None):
        env = {"ANSIBLE_CONFIG": os.path.join(ROOT, "ansible.cfg"),
               "PATH": os.path.dirname(sys.executable) + ":" + os.environ.get("PATH", "/usr/bin:/bin"),
               "ANSIBLE_NOCOLOR": "1"}
        env.update(extra or {})
        return env

    def run_playbook(self, playbook, extravars=None, limit=None, check=False, diff=False, cmdline=None,
                     envvars=None, tags=None):
        import ansible_runner
        path = playbook if os.path.isabs(playbook) else os.path.join(ROOT, playbook)
        opts = [cmdline] if cmdline else []
        if check:
            opts.append("--check")
        if diff:
            opts.append("--diff")
        kwargs = {}
        if tags:
            kwargs["tags"] = tags
        return ansible_runner.run(private_data_dir=self._private_dir(), playbook=path, inventory=self.inventory,
                                  extravars=extravars or {}, limit=limit, cmdline=" ".join(opts) or None,
                                  envvars=self._envvars(envvars), quiet=True, **kwargs)

    def run_module(self, module, args=None, hosts="gpu_hosts", extravars=None, check=False):
        import ansible_runner
        if isinstance(args, dict):
            args = " ".join("%s=%s" % (k, shlex.quote(v if isinstance(v, str) else json.dumps(v)))
                            for k, v in args.items())
        return ansible_runner.run(private_data_dir=self._private_dir(), module=module, module_args=args or "",
                                  host_pattern=hosts, inventory=self.inventory, extravars=extravars or {},
                                  cmdline="--check" if check else None, envvars=self._envvars(), quiet=True)

    @staticmethod
    def events(runner, event, task_action=None):
        out = []
        for ev in runner.events:
            data = ev.get("event_data", {})
            if ev.get("event") == event and (task_action is None or
                                             data.get("task_action", "").endswith(task_action)):
                out.append(data)
        return out

    def ok_hosts(self, runner, task_action=None):
        return {d["host"] for d in self.events(runner, "runner_on_ok", task_action)}

    def failed_hosts(self, runner, task_action=None):
        return {d["host"] for ev in ("runner_on_failed", "runner_on_unreachable")
                for d in self.events(runner, ev, task_action)}

    # -- direct access ----------------------------------------------------------------------------
    def exec(self, host, argv, check=False, input=None, env=None, timeout=120):
        cmd = labtool.exec_argv(self._entry(host), [str(a) for a in argv], env=env)
        proc = subprocess.run(cmd, input=input.encode() if isinstance(input, str) else input,
                              capture_output=True, timeout=timeout)
        res = subprocess.CompletedProcess(argv, proc.returncode,
                                          proc.stdout.decode("utf-8", "surrogateescape"),
                                          proc.stderr.decode("utf-8", "surrogateescape"))
        if check and res.returncode != 0:
            raise subprocess.CalledProcessError(res.returncode, argv, res.stdout, res.stderr)
        return res

    def fault(self, host, **knobs):
        for k in knobs:
            if k not in labtool.FAULT_KNOBS:
                raise ValueError("unknown fault knob %r (known: %s)" % (k, ", ".join(sorted(labtool.FAULT_KNOBS))))
        return labtool.set_faults(self._entry(host), knobs)

    def clear_faults(self, host=None):
        for h in [host] if host else self.hosts:
            labtool.set_faults(self._entry(h), {}, clear=True)

    def gpus(self, host):
        return labtool.gpusim.gpu_snapshot(self.host_dirs[host])

    def start_standin(self, host, extra_env=None, args=None):
        hv = self.host_vars(host)
        argv = list(hv["sglang_launcher"])
        launch = dict(hv["sglang_launch_args"]) if args is None else args
        for k, v in launch.items():
            if v is True:
                argv.append("--" + k)
            elif v not in (False, None):
                argv += ["--" + k, str(v)]
        argv += ["--host", str(hv.get("sglang_host", "127.0.0.1")), "--port", str(hv.get("sglang_port", 30000))]
        log = os.path.join(self.host_dirs[host], "state", "standin-test.log")
        script = "%s > %s 2>&1 < /dev/null & echo $!" % (" ".join(shlex.quote(a) for a in argv), shlex.quote(log))
        res = self.exec(host, ["sh", "-c", script], check=True, env=extra_env)
        return int(res.stdout.split()[-1])

    def stop_server(self, host):
        """Stop whatever server runs on ``host`` the way an operator would (restart.yml --tags stop,wait) and check
        its port is free: the lab is shared, and a server another module left there keeps the port."""
        runner = self.run_playbook("playbooks/restart.yml", limit=host, tags="stop,wait")
        with open(runner.stdout.name) as fh:
            assert runner.status == "successful", fh.read()[-3000:]
        assert self.wait_http(host, timeout_s=1) is None

    def wait_http(self, host, path="/health_generate", status=200, timeout_s=30):
        port = self.host_vars(host).get("sglang_port", 30000)
        addr = self.host_vars(host).get("sglang_host", "127.0.0.1")
        code = ("import sys, time, urllib.request, urllib.error\n"
                "deadline = time.time() + %f\n"
                "while True:\n"
                "    try:\n"
                "        rc = urllib.request.urlopen('http://%s:%d%s', timeout=2).status\n"
                "    except urllib.error.HTTPError as e:\n"
                "        rc = e.code\n"
                "    except OSError:\n"
                "        rc = None\n"
                "    if rc == %d or time.time() > deadline:\n"
                "        print(rc); break\n"
                "    time.sleep(0.1)\n" % (timeout_s, addr, port, path, status))
        res = self.exec(host, [self.host_vars(host)["sglang_python"], "-c", code], timeout=timeout_s + 30)
        got = res.stdout.strip()
        return int(got) if got.isdigit() else None


def _lab_up(lab_dir, hosts, init="process"):
    version = os.environ.get("GPUFLEET_TEST_LAB_SGLANG", "0.5.23")
    up = subprocess.run([sys.executable, LAB_PY, "up", "--hosts", str(hosts), "--sglang-version", version,
                         "--lab-dir", lab_dir, "--init", init], capture_output=True, text=True)
    if up.returncode != 0:
        subprocess.run([sys.executable, LAB_PY, "down", "--lab-dir", lab_dir], capture_output=True)
        pytest.fail("lab up failed (rc %d):\n%s\n%s" % (up.returncode, up.stdout, up.stderr))


def _lab_down(lab_dir):
    subprocess.run([sys.executable, LAB_PY, "down", "--lab-dir", lab_dir], capture_output=True)
    try:
        os.rmdir(lab_dir)
    except OSError:
        pass


def _session_lab(cls, reuse_env, lab_dir, hosts, init):
    """Yield a ``cls`` for the lab named by ``reuse_env`` (left running), or for one brought up in ``lab_dir``
    and taken down afterwards."""
    reuse = os.environ.get(reuse_env)
    if reuse:
        yield cls(reuse)
        return
    _lab_up(lab_dir, hosts, init)
    try:
        yield cls(lab_dir)
    finally:
        _lab_down(lab_dir)


def _lab_prerequisites():
    if os.geteuid() != 0:
        return "the lab needs root"
    for tool in ("/usr/sbin/sshd",):
        if not os.path.exists(tool):
            return "%s missing (run make setup)" % tool
    return None


@pytest.fixture(scope="session")
def lab():
    reason = _lab_prerequisites()
    if reason:
        pytest.skip(reason)
    yield from _session_lab(Lab, "GPUFLEET_TEST_LAB_DIR", "/tmp/gpufleet-test-lab-%d" % os.getpid(),
                            int(os.environ.get("GPUFLEET_TEST_LAB_HOSTS", "4")), "process")


class SystemdLab(Lab):
    def systemctl(self, host, *args):
        return self.exec(host, ["systemctl", "--no-pager"] + list(args))

    def unit_props(self, host, *names, unit="sglang.service"):
        res = self.systemctl(host, "show", unit, *["--property=%s" % n for n in names])
        return dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)


@pytest.fixture(scope="session")
def systemd_lab():
    reason = _lab_prerequisites()
    for tool in ("/usr/bin/systemd-nspawn", "/usr/bin/sudo"):
        if not reason and not os.path.exists(tool):
            reason = "%s missing (run make system-packages LAB_INIT=systemd)" % tool
    if reason:
        pytest.skip(reason)
    yield from _session_lab(SystemdLab, "GPUFLEET_TEST_SYSTEMD_LAB_DIR",
                            "/tmp/gpufleet-test-lab-systemd-%d" % os.getpid(),
                            int(os.environ.get("GPUFLEET_TEST_SYSTEMD_LAB_HOSTS", "2")), "systemd")


def pytest_collection_modifyitems(items):
    for item in items:
        if {"lab", "systemd_lab"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.lab)
