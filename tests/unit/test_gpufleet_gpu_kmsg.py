"""gpufleet_gpu_kmsg: Xid events from a /dev/kmsg-format log or journalctl; unreadable means unknown, never none."""
import errno
import json
import os
import time

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_gpu_kmsg as K

XID79 = "NVRM: Xid (PCI:0000:1b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."


def write_log(path, records):
    """records: (usec, text[, continuation lines])."""
    with open(path, "w") as fh:
        for seq, rec in enumerate(records):
            fh.write("4,%d,%d,-;%s\n" % (seq, rec[0], rec[1]))
            for cont in rec[2:]:
                fh.write(" %s\n" % cont)


def test_xid_line_is_parsed_and_the_bus_id_normalised_to_nvidia_smi_form():
    assert K.parse_xid(XID79) == ("00000000:1B:00.0", 79, "pid=1234, name=python3, GPU has fallen off the bus.")
    assert K.parse_xid("NVRM: loading NVIDIA UNIX Open Kernel Module") is None


def test_events_in_the_window_with_time_and_continuation_lines_skipped(tmp_path):
    log = tmp_path / "kmsg"
    now = 10000.0
    write_log(str(log), [(int((now - 7200) * 1e6), XID79),  # two hours ago: outside 60 min
                         (int((now - 60) * 1e6), XID79, "SUBSYSTEM=pci", "DEVICE=+pci:0000:1b:00.0"),
                         (int((now - 30) * 1e6), "NVRM: GPU at PCI:0000:1b:00: GPU-abc"),
                         (int((now - 5) * 1e6), "NVRM: Xid (PCI:0000:2a:00): 48, pid=7, name=x, DBE")])
    events = K.read_xid_kmsg(str(log), 60, now_mono=now, now_wall=1_800_000_000.0)
    assert [(e["xid"], e["pci_bus_id"]) for e in events] == [(79, "00000000:1B:00.0"), (48, "00000000:2A:00.0")]
    assert events[0]["uptime_s"] == 9940.0 and events[0]["time"] == "2027-01-15T07:59:00.000Z"
    assert events[0]["text"] == XID79


def test_report_is_ok_with_an_empty_list_only_when_the_log_was_read(tmp_path):
    log = tmp_path / "kmsg"
    write_log(str(log), [(1, "NVRM: loading")])
    rep = K.xid_report(60, kmsg_path=str(log))
    assert rep == {"xid_events": [], "xid_status": "ok", "xid_source": str(log), "xid_reason": None}


def test_dmesg_restrict_reads_as_unknown_with_the_reason_and_become(monkeypatch):
    def denied(path, flags):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(K.os, "open", denied)

    def journal(argv, timeout_s):
        return 0, "", "Hint: You are currently not seeing messages from other users and the system.\n"

    rep = K.xid_report(60, runner=journal)
    assert rep["xid_events"] is None and rep["xid_status"] == "unknown"
    assert "dmesg_restrict" in rep["xid_reason"] and "become" in rep["xid_reason"]
    assert "not seeing messages" in rep["xid_reason"]


def test_journalctl_is_the_fallback_when_kmsg_cannot_be_opened(monkeypatch):
    monkeypatch.setattr(K.os, "open", lambda p, f: (_ for _ in ()).throw(FileNotFoundError(2, "No such file")))
    calls = []

    def journal(argv, timeout_s):
        calls.append(argv)
        return 0, json.dumps({"MESSAGE": XID79, "__REALTIME_TIMESTAMP": "1800000000000000",
                              "_SOURCE_MONOTONIC_TIMESTAMP": "5000000"}) + "\n", ""

    rep = K.xid_report(30, runner=journal)
    assert rep["xid_status"] == "ok" and rep["xid_source"] == "journalctl"
    assert rep["xid_events"][0]["xid"] == 79 and rep["xid_events"][0]["uptime_s"] == 5.0
    assert calls[0][:2] == ["journalctl", "-k"] and "--since=-30min" in calls[0]


def test_missing_custom_log_is_unknown_and_journal_is_not_asked(tmp_path):
    rep = K.xid_report(60, kmsg_path=str(tmp_path / "none"), runner=lambda *a: pytest.fail("journal asked"))
    assert rep["xid_status"] == "unknown" and rep["xid_events"] is None and "No such file" in rep["xid_reason"]


def test_window_zero_skips_the_read():
    assert K.xid_report(0)["xid_status"] == "skipped"


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg not readable here")
def test_real_dev_kmsg_read_stops_at_eagain_without_blocking():
    t = time.monotonic()
    try:
        K.read_xid_kmsg("/dev/kmsg", 60 * 24 * 365)
    except PermissionError:
        pytest.skip("dmesg_restrict")
    assert time.monotonic() - t < 3.0


def test_an_empty_journal_is_unknown_not_none(monkeypatch):
    """journalctl in a container without journald answers nothing with rc 0: that is no kernel log at all."""
    monkeypatch.setattr(K.os, "open", lambda p, f: (_ for _ in ()).throw(FileNotFoundError(2, "No such file")))
    rep = K.xid_report(60, runner=lambda argv, timeout_s: (0, "", ""))
    assert rep["xid_status"] == "unknown" and rep["xid_events"] is None
    assert "holds no kernel messages" in rep["xid_reason"]
    answers = {True: json.dumps({"MESSAGE": "Linux version 6.8"}) + "\n", False: ""}
    rep = K.xid_report(60, runner=lambda argv, timeout_s: (0, answers["-n" in argv], ""))
    assert rep["xid_status"] == "ok" and rep["xid_events"] == []
