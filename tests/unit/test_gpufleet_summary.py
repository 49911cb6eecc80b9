"""plugins/callback/gpufleet_summary.py: rows for every targeted host, the printed summary, progress lines,
and silence under machine-readable stdout callbacks."""
import multiprocessing
import pathlib
import time

import pytest

from ansible_collections.gpufleet.fleet.plugins.callback import gpufleet_summary as cb

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_playbooks_callback_dir_loads_this_file():
    link = ROOT / "playbooks" / "callback_plugins" / "gpufleet_summary.py"
    assert link.resolve() == (ROOT / "plugins" / "callback" / "gpufleet_summary.py").resolve()


@pytest.mark.parametrize("name,human", [
    ("default", True), ("ansible.builtin.default", True), ("minimal", True), ("community.general.yaml", True),
    ("json", False), ("ansible.posix.json", False), ("ansible.posix.jsonl", False), ("junit", False),
    ("tree", False), ("someone.else.custom", False),
])
def test_prints_only_under_human_stdout_callbacks(name, human):
    assert cb.is_human_stdout(name) is human


class FakeConfig:
    def __init__(self, value):
        self.value = value

    def get_config_value(self, name):
        assert name == "DEFAULT_STDOUT_CALLBACK"
        return self.value


class FakeC:
    def __init__(self, value):
        self.config = FakeConfig(value)


def test_under_ansible_runner_the_wrapped_callback_decides(monkeypatch):
    monkeypatch.setattr(cb, "C", FakeC("awx_display"))
    assert cb.stdout_callback_name({}) == "default"
    assert cb.stdout_callback_name({"ORIGINAL_STDOUT_CALLBACK": "ansible.posix.json"}) == "ansible.posix.json"
    monkeypatch.setattr(cb, "C", FakeC("ansible.posix.jsonl"))
    assert cb.stdout_callback_name({}) == "ansible.posix.jsonl"


def test_preflight_refusal_gives_every_target_a_row():
    rows = {"h2": {"host": "h2", "result": "refused", "phase": "preflight", "cause": "port 30000 held by pid 5"},
            "h1": {"host": "h1", "result": "not_started"}, "h3": {"host": "h3", "result": "not_started"}}
    out = cb.build_rows(["h1", "h2", "h3"], rows, {}, {}, {"h2": ("preflight", "Stop here", "...")})
    assert [r["host"] for r in out] == ["h1", "h2", "h3"]
    assert [r["result"] for r in out] == ["not_started", "refused", "not_started"]


def test_unreachable_host_keeps_the_provisional_row_of_its_phase():
    rows = {"h1": {"host": "h1", "result": "unreachable", "phase": "launch", "cause": "connection lost during launch",
                   "advice": "ssh lost during launch: the server may have come up; run playbooks/check.yml"}}
    [row] = cb.build_rows(["h1"], rows, {}, {"h1": ("launch", "Failed to connect")}, {})
    assert row["result"] == "unreachable" and row["phase"] == "launch" and "may have come up" in row["advice"]


def test_unreachable_before_any_row_names_phase_and_what_to_do():
    [row, later] = cb.build_rows(["h1", "h2"], {}, {}, {"h1": ("wait", "ssh: connect timed out")}, {})
    assert row["result"] == "unreachable" and row["phase"] == "wait" and row["cause"] == "ssh: connect timed out"
    assert "old server is stopped" in row["advice"] and "playbooks/check.yml" in row["advice"]
    assert later["result"] == "not_started"


def test_final_row_wins_over_a_provisional_one():
    rows = {"h1": {"host": "h1", "result": "ok", "downtime_s": 9.0}}
    [row] = cb.build_rows(["h1"], rows, {}, {}, {})
    assert row["result"] == "ok"


def test_hosts_without_any_event_are_not_reached_when_nothing_failed():
    [row] = cb.build_rows(["h1"], {}, {}, {}, {})
    assert row["result"] == "not_reached"


def test_failures_outside_the_targets_are_not_rows():
    out = cb.build_rows(["h1"], {"h1": {"host": "h1", "result": "ok"}}, {}, {}, {"h9": ("preflight", "t", "m")})
    assert [r["host"] for r in out] == ["h1"]


def test_render_shows_down_and_a_note_per_host_that_is_not_ok():
    table = cb.gpufleet_summary_table
    text = cb.render([
        {"host": "h1", "result": "ok", "downtime_s": 9.04, "nccl": "ok", "new_pid": 40},
        {"host": "h2", "result": "failed", "phase": "wait", "cause": "GPU 3 holds 30000 MiB", "downtime_s": 42.0,
         "still_down": True, "rollback": "failed: relaunch failed", "advice": "fix it, then rerun"},
        {"host": "h3", "result": "not_started", "cause": "the rolling restart stopped at h2 (failed)"},
    ], table)
    lines = text.splitlines()
    assert lines[0].split() == ["host", "result", "downtime_s", "release_wait_ms", "prefetch", "tokens_per_s",
                                "nccl", "old_pid", "new_pid"]
    assert lines[1].split()[:3] == ["h1", "ok", "9.0"] and lines[1].split()[-1] == "40"
    assert lines[2].split()[:3] == ["h2", "failed", "down:42.0"]
    assert "h2: failed in wait: GPU 3 holds 30000 MiB" in lines
    assert "    rollback: failed: relaunch failed" in lines and "    next: fix it, then rerun" in lines
    assert "h3: not_started: the rolling restart stopped at h2 (failed)" in lines


def test_render_names_the_hosts_of_a_first_launch_in_one_line():
    note = "no server ran before this run (a first launch, or the host was down), so none was interrupted (downtime_s 0.0)"
    text = cb.render([
        {"host": "h1", "result": "ok", "downtime_s": 0.0, "new_pid": 40, "advice": note},
        {"host": "h2", "result": "ok", "downtime_s": 0.0, "new_pid": 41, "advice": note},
        {"host": "h3", "result": "ok", "downtime_s": 2.5, "old_pid": 9, "new_pid": 42},
    ], cb.gpufleet_summary_table)
    assert text.splitlines()[4:] == ["h1, h2: ok: " + note]


def test_render_says_a_cause_shared_by_many_hosts_once_with_the_hosts_it_concerns():
    # A guard failure or a fleet-wide refusal gave 64 copies of the same lines, one per host.
    hosts = ["gpu-lab-%02d" % i for i in range(1, 65)]
    rows = [{"host": h, "result": "refused", "phase": "preflight", "cause": "NCCL_BUFFSIZE=4M is not a number",
             "advice": "fix it, then rerun playbooks/restart.yml -e target=%s" % h} for h in hosts[:63]]
    # gpu-lab-64 differs (a lock) and gpu-lab-6 names gpu-lab-60 in its cause: a longer name is not its own.
    rows[5]["cause"] = "port held by gpu-lab-60's job"
    rows.append({"host": hosts[63], "result": "refused", "phase": "lock", "cause": "locked by run 7",
                 "advice": "wait for run 7"})
    rows.append({"host": "h-ok", "result": "ok", "downtime_s": 0.0, "advice": "launched but not verified: "
                 "playbooks/restart.yml -e target=h-ok --tags verify"})
    rows.append({"host": "h-ok2", "result": "ok", "downtime_s": 0.0, "advice": "launched but not verified: "
                 "playbooks/restart.yml -e target=h-ok2 --tags verify"})
    text = cb.render(rows, cb.gpufleet_summary_table)
    notes = text.splitlines()[len(rows) + 1:]
    assert notes == [
        "h-ok, h-ok2: ok: launched but not verified: playbooks/restart.yml -e target=<host> --tags verify",
        "gpu-lab-01, gpu-lab-02, gpu-lab-03, ..., gpu-lab-63 (62 hosts): refused in preflight: "
        "NCCL_BUFFSIZE=4M is not a number",
        "    next: fix it, then rerun playbooks/restart.yml -e target=<host>",
        "gpu-lab-06: refused in preflight: port held by gpu-lab-60's job",
        "    next: fix it, then rerun playbooks/restart.yml -e target=gpu-lab-06",
        "gpu-lab-64: refused in lock: locked by run 7",
        "    next: wait for run 7",
    ], notes
    # The table still has a row for every host.
    assert len(text.splitlines()) == 1 + len(rows) + len(notes)


# -- the callback driven with fake results ------------------------------------------------------------

class FakeDisplay:
    def __init__(self):
        self.lines = []

    def display(self, text, *a, **k):
        self.lines.append(text)

    def banner(self, text, *a, **k):
        self.lines.append("BANNER " + text)


class Named:
    def __init__(self, name):
        self.name = name

    def get_name(self):
        return self.name


class FakeTask(Named):
    def __init__(self, name, role=None, path="", task_vars=None):
        super().__init__(name)
        self._role = Named(role) if role else None
        self.path = path
        self.task_vars = task_vars or {}

    def get_path(self):
        return self.path

    def get_vars(self):
        return dict(self.task_vars)


class FakeResult:
    """The public attributes of ansible-core's CallbackTaskResult (2.19+) only: the private ``_host``, ``_result``
    and ``_task`` are on their way out (tests/unit/test_callback_public_api.py)."""
    def __init__(self, host, result, task=None):
        self.host = Named(host)
        self.result = result
        self.task = task or FakeTask("t")


def make(monkeypatch, stdout="default"):
    monkeypatch.setattr(cb, "C", FakeC(stdout))
    plugin = cb.CallbackModule()
    plugin._display = FakeDisplay()
    return plugin


def test_callback_prints_every_target_and_progress_under_default(monkeypatch):
    plugin = make(monkeypatch)
    plugin.v2_playbook_on_play_start(Named("Check the command line before touching any host"))
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_facts": {"gpufleet_restart_targets": ["h1", "h2"]}}))
    plugin.v2_playbook_on_play_start(Named("Restart SGLang host by host (stop, ...)"))
    plugin.v2_runner_retry(FakeResult("h1", {"progress": "waiting for /health_generate: 20 s of 900 s, port open"}))
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_stats": {"data": {"gpufleet_restart": {
        "h1": {"host": "h1", "result": "failed", "phase": "launch", "cause": "exit code 1"}}}}}))
    plugin.v2_runner_on_failed(FakeResult("h1", {"msg": "restart failed"}, FakeTask("Fail the host")))
    plugin.v2_playbook_on_stats(None)
    text = "\n".join(plugin._display.lines)
    assert "  h1: waiting for /health_generate: 20 s of 900 s, port open" in plugin._display.lines
    assert "BANNER GPUFLEET SUMMARY" in plugin._display.lines
    assert "h1: failed in launch: exit code 1" in text
    assert "h2: not_started" in text


def test_a_progress_line_prints_once_when_the_callback_is_loaded_twice(monkeypatch):
    # Adjacent to the playbook and enabled by FQCN: two copies, and ansible-core 2.19+ hands each its own copy of
    # the result (same Task object, same host, same attempt).
    first, second = make(monkeypatch), make(monkeypatch)
    second._display = first._display
    task = FakeTask("Wait for the server")
    for attempt in (1, 2):
        for plugin in (first, second):
            plugin.v2_runner_retry(FakeResult("h1", {"progress": "%d s of 900 s" % attempt, "attempts": attempt}, task))
    assert first._display.lines == ["  h1: 1 s of 900 s", "  h1: 2 s of 900 s"]


def test_callback_is_silent_under_a_json_stdout_callback(monkeypatch):
    plugin = make(monkeypatch, "ansible.posix.json")
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_facts": {"gpufleet_restart_targets": ["h1"]}}))
    plugin.v2_runner_retry(FakeResult("h1", {"progress": "20 s of 900 s"}))
    plugin.v2_playbook_on_stats(None)
    assert plugin._display.lines == []


def test_callback_prints_nothing_for_other_playbooks(monkeypatch):
    plugin = make(monkeypatch)
    plugin.v2_playbook_on_play_start(Named("Check the GPU fleet"))
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_facts": {"x": 1}}))
    plugin.v2_runner_retry(FakeResult("h1", {"attempts": 1}))
    plugin.v2_playbook_on_stats(None)
    assert plugin._display.lines == []


def test_guard_refusal_is_printed_as_the_runs_reason(monkeypatch):
    plugin = make(monkeypatch)
    plugin.v2_playbook_on_play_start(Named("Check the command line before touching any host"))
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_facts": {"gpufleet_restart_targets": []}}))
    plugin.v2_runner_on_failed(FakeResult("h1", {"msg": "No host matches target=typo in this inventory."}))
    plugin.v2_playbook_on_stats(None)
    assert plugin._display.lines[1:] == ["no host was restarted",
                                         "refused before touching any host: No host matches target=typo in this inventory."]


def test_unreachable_phase_comes_from_the_role_of_the_task(monkeypatch):
    plugin = make(monkeypatch)
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_facts": {"gpufleet_restart_targets": ["h1"]}}))
    plugin.v2_playbook_on_play_start(Named("Restart SGLang host by host"))
    plugin.v2_runner_on_unreachable(FakeResult("h1", {"msg": "ssh: Connection reset"},
                                               FakeTask("Start the server", role="sglang_launch")))
    plugin.v2_playbook_on_stats(None)
    text = "\n".join(plugin._display.lines)
    assert "h1: unreachable in launch: ssh: Connection reset" in text and "may have come up" in text


@pytest.mark.parametrize("task,play,phase,words", [
    # restart.yml's own tasks: the phase they were imported with (gpufleet_phase), not their names
    (FakeTask("Renew the restart lock (wait)", path="/r/playbooks/tasks/restart_lock_renew.yml:8",
              task_vars={"gpufleet_phase": "wait"}), "Restart SGLang host by host", "wait",
     "the stop may have started the new one (process method)"),
    (FakeTask("Renew the restart lock (wait)", path="/r/playbooks/tasks/restart_lock_renew.yml:8"),
     "Restart SGLang host by host", None, "run playbooks/check.yml for this host"),
    (FakeTask("Take the restart lock", path="/r/playbooks/tasks/restart_lock_take.yml:3"),
     "Restart SGLang host by host", "lock", "a lock taken frees itself when its lease ends"),
    (FakeTask("Read the lock", path="/r/playbooks/restart.yml:60"), "Preflight: check every host", "preflight",
     "nothing was changed on this host: check ssh"),
])
def test_an_unreachable_hosts_phase_and_advice_come_from_the_phase_table(monkeypatch, task, play, phase, words):
    plugin = make(monkeypatch)
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_facts": {"gpufleet_restart_targets": ["h1"]}}))
    plugin.v2_playbook_on_play_start(Named(play))
    plugin.v2_runner_on_unreachable(FakeResult("h1", {"msg": "ssh: Connection reset"}, task))
    row = cb.build_rows(["h1"], {}, {}, plugin._unreachable, {})[0]
    assert row["result"] == "unreachable" and row["phase"] == phase and words in row["advice"], row


def test_callback_prints_the_check_table_for_check_yml(monkeypatch):
    plugin = make(monkeypatch)
    plugin.v2_playbook_on_play_start(Named("Check the GPU fleet"))
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_stats": {"data": {"gpufleet_check": {
        "h1": {"verdict": "OK", "reasons": [], "gpus_ok": 8, "gpus_total": 8},
        "h2": {"verdict": "CRIT", "reasons": [{"severity": "CRIT", "gpu": 1, "code": "ecc_uncorrected", "text": "4"}],
               "gpus_ok": 7, "gpus_total": 8}}}}}))
    plugin.v2_playbook_on_stats(None)
    assert plugin._display.lines[0] == "BANNER GPUFLEET CHECK"
    rows = plugin._display.lines[1].splitlines()
    assert rows[1].split() == ["h1", "OK", "8/8", "-"]
    assert rows[2].split() == ["h2", "CRIT", "7/8", "CRIT", "ecc_uncorrected", "GPU", "1"]
    assert rows[-1] == "2 host(s): 1 OK, 0 WARN, 1 CRIT"
    assert "GPUFLEET SUMMARY" not in "\n".join(plugin._display.lines)


def test_check_table_stays_silent_under_a_json_stdout_callback(monkeypatch):
    plugin = make(monkeypatch, "ansible.posix.json")
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_stats": {"data": {"gpufleet_check": {
        "h1": {"verdict": "OK", "reasons": [], "gpus_ok": 8, "gpus_total": 8}}}}}))
    plugin.v2_playbook_on_stats(None)
    assert plugin._display.lines == []


def test_guard_refusal_the_rows_already_give_is_not_printed_again(monkeypatch):
    errors = ["gpufleet_serial='abc' is not valid", "sglang_port='x' is not a port"]
    plugin = make(monkeypatch)
    plugin.v2_playbook_on_play_start(Named("Check the command line before touching any host"))
    plugin.v2_runner_on_ok(FakeResult("localhost", {"ansible_facts": {"gpufleet_restart_targets": ["h1"]}}))
    plugin.v2_runner_on_ok(FakeResult("localhost", {"ansible_stats": {"data": {"gpufleet_restart": {
        "h1": {"host": "h1", "result": "not_reached", "cause": "; ".join(errors)}}}}}))
    plugin.v2_runner_on_failed(FakeResult("localhost", {"msg": " | ".join(errors) + ". Nothing was changed."}))
    plugin.v2_playbook_on_stats(None)
    text = "\n".join(plugin._display.lines)
    assert text.count("is not valid") == 1 and "h1: not_reached: " + "; ".join(errors) in text
    assert plugin._display.lines[-1] == "refused before touching any host (the cause is in the rows above)"


def test_an_interrupted_run_still_prints_what_each_host_was_left_in(monkeypatch):
    # Ctrl-C on ansible-playbook: ansible-core skips v2_playbook_on_stats and every always: section, and printed only
    # "User interrupted execution" while the host it was restarting served nothing.
    plugin = make(monkeypatch)
    plugin.v2_playbook_on_play_start(Named("Check the command line before touching any host"))
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_facts": {"gpufleet_restart_targets": ["h1", "h2", "h3"]}}))
    plugin.v2_playbook_on_play_start(Named("Preflight - check every targeted host before touching any"))
    for host in ("h1", "h2", "h3"):
        plugin.v2_runner_on_start(Named(host), FakeTask("Check", role="sglang_preflight"))
    plugin.v2_playbook_on_play_start(Named("Restart SGLang host by host (patch, stop, wait, launch, verify)"))
    # h1 went through: its final row
    plugin.v2_runner_on_start(Named("h1"), FakeTask("Stop", role="sglang_stop"))
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_stats": {"data": {"gpufleet_restart": {
        "h1": {"host": "h1", "result": "ok", "downtime_s": 9.0, "old_pid": 10, "new_pid": 11}}}}}))
    # h2 was stopped and is in the wait (its provisional row says unreachable) when Ctrl-C comes
    plugin.v2_runner_on_ok(FakeResult("h2", {"ansible_stats": {"data": {"gpufleet_restart": {
        "h2": {"host": "h2", "result": "unreachable", "phase": "wait", "cause": "connection lost during wait"}}}}}))
    plugin.v2_runner_on_start(Named("h2"), FakeTask("Stop", role="sglang_stop"))
    plugin.v2_runner_on_ok(FakeResult("h2", {"signalled": [{"pid": 20, "signals": ["SIGTERM"]}], "main_pid": 20,
                                             "stop_ms": 2000}, FakeTask("Stop", role="sglang_stop")))
    plugin.v2_runner_on_start(Named("h2"), FakeTask("Wait", role="gpu_memory_wait"))
    rows = plugin.interrupted_rows(now=cb.time.time() + 5)
    assert list(rows) == ["h2", "h3"]
    h2 = rows["h2"]
    assert h2["result"] == "interrupted" and h2["phase"] == "wait" and h2["old_pid"] == 20 and h2["still_down"]
    assert 6.5 <= h2["downtime_s"] <= 8.0, h2
    assert h2["advice"].startswith("interrupted after the stop (old server pid 20), before a new server was "
                                   "started: this host serves nothing now; rerun playbooks/restart.yml -e target=h2")
    assert rows["h3"]["result"] == "not_started" and "untouched" in rows["h3"]["advice"]
    plugin._on_exit()
    text = "\n".join(plugin._display.lines)
    assert "BANNER GPUFLEET SUMMARY (interrupted)" in plugin._display.lines
    assert "h2: interrupted in wait: ansible-playbook was interrupted" in text
    assert "h3: not_started" in text and "h1: interrupted" not in text  # h1 finished: its own row
    # A run that reached its stats prints the normal summary only.
    done = make(monkeypatch)
    done.v2_runner_on_ok(FakeResult("h1", {"ansible_facts": {"gpufleet_restart_targets": ["h1"]}}))
    done.v2_playbook_on_play_start(Named("Restart SGLang host by host"))
    done.v2_runner_on_start(Named("h1"), FakeTask("Stop", role="sglang_stop"))
    done.v2_playbook_on_stats(None)
    before = list(done._display.lines)
    done._on_exit()
    assert done._display.lines == before


# -- cancels: SIGTERM (an AWX cancel) ends ansible-playbook as Ctrl-C does, with the summary (issue 30, item 6) -----

@pytest.fixture
def sigterm_seen(monkeypatch):
    """Call it to mark the run cancelled by SIGTERM (the mark every loaded copy of the callback reads)."""
    import signal
    import ansible.plugins.callback as shared
    monkeypatch.setitem(shared.__dict__, "_gpufleet_summary_handled", {})  # no earlier test's copy printed it
    monkeypatch.delitem(shared.__dict__, "_gpufleet_cancel_signal", raising=False)
    return lambda: monkeypatch.setitem(shared.__dict__, "_gpufleet_cancel_signal", signal.SIGTERM)


def test_a_sigterm_cancel_prints_what_it_did_on_each_host_and_the_lock_it_left(monkeypatch, sigterm_seen):
    plugin = make(monkeypatch)
    plugin.v2_playbook_on_play_start(Named("Check the command line before touching any host"))
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_facts": {"gpufleet_restart_targets": ["h1", "h2"]}}))
    plugin.v2_playbook_on_play_start(Named("Restart SGLang host by host (patch, stop, wait, launch, verify)"))
    lock = {"run_id": "awx-4711", "lease_s": 300, "pid": 12}
    plugin.v2_runner_on_start(Named("h1"), FakeTask("Take the restart lock", path="playbooks/tasks/restart_lock_take.yml"))
    plugin.v2_runner_on_ok(FakeResult("h1", {"result": "taken", "acquired": True, "lock": lock, "lease_s": 300}))
    plugin.v2_runner_on_start(Named("h1"), FakeTask("Stop", role="sglang_stop"))
    plugin.v2_runner_on_ok(FakeResult("h1", {"signalled": [{"pid": 20, "signals": ["SIGTERM"]}], "main_pid": 20,
                                             "stop_ms": 900, "start": {"started": True, "pid": 31}},
                                      FakeTask("Stop", role="sglang_stop")))
    plugin.v2_runner_on_start(Named("h1"), FakeTask("Wait", role="gpu_memory_wait"))
    sigterm_seen()
    plugin._on_exit()
    text = "\n".join(plugin._display.lines)
    assert "BANNER GPUFLEET SUMMARY (cancelled: SIGTERM)" in plugin._display.lines
    assert "h1: cancelled in wait: ansible-playbook was cancelled (SIGTERM" in text
    assert ("next: cancelled after the stop (old server pid 20): the new server (pid 31) was started but not "
            "verified and not recorded") in text
    assert "The restart lock (run awx-4711) stays on the host" in text and "unlock.yml -e target=h1" in text
    assert "h2: not_started: the run was cancelled before this host's turn" in text and "(untouched)" in text
    before = list(plugin._display.lines)
    plugin._on_exit()  # the watchdog and atexit both call it: printed once
    assert plugin._display.lines == before


def test_a_sigterm_cancel_during_the_guard_play_still_says_every_host_is_untouched(monkeypatch, sigterm_seen):
    plugin = make(monkeypatch)
    plugin.v2_playbook_on_play_start(Named("Check the command line before touching any host"))
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_facts": {"gpufleet_restart_targets": ["h1", "h2"]}}))
    sigterm_seen()
    plugin._on_exit()
    text = "\n".join(plugin._display.lines)
    assert "h1, h2: not_started: the run was cancelled before this host's turn" in text, text


def test_a_released_lock_is_not_reported_left(monkeypatch, sigterm_seen):
    plugin = make(monkeypatch)
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_facts": {"gpufleet_restart_targets": ["h1"]}}))
    plugin.v2_playbook_on_play_start(Named("Restart SGLang host by host"))
    plugin.v2_runner_on_ok(FakeResult("h1", {"result": "taken", "acquired": True, "lock": {"run_id": "r1"},
                                             "lease_s": 300}))
    plugin.v2_runner_on_start(Named("h1"), FakeTask("Verify", role="sglang_verify"))
    plugin.v2_runner_on_ok(FakeResult("h1", {"lock_release": {"result": "released"}, "changed": True}))
    sigterm_seen()
    rows = plugin.interrupted_rows()
    assert "No restart lock was left" in rows["h1"]["advice"] and "stays on the host" not in rows["h1"]["advice"]


class TaskQueueManager:
    """Stands in for ansible-core's: its _signal_handler tells the workers and raises KeyboardInterrupt on SIGINT
    (on SIGTERM it would kill the process)."""

    def __init__(self):
        self.calls = []
        self._workers = []

    def _signal_handler(self, signum, frame):
        import signal
        self.calls.append(signum)
        assert not any(w is not None and w._closed for w in self._workers)  # as ansible-core's is_alive() loop
        if signum == signal.SIGINT:
            raise KeyboardInterrupt()
        raise AssertionError("ansible-core's SIGTERM path (kill itself) must not run")


def test_sigterm_takes_ansible_cores_ctrl_c_path_and_starts_the_bound(monkeypatch):
    import os
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can be set only in the main thread")
    tqm = TaskQueueManager()
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    seen = []
    try:
        # outside ansible-core's run (no TaskQueueManager handler) nothing is installed
        assert cb.install_cancel_handlers(seen.append) == {}
        assert signal.getsignal(signal.SIGTERM) == saved[signal.SIGTERM]
        signal.signal(signal.SIGTERM, tqm._signal_handler)
        signal.signal(signal.SIGINT, tqm._signal_handler)
        previous = cb.install_cancel_handlers(seen.append)
        assert set(previous) == {signal.SIGTERM, signal.SIGINT}
        # the signal lands as the strategy has closed a finished worker and not yet put the next in its slot
        closed = multiprocessing.get_context("fork").Process(target=int)
        closed.start()
        closed.join()
        closed.close()
        tqm._workers[:] = [None, closed]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):
                threading.Event().wait(0.01)
        assert seen == [signal.SIGTERM] and tqm.calls == [signal.SIGINT]  # the workers are told as on Ctrl-C
        assert tqm._workers == [None, None]  # ansible-core's cleanup loop (is_alive on each) no longer raises
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # a second SIGTERM ends it at once
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def test_the_bound_prints_the_summary_and_exits_when_cleanup_blocks():
    import threading
    done, said, exits = threading.Event(), [], []

    def exit_now(rc):
        exits.append(rc)
        done.set()

    thread = cb.bounded_exit(0.05, lambda: said.append("summary"), exit_now=exit_now)
    assert done.wait(5) and said == ["summary"] and exits == [cb.INTERRUPTED_RC]
    assert thread.daemon  # a process that ends before the bound never waits for it

    def broken():
        raise RuntimeError("display gone")

    done.clear()
    cb.bounded_exit(0.01, broken, exit_now=exit_now)
    assert done.wait(5) and exits == [cb.INTERRUPTED_RC] * 2  # the exit comes whatever the summary does


def test_a_cancel_whose_interrupt_was_lost_is_raised_again_at_the_next_task_or_result(monkeypatch, sigterm_seen):
    # Seen in the lab: SIGTERM landed in logging's fork hook as a worker was forked; Python ignored the
    # KeyboardInterrupt raised there and the run went on to its end.
    plugin = make(monkeypatch)
    plugin.v2_runner_on_ok(FakeResult("h1", {"ansible_facts": {"gpufleet_restart_targets": ["h1"]}}))
    plugin.v2_playbook_on_play_start(Named("Restart SGLang host by host"))
    plugin.v2_runner_on_start(Named("h1"), FakeTask("Stop", role="sglang_stop"))
    sigterm_seen()
    with pytest.raises(KeyboardInterrupt):  # the result is noted first, then the interrupt comes again
        plugin.v2_runner_on_ok(FakeResult("h1", dict(STOP_RESULT), FakeTask("Stop", role="sglang_stop")))
    assert plugin._seen["h1"]["old_pid"] == 20
    with pytest.raises(KeyboardInterrupt):
        plugin.v2_playbook_on_task_start(FakeTask("Wait", role="gpu_memory_wait"), False)
    with pytest.raises(KeyboardInterrupt):
        plugin.v2_runner_on_start(Named("h1"), FakeTask("Wait", role="gpu_memory_wait"))
    # not from another thread (ansible-core's results thread must live), and not after the stats
    import threading
    raised = []
    thread = threading.Thread(target=lambda: raised.append(plugin._cancel_checkpoint()))
    thread.start()
    thread.join()
    assert raised == [None]
    plugin._stats_done = True
    plugin.v2_runner_on_ok(FakeResult("h1", {"changed": False}))


STOP_RESULT = {"signalled": [{"pid": 20, "signals": ["SIGTERM"]}], "main_pid": 20, "stop_ms": 900}


def test_closed_workers_are_put_aside_and_live_or_unstarted_ones_kept():
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    live, unstarted, closed = ctx.Process(target=time.sleep, args=(5,)), ctx.Process(target=int), ctx.Process(target=int)
    live.start()
    closed.start()
    closed.join()
    closed.close()
    try:
        workers = [live, None, closed, unstarted]
        assert cb.forget_closed_workers(workers) == 1
        assert workers == [live, None, None, unstarted]
        assert cb.forget_closed_workers(workers) == 0
    finally:
        live.terminate()
        live.join()


def test_the_bound_tells_the_workers_still_alive_to_end():
    import signal

    class Worker:
        def __init__(self, pid, alive):
            self.pid, self._alive = pid, alive

        def is_alive(self):
            return self._alive

    sent = []
    cb.end_workers([Worker(11, True), None, Worker(12, False), Worker(13, True)],
                   kill=lambda pid, sig: sent.append((pid, sig)))
    assert sent == [(11, signal.SIGTERM), (13, signal.SIGTERM)]
