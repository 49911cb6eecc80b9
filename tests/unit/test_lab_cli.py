"""tests/lab/lab.py command line: what a person reads from --help."""
import os
import subprocess
import sys

LAB_PY = os.path.join(os.path.dirname(__file__), "..", "lab", "lab.py")
sys.path.insert(0, os.path.dirname(LAB_PY))
import lab as labtool  # noqa: E402


def test_fault_help_lists_every_knob_with_its_meaning():
    out = subprocess.run([sys.executable, LAB_PY, "fault", "--help"], capture_output=True, text=True, check=True).stdout
    for knob, meaning in labtool.FAULT_KNOBS.items():
        assert "%s: %s" % (knob, meaning) in out
    assert "KNOB=VALUE" in out


def _parsed(monkeypatch, argv):
    """The namespace main() hands to the subcommand for ``argv`` (the subcommand itself is not run)."""
    seen = []
    for name in ("cmd_up", "cmd_down", "cmd_status", "cmd_exec", "cmd_fault"):
        monkeypatch.setattr(labtool, name, lambda args: seen.append(vars(args)) or 0)
    assert labtool.main(argv) == 0
    return seen[0]


def test_lab_dir_is_taken_after_the_subcommand_and_host_as_well_as_before(monkeypatch):
    for argv in (["exec", "--lab-dir", "/x", "gpu-lab-01", "--", "ls", "-l"],
                 ["exec", "gpu-lab-01", "--lab-dir", "/x", "--", "ls", "-l"],
                 ["exec", "gpu-lab-01", "--lab-dir=/x", "--", "ls", "-l"],
                 ["exec", "gpu-lab-01", "--lab-dir", "/x", "ls", "-l"]):
        args = _parsed(monkeypatch, argv)
        assert (args["lab_dir"], args["host"], args["argv"][-2:]) == ("/x", "gpu-lab-01", ["ls", "-l"]), argv
    for argv in (["fault", "--lab-dir", "/x", "all", "slow_load_s=2", "tokens_per_s=9"],
                 ["fault", "all", "--lab-dir", "/x", "slow_load_s=2", "tokens_per_s=9"],
                 ["fault", "all", "slow_load_s=2", "--lab-dir", "/x", "tokens_per_s=9"],
                 ["fault", "all", "slow_load_s=2", "tokens_per_s=9", "--lab-dir=/x"]):
        args = _parsed(monkeypatch, argv)
        assert (args["lab_dir"], args["host"], args["knobs"]) == ("/x", "all", ["slow_load_s=2", "tokens_per_s=9"]), argv
    # an option between the knobs (found by a fresh-user trial: "unrecognized arguments: slow_load_s=40")
    args = _parsed(monkeypatch, ["fault", "gpu-lab-03", "--lab-dir", "/x", "--clear", "slow_load_s=40"])
    assert (args["clear"], args["knobs"]) == (True, ["slow_load_s=40"])
    args = _parsed(monkeypatch, ["fault", "gpu-lab-03", "a=1", "--clear", "b=2"])
    assert (args["clear"], args["knobs"]) == (True, ["a=1", "b=2"])
    for sub in ("up", "down", "status"):
        assert _parsed(monkeypatch, [sub, "--lab-dir", "/x"])["lab_dir"] == "/x"


def test_exec_leaves_the_commands_own_arguments_alone(monkeypatch):
    args = _parsed(monkeypatch, ["exec", "gpu-lab-01", "--", "grep", "--lab-dir", "/y", "f"])
    assert args["argv"][-4:] == ["grep", "--lab-dir", "/y", "f"] and args["lab_dir"] == labtool.DEFAULT_LAB_DIR
    args = _parsed(monkeypatch, ["exec", "gpu-lab-01", "grep", "--lab-dir", "/y", "f"])
    assert args["argv"] == ["grep", "--lab-dir", "/y", "f"] and args["lab_dir"] == labtool.DEFAULT_LAB_DIR


def test_the_lab_router_is_recognised_under_its_own_process_title(tmp_path):
    """lab_router.stop() finds the router it started by pid and command line: sglang-router retitles itself
    "sglang::router", which the module-name match missed (a CI run left a router running)."""
    import json
    import time
    import lab_router
    code = ("import setproctitle, time; setproctitle.setproctitle('sglang::router'); print('up', flush=True); "
            "time.sleep(60)")
    titled = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert titled.stdout.readline().strip() == b"up"
        assert lab_router._alive_router(titled.pid)
        assert not lab_router._alive_router(plain.pid)
        # stop() by the recorded pid ends it
        with open(lab_router._record(str(tmp_path)), "w") as fh:
            json.dump({"pid": titled.pid}, fh)
        assert lab_router.stop(str(tmp_path)) is True
        deadline = time.time() + 10
        while titled.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert titled.returncode is not None
    finally:
        for proc in (titled, plain):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
