# -*- coding: utf-8 -*-
# gpufleet: GPU/driver failures by class, and calls bounded in time (nvidia-smi runs, NVML calls).
"""Named GPU and driver failures, and time limits for calls that a wedged GPU can block for minutes.

Every failure is a :class:`GpuError` with a machine-readable ``error_class`` (returned by the modules as
``error_class``) and a ``msg`` whose first line is the driver's own text, followed by what to do.

``error_class`` values (stable; playbooks and the preflight role match on them):

========================  ==========================================================================
driver_not_loaded         nvidia-smi rc 9 "couldn't communicate with the NVIDIA driver"; NVML
                          NVML_ERROR_DRIVER_NOT_LOADED
driver_mismatch           nvidia-smi rc 18 "Driver/library version mismatch"; NVML
                          NVML_ERROR_LIB_RM_VERSION_MISMATCH (driver upgraded without reboot)
no_devices                nvidia-smi rc 6 "No devices were found"; nvmlDeviceGetCount() == 0
fewer_gpus                fewer GPUs than ``expected_count``
gpu_lost                  nvidia-smi rc 15 / "GPU is lost"; NVML_ERROR_GPU_IS_LOST (Xid 79)
device_handle_error       nvidia-smi rc 255 "Unable to determine the device handle for GPU ...: Unknown
                          Error"; nvmlDeviceGetHandleByIndex failing otherwise
timeout                   an nvidia-smi run or NVML call did not answer within its time limit
field_unavailable         a field the caller needs (memory.used, memory.total) reads [N/A], [Unknown
                          Error], ... (NVML: the memory call fails with NotSupported/Unknown)
backend_unavailable       no libnvidia-ml.so.1 / no nvidia-smi binary / no permission on /dev/nvidia*
missing_library           a Python package (nvidia-ml-py, psutil) is missing on the target
bad_selector              a ``gpus`` entry is malformed or names no GPU
bad_option                a module option is out of range (negative timeout, ...)
backend_error             any other nvidia-smi or NVML failure (rc and output are returned)
not_released              nvidia_gpu_wait only: memory still in use when ``timeout_s`` ran out
========================  ==========================================================================

Nothing here imports Ansible.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

# nvidia-smi's own texts (driver 580; FIELD-NOTES "Seen 2026-11-30", recordings/h200x2-driver580).
SMI_DRIVER_RE = re.compile(r"couldn't communicate with the NVIDIA driver|NVIDIA driver is not loaded", re.I)
SMI_MISMATCH_RE = re.compile(r"Driver/library version mismatch", re.I)
SMI_NO_DEVICES_RE = re.compile(r"^No devices were found", re.M)
# "Unable to determine the device handle for GPU0000:00:07.0: GPU is lost.  Reboot the system ..." (rc 15)
# "Unable to determine the device handle for GPU 0000:1B:00.0: Unknown Error" (rc 255)
SMI_HANDLE_RE = re.compile(r"^Unable to determine the device handle for GPU\s*([0-9A-Fa-f:.]*)\s*:\s*(.*)$", re.M)

DRIVER_HINT = ("What to do: check that the NVIDIA kernel module is loaded (`lsmod | grep nvidia`, "
               "`dmesg | grep NVRM`), reinstall or reload the driver, and inside a container start it with "
               "GPU access (NVIDIA Container Toolkit, --gpus).")
MISMATCH_HINT = ("What to do: the loaded kernel module and the user-space driver libraries differ, usually "
                 "after a driver package upgrade without a reboot. Reboot the host, or stop every GPU user "
                 "and reload the modules (`rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia && modprobe nvidia`). "
                 "A server already running keeps working until then; a new one cannot start.")
NO_DEVICES_HINT = ("What to do: check that the GPUs are visible on the PCI bus (`lspci | grep -i nvidia`), "
                   "for Xid errors in the kernel log (`dmesg | grep -i xid`), and in a container that GPUs "
                   "were passed in (--gpus, NVIDIA_VISIBLE_DEVICES).")
LOST_HINT = ("What to do: look for Xid 79 in the kernel log (`dmesg | grep -i xid`); the GPU needs a reset "
             "(`nvidia-smi -r` once nothing uses it) or, usually, a reboot of the host.")
HANDLE_HINT = ("What to do: look for Xid errors of that GPU in the kernel log (`dmesg | grep -i xid`); "
               "a reset (`nvidia-smi -r -i <bus id>` once nothing uses it) or a reboot usually clears it.")
HANG_HINT = ("Where to look: Xid errors in the kernel log (`dmesg | grep -i xid` or `journalctl -k | grep -i "
             "xid`), and processes stuck in D state (`ps -eo pid,stat,cmd | awk '$2 ~ /D/'`): a wedged GPU "
             "keeps nvidia-smi in uninterruptible sleep; it usually needs a reset or a reboot.")
FIELD_HINT = ("What to do: a GPU that cannot report its memory is not usable for a restart; look for Xid "
              "errors (`dmesg | grep -i xid`) and check the GPU with `nvidia-smi -q -i <index>`.")

#: Smallest time limit an nvidia-smi call or NVML init gets, s, even when less of ``timeout_s`` is left
#: (so the last poll of a wait is not cut short by its own deadline).
MIN_CALL_TIMEOUT_S = 3.0


class GpuError(Exception):
    """A failure the module reports with fail_json; ``msg`` says what happened and what to do.

    ``error_class`` is one of the values in this module's docstring. ``rc``/``stdout``/``stderr`` are set
    when an nvidia-smi call failed.
    """

    error_class = "backend_error"

    def __init__(self, msg, rc=None, stdout=None, stderr=None, error_class=None):
        super().__init__(msg)
        self.msg = msg
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr
        if error_class:
            self.error_class = error_class

    def fail_kwargs(self):
        """Keyword arguments for ``AnsibleModule.fail_json`` (msg, error_class, rc/stdout/stderr when set)."""
        kw = {"msg": self.msg, "error_class": self.error_class}
        for key in ("rc", "stdout", "stderr"):
            if getattr(self, key) is not None:
                kw[key] = getattr(self, key)
        return kw


class DriverNotLoadedError(GpuError):
    """The NVIDIA kernel driver does not answer (NVML_ERROR_DRIVER_NOT_LOADED / nvidia-smi rc 9)."""
    error_class = "driver_not_loaded"


class DriverMismatchError(DriverNotLoadedError):
    """Kernel module and user-space libraries differ (NVML_ERROR_LIB_RM_VERSION_MISMATCH / nvidia-smi rc 18)."""
    error_class = "driver_mismatch"


class NoDevicesError(GpuError):
    """The driver answers but lists no GPU (nvidia-smi rc 6, nvmlDeviceGetCount() == 0)."""
    error_class = "no_devices"


class FewerGpusError(GpuError):
    """Fewer GPUs than ``expected_count``."""
    error_class = "fewer_gpus"


class GpuLostError(GpuError):
    """A GPU fell off the bus (NVML_ERROR_GPU_IS_LOST / nvidia-smi rc 15 "GPU is lost")."""
    error_class = "gpu_lost"


class DeviceHandleError(GpuError):
    """The driver cannot open one GPU (nvidia-smi rc 255 "Unable to determine the device handle ... Unknown
    Error"; nvmlDeviceGetHandleByIndex failing with anything but GPU_IS_LOST)."""
    error_class = "device_handle_error"


class GpuTimeoutError(GpuError):
    """An nvidia-smi run or an NVML call did not return in time."""
    error_class = "timeout"


class FieldUnavailableError(GpuError):
    """A field the caller needs reads [N/A] / [Unknown Error] / ... ; ``gpu``, ``field``, ``raw`` name it."""
    error_class = "field_unavailable"


class BackendUnavailableError(GpuError):
    """This backend cannot run here (no libnvidia-ml.so.1, no nvidia-smi binary, no permission)."""
    error_class = "backend_unavailable"


class SelectorError(GpuError):
    """A ``gpus`` selector is malformed or names no GPU on this host."""
    error_class = "bad_selector"


def lost_message(where, driver_text=None):
    head = "%s\n" % driver_text.strip() if driver_text else ""
    return "%sGPU %s is lost (fell off the bus). %s" % (head, where, LOST_HINT)


def first_lines(text, limit=4):
    """The first ``limit`` non-empty lines of ``text``, stripped, joined with newlines."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return "\n".join(lines[:limit])


def classify_smi_failure(argv_text, rc, out, err):
    """A :class:`GpuError` subclass instance for an nvidia-smi answer that names a driver or device
    failure, or None when the output shows none of the known texts.

    The message starts with the driver's own line(s), then what it means and what to do. Checked on every
    answer, rc 0 included: nvidia-smi prints a device-handle error for one GPU among the rows of the others.
    """
    both = (out or "") + "\n" + (err or "")
    kw = {"rc": rc, "stdout": out, "stderr": err}
    handle = SMI_HANDLE_RE.search(both)
    if handle:
        bus, reason = handle.group(1), handle.group(2).strip()
        line = handle.group(0).strip()
        if "GPU is lost" in reason or rc == 15:
            return GpuLostError(lost_message(bus or "?", line), **kw)
        return DeviceHandleError("%s\nnvidia-smi (`%s`, rc %s) cannot open GPU %s. %s"
                                 % (line, argv_text, rc, bus or "?", HANDLE_HINT), **kw)
    if SMI_MISMATCH_RE.search(both) or rc == 18:
        return DriverMismatchError("%s\nnvidia-smi rc %s: driver/library version mismatch. %s"
                                   % (first_lines(both, 2) or "(no output)", rc, MISMATCH_HINT), **kw)
    if SMI_DRIVER_RE.search(both) or rc == 9:
        return DriverNotLoadedError("%s\nnvidia-smi rc %s: the NVIDIA driver does not answer. %s"
                                    % (first_lines(both, 2) or "(no output)", rc, DRIVER_HINT), **kw)
    if SMI_NO_DEVICES_RE.search(both) or rc == 6:
        return NoDevicesError("%s\nnvidia-smi rc %s: the driver lists no GPU. %s"
                              % (first_lines(both, 2) or "(no output)", rc, NO_DEVICES_HINT), **kw)
    if rc == 15:
        return GpuLostError(lost_message("?", first_lines(both, 2)), **kw)
    return None


# --------------------------------------------------------------------------------------------------------
# time limits

class Deadline:
    """The time budget of one module call: ``remaining()`` seconds left (never negative), and
    ``call_timeout()``, the limit for the next blocking call (what is left, at least MIN_CALL_TIMEOUT_S)."""

    def __init__(self, budget_s, clock=time.monotonic):
        self.clock = clock
        self.start = clock()
        self.budget_s = None if budget_s is None else max(0.0, float(budget_s))

    def remaining(self):
        if self.budget_s is None:
            return None
        return max(0.0, self.start + self.budget_s - self.clock())

    def call_timeout(self):
        left = self.remaining()
        return MIN_CALL_TIMEOUT_S if left is None else max(left, MIN_CALL_TIMEOUT_S)


class CallTimedOut(Exception):
    """Raised by :func:`bounded_run` when the command did not finish in time (``seconds``, ``argv``)."""

    def __init__(self, argv, seconds, out="", err=""):
        super().__init__("%s did not finish in %.1f s" % (" ".join(argv), seconds))
        self.argv = argv
        self.seconds = seconds
        self.out = out
        self.err = err


def bounded_run(argv, timeout_s, env=None, popen=subprocess.Popen, reap_s=0.5):
    """Run ``argv`` (a list, no shell) and return ``(rc, stdout, stderr)`` (text, undecodable bytes
    replaced), or raise :class:`CallTimedOut` after ``timeout_s``.

    On expiry the process is sent SIGKILL and given ``reap_s`` to go; a process in uninterruptible sleep
    (D state, a wedged GPU) cannot die before the kernel call returns, so it is then abandoned rather than
    waited for. Raises OSError's subclass FileNotFoundError as rc 127 (not raised).
    """
    if env is None:
        env = dict(os.environ, LC_ALL="C", LANG="C")
    try:
        proc = popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                     close_fds=True, start_new_session=True)
    except OSError as exc:
        return 127, "", str(exc)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            try:
                proc.kill()
            except OSError:
                pass
        out = err = b""
        try:
            out, err = proc.communicate(timeout=reap_s)
        except subprocess.TimeoutExpired:
            pass  # D state: leave it; the kernel frees it when the GPU call returns
        raise CallTimedOut(list(argv), timeout_s, _text(out), _text(err))
    return proc.returncode, _text(out), _text(err)


def _text(data):
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode("utf-8", "replace")
    return data


def call_in_thread(fn, timeout_s, what, *args):
    """Return ``fn(*args)`` run in a daemon thread, or raise :class:`GpuTimeoutError` after ``timeout_s``.

    For NVML calls (nvmlInit, and a module's whole NVML session): a call blocked in the driver cannot be
    interrupted, so the thread is abandoned (daemon: it does not keep the module process alive).
    Exceptions of ``fn`` are re-raised in the caller.
    """
    box = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: B902 -- handed to the caller as is
            box["error"] = exc

    thread = threading.Thread(target=target, name="gpufleet-" + what.split()[0], daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise GpuTimeoutError(
            "%s did not return within %.1f s; stopped waiting for it. %s" % (what, timeout_s, HANG_HINT))
    if "error" in box:
        raise box["error"]
    return box.get("value")
