"""The start options: sglang_process's and sglang_stop's start_after come from one argument_spec
(gpufleet_spawn.START_OPTIONS) and one doc fragment (gpufleet.fleet.sglang_start)."""
import pytest

import module_docs
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_spawn as spawn
from gpu_module_harness import load_module


class Built(Exception):
    pass


def argument_spec(name, monkeypatch):
    """The argument_spec ``name``'s main() hands to AnsibleModule."""
    mod = load_module(name)
    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        raise Built()
    monkeypatch.setattr(mod, "AnsibleModule", fake)
    with pytest.raises(Built):
        mod.main()
    return seen["argument_spec"]


def test_the_two_modules_take_the_same_start_options(monkeypatch):
    process = argument_spec("sglang_process", monkeypatch)
    start_after = argument_spec("sglang_stop", monkeypatch)["start_after"]["options"]
    assert sorted(start_after) == sorted(spawn.START_OPTIONS)
    for name, spec in start_after.items():
        unrequired = {k: v for k, v in spec.items() if k != "required"}
        assert process[name] == unrequired == spawn.START_OPTIONS[name], name
        assert spec.get("required", False) is (name in spawn.START_REQUIRED), name
        assert "required" not in process[name], name  # sglang_process requires them per state (required_if)


def test_start_options_are_fresh_copies():
    spec = spawn.start_options(["port"])
    spec["env"]["default"]["X"] = "1"
    assert spawn.START_OPTIONS["env"]["default"] == {} and "required" not in spawn.START_OPTIONS["port"]


def test_the_two_modules_document_the_start_options_with_one_text():
    docs = module_docs.rendered()
    process = docs["sglang_process"]["doc"]["options"]
    start_after = docs["sglang_stop"]["doc"]["options"]["start_after"]
    assert "gpu_wait" in start_after["description"][-1]  # sglang_stop's own text of the option itself stays
    assert sorted(start_after["suboptions"]) == sorted(spawn.START_OPTIONS)
    for name, doc in start_after["suboptions"].items():
        lines = doc["description"] if isinstance(doc["description"], list) else [doc["description"]]
        text = " ".join(lines)
        # a reference to a start option names start_after's suboption here, sglang_process's option there
        assert "O(" not in text.replace("O(start_after.", "").replace("O(gpufleet.fleet.", ""), name
        as_top = dict(doc, description=[line.replace("O(start_after.", "O(") for line in lines])
        as_top.pop("required", None)
        top = dict(process[name])
        top["description"] = top["description"] if isinstance(top["description"], list) else [top["description"]]
        assert as_top == top, name
        assert bool(doc.get("required")) is (name in spawn.START_REQUIRED), name
        assert doc["type"] == spawn.START_OPTIONS[name]["type"], name
        assert doc.get("default") == spawn.START_OPTIONS[name].get("default"), name
