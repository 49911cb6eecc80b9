"""The sglang_preflight role against the lab fleet, over real SSH, through ansible-runner (as AWX runs it).

Playbook tests/integration/playbooks/preflight.yml runs the role alone on every lab host. Each lab host has its
own virtualenv with the real SGLang wheel (its server_args.py and engine.py), model directories, a per-host
/dev/shm and a network namespace, so the flags, paths, NCCL anchor and port checks meet real files and sockets.

Asserted on ansible-runner events: the verdict task (``Stop here if anything would make the restart fail``)
passes or fails per host with a message naming the problem, the module results carry the facts behind it,
and nothing is changed on any host (runner stats).
"""
import base64
import json
import os
import re
import shlex
import time

import pytest

pytestmark = pytest.mark.lab

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAYBOOK = os.path.join(ROOT, "tests", "integration", "playbooks", "preflight.yml")
VERDICT = "Stop here if anything would make the restart fail"
VARIABLES = "Check the inventory variables the restart depends on"


@pytest.fixture
def fleet(request):
    try:
        return request.getfixturevalue("lab")
    except pytest.FixtureLookupError:
        pytest.skip("the lab fixture (tests/integration/conftest.py) is not available")


def run(lab, extravars=None, cmdline=None, limit=None):
    return lab.run_playbook(PLAYBOOK, extravars=extravars or {}, cmdline=cmdline, limit=limit)


def task_events(runner, task):
    """host -> (event name, event_data) of the last ok/failed event of ``task``."""
    found = {}
    for event in runner.events:
        data = event.get("event_data", {})
        if event.get("event") in ("runner_on_ok", "runner_on_failed") and data.get("task") == task:
            found[data["host"]] = (event["event"], data)
    return found


# The module each part of the sglang_preflight_info reads stands for (each part is shaped as that module's result).
PARTS = {"sglang_server_args_info": "args", "sglang_host_info": "host", "sglang_nccl_patch": "patch"}
# The task that shows what goes ahead but the operator should know (GPU holders with warn, hub ids, ...).
NOTES = "Show what goes ahead but the operator should know (hand-typed lines, deprecated or unchecked flags, hub ids)"


def module_results(runner, action):
    """host -> the part of the host's sglang_preflight_info reads that module ``action`` reads alone (the login
    call holds args and patch; the host part is in the call with become where preflight uses one)."""
    part = PARTS[action]
    found = {}
    for event in runner.events:
        data = event.get("event_data", {})
        if event.get("event") in ("runner_on_ok", "runner_on_failed") and \
                data.get("task_action", "").endswith("sglang_preflight_info") and part in data.get("res", {}):
            found.setdefault(data["host"], data["res"][part])
    return found


def verdict_messages(runner):
    """host -> one string of the verdict's message lines, for hosts where it failed."""
    out = {}
    for host, (name, data) in task_events(runner, VERDICT).items():
        if name == "runner_on_failed":
            msg = data["res"]["msg"]
            out[host] = "\n".join(msg) if isinstance(msg, list) else str(msg)
    return out


def assert_nothing_changed(runner):
    changed = {h: n for h, n in (runner.stats or {}).get("changed", {}).items() if n}
    assert changed == {}


def with_launch_args(extra):
    """Extra vars that keep each host's own sglang_launch_args and change some flags (templated per host)."""
    pairs = ", ".join("%r: %s" % (k, "none" if v is None else repr(v)) for k, v in extra.items())
    return {"sglang_preflight_launch_args": "{{ sglang_launch_args | combine({%s}) }}" % pairs}


def test_preflight_passes_on_every_lab_host(fleet):
    runner = run(fleet)
    hosts = sorted(fleet.hosts)
    assert runner.status == "successful"
    verdicts = task_events(runner, VERDICT)
    assert sorted(verdicts) == hosts
    assert all(name == "runner_on_ok" for name, _ in verdicts.values())
    args = module_results(runner, "sglang_server_args_info")
    for host in hosts:
        res = args[host]
        assert res["valid"] is True and res["errors"] == []
        argv = res["argv"]
        assert argv[argv.index("--tp-size") + 1] == "8"
        assert argv[-4:] == ["--host", fleet.host_vars(host)["sglang_host"], "--port", "30000"]
    versions = {args[h]["sglang_version"] for h in hosts}
    assert len(versions) == 1 and None not in versions
    facts = module_results(runner, "sglang_host_info")
    for host in hosts:
        assert facts[host]["port"]["free"] or facts[host]["port"]["held_by_managed"]
        assert facts[host]["shm"]["exists"] and facts[host]["shm"]["size_mib"] > 0
    assert_nothing_changed(runner)


@pytest.mark.lab_only_once
def test_preflight_passes_in_check_mode(fleet):
    runner = run(fleet, cmdline="--check")
    assert runner.status == "successful"
    assert all(name == "runner_on_ok" for name, _ in task_events(runner, VERDICT).values())
    assert_nothing_changed(runner)


@pytest.mark.lab_only_once
def test_unknown_flag_fails_every_host_naming_the_flag_and_the_close_spelling(fleet):
    runner = run(fleet, with_launch_args({"tp_size": 8, "tp-size": None}))
    assert runner.status == "failed"
    messages = verdict_messages(runner)
    assert sorted(messages) == sorted(fleet.hosts)
    for text in messages.values():
        assert "unrecognized argument --tp_size" in text and "did you mean --tp-size" in text
    for res in module_results(runner, "sglang_server_args_info").values():
        assert res["valid"] is False and [e["flag"] for e in res["errors"]] == ["--tp_size"]
    assert_nothing_changed(runner)


@pytest.mark.lab_only_once
def test_bad_speculative_algorithm_fails_listing_the_known_ones(fleet):
    runner = run(fleet, with_launch_args({"speculative-algorithm": "FOO"}))
    assert runner.status == "failed"
    for text in verdict_messages(runner).values():
        assert "--speculative-algorithm" in text and "'FOO'" in text and "EAGLE3" in text
    assert sorted(verdict_messages(runner)) == sorted(fleet.hosts)


@pytest.mark.lab_only_once
def test_missing_model_directory_fails_naming_the_path(fleet):
    runner = run(fleet, with_launch_args({"model-path": "/nonexistent/gpufleet-model"}))
    assert runner.status == "failed"
    messages = verdict_messages(runner)
    assert sorted(messages) == sorted(fleet.hosts)
    for text in messages.values():
        assert "--model-path /nonexistent/gpufleet-model: does not exist on this host" in text


def test_bad_nccl_variable_name_fails_before_any_other_check(fleet):
    runner = run(fleet, {"sglang_nccl_env": {"NCCL_OK": "1", "1NCCL-BAD": "x"}})
    assert runner.status == "failed"
    failed = task_events(runner, VARIABLES)
    assert sorted(failed) == sorted(fleet.hosts)
    for name, data in failed.values():
        assert name == "runner_on_failed"
        assert "sglang_nccl_env has invalid variable names 1NCCL-BAD" in "\n".join(data["res"]["msg"])
    # the module checks never ran
    assert module_results(runner, "sglang_server_args_info") == {}


def stop_managed_server(lab, host):
    """Stop the server an earlier test module may have left on ``host`` (the stray listener needs the port)."""
    pid_file = lab.host_vars(host)["sglang_state_dir"] + "/sglang.pid"
    runner = lab.run_module("sglang_stop", {"pid_file": pid_file, "grace_s": 15}, hosts=host)
    assert runner.status == "successful", [d["res"].get("msg") for d in lab.events(runner, "runner_on_failed")]


@pytest.mark.lab_only_once  # CI time: its path runs under both ansible-cores in another test
def test_port_held_by_a_stray_listener_fails_that_host_only(fleet):
    hosts = sorted(fleet.hosts)
    victim = hosts[0]
    stop_managed_server(fleet, victim)
    fleet.fault(victim, port_held=True)
    try:
        runner = run(fleet)
    finally:
        fleet.fault(victim, port_held=False)
    assert runner.status == "failed"
    messages = verdict_messages(runner)
    assert sorted(messages) == [victim]
    assert "port 30000 is held by pid " in messages[victim]
    assert "stray-listener" in messages[victim]
    assert "which is not the SGLang server being replaced" in messages[victim]
    facts = module_results(runner, "sglang_host_info")[victim]["port"]
    assert facts["free"] is False and facts["held_by_managed"] is False
    (listener,) = [item for item in facts["listeners"] if item["conflicts"]]
    assert listener["pid"] and listener["address"] == "0.0.0.0"
    oks = task_events(runner, VERDICT)
    assert all(oks[h][0] == "runner_on_ok" for h in hosts[1:])


# engine.py of the installed release with its start-method call moved into a branch: a shape the patch refuses (the
# block would run only on some paths), as a future release might write it. The patch must refuse it naming the file
# and the line, in preflight, before anything is stopped.
NOANCHOR = "/tmp/gpufleet-preflight-noanchor-engine.py"
NOANCHOR_SCRIPT = (
    "import importlib.util, os, sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
    "d = importlib.util.find_spec('sglang').submodule_search_locations[0]; "
    "src = open(os.path.join(d, 'srt', 'entrypoints', 'engine.py')).read(); "
    "anchor = 'mp.set_start_method(' + chr(34) + 'spawn' + chr(34) + ', force=True)'; "
    "assert src.count(anchor) == 1; "
    "open(sys.argv[1], 'w').write(src.replace(anchor, 'if server_args:' + chr(10) + ' ' * 8 + anchor))")


@pytest.mark.lab_only_once  # CI time: its path runs under both ansible-cores in another test
def test_start_method_call_in_a_branch_fails_naming_the_file_and_line(fleet):
    hosts = sorted(fleet.hosts)
    for host in hosts:
        fleet.exec(host, [fleet.host_vars(host)["sglang_python"], "-c", NOANCHOR_SCRIPT, NOANCHOR])
    runner = run(fleet, {"sglang_preflight_nccl_patch_path": NOANCHOR})
    assert runner.status == "failed"
    messages = verdict_messages(runner)
    assert sorted(messages) == hosts
    for text in messages.values():
        assert "NCCL patch would fail" in text and NOANCHOR in text
        assert re.search(r"mp\.set_start_method\(\.\.\.\) on line \d+ is not a statement of its own", text), text
        assert "part of the if statement on line" in text and "No file was changed" in text
    for res in module_results(runner, "sglang_nccl_patch").values():
        assert res["changed"] is False
    assert_nothing_changed(runner)


# ---------------------------------------------------------------------------------------------------------------
# Foresight (issue 10, findings 1, 2, 3, 13): what would fail after the stop is refused before it, while the old
# server still serves. Each test starts a stand-in server on one host (with the pid file sglang_launch writes),
# runs restart.yml against that host and asserts the refusal, that the stop never ran, and that the same server
# processes still answer /health_generate.

RESTART = "playbooks/restart.yml"
REAL_STOP = "Stop the server and SGLang leftovers"
SGLANG_PS = ("import json, os, re\n"
             "pat = re.compile(r'sglang::|sglang\\.launch_server')\n"
             "out = []\n"
             "for p in filter(str.isdigit, os.listdir('/proc')):\n"
             "    try:\n"
             "        raw = open('/proc/%s/cmdline' % p, 'rb').read()\n"
             "        cmd = raw.replace(b'\\0', b' ').decode('utf-8', 'replace')\n"
             "    except OSError:\n"
             "        continue\n"
             "    if pat.search(cmd) and int(p) != os.getpid(): out.append(int(p))\n"
             "print(json.dumps(sorted(out)))\n")
# A GPU job that is not SGLang: opens /dev/nvidia<N>, registers MiB with the host's simulated GPUs (gpusimd records
# the connecting pid, as the driver records a CUDA context's process), then optionally drops to another uid.
HOLDER = ("import os, sys, time\n"
          "sys.path.insert(0, sys.argv[4])\n"
          "import gpusim\n"
          "fd = os.open('/dev/nvidia%d' % int(sys.argv[1]), os.O_RDWR)\n"
          "sock = gpusim.hold(int(sys.argv[1]), int(sys.argv[2]))\n"
          "uid = int(sys.argv[3])\n"
          "if uid:\n"
          "    os.setgid(uid); os.setuid(uid)\n"
          "print('holding', flush=True)\n"
          "time.sleep(600)\n")
LAB_TOOLS = os.path.join(ROOT, "tests", "lab")


def sglang_pids(lab, host):
    res = lab.exec(host, [lab.host_vars(host)["sglang_python"], "-c", SGLANG_PS], check=True)
    return set(json.loads(res.stdout))


@pytest.fixture
def serving(fleet):
    """(host, pids): the last lab host serving, with the pid file sglang_launch writes. A server already running
    there (an earlier test's restart.yml) is used as it is and left running; otherwise a stand-in is started and
    stopped afterwards."""
    host = sorted(fleet.hosts)[-1]
    state = fleet.host_vars(host)["sglang_state_dir"]
    running = sglang_pids(fleet, host)
    if running:
        pid_text = fleet.exec(host, ["cat", "%s/sglang.pid" % state]).stdout.strip()
        assert pid_text.isdigit() and int(pid_text) in running, \
            "%s runs SGLang processes %s that no pid file names" % (host, sorted(running))
        assert fleet.wait_http(host, timeout_s=60) == 200
        yield host, sglang_pids(fleet, host)
        return
    pid = fleet.start_standin(host)
    fleet.exec(host, ["sh", "-c", 'mkdir -p "$1" && echo "$2" > "$1/sglang.pid"', "sh", state, str(pid)], check=True)
    try:
        assert fleet.wait_http(host, timeout_s=60) == 200
        pids = sglang_pids(fleet, host)
        assert pid in pids and len(pids) >= 9  # main, 8 TP workers, detokenizer
        yield host, pids
    finally:
        fleet.exec(host, ["kill", "-TERM", str(pid)])
        deadline = time.time() + 30
        while time.time() < deadline and sglang_pids(fleet, host):
            time.sleep(0.2)
        for left in sglang_pids(fleet, host):
            fleet.exec(host, ["kill", "-KILL", str(left)])
        fleet.exec(host, ["rm", "-f", "%s/sglang.pid" % state])
        deadline = time.time() + 10
        while time.time() < deadline and any(g["used_mib"] for g in fleet.gpus(host)):
            time.sleep(0.1)


def assert_refused_and_still_serving(lab, runner, host, pids, *expected):
    """The run failed in preflight on ``host`` naming ``expected``; the stop never ran; the same server serves."""
    assert runner.status == "failed"
    messages = verdict_messages(runner)
    assert list(messages) == [host], messages
    for text in expected:
        assert text in messages[host]
    assert [d for d in lab.events(runner, "runner_on_ok") + lab.events(runner, "runner_on_failed")
            if d.get("task") == REAL_STOP] == []
    refusal = [d["res"]["ansible_facts"]["gpufleet_preflight_refusal"] for d in lab.events(runner, "runner_on_ok")
               if d.get("task") == "Put the refusal in one line for the summary" and d["host"] == host]
    assert len(refusal) == 1 and "\n" not in refusal[0] and expected[0] in refusal[0]
    assert sglang_pids(lab, host) == pids
    assert lab.wait_http(host, timeout_s=5) == 200
    return messages[host]


def start_holder(lab, host, gpu, mib, uid=0):
    """A foreign GPU job on ``host``: pid (host PID namespace) of a process holding ``mib`` MiB on ``gpu``."""
    python = lab.host_vars(host)["sglang_python"]
    script = "setsid %s -c %s %d %d %d %s </dev/null >/dev/null 2>&1 & echo $!" % (
        python, shlex.quote(HOLDER), gpu, mib, uid, shlex.quote(LAB_TOOLS))
    pid = int(lab.exec(host, ["sh", "-c", script], check=True).stdout.split()[-1])
    deadline = time.time() + 10
    while time.time() < deadline:
        apps = [a["pid"] for a in lab.gpus(host)[gpu]["apps"]]
        if pid in apps:
            return pid
        time.sleep(0.1)
    raise AssertionError("holder did not register on %s" % host)


@pytest.mark.lab_only_once
@pytest.mark.parametrize("uid,user", [(0, "root"), (65534, "nobody")], ids=["same-user", "other-user"])
def test_foreign_gpu_job_refuses_the_host_before_the_stop_and_the_server_keeps_serving(fleet, serving, uid, user):
    host, pids = serving
    holder = start_holder(fleet, host, 3, 20000, uid)
    try:
        runner = fleet.run_playbook(RESTART, limit=host)
        text = assert_refused_and_still_serving(
            fleet, runner, host, pids,
            "GPU memory held by a process the stop will not end: pid %d (user %s) holds 20000 MiB on GPU 3"
            % (holder, user),
            "gpufleet_preflight_gpu_holders=warn")
        assert "sglang::scheduler" not in text  # the server's own workers are expected to go
        facts = module_results(runner, "sglang_host_info")[host]
        after = facts["gpu_after_stop"]
        assert [h["pid"] for h in after["holders"]] == [holder] and after["unexplained"] == []
        gpu3 = [g for g in after["gpus"] if g["index"] == 3][0]
        assert gpu3["stop_set_mib"] == 120000 and gpu3["remaining_mib"] > 20000
        assert pids <= set(facts["stop_pids"]) and holder not in facts["stop_pids"]
    finally:
        fleet.exec(host, ["kill", "-KILL", str(holder)])


@pytest.mark.lab_only_once  # CI time: its path runs under both ansible-cores in another test
def test_foreign_gpu_job_with_warn_passes_only_when_the_wait_can_pass_beside_it(fleet, serving):
    host, pids = serving
    holder = start_holder(fleet, host, 5, 1000, 65534)
    try:
        # The wait demands no compute process by default: warn would stop the server and then wait in vain.
        runner = run(fleet, {"gpufleet_preflight_gpu_holders": "warn"}, limit=host)
        text = verdict_messages(runner)[host]
        assert "pid %d (user nobody) holds 1000 MiB on GPU 5" % holder in text
        assert "(warn alone does not help: the run would stop the server and then wait in vain)" in text, text
        # What the holder leaves on GPU 5 (its 1000 MiB and the lab GPU's own base use) fits under the default
        # gpu_memory_wait_max_used_mib (1024): only the setting that stands in the way is named.
        assert ("if the new server fits beside it, set gpu_memory_wait_require_no_processes=false with "
                "gpufleet_preflight_gpu_holders=warn") in text, text
        # A gpu_memory_wait_max_used_mib set too low for what the holder leaves is named, with its value now.
        runner = run(fleet, {"gpufleet_preflight_gpu_holders": "warn", "gpu_memory_wait_require_no_processes": False,
                             "gpu_memory_wait_max_used_mib": 512}, limit=host)
        text = verdict_messages(runner)[host]
        left = re.search(r"set gpu_memory_wait_max_used_mib=(\d+) \(the MiB it leaves on its GPU; now 512\) with ",
                         text)
        assert left and 1000 <= int(left.group(1)) <= 1024, text
        assert "require_no_processes=false" not in text, text
        assert sglang_pids(fleet, host) == pids
        # The wait allowed to pass beside it (1000 MiB under the 1024 MiB limit): warned, and preflight passes.
        runner = run(fleet, {"gpufleet_preflight_gpu_holders": "warn", "gpu_memory_wait_require_no_processes": False},
                     limit=host)
        assert task_events(runner, VERDICT)[host][0] == "runner_on_ok"
        warned = [m for d in fleet.events(runner, "runner_on_ok") if d["host"] == host and d.get("task") == NOTES
                  for m in d["res"]["msg"] if m.startswith("WARNING: GPU memory held")]
        assert len(warned) == 1 and "WARNING: GPU memory held by a process the stop will not end: pid %d" % holder \
            in warned[0]
        assert "the wait after the stop passes beside it" in warned[0]
        assert sglang_pids(fleet, host) == pids
    finally:
        fleet.exec(host, ["kill", "-KILL", str(holder)])


@pytest.mark.lab_only_once
@pytest.mark.parametrize("values,field,raw", [
    ({"memory.used": "[N/A]"}, "memory.used", "[N/A]"),
    ({"used_gpu_memory": "[N/A]"}, "compute-apps used_memory", "[N/A]"),
], ids=["memory-used", "compute-apps-used-memory"])
def test_an_unreadable_gpu_field_refuses_the_host_naming_gpu_field_and_value(fleet, serving, values, field, raw):
    """Issue 30: the wait after the stop reads these fields; preflight refuses while one reads no number."""
    host, pids = serving
    fleet.fault(host, smi_field_values=values)
    try:
        runner = fleet.run_playbook(RESTART, limit=host)
    finally:
        fleet.fault(host, smi_field_values=None)
    text = assert_refused_and_still_serving(fleet, runner, host, pids, "GPU memory unreadable: GPU 0 (GPU-",
                                            "%s unreadable (reads %r)" % (field, raw), "old server keeps serving")
    assert "GPU 7 (GPU-" in text and "held" not in text


@pytest.mark.lab_only_once
def test_memory_of_a_holder_no_gpu_list_names_refuses_when_sglang_would_not_start_beside_it(fleet, serving):
    """Issue 30: 20000 MiB held on GPU 3 by a process nvidia-smi does not list (knob hidden_holder). The old server
    runs beside it, but SGLang's TP memory-balance check would refuse to start any server beside it after the
    stop: refused, untouched, naming the memory per GPU and the way out."""
    host, pids = serving
    fleet.fault(host, hidden_holder={"gpu": 3, "mib": 20000})
    try:
        deadline = time.time() + 10  # the host's init starts the holder on the fault's SIGHUP
        while time.time() < deadline and fleet.gpus(host)[3]["used_mib"] < 140000:
            time.sleep(0.1)
        gpu3 = fleet.gpus(host)[3]
        assert gpu3["used_mib"] >= 140000 and all(a["used_mib"] == 120000 for a in gpu3["apps"])
        runner = fleet.run_playbook(RESTART, limit=host)
        text = assert_refused_and_still_serving(
            fleet, runner, host, pids, "memory held by processes no GPU list names (GPU 3: 200",
            "The memory capacity is unbalanced", "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=false")
        after = module_results(runner, "sglang_host_info")[host]["gpu_after_stop"]
        assert list(after["baseline_mib"]) == ["3"] and 20000 <= after["baseline_mib"]["3"] <= 20100
        assert "python3 /srv/batch/embed_worker.py" in after["unexplained"][0]["text"], text
    finally:
        fleet.fault(host, hidden_holder=None)


@pytest.mark.lab_only_once
@pytest.mark.parametrize("knobs,extravars,expected", [
    ({"smi_rc": 9}, {}, "communicate with the NVIDIA driver"),
    ({"gpus_visible": 7}, {"gpufleet_expected_gpus": 8}, "7"),
], ids=["driver-not-answering", "fewer-gpus"])
def test_driver_error_refuses_the_host_while_the_old_server_serves(fleet, serving, knobs, extravars, expected):
    host, pids = serving
    fleet.fault(host, **knobs)
    try:
        runner = fleet.run_playbook(RESTART, limit=host, extravars=extravars)
    finally:
        fleet.fault(host, **{k: None for k in knobs})
    text = assert_refused_and_still_serving(fleet, runner, host, pids, "GPUs not usable: ",
                                            "the running server is left as it is")
    assert expected in text.split("GPUs not usable: ", 1)[1]


def entrypoints_dir(lab, host):
    """The directory of the engine.py that ``host``'s SGLang virtualenv would import (found without importing it)."""
    locate = ("import importlib.util, os, sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
              "d = importlib.util.find_spec('sglang').submodule_search_locations[0]; "
              "print(os.path.join(d, 'srt', 'entrypoints'))")
    return lab.exec(host, [lab.host_vars(host)["sglang_python"], "-c", locate], check=True).stdout.strip()


@pytest.mark.lab_only_once
def test_unwritable_engine_py_refuses_the_host_naming_the_user_and_the_remedy(fleet, serving):
    host, pids = serving
    entrypoints = entrypoints_dir(fleet, host)
    # A read-only bind mount in the host's own mount namespace: os.access(W_OK) says no and writes fail with
    # EROFS, as for a root-owned virtualenv and a non-root ssh user (the lab logs in as root, which permissions
    # would not stop).
    fleet.exec(host, ["mount", "--bind", entrypoints, entrypoints], check=True)
    try:
        fleet.exec(host, ["mount", "-o", "remount,bind,ro", entrypoints], check=True)
        # A variable no earlier run wrote: the patch would have to change engine.py.
        env = {"GPUFLEET_PREFLIGHT_TEST": "ro-%d" % os.getpid()}
        runner = fleet.run_playbook(RESTART, limit=host, extravars={"sglang_nccl_env": env})
    finally:
        fleet.exec(host, ["umount", entrypoints], check=True)
    text = assert_refused_and_still_serving(
        fleet, runner, host, pids, "NCCL patch could not write %s/engine.py" % entrypoints,
        "read-only filesystem", "no user or become changes that: remount it read-write")
    assert "sglang_nccl_patch_become" not in text  # root already: become would not help
    # engine.py itself bind-mounted over (writable, even): the rename over a mount point fails with EBUSY.
    engine = entrypoints + "/engine.py"
    fleet.exec(host, ["mount", "--bind", engine, engine], check=True)
    try:
        env = {"GPUFLEET_PREFLIGHT_TEST": "bind-%d" % os.getpid()}
        runner = fleet.run_playbook(RESTART, limit=host, extravars={"sglang_nccl_env": env})
    finally:
        fleet.exec(host, ["umount", engine], check=True)
    assert_refused_and_still_serving(
        fleet, runner, host, pids, "NCCL patch could not write %s: %s is a mount point of its own" % (engine, engine),
        "EBUSY", "no user or become changes that")


@pytest.mark.lab_only_once
def test_nccl_values_nccl_would_refuse_or_misread_refuse_the_host_and_engine_py_is_untouched(fleet, serving):
    host, pids = serving
    engine = entrypoints_dir(fleet, host) + "/engine.py"
    before = fleet.exec(host, ["sha256sum", engine], check=True).stdout
    env = {"NCCL_PROTO": 5, "NCCL_P2P_LEVEL": "nvl", "NCCL_BUFFSIZE": "4M", "NCCL_IB_HCA": "mlx5"}
    runner = fleet.run_playbook(RESTART, limit=host, extravars={"sglang_nccl_env": env})
    text = assert_refused_and_still_serving(
        fleet, runner, host, pids, "sglang_nccl_env refused: NCCL_PROTO='5': '5' not known to NCCL",
        "NCCL_P2P_LEVEL='nvl'", "NCCL_BUFFSIZE='4M'", "sglang_nccl_env_unchecked")
    assert "NCCL_IB_HCA" not in text  # free text, not checked
    assert fleet.exec(host, ["sha256sum", engine], check=True).stdout == before


@pytest.mark.lab_only_once
def test_what_sglang_would_undo_or_refuse_after_the_stop_is_refused_before_it(fleet, serving):
    """Deterministic inference with tp 8 beside the seed's NCCL_ALGO/NCCL_MAX_NCHANNELS (the patch would undo what
    SGLang sets for the flag), and a tool-call parser 0.5.23 does not know (argparse refuses it at launch): both are
    named in one refusal, the old server keeps serving and engine.py is untouched. Named as overrides, with the
    real parser name, preflight passes."""
    host, pids = serving
    engine = entrypoints_dir(fleet, host) + "/engine.py"
    before = fleet.exec(host, ["sha256sum", engine], check=True).stdout
    args = dict(fleet.host_vars(host)["sglang_launch_args"],
                **{"enable-deterministic-inference": True, "tool-call-parser": "kimi_k25"})
    assert fleet.group_vars["sglang_nccl_env"]["NCCL_ALGO"] == "Ring"
    runner = fleet.run_playbook(RESTART, limit=host, extravars={"sglang_launch_args": args})
    text = assert_refused_and_still_serving(
        fleet, runner, host, pids,
        "sglang_nccl_env would undo what --enable-deterministic-inference with tp-size 8 makes SGLang set on purpose",
        "NCCL_ALGO=allreduce:tree", "srt/arg_groups/attention_hook.py", "sglang_nccl_env_overrides",
        "invalid choice: 'kimi_k25'", "did you mean 'kimi_k2'")
    assert "NCCL_MAX_NCHANNELS" in text
    assert fleet.exec(host, ["sha256sum", engine], check=True).stdout == before
    allowed = fleet.run_playbook(RESTART, limit=host, tags="preflight", extravars={
        "sglang_launch_args": dict(args, **{"tool-call-parser": "kimi_k2"}),
        "sglang_nccl_env_overrides": ["NCCL_ALGO", "NCCL_MAX_NCHANNELS"]})
    assert allowed.status == "successful", verdict_messages(allowed)
    assert sglang_pids(fleet, host) == pids
    # A preflight-only run is read-only: the rolling play ends before the restart lock is taken or released.
    ran = {e["event_data"].get("task_action", "") for e in allowed.events
           if e.get("event") in ("runner_on_ok", "runner_on_failed") and e["event_data"].get("host") == host}
    assert not any(a.endswith("gpufleet_lock") for a in ran), sorted(ran)
    assert any(a.endswith("sglang_preflight_info") for a in ran), sorted(ran)
    # The summary says what ran: the preflight, passed; not "no task ran".
    row = fleet.events(allowed, "playbook_on_stats")[-1]["artifact_data"]["gpufleet_restart"][host]
    assert (row["result"], row["phase"]) == ("check", "preflight") and "preflight passed" in row["cause"], row
    with open(allowed.stdout.name) as handle:
        assert "no task ran" not in handle.read()


@pytest.mark.lab_only_once  # CI time: its path runs under both ansible-cores in another test
def test_empty_model_directory_refuses_the_host(fleet, serving):
    host, pids = serving
    empty = os.path.join(fleet.host_dirs[host], "models", "unmounted-mount-point")
    os.makedirs(empty, exist_ok=True)
    try:
        runner = fleet.run_playbook(RESTART, limit=host, extravars=with_launch_args({"model-path": empty}))
    finally:
        os.rmdir(empty)
    assert_refused_and_still_serving(fleet, runner, host, pids,
                                     "--model-path %s: holds no config.json" % empty, "mount or copy the model")


def start_shm_holder(lab, host, title, mib):
    """A process titled ``title`` holding /dev/shm/sgl_shm_preflight_live (``mib`` MiB, allocated); its pid."""
    python = lab.host_vars(host)["sglang_python"]
    code = ("import os, sys, time, setproctitle; setproctitle.setproctitle(sys.argv[1]); "
            "fd = os.open('/dev/shm/sgl_shm_preflight_live', os.O_CREAT | os.O_RDWR, 0o600); "
            "os.posix_fallocate(fd, 0, int(sys.argv[2]) << 20); open('/dev/shm/sgl_shm_preflight_live.ready', 'w'); "
            "time.sleep(600)")
    script = "setsid %s -c %s %s %d </dev/null >/dev/null 2>&1 & echo $!" % (
        python, shlex.quote(code), shlex.quote(title), mib)
    pid = int(lab.exec(host, ["sh", "-c", script], check=True).stdout.split()[-1])
    deadline = time.time() + 10
    while time.time() < deadline and lab.exec(host, ["test", "-e", "/dev/shm/sgl_shm_preflight_live.ready"]).returncode:
        time.sleep(0.1)
    assert lab.exec(host, ["test", "-e", "/dev/shm/sgl_shm_preflight_live.ready"]).returncode == 0, \
        "%s could not allocate %d MiB in /dev/shm on %s" % (title, mib, host)
    return pid


def drop_shm_holder(lab, host, pid):
    lab.exec(host, ["kill", "-KILL", str(pid)])
    lab.exec(host, ["rm", "-f", "/dev/shm/sgl_shm_preflight_live", "/dev/shm/sgl_shm_preflight_live.ready"])
    # tmpfs frees an unlinked segment only once its holder is gone: a SIGKILL is not instant under load, and the
    # next holder's 700 MiB would not fit until then (seen in CI).
    deadline = time.time() + 20
    while time.time() < deadline and lab.exec(host, ["kill", "-0", str(pid)]).returncode == 0:
        time.sleep(0.1)


@pytest.mark.lab_only_once  # CI time: its path runs under both ansible-cores in another test
def test_live_shm_segment_of_the_server_counts_as_freed_by_the_stop(fleet, serving):
    host, pids = serving
    # 700 MiB held by an SGLang process (the stop ends it, then removes the segment as stale) leaves less than the
    # 512 MiB preflight needs in the host's 1024 MiB /dev/shm until the stop: it must not block the restart.
    holder = start_shm_holder(fleet, host, "sglang::detokenizer", 700)
    try:
        runner = run(fleet, limit=host)
        assert task_events(runner, VERDICT)[host][0] == "runner_on_ok"
        facts = module_results(runner, "sglang_host_info")[host]
        shm = facts["shm"]
        assert holder in facts["stop_pids"]
        assert shm["free_mib"] < 512 <= shm["free_after_stop_mib"]
        assert shm["freed_by_stop_mib"] >= 700
        assert "sgl_shm_preflight_live" not in [s["name"] for s in shm["kept_segments"]]
    finally:
        drop_shm_holder(fleet, host, holder)
    # The same segment held by a process the stop spares blocks, naming who holds it.
    holder = start_shm_holder(fleet, host, "python train.py", 700)
    try:
        runner = run(fleet, limit=host)
        text = verdict_messages(runner)[host]
        assert "sgl_shm_preflight_live (700.0 MiB, held by pids %d)" % holder in text
        assert "once the stop has ended the old server and removed its segments; need 512 MiB" in text
    finally:
        drop_shm_holder(fleet, host, holder)
    assert sglang_pids(fleet, host) == pids


@pytest.mark.lab_only_once
def test_empty_sglang_port_counts_as_unset_and_a_bad_one_is_named_as_the_user_set_it(fleet):
    host = sorted(fleet.hosts)[0]
    runner = fleet.run_playbook(PLAYBOOK, limit=host, extravars={"sglang_port": ""})
    assert task_events(runner, VERDICT)[host][0] == "runner_on_ok"
    assert module_results(runner, "sglang_host_info")[host]["port"]["port"] == 30000
    runner = fleet.run_playbook(PLAYBOOK, limit=host, extravars={"sglang_port": "abc"})
    (name, data), = task_events(runner, VARIABLES).values()
    text = "\n".join(data["res"]["msg"])
    assert name == "runner_on_failed" and 'sglang_port must be a port number between 1 and 65535, got "abc"' in text
    assert "sglang_preflight_port" not in text


# ---------------------------------------------------------------------------------------------------------------
# Issue 30, items 3 and 8: the seed's own hand-typed NCCL line in engine.py, and a full filesystem under engine.py.

SEED_LINE = 'os.environ["NCCL_PROTO"] = "Simple"'
# Types argv[2] into argv[1]'s _set_envs_and_config at the start-method call's indentation, before or after it
# (argv[3]); prints the 1-based line it went to.
TYPE_LINE = ("import sys\n"
             "path, line, where = sys.argv[1:4]\n"
             "lines = open(path).read().split('\\n')\n"
             "i = next(n for n, t in enumerate(lines) if t.strip().startswith('mp.set_start_method('))\n"
             "indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]\n"
             "at = i + 1 if where == 'after' else i\n"
             "lines.insert(at, indent + line)\n"
             "open(path, 'w').write('\\n'.join(lines))\n"
             "print(at + 1)\n")
WORKER_NCCL = ("import json, os, re\n"
               "out = {}\n"
               "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
               "    try:\n"
               "        title = open('/proc/%s/cmdline' % pid, 'rb').read().split(b'\\0')[0].decode()\n"
               "        if re.match(r'sglang::scheduler_TP\\d+$', title):\n"
               "            env = open('/proc/%s/environ' % pid, 'rb').read().decode('utf-8', 'replace').split('\\0')\n"
               "            out[pid] = dict(e.partition('=')[::2] for e in env if e.startswith('NCCL_'))\n"
               "    except OSError:\n"
               "        pass\n"
               "print(json.dumps(out))\n")


def worker_nccl(lab, host):
    """{worker pid: its NCCL_* variables} of every sglang::scheduler_TP<n> on ``host``."""
    return json.loads(lab.exec(host, [lab.host_vars(host)["sglang_python"], "-c", WORKER_NCCL], check=True).stdout)


def type_line(lab, host, engine, where):
    res = lab.exec(host, [lab.host_vars(host)["sglang_python"], "-c", TYPE_LINE, engine, SEED_LINE, where], check=True)
    return int(res.stdout.strip())


def read_bytes(lab, host, path):
    return lab.exec(host, ["base64", "-w0", path], check=True).stdout


def write_bytes(lab, host, path, b64):
    lab.exec(host, ["sh", "-c", 'base64 -d > "$0"', path], input=b64, check=True)


@pytest.mark.parametrize("where", ["after", pytest.param("before", marks=pytest.mark.lab_only_once)])
def test_a_hand_typed_nccl_line_refuses_the_restart_and_the_old_server_keeps_its_values(fleet, serving, where):
    host, pids = serving
    engine = entrypoints_dir(fleet, host) + "/engine.py"
    original = read_bytes(fleet, host, engine)
    workers = worker_nccl(fleet, host)
    assert len(workers) == 8
    try:
        line = type_line(fleet, host, engine, where)
        edited = read_bytes(fleet, host, engine)
        runner = fleet.run_playbook(RESTART, limit=host)
        text = assert_refused_and_still_serving(
            fleet, runner, host, pids, "NCCL patch would fail",
            '%s:%d: %s' % (engine, line, SEED_LINE), "sglang_nccl_patch_hand_edits=take_over", "No file was changed")
        assert ("(after mp.set_start_method(...))" in text) is (where == "after")
        assert read_bytes(fleet, host, engine) == edited
        assert worker_nccl(fleet, host) == workers
        assert fleet.exec(host, ["sh", "-c", 'ls "$0" | grep -c "~$" || true', os.path.dirname(engine)]).stdout.strip() == "0"
    finally:
        write_bytes(fleet, host, engine, original)


@pytest.mark.lab_only_once
def test_take_over_restarts_with_the_inventory_values_and_absent_puts_the_hand_line_back(fleet, serving):
    """take_over: the restart serves the inventory's values, the backup holds the hand line, state=absent puts it back.
    Then a take-over run whose launch fails: the rollback puts engine.py back as it was before that run (the hand line
    in effect again) and relaunches the recorded launch, whose workers now read Simple, not the recorded LL: the note
    must not say "previous configuration" (gpufleet_rollback_serves)."""
    host, _ = serving
    engine = entrypoints_dir(fleet, host) + "/engine.py"
    original = read_bytes(fleet, host, engine)
    expected = {k: str(v) for k, v in fleet.group_vars["sglang_nccl_env"].items()}
    fast = {"sglang_stop_grace_s": 10, "sglang_launch_ready_slice_s": 5, "sglang_nccl_patch_hand_edits": "take_over"}
    try:
        line = type_line(fleet, host, engine, "after")
        edited = read_bytes(fleet, host, engine)
        runner = fleet.run_playbook(RESTART, limit=host, extravars=fast)
        with open(runner.stdout.name) as handle:
            out = handle.read()
        assert runner.status == "successful", out[-4000:]
        # The run's output names the line taken over; the module's return lists it.
        shown = [d["res"]["msg"] for d in fleet.events(runner, "runner_on_ok")
                 if d.get("task") == "Show the hand-typed lines the patch took over or left" and d["host"] == host]
        assert len(shown) == 1 and shown[0][0].startswith(
            '%s:%d: %s -- after the start-method call; taken over by this run' % (engine, line, SEED_LINE)), shown
        assert "taken over by this run" in out
        patch = module_results(runner, "sglang_nccl_patch")[host]
        taken = [h for h in patch.get("hand_edits", []) if h["action"] == "taken_over"]
        assert [(h["line"], h["text"]) for h in taken] == [(line, SEED_LINE)]
        # Every new worker carries the inventory's values (NCCL_PROTO LL, not the hand line's Simple).
        workers = worker_nccl(fleet, host)
        assert len(workers) == 8 and all({k: env.get(k) for k in expected} == expected for env in workers.values())
        # The backup beside engine.py holds the file with the hand line.
        backups = fleet.exec(host, ["sh", "-c", 'ls -t "$0".*~ | head -1', engine], check=True).stdout.strip()
        assert read_bytes(fleet, host, backups) == edited
        # state=absent: the block goes and the hand line comes back, byte for byte: the file as typed, without the
        # block an earlier run may have put there.
        absent = fleet.run_playbook("playbooks/patch.yml", limit=host, extravars={"sglang_nccl_patch_state": "absent"})
        assert absent.status == "successful"
        typed = base64.b64decode(edited).decode("utf-8").split("\n")
        marks = [i for i, text in enumerate(typed) if "gpufleet managed block" in text]
        unblocked = "\n".join(typed[:marks[0]] + typed[marks[1] + 1:]) if marks else "\n".join(typed)
        assert base64.b64decode(read_bytes(fleet, host, engine)).decode("utf-8") == unblocked
        assert SEED_LINE in unblocked and "gpufleet managed block" not in unblocked
        edited = read_bytes(fleet, host, engine)

        fleet.fault(host, crash_with_arg="--max-running-requests")
        failed = fleet.run_playbook(RESTART, limit=host, extravars=dict(
            fast, sglang_launch_args=fleet.launch_args_expr({"max-running-requests": 7})))
        assert failed.status == "failed"
        rollback = [d["res"]["ansible_facts"]["_gpufleet_rollback"] for d in fleet.events(failed, "runner_on_ok", "set_fact")
                    if d["host"] == host and "_gpufleet_rollback" in d.get("res", {}).get("ansible_facts", {})][-1]
        assert rollback["state"] == "rolled_back", rollback
        assert "previous configuration" not in rollback["detail"], rollback
        assert "not the previous NCCL values" in rollback["detail"] and "NCCL_PROTO" in rollback["detail"], rollback
        assert read_bytes(fleet, host, engine) == edited
        workers = worker_nccl(fleet, host)
        assert len(workers) == 8 and all(env.get("NCCL_PROTO") == "Simple" for env in workers.values())
        assert fleet.wait_http(host, timeout_s=30) == 200
    finally:
        fleet.clear_faults(host)
        fleet.exec(host, ["sh", "-c", 'rm -f "$0".*~', engine])
        write_bytes(fleet, host, engine, original)


@pytest.mark.lab_only_once
def test_a_filesystem_too_full_for_the_patch_refuses_the_host_and_leaves_nothing(fleet, serving):
    host, pids = serving
    entrypoints = entrypoints_dir(fleet, host)
    engine = entrypoints + "/engine.py"
    # A small tmpfs over the entrypoints directory (the host's own mount namespace) holding copies of its files, with
    # room for a patched copy of engine.py but not also for its backup (never the machine's disk).
    size_kib = int(fleet.exec(host, ["du", "-sk", entrypoints], check=True).stdout.split()[0])
    engine_kib = int(fleet.exec(host, ["du", "-k", engine], check=True).stdout.split()[0])
    script = ('d="$0"; t=$(mktemp -d); cp -a "$d/." "$t/"; mount -t tmpfs -o size="$1"k gpufleet-full "$d" && '
              'cp -a "$t/." "$d/"; rc=$?; rm -rf "$t"; exit $rc')
    fleet.exec(host, ["sh", "-c", script, entrypoints, str(size_kib + engine_kib + 16)], check=True)
    try:
        listing = fleet.exec(host, ["ls", "-a", entrypoints], check=True).stdout
        before = fleet.exec(host, ["sha256sum", engine], check=True).stdout
        env = {"GPUFLEET_PREFLIGHT_TEST": "full-%d" % os.getpid()}  # a value no run wrote: engine.py must change
        runner = fleet.run_playbook(RESTART, limit=host, extravars={"sglang_nccl_env": env})
        text = assert_refused_and_still_serving(
            fleet, runner, host, pids, "NCCL patch would fail",
            "not enough room on the filesystem mounted at %s for the NCCL patch: it needs" % entrypoints,
            "the backup of engine.py")
        needed, free = re.search(r"it needs (\d+) bytes .* and has (\d+) bytes free", text).groups()
        assert int(needed) > int(free)
        assert fleet.exec(host, ["ls", "-a", entrypoints], check=True).stdout == listing
        assert fleet.exec(host, ["sha256sum", engine], check=True).stdout == before
    finally:
        fleet.exec(host, ["umount", entrypoints], check=True)

