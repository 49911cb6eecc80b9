"""sglang_fleet_check_info: check.yml's one read per host. Each part is read by the module_utils function its own
module uses and returned shaped as that module's result; a failing part does not stop the others; the API key
goes out in the request and comes back nowhere; the root-code check stops the read before anything else."""
import http.server
import importlib.util
import json
import os
import pathlib
import sys
import threading
import time

import psutil
import pytest

from ansible.module_utils.testing import patch_module_args
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_host_reads as host_reads
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_nccl_plan
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_errors import GpuTimeoutError
from ansible_collections.gpufleet.fleet.plugins.plugin_utils import check as chk

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sglang_fleet_check_info",
                                               ROOT / "plugins" / "modules" / "sglang_fleet_check_info.py")
mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mod)

KEY = "sk-fleet-check-7f3a9"


class _Server(http.server.BaseHTTPRequestHandler):
    health = 200
    seen = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        if self.path == "/health_generate":
            status, body = type(self).health, b""
        elif self.path == "/get_server_info":
            status, body = 200, json.dumps({"version": "0.5.23", "tp_size": 8}).encode()
        else:
            status, body = 404, b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Server.health, _Server.seen = 200, []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield "http://127.0.0.1:%d" % httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def run(capsys, args):
    with patch_module_args(args):
        with pytest.raises(SystemExit):
            mod.main()
    return json.loads(capsys.readouterr().out)


def test_one_read_finds_the_server_its_start_and_its_answers_and_returns_no_key(capsys, server, tmp_path):
    pid_file = tmp_path / "sglang.pid"
    pid_file.write_text("%d\n" % os.getpid())
    before = time.time()
    result = run(capsys, {"gather": ["server", "sglang"], "pid_file": str(pid_file), "url": server,
                          "api_key": KEY, "request_timeout_s": 5})
    assert result["gathered"] == ["server", "sglang"] and not result["changed"]
    assert result["host"] == {"managed_pid": os.getpid(), "managed_running": True}
    # The start as psutil reads it, and when that was read, both from this host's clock.
    assert result["started"]["create_time"] == pytest.approx(psutil.Process().create_time())
    assert before <= result["started"]["now"] <= time.time()
    assert result["health"]["status"] == 200 and result["health"]["url"] == server + "/health_generate"
    assert result["server_info"]["json"] == {"version": "0.5.23", "tp_size": 8}
    # The key went out with /get_server_info only (as the uri tasks sent it) and comes back nowhere.
    assert _Server.seen == [("/health_generate", None), ("/get_server_info", "Bearer " + KEY)]
    assert KEY not in json.dumps(result)
    # No sglang_python: the launch args are not resolved, and say why (the verdict then judges no drift).
    assert result["args"]["failed"] and "python" in result["args"]["msg"]
    assert "gpu" not in result and "patch_present" not in result and "workers" not in result


def test_a_server_that_does_not_answer_gets_no_info_or_args_request(capsys, server, tmp_path):
    _Server.health = 503
    result = run(capsys, {"gather": ["sglang"], "url": server, "request_timeout_s": 5})
    assert result["health"]["status"] == 503 and result["health"]["failed"]
    assert result["health"]["msg"].startswith("Status code was 503 and not [200]:")
    assert "server_info" not in result and "args" not in result
    assert [path for path, _ in _Server.seen] == ["/health_generate"]
    # Nothing listening: status -1, as ansible.builtin.uri says it.
    sock = __import__("socket").socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    result = run(capsys, {"gather": ["sglang"], "url": "http://127.0.0.1:%d" % port, "request_timeout_s": 5})
    assert result["health"]["status"] == -1 and "server_info" not in result
    verdict = chk.gpufleet_check_verdict(result)
    assert [r["code"] for r in verdict["reasons"]] == ["sglang_not_serving"]


def test_a_failed_gpu_read_is_one_failed_part_the_others_are_still_read(capsys, monkeypatch, tmp_path):
    def hung(*args, **kwargs):
        raise GpuTimeoutError("nvidia-smi did not answer within 5 s")
    monkeypatch.setattr(host_reads, "read_gpu_info", hung)
    pid_file = tmp_path / "sglang.pid"
    pid_file.write_text("999999999\n")
    result = run(capsys, {"gather": ["server", "gpu"], "pid_file": str(pid_file), "xid_window_min": 0})
    assert result["gpu"]["failed"] and result["gpu"]["error_class"] == "timeout"
    assert result["host"] == {"managed_pid": 999999999, "managed_running": False} and "started" not in result
    verdict = chk.gpufleet_check_verdict(result, {"expected_gpus": 8})
    assert [(r["severity"], r["code"]) for r in verdict["reasons"]] == [("CRIT", "timeout")]
    assert verdict["gpus_total"] == 8


def test_root_code_that_root_must_not_run_stops_the_read_before_any_part(capsys, monkeypatch, tmp_path):
    entry = {"variable": "ansible_python_interpreter", "interpreter": sys.executable, "problems": [],
             "text": "ansible_python_interpreter %s runs as root, but it is writable by uid 1000" % sys.executable}
    monkeypatch.setattr(mod, "root_code_check", lambda variable, python: entry)
    pid_file = tmp_path / "sglang.pid"
    pid_file.write_text("%d\n" % os.getpid())
    result = run(capsys, {"gather": ["server"], "pid_file": str(pid_file), "root_interpreter_self": True})
    assert result["root_code"] == [entry] and result["gathered"] == [] and "host" not in result
    verdict = chk.gpufleet_check_verdict([result, {"skipped": True}])
    assert [r["code"] for r in verdict["reasons"]] == ["root_code_untrusted"]
    # A trusted interpreter: an empty list, and the read goes on.
    monkeypatch.setattr(mod, "root_code_check", lambda variable, python: None)
    result = run(capsys, {"gather": ["server"], "pid_file": str(pid_file), "root_interpreter_self": True})
    assert result["root_code"] == [] and result["host"]["managed_running"] is True


def test_workers_are_read_only_with_nccl_env_and_a_given_pid(capsys):
    result = run(capsys, {"gather": ["nccl_workers"], "pid": 999999999, "nccl_env": {"NCCL_PROTO": "Simple"}})
    assert result["workers"]["failed"] and "not running" in result["workers"]["msg"]
    assert "workers" not in run(capsys, {"gather": ["nccl_workers"], "pid": 999999999})
    assert "workers" not in run(capsys, {"gather": ["nccl_workers"], "nccl_env": {"NCCL_PROTO": "Simple"}})


def test_sglang_needs_a_url(capsys):
    result = run(capsys, {"gather": ["sglang"]})
    assert result["failed"] and "url is required" in result["msg"]


def test_the_nccl_check_is_the_patch_plan_in_check_mode(tmp_path):
    # The same plan sglang_nccl_patch writes from: a file without the block would change, and says so.
    pkg = tmp_path / "site" / "sglang"
    (pkg / "srt" / "entrypoints").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "version.py").write_text('__version__ = "0.5.23"\n')
    engine = pkg / "srt" / "entrypoints" / "engine.py"
    engine.write_text("import os\n\n\ndef _set_envs_and_config(server_args):\n"
                      "    os.environ[\"NCCL_CUMEM_ENABLE\"] = \"0\"\n"
                      "    mp.set_start_method(\"spawn\", force=True)\n")
    before = engine.read_bytes()
    res = gpufleet_nccl_plan.check_block(path=str(engine), env={"NCCL_PROTO": "Simple"})
    assert engine.read_bytes() == before
    assert res["changed"] and [(f["changed"], f["block"]) for f in res["files"]] == [(True, "none")]
    assert res["sglang_version"] == "0.5.23" and "failed" not in res
    assert [r["code"] for r in chk.gpufleet_check_verdict({"patch_present": res})["reasons"]] == [
        "nccl_block_missing"]
    bad = gpufleet_nccl_plan.check_block(path=str(engine), env={"NCCL_PROTO": True})
    assert bad["failed"] and "NCCL_PROTO" in bad["msg"] and bad["files"] == []


@pytest.mark.realrelease
def test_one_read_finds_sglang_once_in_its_own_process_for_the_args_and_the_nccl_blocks(capsys, server, monkeypatch):
    # The module runs on the SGLang interpreter (as on the lab): SGLang is found in the module's process, once,
    # and both the launch args and the NCCL blocks are judged against that package.
    from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_sglang
    from gpu_module_harness import sglang_on_path
    from support.sglang_wheels import sglang_package_dir
    pkg = sglang_package_dir("0.5.23")
    sglang_on_path(monkeypatch, str(pkg.parent))
    searched = []
    real = gpufleet_sglang.locate_here
    monkeypatch.setattr(gpufleet_sglang, "locate_here", lambda: searched.append(1) or real())
    started = []
    monkeypatch.setattr(gpufleet_sglang, "locate_argv", lambda python: started.append(python) or [python, "-c", "1"])
    result = run(capsys, {"gather": ["sglang", "nccl_files"], "url": server, "request_timeout_s": 5,
                          "python": sys.executable, "launch_args": {"model-path": "/models/m", "tp-size": 8}, "host": "127.0.0.1",
                          "port": 30000, "nccl_env": {"NCCL_PROTO": "Simple"}})
    assert searched == [1] and started == []
    assert result["args"]["sglang_version"] == "0.5.23" and result["args"]["valid"], result["args"]
    assert os.path.realpath(result["args"]["sglang_path"]) == os.path.realpath(str(pkg))
    assert result["patch_present"]["sglang_version"] == "0.5.23" and result["patch_present"]["changed"]
    assert [os.path.relpath(p, str(pkg)) for p in result["patch_present"]["paths"]] == ["srt/entrypoints/engine.py"]


def test_uri_result_is_shaped_as_ansible_builtin_uri():
    ok = mod.uri_result("http://h/get_server_info", 200, "OK", b'{"version": "0.5.23"}', parse_json=True)
    assert ok == {"url": "http://h/get_server_info", "status": 200, "msg": "OK (21 bytes)",
                  "json": {"version": "0.5.23"}}
    assert "json" not in mod.uri_result("http://h/x", 200, "OK", b"not json", parse_json=True)
    bad = mod.uri_result("http://h/health_generate", -1, "Request failed: <urlopen error [Errno 111]>")
    assert bad == {"url": "http://h/health_generate", "status": -1, "failed": True,
                   "msg": "Status code was -1 and not [200]: Request failed: <urlopen error [Errno 111]>"}
