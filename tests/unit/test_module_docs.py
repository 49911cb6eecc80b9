"""Every module's documentation renders in ansible-doc with every sentence whole (issue 32).

A RETURN entry in flow style (``uuid: {description: GPU UUID (nvmlDeviceGetUUID, nvidia-smi uuid)., type: str}``)
still parses, but as a mapping whose description stops at the comma and whose rest became keys: ansible-doc
showed "GPU UUID (nvmlDeviceGetUUID". These tests read the documentation as ansible-doc renders it (doc fragments
merged) and fail on any key the documentation format does not have, a missing type or description, and a
description whose brackets do not close. ``make sanity`` (ansible-test's validate-modules) checks the same and
more, but needs its own environment; these run with the unit tests.
"""
import re

import pytest

import module_docs

# The keys the module documentation format has (ansible-test's validate-modules schema, ansible-core 2.19).
OPTION_KEYS = {"description", "type", "required", "default", "choices", "elements", "aliases", "suboptions",
               "version_added", "version_added_collection", "deprecated", "no_log", "apply_defaults"}
RETURN_KEYS = {"description", "type", "returned", "sample", "contains", "elements", "version_added",
               "version_added_collection"}
TYPES = {"str", "int", "float", "bool", "list", "dict", "path", "raw", "jsonarg", "json", "bytes", "bits",
         "complex"}


def walk(entries, children, where):
    for name, spec in (entries or {}).items():
        yield "%s.%s" % (where, name), spec
        if isinstance(spec, dict):
            yield from walk(spec.get(children), children, "%s.%s" % (where, name))


def text(description):
    return " ".join(description) if isinstance(description, list) else description


def problems(path, spec, allowed, need_type):
    if not isinstance(spec, dict):
        return ["%s is not a mapping: %r" % (path, spec)]
    found = []
    extra = set(spec) - allowed
    if extra:
        found.append("%s has keys the format does not have (a description cut at a comma or colon?): %s"
                     % (path, sorted(extra)))
    desc = text(spec.get("description"))
    if not isinstance(desc, str) or not desc.strip():
        found.append("%s has no description" % path)
    elif desc.count("(") != desc.count(")"):
        found.append("%s: brackets do not close, the text looks cut: %r" % (path, desc))
    if need_type and spec.get("type") not in TYPES:
        found.append("%s: type %r" % (path, spec.get("type")))
    return found


def test_every_module_is_rendered():
    assert set(module_docs.rendered()) == set(module_docs.MODULES)
    assert len(module_docs.MODULES) >= 11


@pytest.mark.parametrize("name", module_docs.MODULES)
def test_options_and_return_values_are_whole(name):
    data = module_docs.rendered()[name]
    found = []
    for path, spec in walk(data["doc"]["options"], "suboptions", "options"):
        found += problems(path, spec, OPTION_KEYS, need_type=False)
    assert data["return"], "%s documents no RETURN" % name
    for path, spec in walk(data["return"], "contains", "RETURN"):
        found += problems(path, spec, RETURN_KEYS, need_type=True)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("name", module_docs.MODULES)
def test_module_references_are_fqcn_and_attributes_are_described(name):
    doc = module_docs.rendered()[name]["doc"]
    for also in doc.get("seealso") or []:
        if "module" in also:
            assert also["module"].count(".") >= 2, also
    everything = repr(doc) + repr(module_docs.rendered()[name]["return"])
    short = re.findall(r"M\(([^).]+)\)", everything)
    assert not short, "M() needs a FQCN (gpufleet.fleet.X, ansible.builtin.X): %s" % short
    for attr in ("check_mode", "diff_mode", "platform"):
        assert doc["attributes"][attr]["description"] and doc["attributes"][attr]["support"], attr


def test_the_cut_uuid_description_reads_whole():
    uuid = module_docs.rendered()["nvidia_gpu_info"]["return"]["gpus"]["contains"]["uuid"]
    assert uuid == {"description": "GPU UUID (nvmlDeviceGetUUID, nvidia-smi uuid).", "type": "str",
                    "sample": "GPU-8b76e503-d849-6334-acea-f57e29736cb3"}


def test_the_gpu_modules_share_the_selector_docs():
    info, wait = (module_docs.rendered()[m]["doc"]["options"] for m in ("nvidia_gpu_info", "nvidia_gpu_wait"))
    for option in ("gpus", "backend", "expected_count"):
        assert info[option] == wait[option], option
