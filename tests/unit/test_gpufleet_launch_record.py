"""The launch record read back as untrusted input: module_utils/gpufleet_launch_record.py and
sglang_host_info's launch_record option (the rollback's read)."""
import copy
import json
import os

import pytest
from ansible.module_utils.testing import patch_module_args
from gpu_module_harness import load_module

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_launch_record as R
from unit_template import render_unit

# A unit as releases before issue 31 wrote it (format 1: no UMask=), with an API key.
UNIT_V1 = """# Ansible managed
# SGLang server on port 30000; started and stopped by gpufleet's restart playbook.
[Unit]
Description=SGLang server (gpufleet) on 127.0.0.1:30000
After=network-online.target
Wants=network-online.target
# At most 3 crash restarts in 10 minutes (Restart=on-failure), then the unit stays failed for an operator.
StartLimitIntervalSec=600
StartLimitBurst=3

[Service]
Type=simple
User=sglang
WorkingDirectory=/var/lib/gpufleet
Environment="NCCL_IB_DISABLE=1"
Environment="SPT_NOENV=1"
# The API key: systemd expands ${NAME} in ExecStart= as one argument (systemd.service(5)); the key is never here.
EnvironmentFile=/var/lib/gpufleet/sglang-api-key.env
ExecStart=/opt/sglang/.venv/bin/python -m sglang.launch_server --model-path /models/m --host 127.0.0.1 --port 30000 --api-key ${GPUFLEET_SGLANG_API_KEY}
KillMode=control-group
KillSignal=SIGTERM
TimeoutStopSec=60s
SuccessExitStatus=137 SIGKILL
Restart=on-failure
RestartSec=30
StandardOutput=append:/var/lib/gpufleet/sglang.log
StandardError=inherit
LimitNOFILE=1048576
LimitMEMLOCK=infinity

[Install]
WantedBy=multi-user.target
"""

RECORD_V1 = {
    "format": 1, "method": "systemd",
    "argv": ["/opt/sglang/.venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/m",
             "--host", "127.0.0.1", "--port", "30000"],
    "env": {"NCCL_IB_DISABLE": "1", "SPT_NOENV": "1"}, "api_key_set": True, "host": "127.0.0.1", "port": 30000,
    "chdir": "/var/lib/gpufleet", "log_file": "/var/lib/gpufleet/sglang.log", "pid_file": "/var/lib/gpufleet/sglang.pid",
    "pid": 4242, "unit_name": "sglang.service", "unit_path": "/etc/systemd/system/sglang.service", "unit_text": UNIT_V1,
    "engine_path": "/x/engine.py", "engine_sha256": "ab" * 32, "nccl_files": [{"path": "/x/engine.py", "sha256": "ab"}],
    "nccl_env": {"NCCL_IB_DISABLE": "1"}, "recorded_at": "2026-12-01T10:00:00Z",
}


def check(record, unit_dir="/etc/systemd/system"):
    return R.check_record(json.dumps(record), unit_dir)


def refused(record, *words):
    with pytest.raises(R.RecordError) as exc:
        check(record)
    for word in words:
        assert word in str(exc.value), str(exc.value)
    return str(exc.value)


def changed(**keys):
    record = copy.deepcopy(RECORD_V1)
    record.update(keys)
    return record


def test_a_record_of_an_earlier_release_passes_with_the_keys_the_rollback_reads():
    out = check(RECORD_V1)
    assert out["method"] == "systemd" and out["port"] == 30000 and out["unit_text"] == UNIT_V1
    assert out["unit_path"] == "/etc/systemd/system/sglang.service" and out["nccl_env"] == {"NCCL_IB_DISABLE": "1"}
    assert "engine_sha256" not in out  # only what the rollback reads


def test_a_unit_with_umask_passes_and_a_process_record_too():
    assert check(changed(unit_text=UNIT_V1.replace("Type=simple\n", "Type=simple\nUMask=0027\n")))
    process = changed(method="process", unit_name=None, unit_path=None, unit_text=None, env={"NCCL_DEBUG": 2})
    assert check(process)["argv"][0] == "/opt/sglang/.venv/bin/python"


def render_template(**overrides):
    """The unit as roles/sglang_launch/templates/sglang.service.j2 writes it today (with the project's filters)."""
    values = dict(_sglang_launch_port=30000, _sglang_launch_host="0.0.0.0", sglang_service_user="first.last",
                  sglang_launch_chdir="/srv/100%/gpufleet", sglang_launch_env={"NCCL_PROTO": "LL", "X": "a b$c"},
                  sglang_launch_argv=["/opt/sglang/bin/python", "-m", "sglang.launch_server", "--x", "a b"],
                  _sglang_launch_stop_grace_s=60, sglang_launch_systemd_restart="on-failure",
                  sglang_launch_systemd_restart_sec=30, sglang_launch_log_file="/srv/100%/gpufleet/sglang.log",
                  _sglang_launch_api_key="k", _sglang_launch_api_key_env="GPUFLEET_SGLANG_API_KEY",
                  sglang_launch_api_key_file="/srv/100%/gpufleet/sglang-api-key.env")
    values.update(overrides)
    return render_unit(values)


@pytest.mark.parametrize("key", ["k", ""])
def test_every_unit_the_template_writes_passes(key):
    # A directive added to the template must be added to UNIT_DIRECTIVES too, or the rollback refuses the record.
    text = render_template(_sglang_launch_api_key=key)
    assert R.check_unit_text(text) == text
    assert check(changed(unit_text=text))["unit_text"] == text


def test_the_unit_goes_to_the_unit_dir_whatever_unit_path_says():
    out = check(changed(unit_path="/etc/cron.d/evil"), unit_dir="/etc/systemd/system")
    assert out["unit_path"] == "/etc/systemd/system/sglang.service"
    refused(changed(unit_name="../../cron.d/evil.service"), "unit_name", "plain name")
    refused(changed(unit_name="sglang.timer"), "unit_name")


@pytest.mark.parametrize("line, words", [
    ("ExecStartPre=+/bin/sh -c 'id > /tmp/pwned'", ["ExecStartPre", "not a directive gpufleet writes in [Service]"]),
    ("ExecStopPost=/bin/sh", ["ExecStopPost"]),
    ("[Socket]", ["section [Socket]"]),
])
def test_an_injected_directive_or_section_is_refused(line, words):
    text = UNIT_V1.replace("Type=simple\n", "Type=simple\n%s\n" % line)
    refused(changed(unit_text=text), *words)


def test_an_execstart_prefix_is_refused():
    for prefix in "+!-@:|":
        text = UNIT_V1.replace("ExecStart=/opt", "ExecStart=%s/opt" % prefix)
        refused(changed(unit_text=text), "ExecStart=", "prefix")


def test_user_root_no_user_or_two_execstarts_are_refused():
    refused(changed(unit_text=UNIT_V1.replace("User=sglang", "User=root")), "User=root", "other than root")
    refused(changed(unit_text=UNIT_V1.replace("User=sglang", "User=0")), "User=0")
    refused(changed(unit_text=UNIT_V1.replace("User=sglang\n", "")), "0 User= lines")
    refused(changed(unit_text=UNIT_V1.replace("KillMode", "ExecStart=/bin/true\nKillMode")), "2 ExecStart= lines")


def test_a_directive_in_another_section_or_a_continued_line_is_refused():
    refused(changed(unit_text=UNIT_V1.replace("After=network", "User=sglang\nAfter=network")), "User", "[Unit]")
    refused(changed(unit_text=UNIT_V1.replace("KillSignal=SIGTERM", "KillSignal=SIGTERM \\")), "trailing backslash")
    refused(changed(unit_text=UNIT_V1.replace("StandardError=inherit", "StandardError=socket")), "StandardError")
    refused(changed(unit_text=UNIT_V1.replace("Type=simple", "Type=simple\x1b")), "control character")


@pytest.mark.parametrize("keys, words", [
    ({"method": "shell"}, ["method"]),
    ({"port": "30000"}, ["port", "not an integer"]),
    ({"port": 70000}, ["port", "outside 1-65535"]),
    ({"port": True}, ["port"]),
    ({"host": "127.0.0.1\nExecStartPre=x"}, ["host", "control character"]),
    ({"log_file": "relative.log"}, ["log_file", "absolute normalised"]),
    ({"log_file": "/var/lib/../../etc/x"}, ["log_file"]),
    ({"env": {"BAD NAME": "1"}}, ["env", "variable name"]),
    ({"env": {"LD_PRELOAD": "/x\n"}}, ["env[LD_PRELOAD]", "control character"]),
    ({"env": ["NCCL=1"]}, ["env", "not an object"]),
    ({"api_key_set": "yes"}, ["api_key_set"]),
    ({"unit_text": 5}, ["unit_text"]),
    ({"unit_text": "x" * (R.MAX_UNIT_TEXT + 1)}, ["unit_text", "longer"]),
    ({"argv": ["/bin/python", 5]}, ["argv[1]"]),
])
def test_wrong_types_and_bounds_name_the_key(keys, words):
    refused(changed(**keys), *words)


def test_process_records_need_argv_paths():
    refused(changed(method="process", argv=[]), "argv")
    refused(changed(method="process", chdir=None), "chdir")


def test_malformed_json_oversized_or_not_an_object_is_refused():
    with pytest.raises(R.RecordError, match="not valid JSON"):
        R.check_record(b'{"method": "systemd", ', "/etc/systemd/system")
    with pytest.raises(R.RecordError, match="not a JSON object"):
        R.check_record(b"[1, 2]", "/etc/systemd/system")
    with pytest.raises(R.RecordError, match="larger than"):
        R.check_record(b" " * (R.MAX_RECORD_BYTES + 1), "/etc/systemd/system")


host_info = load_module("sglang_host_info")


def read(path, capsys, unit_dir="/etc/systemd/system"):
    with patch_module_args({"launch_record": str(path), "launch_unit_dir": unit_dir}):
        with pytest.raises(SystemExit):
            host_info.main()
    return json.loads(capsys.readouterr().out)["launch_record"]


def test_module_returns_a_checked_record_or_says_why_not(tmp_path, capsys):
    path = tmp_path / "launch.json"
    assert read(path, capsys) == {"path": str(path), "exists": False, "valid": False, "reason": None, "record": None}
    path.write_text(json.dumps(RECORD_V1))
    os.chmod(path, 0o600)
    out = read(path, capsys, unit_dir="/run/systemd/system")
    assert out["valid"] is True and out["record"]["unit_path"] == "/run/systemd/system/sglang.service"
    # Through the module's redaction net unchanged: ${GPUFLEET_SGLANG_API_KEY} names the key, it is not one.
    assert out["record"]["unit_text"] == UNIT_V1
    path.write_text("{not json")
    out = read(path, capsys)
    assert out["valid"] is False and out["record"] is None and out["reason"].startswith("not valid JSON")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_module_refuses_a_record_another_user_owns_before_reading_it(tmp_path, capsys):
    path = tmp_path / "launch.json"
    path.write_text(json.dumps(RECORD_V1))
    os.chown(path, 54321, 54321)
    out = read(path, capsys)
    assert out["valid"] is False and out["record"] is None
    assert out["reason"] == "%s (owner 54321, mode 0644) belongs to another user" % path
