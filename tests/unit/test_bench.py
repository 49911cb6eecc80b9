"""Pure parts of the benchmark equipment (tests/bench/bench.py, tests/gpu/bench_h200.py): no lab, no timing."""
import io
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
import bench  # noqa: E402
import bench_h200  # noqa: E402


# -- prober gaps ----------------------------------------------------------------------------------------------
def _samples(pattern, t0=100.0, step=0.02):
    return [(t0 + i * step, c == "+") for i, c in enumerate(pattern)]


def test_downtime_is_first_good_after_minus_last_good_before():
    s = _samples("+++---+++")  # last good at index 2, first good after at index 6
    d = bench.downtime_from_samples(s)
    assert d["downtime_s"] == pytest.approx(4 * 0.02)
    assert (d["gaps"], d["failed_samples"], d["open"]) == (1, 3, None)
    assert d["last_ok"] == s[2][0] and d["first_ok_after"] == s[6][0]


def test_downtime_spans_flapping_gaps_inside_the_window():
    s = _samples("++-+--+")  # two failure runs: the client saw service from index 1 until index 6
    d = bench.downtime_from_samples(s)
    assert d["gaps"] == 2
    assert d["downtime_s"] == pytest.approx(5 * 0.02)


def test_failures_outside_the_window_are_ignored():
    s = _samples("+-+++--++")
    d = bench.downtime_from_samples(s, t_from=s[3][0])
    assert d["downtime_s"] == pytest.approx(3 * 0.02) and d["gaps"] == 1
    assert bench.downtime_from_samples(s, t_from=s[2][0], t_to=s[4][0]) is None


def test_downtime_open_ends_give_no_number():
    assert bench.downtime_from_samples(_samples("---++"))["open"] == "no good sample before the interruption"
    d = bench.downtime_from_samples(_samples("++---"))
    assert d["downtime_s"] is None and d["open"] == "no good sample after the interruption"
    assert bench.downtime_from_samples(_samples("+++")) is None
    assert bench.downtime_from_samples([]) is None


# -- stand-in log ------------------------------------------------------------------------------------------
def _line(local_epoch, msg):
    # the stand-in's format: local wall clock with ms
    return "[%s.%03d] %s" % (time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(local_epoch)),
                            int(round(local_epoch % 1 * 1000)), msg)


@pytest.mark.parametrize("zone_s", [0, 3600, -5 * 3600 - 1800])
def test_log_start_to_ready_in_any_zone(zone_s):
    exec_t, now_t, ready_t = 1796122400.070, 1796122400.310, 1796122402.055
    text = "\n".join([
        "some earlier unrelated line",
        _line(now_t + zone_s, "lab stand-in: process exec at unix %.3f; now unix %.3f" % (exec_t, now_t)),
        _line(now_t + 0.5 + zone_s, "Load weight begin. (lab stand-in)"),
        _line(ready_t + zone_s, "The server is fired up and ready to roll!"),
    ])
    [start] = bench.parse_standin_log(text)
    assert start["exec"] == pytest.approx(exec_t)
    assert start["ready"] == pytest.approx(ready_t, abs=0.002)
    assert start["start_to_ready_s"] == pytest.approx(ready_t - exec_t, abs=0.002)


def test_log_with_several_starts_and_a_crash():
    lines = []
    for i, (exec_t, ready) in enumerate([(1000.0, 1002.0), (2000.0, None), (3000.0, 3001.5)]):
        lines.append(_line(exec_t + 0.1, "lab stand-in: process exec at unix %.3f; now unix %.3f" % (exec_t, exec_t + 0.1)))
        lines.append(_line(exec_t + 0.5, "RuntimeError: lab fault crash_on_start" if ready is None else "Load weight begin."))
        if ready:
            lines.append(_line(ready, "The server is fired up and ready to roll!"))
    starts = bench.parse_standin_log("\n".join(lines))
    assert [s["start_to_ready_s"] for s in starts] == [pytest.approx(2.0), None, pytest.approx(1.5)]
    assert [s["exec"] for s in bench.parse_standin_log("\n".join(lines), after=1500)] == [2000.0, 3000.0]


def test_log_of_the_real_standin_log_function(monkeypatch):
    """The stand-in's own log()/log_exec_time() output parses, and its exec time is this process's start."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "lab"))
    sys.path.insert(0, os.path.join(ROOT, "tests", "lab", "standin"))
    import sglang_standin
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    sglang_standin.log_exec_time()
    sglang_standin.log("The server is fired up and ready to roll!")
    text = err.getvalue()
    assert text.startswith("[") and "] lab stand-in: process exec at unix " in text
    [start] = bench.parse_standin_log(text)
    # this pytest process started before now, and not days ago
    assert 0 < time.time() - start["exec"] < 86400
    assert start["ready"] == pytest.approx(time.time(), abs=5)
    assert start["start_to_ready_s"] > 0


# -- stats and writers -------------------------------------------------------------------------------------
def test_stats_median_spread_and_null_with_reason():
    e = bench.stats([3.0, 1.0, 2.0, None], "s", "cmd")
    assert (e["value"], e["median"], e["min"], e["max"], e["runs"]) == (2.0, 2.0, 1.0, 3.0, 3)
    assert e["unit"] == "s" and e["command"] == "cmd"
    n = bench.stats([], "s", "cmd", "lab has 8 hosts, not 64")
    assert n["value"] is None and n["reason"] == "lab has 8 hosts, not 64" and n["runs"] == 0


def test_batch_pair_ratio_sets_the_fast_hosts_against_the_same_batch_without_a_slow_host():
    even = {"status": "successful", "hosts": {"h%d" % i: {"downtime_s": d} for i, d in enumerate([10, 12, 14, 11])}}
    slow = {"status": "successful", "hosts": {}}
    e = bench.batch_pair_ratio([11.0, 13.0, None, 12.0], even, slow, "cmd")
    assert e["value"] == round(12.0 / 11.5, 3) and e["runs"] == 1 and "12.00 s" in e["note"] and "11.50 s" in e["note"]
    failed = bench.batch_pair_ratio([11.0], dict(even, status="failed"), slow, "cmd")
    assert failed["value"] is None and "failed (no slow host)" in failed["reason"]


def test_replace_section_keeps_the_rest_of_the_file():
    text = "# Benchmarks\n\nhand-written\n\n%s\nold generated\n%s\n\n## After\nmore\n" % (bench.BEGIN_MARK,
                                                                                      bench.END_MARK)
    out = bench.replace_section(text, "NEW BODY\n")
    assert out == "# Benchmarks\n\nhand-written\n\n%s\nNEW BODY\n%s\n\n## After\nmore\n" % (bench.BEGIN_MARK,
                                                                                          bench.END_MARK)
    assert bench.replace_section(out, "NEW BODY") == out  # idempotent
    appended = bench.replace_section("# B\ntext\n", "body")
    assert appended == "# B\ntext\n\n%s\nbody\n%s\n" % (bench.BEGIN_MARK, bench.END_MARK)
    with pytest.raises(ValueError, match="markers"):
        bench.replace_section("x\n%s\ny\n" % bench.BEGIN_MARK, "body")
    with pytest.raises(ValueError, match="markers"):
        bench.replace_section("%s\n%s\n" % (bench.END_MARK, bench.BEGIN_MARK), "body")


def test_merge_keeps_keys_not_measured_this_time_and_renders_nulls(tmp_path):
    machine = {"cores": 2}
    first = bench.merge_doc({}, {"check_s_64": bench.stats([10.0, 12.0], "s", "ansible ...")}, "make bench",
                            machine)
    second = bench.merge_doc(first, {"downtime_overhead_s_median": bench.stats([], "s", "restart", "run failed")},
                             "make bench BENCH_ARGS='--only single'", machine)
    assert second["keys"]["check_s_64"]["value"] == 11.0
    assert second["keys"]["downtime_overhead_s_median"]["target"] == "≤ 1.0"
    assert list(second["keys"]) == ["downtime_overhead_s_median", "check_s_64"]  # KEYS order
    md = tmp_path / "b.md"
    md.write_text("# Benchmarks\n\nkept\n")
    js = tmp_path / "b.json"
    bench.write_outputs(second, str(js), str(md))
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n") and bench.BEGIN_MARK in text
    assert "| `downtime_overhead_s_median` | null: run failed |" in text
    assert "| `check_s_64` | 11 | 2 |" in text
    assert json.loads(js.read_text())["keys"]["check_s_64"]["samples"] == [10.0, 12.0]


def test_only_selects_groups_by_key_or_name():
    assert bench.select_groups("check_vs_raw_ratio_64,single") == ["check", "single"]
    assert bench.select_groups("batch8") == ["batch8"]
    assert bench.select_groups(None) == bench.ORDER
    with pytest.raises(ValueError, match="unknown key or group 'nope'"):
        bench.select_groups("nope")


def test_lab_size_is_the_most_any_selected_group_needs():
    assert bench.lab_hosts(["module_exit"]) == 0
    assert bench.lab_hosts(["prefetch"]) == 1  # one host at a time: the page cache is shared
    assert bench.lab_hosts(["module_exit", "prefetch"]) == 1
    assert bench.lab_hosts(["prefetch", "single"]) == 8
    assert bench.lab_hosts(["prefetch", "check"]) == 64
    assert bench.lab_hosts(bench.ORDER) == 64
    assert bench.select_groups("prefetch_start_ratio") == ["prefetch"]


def _prefetch_run(mode, pair, ready, load_s=1.5, before=0.0, status="successful", **row):
    return dict({"mode": mode, "pair": pair, "status": status, "start_to_ready_s": ready, "weights_load_s": load_s,
                 "weights_bytes": 3 << 30, "resident_before_pct": before, "prefetch_s": None, "prefetch_gib": None,
                 "resident_pct": None}, **row)


def _prefetched(pair, ready, prefetch_s=1.6, status="successful"):
    return _prefetch_run("prefetched", pair, ready, load_s=0.02, before=100.0, status=status, prefetch_s=prefetch_s,
                         prefetch_gib=3.0, resident_pct=100.0)


def test_prefetch_ratio_is_median_over_median_with_the_pairs_own_ratios_as_samples():
    runs = [_prefetch_run("first_read", 0, 6.0, load_s=6.0),  # before the pairs: only in the read speed's note
            _prefetch_run("cold", 1, 2.0), _prefetched(1, 0.8),
            _prefetched(2, 1.0), _prefetch_run("cold", 2, 2.5),
            _prefetch_run("cold", 3, 4.0), _prefetched(3, 0.9, prefetch_s=1.4)]
    keys = bench.prefetch_keys(runs, {"cold": "cold cmd", "prefetched": "pref cmd"})
    assert set(keys) == set(bench.GROUPS["prefetch"])
    assert keys["start_to_ready_cold_s"]["value"] == 2.5 and keys["start_to_ready_cold_s"]["command"] == "cold cmd"
    assert keys["start_to_ready_prefetched_s"]["value"] == 0.9
    ratio = keys["prefetch_start_ratio"]
    assert ratio["value"] == round(0.9 / 2.5, 3)  # median ÷ median, not the median of the ratios
    assert ratio["samples"] == [0.4, 0.4, 0.225] and ratio["median"] == 0.4
    assert keys["prefetch_s"]["samples"] == [1.6, 1.6, 1.4]
    assert keys["weights_cold_read_mib_s"]["samples"] == [2048.0, 2048.0, 2048.0]  # 3072 MiB ÷ 1.5 s
    assert "the first read after the files were written (a cold run before the pairs, not counted) read 512 MiB/s" \
        in keys["weights_cold_read_mib_s"]["note"]
    assert "3072 MiB of weight files" in keys["start_to_ready_cold_s"]["note"]
    assert "100 % of them resident" in keys["start_to_ready_prefetched_s"]["note"]


def test_a_cold_run_that_was_not_cold_or_failed_gives_no_sample_and_the_note_says_why():
    runs = [_prefetch_run("cold", 1, 0.9, before=40.0), _prefetched(1, 0.8),
            _prefetch_run("cold", 2, 2.0), _prefetched(2, None, status="failed")]
    keys = bench.prefetch_keys(runs, {"cold": "c", "prefetched": "p"})
    assert keys["start_to_ready_cold_s"]["samples"] == [2.0]
    assert keys["start_to_ready_prefetched_s"]["samples"] == [0.8]
    ratio = keys["prefetch_start_ratio"]
    # no pair has both runs counted: no per-pair sample, so no value even though each mode has a median
    assert ratio["value"] is None
    assert "pair 1 cold: not cold: 40.0 % resident" in ratio["reason"]
    assert "pair 2 prefetched: restart.yml failed" in ratio["reason"]
    assert "pair 1 cold: not cold" in keys["start_to_ready_cold_s"]["note"]


def test_prefetch_keys_are_null_with_a_reason_when_nothing_counted():
    keys = bench.prefetch_keys([_prefetch_run("cold", 1, None, status="failed")], {"cold": "c", "prefetched": "p"})
    assert all(e["value"] is None for e in keys.values())
    assert keys["start_to_ready_prefetched_s"]["reason"].startswith("no prefetched run counted (0 run(s)")
    assert "restart.yml failed" in keys["start_to_ready_cold_s"]["reason"]


def test_bench_cli_rejects_bad_arguments():
    for args, text in ((["--only", "nope"], "unknown key or group"), (["--runs", "0"], "--runs must be")):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "bench", "bench.py")] + args,
                           capture_output=True, text=True)
        assert p.returncode == 2 and text in p.stderr


# -- device script --------------------------------------------------------------------------------------------
def test_release_samples_from_a_recorded_h200_report():
    with open(os.path.join(ROOT, "tests", "gpu", "results", "restart-h200x2-run1", "report.json")) as fh:
        report = json.load(fh)
    # docs/benchmarks.md's table of that run: wait end − the later GPU's free moment, per held rep
    assert bench_h200.release_samples(report) == [112.5, 111.5, 116.5]
    assert bench_h200.release_samples({"runs": {"run1": report["runs"]["held1"]}}) == []


def test_release_samples_leave_out_a_wait_that_found_the_memory_free_on_its_first_poll():
    # 2026-12-02, H200: held1's release came while the module was still starting (its first poll saw it free)
    with open(os.path.join(ROOT, "tests", "gpu", "results", "gcfreeze-h200x1-run1", "restart-report.json")) as fh:
        report = json.load(fh)
    skipped = []
    samples = bench_h200.release_samples(report, skipped)
    assert skipped == ["held1"] and len(samples) == 6 and max(samples) < 50


def test_merge_adds_device_keys_and_keeps_lab_keys(tmp_path, monkeypatch):
    js, md = tmp_path / "b.json", tmp_path / "b.md"
    lab = bench.merge_doc({}, {"raw_s_64": bench.stats([9.0], "s", "ssh")}, "make bench", {"cores": 2})
    bench.write_outputs(lab, str(js), str(md))
    res = tmp_path / "bench_h200.json"
    res.write_text(json.dumps({"command": "tests/gpu/bench_h200.py --out $OUT", "machine": {"gpus": "1× H200"},
                               "generated": "2026-12-01T11:00:00Z", "keys": {
                                   "release_detect_ms_median_h200": bench.stats([40.0, 45.0, 50.0], "ms", "rr"),
                                   "info_ms_nvml_h200": bench.stats([300.0], "ms", "mod"),
                                   "unrelated": {"value": 1}}}))
    assert bench_h200.merge(str(res), str(js), str(md)) == ["info_ms_nvml_h200", "release_detect_ms_median_h200"]
    doc = json.loads(js.read_text())
    assert doc["keys"]["raw_s_64"]["value"] == 9.0 and "unrelated" not in doc["keys"]
    e = doc["keys"]["release_detect_ms_median_h200"]
    assert (e["value"], e["target"], e["machine"]) == (45.0, "≤ 50", {"gpus": "1× H200"})
    assert doc["command"] == "make bench"
    assert "| `release_detect_ms_median_h200` | 45 | 3 |" in md.read_text()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="no release_detect_ms_median_h200"):
        bench_h200.merge(str(bad), str(js), str(md))


def test_device_cli_needs_exactly_one_mode():
    script = os.path.join(ROOT, "tests", "gpu", "bench_h200.py")
    for args in ([], ["--out", "/tmp/x", "--merge", "y.json"]):
        p = subprocess.run([sys.executable, script] + args, capture_output=True, text=True)
        assert p.returncode == 2 and "exactly one of --out" in p.stderr
    p = subprocess.run([sys.executable, script, "--out", "/tmp/x", "--mib", "10"], capture_output=True, text=True)
    assert p.returncode == 2 and "--mib" in p.stderr


def test_prober_sees_a_server_go_away_and_come_back():
    """The prober process against a local HTTP server that is down for about 0.5 s: one gap of about that
    length (loose bounds: the machine may be loaded)."""
    import http.server
    import socket
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def serve():
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return srv

    srv = serve()
    with bench.Prober({"h": "http://127.0.0.1:%d/health" % port}, 15) as p:
        t_down = time.time()
        srv.shutdown()
        srv.server_close()
        time.sleep(0.5)
        # Taken before the listen: a probe that starts earlier is refused, so every good sample after the gap
        # started after this moment (the sample's time is its request's start).
        t_up = time.time()
        srv = serve()
        # Leave the prober time for good samples after the return (its process may be scheduled late on a
        # loaded machine; without any, the gap stays open).
        time.sleep(2.0)
    srv.shutdown()
    srv.server_close()
    d = bench.downtime_from_samples(p.samples["h"])
    assert d["gaps"] == 1 and d["open"] is None
    # A probe that read its clock just before t_up may connect just after the listen: 0.2 ms seen in CI.
    assert d["last_ok"] <= t_down and d["first_ok_after"] >= t_up - 0.05
    assert 0.45 <= d["downtime_s"] < 3.0
    assert len(p.samples["h"]) > 20


# -- controller profile folding (tests/bench/profile_controller.py) -------------------------------------------
import profile_controller  # noqa: E402

_PARENT = ("process 1:\"ansible-playbook\";main (ansible/cli/playbook.py:231);"
           "TaskQueueManager.run (/v/lib/python3.11/site-packages/ansible/executor/task_queue_manager.py:386);"
           "StrategyModule.run (/v/lib/python3.11/site-packages/ansible/plugins/strategy/free.py:184)")
_RAW = [
    # a worker building a module payload, parsing a source
    _PARENT + ";Popen._launch (/usr/lib/python3.11/multiprocessing/popen_fork.py:71);"
    "BaseProcess._bootstrap (/usr/lib/python3.11/multiprocessing/process.py:314);"
    "modify_module (/v/lib/python3.11/site-packages/ansible/executor/module_common.py:1312);"
    "_compile_module_ast (/v/lib/python3.11/site-packages/ansible/executor/module_common.py:851) 7",
    # the parent inside os.fork
    _PARENT + ";Popen._launch (/usr/lib/python3.11/multiprocessing/popen_fork.py:66) 3",
    # the parent's loop
    _PARENT + " 5",
    # start-up, before the TQM
    "process 1:\"ansible-playbook\";main (ansible/cli/playbook.py:231);Playbook.load (x.py:1) 2",
    "a line that is not a sample",
]


def test_profile_fold_counts_inclusive_once_per_sample_and_own_at_the_leaf():
    total, incl, own = profile_controller.fold(_RAW)
    assert total == 17
    free = "StrategyModule.run (ansible/plugins/strategy/free.py:184)"  # shortened below site-packages
    assert incl[free] == 15 and own[free] == 5
    assert own["_compile_module_ast (ansible/executor/module_common.py:851)"] == 7
    assert incl["main (ansible/cli/playbook.py:231)"] == 17


def test_profile_buckets_split_child_work_from_the_parents_fork_and_loop():
    b = profile_controller.bucket_counts(_RAW)
    labels = [label for label, _ in profile_controller.BUCKETS]
    worker, build, parse, fork, loop = labels[:5]
    assert (b[worker], b[build], b[parse]) == (7, 7, 7)
    assert b[fork] == 3  # the fork seen from the parent, not the child's work under it
    assert b[loop] == 5
    assert b[labels[-1]] == 2  # start-up: no TaskQueueManager.run frame


def test_release_report_measures_from_when_the_pollers_call_returned(tmp_path):
    """A release seen by a poller call that blocked 40 ms: the latency counts from that call's return (t_end),
    the blocked time is reported apart; a sample without t_end (older poll files) counts from its start."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    import real_restart
    times = tmp_path / "times.jsonl"
    times.write_text(json.dumps({"run": "held1", "play": "Restart", "role": "gpu_memory_wait", "task": "wait",
                                 "action": "gpufleet.fleet.nvidia_gpu_wait", "status": "ok", "start": 100.0,
                                 "runner_start": 100.0, "end": 102.0, "started_at": 100.5,
                                 "elapsed_ms": 1450}) + "\n")
    poll = tmp_path / "poll.jsonl"
    poll.write_text("".join(json.dumps(x) + "\n" for x in [
        {"t": 99.0, "t_call": 99.0, "t_end": 99.0001, "gpu": 0, "used_mib": 21000, "procs": 1},
        {"t": 101.90, "t_call": 101.90, "t_end": 101.94, "gpu": 0, "used_mib": 0, "procs": 0},
        {"t": 99.0, "gpu": 1, "used_mib": 21000, "procs": 1},
        {"t": 101.93, "gpu": 1, "used_mib": 0, "procs": 0}]))
    out = tmp_path / "report.json"
    assert real_restart.report(str(times), str(poll), str(out))
    g = json.loads(out.read_text())["runs"]["held1"]["release_per_gpu"]
    assert g["0"]["poller_free_call_ms"] == pytest.approx(40.0)
    assert g["0"]["wait_task_end_minus_free_seen_ms"] == pytest.approx(60.0)  # 102.0 - 101.94
    assert g["0"]["module_seen_minus_free_seen_ms"] == pytest.approx(10.0)   # 100.5 + 1.45 - 101.94
    assert g["1"]["wait_task_end_minus_free_seen_ms"] == pytest.approx(70.0)  # no t_end: from t
    assert bench_h200.release_samples(json.loads(out.read_text())) == [pytest.approx(60.0)]
