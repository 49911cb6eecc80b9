"""gpufleet filters: SGLang argv rendering, systemd quoting, summary table, restart lock holder."""
import os
import shlex
import subprocess
import sys

import pytest
from ansible.errors import AnsibleFilterError

from plugins.filter import gpufleet as f
from unit_template import render_unit

LAUNCHER = ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]


def test_argv_renders_flags_bare_omitted_lists_and_host_port():
    args = {
        "model-path": "/models/Llama-3.1-8B-Instruct",
        "speculative-algorithm": "EAGLE3",
        "speculative-num-steps": 3,
        "tp-size": 8,
        "trust-remote-code": True,
        "enable-metrics": False,
        "chunked-prefill-size": None,
        "cuda-graph-bs": [1, 2, 4],
        "json-model-override-args": {"rope_scaling": {"type": "yarn"}},
        "mem-fraction-static": 0.85,
    }
    argv = f.sglang_argv(args, LAUNCHER, "0.0.0.0", 30001)
    assert argv == LAUNCHER + [
        "--model-path", "/models/Llama-3.1-8B-Instruct", "--speculative-algorithm", "EAGLE3",
        "--speculative-num-steps", "3", "--tp-size", "8", "--trust-remote-code",
        "--cuda-graph-bs", "1", "2", "4",
        "--json-model-override-args", '{"rope_scaling":{"type":"yarn"}}',
        "--mem-fraction-static", "0.85",
        "--host", "0.0.0.0", "--port", "30001"]


def test_argv_keeps_values_with_shell_characters_as_single_elements():
    argv = f.sglang_argv({"served-model-name": "m; rm -rf / $(x)"}, LAUNCHER)
    assert argv[argv.index("--served-model-name") + 1] == "m; rm -rf / $(x)"


@pytest.mark.parametrize("args, message", [
    ({"--tp-size": 8}, "without leading dashes"),
    ({"port": 1}, "sglang_port"),
    ({"host": "0.0.0.0"}, "sglang_host"),
    # abbreviations SGLang's parser takes for them: the appended --host/--port would silently win
    ({"ho": "0.0.0.0"}, r"'ho' \(SGLang reads it as --host\): set sglang_host instead"),
    ({"por": 1}, r"'por' \(SGLang reads it as --port\): set sglang_port instead"),
    ({"tp size": 8}, "not an option name"),
    ({"cuda-graph-bs": [True]}, "ambiguous"),
])
def test_argv_rejects_bad_input_with_a_clear_message(args, message):
    with pytest.raises(AnsibleFilterError, match=message):
        f.sglang_argv(args, LAUNCHER)


def test_argv_rejects_a_string_launcher():
    with pytest.raises(AnsibleFilterError, match="list of strings"):
        f.sglang_argv({}, "python -m sglang.launch_server")


def _systemd_split(line):
    """Reference unquoting of systemd's ExecStart rules for the characters we emit (C escapes, %%, $$)."""
    words, cur, i, quoted, inword = [], [], 0, False, False
    while i < len(line):
        c = line[i]
        if c == "%":
            assert line[i + 1] == "%", "unescaped specifier in %r" % line
            cur.append("%"); i += 2; inword = True; continue
        if c == "$":
            assert line[i + 1] == "$", "unescaped variable in %r" % line
            cur.append("$"); i += 2; inword = True; continue
        if c == "\\":
            if line[i + 1] == "x":
                cur.append(chr(int(line[i + 2:i + 4], 16))); i += 4; continue
            cur.append({"n": "\n", "t": "\t", "r": "\r"}.get(line[i + 1], line[i + 1])); i += 2; continue
        if c == '"':
            quoted = not quoted; inword = True; i += 1; continue
        if c == " " and not quoted:
            if inword or cur:
                words.append("".join(cur))
            cur, inword = [], False; i += 1; continue
        cur.append(c); inword = True; i += 1
    if inword or cur:
        words.append("".join(cur))
    return words


@pytest.mark.parametrize("word", [
    "/opt/sglang/bin/python", "--model-path", "/models/with space/m", 'say "hi"', "back\\slash",
    "100%", "$HOME", "${X}", "", ";", "tab\tnew\nline", "it's", "{\"a\":1}", "esc\x1b[31m\x7f\x0b\x0c",
])
def test_systemd_quote_round_trips(word):
    quoted = f.systemd_quote(word)
    assert _systemd_split(quoted) == [word]
    assert not [c for c in quoted if ord(c) < 0x20 or ord(c) == 0x7f]  # no raw control byte in the unit


def test_systemd_quote_leaves_plain_words_bare_and_doubles_specifiers():
    assert f.systemd_quote("/models/Llama-3.1-8B") == "/models/Llama-3.1-8B"
    assert f.systemd_quote("50%") == "50%%"
    assert f.systemd_quote("a b") == '"a b"'


def test_systemd_quote_refuses_nul():
    with pytest.raises(AnsibleFilterError, match="NUL"):
        f.systemd_quote("a\x00b")


def test_systemd_env_assignment_escapes_and_validates_names():
    assert f.systemd_env_assignment("LL", "NCCL_PROTO") == '"NCCL_PROTO=LL"'
    assert f.systemd_env_assignment('a"b\\c 5%', "X") == '"X=a\\"b\\\\c 5%%"'
    assert f.systemd_env_assignment(16777216, "NCCL_BUFFSIZE") == '"NCCL_BUFFSIZE=16777216"'
    with pytest.raises(AnsibleFilterError, match="not valid"):
        f.systemd_env_assignment("x", "BAD-NAME")


def test_summary_table_aligns_and_marks_missing_values():
    table = f.gpufleet_summary_table([
        {"host": "gpu-a", "result": "ok", "downtime_s": 41.234, "release_wait_ms": 830, "tokens_per_s": 1520.44,
         "nccl": "ok", "old_pid": 10, "new_pid": 20, "prefetch_gib": 12.01, "prefetch_s": 8.26, "resident_pct": 99.9},
        {"host": "gpu-bb", "result": "failed", "downtime_s": None, "nccl": "fail"},
    ])
    lines = table.splitlines()
    assert lines[0].split() == ["host", "result", "downtime_s", "release_wait_ms", "prefetch", "tokens_per_s",
                                "nccl", "old_pid", "new_pid"]
    assert lines[1].split() == ["gpu-a", "ok", "41.2", "830", "12.0G/8.3s/99%", "1520.4", "ok", "10", "20"]
    assert lines[2].split() == ["gpu-bb", "failed", "-", "-", "-", "-", "fail", "-", "-"]
    assert lines[1].index("41.2") == lines[0].index("downtime_s")


def _render_unit(**overrides):
    argv = f.sglang_argv({"model-path": "/models/Llama 3.1 8B", "served-model-name": "m%1$x", "tp-size": 8,
                          "trust-remote-code": True}, LAUNCHER, "0.0.0.0", 30000)
    values = dict(_sglang_launch_port=30000, _sglang_launch_host="0.0.0.0", sglang_service_user="sglang",
                  sglang_launch_chdir="/var/lib/gpufleet", sglang_launch_env={"NCCL_PROTO": "LL", "ODD": 'a "b" 5%'},
                  sglang_launch_argv=argv, _sglang_launch_stop_grace_s=60, sglang_launch_systemd_restart="no",
                  sglang_launch_systemd_restart_sec=30,
                  sglang_launch_log_file="/var/lib/gpufleet/sglang.log")
    values.update(overrides)
    return argv, render_unit(values)


def test_unit_template_execstart_round_trips_the_argv_and_carries_env_user_killmode():
    argv, unit = _render_unit()
    lines = unit.splitlines()
    [exec_start] = [l for l in lines if l.startswith("ExecStart=")]
    assert _systemd_split(exec_start[len("ExecStart="):]) == argv
    assert 'Environment="NCCL_PROTO=LL"' in lines
    assert 'Environment="ODD=a \\"b\\" 5%%"' in lines
    assert "User=sglang" in lines and "KillMode=control-group" in lines and "TimeoutStopSec=60s" in lines
    assert "Restart=no" in lines and "SuccessExitStatus=137 SIGKILL" in lines
    assert "StandardOutput=append:/var/lib/gpufleet/sglang.log" in lines
    assert "UMask=0027" in lines  # the log systemd creates is owner and group only (issue 31)


def test_unit_template_stop_timeout_is_the_stop_grace_and_restart_policy_is_bounded():
    # one grace value (sglang_stop_grace_s) drives TimeoutStopSec=; fractions stay, whole numbers lose ".0"
    _, unit = _render_unit(_sglang_launch_stop_grace_s=12.5, sglang_launch_systemd_restart="on-failure",
                           sglang_launch_systemd_restart_sec=45)
    lines = unit.splitlines()
    assert "TimeoutStopSec=12.5s" in lines
    assert "Restart=on-failure" in lines and "RestartSec=45" in lines
    assert "StartLimitBurst=3" in lines and "StartLimitIntervalSec=600" in lines
    _, unit = _render_unit(_sglang_launch_stop_grace_s="90")
    assert "TimeoutStopSec=90s" in unit.splitlines()
    # grace 0 = SIGKILL at once; systemd would read TimeoutStopSec=0 as "never SIGKILL" (systemd.service(5))
    _, unit = _render_unit(_sglang_launch_stop_grace_s=0)
    assert "TimeoutStopSec=1ms" in unit.splitlines()
    # %g writes an exponent for these, which systemd's time parser refuses (it would keep its default timeout)
    for grace, text in ((1e-05, "TimeoutStopSec=1ms"), (1e6, "TimeoutStopSec=1000000000ms"), ("0.0004", "TimeoutStopSec=0.0004s")):
        _, unit = _render_unit(_sglang_launch_stop_grace_s=grace)
        assert text in unit.splitlines(), (grace, [x for x in unit.splitlines() if "TimeoutStop" in x])


def test_unit_template_with_an_api_key_names_the_env_file_and_never_holds_the_key():
    key = "sk-unit-3b8f0e"
    argv, unit = _render_unit(_sglang_launch_api_key=key, _sglang_launch_api_key_env="GPUFLEET_SGLANG_API_KEY",
                              sglang_launch_api_key_file="/var/lib/gpufleet/sglang-api-key.env")
    assert key not in unit
    lines = unit.splitlines()
    assert "EnvironmentFile=/var/lib/gpufleet/sglang-api-key.env" in lines
    [exec_start] = [l for l in lines if l.startswith("ExecStart=")]
    # systemd expands a lone ${NAME} word into exactly one argument (systemd.service(5), "Command lines").
    head, sep, tail = exec_start[len("ExecStart="):].rpartition(" --api-key ")
    assert sep and tail == "${GPUFLEET_SGLANG_API_KEY}"
    assert _systemd_split(head) == argv
    _, without = _render_unit(_sglang_launch_api_key="")
    assert "EnvironmentFile=" not in without and "--api-key" not in without


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lock_holder_gone_only_for_a_dead_run_of_this_controller(monkeypatch):
    monkeypatch.setattr(f.socket, "gethostname", lambda: "ctl-7")
    dead = _dead_pid()
    assert f.gpufleet_lock_holder_gone({"controller": "ctl-7", "pid": dead, "run_id": "r1"})
    # another controller, a shared hostname, no pid, no owner.json: never judged gone
    assert not f.gpufleet_lock_holder_gone({"controller": "awx-1", "pid": dead})
    monkeypatch.setattr(f.socket, "gethostname", lambda: "localhost")
    assert not f.gpufleet_lock_holder_gone({"controller": "localhost", "pid": dead})
    monkeypatch.setattr(f.socket, "gethostname", lambda: "ctl-7")
    assert not f.gpufleet_lock_holder_gone({"controller": "ctl-7"})
    assert not f.gpufleet_lock_holder_gone({"run_id": "unknown (no owner.json)"})
    # a live ansible process holds it; a reused pid running something else does not
    ansible_like = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "ansible-playbook"])
    other = subprocess.Popen(["sleep", "30"])
    try:
        assert not f.gpufleet_lock_holder_gone({"controller": "ctl-7", "pid": ansible_like.pid})
        assert f.gpufleet_lock_holder_gone({"controller": "ctl-7", "pid": other.pid})
        assert not f.gpufleet_lock_holder_gone({"controller": "ctl-7", "pid": os.getppid()})
    finally:
        ansible_like.kill()
        other.kill()
        ansible_like.wait()
        other.wait()
