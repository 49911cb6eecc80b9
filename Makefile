# gpufleet — set-up, lab and tests. Every target installs what it needs on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# Second controller environment: the newest ansible-core, which needs Python >= 3.12.
PY_NEW ?= $(shell p=$$(pyenv root 2>/dev/null || echo /root/.pyenv); ls -d $$p/versions/3.13*/bin/python3 $$p/versions/3.12*/bin/python3 2>/dev/null | head -n1)
VENV_NEW ?= .venv-ansible-2.21
LAB_HOSTS ?= 8
LAB_SGLANG_VERSION ?= 0.5.23
LAB_DIR ?= .lab
# PID 1 of each lab host: process (host_init.py, the default) or systemd (Debian's systemd under systemd-nspawn,
# a non-root login user with sudo, sglang_launch_method systemd; needs systemd-container and sudo).
LAB_INIT ?= process
PYTEST_ARGS ?=
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg

.PHONY: setup system-packages venv venv-new lab-up lab-down demo test test-unit test-lab test-new lint docs clean

setup: system-packages venv

# The lab needs a real sshd and iproute2; the systemd lab (LAB_INIT=systemd, and `make test`, which runs the
# systemd lab tests: SYSTEMD_LAB=1) also systemd-nspawn and sudo. Nothing else comes from the OS.
system-packages:
	@need=""; command -v /usr/sbin/sshd >/dev/null || need="$$need openssh-server"; \
	 command -v ip >/dev/null || need="$$need iproute2"; \
	 command -v unshare >/dev/null || need="$$need util-linux"; \
	 command -v ssh >/dev/null || need="$$need openssh-client"; \
	 if [ "$(LAB_INIT)" = systemd ] || [ "$(SYSTEMD_LAB)" = 1 ]; then \
	   test -x /usr/lib/systemd/systemd || need="$$need systemd"; \
	   test -x /usr/bin/dbus-daemon || need="$$need dbus"; \
	   test -x /usr/bin/systemd-nspawn || need="$$need systemd-container"; \
	   test -x /usr/bin/sudo || need="$$need sudo"; \
	 fi; \
	 if [ -n "$$need" ]; then \
	   if [ "$$(id -u)" != 0 ]; then echo "missing system packages:$$need (run 'make system-packages' as root)"; exit 1; fi; \
	   apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$need >/dev/null; \
	 fi

venv: $(VENV)/.installed
$(VENV)/.installed: requirements/controller.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -r requirements/controller.txt
	touch $@

venv-new: $(VENV_NEW)/.installed
$(VENV_NEW)/.installed: requirements/controller-ansible-2.21.txt
	@test -n "$(PY_NEW)" || { echo "no Python >= 3.12 found (set PY_NEW=/path/to/python3.12+)"; exit 1; }
	$(PY_NEW) -m venv $(VENV_NEW)
	$(VENV_NEW)/bin/python -m pip install -q --upgrade pip
	$(VENV_NEW)/bin/python -m pip install -q -r requirements/controller-ansible-2.21.txt
	touch $@

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
	@echo; echo "=== second run: every host restarted again, still green ==="; echo
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH ansible-playbook -i $(DEMO_INVENTORY) playbooks/restart.yml

test: SYSTEMD_LAB = 1
test: setup venv-new
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/python -m pytest $(PYTEST_ARGS)
	PATH=$(CURDIR)/$(VENV_NEW)/bin:$$PATH $(VENV_NEW)/bin/python -m pytest -m "not lab_only_once" $(PYTEST_ARGS)

lint: venv
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH ansible-config validate -t all
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH ansible-lint playbooks roles

clean: lab-down
	rm -rf $(VENV) $(VENV_NEW) .cache
