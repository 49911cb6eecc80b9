"""plugins/plugin_utils/preflight.py: the restart preflight's decision from one host's reads (no Ansible, no host)."""
import pytest

from ansible_collections.gpufleet.fleet.plugins.plugin_utils import preflight as pf

ARGS = {"valid": True, "sglang_version": "0.5.23", "errors": [], "dest_values": {}, "resolved": {}}
PATCH = {"changed": True, "paths": ["/v/engine.py"], "files": [{"path": "/v/engine.py", "changed": True}],
         "hand_edits": []}
HOST = {"disk": [{"path": "/var/lib/gpufleet", "measured_path": "/var/lib", "free_mib": 5000}],
        "shm": {"path": "/dev/shm", "exists": True, "free_mib": 4000, "size_mib": 8000, "free_after_stop_mib": 4000,
                "kept_segments": []},
        "managed_pid": 4242, "port": {"listeners": []}, "model_dirs": [], "write_access": [], "ownership": [],
        "gpu_after_stop": {"gpus": [], "holders": [], "baseline_mib": {}, "unreadable": []}, "restart_lock": None}
STOP = {"signalled": [{"pid": 4242}], "main_pid": 4242}
SETTINGS = {"launch_method": "process", "pid_file": "/var/lib/gpufleet/sglang.pid", "port": 30000, "host": "h1",
            "lock_dir": "/var/lib/gpufleet/restart.lock", "run_id": "run-2", "world_size": 8}


def reads(**over):
    login = {"args": dict(ARGS), "patch": dict(PATCH), "gpu": {"gpus": [{}]}, "stop_preview": dict(STOP),
             "host": dict(HOST), "model_paths": []}
    login.update(over.pop("login", {}))
    out = {"root_check": False, "login": login, "become": None, "stop_preview": None, "patch_access": None}
    out.update(over)
    return out


def test_a_clean_host_goes_ahead_and_keeps_what_the_run_needs():
    d = pf.judge(reads(), SETTINGS)
    assert d["problems"] == [] and d["refusal"] is None
    assert d["server_ran"] is True and d["stop_preview"]["main_pid"] == 4242
    assert d["server_gpus"] == {"gpus": [], "world_size": 8, "env": {}}


def test_a_port_held_by_another_process_names_pid_command_and_the_managed_server():
    host = dict(HOST, port={"listeners": [
        {"address": "0.0.0.0", "pid": 77, "cmdline": ["nc", "-l", "30000"], "conflicts": True, "managed": False},
        {"address": "127.0.0.1", "pid": 4242, "cmdline": ["sglang"], "conflicts": True, "managed": True}]})
    d = pf.judge(reads(login={"host": host}), SETTINGS)
    assert d["problems"] == ["port 30000 is held by pid 77 (nc -l 30000) on 0.0.0.0, which is not the SGLang server "
                             "being replaced (pid file /var/lib/gpufleet/sglang.pid: pid 4242); stop it or choose "
                             "another sglang_port"]
    assert d["refusal"] == "preflight refused the host, nothing was stopped or changed: " + d["problems"][0]
    assert d["fail_msg"][0] == "sglang_preflight on h1 found 1 problem(s); nothing was stopped or changed:"


def test_model_paths_missing_come_before_those_that_are_no_directory_and_hub_ids_are_warned():
    paths = [{"key": "tokenizer_path", "value": "/m/tok", "local": True, "exists": True, "isdir": False},
             {"key": "model_path", "value": "/m/none", "local": True, "exists": False},
             {"key": "speculative_draft_model_path", "value": "org/draft", "local": False}]
    d = pf.judge(reads(login={"model_paths": paths}), SETTINGS)
    assert d["problems"] == [
        "--model-path /m/none: does not exist on this host; copy the model there or fix sglang_launch_args",
        "--tokenizer-path /m/tok: is not a directory; copy the model there or fix sglang_launch_args"]
    assert d["notes"][0].startswith("WARNING: --speculative-draft-model-path org/draft is not a local path")
    assert pf.judge(reads(login={"model_paths": paths}), dict(SETTINGS, allow_hub_ids="true"))["notes"] == []
    # what the weight prefetch reads: every path flag's value as SGLang's parser resolved it, hub ids too
    assert d["model_paths"] == ["/m/tok", "/m/none", "org/draft"]


def test_a_gpu_holder_the_wait_cannot_pass_is_refused_even_with_warn_and_names_the_settings():
    after = {"gpus": [{"index": 0, "foreign_listed": True, "remaining_mib": 3000}],
             "holders": [{"text": "pid 9 (python train.py) 3000 MiB on GPU 0"}], "baseline_mib": {}, "unreadable": []}
    host = dict(HOST, gpu_after_stop=after)
    d = pf.judge(reads(login={"host": host}), dict(SETTINGS, gpu_holders="warn"))
    assert d["problems"] == [
        "GPU memory held by a process the stop will not end: pid 9 (python train.py) 3000 MiB on GPU 0; the wait for "
        "free GPU memory after the stop would fail: stop it (or ask its owner) and rerun; if the new server fits "
        "beside it, set gpu_memory_wait_require_no_processes=false and gpu_memory_wait_max_used_mib=3000 (the MiB it "
        "leaves on its GPU; now 1024) with gpufleet_preflight_gpu_holders=warn (warn alone does not help: the run "
        "would stop the server and then wait in vain)"]
    passing = dict(SETTINGS, gpu_holders="warn", gpu_require_no_processes="false", gpu_max_used_mib=4096)
    d = pf.judge(reads(login={"host": host}), passing)
    assert d["problems"] == [] and d["notes"][0].startswith("WARNING: GPU memory held by a process the stop will not end")
    assert "the wait after the stop passes beside it" in d["notes"][0]
    refuse = pf.judge(reads(login={"host": host}), dict(passing, gpu_holders="refuse"))
    assert refuse["problems"][0].endswith(" (or set gpufleet_preflight_gpu_holders=warn to go ahead)")


def test_another_runs_lock_is_the_refusal_alone_and_counts_the_other_findings():
    lock = {"run_id": "run-1", "controller": "ctl-a", "pid": 99, "user": "ops", "remaining_s": 120.4, "expired": False}
    host = dict(HOST, restart_lock=lock, disk=[{"path": "/x", "measured_path": "/", "free_mib": 1}])
    d = pf.judge(reads(login={"host": host}), SETTINGS)
    assert d["problems"] == [
        "locked by another restart: run run-1 from ctl-a (pid 99, user ops), lease expires in 120 s "
        "(/var/lib/gpufleet/restart.lock). Wait for that run to finish or for its lease to end; if it is certainly "
        "gone, run playbooks/unlock.yml -e target=h1 (1 other finding(s) not listed: while that run restarts the "
        "host, GPU memory, the port and /dev/shm show its work)"]
    assert pf.judge(reads(login={"host": dict(host, restart_lock=dict(lock, run_id="run-2"))}),
                    SETTINGS)["problems"][0].startswith("1 MiB free on the filesystem of /x")
    assert pf.judge(reads(login={"host": dict(host, restart_lock=dict(lock, expired=True))}),
                    SETTINGS)["problems"][0].startswith("1 MiB free")


def test_root_code_refuses_before_anything_else_is_judged():
    login = {"changed": False, "gathered": [], "root_code": [{"text": "/opt/venv/lib/x.pth is owned by sglang"}]}
    d = pf.judge({"root_check": True, "login": login}, SETTINGS)
    assert d["problems"] == ["/opt/venv/lib/x.pth is owned by sglang"] and d["server_ran"] is None
    failed = pf.judge({"root_check": True, "login": {"failed": True, "msg": "boom"}}, SETTINGS)
    assert failed["problems"] == ["could not check what root runs: boom"]


def test_the_patch_write_access_of_another_user_is_judged_only_for_files_it_changes():
    access = {"write_access": [
        {"path": "/v/engine.py", "ok": False, "reason": "user ops cannot create files in /v", "user": "ops"},
        {"path": "/v/other.py", "ok": False, "reason": "user ops cannot create files in /v", "user": "ops"}]}
    d = pf.judge(reads(patch_access=access), SETTINGS)
    assert d["problems"] == [
        "NCCL patch could not write /v/engine.py: user ops cannot create files in /v; the patch runs as the connecting "
        "user (ansible_user): make the SGLang virtualenv writable for ops, or set sglang_nccl_patch_become=true"]
    d = pf.judge(reads(patch_access={"failed": True, "msg": "no psutil"}), SETTINGS)
    assert d["problems"] == ["could not check write access to /v/engine.py: no psutil"]


def test_the_become_read_replaces_the_host_parts_and_a_failed_one_is_named():
    become = {"gpu": {"failed": True, "msg": "NVML: driver not loaded"}, "stop_preview": dict(STOP),
              "host": dict(HOST), "model_paths": []}
    d = pf.judge(reads(login={"gpu": None, "host": None}, become=become), SETTINGS)
    assert d["problems"][0].startswith("GPUs not usable: NVML: driver not loaded -- the running server is left")
    d = pf.judge(reads(become={"failed": True, "msg": "Timeout"}), SETTINGS)
    assert d["problems"] == ["host measurement failed: Timeout"]


def test_sglang_refusals_keep_their_words():
    args = dict(ARGS, errors=[{"message": "--tp-size: invalid int value: 'x'"}])
    patch = {"failed": True, "msg": "invalid env: NCCL_PROTO: not one of Simple, LL, LL128"}
    d = pf.judge(reads(login={"args": args, "patch": patch}), SETTINGS)
    assert d["problems"][:2] == ["sglang_launch_args (sglang 0.5.23): --tp-size: invalid int value: 'x'",
                                 "sglang_nccl_env refused: NCCL_PROTO: not one of Simple, LL, LL128"]
    d = pf.judge(reads(login={"args": {"failed": True, "msg": "no sglang"}}), SETTINGS)
    assert d["problems"][0] == "SGLang not usable: no sglang"
    assert len(d["refusal"].split(" | ")) == 1 or d["refusal"].startswith("preflight refused the host")


# ------------------------------------------------------------------------------ variable_problems

def _values(**changed):
    values = {
        "sglang_launch_args": {"model-path": "/models/m", "tp-size": 8}, "sglang_python": "/opt/sglang/bin/python",
        "sglang_launcher": ["/opt/sglang/bin/python", "-m", "sglang.launch_server"], "sglang_port": 30000,
        "sglang_host": "127.0.0.1", "sglang_launch_method": "systemd", "sglang_state_dir": "/var/lib/gpufleet",
        "sglang_service_user": "sglang", "sglang_launch_stop_timeout_s": None,
        "sglang_launch_systemd_restart": "on-failure", "sglang_nccl_env": {"NCCL_PROTO": "LL"},
        "sglang_api_key": "", "gpufleet_preflight_gpu_holders": "refuse", "gpu_memory_wait_max_used_mib": 1024,
        "sglang_preflight_min_disk_free_mib": 1024, "sglang_preflight_min_shm_free_mib": 512,
        "unit_values": {"sglang_state_dir": "/var/lib/gpufleet", "sglang_host": "127.0.0.1"},
    }
    values.update(changed)
    return values


def test_sound_variables_have_no_problem():
    assert pf.variable_problems(_values()) == []
    # YAML's no (False) is a restart policy the unit takes; the process method needs no service user.
    assert pf.variable_problems(_values(sglang_launch_systemd_restart=False, sglang_launch_method="process",
                                        sglang_service_user="", sglang_port="8080")) == []


@pytest.mark.parametrize("changed, expected", [
    ({"sglang_launch_args": {}}, "sglang_launch_args is empty or null: give the SGLang flags as a mapping, at least "
     "model-path (e.g. {model-path: /models/Llama-3.1-8B-Instruct, tp-size: 8})"),
    ({"sglang_launch_args": ["--tp-size", "8"]}, "sglang_launch_args is not a mapping: give the SGLang flags"),
    ({"sglang_python": ""}, "sglang_python is not set: give the interpreter of the SGLang virtualenv"),
    ({"sglang_launcher": "/opt/sglang/bin/python -m sglang.launch_server"}, "sglang_launcher must be a non-empty list"),
    ({"sglang_launcher": ["/opt/sglang/bin/python", 3]}, "sglang_launcher must be a non-empty list of strings"),
    ({"sglang_port": "abc"}, 'sglang_port must be a port number between 1 and 65535, got "abc"'),
    ({"sglang_port": 70000}, 'sglang_port must be a port number between 1 and 65535, got "70000"'),
    ({"sglang_port": 0}, 'got "0"'),
    ({"sglang_host": ""}, 'sglang_host must be the bind address, e.g. 127.0.0.1, got ""'),
    ({"sglang_launch_method": "docker"}, 'sglang_launch_method must be systemd or process, got "docker"'),
    ({"sglang_state_dir": "state"}, 'sglang_state_dir must be an absolute path, got "state"'),
    ({"sglang_service_user": None, "sglang_launch_method": "process"}, 'sglang_service_user must be a user name, got "None"'),
    ({"sglang_service_user": ""}, "sglang_service_user is not set: the systemd method runs the server as this "
     "unprivileged user"),
    ({"sglang_launch_stop_timeout_s": 30}, 'sglang_launch_stop_timeout_s is no longer used: TimeoutStopSec= of the unit '
     'is sglang_stop_grace_s, the one stop grace of the stop role and the unit; set sglang_stop_grace_s (got "30") and '
     "remove sglang_launch_stop_timeout_s"),
    ({"sglang_launch_systemd_restart": "always"}, 'sglang_launch_systemd_restart must be "no" or on-failure, got '
     '"always": other policies restart'),
    ({"sglang_nccl_env": "NCCL_PROTO=LL"}, "sglang_nccl_env must be a mapping of variable name to value"),
    ({"sglang_nccl_env": {"NCCL PROTO": "LL", "1X": "1", "OK_1": "1"}}, "sglang_nccl_env has invalid variable names "
     "NCCL PROTO, 1X: names must match"),
    ({"sglang_launch_args": {"model-path": "/m", "api-key": "sk-1", "admin_api_key": "sk-2"}},
     "api-key, admin_api_key in sglang_launch_args would show the key in task output"),
    # abbreviations SGLang's parser reads as the key flag (argparse allow_abbrev): the key would be on the argv
    ({"sglang_launch_args": {"model-path": "/m", "api-k": "sk-1", "admin-api": "sk-2"}},
     "api-k, admin-api in sglang_launch_args would show the key in task output"),
    ({"sglang_api_key": ["a", "b"]}, "sglang_api_key must be text, one bearer token; the value is not shown here"),
    ({"gpufleet_preflight_gpu_holders": "ignore"}, 'gpufleet_preflight_gpu_holders must be refuse or warn, got "ignore"'),
    ({"gpu_memory_wait_max_used_mib": -1}, 'gpu_memory_wait_max_used_mib must be a number of MiB (0 or more), got "-1"'),
    ({"sglang_preflight_min_shm_free_mib": -5}, "sglang_preflight_min_disk_free_mib and "
     "sglang_preflight_min_shm_free_mib must not be negative"),
    ({"unit_values": {"sglang_host": "127.0.0.1\nExecStartPre=/bin/sh"}}, "sglang_host"),
])
def test_each_unsound_variable_is_one_problem_naming_it(changed, expected):
    problems = pf.variable_problems(_values(**changed))
    assert len(problems) == 1, problems
    assert expected in problems[0]
    assert "sk-1" not in " ".join(problems) and "sk-2" not in " ".join(problems)


def test_problems_come_in_a_fixed_order_and_all_at_once():
    problems = pf.variable_problems(_values(sglang_port="x", sglang_python="", sglang_launch_method="lxc"))
    assert [p.split(" ")[0] for p in problems] == ["sglang_python", "sglang_port", "sglang_launch_method"]
