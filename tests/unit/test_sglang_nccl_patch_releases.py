"""sglang_nccl_patch against the real _set_envs_and_config of SGLang releases 0.3.6 to 0.5.23 (PyPI wheels).

For each release: copy the package's version file and the file that defines the function into a temporary
``sglang/`` tree, patch through the module's main(), re-patch (no change), compile, *execute* the patched
function (tests/support/set_envs_exec.py) against a copy of os.environ and check every configured variable
kept exactly its configured value -- including ones SGLang itself writes -- then show the unpatched function
would have overwritten CUDA_DEVICE_MAX_CONNECTIONS, and finally ``state: absent`` gives back the original bytes.

Wheels come from PyPI through tests/support/sglang_wheels.py (cached in .cache/, never committed).
"""
import importlib.util
import json
import os
import shutil
import sys

import pytest
from gpu_module_harness import sglang_on_path

from ansible.module_utils import basic
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang import find_set_envs_files
from support.set_envs_exec import execute_set_envs_and_config, run_set_envs_and_config
from support.sglang_wheels import sglang_package_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("sglang_nccl_patch_rel", os.path.join(ROOT, "plugins", "modules", "sglang_nccl_patch.py"))
patch_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(patch_module)

# (release, file defining _set_envs_and_config, why this release is here)
RELEASES = [
    ("0.3.6", "srt/server.py", "oldest covered"),
    ("0.4.1.post6", "srt/server.py", "last release with the function in server.py"),
    ("0.4.1.post7", "srt/entrypoints/engine.py", "moved to engine.py; server.py becomes a re-export shim"),
    ("0.4.5", "srt/entrypoints/engine.py", "last release with the shim"),
    ("0.4.6", "srt/entrypoints/engine.py", "shim gone"),
    ("0.5.4", "srt/entrypoints/engine.py", "last release overwriting NCCL_CUMEM_ENABLE/NCCL_NVLS_ENABLE always"),
    ("0.5.5", "srt/entrypoints/engine.py", "NCCL_* only when unset; CUDA_DEVICE_MAX_CONNECTIONS 4 -> 8"),
    ("0.5.10", "srt/entrypoints/engine.py", "last pure-Python wheel"),
    ("0.5.11", "srt/entrypoints/engine.py", "first platform wheel"),
    ("0.5.14", "srt/entrypoints/engine.py", "flag renames (--cuda-graph-max-bs-decode)"),
    ("0.5.20", "srt/entrypoints/engine.py", "blank first body line, resolving_view(server_args)"),
    ("0.5.23", "srt/entrypoints/engine.py", "newest covered; the lab's release"),
]
RELEASES_COVERED = [r[0] for r in RELEASES]
print("sglang_nccl_patch real releases covered: " + ", ".join(RELEASES_COVERED))

# Includes the three variables SGLang writes itself, and a value that needs escaping.
ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "NCCL_CUMEM_ENABLE": "1",
    "NCCL_NVLS_ENABLE": "1",
    "NCCL_IB_HCA": "=mlx5_0,mlx5_1",
    "NCCL_MIN_NCHANNELS": 16,
    "NCCL_DEBUG_SUBSYS": "INIT,COLL",
    "GPUFLEET_PROBE": "it's \"quoted\" \\ back\\slash\nnew line \u00fcn\u00efc\u00f6de \U0001F680",
}
EXPECTED = {k: str(v) for k, v in ENV.items()}


def _version_parts(version):
    return tuple(int(p) for p in version.replace("post", ".").split(".") if p.isdigit())


def _copy_release(version, rel, dest):
    """The release's version files and the defining file, in a fresh sglang/ tree under ``dest``."""
    src = sglang_package_dir(version)
    pkg = dest / "sglang"
    target = pkg / rel
    target.parent.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name in ("_version.py", "version.py"):
        if (src / name).exists():
            shutil.copyfile(str(src / name), str(pkg / name))
    shutil.copyfile(str(src / rel), str(target))
    return src, target


def _main(capsys, args, diff=False):
    payload = dict(args, _ansible_check_mode=False, _ansible_diff=diff)
    basic._ANSIBLE_ARGS = json.dumps({"ANSIBLE_MODULE_ARGS": payload}).encode("utf-8")
    if hasattr(basic, "_ANSIBLE_PROFILE"):
        basic._ANSIBLE_PROFILE = "legacy"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        patch_module.main()
    out = capsys.readouterr().out
    basic._ANSIBLE_ARGS = None
    return json.loads(out[out.index("{"):])


@pytest.mark.realrelease
@pytest.mark.parametrize("version, rel", [(v, r) for v, r, _ in RELEASES], ids=[r[0] for r in RELEASES])
def test_patched_release_delivers_every_value_and_unpatches_byte_exact(tmp_path, capsys, version, rel):
    src, path = _copy_release(version, rel, tmp_path)
    original = path.read_bytes()

    # The whole package defines the function once, in that file: the search skips the shim (0.4.1.post7-0.4.5
    # ship both) and finds nothing else.
    assert find_set_envs_files(str(src)) == [str(src / rel)]

    first = _main(capsys, {"path": str(path), "env": ENV})
    assert not first.get("failed"), first.get("msg")
    assert first["changed"] and first["sglang_version"] == version and first["env"] == EXPECTED
    patched = path.read_bytes()
    lines = patched.decode("utf-8").splitlines()
    assert "# BEGIN gpufleet managed block" in lines[first["line"] - 1]
    assert lines[first["line"] + len(ENV) + 1].strip() == 'mp.set_start_method("spawn", force=True)'

    second = _main(capsys, {"path": str(path), "env": ENV})
    assert not second["changed"] and path.read_bytes() == patched

    compile(patched, str(path), "exec")

    # Patched: every configured value is what the workers would inherit.
    env = run_set_envs_and_config(str(path), dict(os.environ))
    assert {k: env.get(k) for k in EXPECTED} == EXPECTED

    # Unpatched, with the same values exported beforehand: SGLang overwrites them (so the test above can fail).
    unpatched = tmp_path / "unpatched.py"
    unpatched.write_bytes(original)
    before_env = dict(os.environ, **EXPECTED)
    env_orig = run_set_envs_and_config(str(unpatched), before_env)
    assert env_orig["CUDA_DEVICE_MAX_CONNECTIONS"] == ("4" if _version_parts(version) < (0, 5, 5) else "8")
    if _version_parts(version) <= (0, 5, 4):
        assert env_orig["NCCL_CUMEM_ENABLE"] == "0" and env_orig["NCCL_NVLS_ENABLE"] == "0"
    else:  # 0.5.5+: only when unset
        assert env_orig["NCCL_CUMEM_ENABLE"] == "1" and env_orig["NCCL_NVLS_ENABLE"] == "1"

    removed = _main(capsys, {"path": str(path), "state": "absent"})
    assert removed["changed"] and path.read_bytes() == original


@pytest.mark.realrelease
def test_patched_value_wins_over_sglang_even_with_empty_starting_environment(tmp_path):
    """From 0.5.5 NCCL_CUMEM_ENABLE is set only when unset: the block must still win when nothing is exported."""
    _, path = _copy_release("0.5.23", "srt/entrypoints/engine.py", tmp_path)
    text = path.read_text()
    plan = patch_module.plan_patch(text, patch_module.normalise_env({"NCCL_CUMEM_ENABLE": "1"}), "present")
    path.write_text(plan["after"])
    result = execute_set_envs_and_config(str(path), {})
    assert result["env"]["NCCL_CUMEM_ENABLE"] == "1"
    assert result["start_method_calls"] == [("spawn", True)]


# SGLang's development branch after 0.5.23: two unmodified files of one commit (../shared/upstream/sglang-main/,
# SOURCE.md). engine.py's start-method call takes envs.SGLANG_MP_START_METHOD.get(); worker_launch.py holds a copy
# of the function, run instead of engine.py's when SGLANG_PRESPAWN_WORKERS=1. Both must carry the block.
UPSTREAM_MAIN = os.path.join(ROOT, "..", "shared", "upstream", "sglang-main")


@pytest.mark.skipif(not os.path.isdir(UPSTREAM_MAIN), reason="../shared/upstream/sglang-main is not beside this checkout")
def test_upstream_main_files_are_both_patched_hold_every_value_and_unpatch_byte_exact(tmp_path, capsys, monkeypatch):
    pkg = tmp_path / "site" / "sglang"
    (pkg / "srt" / "entrypoints").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_version.py").write_text("__version__ = version = '0.5.24.dev0'\n")
    originals = {}
    for name in ("engine.py", "worker_launch.py"):
        shutil.copyfile(os.path.join(UPSTREAM_MAIN, name), str(pkg / "srt" / "entrypoints" / name))
        originals[name] = (pkg / "srt" / "entrypoints" / name).read_bytes()
    sglang_on_path(monkeypatch, str(tmp_path / "site"))
    first = _main(capsys, {"python": sys.executable, "env": ENV})
    assert not first.get("failed"), first.get("msg")
    assert first["changed"] and first["sglang_version"] == "0.5.24.dev0"
    assert [f["relative"] for f in first["files"]] == ["srt/entrypoints/engine.py", "srt/entrypoints/worker_launch.py"]
    for entry in first["files"]:
        lines = open(entry["path"]).read().splitlines()
        assert "# BEGIN gpufleet managed block" in lines[entry["line"] - 1]
        assert lines[entry["line"] + len(ENV) + 1].strip() == \
            "mp.set_start_method(envs.SGLANG_MP_START_METHOD.get(), force=True)"
        compile(open(entry["path"], "rb").read(), entry["path"], "exec")
        # Executed: every value holds, also those the function sets itself (CUDA_DEVICE_MAX_CONNECTIONS=8).
        env = run_set_envs_and_config(entry["path"], dict(os.environ))
        assert {k: env.get(k) for k in EXPECTED} == EXPECTED
        # Unpatched, SGLang's own write wins over an exported value (so the check above can fail).
        unpatched = tmp_path / ("unpatched-" + os.path.basename(entry["path"]))
        unpatched.write_bytes(originals[os.path.basename(entry["path"])])
        assert run_set_envs_and_config(str(unpatched), dict(os.environ, **EXPECTED))["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    second = _main(capsys, {"python": sys.executable, "env": ENV})
    assert not second["changed"]
    removed = _main(capsys, {"python": sys.executable, "state": "absent"})
    assert removed["changed"]
    for name, data in originals.items():
        assert (pkg / "srt" / "entrypoints" / name).read_bytes() == data
