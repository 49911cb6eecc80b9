"""tests/lab/lab.py command line: what a person reads from --help."""
import os
import subprocess
import sys

LAB_PY = os.path.join(os.path.dirname(__file__), "..", "lab", "lab.py")
sys.path.insert(0, os.path.dirname(LAB_PY))
import lab as labtool  # noqa: E402


def test_fault_help_lists_every_knob_with_its_meaning():
    out = subprocess.run([sys.executable, LAB_PY, "fault", "--help"], capture_output=True, text=True, check=True).stdout
    for knob, meaning in labtool.FAULT_KNOBS.items():
        assert "%s: %s" % (knob, meaning) in out
    assert "KNOB=VALUE" in out
