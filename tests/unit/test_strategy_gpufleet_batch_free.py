"""plugins/strategy/gpufleet_batch_free.py: the batch-failure decision, the run() wrapper around free, and a
real ansible-playbook run on local hosts (no lab): hosts of a batch move on their own, a failed batch ends
the play before the next batch starts, and free's "max_fail_percentage is not supported" warning is gone."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpufleet_batch_free", ROOT / "plugins" / "strategy" / "gpufleet_batch_free.py")
plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plugin)


@pytest.mark.parametrize("max_fail, batch, failed, stops", [
    (0, 2, 0, False), (0, 2, 1, True), (0, 1, 1, True), (0, 8, 1, True),
    (None, 2, 2, False), (None, 1, 1, False),
    (50, 4, 2, False), (50, 4, 3, True), (49, 4, 2, True), (100, 3, 3, False),
    (0, 0, 0, False),
])
def test_batch_stops_play_when_more_than_the_percentage_failed(max_fail, batch, failed, stops):
    assert plugin.batch_stops_play(max_fail, batch, failed) is stops


class FakeTqm:
    RUN_OK = 0
    RUN_FAILED_HOSTS = 2
    RUN_FAILED_BREAK_PLAY = 8

    def __init__(self, unreachable=()):
        self._failed_hosts = {}
        self._unreachable_hosts = {h: True for h in unreachable}
        self.callbacks = []

    def send_callback(self, name, *args):
        self.callbacks.append(name)


class FakePlay:
    def __init__(self, max_fail_percentage):
        self.max_fail_percentage = max_fail_percentage


class FakeIterator:
    def __init__(self, play, batch_size, failed=()):
        self._play = play
        self.batch_size = batch_size
        self.failed = list(failed)

    def get_failed_hosts(self):
        return {h: True for h in self.failed}


def _run(monkeypatch, max_fail, batch_size, fail=(), unreachable=(), unreachable_before=(), free_result=0,
         iterator_failed=()):
    seen = {}

    def free_run(self, iterator, play_context):
        seen["max_fail_during_free"] = iterator._play.max_fail_percentage
        for h in fail:
            self._tqm._failed_hosts[h] = True
        for h in unreachable:
            self._tqm._unreachable_hosts[h] = True
        return free_result

    monkeypatch.setattr(plugin.FreeStrategyModule, "run", free_run)
    strategy = object.__new__(plugin.StrategyModule)
    strategy._tqm = FakeTqm(unreachable_before)
    strategy._hosts_cache = ["h%d" % (i + 1) for i in range(batch_size)]  # what free's run sets: the batch
    play = FakePlay(max_fail)
    result = strategy.run(FakeIterator(play, batch_size, iterator_failed), None)
    return result, strategy._tqm, play, seen


def test_a_failed_host_breaks_the_play_after_its_batch(monkeypatch):
    result, tqm, play, seen = _run(monkeypatch, 0, 2, fail=["h1"], free_result=2)
    assert result & tqm.RUN_FAILED_BREAK_PLAY and result & tqm.RUN_FAILED_HOSTS
    # as linear does: the whole batch counts as failed, which is what makes ansible-playbook start no other
    assert set(tqm._failed_hosts) == {"h1", "h2"}
    assert "v2_playbook_on_no_hosts_remaining" in tqm.callbacks
    # free never saw max_fail_percentage (no "not supported" warning); the play has it back afterwards
    assert seen["max_fail_during_free"] is None and play.max_fail_percentage == 0


def test_a_host_failed_in_a_rescue_with_an_always_section_counts(monkeypatch):
    """StrategyBase leaves such a host out of _failed_hosts (its state is not complete when it fails); the
    iterator has it failed. restart.yml fails a host that way (rescue: fail, always: summary row, lock)."""
    result, tqm, _, _ = _run(monkeypatch, 0, 2, iterator_failed=["h1"], free_result=2)
    assert result & tqm.RUN_FAILED_BREAK_PLAY and set(tqm._failed_hosts) == {"h1", "h2"}


def test_a_green_batch_lets_the_next_batch_start(monkeypatch):
    result, tqm, play, _ = _run(monkeypatch, 0, 2)
    assert result == 0 and tqm.callbacks == [] and play.max_fail_percentage == 0 and tqm._failed_hosts == {}


def test_an_unreachable_host_of_this_batch_counts_one_of_an_earlier_batch_does_not(monkeypatch):
    result, tqm, _, _ = _run(monkeypatch, 0, 2, unreachable=["h2"], free_result=4)
    assert result & tqm.RUN_FAILED_BREAK_PLAY
    assert set(tqm._failed_hosts) == {"h1"}  # h2 is counted as unreachable already, not twice
    result, tqm, _, _ = _run(monkeypatch, 0, 2, unreachable_before=["h0"], free_result=4)
    assert not result & tqm.RUN_FAILED_BREAK_PLAY and tqm._failed_hosts == {}


def test_without_max_fail_percentage_it_is_plain_free(monkeypatch):
    result, tqm, play, _ = _run(monkeypatch, None, 2, fail=["h1", "h2"], free_result=2)
    assert result == 2 and play.max_fail_percentage is None


def test_a_free_result_of_false_no_hosts_left_still_breaks_the_play(monkeypatch):
    result, tqm, _, _ = _run(monkeypatch, 0, 1, fail=["h1"], free_result=False)
    assert result & tqm.RUN_FAILED_BREAK_PLAY


PLAYBOOK = """
- hosts: all
  gather_facts: false
  serial: 2
  max_fail_percentage: 0
  strategy: gpufleet.fleet.gpufleet_batch_free
  tasks:
    - name: Start
      ansible.builtin.shell: "echo start $(date +%s.%N) >> {{ log }}/{{ inventory_hostname }}"
    # shaped like restart.yml's rolling play: a failure is rescued, then failed again, with an always section
    - name: Restart-like block
      block:
        - name: Work (slow host sleeps)
          ansible.builtin.command: "sleep {{ work_s | default(0) }}"
        - name: Work until another host of the batch is done (linear would never get it there)
          ansible.builtin.wait_for:
            path: "{{ log }}/{{ waits_for }}.done"
            timeout: 60
          when: waits_for is defined
        - name: Fail where asked
          ansible.builtin.fail:
            msg: "{{ inventory_hostname }} fails"
          when: fails | default(false) | bool
        - name: Done
          ansible.builtin.shell: "echo done $(date +%s.%N) >> {{ log }}/{{ inventory_hostname }}; touch {{ log }}/{{ inventory_hostname }}.done"
      rescue:
        - name: Fail the host
          ansible.builtin.fail:
            msg: "{{ inventory_hostname }}: failed, rolling restart stopped"
      always:
        - name: Always
          ansible.builtin.shell: "echo always $(date +%s.%N) >> {{ log }}/{{ inventory_hostname }}"
"""


def _play(tmp_path, hostvars):
    log = tmp_path / "log"
    log.mkdir()
    inv = {"all": {"hosts": {h: dict(v, ansible_connection="local", ansible_python_interpreter=sys.executable,
                                     log=str(log)) for h, v in hostvars.items()}}}
    (tmp_path / "inv.json").write_text(json.dumps(inv))
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_STDOUT_CALLBACK="ansible.builtin.default",
               ANSIBLE_FORCE_COLOR="0", ANSIBLE_NOCOLOR="1", PATH=os.path.dirname(sys.executable) + ":" + os.environ["PATH"])
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i",
                           str(tmp_path / "inv.json"), str(tmp_path / "play.yml")],
                          cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=300)
    marks = {}
    for h in hostvars:
        path = log / h
        marks[h] = dict(line.split() for line in path.read_text().splitlines()) if path.exists() else {}
    return done, {h: {k: float(v) for k, v in m.items()} for h, m in marks.items()}


def test_in_a_real_play_the_fast_host_finishes_before_the_slow_one_and_a_green_batch_lets_the_next_run(tmp_path):
    # batch 1: the slow host's work ends only once the fast host is through all its tasks (under linear it would
    # wait 60 s for a marker the fast host writes only after the slow host's work, and fail)
    done, marks = _play(tmp_path, {"fast": {}, "slow": {"waits_for": "fast"}, "next1": {}, "next2": {}})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert marks["fast"]["done"] < marks["slow"]["done"]
    # batch 2 starts once batch 1 is done
    assert min(marks["next1"]["start"], marks["next2"]["start"]) > marks["slow"]["done"]
    assert "max_fail_percentage with the free strategy is not supported" not in out


def test_in_a_real_play_a_failed_host_lets_its_batch_mate_finish_and_no_further_batch_starts(tmp_path):
    done, marks = _play(tmp_path, {"bad": {"work_s": 0, "fails": True}, "good": {"work_s": 2},
                                   "later1": {"work_s": 0}, "later2": {"work_s": 0}})
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "done" in marks["good"] and "done" not in marks["bad"]  # the healthy host of the batch finished
    assert "always" in marks["bad"] and "always" in marks["good"]
    assert marks["later1"] == {} and marks["later2"] == {}  # the next batch never started
    assert "1 of 2 hosts of this batch failed (bad), more than max_fail_percentage 0%" in out
    # the recap still tells the healthy host from the failed one
    assert any(line.split()[:1] == ["good"] and "failed=0" in line for line in out.splitlines())
    assert "max_fail_percentage with the free strategy is not supported" not in out
