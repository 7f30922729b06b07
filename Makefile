# gpuguard — `make demo` and `make test` are all a new user needs (Debian 12, as root).
SHELL := /bin/bash
# The interpreter of the venv (and of `make install`'s): the distribution's own /usr/bin/python3 when it can make a
# venv, else python3 from PATH; PYTHON=... chooses another. Debian and Ubuntu build theirs with profile-guided
# optimisation and LTO: on the 2-core CI machine the whole suite took ~20% less CPU with it than with a plain source
# build (pyenv's, first on that PATH), and it is the Python a compute node's own packages run on.
ifndef PYTHON
PYTHON := $(shell for p in /usr/bin/python3 python3; do $$p -c 'import sys, venv, ensurepip; \
  sys.exit(sys.version_info < (3, 9))' >/dev/null 2>&1 && { echo $$p; exit 0; }; done; echo python3)
endif
VENV ?= .venv
PY := $(VENV)/bin/python
PREFIX ?= /usr/local
CONFDIR ?= /etc/gpuguard
FAKENVML := build/fakenvml/libnvidia-ml.so.1
# Debian's Python images (CI's among them) set PYTHONDONTWRITEBYTECODE=1: every process would compile what it
# imports from source, and every pytest worker would rewrite the asserts of every test module anew (~7 s of CPU
# per worker here). Nothing make starts needs that.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: all deps venv torch fakenvml demo test unit integration bench install rollback uninstall slurm-conf clean

all: venv fakenvml

# Slurm and munge from Debian, only when missing (the integration tests and the demo boot a real cluster).
deps:
	@if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then \
	  echo ">> installing slurm-wlm and munge (apt)"; \
	  if [ "$$(id -u)" != 0 ]; then echo "need root to apt-get install slurm-wlm munge" >&2; exit 1; fi; \
	  apt-get -o DPkg::Lock::Timeout=300 update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends \
	    slurm-wlm munge gcc libc6-dev >/dev/null; \
	fi
	@# shellcheck: every rendered sbatch template is checked with it
	@command -v shellcheck >/dev/null || { [ "$$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive \
	  apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends shellcheck >/dev/null; } || true
	@# locales: the node agent's tests build en_US.UTF-8 with localedef (the locale a service gets from locale.conf)
	@[ -f /usr/share/i18n/locales/en_US ] || { [ "$$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive \
	  apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends locales >/dev/null; } || true
	@# PostgreSQL (the fleet history tests boot a real server in a temp dir) and promtool (Prometheus rules and
	@# metrics are checked with it): Debian's packages, only when missing
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || ! command -v promtool >/dev/null; then \
	  echo ">> installing postgresql and prometheus (promtool) (apt)"; \
	  if [ "$$(id -u)" != 0 ]; then echo "need root to apt-get install postgresql prometheus" >&2; exit 1; fi; \
	  apt-get -o DPkg::Lock::Timeout=300 update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends \
	    postgresql prometheus >/dev/null; \
	fi
	@# Alertmanager and amtool (the alert tests start a real one in a temp dir): Debian's package, only when missing
	@if ! command -v prometheus-alertmanager >/dev/null || ! command -v amtool >/dev/null; then \
	  echo ">> installing prometheus-alertmanager (apt)"; \
	  if [ "$$(id -u)" != 0 ]; then echo "need root to apt-get install prometheus-alertmanager" >&2; exit 1; fi; \
	  apt-get -o DPkg::Lock::Timeout=300 update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends \
	    prometheus-alertmanager >/dev/null; \
	fi
	@# PgBouncer: the pooler docs/fleet.md recommends for health-check shipping, tested in transaction mode
	@if ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ]; then \
	  echo ">> installing pgbouncer (apt)"; \
	  if [ "$$(id -u)" != 0 ]; then echo "need root to apt-get install pgbouncer" >&2; exit 1; fi; \
	  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends pgbouncer >/dev/null || \
	  { apt-get -o DPkg::Lock::Timeout=300 update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends \
	    pgbouncer >/dev/null; }; \
	fi

$(VENV)/.installed: setup.cfg pyproject.toml
	@echo ">> python venv in $(VENV) ($(PYTHON))"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v '^WARNING: Location' || true
	@$(PY) -c 'import gpuguard, pynvml, yaml, psutil, pytest, xdist, hypothesis, apprise, prometheus_client, psycopg, hostlist'
	@touch $@

venv: $(VENV)/.installed

# CPU PyTorch for the torchrun end-to-end tests and the torch.distributed bandwidth probe (from this machine's
# local wheel cache when present; a CPU-only build either way).
$(VENV)/.torch: $(VENV)/.installed
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 \
	  2>&1 | grep -v '^WARNING: Location' || true
	@$(PY) -c 'import torch' 2>/dev/null && touch $@ || echo ">> torch not available: the torchrun tests will be skipped"

# With it, the oldest supported PyTorch (test_torchrun_oldest.py), once per machine in ~/.cache/gpuguard
# (devtools/oldtorch.py): its 2.6 GB download and 4.7 GB install are no part of the tests' time.
torch: $(VENV)/.torch
	@[ ! -f $(VENV)/.torch ] || $(PY) -m devtools.oldtorch

$(FAKENVML): lib/gpuguard/simulate/fakenvml.c
	@echo ">> building the fake libnvidia-ml.so.1 (simulated GPUs)"
	@mkdir -p $(dir $@)
	@cc -shared -fPIC -O2 -Wall -Wextra -Werror -o $@.tmp $< -lpthread && mv $@.tmp $@

fakenvml: $(FAKENVML)

demo: deps venv torch fakenvml
	@$(PY) -m devtools.demo $(DEMO_ARGS)

# Whole files per worker (a module's Slurm cluster or PostgreSQL server stays in one process), longest first
# (tests/conftest.py orders them; --no-loadscope-reorder keeps that order). Six workers on CI's 2 cores: the
# end-to-end tests spend most of their time waiting (Slurm's requeue delay, time limits, checkpoints), so the
# long ones run side by side while the others fill the gaps. Measured on this machine (whole-machine idle CPU over
# the run): four workers left both cores ~40 % idle in the first minute; five, 36 CPU-s idle, most of it in the
# first two minutes while the five longest files (all of them waiting ones) had a worker each; six, 18 CPU-s.
PYTEST_PAR ?= -n 6 --dist loadfile --no-loadscope-reorder
# One collection first writes the assert-rewritten test modules' cache, which every worker then reads (2 s of CPU
# each instead of 7).
PYTEST_WARM = $(PY) -m pytest -q --collect-only -p no:cacheprovider

test: deps venv torch fakenvml
	@$(PYTEST_WARM) tests >/dev/null || true
	@$(PY) -m pytest -q $(PYTEST_PAR) tests

unit: venv fakenvml
	@$(PYTEST_WARM) tests/unit >/dev/null || true
	@$(PY) -m pytest -q $(PYTEST_PAR) tests/unit

integration: deps venv torch fakenvml
	@$(PYTEST_WARM) tests/integration >/dev/null || true
	@$(PY) -m pytest -q $(PYTEST_PAR) tests/integration

# The prolog's yardstick: NHC 1.4.3 (bench/nhc.py runs its own script from a checkout; nothing of it is copied into
# gpuguard). NHC_SRC=... names a checkout; else one is cloned into build/nhc once, when the network allows.
NHC_SRC ?= $(CURDIR)/build/nhc
NHC_REPO ?= https://github.com/mej/nhc
bench: deps venv fakenvml
	@[ -x "$(NHC_SRC)/nhc" ] || { echo ">> cloning NHC 1.4.3 (the prolog's yardstick) into $(NHC_SRC)"; \
	  timeout 120 git clone -q $(NHC_REPO) "$(NHC_SRC)" && git -C "$(NHC_SRC)" checkout -q 1.4.3; } || \
	  { rm -rf "$(NHC_SRC)"; echo "   no NHC: the prolog targets are not measured (NHC_SRC=/path/to/nhc)"; }
	@NHC_SRC="$(NHC_SRC)" $(PY) bench/run.py $(BENCH_ARGS)

# Installs the package into a version directory of its own, $(PREFIX)/lib/gpuguard/versions/<version>-<time>/venv,
# switched in by one rename of the symlink $(PREFIX)/lib/gpuguard/current (gpuguard.cli.versions: a hook running during
# the install starts on the old version or the new one, never on half of one; the previous version stays for
# `make rollback`, older ones go), the slurmd hooks into $(PREFIX)/libexec/gpuguard (gpuguard.env beside them keeps
# the site's own lines), `gpuguard` into $(PREFIX)/bin, an example config (never overwriting one).
GG_ROOT = $(PREFIX)/lib/gpuguard
GG_PYTHON = $(GG_ROOT)/current/venv/bin/python
install: fakenvml
	@echo ">> installing gpuguard under $(PREFIX)"
	@# with the fleet extra (psycopg[binary], a self-contained wheel): setting store.url is then a config change on
	@# every node, no reinstall; the hooks never import it (only shipping does, after the verdict)
	@set -o pipefail; PYTHONPATH=lib $(PYTHON) -m gpuguard.cli.versions --root $(GG_ROOT) --python $(PYTHON) \
	  --source . --extras fleet --require psycopg 2>&1 | { grep -v '^WARNING: Location' || true; }
	@install -d $(PREFIX)/bin $(PREFIX)/libexec/gpuguard $(GG_ROOT)/fakenvml
	@ln -sfn $(GG_ROOT)/current/venv/bin/gpuguard $(PREFIX)/bin/.gpuguard.new && mv -Tf $(PREFIX)/bin/.gpuguard.new $(PREFIX)/bin/gpuguard
	@install -m 755 $(FAKENVML) $(GG_ROOT)/fakenvml/.new && mv -f $(GG_ROOT)/fakenvml/.new $(GG_ROOT)/fakenvml/$(notdir $(FAKENVML))
	@install -d $(PREFIX)/share/gpuguard/sbatch_templates $(PREFIX)/share/gpuguard/examples
	@install -m 644 sbatch_templates/*.j2 sbatch_templates/README.md $(PREFIX)/share/gpuguard/sbatch_templates/
	@cp -r examples/scenarios $(PREFIX)/share/gpuguard/examples/
	@# the rules with their promtool tests beside them (`promtool test rules gpuguard.rules.test.yml` there), the
	@# example Alertmanager configuration (routing, grouping, inhibition: docs/alerts.md) and the dashboard
	@# (the tests expect the runbook links the rules got)
	@install -d $(PREFIX)/share/gpuguard/observability && install -m 644 observability/gpuguard-dashboard.json \
	  observability/alertmanager.yml docs/runbooks.md $(PREFIX)/share/gpuguard/observability/ && u='$(RUNBOOK_URL)' && \
	  for f in gpuguard.rules.yml gpuguard.rules.test.yml; do sed "s|@RUNBOOK_URL@|$${u:-file://$(PREFIX)/share/gpuguard/observability/runbooks.md}|g" \
	  observability/$$f > $(PREFIX)/share/gpuguard/observability/$$f && chmod 644 $(PREFIX)/share/gpuguard/observability/$$f || exit 1; done
	@for unit in gpuguard-watch gpuguard-watch-agent; do sed "s|/usr/local/libexec|$(PREFIX)/libexec|g" \
	  healthcheck/$$unit.service > $(PREFIX)/share/gpuguard/$$unit.service; done
	@echo ">> the watch daemon (drains within a second of a fatal Xid):"
	@echo "   cp $(PREFIX)/share/gpuguard/gpuguard-watch.service /etc/systemd/system/ && systemctl daemon-reload && systemctl enable --now gpuguard-watch"
	@echo "   or, with the node agent that runs the hooks without a Python start-up each (docs/agent.md), instead:"
	@echo "   cp $(PREFIX)/share/gpuguard/gpuguard-watch-agent.service /etc/systemd/system/ && systemctl daemon-reload && systemctl enable --now gpuguard-watch-agent"
	@# gpuguard.env: GPUGUARD_PYTHON through `current`; GPUGUARD_CONFIG only where the file has none unless CONFDIR= is
	@# given; every other line (a site's GPUGUARD_STATE_DIR, GPUGUARD_RUNTIME_DIR, ...) is kept
	@PYTHONPATH=lib $(PYTHON) -m gpuguard.cli.install --libexec $(PREFIX)/libexec/gpuguard --python $(GG_PYTHON) \
	  $(if $(filter file,$(origin CONFDIR)),--default-config,--config) $(CONFDIR)/config.yaml
	@# 0640, never overwritten: notification URLs in it carry tokens
	@PYTHONPATH=lib $(PYTHON) -m gpuguard.cli.install --install-config examples/config.yaml --config $(CONFDIR)/config.yaml
	@echo ">> the running watch unit keeps the version it started with until restarted (systemctl restart gpuguard-watch"
	@echo "   or gpuguard-watch-agent); its node agent takes the new version up by itself (docs/agent.md)"
	@echo ">> add these lines to slurm.conf and run 'scontrol reconfigure':"
	@$(PREFIX)/bin/gpuguard slurm-conf --prefix $(PREFIX)

# Switches $(PREFIX)/lib/gpuguard/current back to the version before it (kept by `make install`), in one rename.
rollback:
	@PYTHONPATH=lib $(PYTHON) -m gpuguard.cli.versions --root $(PREFIX)/lib/gpuguard --rollback

# Removes what `make install` put in place (every version, the hooks, `gpuguard`, the shared files). The config
# ($(CONFDIR)) and the history (the node store under $(STATEDIR), store.path's default) stay unless PURGE=1.
STATEDIR ?= /var/lib/gpuguard
uninstall:
	@case "$(PREFIX)" in ""|/) echo "refusing to uninstall from PREFIX='$(PREFIX)'" >&2; exit 1 ;; esac
	@echo ">> removing gpuguard from $(PREFIX)"
	@if [ -L $(PREFIX)/bin/gpuguard ] && case "$$(readlink $(PREFIX)/bin/gpuguard)" in \
	  $(PREFIX)/lib/gpuguard/*) true ;; *) false ;; esac; then rm -f $(PREFIX)/bin/gpuguard; fi
	@rm -rf $(PREFIX)/lib/gpuguard $(PREFIX)/libexec/gpuguard $(PREFIX)/share/gpuguard
	@if [ "$(PURGE)" = 1 ]; then \
	  case "$(CONFDIR)$(STATEDIR)" in *gpuguard*gpuguard*) ;; \
	    *) echo "PURGE=1 removes only directories named gpuguard: CONFDIR=$(CONFDIR) STATEDIR=$(STATEDIR)" >&2; exit 1 ;; esac; \
	  rm -rf $(CONFDIR) $(STATEDIR); echo ">> PURGE=1: removed the config ($(CONFDIR)) and the history ($(STATEDIR))"; \
	else echo ">> kept the config ($(CONFDIR)) and the history ($(STATEDIR)); 'make uninstall PURGE=1' removes them too"; fi
	@echo ">> remove gpuguard's lines from slurm.conf (Prolog=, Epilog=, HealthCheckProgram=, see 'gpuguard slurm-conf')"
	@echo "   and run 'scontrol reconfigure'; 'systemctl disable --now gpuguard-watch' if you installed the watch unit"

slurm-conf: venv
	@$(PY) -m gpuguard slurm-conf --prefix $(PREFIX)

clean:
	rm -rf build .pytest_cache .hypothesis
