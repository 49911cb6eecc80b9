"""gpufleet's callbacks read only the public attributes of the result ansible-core hands them (``result.result``,
``result.host``, ``result.task``; public since ansible-core 2.19, the oldest release meta/runtime.yml allows).

The private ``_result``, ``_host`` and ``_task`` still work silently up to ansible-core 2.21: the source only carries
a ``# deprecated: ... core_version='2.23'`` marker (a deprecation warning is planned from 2.23, removal after).
So this test does not wait for ansible-core to warn: it runs a real ansible-playbook (the installed ansible-core,
the one of ``sys.executable``) in which those three properties raise a deprecation warning whenever code outside
ansible-core reads them, as 2.23 is set to, and checks that no callback of gpufleet triggers one: the stdout
callback (``gpufleet_default``), the summary (``gpufleet_summary``) and the test equipment callbacks
(``gpufleet_test_json``, ``gpufleet_task_times``)."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The play's name makes gpufleet_summary treat the run as restart.yml's rolling play: it prints its summary,
# with a row for the host whose task failed. The retried slice carries "progress" (the summary's progress line).
PLAYBOOK = """
- name: Restart host by host (callback API test)
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Say something
      ansible.builtin.debug:
        msg: hello from the debug task
    - name: A wait slice
      ansible.builtin.debug:
        var: progress
      vars:
        progress: "waiting for /health_generate: 5 s of 900 s"
      until: false
      retries: 1
      delay: 0
      ignore_errors: true
    - name: Fail here
      ansible.builtin.fail:
        msg: the failing task of the callback API test
"""

# Runs ansible-playbook with CallbackTaskResult._result/_host/_task deprecated for callers outside ansible-core.
GUARD = r"""
import os, sys
import ansible
from ansible.executor import task_result
from ansible.utils.display import Display

core = os.path.dirname(os.path.abspath(ansible.__file__)) + os.sep


def guarded(private, public):
    def get(self):
        caller = sys._getframe(1).f_code.co_filename
        if not os.path.abspath(caller).startswith(core):
            Display().deprecated(msg="CallbackTaskResult.%s is read by %s" % (private, caller), version="2.23",
                                 help_text="Use `%s` instead (ansible-core 2.19+)." % public)
        return getattr(self, public)
    return property(get)


for private, public in (("_result", "result"), ("_host", "host"), ("_task", "task")):
    setattr(task_result.CallbackTaskResult, private, guarded(private, public))

from ansible.cli.playbook import main
main(["ansible-playbook"] + sys.argv[1:])
"""

CALLBACK_DIRS = [ROOT / "plugins" / "callback", ROOT / "tests" / "integration" / "callback_plugins",
                 ROOT / "tests" / "gpu" / "callback_plugins"]


def _run(tmp_path, stdout_callback, guard=True):
    book = tmp_path / "book.yml"
    book.write_text(PLAYBOOK)
    times = tmp_path / "times.jsonl"
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0",
               ANSIBLE_DEPRECATION_WARNINGS="1", ANSIBLE_STDOUT_CALLBACK=stdout_callback,
               ANSIBLE_CALLBACK_PLUGINS=":".join(str(d) for d in CALLBACK_DIRS),
               # the summary both from the callback path (always on) and enabled by its collection name
               ANSIBLE_CALLBACKS_ENABLED="gpufleet.fleet.gpufleet_summary",
               GPUFLEET_TASK_TIMES_FILE=str(times), COLUMNS="400")
    args = ["-i", "localhost,", "-c", "local", str(book)]
    if guard:
        cmd = [sys.executable, "-c", GUARD, *args]
    else:
        cmd = [os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out  # the failing task
    return proc, out, times


def _private_api_deprecations(out):
    """Deprecation warnings (whitespace folded: ansible wraps them) that name a private result attribute or a
    callback plugin."""
    text = " ".join(out.split())
    found = re.findall(r"\[DEPRECATION WARNING\]:.*?(?=\[DEPRECATION WARNING\]|\[WARNING\]|$)", text)
    return [d for d in found if re.search(r"\b_(result|host|task|task_fields)\b|callback", d)]


def test_the_guard_reports_a_private_attribute(tmp_path):
    # The harness itself: a callback that reads result._result is reported.
    plugin_dir = tmp_path / "cb"
    plugin_dir.mkdir()
    (plugin_dir / "gpufleet_private_reader.py").write_text(
        "from ansible.plugins.callback import CallbackBase\n"
        "class CallbackModule(CallbackBase):\n"
        "    CALLBACK_VERSION = 2.0\n"
        "    CALLBACK_TYPE = 'aggregate'\n"
        "    CALLBACK_NAME = 'gpufleet_private_reader'\n"
        "    CALLBACK_NEEDS_ENABLED = False\n"
        "    def v2_runner_on_ok(self, result):\n"
        "        result._result.get('msg')\n")
    CALLBACK_DIRS.append(plugin_dir)
    try:
        _, out, _ = _run(tmp_path, "gpufleet.fleet.gpufleet_default")
    finally:
        CALLBACK_DIRS.remove(plugin_dir)
    assert any("CallbackTaskResult._result is read by" in d and "gpufleet_private_reader.py" in d
               for d in _private_api_deprecations(out)), out


def test_the_stdout_and_summary_callbacks_use_the_public_result_api(tmp_path):
    _, out, times = _run(tmp_path, "gpufleet.fleet.gpufleet_default")
    assert _private_api_deprecations(out) == [], out
    assert "  localhost: hello from the debug task" in out, out  # gpufleet_default's debug line
    assert "fatal: [localhost]: the failing task of the callback API test" in out, out
    # gpufleet_summary's progress line, once though the summary is loaded twice and each copy gets its own result
    assert out.count("  localhost: waiting for /health_generate: 5 s of 900 s") == 1, out
    assert out.count("GPUFLEET SUMMARY") == 1, out  # once, though loaded twice
    assert re.search(r"^localhost: failed: the failing task of the callback API test$", out, re.M), out
    rows = [json.loads(line) for line in times.read_text().splitlines()]  # gpufleet_task_times
    assert [(r["task"], r["status"]) for r in rows] == [
        ("Say something", "ok"), ("A wait slice", "failed"), ("Fail here", "failed")], rows


def test_the_test_json_callback_uses_the_public_result_api(tmp_path):
    proc, out, _ = _run(tmp_path, "gpufleet_test_json")
    assert _private_api_deprecations(out) == [], out
    doc = json.loads(proc.stdout)  # one JSON document: the summary stays silent under a JSON stdout callback
    assert [(r["task"], r["status"]) for r in doc["results"]] == [
        ("Say something", "ok"), ("A wait slice", "failed"), ("Fail here", "failed")], doc
    assert doc["results"][-1]["msg"] == "the failing task of the callback API test"


@pytest.mark.parametrize("stdout_callback", ["gpufleet.fleet.gpufleet_default", "gpufleet_test_json"])
def test_the_installed_ansible_core_prints_no_callback_deprecation(tmp_path, stdout_callback):
    # Without the guard: whatever the installed ansible-core itself deprecates about callbacks (v1 methods,
    # v2_on_any, CallbackTaskResult.task_fields in 2.21, the private attributes once 2.23 warns).
    _, out, _ = _run(tmp_path, stdout_callback, guard=False)
    assert _private_api_deprecations(out) == [], out
