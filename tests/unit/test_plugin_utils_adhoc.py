"""Unit tests of plugins/plugin_utils/adhoc.py: which long strings an ad-hoc run prints once."""
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.adhoc import MIN_REPEAT_CHARS, shorten_repeats

FALLBACK = ("NVML: NVML Shared Library Not Found: libnvidia-ml.so.1 was not found. The NVIDIA driver's user-space "
            "libraries are not installed on this host")
XID = "kernel log not readable, Xid events unknown (not 'none'): /dev/kmsg: No such file or directory"


def _result(**extra):
    return dict({"changed": False, "backend": "nvidia-smi", "backend_fallback_reason": FALLBACK,
                 "xid_reason": XID, "gpu_count": 8}, **extra)


def test_the_first_host_prints_whole_a_later_host_points_to_it():
    first, shown = shorten_repeats(_result(), "gpu-lab-01", {})
    assert first == _result()
    second, shown = shorten_repeats(_result(), "gpu-lab-02", shown)
    assert second == dict(_result(), backend_fallback_reason="(same as gpu-lab-01)",
                          xid_reason="(same as gpu-lab-01)")
    third, _ = shorten_repeats(_result(), "gpu-lab-03", shown)
    assert third["xid_reason"] == "(same as gpu-lab-01)"  # the host that printed it whole, not the last one


def test_short_strings_other_values_and_other_keys_are_printed_whole():
    _, shown = shorten_repeats(_result(note="x" * (MIN_REPEAT_CHARS - 1)), "a", {})
    out, _ = shorten_repeats(_result(note="x" * (MIN_REPEAT_CHARS - 1), other=FALLBACK + " (on b)",
                                     renamed=XID), "b", shown)
    assert out["note"] == "x" * (MIN_REPEAT_CHARS - 1)  # below the threshold
    assert out["other"] == FALLBACK + " (on b)"  # a different string
    assert out["renamed"] == XID  # the same string under another key is said whole there
    assert out["backend"] == "nvidia-smi" and out["gpu_count"] == 8


def test_strings_in_nested_dicts_are_said_once_lists_are_left_alone():
    res = {"ansible_facts": {"gpu": {"reason": FALLBACK}}, "items": [FALLBACK]}
    _, shown = shorten_repeats(res, "a", {})
    out, _ = shorten_repeats(res, "b", shown)
    assert out == {"ansible_facts": {"gpu": {"reason": "(same as a)"}}, "items": [FALLBACK]}


def test_inputs_are_not_changed_and_nothing_new_returns_the_same_objects():
    res = _result()
    _, shown = shorten_repeats(res, "a", {})
    frozen = {k: dict(v) for k, v in shown.items()}
    out, shown_after = shorten_repeats(res, "b", shown)
    assert res == _result() and shown == frozen  # pure
    assert out is not res and shown_after is shown  # b added nothing new: the same mapping back
    again, _ = shorten_repeats(res, "a", shown)
    assert again is res  # the host that printed them whole prints them whole again (a second task)


def test_a_host_that_prints_a_new_long_value_is_the_one_pointed_to():
    _, shown = shorten_repeats(_result(), "a", {})
    changed = _result(xid_reason=XID + "; journalctl -k: no kernel messages")
    out_b, shown = shorten_repeats(changed, "b", shown)
    assert out_b["xid_reason"] == changed["xid_reason"] and out_b["backend_fallback_reason"] == "(same as a)"
    out_c, _ = shorten_repeats(changed, "c", shown)
    assert out_c["xid_reason"] == "(same as b)"
