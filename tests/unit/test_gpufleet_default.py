"""plugins/callback/gpufleet_default.py (the stdout callback ansible.cfg sets) in a real ansible-playbook run on
the local host: what a failed fail/assert task prints at verbosity 0 and with -v."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

PLAYBOOK = """
- hosts: localhost
  gather_facts: false
  tasks:
    - name: A refusal in lines
      ansible.builtin.assert:
        that: false
        fail_msg: ["gpu-lab-01: fix the inventory; nothing was stopped or changed.", "sglang_port must be a port"]
        quiet: true
      ignore_errors: true
    - name: A refusal in one message
      ansible.builtin.fail:
        msg: "gpufleet_serial='abc' is not valid. Nothing was changed."
"""


def _run(tmp_path, *args):
    book = tmp_path / "book.yml"
    book.write_text(PLAYBOOK)
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0")
    bindir = os.path.dirname(sys.executable)
    proc = subprocess.run([os.path.join(bindir, "ansible-playbook"), "-i", "localhost,", "-c", "local", str(book),
                           *args], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_a_failed_fail_or_assert_prints_its_message_once_as_text(tmp_path):
    out = _run(tmp_path)
    assert "fatal: [localhost]: gpufleet_serial='abc' is not valid. Nothing was changed.\n" in out
    assert out.count("is not valid") == 1  # no [ERROR] block, no JSON dump repeating it
    assert "[ERROR]" not in out and "FAILED! =>" not in out
    assert ("fatal: [localhost]: gpu-lab-01: fix the inventory; nothing was stopped or changed.\n"
            "    sglang_port must be a port\n...ignoring") in out


def test_with_v_it_prints_what_ansibles_default_prints(tmp_path):
    out = _run(tmp_path, "-v")
    assert "fatal: [localhost]: FAILED! =>" in out


RETRY_PLAYBOOK = """
- hosts: localhost
  gather_facts: false
  tasks:
    - name: A wait slice
      ansible.builtin.debug:
        var: progress
      vars:
        progress: "waiting for /health_generate: 5 s of 900 s"
      register: slice
      until: false
      retries: 1
      delay: 0
      ignore_errors: true
"""


def test_a_retried_wait_slice_is_not_called_failed(tmp_path):
    book = tmp_path / "retry.yml"
    book.write_text(RETRY_PLAYBOOK)
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    bindir = os.path.dirname(sys.executable)
    proc = subprocess.run([os.path.join(bindir, "ansible-playbook"), "-i", "localhost,", "-c", "local", str(book)],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
    out = proc.stdout + proc.stderr
    assert "TASK [A wait slice]" in out, out
    assert "FAILED - RETRYING" not in out, out
    assert "  localhost: waiting for /health_generate: 5 s of 900 s" in out  # gpufleet_summary's progress line


NO_HOSTS_PLAYBOOK = """
- hosts: "{{ [] }}"
  gather_facts: false
  tasks:
    - name: Never runs
      ansible.builtin.debug:
        msg: never
- hosts: localhost
  gather_facts: false
  tasks:
    - name: Fails, so the run has a result to print
      ansible.builtin.fail:
        msg: the second play ran
"""


def test_a_play_with_no_hosts_says_nothing_at_verbosity_0_and_is_said_with_v(tmp_path):
    book = tmp_path / "none.yml"
    book.write_text(NO_HOSTS_PLAYBOOK)
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0")
    ap = os.path.join(os.path.dirname(sys.executable), "ansible-playbook")
    outs = []
    for args in ([], ["-v"]):
        proc = subprocess.run([ap, "-i", "localhost,", "-c", "local", str(book), *args], capture_output=True,
                              text=True, env=env, cwd=str(tmp_path), timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        outs.append(proc.stdout + proc.stderr)
    quiet, verbose = outs
    assert "the second play ran" in quiet and "no hosts matched" not in quiet
    assert "skipping: no hosts matched" in verbose


# Two inventory aliases of the local host: an ad-hoc set_fact returns the same long string from both (and one of
# each host's own).
ADHOC_INVENTORY = """
[pair]
gpu-a ansible_connection=local
gpu-b ansible_connection=local
"""
LONG = ("kernel log not readable, Xid events unknown (not none): /dev/kmsg: No such file or directory; "
        "journalctl -k: the journal holds no kernel messages of this boot")


def _adhoc(tmp_path, *args):
    inventory = tmp_path / "pair.ini"
    inventory.write_text(ADHOC_INVENTORY)
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0")
    env.pop("ANSIBLE_LOAD_CALLBACK_PLUGINS", None)
    module_args = "xid_reason='%s' own='%s on {{ inventory_hostname }}'" % (LONG, LONG)
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ansible"), "pair", "-i", str(inventory),
                           "-m", "ansible.builtin.set_fact", "-a", module_args, *args],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_an_ad_hoc_run_prints_a_long_string_every_host_repeats_once(tmp_path):
    out = _adhoc(tmp_path)
    blocks = out.split(" | SUCCESS => ")
    first = blocks[0].strip()  # the host printed first (the forks decide which)
    second = "gpu-b" if first == "gpu-a" else "gpu-a"
    assert first in ("gpu-a", "gpu-b") and out.count(" | SUCCESS => ") == 2, out
    assert out.count('"xid_reason": "%s"' % LONG) == 1, out
    assert out.count('"xid_reason": "(same as %s)"' % first) == 1, out
    # the value that differs per host is printed whole for each
    assert '"own": "%s on gpu-a"' % LONG in out and '"own": "%s on gpu-b"' % LONG in out
    assert out.index("%s | SUCCESS" % second) > out.index('"xid_reason": "%s"' % LONG)
    # as minimal prints ad hoc: no banners, no recap, nothing from the summary callback
    assert "PLAY" not in out and "TASK [" not in out and "GPUFLEET" not in out, out


def test_with_v_an_ad_hoc_run_prints_every_value_whole(tmp_path):
    out = _adhoc(tmp_path, "-v")
    assert out.count('"xid_reason": "%s"' % LONG) == 2 and "same as" not in out, out
