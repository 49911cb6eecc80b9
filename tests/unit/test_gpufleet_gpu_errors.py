"""gpufleet_gpu_errors: nvidia-smi failure texts classified, calls bounded in time and abandoned, not waited for."""
import subprocess
import sys
import time

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu_errors as E
from fake_pynvml import DRIVER_NOT_LOADED_TEXT, GPU_LOST_TEXT, recording

MISMATCH_TEXT = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.159\n"
HANDLE_TEXT = "Unable to determine the device handle for GPU 0000:1B:00.0: Unknown Error\n"


@pytest.mark.parametrize("rc, out, cls, first", [
    (9, DRIVER_NOT_LOADED_TEXT, "driver_not_loaded", "NVIDIA-SMI has failed because it couldn't communicate"),
    (18, MISMATCH_TEXT, "driver_mismatch", "Failed to initialize NVML: Driver/library version mismatch"),
    (6, "No devices were found\n", "no_devices", "No devices were found"),
    (15, GPU_LOST_TEXT, "gpu_lost", "Unable to determine the device handle for GPU0000:00:07.0: GPU is lost."),
    (255, HANDLE_TEXT, "device_handle_error", "Unable to determine the device handle for GPU 0000:1B:00.0"),
])
def test_each_driver_failure_is_classified_with_the_driver_text_first(rc, out, cls, first):
    err = E.classify_smi_failure("nvidia-smi -L", rc, out, "")
    assert err.error_class == cls and err.msg.startswith(first)
    assert "What to do" in err.msg and err.fail_kwargs()["error_class"] == cls and err.rc == rc


def test_mismatch_says_reboot_or_reload_the_kernel_module():
    msg = E.classify_smi_failure("nvidia-smi", 18, MISMATCH_TEXT, "").msg
    assert "Reboot the host" in msg and "modprobe nvidia" in msg


def test_handle_error_among_good_rows_is_found_and_its_line_comes_first():
    rows = "".join("%d, 0, 143771\n" % i for i in range(7))
    err = E.classify_smi_failure("nvidia-smi --query-gpu=...", 255, rows + HANDLE_TEXT, "")
    assert isinstance(err, E.DeviceHandleError)
    assert err.msg.splitlines()[0] == HANDLE_TEXT.strip() and "0000:1B:00.0" in err.msg
    assert len(err.msg) < 800  # the healthy rows stay in stdout, not in the message


def test_a_clean_answer_is_not_a_failure():
    assert E.classify_smi_failure("nvidia-smi", 0, recording("idle-query-gpu.csv"), "") is None
    assert E.classify_smi_failure("nvidia-smi", 2, recording("error-bad-field.txt"), "") is None


def test_deadline_gives_each_call_what_is_left_but_at_least_the_floor():
    now = [100.0]
    d = E.Deadline(10, clock=lambda: now[0])
    assert d.call_timeout() == 10
    now[0] = 108.5
    assert d.remaining() == pytest.approx(1.5) and d.call_timeout() == E.MIN_CALL_TIMEOUT_S
    now[0] = 200
    assert d.remaining() == 0


def test_bounded_run_returns_output_and_rc():
    rc, out, err = E.bounded_run([sys.executable, "-c", "import sys; print('a'); sys.exit(3)"], 10)
    assert (rc, out) == (3, "a\n")


def test_bounded_run_missing_binary_is_rc_127():
    assert E.bounded_run(["/nonexistent/nvidia-smi"], 5)[0] == 127


def test_bounded_run_kills_a_hung_command_and_raises_within_the_limit():
    t = time.monotonic()
    with pytest.raises(E.CallTimedOut) as err:
        E.bounded_run([sys.executable, "-c", "import time; time.sleep(30)"], 0.3)
    assert time.monotonic() - t < 2.0 and err.value.seconds == 0.3


def test_bounded_run_does_not_wait_for_a_process_that_cannot_die():
    """A D-state nvidia-smi ignores SIGKILL until the driver returns: the run must be abandoned."""
    class Unkillable:
        pid = 999999999
        returncode = None

        def __init__(self, *a, **kw):
            self.communicates = 0

        def communicate(self, timeout=None):
            self.communicates += 1
            time.sleep(timeout)
            raise subprocess.TimeoutExpired("nvidia-smi", timeout)

        def kill(self):
            pass

        def wait(self, timeout=None):  # never returns: the test fails by hanging if it is called
            time.sleep(3600)

    t = time.monotonic()
    with pytest.raises(E.CallTimedOut):
        E.bounded_run(["nvidia-smi"], 0.2, popen=Unkillable, reap_s=0.2)
    assert time.monotonic() - t < 1.0


def test_call_in_thread_returns_values_reraises_errors_and_abandons_a_blocked_call():
    assert E.call_in_thread(lambda a: a + 1, 5, "add", 1) == 2
    with pytest.raises(KeyError):
        E.call_in_thread(lambda: {}["x"], 5, "lookup")
    t = time.monotonic()
    with pytest.raises(E.GpuTimeoutError) as err:
        E.call_in_thread(time.sleep, 0.2, "nvmlInit (NVML initialisation)", 30)
    assert time.monotonic() - t < 1.0
    assert err.value.msg.startswith("nvmlInit (NVML initialisation) did not return within 0.2 s")
    assert "D state" in err.value.msg and err.value.error_class == "timeout"
