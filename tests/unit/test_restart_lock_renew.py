"""playbooks/tasks/restart_lock_renew.yml in a real ansible-playbook run on a local host (no lab): verify's renewal
is skipped when the readiness slice renewed the lease as it saw the server ready, and runs (and fails naming the
loss) when that renewal at readiness failed, whatever the lease."""
import json
import os
import pathlib
import subprocess
import sys

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_lock

ROOT = pathlib.Path(__file__).resolve().parents[2]
RENEW = ROOT / "playbooks" / "tasks" / "restart_lock_renew.yml"

PLAYBOOK = """
- hosts: all
  gather_facts: false
  vars:
    sglang_launch_method: process
    gpufleet_lock_dir: "{{ lock_dir }}"
    gpufleet_run_id: run-1
    _gpufleet_lock_held: true
    _gpufleet_lock_lease_s: 300
    _gpufleet_lock_min_lease_s: 300
  tasks:
    - name: Renew as restart.yml's verify phase does
      ansible.builtin.import_tasks: %s
      vars:
        gpufleet_phase: verify
""" % RENEW


def _run(tmp_path, **hostvars):
    local = dict(ansible_connection="local", ansible_python_interpreter=sys.executable, **hostvars)
    (tmp_path / "inv.json").write_text(json.dumps({"all": {"hosts": {"h1": local}}}))
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_STDOUT_CALLBACK="ansible.builtin.default",
               ANSIBLE_NOCOLOR="1", PATH=os.path.dirname(sys.executable) + ":" + os.environ["PATH"])
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i",
                           str(tmp_path / "inv.json"), str(tmp_path / "play.yml")],
                          cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def _expires(lock_dir):
    return json.loads((lock_dir / "owner.json").read_text())["expires_at"]


def test_verify_skips_its_renewal_after_one_at_readiness_and_renews_when_that_one_failed(tmp_path):
    lock_dir = tmp_path / "restart.lock"
    gpufleet_lock.take_lease(str(lock_dir), {"run_id": "run-1"}, lease_s=300)
    before = _expires(lock_dir)
    # Renewed at readiness, verify not in the renew phases: no round trip, the lease is untouched.
    rc, out = _run(tmp_path, lock_dir=str(lock_dir), sglang_launch_ready_lease_renewed=True,
                   _gpufleet_lock_renew_phases=["verify"])
    assert rc == 0 and "skipping: [h1]" in out, out
    assert _expires(lock_dir) == before
    # No slice saw it ready (the start did): verify renews as its phase list says.
    rc, out = _run(tmp_path, lock_dir=str(lock_dir), _gpufleet_lock_renew_phases=["verify"])
    assert rc == 0 and "ok: [h1]" in out, out
    assert _expires(lock_dir) > before
    # The renewal at readiness failed: verify renews even when its phase list (a long lease) says no, and the
    # lock being gone fails the task naming that.
    gpufleet_lock.release_lease(str(lock_dir), "run-1")
    rc, out = _run(tmp_path, lock_dir=str(lock_dir), sglang_launch_ready_lease_renewed=False,
                   sglang_launch_ready_lease_error="the restart lock is gone", _gpufleet_lock_renew_phases=[])
    assert rc == 2 and "fatal: [h1]" in out and "gone" in out, out
    # Same lease and no failure at readiness: nothing runs.
    rc, out = _run(tmp_path, lock_dir=str(lock_dir), _gpufleet_lock_renew_phases=[])
    assert rc == 0 and "skipping: [h1]" in out, out


# restart.yml's rolling play (playbooks/vars/restart_host.yml) works the lease plan out through the core (plugins/plugin_utils/phases.py lock_plan):
# its own lease variables, rendered by a real ansible-playbook with the variables a user sets.
PLAN_PLAYBOOK = """
- hosts: all
  gather_facts: false
  vars_files: [%s]
  vars: %s
  tasks:
    - name: Show the plan
      ansible.builtin.debug:
        msg: "PLAN {{ {'min': _gpufleet_lock_min_lease_s | int, 'renew': _gpufleet_lock_renew_phases,
                       'free': _gpufleet_lock_plan.wait_renews_when_memory_free} | to_json }}"
"""


def _plan(tmp_path, **extra):
    import yaml
    # the rolling play's variables: playbooks/vars/restart_host.yml (restart.yml loads it, as tune.yml does)
    play_vars = yaml.safe_load((ROOT / "playbooks" / "vars" / "restart_host.yml").read_text())
    lease_vars = {k: v for k, v in play_vars.items() if k.startswith("_gpufleet_lock_")}
    (tmp_path / "plan.yml").write_text(PLAN_PLAYBOOK % (ROOT / "playbooks" / "vars" / "restart_lock.yml",
                                                        json.dumps(lease_vars)))
    (tmp_path / "inv.json").write_text(json.dumps({"all": {"hosts": {"h1": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_STDOUT_CALLBACK="ansible.builtin.default",
               ANSIBLE_NOCOLOR="1")
    argv = [os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", str(tmp_path / "inv.json"),
            str(tmp_path / "plan.yml")]
    for key, value in extra.items():
        argv += ["-e", "%s=%s" % (key, value)]
    done = subprocess.run(argv, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.split('"msg": "PLAN ', 1)[1].split('"\n', 1)[0].replace('\\"', '"'))


def test_restart_yml_renews_at_wait_and_verify_by_default_and_nowhere_with_a_long_lease(tmp_path):
    assert _plan(tmp_path) == {"min": 300, "renew": ["wait", "verify"], "free": False}
    assert _plan(tmp_path, gpufleet_lock_lease_s=325) == {"min": 300, "renew": ["launch", "verify"], "free": False}
    assert _plan(tmp_path, gpufleet_lock_lease_s=355)["renew"] == []
    # a longer verify request raises the least lease; a long start window makes the free-memory stop renew at wait
    assert _plan(tmp_path, sglang_verify_request_timeout_s=200, sglang_launch_start_wait_s=300) == {
        "min": 460, "renew": ["verify"], "free": True}
