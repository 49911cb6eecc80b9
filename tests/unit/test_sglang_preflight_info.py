"""sglang_preflight_info: the restart preflight's one read per host. Each part is read by the module_utils function
its own module uses and returned shaped as that module's result; a failing part does not stop the others; the
root-code check stops the read before anything else; the host part measures what the sglang part found (model
directories, the patch's files). Also the moved pieces: plan_stop (sglang_stop's check mode) and preview_patch
(sglang_nccl_patch's check mode)."""
import importlib.util
import json
import os
import pathlib
import textwrap

import pytest

from ansible.module_utils.testing import patch_module_args
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_nccl_check as nccl_check
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_stop_plan as stop_plan

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sglang_preflight_info",
                                               ROOT / "plugins" / "modules" / "sglang_preflight_info.py")
mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mod)

SOURCE = textwrap.dedent('''\
    import os
    import multiprocessing as mp


    def _set_envs_and_config(server_args):
        os.environ["NCCL_CUMEM_ENABLE"] = "0"
        mp.set_start_method("spawn", force=True)
    ''')


def engine(tmp_path):
    pkg = tmp_path / "site" / "sglang"
    (pkg / "srt" / "entrypoints").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "version.py").write_text('__version__ = "0.5.4"\n')
    path = pkg / "srt" / "entrypoints" / "engine.py"
    path.write_text(SOURCE)
    return path


def run_main(args, capsys):
    with patch_module_args(args):
        with pytest.raises(SystemExit):
            mod.main()
    return json.loads(capsys.readouterr().out)


def no_gpu(monkeypatch):
    monkeypatch.setattr(mod, "read_host_gpu", lambda module, p: mod.failed("no GPUs here", error_class="no_devices"))


def test_root_code_found_first_stops_the_read(monkeypatch, capsys):
    entry = {"variable": "ansible_python_interpreter", "text": "root would run code another user can change"}
    monkeypatch.setattr(mod, "root_code", lambda interpreters, self_too: [entry] if self_too else [])
    out = run_main({"root_interpreter_self": True, "python": "/nonexistent/python"}, capsys)
    assert out["root_code"] == [entry] and out["gathered"] == []
    assert "args" not in out and "host" not in out and "gpu" not in out


def test_failing_parts_do_not_stop_the_others_and_keep_their_module_shape(tmp_path, monkeypatch, capsys):
    no_gpu(monkeypatch)
    out = run_main({"python": str(tmp_path / "nope" / "python"), "port": 1, "launch_args": {"tp-size": 2},
                    "stop_users": ["gpufleet-no-such-user"], "measure": {"paths": [str(tmp_path)]}}, capsys)
    assert out["gathered"] == ["sglang", "host"]
    assert out["args"]["failed"] and out["args"]["msg"] and "valid" not in out["args"]
    assert out["patch"]["failed"] and out["patch"]["msg"]
    assert out["gpu"] == {"failed": True, "msg": "no GPUs here", "error_class": "no_devices"}
    assert out["stop_preview"]["signalled"] == [] and out["stop_preview"]["progress"] == "would signal 0 process(es)"
    assert out["host"]["disk"][0]["path"] == str(tmp_path) and "gpu_after_stop" not in out["host"]


def test_the_host_part_measures_the_model_directories_and_the_patch_files_of_the_sglang_part(tmp_path, monkeypatch,
                                                                                             capsys):
    no_gpu(monkeypatch)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "afile").write_text("")
    dest = {"model_path": str(model), "tokenizer_path": str(tmp_path / "afile"), "speculative_draft_model_path":
            "org/draft", "port": 30000}
    earlier = {"args": {"valid": True, "dest_values": dest}, "patch": {"paths": [str(tmp_path / "engine.py")]}}
    out = run_main({"gather": ["host"], "sglang_read": earlier, "stop_preview": {"signalled": [], "main_pid": None},
                    "path_flags": ["model-path", "tokenizer-path", "speculative-draft-model-path"],
                    "launcher": str(tmp_path / "afile"), "patch_write_access": True,
                    "measure": {"paths": [str(tmp_path / "state")], "model_markers": {"model_path": ["config.json"]}}},
                   capsys)
    assert out["gathered"] == ["host"] and "args" not in out
    by_key = dict((e["key"], e) for e in out["model_paths"])
    assert by_key["model_path"] == {"key": "model_path", "value": str(model), "local": True, "exists": True,
                                    "isdir": True}
    assert by_key["tokenizer_path"]["isdir"] is False
    assert by_key["speculative_draft_model_path"] == {"key": "speculative_draft_model_path", "value": "org/draft",
                                                      "local": False}
    assert out["launcher"] == {"path": str(tmp_path / "afile"), "exists": True, "isdir": False, "executable": False}
    assert out["stop_preview"] == {"signalled": [], "main_pid": None}
    # The model directory is measured after the state directory, and its files looked for.
    assert [d["path"] for d in out["host"]["disk"]] == [str(tmp_path / "state"), str(model)]
    assert [(d["path"], bool(d["found"])) for d in out["host"]["model_dirs"]] == [(str(model), True)]
    assert [w["path"] for w in out["host"]["write_access"] if w["purpose"] == "replace"] == [str(tmp_path / "engine.py")]


def test_the_patch_preview_is_the_modules_check_mode_answer(tmp_path, monkeypatch, capsys):
    path = engine(tmp_path)
    before = path.read_bytes()
    no_gpu(monkeypatch)
    out = run_main({"gather": ["sglang"], "nccl_patch_path": str(path), "python": "/nonexistent/python",
                    "nccl_env": {"NCCL_MIN_NCHANNELS": 16}}, capsys)
    assert out["patch"]["changed"] is True and out["patch"]["paths"] == [str(path)] and "msg" not in out["patch"]
    assert out["patch"]["files"][0]["changed"] is True and path.read_bytes() == before
    assert "host" not in out


def test_a_patch_whose_copy_does_not_fit_fails_its_preview_as_the_module_would(tmp_path, monkeypatch):
    path = engine(tmp_path)
    real = nccl_check.filesystem_of
    monkeypatch.setattr(nccl_check, "filesystem_of", lambda d: dict(real(d), free=10))
    out = nccl_check.preview_patch(path=str(path), env={"NCCL_MIN_NCHANNELS": 16})
    assert out["failed"] and "not enough room on the filesystem mounted at" in out["msg"]
    assert out["msg"].endswith("No file was changed.") and out["changed"] is True


def test_plan_stop_refuses_a_pid_file_without_a_pid_and_lists_nothing_it_may_not_signal(tmp_path):
    bad = tmp_path / "sglang.pid"
    bad.write_text("not a pid\n")
    with pytest.raises(stop_plan.StopPlanError) as err:
        stop_plan.plan_stop(pid_file=str(bad), users=["gpufleet-no-such-user"])
    assert "remove it after checking no SGLang server runs" in err.value.msg
    out = stop_plan.plan_stop(pid_file=str(tmp_path / "none.pid"), users=["gpufleet-no-such-user"],
                              shm_dir=str(tmp_path))
    assert out["signalled"] == [] and out["main_pid"] is None and out["pid_file_removed"] is False
    assert out["done"] is True and out["changed"] is False and out["users"] == ["gpufleet-no-such-user"]
    assert os.path.exists(str(bad))
