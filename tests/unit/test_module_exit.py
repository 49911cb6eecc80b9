"""Every gpufleet module freezes its imports into the GC's permanent generation before it runs (``gc.freeze()``
in its ``__main__`` guard), so the interpreter's exit does not walk them: measured by ``make bench
BENCH_ARGS='--only module_exit'`` (docs/benchmarks.md). These tests check that the freeze is there and happens
in the module's own process, not how fast the exit is."""
import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Modules that run on the host; a module file that only documents an action plugin of the same name
# (plugins/action/<name>.py, run on the controller) has no code to run.
MODULES = sorted(p for p in (ROOT / "plugins" / "modules").glob("*.py")
                 if not (ROOT / "plugins" / "action" / p.name).exists())


def main_guard(tree):
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and getattr(node.test.left, "id", None) == "__name__"):
            return node
    return None


def call_name(stmt):
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        func = stmt.value.func
        return ast.unparse(func)
    return None


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_each_module_freezes_gc_right_before_main(path):
    guard = main_guard(ast.parse(path.read_text()))
    assert guard is not None, "%s has no __main__ guard" % path.name
    calls = [call_name(stmt) for stmt in guard.body]
    assert calls[-2:] == ["gc.freeze", "main"], "%s: __main__ guard calls %s" % (path.name, calls)


def test_the_freeze_happens_in_the_module_process(tmp_path):
    # A sitecustomize reports, at the module's sys.exit, how many objects sit in the permanent generation.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import gc, sys\n_exit = sys.exit\n"
        "def _report(code=0):\n    sys.stderr.write('FROZEN %d\\n' % gc.get_freeze_count())\n    _exit(code)\n"
        "sys.exit = _report\n")
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {"max_used_mib": 1024, "timeout_s": 1,
                                                        "backend": "nvidia-smi"}}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT / "collections")]),
               PATH="/nonexistent")  # no nvidia-smi: the wait fails at once, through the same sys.exit
    proc = subprocess.run([sys.executable, str(ROOT / "plugins" / "modules" / "nvidia_gpu_wait.py"), str(args)],
                          capture_output=True, text=True, env=env, timeout=60)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.get("failed") and "nvidia-smi" in result["msg"], result
    frozen = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("FROZEN ")]
    # the imports (ansible.module_utils.basic alone is tens of thousands of objects) are frozen
    assert frozen and frozen[-1] > 10000, proc.stderr[-2000:]
