"""The lab's simulated nvidia-smi (tests/lab/gpusim.py) against real H200 output, query by query.

Every command of RECORDED-WITH.sh (copied with its outputs to tests/data/recordings/h200x2-driver580/ from the
shared recordings; H200 ×2, driver 580.159.04) is run against the simulator in the same state (idle, or one
holder per GPU) and compared structurally: identical header line, same number of columns, ", " separators,
the same unit suffix / "[N/A]" / hex / UUID / bus-id form in each column, the same table layout (every
``|`` and ``+`` in the same column), trailing newline conventions, error text and exit code.
Values differ by design (8 GPUs, other UUIDs, simulated power). ``-q -x`` is the recorded document with the
GPU block repeated per simulated GPU.
"""
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAB = os.path.join(ROOT, "tests", "lab")
REC = os.path.join(os.path.dirname(LAB), "data", "recordings", "h200x2-driver580")
sys.path.insert(0, LAB)
import gpusim  # noqa: E402

FIELDS = None


def _recorded_fields():
    with open(os.path.join(REC, "RECORDED-WITH.sh")) as fh:
        return re.search(r"^F=(\S+)$", fh.read(), re.M).group(1)


def rec(name):
    with open(os.path.join(REC, name)) as fh:
        return fh.read()


@pytest.fixture
def idle_host(tmp_path, monkeypatch):
    host_dir = tmp_path / "gpu-lab-01"
    (host_dir / "gpu").mkdir(parents=True)
    # as inside a lab host: the simulator resolves holder pids in /proc only for its own host
    monkeypatch.setenv(gpusim.HOST_DIR_ENV, str(host_dir))
    return str(host_dir)


@pytest.fixture
def holder():
    """A live process started by absolute interpreter path, like the recording's spawned workers."""
    import subprocess
    import time
    exe = os.path.abspath(sys.executable)
    proc = subprocess.Popen([exe, "-c", "import time; time.sleep(60)"])
    # On a loaded machine /proc/<pid>/cmdline can still show the pre-exec argv for a moment after Popen
    # returns (seen once in a full run: "python3"); the simulator reads argv[0] like NVML does.
    deadline = time.time() + 10
    while time.time() < deadline:
        with open("/proc/%d/cmdline" % proc.pid, "rb") as fh:
            if fh.read().split(b"\0", 1)[0].decode() == exe:
                break
        time.sleep(0.01)
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def loaded_host(idle_host, holder):
    # one live holder per GPU, as in the recording (31330 MiB each)
    gpusim.write_json_atomic(os.path.join(idle_host, "gpu", "state.json"), {"allocs": [
        {"id": i + 1, "gpu": i, "mib": 31330, "pid": holder, "name": None, "released_at": None}
        for i in range(gpusim.GPU_COUNT)], "util": {}})
    return idle_host


def sim(host_dir, argv):
    return gpusim.run(argv, host_dir)


def kind(value):
    """Structural class of one CSV value: the form, not the number."""
    patterns = [
        ("na", r"\[N/A\]"), ("notsup", r"\[Not Supported\]"),
        ("uuid", r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
        ("busid", r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-9A-F]"),
        ("hex", r"0x[0-9A-F]{16}"),
        ("version", r"\d+\.\d+\.\d+"),
        ("float_unit", r"\d+\.\d{2} [A-Za-z%]+"), ("float", r"\d+\.\d{2}"),
        ("int_unit", r"\d+ [A-Za-z%]+"), ("int", r"\d+"),
        ("path", r"/\S+|sglang::\S+"),
    ]
    for name, pat in patterns:
        if re.fullmatch(pat, value):
            return name + (value.split(" ", 1)[1] if name.endswith("_unit") else "")
    return "word:" + value


def assert_csv_like(recorded, simulated, rows_per_gpu=1, header=True):
    assert simulated.endswith("\n") and not simulated.endswith("\n\n")
    assert recorded.endswith("\n") and not recorded.endswith("\n\n")
    r_lines, s_lines = recorded.splitlines(), simulated.splitlines()
    if header:
        assert s_lines[0] == r_lines[0]
        r_lines, s_lines = r_lines[1:], s_lines[1:]
    assert len(s_lines) == 8 * rows_per_gpu
    r_kinds = [[kind(v) for v in line.split(", ")] for line in r_lines]
    for line in s_lines:
        cols = line.split(", ")
        assert len(cols) == len(r_kinds[0])
        s_kind = [kind(v) for v in cols]
        # booleans/words must be the same words (Enabled, Default, P0 ...); numbers the same form and unit
        assert s_kind in r_kinds or _same_forms(s_kind, r_kinds[0]), (line, r_lines[0])


def _same_forms(a, b):
    return all(x == y or (x.startswith("hex") and y.startswith("hex")) for x, y in zip(a, b))


def test_query_gpu_with_header_and_units_matches_idle_recording(idle_host):
    out, rc = sim(idle_host, ["--query-gpu=" + _recorded_fields(), "--format=csv"])
    assert rc == 0
    assert_csv_like(rec("idle-query-gpu.csv"), out)


def test_query_gpu_noheader_nounits_matches_idle_recording(idle_host):
    out, rc = sim(idle_host, ["--query-gpu=" + _recorded_fields(), "--format=csv,noheader,nounits"])
    assert rc == 0
    assert_csv_like(rec("idle-query-gpu-noheader-nounits.csv"), out, header=False)


def test_query_gpu_matches_loaded_recordings(loaded_host):
    out, rc = sim(loaded_host, ["--query-gpu=" + _recorded_fields(), "--format=csv"])
    assert rc == 0
    assert_csv_like(rec("loaded-query-gpu.csv"), out)
    out, _ = sim(loaded_host, ["--query-gpu=" + _recorded_fields(), "--format=csv,noheader,nounits"])
    assert_csv_like(rec("loaded-query-gpu-noheader-nounits.csv"), out, header=False)
    # the recorded relation: used = process memory + context overhead, free = total - reserved - used
    row = out.splitlines()[0].split(", ")
    assert (int(row[8]), int(row[9]), int(row[10]), int(row[11])) == (31339, 143771, 143771 - 616 - 31339, 616)


def test_idle_compute_apps_prints_nothing_and_exits_zero(idle_host):
    out, rc = sim(idle_host, ["--query-compute-apps=pid,process_name,used_memory,gpu_uuid,gpu_bus_id",
                              "--format=csv,noheader,nounits"])
    assert out + "rc=%d\n" % rc == rec("idle-compute-apps.csv")


def test_compute_apps_match_loaded_recordings(loaded_host, holder):
    q = "--query-compute-apps=pid,process_name,used_memory,gpu_uuid,gpu_bus_id"
    out, rc = sim(loaded_host, [q, "--format=csv"])
    assert rc == 0
    assert_csv_like(rec("loaded-compute-apps.csv"), out)
    out, rc = sim(loaded_host, [q, "--format=csv,noheader,nounits"])
    assert_csv_like(rec("loaded-compute-apps-noheader-nounits.csv"), out, header=False)
    assert out.splitlines()[0].split(", ")[:2] == [str(holder), os.path.abspath(sys.executable)]


def test_compute_apps_hide_dead_holders_while_memory_is_still_held(idle_host):
    import time
    gpusim.write_json_atomic(os.path.join(idle_host, "gpu", "state.json"), {"allocs": [
        {"id": 1, "gpu": 3, "mib": 20480, "pid": 2 ** 22 + 7, "released_at": time.time() + 60}], "util": {}})
    apps, _ = sim(idle_host, ["--query-compute-apps=pid", "--format=csv,noheader"])
    used, _ = sim(idle_host, ["-i", "3", "--query-gpu=memory.used", "--format=csv,noheader,nounits"])
    assert apps == "" and used == "%d\n" % (20480 + gpusim.CONTEXT_OVERHEAD_MIB)


def test_after_kill_form(loaded_host):
    out, rc = sim(loaded_host, ["--query-gpu=index,memory.used", "--format=csv,noheader,nounits"])
    assert rc == 0
    assert_csv_like(rec("after-kill.csv"), out, header=False)


def test_bad_field_error_text_and_exit_code(idle_host):
    out, rc = sim(idle_host, ["--query-gpu=bogus.field", "--format=csv"])
    assert out + "rc=%d\n" % rc == rec("error-bad-field.txt")


def test_bad_index_error_text_and_exit_code(idle_host):
    # the recording asked for -i 7 on a 2-GPU host; the lab hosts have 8
    out, rc = sim(idle_host, ["-i", "8", "--query-gpu=index", "--format=csv"])
    assert out + "rc=%d\n" % rc == rec("error-bad-index.txt")


def test_select_by_index_list_and_uuid(idle_host):
    uuid = gpusim.gpu_identities("gpu-lab-01")[5]["uuid"]
    out, rc = sim(idle_host, ["-i", "1,%s" % uuid, "--query-gpu=index", "--format=csv,noheader"])
    assert (out, rc) == ("1\n5\n", 0)


def _layout(line):
    """Positions of the table's frame characters."""
    return [i for i, c in enumerate(line) if c in "|+"]


@pytest.mark.parametrize("state,recording", [("idle", "idle-table.txt"), ("loaded", "loaded-table.txt")])
def test_default_table_layout_matches_recording(request, state, recording):
    host = request.getfixturevalue(state + "_host")
    out, rc = sim(host, [])
    assert rc == 0
    r, s = rec(recording).splitlines(), out.splitlines()
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} {7}", s[0])
    assert s[1:8] == r[1:8]  # banner and column headers, byte for byte
    gpu_block_r, gpu_block_s = r[8:12], s[8:12]
    for a, b in zip(gpu_block_r, gpu_block_s):
        assert _layout(a) == _layout(b) and len(a) == len(b)
    assert len(s) == 8 + 8 * 4 + 6 + (8 if state == "loaded" else 1) + 1
    proc_hdr_r = r.index("| Processes:                                                                              |")
    proc_hdr_s = s.index(r[proc_hdr_r])
    assert s[proc_hdr_s - 2:proc_hdr_s + 4] == r[proc_hdr_r - 2:proc_hdr_r + 4]
    if state == "idle":
        assert s[-2:] == r[-2:]
    else:
        for line in s[proc_hdr_s + 4:-1]:
            assert _layout(line) == _layout(r[proc_hdr_r + 4]) and len(line) == 91
            assert re.fullmatch(r"\|\s+\d+\s+N/A\s+N/A\s+\d+\s+C\s+\S+\s+\d+MiB \|", line)
        assert s[-1] == r[-1]
    assert out.endswith("\n")


def test_list_gpus(idle_host):
    out, rc = sim(idle_host, ["-L"])
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 8
    assert all(re.fullmatch(r"GPU %d: NVIDIA H200 \(UUID: GPU-[0-9a-f-]{36}\)" % i, l) for i, l in enumerate(lines))


def test_help_query_lists_are_the_recorded_ones(idle_host):
    out, rc = sim(idle_host, ["--help-query-gpu"])
    assert rc == 0 and out == rec_help("help-query-gpu.txt")


def rec_help(name):
    with open(os.path.join(REC, name)) as fh:
        return fh.read()


def test_identities_are_distinct_across_hosts():
    ids = [g["uuid"] for h in ("gpu-lab-01", "gpu-lab-02") for g in gpusim.gpu_identities(h)]
    assert len(set(ids)) == 16


def _tags(elem):
    return [e.tag for e in elem.iter()]


def test_q_x_has_the_recorded_structure_per_gpu_and_lists_processes(loaded_host, holder):
    import xml.etree.ElementTree as ET
    out, rc = sim(loaded_host, ["-q", "-x"])
    assert rc == 0
    recorded = rec("idle-q.xml")
    assert out.splitlines()[:3] == recorded.splitlines()[:3]  # xml declaration, DOCTYPE, root
    doc = ET.fromstring(re.sub(r"<!DOCTYPE[^>]*>", "", out))
    ref = ET.fromstring(re.sub(r"<!DOCTYPE[^>]*>", "", recorded))
    assert doc.find("attached_gpus").text == "8"
    gpus = doc.findall("gpu")
    assert [g.find("minor_number").text for g in gpus] == [str(i) for i in range(8)]
    ref_tags = [t for t in _tags(ref.find("gpu")) if t != "process_info"]
    for g in gpus:
        assert [t for t in _tags(g) if t not in ("process_info", "gpu_instance_id", "compute_instance_id", "pid",
                                                    "type", "process_name", "used_memory")] == ref_tags
        assert g.find("fb_memory_usage/used").text == "31339 MiB"
        assert g.find("processes/process_info/pid").text == str(holder)
        assert g.find("processes/process_info/used_memory").text == "31330 MiB"
    assert out.endswith("\t</gpu>\n\n</nvidia_smi_log>\n") and recorded.endswith("\t</gpu>\n\n</nvidia_smi_log>\n")


# ------------------------------------------------------------------------------------------------ health, faults

HEALTH = os.path.join(os.path.dirname(LAB), "data", "recordings", "h200x1-health-driver580")


def health_rec(name):
    with open(os.path.join(HEALTH, name)) as fh:
        return fh.read()


def _health_fields():
    return re.search(r"^F=(\S+)$", health_rec("RECORDED-WITH.sh"), re.M).group(1)


def fault(host_dir, **knobs):
    gpusim.write_json_atomic(os.path.join(host_dir, "faults.json"), knobs)


def test_health_query_matches_the_h200_health_recording_word_for_word_when_idle(idle_host):
    recorded = health_rec("health-query-gpu.csv").split("rc=")[0]
    out, rc = sim(idle_host, ["--query-gpu=" + _health_fields(), "--format=csv"])
    assert rc == 0
    assert_csv_like(recorded, out)
    r_cols = recorded.splitlines()[1].split(", ")
    for line in out.splitlines()[1:]:
        for f, r, s in zip(_health_fields().split(","), r_cols, line.split(", ")):
            if kind(r).startswith("word:") or kind(r) in ("na", "hex"):
                assert s == r, f  # Active / Not Active / [N/A] / N/A / idle reason 0x...01 exactly


def test_each_health_field_alone_is_accepted_like_the_recording(idle_host):
    for line in health_rec("health-fields-one-by-one.txt").splitlines():
        field, _, value = line.partition(": ")
        out, rc = sim(idle_host, ["--query-gpu=" + field, "--format=csv,noheader"])
        assert rc == 0 and kind(out.splitlines()[0]) == kind(value), field


@pytest.mark.parametrize("rc, first", [
    (6, "No devices were found"),
    (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."),
    (15, "Unable to determine the device handle for GPU0000:2A:00.0: GPU is lost."),
    (18, "Failed to initialize NVML: Driver/library version mismatch"),
])
def test_smi_rc_knob_prints_the_driver_text_and_exits_with_it(idle_host, rc, first):
    fault(idle_host, smi_rc=rc)
    for argv in (["--query-gpu=index,memory.used", "--format=csv,noheader,nounits"], ["-L"], [], ["nvlink", "-s"]):
        out, code = sim(idle_host, argv)
        assert code == rc and out.startswith(first), argv


def test_smi_rc_255_prints_seven_good_rows_and_the_device_handle_error(idle_host):
    fault(idle_host, smi_rc=255)
    out, rc = sim(idle_host, ["--query-gpu=index,memory.used", "--format=csv,noheader,nounits"])
    lines = out.splitlines()
    assert rc == 255 and len(lines) == 8
    assert lines[1] == "Unable to determine the device handle for GPU 0000:2A:00.0: Unknown Error"
    assert [ln.split(",")[0] for ln in lines if not ln.startswith("Unable")] == ["0", "2", "3", "4", "5", "6", "7"]


def test_smi_hang_knob_delays_every_answer(idle_host):
    import time
    fault(idle_host, smi_hang_s=0.3)
    t = time.monotonic()
    _, rc = sim(idle_host, ["-L"])
    assert rc == 0 and time.monotonic() - t >= 0.3


def test_health_knobs_change_the_fault_gpu_and_leave_the_others(idle_host):
    fault(idle_host, ecc_errors=4, remap_pending=True, throttle=["hw_slowdown", "sw_thermal_slowdown"],
          mig_on=True, smi_field_values={"memory.used": "[Unknown Error]"})
    fields = ("index,ecc.errors.uncorrected.aggregate.total,ecc.errors.corrected.volatile.total,remapped_rows.pending,"
              "remapped_rows.uncorrectable,clocks_event_reasons.active,clocks_event_reasons.hw_slowdown,"
              "mig.mode.current,memory.used")
    out, rc = sim(idle_host, ["--query-gpu=" + fields, "--format=csv,noheader,nounits"])
    rows = [line.split(", ") for line in out.splitlines()]
    assert rc == 0
    assert rows[1][1:] == ["4", "4", "Yes", "1", "0x0000000000000028", "Active", "Enabled", "[Unknown Error]"]
    assert rows[0][1:] == ["0", "0", "No", "0", "0x0000000000000001", "Not Active", "Enabled", "[Unknown Error]"]


def test_gpus_visible_knob_drops_gpus(idle_host):
    fault(idle_host, gpus_visible=6)
    out, rc = sim(idle_host, ["-L"])
    assert rc == 0 and len(out.splitlines()) == 6


def test_nvlink_status_and_errors_with_a_link_down(idle_host):
    fault(idle_host, nvlink_down=3)
    out, rc = sim(idle_host, ["nvlink", "-s"])
    lines = out.splitlines()
    assert rc == 0 and lines[0].startswith("GPU 0: NVIDIA H200 (UUID: GPU-") and len(lines) == 8 * 19
    assert lines[19 + 1 + 3] == "\t Link 3: <inactive>" and lines[1] == "\t Link 0: 26.562 GB/s"
    err, rc = sim(idle_host, ["nvlink", "-e"])
    assert rc == 0 and "\t Link 3: Recovery Errors: 3" in err.split("GPU 2:")[0]


def test_xid_knob_writes_kmsg_records_the_module_reader_parses(idle_host):
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu_kmsg as K
    gpusim.sync_kmsg(idle_host, {"xid": [79, 48]})
    events = K.read_xid_kmsg(gpusim.kmsg_path(idle_host), window_min=5)
    bus = gpusim.gpu_identities("gpu-lab-01")[gpusim.FAULT_GPU]["pci_bus_id"]
    assert [(e["xid"], e["pci_bus_id"]) for e in events] == [(79, bus), (48, bus)]
    assert "GPU has fallen off the bus." in events[0]["text"]
    gpusim.sync_kmsg(idle_host, {})
    assert K.read_xid_kmsg(gpusim.kmsg_path(idle_host), window_min=5) == []


# --- the cost of a call (issue 14): the query paths import no heavy module, and a call lasts at least the
# real nvidia-smi's median (padding by sleep), so the lab measures gpufleet, not the simulator.

def _front_end(host_dir, python=None):
    """A front end written as lab.py writes it (interpreter -IS, gpusim from tests/lab)."""
    path = os.path.join(host_dir, "nvidia-smi")
    with open(path, "w") as fh:
        fh.write("#!%s -IS\nimport sys\nsys.path.insert(0, %r)\nimport gpusim\nsys.exit(gpusim.main(host_dir=%r))\n"
                 % (python or getattr(sys, "_base_executable", sys.executable), LAB, host_dir))
    os.chmod(path, 0o755)
    return path


def test_query_paths_import_neither_json_re_socket_nor_hashlib(loaded_host):
    import subprocess
    probe = ("import sys\nsys.path.insert(0, %r)\nimport gpusim\n"
             "for argv in ([%r, '--format=csv,noheader,nounits'], [], ['nvlink', '-s'], ['nvlink', '-e'],\n"
             "             ['--query-compute-apps=pid,used_memory,gpu_uuid,gpu_bus_id,process_name', '--format=csv']):\n"
             "    assert gpusim.run(argv, %r)[1] == 0, argv\n"
             "print(','.join(m for m in ('json', 're', 'socket', 'hashlib', '_hashlib', 'enum') if m in sys.modules))\n"
             % (LAB, "--query-gpu=" + _health_fields(), loaded_host))
    done = subprocess.run([getattr(sys, "_base_executable", sys.executable), "-IS", "-c", probe],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_reading_json_without_the_json_module_gives_what_json_gives(tmp_path):
    import json
    for text in ('{"allocs": [{"gpu": 0, "mib": 31330, "pid": 7, "released_at": 1764600000.25, "name": null}],'
                 ' "util": {"0": 40}, "ok": true, "neg": -1.5e3, "s": "caf\\u00e9 \\"q\\""}\n',
                 '  [1, 2.5, "x", false]\n', '{}', '"just a string"'):
        assert gpusim.loads(text) == json.loads(text)
    for bad in ("", "{", '{"a": 1} trailing', "{'a': 1}", "nul"):
        with pytest.raises(ValueError):
            gpusim.loads(bad)
    (tmp_path / "half.json").write_text('{"allocs": [')
    assert gpusim.read_json(str(tmp_path / "half.json"), "default") == "default"


def test_help_field_table_parses_every_recorded_name_and_alias():
    import re
    for fname in ("help-query-gpu.txt", "help-query-compute-apps.txt"):
        expected = {}
        with open(os.path.join(REC, fname)) as fh:
            for line in fh:
                m = re.match(r'^"([A-Za-z_][^"]*)"(?: or "([^"]+)")?\s*$', line)
                if m:
                    expected[m.group(1)] = m.group(1)
                    if m.group(2):
                        expected[m.group(2)] = m.group(1)
        assert gpusim._help_fields(fname) == expected and len(expected) >= 10


def test_a_call_lasts_at_least_the_cost_knob_and_writes_its_answer_first(idle_host):
    import subprocess
    import time
    smi = _front_end(idle_host)
    fault(idle_host, smi_cost_ms=400)
    t = time.monotonic()
    done = subprocess.run([smi, "-L"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("GPU 0: NVIDIA H200")
    assert time.monotonic() - t >= 0.4
    # the default floor is the real nvidia-smi's median (docs/benchmarks.md), 0 turns it off
    assert gpusim.SMI_COST_MS == 28.0 and "smi_cost_ms" in gpusim.SMI_FAULT_KNOBS
