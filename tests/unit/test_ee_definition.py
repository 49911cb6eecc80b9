"""The execution environment's definition: an Ansible EE base, one version source, the collection's Python
requirements found the Galaxy way. ``make ee`` builds and runs the image (tests/ee/); this is the part that needs
no container engine."""
import os
import pathlib
import re
import subprocess

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(rel):
    return yaml.safe_load((ROOT / rel).read_text())


def test_the_ee_builds_on_an_ansible_ee_base_and_names_no_version():
    ee = _load("execution-environment.yml")
    assert ee["version"] == 3
    assert re.fullmatch(r"ghcr\.io/ansible-community/community-ee-(minimal|base):\S+", ee["images"]["base_image"]["name"])
    # galaxy.yml's version is the one source: the EE file names none (tarball and tag come from make ee)
    version = _load("galaxy.yml")["version"]
    assert version not in (ROOT / "execution-environment.yml").read_text()
    assert "tags" not in ee.get("options", {})
    pins = (ROOT / "requirements" / "controller.txt").read_text().splitlines()
    assert ee["dependencies"]["ansible_core"]["package_pip"] in pins
    assert ee["dependencies"]["ansible_runner"]["package_pip"] in pins


def test_the_collection_declares_its_python_requirements_for_ansible_builder():
    meta = _load("meta/execution-environment.yml")
    req = ROOT / meta["dependencies"]["python"]
    assert req.name == "requirements.txt" and req.is_file()
    names = {re.split(r"[=<>!~ ;\[]", line, maxsplit=1)[0].lower() for line in req.read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    assert "prometheus-client" in names


def test_make_ee_tags_the_image_and_names_the_tarball_from_galaxy_yml():
    version = _load("galaxy.yml")["version"]
    env = dict(os.environ, MAKEFLAGS="")
    dry = subprocess.run(["make", "-n", "--no-print-directory", "ee"], cwd=str(ROOT), env=env,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "cp dist/gpufleet-fleet-%s.tar.gz dist/ee/gpufleet-fleet.tar.gz" % version in dry.stdout
    assert "--tag gpufleet-ee:%s " % version in dry.stdout
    assert "GPUFLEET_EE_IMAGE=gpufleet-ee:%s " % version in dry.stdout
