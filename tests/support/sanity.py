"""``ansible-test sanity`` for this checkout, the same way on a fresh machine (``make sanity``, part of ``make lint``).

ansible-test wants its working directory to be ``.../ansible_collections/<namespace>/<name>`` and takes its file
list from git. The checkout is the collection gpufleet.fleet, but ``collections/ansible_collections/gpufleet/fleet``
is a link to the checkout's root and the kernel resolves it (ansible-test sees the real path); so the files git
knows (tracked, and new files git does not ignore) are copied into
``.cache/sanity/ansible_collections/gpufleet/fleet`` and committed to a throwaway git repository there, and
ansible-test runs in that tree. ``collections/`` stays out: it holds only the link.

ansible-test itself comes from ``.cache/sanity-venv`` (the ansible-core that ``requirements/controller.txt``
pins, plus each sanity test's pinned requirements from ansible-test's own ``_data/requirements``). Each test then
runs in a virtualenv that ansible-test makes under ``$HOME/.ansible/test/venv``; HOME is pointed at
``.cache/sanity-home`` so that these stay under ``.cache`` too. ansible-test puts pip into those virtualenvs with a
``get-pip`` script it downloads from ci-files.testing.ansible.com; where that host is out of reach (this lab and
CI machines that only reach PyPI) the script is replaced by a stand-in that does the same with the interpreter's
own ``ensurepip`` and then pip-installs the pip version ansible-test asks for from the package index.

Usage: ``python tests/support/sanity.py [ansible-test sanity options]`` (default: every test, ``--python 3.11``).
Exit status: ansible-test's.
"""
import fnmatch
import glob
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.path.join(ROOT, ".cache")
VENV = os.path.join(CACHE, "sanity-venv")
HOME = os.path.join(CACHE, "sanity-home")
TREE = os.path.join(CACHE, "sanity", "ansible_collections", "gpufleet", "fleet")
PYTHON_VERSION = "3.11"  # the controller Python of requirements/controller.txt; one version keeps runs deterministic
# Sanity tests whose requirements go into the cache venv (the ones that run on this collection).
SANITY_REQUIREMENTS = ("ansible-doc", "import", "import.plugin", "integration-aliases", "pep8", "pylint",
                       "runtime-metadata", "validate-modules", "yamllint")

# Stands in for https://ci-files.testing.ansible.com/ansible-test/get-pip-<version>.py: ansible-test runs it with
# the new virtualenv's interpreter and pip's install arguments (plus get-pip's own --no-setuptools/--no-wheel).
GET_PIP_STANDIN = '''"""Stand-in for get-pip.py, written by gpufleet's tests/support/sanity.py: ensurepip, then pip install."""
import subprocess
import sys

subprocess.run([sys.executable, "-m", "ensurepip", "--default-pip"], check=True, stdout=subprocess.DEVNULL)
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
sys.exit(subprocess.run([sys.executable, "-m", "pip", "install", "-q"] + args).returncode)
'''


def _ansible_core_pin():
    with open(os.path.join(ROOT, "requirements", "controller.txt")) as fh:
        for line in fh:
            if re.match(r"ansible-core==", line.strip()):
                return line.strip()
    raise SystemExit("requirements/controller.txt pins no ansible-core")


def sanity_venv():
    """The venv with ansible-test and the sanity tests' requirements; (re)built when the ansible-core pin changes."""
    pin = _ansible_core_pin()
    stamp = os.path.join(VENV, ".pins")
    if os.path.exists(stamp) and open(stamp).read() == pin + "\n":
        return VENV
    python = shutil.which("python" + PYTHON_VERSION) or sys.executable
    subprocess.run([python, "-m", "venv", "--clear", VENV], check=True)
    pip = [os.path.join(VENV, "bin", "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + [pin], check=True)
    [reqs] = glob.glob(os.path.join(VENV, "lib", "python3*", "site-packages", "ansible_test", "_data", "requirements"))
    args = []
    for name in SANITY_REQUIREMENTS:
        args += ["-r", os.path.join(reqs, "sanity.%s.txt" % name)]
    subprocess.run(pip + [pin] + args, check=True)
    with open(stamp, "w") as fh:
        fh.write(pin + "\n")
    return VENV


def _get_pip_standin(venv):
    """Put the stand-in where ansible-test looks for a cached get-pip script, unless a real one is there."""
    [reqs] = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "ansible_test", "_internal",
                                    "python_requirements.py"))
    with open(reqs) as fh:
        version = re.search(r"pip='([0-9.]+)'", fh.read()).group(1)
    path = os.path.join(HOME, ".ansible", "test", "cache", "get_pip_%s.py" % version.replace(".", "_"))
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(GET_PIP_STANDIN)


def _build_ignore():
    """galaxy.yml's build_ignore: the patterns of what the collection tarball leaves out."""
    import yaml  # the project venv's PyYAML (make sanity runs this script with .venv's python)

    with open(os.path.join(ROOT, "galaxy.yml")) as fh:
        return yaml.safe_load(fh).get("build_ignore") or []


def shipped(rel, patterns):
    """True when ``ansible-galaxy collection build`` would put ``rel`` into the tarball: neither the path nor a
    folder above it matches a build_ignore pattern (fnmatch on the path relative to the root, as ansible-galaxy
    applies them; galaxy.yml itself stays, ansible-test reads it)."""
    parts = rel.split("/")
    return not any(fnmatch.fnmatch("/".join(parts[:i]), p) for i in range(1, len(parts) + 1) for p in patterns)


def tree_files():
    """The checkout's files that go into the sanity tree (paths relative to the root)."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    patterns = _build_ignore()
    return [f for f in listing if f and (shipped(f, patterns) or f.startswith("tests/sanity/"))
            and os.path.lexists(os.path.join(ROOT, f))]


def collection_tree():
    """Copy the files git knows (tracked, or new and not ignored) that the collection ships, and tests/sanity/
    (the ignore file), into TREE, a fresh git repository; return TREE. The rest of tests/ is the pytest suite
    and its lab, not collection content."""
    files = tree_files()
    shutil.rmtree(os.path.dirname(os.path.dirname(os.path.dirname(TREE))), ignore_errors=True)
    for rel in files:
        src, dst = os.path.join(ROOT, rel), os.path.join(TREE, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    git = ["git", "-c", "user.name=sanity", "-c", "user.email=sanity@invalid", "-c", "init.defaultBranch=main"]
    subprocess.run(git + ["init", "-q"], cwd=TREE, check=True)
    subprocess.run(git + ["add", "-A"], cwd=TREE, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "sanity tree"], cwd=TREE, check=True)
    return TREE


def main(argv):
    started = time.monotonic()
    venv = sanity_venv()
    _get_pip_standin(venv)
    tree = collection_tree()
    # PIP_QUIET: ansible-test's installs into its per-test virtualenvs print errors only.
    env = dict(os.environ, HOME=HOME, PIP_QUIET="1",
               PATH=os.path.join(venv, "bin") + os.pathsep + os.environ.get("PATH", ""))
    env.pop("ANSIBLE_CONFIG", None)  # the checkout's ansible.cfg is for the playbooks, not for ansible-test
    env.pop("PYTHONPATH", None)
    args = argv or ["--python", PYTHON_VERSION]
    cmd = [os.path.join(venv, "bin", "ansible-test"), "sanity", "--local", "--color", "no"] + args
    if "--python" not in args:
        cmd += ["--python", PYTHON_VERSION]
    rc = subprocess.run(cmd, cwd=tree, env=env).returncode
    print("sanity: rc=%d in %.0f s (%s)" % (rc, time.monotonic() - started, " ".join(cmd[1:])))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
