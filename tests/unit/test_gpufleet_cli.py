"""The gpufleet command (src/gpufleet_cli): arguments → ansible-runner call, events → progress and report."""
import datetime
import io
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "src"))

from gpufleet_cli import cli, events  # noqa: E402

NOW = datetime.datetime(2026, 12, 1, 7, 0, 0)


def spec_of(argv, project=ROOT):
    args = cli.build_parser().parse_args(argv)
    return cli.run_spec(args, project, now=NOW)


def ev(kind, host=None, task="t", role=None, play="Restart SGLang host by host", res=None, **extra):
    data = dict(host=host, task=task, role=role, play=play, res=res or {}, **extra)
    return {"event": kind, "event_data": {k: v for k, v in data.items() if v is not None or k == "res"}}


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


# -- arguments -> ansible-runner ------------------------------------------------------------------------

def test_run_spec_maps_every_option_to_ansible_runner(tmp_path):
    spec, run_dir, report_dir = spec_of(["restart", "-i", "inventory/example", "--limit", "gpu-01,gpu-02",
                                         "--serial", "25%", "--check", "-e", "sglang_port=31000",
                                         "--artifacts-dir", str(tmp_path), "-vv"])
    assert spec["playbook"] == os.path.join(ROOT, "playbooks", "restart.yml")
    assert spec["project_dir"] == ROOT and spec["envvars"]["ANSIBLE_CONFIG"] == os.path.join(ROOT, "ansible.cfg")
    assert spec["inventory"] == [os.path.abspath("inventory/example")]
    assert spec["limit"] == "gpu-01,gpu-02" and spec["cmdline"] == "--check" and spec["verbosity"] == 2
    assert spec["extravars"] == {"gpufleet_serial": "25%", "sglang_port": 31000}
    assert run_dir.startswith(str(tmp_path) + os.sep) and spec["private_data_dir"] == run_dir
    assert os.path.basename(run_dir) == spec["ident"] and spec["ident"].startswith("20261201T070000-restart-")
    assert report_dir == os.path.join(run_dir, "report")


def test_run_spec_without_a_checkout_runs_the_collection_playbook(tmp_path):
    spec, _, report_dir = spec_of(["check", "--artifacts-dir", str(tmp_path)], project=None)
    assert spec["playbook"] == "gpufleet.fleet.check"
    assert "project_dir" not in spec and "ANSIBLE_CONFIG" not in spec["envvars"]
    # check writes its report files into the run's directory
    assert spec["extravars"]["gpufleet_report_dir"] == report_dir
    assert "limit" not in spec and "cmdline" not in spec


def test_unlock_targets_the_limit_unless_target_is_given():
    assert spec_of(["unlock", "--limit", "gpu-07"])[0]["extravars"]["target"] == "gpu-07"
    assert spec_of(["unlock", "--limit", "gpu-07", "-e", "target=gpu-08"])[0]["extravars"]["target"] == "gpu-08"


def test_a_missing_inventory_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(cli.UsageError, match="-i /nonexistent/inv: no such inventory"):
        spec_of(["check", "-i", "/nonexistent/inv"])
    assert spec_of(["check", "-i", "gpu-01,gpu-02,"])[0]["inventory"] == ["gpu-01,gpu-02,"]
    assert cli.main(["check", "-i", "/nonexistent/inv", "--artifacts-dir", str(tmp_path)]) == 2
    assert "Nothing was run" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_extra_vars_parse_like_ansible(tmp_path):
    f = tmp_path / "vars.yml"
    f.write_text("sglang_verify_throughput: true\n")
    got = cli.parse_extra(["a=1", "b=text", "c=[1, 2]", '{"d": {"e": 1}}', "@%s" % f, "p=01:02"])
    assert got == {"a": 1, "b": "text", "c": [1, 2], "d": {"e": 1}, "sglang_verify_throughput": True,
                   "p": "01:02"}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        cli.parse_extra(["novalue"])


def test_find_project_walks_up_from_a_subdirectory_and_ignores_other_trees(tmp_path):
    assert cli.find_project(os.path.join(ROOT, "roles", "sglang_stop")) == ROOT
    # an unrelated directory: the package's own location (an editable install) still finds the checkout
    assert cli.find_project(str(tmp_path)) == ROOT


def test_bad_arguments_exit_2_naming_the_option(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["reboot"])
    assert exc.value.code == 2 and "invalid choice: 'reboot'" in capsys.readouterr().err


# -- events -> progress ---------------------------------------------------------------------------------

def test_progress_follows_phases_per_host_and_keeps_guard_failures_apart():
    clock = Clock()
    p = events.FleetProgress(clock=clock)
    p.handle(ev("runner_on_failed", "localhost", task="Check target and survey answers",
                play="Check the command line before touching any host", res={"msg": "gpufleet_serial=abc: bad"}))
    p.handle(ev("runner_on_start", "gpu-01", task="Note when the stop began (downtime starts here)", role="sglang_stop"))
    clock.t = 103.0
    p.handle(ev("runner_on_start", "gpu-01", task="Renew the restart lock (wait)"))
    p.handle(ev("runner_retry", "gpu-01", task="Wait for GPU memory", role="gpu_memory_wait",
                res={"progress": "GPU 3 holds 1200 MiB"}))
    p.handle(ev("runner_on_start", "gpu-02", task="Check every host", role="gpufleet.fleet.sglang_preflight"))
    p.handle(ev("runner_on_unreachable", "gpu-02", task="x", role="sglang_preflight",
                res={"msg": "ssh: connect to host 10.0.0.2 port 22: No route to host"}))
    clock.t = 110.0
    p.handle(ev("runner_on_failed", "gpu-01", task="Start", role="sglang_launch", res={"msg": "port 30000 busy"}))
    p.handle(ev("runner_on_failed", "gpu-01", task="Probe", role="sglang_launch", res={"msg": "ignored"},
                ignore_errors=True))
    rows = {r["host"]: r for r in p.hosts()}
    assert list(rows) == ["gpu-01", "gpu-02"]  # localhost's guard task is not a fleet host
    assert p.run_errors == ["gpufleet_serial=abc: bad"]
    assert p.changes == [("gpu-01", "stop"), ("gpu-01", "wait"), ("gpu-02", "preflight"), ("gpu-01", "launch")]
    assert rows["gpu-01"]["state"] == "failed" and rows["gpu-01"]["cause"] == "port 30000 busy"
    assert rows["gpu-01"]["elapsed_s"] == 10.0 and rows["gpu-01"]["task"] == "sglang_launch : Probe"
    assert rows["gpu-02"]["state"] == "unreachable" and "No route to host" in rows["gpu-02"]["cause"]


def test_rendering_the_new_argv_in_the_stop_phase_does_not_flip_the_host_to_launch():
    # The live progress read "stop 10.7 s / launch 10.7 s / stop 11.2 s": sglang_launch's prepare tasks run in the
    # stop phase.
    p = events.FleetProgress()
    p.handle(ev("runner_on_start", "gpu-01", task="Drain", role="sglang_stop"))
    p.handle(ev("runner_on_start", "gpu-01", task="Render argv", role="sglang_launch",
                task_path="/x/roles/sglang_launch/tasks/prepare.yml:3"))
    p.handle(ev("runner_on_start", "gpu-01", task="Validating arguments against arg spec 'prepare' - argv",
                role="sglang_launch"))
    p.handle(ev("runner_on_start", "gpu-01", task="Check the launch inputs", role="sglang_launch",
                task_path="/x/roles/sglang_launch/tasks/checks.yml:8"))
    p.handle(ev("runner_on_start", "gpu-01", task="Stop", role="sglang_stop"))
    assert p.changes == [("gpu-01", "stop")]


def test_rollback_is_a_phase_and_the_launch_record_keeps_the_verify_phase():
    p = events.FleetProgress()
    p.handle(ev("runner_on_ok", "gpu-01", task="Verify", role="sglang_verify"))
    p.handle(ev("runner_on_ok", "gpu-01", task="Write the launch record", role="sglang_launch",
                task_path="/x/roles/sglang_launch/tasks/record.yml:3"))
    p.handle(ev("runner_on_start", "gpu-01", role="sglang_launch", task_path="/x/playbooks/restart.yml:81",
                task="Validating arguments against arg spec 'record' - Write the launch record"))
    assert p.hosts()[0]["phase"] == "verify"
    p.handle(ev("runner_on_ok", "gpu-01", task="Put engine.py back", role="sglang_launch",
                task_path="/x/roles/sglang_launch/tasks/rollback.yml:9"))
    assert p.changes == [("gpu-01", "verify"), ("gpu-01", "rollback")]


def test_phases_come_from_the_phase_mark_and_the_lock_take_not_from_task_names():
    # restart.yml's own tasks carry no role: the lock take is its task file, a phase start the provisional row its
    # phase mark publishes (set_stats); a task whose name merely ends in "(verify)" moves nothing.
    p = events.FleetProgress()
    p.handle(ev("runner_on_start", "gpu-01", task="Take the restart lock",
                task_path="/c/ansible_collections/gpufleet/fleet/playbooks/tasks/restart_lock_take.yml:12"))
    mark = {"ansible_stats": {"data": {"gpufleet_restart": {"gpu-01": {"phase": "patch", "result": "unreachable"}}},
                              "per_host": False, "aggregate": True}, "changed": False}
    p.handle(ev("runner_on_start", "gpu-01", task="Publish what this host may be doing if the connection is lost "
                "(patch)", task_path="/r/playbooks/tasks/restart_phase.yml:9"))
    assert p.changes == [("gpu-01", "lock")]
    p.handle(ev("runner_on_ok", "gpu-01", task="Publish what this host may be doing if the connection is lost "
                "(patch)", task_path="/r/playbooks/tasks/restart_phase.yml:9", res=mark))
    p.handle(ev("runner_on_start", "gpu-01", task="Renew the restart lock (verify)",
                task_path="/r/playbooks/tasks/restart_lock_renew.yml:8"))
    # another host's row in the same stats is not this host's phase
    p.handle(ev("runner_on_ok", "gpu-02", task="Publish", task_path="/r/playbooks/tasks/restart_phase.yml:9",
                res=mark))
    assert p.changes == [("gpu-01", "lock"), ("gpu-01", "patch")]
    assert p.hosts()[1]["phase"] is None


def test_without_the_collection_the_cli_refuses_naming_where_it_looked(tmp_path, monkeypatch, capsys):
    from gpufleet_cli import core
    monkeypatch.setattr(core, "PACKAGE", "ansible_collections.gpufleet.nowhere.plugins.plugin_utils")
    with pytest.raises(core.CoreMissing, match="not installed where Ansible looks for collections \\(%s\\)"
                       % str(tmp_path)):
        core.load("run", environ={"ANSIBLE_COLLECTIONS_PATH": str(tmp_path)})
    monkeypatch.setattr(core, "collection_roots", lambda project=None, environ=None: [str(tmp_path)])
    assert cli.main(["check", "--artifacts-dir", str(tmp_path / "art")]) == 2
    err = capsys.readouterr().err
    assert "gpufleet.fleet collection is not installed" in err and "Nothing was run" in err
    assert not (tmp_path / "art").exists()


def test_retry_progress_shows_in_the_task_column():
    p = events.FleetProgress()
    p.handle(ev("runner_retry", "gpu-01", task="Wait for GPU memory", role="gpu_memory_wait",
                res={"progress": "GPU 3 holds 1200 MiB"}))
    assert p.hosts()[0]["task"] == "gpu_memory_wait : Wait for GPU memory — GPU 3 holds 1200 MiB"


# -- report ---------------------------------------------------------------------------------------------

def _stats(artifact_data=None, failures=None):
    return ev("playbook_on_stats", None, ok={"gpu-01": 5}, failures=failures or {}, dark={}, changed={},
              artifact_data=artifact_data or {})


def test_restart_report_takes_the_published_rows_and_fails_on_a_rolled_back_host():
    p = events.FleetProgress()
    for h in ("gpu-01", "gpu-02"):
        p.handle(ev("runner_on_ok", h, task="x", role="sglang_verify"))
    rows = {"gpu-01": {"result": "ok", "downtime_s": 11.2, "new_pid": 42},
            "gpu-02": {"result": "rolled_back", "phase": "verify", "cause": "NCCL_PROTO missing in TP3",
                       "advice": "fix sglang_nccl_env, then rerun"}}
    p.handle(_stats({"gpufleet_restart": rows}))
    report = events.build_report("restart", p, "failed", 2, "/a")
    assert report["hosts"]["gpu-01"]["downtime_s"] == 11.2 and report["failed_hosts"] == ["gpu-02"]
    assert report["exit_code"] == 2 and report["artifacts_dir"] == "/a"
    assert cli._why_lines(report) == ["gpu-02: verify — NCCL_PROTO missing in TP3 — fix sglang_nccl_env, then rerun"]


def test_restart_report_names_the_hosts_whose_launch_was_their_first():
    p = events.FleetProgress()
    note = "no server ran before this run (a first launch, or the host was down), so none was interrupted (downtime_s 0.0)"
    rows = {h: {"result": "ok", "downtime_s": 0.0, "new_pid": 42, "advice": note} for h in ("gpu-01", "gpu-02")}
    rows["gpu-03"] = {"result": "ok", "downtime_s": 2.5, "old_pid": 7, "new_pid": 43}
    p.handle(_stats({"gpufleet_restart": rows}))
    report = events.build_report("restart", p, "successful", 0, "/a")
    assert report["exit_code"] == 0 and cli._why_lines(report) == ["gpu-01, gpu-02: " + note]


def test_restart_report_leaves_the_advice_of_hosts_not_started_to_the_failed_hosts_line():
    p = events.FleetProgress()
    rows = {"gpu-01": {"result": "ok", "downtime_s": 2.5, "old_pid": 7, "new_pid": 43},
            "gpu-02": {"result": "failed", "phase": "launch", "cause": "exited with status 1",
                       "advice": "this host serves nothing now: fix the cause"},
            "gpu-03": {"result": "not_started", "advice": "nothing was changed on this host: rerun once gpu-02 is fixed"}}
    p.handle(_stats({"gpufleet_restart": rows}))
    report = events.build_report("restart", p, "failed", 2, "/a")
    assert cli._why_lines(report) == ["gpu-02: launch — exited with status 1 — this host serves nothing now: fix the cause"]


def test_a_cancelled_run_marks_hosts_still_running_canceled_and_fails():
    p = events.FleetProgress()
    p.handle(ev("runner_on_start", "gpu-01", task="x", role="sglang_preflight"))
    report = events.build_report("restart", p, "canceled", None, "/a")
    assert report["hosts"]["gpu-01"]["result"] == "cancelled" and report["failed_hosts"] == ["gpu-01"]
    assert report["exit_code"] == 1


def test_a_cancelled_restart_says_what_the_hosts_phase_left_behind():
    p = events.FleetProgress()
    p.handle(ev("runner_on_start", "gpu-01", task="Wait", role="gpu_memory_wait"))
    p.handle(ev("runner_on_start", "gpu-02", task="Patch", role="sglang_nccl_patch"))
    report = events.build_report("restart", p, "canceled", None, "/a")
    wait, patch = report["hosts"]["gpu-01"], report["hosts"]["gpu-02"]
    assert wait["result"] == "cancelled" and wait["phase"] == "wait"
    assert "most likely serves nothing now" in wait["cause"] and "-e target=gpu-01" in wait["cause"]
    assert "the old server still serves" in patch["cause"] and "-e target=gpu-02" in patch["cause"]


def test_a_restart_cancelled_after_the_stop_reports_the_old_pid_and_the_outage_so_far():
    # No summary row comes from a cancelled run, and the rerun finds no server (a "first launch"): the
    # cancelled run's own report is where the outage is counted.
    wall = Clock()
    wall.t = 5000.0
    p = events.FleetProgress(wall=wall)
    stopped = {"signalled": [{"pid": 4242, "signals": ["SIGTERM"], "ended": "after SIGTERM"}], "main_pid": 4242,
               "stop_ms": 1500, "start": {"started": True, "pid": 5151}}
    p.handle(ev("runner_on_ok", "gpu-01", task="Stop", role="sglang_stop", res=stopped))
    p.handle(ev("runner_on_start", "gpu-01", task="Wait", role="gpu_memory_wait"))
    # preflight's check-mode stop preview (no signal sent) is not a stop
    p.handle(ev("runner_on_ok", "gpu-02", task="Preview", role="sglang_preflight",
                res={"signalled": [{"pid": 77, "signals": []}], "main_pid": 77, "stop_ms": 0}))
    wall.t = 5030.0
    report = events.build_report("restart", p, "canceled", None, "/a")
    row = report["hosts"]["gpu-01"]
    assert row["old_pid"] == 4242 and row["new_pid"] == 5151
    assert row["downtime_s"] == 31.5 and row["still_down"] is True
    # the stop (process method) started the new server: the cancel left it running, unverified and unrecorded
    assert row["cause"].startswith("cancelled after the stop (old server pid 4242): the new server (pid 5151) was "
                                   "started but not verified and not recorded"), row["cause"]
    assert report["hosts"]["gpu-02"]["old_pid"] is None and report["hosts"]["gpu-02"]["downtime_s"] is None
    table = cli.fleet_table(report)
    downtime = [c for c in table.columns if c.header == "downtime_s"][0]
    assert list(downtime.cells)[0] == "down:31.5"


def test_a_restart_cancelled_after_the_new_server_was_ready_says_it_runs_unverified():
    wall = Clock()
    wall.t = 5000.0
    p = events.FleetProgress(wall=wall)
    p.handle(ev("runner_on_ok", "gpu-01", task="Stop", role="sglang_stop",
                res={"signalled": [{"pid": 4242, "signals": ["SIGTERM"]}], "main_pid": 4242, "stop_ms": 0}))
    wall.t = 5012.0
    p.handle(ev("runner_on_ok", "gpu-01", task="Wait until it serves", role="sglang_launch",
                res={"pid": 5151, "ready": True}))
    wall.t = 5020.0
    row = events.build_report("restart", p, "canceled", None, "/a")["hosts"]["gpu-01"]
    assert row["downtime_s"] == 12.0 and row["still_down"] is False and row["new_pid"] == 5151
    assert row["cause"].startswith("cancelled after the new server (pid 5151) answered, before verify ended: it "
                                   "serves but was not verified"), row["cause"]


def test_sigterm_cancels_the_run_as_ctrl_c_does_and_the_handler_is_put_back():
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can be set only in the main thread")
    before = signal.getsignal(signal.SIGTERM)
    cancel = threading.Event()
    restore = cli._cancel_on_signals(cancel)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            if cancel.is_set():
                break
            time.sleep(0.01)
        assert cancel.is_set()
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) == before


def test_check_report_prefers_the_report_file_then_set_stats_then_the_run(tmp_path):
    verdicts = {"gpu-01": {"verdict": "WARN", "reasons": [{"severity": "WARN", "gpu": 3, "code": "temp",
                                                           "text": "86 C"}], "gpus_ok": 8, "gpus_total": 8},
                "gpu-02": {"verdict": "CRIT", "reasons": [], "gpus_ok": 7, "gpus_total": 8}}
    p = events.FleetProgress(default_phase="check")
    p.handle(_stats({"gpufleet_check": {"gpu-01": {"verdict": "OK"}}}))
    (tmp_path / "check.json").write_text(json.dumps(verdicts))
    from_file = events.build_report("check", p, "successful", 0, "/a", str(tmp_path))
    assert from_file["hosts"]["gpu-01"]["verdict"] == "WARN" and from_file["failed_hosts"] == ["gpu-02"]
    assert from_file["exit_code"] == 1  # CRIT, even though ansible-playbook exited 0
    from_stats = events.build_report("check", p, "successful", 0, "/a", str(tmp_path / "none"))
    assert from_stats["hosts"]["gpu-01"]["verdict"] == "OK" and from_stats["exit_code"] == 0


def test_check_report_of_todays_check_playbook_reads_the_run():
    p = events.FleetProgress(default_phase="check")
    p.handle(ev("runner_on_ok", "gpu-01", task="Report the host", play="Check the GPU fleet",
                res={"msg": {"gpus": ["0:10:30", "1:10:31"], "sglang_serving": True}}))
    p.handle(ev("runner_on_ok", "gpu-02", task="Report the host", play="Check the GPU fleet",
                res={"msg": {"gpus": ["0:10:30"], "sglang_serving": False}}))
    p.handle(ev("runner_on_failed", "gpu-02", task="SGLang serves on every host", play="Check the GPU fleet",
                res={"msg": "SGLang on gpu-02 does not answer"}))
    p.handle(_stats())
    report = events.build_report("check", p, "failed", 2, "/a")
    assert report["hosts"]["gpu-01"] == {"host": "gpu-01", "verdict": "OK", "gpus_ok": 2, "gpus_total": 2,
                                         "reasons": []}
    assert report["hosts"]["gpu-02"]["verdict"] == "CRIT"
    assert report["hosts"]["gpu-02"]["reasons"][0]["text"] == "SGLang on gpu-02 does not answer"
    assert report["exit_code"] == 2


def test_a_refused_command_line_fails_the_run_even_without_hosts():
    p = events.FleetProgress()
    p.handle(ev("runner_on_failed", "localhost", play="Check the command line before touching any host",
                res={"msg": "no host matches target=gpu-99"}))
    report = events.build_report("patch", p, "failed", 0, "/a")
    assert report["hosts"] == {} and report["exit_code"] == 1
    assert cli._why_lines(report) == ["run refused: no host matches target=gpu-99"]


def test_fleet_table_renders_each_command():
    from rich.console import Console
    p = events.FleetProgress()
    p.handle(_stats({"gpufleet_restart": {"gpu-01": {"result": "ok", "downtime_s": 11.25,
                                                     "release_wait_ms": 310, "nccl": "ok"}}}))
    console = Console(file=io.StringIO(), width=120)
    console.print(cli.fleet_table(events.build_report("restart", p, "successful", 0, "/a")))
    text = console.file.getvalue()
    assert "downtime_s" in text and "11.2" in text and "310" in text and "gpu-01" in text


def test_console_entry_point_answers_help():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    proc = subprocess.run([sys.executable, "-m", "gpufleet_cli", "restart", "--help"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0
    for option in ("--inventory", "--limit", "--serial", "--check", "--json"):
        assert option in proc.stdout


def test_extra_vars_reach_ansible_playbook_through_a_0600_file_not_its_argv(tmp_path):
    """A secret given with -e is in env/extravars (0600, dir 0700) and absent from ansible-playbook's argv."""
    from ansible_runner.config.runner import RunnerConfig

    secret = "sk-gpufleet-test-7731"
    spec, run_dir, _ = spec_of(["restart", "-i", "inventory/example", "-e", "sglang_api_key=" + secret,
                                "--artifacts-dir", str(tmp_path)])
    path = cli.write_extravars(run_dir, spec.pop("extravars"))
    assert path == os.path.join(run_dir, "env", "extravars")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    with open(path) as fh:
        assert json.load(fh) == {"sglang_api_key": secret}
    config = RunnerConfig(**{k: v for k, v in spec.items() if k not in ("quiet",)})
    config.prepare()
    argv = config.command
    assert "@" + path in argv and argv[argv.index("@" + path) - 1] == "-e"
    assert not any(secret in a for a in argv)


def test_the_count_line_says_a_refused_run_changed_nothing():
    # "FAILED: 4 host(s), 4 failed" for a run the guard refused before touching any host.
    report = {"command": "restart", "hosts": {h: {"result": "not_reached"} for h in ("a", "b", "c", "d")},
              "failed_hosts": ["a", "b", "c", "d"]}
    assert cli.count_line(report) == "4 host(s): 4 not_reached (untouched)"
    report["hosts"].update(a={"result": "ok"}, b={"result": "rolled_back"})
    assert cli.count_line(report) == "4 host(s): 1 ok, 1 rolled_back, 2 not_reached (untouched)"
    check = {"command": "check", "hosts": {"a": {"verdict": "OK"}, "b": {"verdict": "CRIT"}}, "failed_hosts": ["b"]}
    assert cli.count_line(check) == "2 host(s): 1 OK, 1 CRIT"
    assert cli.count_line({"command": "patch", "hosts": {"a": {}}, "failed_hosts": []}) == "1 host(s), 0 failed"


# -- cancels (issue 30, item 6): the playbook gets SIGTERM and prints its summary; the last line says CANCELLED ----

def test_the_playbooks_pid_is_taken_from_its_events():
    p = events.FleetProgress()
    p.handle({"event": "playbook_on_start", "pid": 4711, "event_data": {}})
    p.handle(dict(ev("runner_on_start", "gpu-01"), pid=9999))
    assert p.playbook_pid == 4711


def test_a_cancel_sends_sigterm_first_and_kills_only_when_needed():
    cancel = cli.CancelRequest()
    assert cli.cancel_step(cancel, None, 10.0, 4711) == (None, None)
    cancel.request()
    assert cli.cancel_step(cancel, None, 10.0, 4711) == ("term", 10.0)
    assert cli.cancel_step(cancel, 10.0, 20.0, 4711) == (None, 10.0)  # the playbook stops and prints its summary
    assert cli.cancel_step(cancel, 10.0, 10.0 + cli.PLAYBOOK_CANCEL_GRACE_S + 1, 4711) == ("kill", 10.0)
    cancel.request()  # Ctrl-C or SIGTERM again: kill at once
    assert cli.cancel_step(cancel, 10.0, 11.0, 4711) == ("kill", 10.0)
    # no event yet: no task ran, ansible-runner kills it
    early = cli.CancelRequest()
    early.request()
    assert cli.cancel_step(early, None, 3.0, None) == ("kill", 3.0)


def test_the_last_line_of_a_cancelled_run_says_cancelled_not_failed_beside_ok_hosts():
    p = events.FleetProgress()
    p.handle(ev("runner_on_start", "gpu-01", role="gpu_memory_wait"))
    report = events.build_report("restart", p, "canceled", 99, "/a")
    assert cli.verdict(report) == "CANCELLED" and cli.count_line(report) == "1 host(s): 1 cancelled"
    finished = {"status": "successful", "exit_code": 0, "hosts": {}}
    assert cli.verdict(finished) == "ok"
    assert cli.verdict({"status": "failed", "exit_code": 2, "hosts": {}}) == "FAILED"


def test_the_cancel_message_says_what_happens_to_the_playbook():
    import io
    from rich.console import Console
    buf = io.StringIO()
    cli._say_cancelling(Console(file=buf, width=400), 4711)
    text = buf.getvalue()
    assert "ansible-playbook (pid 4711) got SIGTERM" in text and "prints its summary" in text
    assert "ansible-runner stops the playbook now" not in text
    buf = io.StringIO()
    cli._say_cancelling(Console(file=buf, width=400), None)
    assert "has not started a task yet" in buf.getvalue() and "nothing was changed" in buf.getvalue()


def test_a_key_given_inline_is_named_for_a_warning_and_a_file_or_an_empty_key_is_not(tmp_path):
    f = tmp_path / "key.yml"
    f.write_text("sglang_api_key: sk-file\n")
    assert cli.secrets_on_command_line(["sglang_api_key=sk-1", '{"gpufleet_router_api_key": "sk-2", "a": 1}',
                                        "@%s" % f, "sglang_port=30000"]) == ["gpufleet_router_api_key",
                                                                            "sglang_api_key"]
    assert cli.secrets_on_command_line(["@%s" % f, "sglang_api_key=", "{not yaml: [", "novalue"]) == []


def test_main_warns_on_stderr_when_a_key_is_on_its_command_line_without_echoing_it(tmp_path, capsys):
    assert cli.main(["check", "-i", "/nonexistent/inv", "--artifacts-dir", str(tmp_path),
                     "-e", "sglang_api_key=sk-visible-in-ps"]) == 2
    err = capsys.readouterr().err
    assert "WARNING: sglang_api_key given inline with -e" in err and "-e @FILE" in err
    assert "sk-visible-in-ps" not in err


# -- issue 33: Ansible's own errors, one artifacts path, labelled phase times, grouped check reasons ------------

def verbose(line):
    """A line ansible-playbook printed outside any task, as ansible-runner hands it over."""
    return {"event": "verbose", "stdout": line, "event_data": {}}


def test_a_limit_that_matches_no_host_reports_ansibles_own_message_in_run_errors():
    # `gpufleet check --limit nosuchhost` printed only "FAILED: 0 host(s)" and --json gave run_errors: [] while
    # ansible-playbook's error sat in the artifacts' stdout (these two lines, as recorded in the lab)
    p = events.FleetProgress()
    p.handle(verbose("[WARNING]: Could not match supplied host pattern, ignoring: nosuchhost"))
    p.handle(verbose("[ERROR]: Specified inventory, host pattern and/or --limit leaves us with no hosts to target."))
    report = events.build_report("check", p, "failed", 1, "/a")
    assert report["run_errors"] == [
        "[WARNING]: Could not match supplied host pattern, ignoring: nosuchhost",
        "[ERROR]: Specified inventory, host pattern and/or --limit leaves us with no hosts to target."]
    assert report["exit_code"] == 1 and report["hosts"] == {}
    # said as Ansible said it, not as a refusal of gpufleet's own checks
    assert cli._why_lines(report) == report["run_errors"]


def test_ansibles_warnings_alone_are_no_run_error_and_an_error_keeps_its_following_lines():
    p = events.FleetProgress()
    p.handle(verbose("[WARNING]: Collection community.general does not support Ansible version 2.17.7"))
    p.handle(ev("runner_on_ok", "gpu-01", task="x", role="sglang_preflight"))
    report = events.build_report("patch", p, "successful", 0, "/a")
    assert report["run_errors"] == [] and report["exit_code"] == 0
    assert report["warnings"] == ["[WARNING]: Collection community.general does not support Ansible version 2.17.7"]
    p = events.FleetProgress()
    for line in ("ERROR! couldn't resolve module/action 'nvidia_gpu_infoo'.", "", "The error appears to be in "
                 "'/p/check.yml': line 3, column 7", "[WARNING]: later"):
        p.handle(verbose(line))
    p2 = events.FleetProgress()
    for line in ("[ERROR]: couldn't resolve module/action 'nvidia_gpu_infoo'.", "Origin: /p/check.yml:3:7",
                 "", "3       - nvidia_gpu_infoo:"):
        p2.handle(verbose(line))
    assert p.ansible_errors == ["ERROR! couldn't resolve module/action 'nvidia_gpu_infoo'."]
    assert p2.ansible_errors == ["[ERROR]: couldn't resolve module/action 'nvidia_gpu_infoo'. Origin: /p/check.yml:3:7"]
    assert events.build_report("check", p2, "failed", 4, "/a")["run_errors"] == p2.ansible_errors


def test_the_runs_artifacts_are_in_its_own_directory_not_one_below_it(tmp_path):
    from ansible_runner.config.runner import RunnerConfig
    spec, run_dir, report_dir = spec_of(["check", "-i", "inventory/example", "--artifacts-dir", str(tmp_path)])
    spec.pop("extravars")
    config = RunnerConfig(**{k: v for k, v in spec.items() if k not in ("quiet",)})
    config.prepare()
    # was <run>/artifacts/<run>
    assert config.artifact_dir == run_dir and os.path.dirname(report_dir) == run_dir
    assert os.listdir(str(tmp_path)) == [os.path.basename(run_dir)]


def test_each_phase_line_says_when_it_began_since_the_run_and_how_long_the_phase_before_took():
    clock = Clock()
    p = events.FleetProgress(clock=clock)
    clock.t = 101.0
    p.handle(ev("runner_on_start", "gpu-01", task="Check", role="sglang_preflight"))
    clock.t = 112.3
    p.handle(ev("runner_on_start", "gpu-01", task="Drain", role="sglang_stop"))
    clock.t = 115.4
    p.handle(ev("runner_on_start", "gpu-01", task="Wait", role="gpu_memory_wait"))
    assert [(e["phase"], e["began_s"], e["previous"], e["previous_s"]) for e in p.phase_log] == [
        ("preflight", 1.0, None, None), ("stop", 12.3, "preflight", 11.3), ("wait", 15.4, "stop", 3.1)]
    assert cli.phase_line(p.phase_log[2]) == "  gpu-01               wait           +15.4 s  stop 3.1 s"
    assert cli.phase_line(p.phase_log[0]).endswith("+1.0 s  -")
    header = cli.PHASE_HEADER
    assert header.split() == ["host", "phase", "since", "start", "phase", "before"]
    # the columns line up under their heads
    assert header.index("since start") + len("since start") == cli.phase_line(p.phase_log[2]).index(" s  stop") + 2
    clock.t = 120.0
    row = p.hosts()[0]
    assert row["in_phase_s"] == 4.6 and row["elapsed_s"] == 19.0


def test_the_phase_lines_are_printed_once_under_one_header():
    from rich.console import Console
    clock = Clock()
    p = events.FleetProgress(clock=clock)
    err = Console(file=io.StringIO(), width=200)
    shown = {"n": 0}
    p.handle(ev("runner_on_start", "gpu-01", task="Check", role="sglang_preflight"))
    cli._print_phase_lines(err, p, shown)
    p.handle(ev("runner_on_start", "gpu-01", task="Drain", role="sglang_stop"))
    cli._print_phase_lines(err, p, shown)
    cli._print_phase_lines(err, p, shown)
    lines = err.file.getvalue().splitlines()
    assert lines[0] == cli.PHASE_HEADER and len(lines) == 3
    assert lines[1].split()[:2] == ["gpu-01", "preflight"] and lines[2].split()[:2] == ["gpu-01", "stop"]


def test_the_check_table_says_a_reason_shared_by_gpus_once_with_their_range():
    from rich.console import Console
    p = events.FleetProgress()
    reasons = [{"severity": "WARN", "gpu": i, "code": "gpu_temperature", "text": "GPU temperature 87 C >= 85 C"}
               for i in range(8)]
    p.handle(_stats({"gpufleet_check": {"gpu-01": {"verdict": "WARN", "reasons": reasons, "gpus_ok": 0,
                                                   "gpus_total": 8}}}))
    report = events.build_report("check", p, "successful", 0, "/a")
    assert len(report["hosts"]["gpu-01"]["reasons"]) == 8  # the report keeps them per GPU
    console = Console(file=io.StringIO(), width=200)
    console.print(cli.fleet_table(report))
    text = console.file.getvalue()
    assert text.count("GPU temperature 87 C") == 1 and "WARN GPU 0\u20137: GPU temperature 87 C >= 85 C" in text


def _mark(host, phase, role):
    """restart.yml's phase mark (tasks/restart_phase.yml) as its ok event came in the lab: with a stale role."""
    row = {"host": host, "result": "unreachable", "phase": phase, "cause": "connection lost during %s" % phase}
    return ev("runner_on_ok", host, task="Publish what this host may be doing if the connection is lost (%s)" % phase,
              role=role, task_path="/p/playbooks/tasks/restart_phase.yml:10",
              res={"ansible_stats": {"data": {"gpufleet_restart": {host: row}}}})


def test_the_phase_lines_follow_the_phase_marks_not_a_stale_role_nor_a_skipped_task():
    # a 3-host batch printed "patch, launch, stop, wait, launch, wait, launch" for gpu-lab-01: the mark of the stop
    # came with role sglang_launch, a skipped include_role of the stop phase with role sglang_launch
    p = events.FleetProgress()
    p.handle(_mark("gpu-01", "patch", None))
    p.handle(_mark("gpu-01", "stop", "sglang_launch"))
    p.handle(ev("runner_on_skipped", "gpu-01", task="Take the host out of the router's pool", role="sglang_launch",
                task_path="/p/playbooks/restart.yml:267"))
    p.handle(ev("runner_on_start", "gpu-01", task="Drain", role="sglang_stop"))
    p.handle(_mark("gpu-01", "wait", "sglang_stop"))
    p.handle(ev("runner_on_skipped", "gpu-01", task="Renew the restart lock (launch)", role="gpu_memory_wait",
                task_path="/p/playbooks/tasks/restart_lock_renew.yml:8"))
    p.handle(_mark("gpu-01", "launch", "gpu_memory_wait"))
    p.handle(ev("runner_on_start", "gpu-01", task="Launch", role="sglang_launch",
                task_path="/p/roles/sglang_launch/tasks/main.yml:11"))
    assert [phase for _, phase in p.changes] == ["patch", "stop", "wait", "launch"]


def test_the_live_table_labels_time_in_phase_and_the_hosts_total():
    from rich.console import Console
    clock = Clock()
    p = events.FleetProgress(clock=clock)
    p.handle(ev("runner_on_start", "gpu-01", task="Drain", role="sglang_stop"))
    clock.t = 130.0
    p.handle(ev("runner_on_start", "gpu-01", task="Wait", role="gpu_memory_wait"))
    clock.t = 172.0
    console = Console(file=io.StringIO(), width=200)
    console.print(cli._progress_table(p, 0))
    head, row = console.file.getvalue().splitlines()[:2]
    assert head.split() == ["host", "phase", "in", "phase", "host", "total", "state", "task"]
    assert row.split()[:6] == ["gpu-01", "wait", "42", "s", "72", "s"]


# -- history and tune (issue 34) ------------------------------------------------------------------------

def test_history_targets_the_host_and_passes_last():
    spec, _, _ = spec_of(["history", "gpu-07", "--last", "5"])
    assert spec["playbook"].endswith(os.path.join("playbooks", "history.yml"))
    assert spec["extravars"]["target"] == "gpu-07" and spec["extravars"]["gpufleet_history_last"] == 5
    assert "gpufleet_history_last" not in spec_of(["history", "gpu-07"])[0]["extravars"]


def test_tune_reads_the_candidates_file_and_maps_its_options(tmp_path):
    cands = tmp_path / "candidates.yml"
    cands.write_text("gpufleet_tune_candidates:\n  - name: cand-a\n    sglang_nccl_env: {NCCL_PROTO: LL}\n"
                     "  - name: steps2\n    sglang_launch_args: {speculative-num-steps: 2}\n")
    spec, _, _ = spec_of(["tune", "gpu-01", "-c", str(cands), "--repeats", "2", "--report", "r.json",
                          "--profile", "fast"])
    ev_ = spec["extravars"]
    assert spec["playbook"].endswith(os.path.join("playbooks", "tune.yml")) and ev_["target"] == "gpu-01"
    assert [c["name"] for c in ev_["gpufleet_tune_candidates"]] == ["cand-a", "steps2"]
    assert ev_["gpufleet_tune_repeats"] == 2 and ev_["gpufleet_tune_profile"] == "fast"
    assert ev_["gpufleet_tune_report"] == os.path.abspath("r.json")
    assert "gpufleet_tune_repeats" not in spec_of(["tune", "gpu-01", "-c", str(cands)])[0]["extravars"]


def test_tune_refuses_a_bad_candidates_file_before_anything_runs(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("gpufleet_tune_candidates:\n  - name: baseline\n")
    with pytest.raises(cli.UsageError, match="bad.yml"):
        spec_of(["tune", "gpu-01", "-c", str(bad)])
    (tmp_path / "none.yml").write_text("other: 1\n")
    with pytest.raises(cli.UsageError, match="must hold gpufleet_tune_candidates"):
        spec_of(["tune", "gpu-01", "-c", str(tmp_path / "none.yml")])
    with pytest.raises(cli.UsageError, match="missing.yml"):
        spec_of(["tune", "gpu-01", "-c", str(tmp_path / "missing.yml")])


def test_tune_needs_a_host_and_a_candidates_file(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["tune", "gpu-01"])
    assert "-c/--candidates" in capsys.readouterr().err


def test_the_history_table_comes_from_the_published_entries():
    data = {"gpufleet_history": {"gpu-02": [{"time": "2026-12-05T11:00:00Z", "run_id": "r2", "playbook": "restart",
                                             "nccl_env": {"NCCL_PROTO": "LL"}, "sglang_version": "0.5.23"}],
                                 "gpu-01": [{"time": "2026-12-05T10:00:00Z", "run_id": "r1", "playbook": "tune",
                                             "candidate": "cand-a", "figures": {"single_stream_tok_s": 94.0}}]}}
    lines = cli.command_table("history", data, ROOT).splitlines()
    assert len(lines) == 3 and "gpu-01" in lines[1] and "cand-a" in lines[1] and "94.0 tok/s 1x" in lines[1]
    assert "gpu-02" in lines[2] and "PROTO=LL" in lines[2] and "0.5.23" in lines[2]
    assert cli.command_table("history", {}, ROOT) is None


def test_the_tune_table_is_the_cores_or_a_fallback_with_the_same_numbers(monkeypatch):
    report = {"baseline": "baseline", "winner": "cand-a", "metric": "single_stream_tok_s", "reason": "r",
              "candidates": [{"name": "baseline", "ok": True,
                              "single_stream_tok_s": {"median": 82.5, "min": 82.0, "max": 83.0, "runs": []}},
                             {"name": "cand-a", "ok": False, "note": "verify failed",
                              "single_stream_tok_s": {"median": None, "min": None, "max": None, "runs": []}}]}
    fallback = cli.tune_fallback_table(report)
    assert fallback.splitlines()[0].startswith("winner: cand-a (baseline: baseline)")
    assert "82.5 (min 82.0, max 83.0)" in fallback and "not ok: verify failed" in fallback
    from gpufleet_cli import core
    tune = core.load("tune", project=ROOT)
    monkeypatch.delattr(tune, "table", raising=False)
    assert cli.command_table("tune", {"gpufleet_tune": report}, ROOT) == fallback
    monkeypatch.setattr(tune, "table", lambda r: "core table of " + r["winner"], raising=False)
    assert cli.command_table("tune", {"gpufleet_tune": report}, ROOT) == "core table of cand-a"


def test_the_tune_table_printed_is_the_cores_own_for_the_published_report():
    from gpufleet_cli import core
    tune = core.load("tune", project=ROOT)
    none = tune.summarize([])
    report = {"baseline": "baseline", "winner": "cand-a", "metric": "single_stream_tok_s", "reason": "r",
              "candidates": [dict(name=name, ok=True, note="", sglang_nccl_env={}, sglang_launch_args={},
                                  single_stream_tok_s=tune.summarize(runs), throughput_tok_s=none, ttft_ms=none,
                                  itl_ms=none)
                             for name, runs in (("baseline", [82.0, 82.5, 83.0]), ("cand-a", [93.0, 94.0, 95.0]))]}
    text = cli.command_table("tune", {"gpufleet_tune": report}, ROOT)
    assert text == tune.table(report) and "94.0 (93.0-95.0)" in text and "cand-a" in text


def test_tune_checks_the_candidates_structure_and_leaves_nccl_values_to_the_play(tmp_path):
    # A value tune.yml accepts when the canary's inventory lists the variable in sglang_nccl_env_unchecked: the CLI
    # does not read the inventory, so it does not judge values (play 1 does, with the inventory's list).
    cands = tmp_path / "candidates.yml"
    cands.write_text("gpufleet_tune_candidates:\n  - name: proto\n    sglang_nccl_env: {NCCL_PROTO: LL128x}\n")
    spec, _, _ = spec_of(["tune", "gpu-01", "-c", str(cands)])
    assert spec["extravars"]["gpufleet_tune_candidates"][0]["sglang_nccl_env"] == {"NCCL_PROTO": "LL128x"}
    # Structure is still refused: a value type no environment holds, a bad variable name, a reserved flag.
    for body, words in (("sglang_nccl_env: {NCCL_PROTO: [LL]}", "NCCL_PROTO: value"),
                        ("sglang_nccl_env: {'1BAD': x}", "not a valid environment variable name"),
                        ("sglang_launch_args: {api-ke: SECRET}", "must not set api-ke")):
        cands.write_text("gpufleet_tune_candidates:\n  - name: c1\n    %s\n" % body)
        with pytest.raises(cli.UsageError, match=words):
            spec_of(["tune", "gpu-01", "-c", str(cands)])


def _tune_events(failures, rescued):
    p = events.FleetProgress()
    play = "Tune the canary"
    p.handle(ev("runner_on_ok", "gpu-01", task="Restart to candidate cand-a", play=play))
    p.handle(ev("runner_on_failed", "gpu-01", task="Verify", role="sglang_verify", play=play,
                res={"msg": "cand-a: verify failed, rolled back"}))
    p.handle(ev("runner_on_ok", "gpu-01", task="Measure baseline", play=play))
    p.handle(ev("playbook_on_stats", None, ok={"gpu-01": 9}, failures=failures, dark={}, changed={},
                rescued=rescued, artifact_data={}))
    return p


def test_tune_report_takes_the_hosts_result_from_the_final_stats():
    # A tune round that failed was rescued (it shows in the tune table as ok: false): the run did its job.
    for command in ("tune", "history"):
        report = events.build_report(command, _tune_events({}, {"gpu-01": 1}), "successful", 0, "/a")
        row = report["hosts"]["gpu-01"]
        assert report["failed_hosts"] == [] and report["exit_code"] == 0
        assert row["result"] == "ok" and row["cause"] is None and row["rescued"] == 1
        assert row["rescued_cause"] == "cand-a: verify failed, rolled back"
    # A failure Ansible counts (failures 1) stays a failed host.
    report = events.build_report("tune", _tune_events({"gpu-01": 1}, {}), "failed", 2, "/a")
    assert report["failed_hosts"] == ["gpu-01"] and report["exit_code"] == 2
    assert report["hosts"]["gpu-01"]["cause"] == "cand-a: verify failed, rolled back"
    # Even with rc 0 (the stats decide, not the exit code).
    report = events.build_report("tune", _tune_events({"gpu-01": 1}, {}), "successful", 0, "/a")
    assert report["failed_hosts"] == ["gpu-01"] and report["exit_code"] == 1
    # Other commands keep judging by the failed event.
    report = events.build_report("patch", _tune_events({}, {"gpu-01": 1}), "successful", 0, "/a")
    assert report["failed_hosts"] == ["gpu-01"] and report["exit_code"] == 1
