"""A throwaway virtualenv for packaging checks: ansible-builder, antsibull-changelog and the awx.awx collection.

``tools_venv()`` → dict ``python`` (path), ``bin`` (dir), ``collections`` (a path holding
``ansible_collections/awx/awx``), or raises ``ToolsUnavailable`` (PyPI unreachable and nothing cached).

awx.awx is not on PyPI by itself and Galaxy is out of reach here: it comes from the community ``ansible``
package of a release that still bundled it, ``ansible==8.7.0`` (awx.awx 22.7.0): only its
``ansible_collections/awx/`` is unpacked from the wheel into the venv's site-packages, which only serves as a
collections path for ansible-playbook --syntax-check and ansible-lint of the project's venv. Wheels are cached
under ``.cache/wheels`` (the ansible wheel is 48 MB), the venv lives in ``.cache/tools-venv`` and is rebuilt when
the pins below change.
"""
import glob
import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.path.join(ROOT, ".cache")
WHEELS = os.path.join(CACHE, "wheels")
VENV = os.path.join(CACHE, "tools-venv")
ANSIBLE_BUILDER = "ansible-builder==3.2.0"
ANSIBLE_WITH_AWX = "ansible==8.7.0"  # the last community package release checked to bundle awx.awx (22.7.0)
ANTSIBULL_CHANGELOG = "antsibull-changelog==0.36.0"  # changelogs/ (make changelog, make lint)
# antsibull-changelog imports ansible-core (when it can) for the plugin types it lists as new in a release: without
# it, no filters or roles. The controller's pin, one home: requirements/controller.txt.
ANSIBLE_CORE = next(line.strip() for line in open(os.path.join(ROOT, "requirements", "controller.txt"))
                    if line.startswith("ansible-core=="))
PINS = "%s %s %s %s\n" % (ANSIBLE_BUILDER, ANSIBLE_WITH_AWX, ANTSIBULL_CHANGELOG, ANSIBLE_CORE)


class ToolsUnavailable(RuntimeError):
    """PyPI could not be reached and the wheels are not cached."""


def _pip(python, *args):
    proc = subprocess.run([python, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise ToolsUnavailable("pip %s failed: %s" % (" ".join(args[:2]), (proc.stderr or proc.stdout)[-800:]))


# A stable collections path for awx.awx (ansible.cfg's collections_path names it), so plain ``ansible-lint`` at the
# repository root resolves awx.awx once this venv exists: a link to the copy in the venv's site-packages.
COLLECTIONS = os.path.join(CACHE, "collections")


def _link_collections(site):
    link = os.path.join(COLLECTIONS, "ansible_collections", "awx")
    target = os.path.join(site, "ansible_collections", "awx")
    os.makedirs(os.path.dirname(link), exist_ok=True)
    if os.path.islink(link) and os.readlink(link) == target:
        return
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(target, link)


def tools_venv():
    result = _tools_venv()
    _link_collections(result["collections"])
    return result


def _tools_venv():
    stamp = os.path.join(VENV, ".pins")
    py = os.path.join(VENV, "bin", "python")
    site = glob.glob(os.path.join(VENV, "lib", "python3*", "site-packages"))
    if site and os.path.exists(stamp) and open(stamp).read() == PINS:
        return {"python": py, "bin": os.path.join(VENV, "bin"), "collections": site[0]}
    os.makedirs(WHEELS, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", VENV], check=True, capture_output=True)
    # cache first (one download), then install from the cache only
    _pip(py, "download", "-d", WHEELS, ANSIBLE_BUILDER, ANTSIBULL_CHANGELOG, ANSIBLE_CORE)
    _pip(py, "download", "--no-deps", "-d", WHEELS, ANSIBLE_WITH_AWX)
    _pip(py, "install", "--no-index", "--find-links", WHEELS, ANSIBLE_BUILDER, ANTSIBULL_CHANGELOG, ANSIBLE_CORE)
    site = glob.glob(os.path.join(VENV, "lib", "python3*", "site-packages"))
    # Only awx.awx is used: unpack ansible_collections/awx/ from the wheel (a zip) into site-packages, where pip
    # would put it, instead of installing all ~100 collections (pip install --no-deps: ~30 s of unpacking and
    # byte-compiling on a 2-core machine; this: under a second).
    name, version = ANSIBLE_WITH_AWX.split("==")
    [wheel] = glob.glob(os.path.join(WHEELS, "%s-%s-*.whl" % (name, version)))
    with zipfile.ZipFile(wheel) as whl:
        members = [m for m in whl.namelist() if m.startswith("ansible_collections/awx/awx/")]
        if not members:
            raise ToolsUnavailable("%s holds no ansible_collections/awx/awx" % wheel)
        whl.extractall(site[0], members)
    with open(stamp, "w") as fh:
        fh.write(PINS)
    return {"python": py, "bin": os.path.join(VENV, "bin"), "collections": site[0]}


if __name__ == "__main__":
    print(tools_venv())
