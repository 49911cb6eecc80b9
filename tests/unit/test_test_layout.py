"""The test tree itself: pytest (rootdir import mode, no packages) imports each test module by its basename, so two
modules of one name anywhere under tests/ make the second fail to collect ("import file mismatch"): CI lost
tests/integration/test_prefetch.py that way beside tests/unit/plugins/plugin_utils/test_prefetch.py."""
import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent.parent


def test_every_test_module_has_a_basename_of_its_own():
    seen = collections.defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if "__pycache__" not in path.parts:
            seen[path.name].append(str(path.relative_to(TESTS)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
    assert "test_weight_prefetch.py" in seen and "test_prefetch.py" in seen  # the pair that collided, now apart
