"""playbooks/tasks/restart_roll_gate.yml, the first task of restart.yml's rolling play, in a real ansible-playbook
run on local hosts (no lab) under the play's strategy (Ansible's free, serial 2): hosts of a batch move on their
own, a failed or unreachable host lets its batch mate finish and no host of a later batch starts."""
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
GATE = ROOT / "playbooks" / "tasks" / "restart_roll_gate.yml"

PLAYBOOK = """
- hosts: all
  gather_facts: false
  serial: 2
  strategy: ansible.builtin.free
  tasks:
    - name: The gate of restart.yml
      ansible.builtin.import_tasks: %s
    - name: Start
      ansible.builtin.shell: "echo start $(date +%%s.%%N) >> {{ log }}/{{ inventory_hostname }}"
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
          ansible.builtin.shell: "echo done $(date +%%s.%%N) >> {{ log }}/{{ inventory_hostname }}; touch {{ log }}/{{ inventory_hostname }}.done"
      rescue:
        - name: Summary row
          ansible.builtin.set_fact:
            gpufleet_summary_row: {result: rolled_back}
        - name: Fail the host
          ansible.builtin.fail:
            msg: "{{ inventory_hostname }}: failed, rolling restart stopped"
      always:
        - name: Always
          ansible.builtin.shell: "echo always $(date +%%s.%%N) >> {{ log }}/{{ inventory_hostname }}"
""" % GATE


def _play(tmp_path, hostvars):
    log = tmp_path / "log"
    log.mkdir()
    local = dict(ansible_connection="local", ansible_python_interpreter=sys.executable, log=str(log))
    inv = {"all": {"hosts": {h: dict(local, **v) for h, v in hostvars.items()}}}
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


def test_the_fast_host_finishes_before_the_slow_one_and_a_green_batch_lets_the_next_run(tmp_path):
    # batch 1: the slow host's work ends only once the fast host is through all its tasks (under linear it would
    # wait 60 s for a marker the fast host writes only after the slow host's work, and fail)
    done, marks = _play(tmp_path, {"fast": {}, "slow": {"waits_for": "fast"}, "next1": {}, "next2": {}})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert marks["fast"]["done"] < marks["slow"]["done"]
    # batch 2 starts once batch 1 is done, and the gate let it
    assert min(marks["next1"]["start"], marks["next2"]["start"]) > marks["slow"]["done"]
    assert "not started: " not in out and "max_fail_percentage" not in out and "DEPRECATION" not in out


def test_a_failed_host_lets_its_batch_mate_finish_and_no_later_host_starts(tmp_path):
    done, marks = _play(tmp_path, {"bad": {"work_s": 0, "fails": True}, "good": {"work_s": 2},
                                   "later1": {}, "later2": {}, "later3": {}})
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "done" in marks["good"] and "done" not in marks["bad"]  # the healthy host of the batch finished
    assert "always" in marks["bad"] and "always" in marks["good"]
    # neither batch 2 nor batch 3 ran a task past the gate, and each says why
    assert marks["later1"] == marks["later2"] == marks["later3"] == {}
    assert out.count('"msg": "not started: the rolling restart stopped at bad (rolled_back); nothing was '
                     'changed on this host"') == 3, out
    # the recap tells the healthy host from the failed one, and the later hosts did not fail
    recap = {line.split()[0]: line for line in out.split("PLAY RECAP", 1)[1].splitlines() if ":" in line}
    assert "failed=1" in recap["bad"] and all("failed=0" in recap[h] for h in ("good", "later1", "later2", "later3"))


def test_an_unreachable_host_stops_the_roll_too(tmp_path):
    # nothing listens on 127.0.0.1:9: the connection is refused, the host is unreachable (no row of its own)
    lost = {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": 9}
    done, marks = _play(tmp_path, {"lost": lost, "good": {}, "later": {}})
    out = done.stdout + done.stderr
    assert done.returncode == 4, out
    assert "done" in marks["good"] and marks["later"] == {}
    assert '"msg": "not started: the rolling restart stopped at lost (failed); nothing was changed on this host"' in out


def test_the_removed_strategy_plugin_names_its_replacement(tmp_path):
    (tmp_path / "play.yml").write_text("- hosts: localhost\n  gather_facts: false\n"
                                       "  strategy: gpufleet.fleet.gpufleet_batch_free\n"
                                       "  tasks:\n    - ansible.builtin.debug: {msg: hi}\n")
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", "localhost,",
                           "-c", "local", str(tmp_path / "play.yml")], cwd=str(ROOT), env=env, capture_output=True,
                          text=True, timeout=120)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode != 0 and "has been removed" in out, out
    assert "use strategy ansible.builtin.free with serial and import playbooks/tasks/restart_roll_gate.yml" in out, out
