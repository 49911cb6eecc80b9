"""The modules' documentation as ansible-doc renders it: doc fragments merged, RETURN included.

``rendered()`` → ``{short module name: {"doc": ..., "return": ..., "examples": ...}}`` from one
``ansible-doc --json`` call over every module (about 0.6 s), run with the interpreter's own ansible-doc and the
checkout as the collection gpufleet.fleet (``collections/``); cached for the session.
"""
import functools
import glob
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "plugins", "modules", "*.py")))


@functools.lru_cache(maxsize=None)
def rendered():
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=os.path.join(ROOT, "collections"), ANSIBLE_NOCOLOR="1")
    env.pop("ANSIBLE_CONFIG", None)
    doc = os.path.join(os.path.dirname(sys.executable), "ansible-doc")
    proc = subprocess.run([doc, "--json"] + ["gpufleet.fleet." + m for m in MODULES], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return {name.rsplit(".", 1)[1]: data for name, data in json.loads(proc.stdout).items()}
