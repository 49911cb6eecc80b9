# gpufleet — set-up, lab and tests. Every target installs what it needs on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# Second controller environment: the newest ansible-core, which needs Python >= 3.12.
PY_NEW ?= $(shell p=$$(pyenv root 2>/dev/null || echo /root/.pyenv); ls -d $$p/versions/3.13*/bin/python3 $$p/versions/3.12*/bin/python3 2>/dev/null | head -n1)
VENV_NEW ?= .venv-ansible-2.21
# Third: ansible-core 2.20 (Python >= 3.12; a 3.12 first), for the unit tests only (`make test`).
PY_220 ?= $(shell p=$$(pyenv root 2>/dev/null || echo /root/.pyenv); ls -d $$p/versions/3.12*/bin/python3 $$p/versions/3.13*/bin/python3 2>/dev/null | head -n1)
VENV_220 ?= .venv-ansible-2.20
LAB_HOSTS ?= 8
LAB_SGLANG_VERSION ?= 0.5.23
LAB_DIR ?= .lab
# PID 1 of each lab host: process (host_init.py, the default) or systemd (Debian's systemd under systemd-nspawn,
# a non-root login user with sudo, sglang_launch_method systemd; needs systemd-container and sudo).
LAB_INIT ?= process
PYTEST_ARGS ?=
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg

.PHONY: setup system-packages venv venv-new venv-2.20 lab-up lab-down demo roll-under-load test test-unit test-lab test-new lint sanity docs \
	clean collection ee-context ee ee-base ee-packages awx-lint bench bench-site tune-trials

setup: system-packages venv

# The lab needs a real sshd, iproute2 and util-linux's fincore (page cache residency of lab weight files, issue 35;
# Debian ships it in util-linux-extra); the systemd lab (LAB_INIT=systemd, and `make test`, which runs the
# systemd lab tests: SYSTEMD_LAB=1) also systemd-nspawn and sudo; the check.yml HTML report test renders in
# headless chromium (`make test`: REPORT_BROWSER=1; `make demo` does without); the metrics tests use Debian's
# prometheus (promtool, and a real server scraping the textfile) and prometheus-node-exporter (`make test`:
# PROMETHEUS=1), installed with a policy-rc.d that keeps their services from starting and then disabled: the tests
# start their own on loopback. Nothing else comes from the OS.
system-packages:
	@need=""; command -v /usr/sbin/sshd >/dev/null || need="$$need openssh-server"; \
	 if [ "$(REPORT_BROWSER)" = 1 ]; then command -v chromium >/dev/null || need="$$need chromium"; fi; \
	 prom=""; if [ "$(PROMETHEUS)" = 1 ]; then \
	   test -x /usr/bin/promtool || prom="$$prom prometheus"; \
	   test -x /usr/bin/prometheus-node-exporter || prom="$$prom prometheus-node-exporter"; \
	 fi; need="$$need$$prom"; \
	 command -v ip >/dev/null || need="$$need iproute2"; \
	 command -v unshare >/dev/null || need="$$need util-linux"; \
	 command -v fincore >/dev/null || need="$$need util-linux-extra"; \
	 command -v ssh >/dev/null || need="$$need openssh-client"; \
	 if [ "$(LAB_INIT)" = systemd ] || [ "$(SYSTEMD_LAB)" = 1 ]; then \
	   test -x /usr/lib/systemd/systemd || need="$$need systemd"; \
	   test -x /usr/bin/dbus-daemon || need="$$need dbus"; \
	   test -x /usr/bin/systemd-nspawn || need="$$need systemd-container"; \
	   test -x /usr/bin/sudo || need="$$need sudo"; \
	 fi; \
	 if [ -n "$$need" ]; then \
	   if [ "$$(id -u)" != 0 ]; then echo "missing system packages:$$need (run 'make system-packages' as root)"; exit 1; fi; \
	   rcd=""; if [ -n "$$prom" ] && [ ! -e /usr/sbin/policy-rc.d ]; then \
	     rcd=/usr/sbin/policy-rc.d; printf '#!/bin/sh\n# gpufleet make system-packages: start no service\nexit 101\n' >$$rcd; \
	     chmod 755 $$rcd; fi; \
	   apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$need >/dev/null; \
	   rc=$$?; if [ -n "$$rcd" ]; then rm -f $$rcd; fi; \
	   if [ -n "$$prom" ] && [ -d /run/systemd/system ]; then \
	     systemctl disable --now prometheus.service prometheus-node-exporter.service >/dev/null 2>&1 || true; fi; \
	   exit $$rc; \
	 fi

# A controller environment: $(1) the interpreter, $(2) the venv folder, $(3) the pinned requirements. Also the
# gpufleet command (src/gpufleet_cli), editable: it runs this checkout's playbooks. Its version is galaxy.yml's
# (setup.py reads it), so a new galaxy.yml reinstalls it.
define controller_venv
	$(1) -m venv $(2)
	$(2)/bin/python -m pip install -q --upgrade pip
	$(2)/bin/python -m pip install -q -r $(3)
	$(2)/bin/python -m pip install -q -e .
	touch $(2)/.installed
endef

venv: $(VENV)/.installed
$(VENV)/.installed: requirements/controller.txt pyproject.toml galaxy.yml
	$(call controller_venv,$(PYTHON),$(VENV),requirements/controller.txt)

venv-new: $(VENV_NEW)/.installed
$(VENV_NEW)/.installed: requirements/controller-ansible-2.21.txt pyproject.toml galaxy.yml
	@test -n "$(PY_NEW)" || { echo "no Python >= 3.12 found (set PY_NEW=/path/to/python3.12+)"; exit 1; }
	$(call controller_venv,$(PY_NEW),$(VENV_NEW),requirements/controller-ansible-2.21.txt)

venv-2.20: $(VENV_220)/.installed
$(VENV_220)/.installed: requirements/controller-ansible-2.20.txt pyproject.toml galaxy.yml
	@test -n "$(PY_220)" || { echo "no Python >= 3.12 found (set PY_220=/path/to/python3.12)"; exit 1; }
	$(call controller_venv,$(PY_220),$(VENV_220),requirements/controller-ansible-2.20.txt)

lab-up: setup
	$(VENV)/bin/python tests/lab/lab.py up --hosts $(LAB_HOSTS) --sglang-version $(LAB_SGLANG_VERSION) --lab-dir $(LAB_DIR) --init $(LAB_INIT)

lab-down:
	@if [ -x $(VENV)/bin/python ]; then $(VENV)/bin/python tests/lab/lab.py down --lab-dir $(LAB_DIR); \
	 else $(PYTHON) tests/lab/lab.py down --lab-dir $(LAB_DIR); fi

# The main job against the lab fleet: lab up, then restart.yml twice (the second run shows it is repeatable).
# The lab writes its inventory to <LAB_DIR>/inventory, and also to inventory/lab for the default LAB_DIR only.
DEMO_INVENTORY ?= $(if $(filter .lab ./.lab,$(LAB_DIR)),inventory/lab,$(LAB_DIR)/inventory)
demo: lab-up
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH ansible-playbook -i $(DEMO_INVENTORY) playbooks/restart.yml
	@echo; echo "=== second run: the lab started with no server, so run 1 was a first launch on every host; now a real rolling restart ==="; echo
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH ansible-playbook -i $(DEMO_INVENTORY) playbooks/restart.yml

# Rolling restart under continuous load behind the real router (ROUTER=sglang-router, its 0.3.2, or ROUTER=smg, its
# successor; both pinned in requirements/controller.txt), with the router integration off (baseline) and on: prints
# failed_requests=N total_requests=M, writes docs/reliability.md.
ROUTER ?= sglang-router
ROLL_HOSTS ?= 4
ROLL_LAB_DIR ?= .lab-roll
roll-under-load: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/python tests/lab/roll_under_load.py --router $(ROUTER) --hosts $(ROLL_HOSTS) --lab-dir $(ROLL_LAB_DIR)

# Two pytest workers (pytest-xdist), one test file each at a time (module fixtures set up once; each worker brings
# up its own lab): one stream leaves the CPU idle while it waits on server starts and SSH round trips, two keep
# 2 cores busy (first pass 70 -> 49 min measured on a 2-core machine). PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
PYTEST_XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)
# Every test under ansible-core 2.19 (.venv), all but the lab_only_once ones under 2.21, the unit tests under 2.20.
test: SYSTEMD_LAB = 1
test: REPORT_BROWSER = 1
test: PROMETHEUS = 1
test: setup venv-new venv-2.20
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/python -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)
	PATH=$(CURDIR)/$(VENV_NEW)/bin:$$PATH $(VENV_NEW)/bin/python -m pytest -m "not lab_only_once" $(PYTEST_XDIST) $(PYTEST_ARGS)
	PATH=$(CURDIR)/$(VENV_220)/bin:$$PATH $(VENV_220)/bin/python -m pytest tests/unit -m "not lab and not lab_only_once" $(PYTEST_XDIST) $(PYTEST_ARGS)

# ansible-lint at the repository root (.ansible-lint says what it skips: generated files), with the real awx.awx
# from the tools venv (linked at .cache/collections, which ansible.cfg's collections_path names) so awx/*.yml is
# checked against its modules' argument specs; the changelog fragments (antsibull-changelog lint); ansible-test sanity.
lint: venv tools-venv
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH ansible-config validate -t all
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH ansible-lint
	PATH=$(CURDIR)/.cache/tools-venv/bin:$$PATH antsibull-changelog lint
	$(MAKE) --no-print-directory sanity

.PHONY: tools-venv changelog
# The throwaway venv of packaging tools (ansible-builder, antsibull-changelog, awx.awx): tests/support/tools_venv.py.
tools-venv: venv
	$(VENV)/bin/python -c 'import sys; sys.path.insert(0, "tests/support"); import tools_venv; tools_venv.tools_venv()'

# The changelog (antsibull-changelog; how to cut a release: docs/releasing.md). `make changelog` lints the fragments
# in changelogs/fragments/; `make changelog VERSION=x.y.z` also cuts release x.y.z: galaxy.yml's version (the one
# version source) becomes x.y.z, the fragments move into changelogs/changelog.yaml and CHANGELOG.md is rewritten.
# Only a VERSION given on the command line releases (not one from the environment or set in this file).
RELEASE_VERSION = $(if $(filter command line,$(origin VERSION)),$(VERSION))
changelog: tools-venv
	PATH=$(CURDIR)/.cache/tools-venv/bin:$$PATH antsibull-changelog lint
	@if [ -n "$(RELEASE_VERSION)" ]; then \
	   $(VENV)/bin/python tests/support/release_version.py "$(RELEASE_VERSION)" && \
	   PATH=$(CURDIR)/.cache/tools-venv/bin:$$PATH antsibull-changelog release && \
	   echo "released $(RELEASE_VERSION): commit galaxy.yml, changelogs/ and CHANGELOG.md"; \
	 fi

# ansible-test sanity (issue 32) on what the collection ships (galaxy.yml's build_ignore decides; plus
# tests/sanity/ignore-<core>.txt), run in a copy laid out as ansible_collections/gpufleet/fleet under .cache/sanity
# with ansible-test from .cache/sanity-venv (the ansible-core pinned in requirements/controller.txt and each sanity
# test's own pins), Python 3.11 only. Fresh: about 3 min (PyPI installs), then about 1 min.
# One test: make sanity SANITY_ARGS='--test validate-modules'.
SANITY_ARGS ?=
sanity: venv
	$(VENV)/bin/python tests/support/sanity.py $(SANITY_ARGS)

# docs/inventory.md's table of every role variable, generated from roles/*/meta/argument_specs.yml
# (tests/unit/test_docs_pages.py fails when the page and the specs disagree).
docs: venv
	$(VENV)/bin/python tests/support/docs_pages.py

# The collection tarball (dist/gpufleet-fleet-<version>.tar.gz), installable with ansible-galaxy collection install.
collection: venv
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH ansible-galaxy collection build --force --output-path dist .

# The version galaxy.yml names (the one version source): the tarball's and the EE image's.
COLLECTION_VERSION := $(shell sed -n 's/^version:[[:space:]]*["'"'"']\{0,1\}\([^"'"'"' #]*\).*/\1/p' galaxy.yml)

# The execution environment's build context (context/Containerfile): the collection tarball of galaxy.yml's version
# goes to dist/ee/gpufleet-fleet.tar.gz, the fixed name execution-environment.yml installs. With a registry:
# podman build -f context/Containerfile -t gpufleet-ee:$(COLLECTION_VERSION) context
ee-context: collection
	$(VENV)/bin/python -c 'import sys; sys.path.insert(0, "tests/support"); import tools_venv; tools_venv.tools_venv()'
	mkdir -p dist/ee && cp dist/gpufleet-fleet-$(COLLECTION_VERSION).tar.gz dist/ee/gpufleet-fleet.tar.gz
	.cache/tools-venv/bin/ansible-builder create -f execution-environment.yml -c context --output-filename Containerfile

# The execution environment built for real with Debian's podman, then check.yml and an ad-hoc nvidia_gpu_info run
# inside it through ansible-runner's process isolation (as AWX runs jobs) against a 2-host lab (docs/ee.md).
# No registry here: the base is a local Debian bookworm (mmdebstrap -> podman import, cached in .cache/ee),
# passed as EE_BASE_IMAGE. EE_BASE=<image> builds on that image instead (pulled if missing; EE_PKGMGR its
# package manager). The lab part takes ~10 s; EE_LAB_LOCK (below) serialises it with other labs.
EE_TAG ?= gpufleet-ee:$(COLLECTION_VERSION)
EE_BASE ?=
EE_PKGMGR ?= /usr/bin/microdnf
EE_LAB_DIR ?= .lab-ee
EE_DIR := $(CURDIR)/.cache/ee
# pip inside the build uses the host's package index: its pip config, the local indexes it names and the CA bundle
# (the host's, which trusts its HTTPS proxy), read-only.
EE_PIP_MOUNTS ?= $(foreach p,$(wildcard /etc/pip.conf /etc/xdg/pip /etc/ssl/certs/ca-certificates.crt /opt/wheels /opt/pypi /opt/pypi-more), -v $(p):$(p):ro)
# Where labs share a machine, EE_LAB_LOCK=<file> runs the lab part under flock on it (the build runs unlocked).
EE_LAB_LOCK ?=
ee ee-base: export CONTAINERS_CONF := $(EE_DIR)/containers.conf
ee: setup ee-context ee-packages $(EE_DIR)/containers.conf
	@if [ -z "$(EE_BASE)" ]; then $(MAKE) --no-print-directory ee-base; fi
	.cache/tools-venv/bin/ansible-builder build -f execution-environment.yml -c context \
	  --container-runtime podman --tag $(EE_TAG) -v 3 \
	  $(if $(EE_BASE),--build-arg EE_BASE_IMAGE=$(EE_BASE) --build-arg PKGMGR=$(EE_PKGMGR),--build-arg EE_BASE_IMAGE=$(EE_LOCAL_BASE) --build-arg PKGMGR=/usr/bin/apt-get --build-arg PKGMGR_PRESERVE_CACHE=always) \
	  --extra-build-cli-args "--network host$(EE_PIP_MOUNTS)"
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH GPUFLEET_EE_IMAGE=$(EE_TAG) GPUFLEET_EE_LAB_DIR=$(CURDIR)/$(EE_LAB_DIR) \
	  $(if $(EE_LAB_LOCK),flock $(EE_LAB_LOCK)) $(VENV)/bin/python -m pytest -p no:xdist -p no:cacheprovider tests/ee -q -o addopts= $(PYTEST_ARGS)

ee-packages:
	@need=""; for p in podman runc mmdebstrap; do command -v $$p >/dev/null || need="$$need $$p"; done; \
	 if [ -n "$$need" ]; then \
	   if [ "$$(id -u)" != 0 ]; then echo "missing system packages:$$need (run 'make ee' as root)"; exit 1; fi; \
	   apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$need >/dev/null; \
	 fi

# Debian's podman on these machines (FIELD-NOTES): runc (crun refuses hybrid cgroups), cgroupfs, no cgroup pids
# limit and no default ulimits (they fail with EPERM). Used through CONTAINERS_CONF, the system's config untouched.
$(EE_DIR)/containers.conf: Makefile
	mkdir -p $(EE_DIR)
	printf '[containers]\ndefault_ulimits = []\npids_limit = 0\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n' > $@

# The local stand-in of an EE base: Debian bookworm with python3, pip and the ssh client (ansible-core and
# ansible-runner come from the EE build, as on any base). The tarball is cached; re-imported when missing.
EE_LOCAL_BASE := localhost/gpufleet-ee-base:bookworm
EE_DEBIAN_MIRROR ?= http://deb.debian.org/debian
ee-base: $(EE_DIR)/base-bookworm.tar $(EE_DIR)/containers.conf
	podman image exists $(EE_LOCAL_BASE) || podman import --change 'CMD ["/bin/bash"]' $< $(EE_LOCAL_BASE)
$(EE_DIR)/base-bookworm.tar:
	mkdir -p $(EE_DIR)
	mmdebstrap --variant=apt --include=python3,python3-pip,openssh-client,ca-certificates \
	  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
	  --dpkgopt='path-exclude=/usr/share/locale/*' --aptopt='Acquire::Languages "none"' \
	  bookworm $@.part.tar $(EE_DEBIAN_MIRROR)
	mv $@.part.tar $@

# AWX configuration as code: syntax-check and lint awx/configure.yml against awx.awx from a throwaway venv.
awx-lint: venv
	$(VENV)/bin/python -c 'import sys; sys.path.insert(0, "tests/support"); import tools_venv; tools_venv.tools_venv()'
	AWX=$$(ls -d $(CURDIR)/.cache/tools-venv/lib/python3*/site-packages); \
	 PATH=$(CURDIR)/$(VENV)/bin:$$PATH ANSIBLE_COLLECTIONS_PATH=$$AWX:$(CURDIR)/collections ansible-playbook --syntax-check awx/configure.yml && \
	 PATH=$(CURDIR)/$(VENV)/bin:$$PATH ANSIBLE_COLLECTIONS_PATH=$$AWX:$(CURDIR)/collections ansible-lint awx/configure.yml

# Lab benchmarks (issue 14): brings up its own lab in .lab-bench (64 hosts), measures, takes it down, writes
# docs/benchmarks.json, the generated section of docs/benchmarks.md and docs/img/bench-*.png (about 25 min on 2
# cores). Parts: make bench BENCH_ARGS='--only single,check --runs 3'. matplotlib and py-spy (make bench-site) go to .cache/bench-site only.
BENCH_ARGS ?=
BENCH_SITE := $(CURDIR)/.cache/bench-site
bench-site: venv $(BENCH_SITE)/.installed
bench: setup $(BENCH_SITE)/.installed
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH GPUFLEET_BENCH_SITE=$(BENCH_SITE) PYTHONUNBUFFERED=1 \
	  $(VENV)/bin/python tests/bench/bench.py $(BENCH_ARGS)
$(BENCH_SITE)/.installed: requirements/bench.txt
	$(VENV)/bin/python -m pip install -q --upgrade --target $(BENCH_SITE) -r requirements/bench.txt
	touch $@

# tune.yml's decision under noise (issue 34; not part of make test): 10 seeded trials of playbooks/tune.yml over the
# 4 candidates of tests/bench/tune_candidates.yml on a lab canary (its own lab in .lab-tune), each checked against
# the lab stand-in's speed table (docs/lab.md "Decode speed"); writes tests/bench/results/tune_trials.json.
# Options: make tune-trials TUNE_TRIALS_ARGS='--parallel 2 --repeats 3 -e gpufleet_tune_num_prompts=4'.
TUNE_TRIALS_ARGS ?=
tune-trials: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH PYTHONUNBUFFERED=1 $(VENV)/bin/python tests/bench/tune_trials.py $(TUNE_TRIALS_ARGS)

clean: lab-down
	rm -rf $(VENV) $(VENV_NEW) $(VENV_220) .cache dist context artifacts
