"""playbooks/check.yml against the lab: a healthy fleet is all OK (rc 0) with table, stats, JSON, HTML and
textfile; each injected fault gives its verdict and reason code; fail_on; check mode writes nothing; the textfile,
scraped by node_exporter into a real Prometheus, joins a dcgm-exporter-shaped series on UUID.

One lab for the module (restart.yml serves every host once); each test undoes its faults."""
import http.server
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("gpufleet_lab_tool_check", os.path.join(ROOT, "tests", "lab", "lab.py"))
labtool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(labtool)
SCHEMA = os.path.join(ROOT, "docs", "schemas", "check.schema.json")
ARTIFACTS = os.path.join(ROOT, "artifacts")
# The lab's simulated kernel log (lab hosts have no /dev/kmsg) and a per-host textfile directory.
LAB_VARS = {"fleet_check_kmsg_path": "{{ lab_host_dir }}/kmsg"}
TEXTFILE = "{{ lab_host_dir }}/textfile"


def stdout_of(runner):
    with open(runner.stdout.name) as handle:
        return handle.read()


def check_stats(runner):
    for ev in runner.events:
        if ev.get("event") == "playbook_on_stats":
            return ((ev.get("event_data") or {}).get("artifact_data") or {}).get("gpufleet_check")
    return None


def codes(stats, host):
    return {(r["severity"], r["code"], r["gpu"]) for r in stats[host]["reasons"]}


def server_pid(lab, host):
    path = os.path.join(lab.host_vars(host)["sglang_state_dir"], "sglang.pid")
    with open(path) as fh:
        return int(fh.read().split()[0])


def engine_path(host_dir):
    out = subprocess.run(["bash", "-c", "ls -d %s/venv/lib/python3*/site-packages/sglang/srt/entrypoints/engine.py"
                          % host_dir], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


@pytest.fixture(scope="module")
def served(lab):
    hosts = lab.hosts[:3]
    assert len(hosts) >= 2, "test_check needs a lab of 2 hosts or more"
    lab.clear_faults()
    runner = lab.run_playbook("playbooks/restart.yml", extravars={"gpufleet_serial": len(lab.hosts)})
    assert runner.status == "successful", stdout_of(runner)[-3000:]
    for host in lab.hosts:
        os.makedirs(os.path.join(lab.host_dirs[host], "textfile"), exist_ok=True)
    yield hosts
    lab.clear_faults()
    # Leave the lab as the next module expects it: the NCCL block in place (a test removed it), no server running
    # (later modules start their own and wait for GPU memory to be free).
    patched = lab.run_playbook("playbooks/patch.yml")
    assert patched.status == "successful", stdout_of(patched)[-3000:]
    stopped = lab.run_playbook("playbooks/restart.yml", extravars={"gpufleet_serial": len(lab.hosts)}, tags="stop,wait")
    assert stopped.status == "successful", stdout_of(stopped)[-3000:]
    for host in lab.hosts:
        shutil.rmtree(os.path.join(lab.host_dirs[host], "textfile"), ignore_errors=True)


def run_check(lab, extravars=None, **kw):
    ev = dict(LAB_VARS)
    ev.update(extravars or {})
    return lab.run_playbook("playbooks/check.yml", extravars=ev, **kw)


def test_healthy_fleet_is_ok_with_table_stats_json_html_and_textfile(lab, served, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    parser = pytest.importorskip("prometheus_client.parser")
    report = tmp_path / "report"
    runner = run_check(lab, {"gpufleet_report_dir": str(report), "gpufleet_textfile_dir": TEXTFILE,
                             "gpufleet_expected_gpus": 8})
    out = stdout_of(runner)
    assert runner.status == "successful" and runner.rc == 0, out[-3000:]
    stats = check_stats(runner)
    assert set(stats) == set(lab.hosts)
    for host in lab.hosts:
        assert stats[host] == {"verdict": "OK", "reasons": [], "gpus_ok": 8, "gpus_total": 8}, stats[host]
    table = out.split("GPUFLEET CHECK", 1)[1]
    for host in lab.hosts:
        assert any(line.split()[:3] == [host, "OK", "8/8"] for line in table.splitlines()), table
    assert "%d host(s): %d OK, 0 WARN, 0 CRIT" % (len(lab.hosts), len(lab.hosts)) in table
    # Read-only (issue 30, item 8): no task reports a change (the engine.py check runs the patch in check mode) but
    # the files this run was asked to write (the textfile on each host, the reports on the controller).
    changed = set(e["task"] for e in lab.events(runner, "runner_on_ok") if (e.get("res") or {}).get("changed"))
    assert changed <= {"Write gpufleet.prom", "Create the report directory",
                       "Write check.json", "Write check.html (self-contained)"}, changed

    doc = json.loads((report / "check.json").read_text())
    with open(SCHEMA) as fh:
        jsonschema.validate(doc, json.load(fh))
    one = doc["hosts"][lab.hosts[0]]
    assert one["sglang"]["serving"] is True and one["sglang"]["nccl_block"] == "present"
    assert one["sglang"]["workers_nccl_ok"] == 8 and len(one["gpus"]) == 8

    for host in lab.hosts:
        path = os.path.join(lab.host_dirs[host], "textfile", "gpufleet.prom")
        with open(path) as fh:
            families = {f.name: f for f in parser.text_string_to_metric_families(fh.read())}
        assert families["gpufleet_check_severity"].samples[0].value == 0
        assert families["gpufleet_check_severity"].samples[0].labels == {"Hostname": host}
        assert families["gpufleet_gpus_ok"].samples[0].value == 8
        assert families["gpufleet_sglang_serving"].samples[0].value == 1
        # Atomic write: no temporary file left next to it.
        assert os.listdir(os.path.dirname(path)) == ["gpufleet.prom"]

    html = report / "check.html"
    text = html.read_text()
    assert "<link" not in text and "<script" not in text and "http" not in text.split("<body>")[0]
    chromium = shutil.which("chromium")
    if not chromium:
        pytest.skip("chromium not installed (make system-packages REPORT_BROWSER=1 installs it)")
    profile = tempfile.mkdtemp(prefix="i11-chromium-")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--user-data-dir=" + profile]
    try:
        dom = subprocess.run([chromium] + flags + ["--dump-dom", "file://%s" % html], capture_output=True,
                             text=True, timeout=120).stdout
        os.makedirs(ARTIFACTS, exist_ok=True)
        subprocess.run([chromium] + flags + ["--window-size=1400,900",
                                             "--screenshot=%s" % os.path.join(ARTIFACTS, "check-report.png"),
                                             "file://%s" % html], capture_output=True, timeout=120)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert '<table id="fleet">' in dom
    for host in lab.hosts:
        assert 'data-host="%s" data-verdict="OK"' % host in dom
    assert "%d OK" % len(lab.hosts) in dom
    assert os.path.getsize(os.path.join(ARTIFACTS, "check-report.png")) > 1000


def test_check_mode_writes_nothing_and_tags_narrow(lab, served):
    host = served[0]
    prom = os.path.join(lab.host_dirs[host], "textfile", "gpufleet.prom")
    if os.path.exists(prom):
        os.remove(prom)
    runner = run_check(lab, {"gpufleet_textfile_dir": TEXTFILE}, check=True, tags="gpu", limit=host)
    out = stdout_of(runner)
    assert runner.rc == 0, out[-3000:]
    assert not os.path.exists(prom)
    assert check_stats(runner)[host]["verdict"] == "OK"
    # One read per host (issue 32), and under --tags gpu it read the server and the GPUs, nothing of SGLang or NCCL.
    reads = [e["res"] for e in lab.events(runner, "runner_on_ok", "sglang_fleet_check_info") if e.get("host") == host]
    actions = {e["task_action"] for e in lab.events(runner, "runner_on_ok") if e.get("host") == host}
    assert not actions & {"nvidia_gpu_info", "sglang_host_info", "sglang_nccl_patch", "sglang_worker_env_info",
                          "ansible.builtin.uri", "ansible.builtin.ping", "ansible.builtin.command"}, actions
    assert [r["gathered"] for r in reads] == [["server", "gpu"]], reads
    assert reads[0]["gpu"]["gpu_count"] == 8 and reads[0]["host"]["managed_running"] is True
    assert not {"health", "server_info", "args", "patch_present", "workers"} & set(reads[0])


@pytest.mark.lab_only_once
def test_gpu_faults_give_their_reasons(lab, served):
    a, b = served[0], served[1]
    c = served[2] if len(served) > 2 else None
    lab.fault(a, ecc_errors=4, throttle="hw_slowdown")
    # Issue 30: a field restart.yml's GPU memory wait reads, unreadable: named per GPU with field and value.
    lab.fault(b, remap_pending=True, nvlink_down=3, smi_field_values={"memory.total": "[Unknown Error]"})
    if c:
        lab.fault(c, xid=79, gpus_visible=7)
    try:
        runner = run_check(lab, {"gpufleet_expected_gpus": 8})
    finally:
        lab.clear_faults()
    out = stdout_of(runner)
    assert runner.rc != 0, out[-3000:]
    stats = check_stats(runner)
    assert stats[a]["verdict"] == "CRIT"
    assert {("CRIT", "ecc_uncorrected", 1), ("WARN", "throttle", 1)} <= codes(stats, a)
    assert stats[a]["gpus_ok"] == 7
    assert {("CRIT", "remap_pending", 1), ("CRIT", "nvlink_down", 1)} <= codes(stats, b)
    assert {("CRIT", "gpu_field_unreadable", i) for i in range(8)} <= codes(stats, b)
    [text] = [r["text"] for r in stats[b]["reasons"] if r["code"] == "gpu_field_unreadable" and r["gpu"] == 3]
    assert "GPU 3 (GPU-" in text and "memory.total unreadable (reads '[Unknown Error]')" in text, text
    if c:
        assert ("CRIT", "xid_79", 1) in codes(stats, c) and ("CRIT", "fewer_gpus", None) in codes(stats, c)
        assert stats[c]["gpus_total"] == 7
    assert "host(s) at or above CRIT" in out


def test_the_failure_is_the_critical_hosts_own(lab):
    # Not the first host's (the fleet is judged by run_once tasks that run for it): the recap, AWX and the gpufleet
    # command name the host that is CRIT.
    ok, bad = lab.hosts[0], lab.hosts[1]
    lab.fault(bad, remap_pending=True)
    try:
        runner = run_check(lab, {}, tags="gpu", limit="%s,%s" % (ok, bad))
    finally:
        lab.clear_faults(bad)
    out = stdout_of(runner)
    stats = check_stats(runner)
    assert runner.rc != 0 and stats[ok]["verdict"] == "OK" and stats[bad]["verdict"] == "CRIT", out[-3000:]
    assert lab.failed_hosts(runner) == {bad} and runner.stats["failures"] == {bad: 1}, out[-3000:]
    [msg] = [d["res"]["msg"] for d in lab.events(runner, "runner_on_failed")]
    assert msg.startswith("%s is CRIT (remap_pending);" % bad), msg
    assert "1 host(s) at or above CRIT (gpufleet_check_fail_on=crit)" in msg, msg


@pytest.mark.lab_only_once
def test_driver_faults_and_hung_nvidia_smi_are_crit_in_bounded_time(lab, served):
    a, b = served[0], served[1]
    lab.fault(a, smi_rc=6)
    lab.fault(b, smi_hang_s=120)
    try:
        t0 = time.monotonic()
        runner = run_check(lab, {"fleet_check_gpu_timeout_s": 5, "gpufleet_expected_gpus": 8}, tags="gpu",
                           limit="%s,%s" % (a, b))
        took = time.monotonic() - t0
        lab.clear_faults()
        lab.fault(a, smi_rc=18)
        mismatch = run_check(lab, {}, tags="gpu", limit=a)
    finally:
        lab.clear_faults()
    stats = check_stats(runner)
    assert runner.rc != 0
    assert codes(stats, a) == {("CRIT", "no_devices", None)}
    assert stats[a]["gpus_total"] == 8
    assert ("CRIT", "timeout", None) in codes(stats, b)
    assert took < 100, "a hung nvidia-smi held the check for %.0f s" % took
    assert ("CRIT", "driver_mismatch", None) in codes(check_stats(mismatch), a)


@pytest.mark.lab_only_once
def test_nccl_drift_memory_held_and_unreachable(lab, served, tmp_path):
    a, b = served[0], served[1]
    c = served[2] if len(served) > 2 else None
    version = lab.group_vars["lab_sglang_version"]
    pristine = os.path.join(labtool.sglang_release_dir(version),
                            "sglang", "srt", "entrypoints", "engine.py")
    # a: reinstalling the wheel puts SGLang's own engine.py back (the NCCL block is gone).
    shutil.copyfile(pristine, engine_path(lab.host_dirs[a]))
    # b: a server started from the pristine file (workers lack the values), then the block patched back in.
    shutil.copyfile(pristine, engine_path(lab.host_dirs[b]))
    lab.exec(b, ["kill", "-TERM", str(server_pid(lab, b))])
    time.sleep(3)
    pid = lab.start_standin(b)
    with open(os.path.join(lab.host_vars(b)["sglang_state_dir"], "sglang.pid"), "w") as fh:
        fh.write("%d\n" % pid)
    assert lab.wait_http(b, timeout_s=60) == 200
    patch = lab.run_playbook("playbooks/patch.yml", limit=b)
    assert patch.status == "successful", stdout_of(patch)[-2000:]
    if c:
        # c: the server is gone but its GPU memory stays held.
        lab.fault(c, memory_never_released=True)
        lab.exec(c, ["kill", "-KILL", str(server_pid(lab, c))])
        time.sleep(1)
    # An inventory host that does not answer ssh. Its lab_host_dir: LAB_VARS name it, and the one read templates its
    # arguments before it connects (there is no separate ping first any more).
    extra = tmp_path / "extra.yml"
    extra.write_text("all:\n  children:\n    gpu_hosts:\n      hosts:\n        gpu-gone:\n"
                     "          ansible_host: 10.255.255.1\n          ansible_ssh_common_args: -o ConnectTimeout=3\n"
                     "          lab_host_dir: /nonexistent/gpu-gone\n")
    try:
        runner = run_check(lab, {"gpufleet_check_fail_on": "never"}, cmdline="-i %s" % extra)
    finally:
        lab.clear_faults()
    out = stdout_of(runner)
    assert runner.rc == 0, out[-3000:]
    stats = check_stats(runner)
    assert ("CRIT", "nccl_block_missing", None) in codes(stats, a)
    # Read-only (issue 30, item 8): the engine.py check finds a file the patch would change on a, yet reports no
    # change, and the recap counts none on any host.
    assert [e["res"]["patch_present"]["files"][0]["changed"]
            for e in lab.events(runner, "runner_on_ok", "sglang_fleet_check_info") if e["host"] == a] == [True]
    assert [e["task"] for e in lab.events(runner, "runner_on_ok") if (e.get("res") or {}).get("changed")] == []
    assert not any(runner.stats.get("changed", {}).values()), runner.stats
    assert "playbooks/patch.yml" in [r for r in stats[a]["reasons"] if r["code"] == "nccl_block_missing"][0]["text"]
    assert ("CRIT", "nccl_worker_env", None) in codes(stats, b)
    assert ("WARN", "restart_needed", None) in codes(stats, b)
    assert ("CRIT", "nccl_block_missing", None) not in codes(stats, b)
    if c:
        assert ("CRIT", "sglang_not_serving", None) in codes(stats, c)
        assert ("WARN", "memory_held_no_server", 0) in codes(stats, c)
    assert codes(stats, "gpu-gone") == {("CRIT", "unreachable", None)}
    assert "gpu-gone" in out.split("GPUFLEET CHECK", 1)[1]


@pytest.mark.lab_only_once
def test_fail_on_warn_and_crit(lab, served):
    a = served[0]
    lab.fault(a, throttle="hw_slowdown")
    try:
        warn = run_check(lab, {"gpufleet_check_fail_on": "warn"}, tags="gpu", limit=a)
        crit = run_check(lab, {}, tags="gpu", limit=a)
        bad = run_check(lab, {"gpufleet_check_fail_on": "sometimes"}, tags="gpu", limit=a)
    finally:
        lab.clear_faults()
    assert check_stats(warn)[a]["verdict"] == "WARN"
    assert warn.rc != 0 and "at or above WARN" in stdout_of(warn)
    assert crit.rc == 0 and check_stats(crit)[a]["verdict"] == "WARN"
    assert bad.rc != 0 and "gpufleet_check_fail_on=sometimes is not one of" in stdout_of(bad)


@pytest.mark.lab_only_once
def test_a_host_whose_read_did_not_finish_is_crit_not_ok(lab, served):
    a, b = served[0], served[1]
    # b: the call with become fails before its module runs (su to a user that does not exist: the task fails, the
    # host leaves the play): the first call's verdict, still waiting for that call, must not stand for it.
    other = "{{ '%%s' if inventory_hostname == '%s' else '%%s' }}" % b
    runner = run_check(lab, {"fleet_check_become": True, "gpufleet_check_fail_on": "never",
                             "ansible_become_method": other % ("su", "sudo"),
                             "ansible_become_user": other % ("gpufleet-no-such-user", "root")},
                       limit="%s,%s" % (a, b))
    out = stdout_of(runner)
    stats = check_stats(runner)
    assert stats[b]["verdict"] == "CRIT", out[-3000:]
    assert [r["code"] for r in stats[b]["reasons"]] == ["unreachable"], stats[b]
    # a was read and judged from both calls (whatever an earlier test of this module left on it).
    assert not {r["code"] for r in stats[a]["reasons"]} & {"unreachable", "check_read_failed"}, stats[a]
    # a: an interpreter that cannot run returns no part: CRIT check_read_failed, not OK with 0 GPUs.
    runner = run_check(lab, {"ansible_python_interpreter": "/nonexistent/python", "gpufleet_check_fail_on": "never"},
                       limit=a)
    out = stdout_of(runner)
    stats = check_stats(runner)
    assert stats[a]["verdict"] == "CRIT", out[-3000:]
    assert [r["code"] for r in stats[a]["reasons"]] == ["check_read_failed"], stats[a]
    assert "/nonexistent/python" in stats[a]["reasons"][0]["text"], stats[a]


@pytest.mark.lab_only_once
def test_dcgm_health_failure_on_a_gpu_is_crit_and_a_passing_dcgm_is_ok(lab, served):
    # DCGM installed on both hosts (the lab's stand-in dcgmi, tests/lab/standin/dcgmi_standin.py): a's health watches
    # report a memory Failure on GPU 3, b's pass. The other tests' hosts have no dcgmi: nothing is said of DCGM there.
    a, b = served[0], served[1]
    lab.fault(a, dcgmi={"state": "fail", "gpu": 3})
    lab.fault(b, dcgmi="pass")
    try:
        runner = run_check(lab, {"gpufleet_check_fail_on": "never"}, tags="gpu", limit="%s,%s" % (a, b))
    finally:
        lab.clear_faults(a)
        lab.clear_faults(b)
    out = stdout_of(runner)
    assert runner.rc == 0, out[-3000:]
    assert not os.path.exists(os.path.join(lab.host_dirs[a], "bin", "dcgmi")), "a cleared knob leaves no dcgmi"
    stats = check_stats(runner)
    assert stats[b] == {"verdict": "OK", "reasons": [], "gpus_ok": 8, "gpus_total": 8}, stats[b]
    assert stats[a]["verdict"] == "CRIT" and stats[a]["gpus_ok"] == 7, stats[a]
    assert codes(stats, a) == {("CRIT", "dcgm_health_memory", 3)}, stats[a]
    [reason] = stats[a]["reasons"]
    assert reason["text"] == "DCGM Memory system Failure: Detected 2 volatile double-bit ECC error(s) in GPU 3."
    # The module returned what dcgmi said; the host's line says DCGM's words, the table names the code and the GPU.
    [read] = [e["res"]["dcgm"] for e in lab.events(runner, "runner_on_ok", "sglang_fleet_check_info") if e["host"] == a]
    assert read["status"] == "ok" and read["dcgmi"] == os.path.join(lab.host_dirs[a], "bin", "dcgmi"), read
    lines = [e["res"]["msg"] for e in lab.events(runner, "runner_on_ok", "debug") if e["host"] == a]
    assert any(line.startswith("CRIT, GPUs 7/8: CRIT dcgm_health_memory GPU 3: DCGM Memory system Failure: Detected "
                               "2 volatile double-bit ECC error(s) in GPU 3.") for line in lines), lines
    table = out.split("GPUFLEET CHECK", 1)[1]
    [row] = [line for line in table.splitlines() if line.split()[:1] == [a]]
    assert row.split()[1:3] == ["CRIT", "7/8"] and "dcgm_health_memory" in row and "3" in row, table
    assert [line for line in table.splitlines() if line.split()[:3] == [b, "OK", "8/8"]], table


@pytest.mark.lab_only_once
def test_without_prometheus_client_on_the_controller_the_textfile_is_a_warn_and_the_old_file_stays(lab, served,
                                                                                                   tmp_path):
    host = served[0]
    prom = os.path.join(lab.host_dirs[host], "textfile", "gpufleet.prom")
    with open(prom, "w") as fh:
        fh.write("# an earlier check's file\n")
    # The controller's Python finds a prometheus_client that cannot be imported (as where it is not installed).
    (tmp_path / "prometheus_client").mkdir()
    (tmp_path / "prometheus_client" / "__init__.py").write_text("raise ImportError('No module named prometheus_client')\n")
    runner = run_check(lab, {"gpufleet_textfile_dir": TEXTFILE}, tags="gpu", limit=host,
                       envvars={"PYTHONPATH": str(tmp_path)})
    out = stdout_of(runner)
    assert runner.status == "successful" and runner.rc == 0, out[-3000:]
    stats = check_stats(runner)
    assert stats[host]["verdict"] == "WARN", stats[host]
    [reason] = stats[host]["reasons"]
    assert reason["code"] == "textfile_write_failed" and reason["text"].startswith(
        "%s/gpufleet.prom not written: the Python package prometheus-client is missing on the controller"
        % os.path.dirname(prom)), reason
    assert not [e for e in lab.events(runner, "runner_on_ok") if e["task"] == "Write gpufleet.prom"]
    with open(prom) as fh:
        assert fh.read() == "# an earlier check's file\n"
    os.remove(prom)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dcgm_exporter_text(gpus_by_host):
    """dcgm-exporter's shape of DCGM_FI_DEV_FB_USED (MiB) and its labels, for the GPUs nvidia-smi listed."""
    lines = ["# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).", "# TYPE DCGM_FI_DEV_FB_USED gauge"]
    for host, gpus in gpus_by_host.items():
        for g in gpus:
            lines.append('DCGM_FI_DEV_FB_USED{gpu="%s",UUID="%s",pci_bus_id="%s",device="nvidia%s",modelName="%s",'
                         'Hostname="%s",DCGM_FI_DRIVER_VERSION="580.159.04"} %s'
                         % (g["index"], g["uuid"], g["pci_bus_id"], g["index"], g["name"], host, g["used_mib"]))
    return ("\n".join(lines) + "\n").encode()


def _prom_query(port, expr):
    url = "http://127.0.0.1:%d/api/v1/query?%s" % (port, urllib.parse.urlencode({"query": expr}))
    with urllib.request.urlopen(url, timeout=5) as resp:
        doc = json.load(resp)
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


@pytest.mark.lab_only_once
def test_the_textfile_joins_dcgm_exporter_series_on_uuid_in_a_real_prometheus(lab, served, tmp_path):
    """check.yml writes gpufleet.prom; Debian's node_exporter serves it (textfile collector only), a stand-in
    serves dcgm-exporter's DCGM_FI_DEV_FB_USED for the same GPUs, Debian's Prometheus scrapes both (1 s): the
    PromQL join on UUID gives each GPU's memory with gpufleet's labels, and all six GPU labels agree."""
    binaries = {name: shutil.which(name) for name in ("prometheus", "prometheus-node-exporter")}
    if not all(binaries.values()):
        if os.environ.get("CI"):
            pytest.fail("Debian's prometheus and prometheus-node-exporter are missing: make system-packages PROMETHEUS=1")
        pytest.skip("Debian's prometheus / prometheus-node-exporter missing (make system-packages PROMETHEUS=1)")
    hosts = served[:2]
    runner = run_check(lab, {"gpufleet_textfile_dir": TEXTFILE}, tags="gpu", limit=",".join(hosts))
    assert runner.status == "successful" and runner.rc == 0, stdout_of(runner)[-3000:]
    gpus_by_host = {}
    for host in hosts:
        out = lab.exec(host, ["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id,name,memory.used",
                              "--format=csv,noheader,nounits"], check=True).stdout
        rows = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]
        gpus_by_host[host] = [dict(zip(("index", "uuid", "pci_bus_id", "name", "used_mib"), r)) for r in rows]
        assert len(gpus_by_host[host]) == 8, out
    used = {g["uuid"]: float(g["used_mib"]) for gpus in gpus_by_host.values() for g in gpus}
    assert len(used) == 16 and all(v > 0 for v in used.values()), used  # the served lab holds GPU memory
    body = _dcgm_exporter_text(gpus_by_host)

    class Dcgm(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    dcgm = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Dcgm)
    threading.Thread(target=dcgm.serve_forever, daemon=True).start()
    procs, logs = [], []
    try:
        targets = []
        for host in hosts:
            port = _free_port()
            log = open(tmp_path / ("node-exporter-%s.log" % host), "w")
            logs.append(log)
            procs.append(subprocess.Popen([binaries["prometheus-node-exporter"], "--collector.disable-defaults",
                                           "--collector.textfile", "--collector.textfile.directory=%s"
                                           % os.path.join(lab.host_dirs[host], "textfile"),
                                           "--web.listen-address=127.0.0.1:%d" % port],
                                          stdout=log, stderr=subprocess.STDOUT))
            targets.append("127.0.0.1:%d" % port)
        (tmp_path / "prometheus.yml").write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "node", "static_configs": [{"targets": targets}]},
                               {"job_name": "dcgm", "static_configs": [
                                   {"targets": ["127.0.0.1:%d" % dcgm.server_address[1]]}]}]}))
        prom_port = _free_port()
        log = open(tmp_path / "prometheus.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([binaries["prometheus"], "--config.file=%s" % (tmp_path / "prometheus.yml"),
                                       "--storage.tsdb.path=%s" % (tmp_path / "tsdb"),
                                       "--web.listen-address=127.0.0.1:%d" % prom_port],
                                      stdout=log, stderr=subprocess.STDOUT))
        join = "gpufleet_gpu_healthy * on(UUID) group_left DCGM_FI_DEV_FB_USED"
        # One-to-one on all six labels: gpufleet names each GPU exactly as dcgm-exporter does.
        strict = "gpufleet_gpu_healthy * on(gpu, UUID, pci_bus_id, device, modelName, Hostname) DCGM_FI_DEV_FB_USED"
        deadline, result = time.monotonic() + 25, []
        while time.monotonic() < deadline:
            try:
                result = _prom_query(prom_port, join)
            except OSError:  # not listening yet
                result = []
            if len(result) == 16:
                break
            time.sleep(0.5)
        for p in procs:
            assert p.poll() is None, "exited %s: see %s" % (p.returncode, tmp_path)
        assert len(result) == 16, (result, _prom_query(prom_port, "up"))
        assert len(_prom_query(prom_port, strict)) == 16
        assert [r["value"][1] for r in _prom_query(prom_port, "node_textfile_scrape_error")] == ["0", "0"]
        joined = {r["metric"]["UUID"]: (r["metric"], float(r["value"][1])) for r in result}
        assert set(joined) == set(used)
        for host, gpus in gpus_by_host.items():
            for g in gpus:
                labels, value = joined[g["uuid"]]
                # The served lab is OK on every GPU: healthy 1 times DCGM's MiB.
                assert value == used[g["uuid"]], (labels, value)
                assert {k: labels[k] for k in ("gpu", "device", "pci_bus_id", "modelName", "Hostname")} == {
                    "gpu": g["index"], "device": "nvidia" + g["index"], "pci_bus_id": g["pci_bus_id"],
                    "modelName": g["name"], "Hostname": host}
                assert labels["job"] == "node"  # group_left keeps gpufleet's side
        # Every query the shipped dashboard and rules make runs in this Prometheus; the GPU table's DCGM column
        # finds each GPU's memory through gpufleet's series.
        dash = json.loads(open(os.path.join(ROOT, "monitoring", "grafana", "gpufleet.json")).read())
        exprs = [t["expr"].replace("$Hostname", ".*") for p in dash["panels"] for t in p["targets"]]
        for expr in exprs:
            _prom_query(prom_port, expr)
        [fb] = [e for e in exprs if e.startswith("max by (UUID) (DCGM_FI_DEV_FB_USED")]
        assert {r["metric"]["UUID"]: float(r["value"][1]) for r in _prom_query(prom_port, fb)} == used
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        dcgm.shutdown()
        dcgm.server_close()
        for log in logs:
            log.close()
