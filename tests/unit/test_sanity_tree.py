"""make sanity's collection tree (tests/support/sanity.py): what the collection ships, plus the ignore file."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "support"))
import sanity  # noqa: E402


def test_build_ignore_patterns_match_as_ansible_galaxy_applies_them():
    patterns = ["tests", ".venv-*", "*.pyc", "inventory/lab", "collections"]
    assert sanity.shipped("plugins/modules/nvidia_gpu_info.py", patterns)
    assert sanity.shipped("plugins/doc_fragments/nvidia_gpu.py", patterns)
    assert sanity.shipped("inventory/group_vars/all.yml", patterns)
    assert not sanity.shipped("tests/unit/test_module_docs.py", patterns)  # a folder above matches
    assert not sanity.shipped(".venv-ansible-2.21/bin/python", patterns)
    assert not sanity.shipped("plugins/filter/__pycache__/x.cpython-311.pyc", patterns)  # * crosses folders
    assert not sanity.shipped("inventory/lab/hosts.yml", patterns)
    assert not sanity.shipped("collections/ansible_collections/gpufleet/fleet", patterns)


def test_the_tree_holds_the_plugins_and_the_ignore_file_but_not_the_test_suite_or_the_link():
    files = set(sanity.tree_files())
    assert {"galaxy.yml", "meta/runtime.yml", "plugins/modules/nvidia_gpu_info.py",
            "plugins/doc_fragments/nvidia_gpu.py", "tests/sanity/ignore-2.19.txt"} <= files
    assert not [f for f in files if f.startswith(("collections/", "library/", "tests/unit/", "tests/lab/", "src/"))]
