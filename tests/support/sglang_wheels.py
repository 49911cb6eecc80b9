"""Real SGLang release sources for tests: wheels from PyPI, fetched without dependencies and cached.

``sglang_package_dir("0.5.23")`` returns the extracted ``sglang/`` package directory of that release
(a ``pathlib.Path``), downloading the wheel once into ``.cache/sglang-wheels`` (git-ignored). Releases up to
0.5.10 are pure ``py3-none-any`` wheels; from 0.5.11 only platform wheels exist
(``cpXY-manylinux_2_34_x86_64``), fetched with explicit platform flags (see ../shared/FIELD-NOTES.md).
SGLang's files are never committed: they live only in the cache.

Raises ``RuntimeError`` naming the pip command when a download fails (no registry, unknown release).
"""
import fcntl
import os
import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
CACHE = pathlib.Path(os.environ.get("GPUFLEET_CACHE", ROOT / ".cache"))
WHEELS = CACHE / "sglang-wheels"
SOURCES = CACHE / "sglang-src"


def _version_tuple(version):
    parts = []
    for piece in version.replace("rc", ".").replace("post", ".").split("."):
        parts.append(int(piece) if piece.isdigit() else 0)
    return tuple(parts)


def _pip_download_argv(version, dest):
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
            "-d", str(dest), "sglang==%s" % version]
    if _version_tuple(version) >= (0, 5, 11):
        argv[5:5] = ["--platform", "manylinux_2_34_x86_64", "--python-version", "3.11",
                     "--implementation", "cp"]
    return argv


def wheel_path(version):
    """Path of the cached wheel for ``version``, downloading it first if needed."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    with open(WHEELS / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(WHEELS.glob("sglang-%s-*.whl" % version))
        if not found:
            argv = _pip_download_argv(version, WHEELS)
            proc = subprocess.run(argv, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError("could not download sglang==%s: %s\n%s" % (
                    version, " ".join(argv), proc.stderr[-2000:]))
            found = sorted(WHEELS.glob("sglang-%s-*.whl" % version))
        if not found:
            raise RuntimeError("pip reported success but no sglang-%s wheel is in %s" % (version, WHEELS))
        return found[0]


def sglang_package_dir(version):
    """Extracted ``sglang/`` package directory of a real release (``pathlib.Path``)."""
    dest = SOURCES / version
    pkg = dest / "sglang"
    if (dest / ".complete").exists():
        return pkg
    wheel = wheel_path(version)
    dest.mkdir(parents=True, exist_ok=True)
    with open(SOURCES / (".lock-" + version), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / ".complete").exists():
            with zipfile.ZipFile(wheel) as zf:
                members = [m for m in zf.namelist() if m.startswith("sglang/") or ".dist-info/" in m]
                zf.extractall(dest, members)
            (dest / ".complete").write_text(wheel.name)
    return pkg
