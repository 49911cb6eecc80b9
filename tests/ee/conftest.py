"""Fixtures for the execution-environment test (``make ee``; not part of ``make test``).

``ee_image``: the image ``make ee`` built (``GPUFLEET_EE_IMAGE``, e.g. ``gpufleet-ee:<version>``); the test is skipped
when it is unset. ``ee_lab``: a 2-host lab in ``GPUFLEET_EE_LAB_DIR`` (default ``<repo>/.lab-ee``), brought up
and taken down by the session; ``GPUFLEET_TEST_LAB_DIR`` reuses a running lab instead (left running). The lab
API is the integration tests' ``Lab`` (tests/integration/conftest.py docstring).
"""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _integration_conftest():
    spec = importlib.util.spec_from_file_location(
        "gpufleet_integration_conftest", os.path.join(ROOT, "tests", "integration", "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


labs = _integration_conftest()


@pytest.fixture(scope="session")
def ee_image():
    image = os.environ.get("GPUFLEET_EE_IMAGE")
    if not image:
        pytest.skip("GPUFLEET_EE_IMAGE is not set: run make ee")
    return image


@pytest.fixture(scope="session")
def ee_lab():
    reason = labs._lab_prerequisites()
    if reason:
        pytest.skip(reason)
    yield from labs._session_lab(labs.Lab, "GPUFLEET_TEST_LAB_DIR",
                                 os.environ.get("GPUFLEET_EE_LAB_DIR", os.path.join(ROOT, ".lab-ee")), 2, "process")
