# laplace-ng developer commands. `make help` lists them.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2
# Stops a GPU target with one line where torch sees no CUDA device.
NEED_CUDA = $(PY) -c "import sys, torch; torch.cuda.is_available() or sys.exit('make $@ needs a CUDA GPU: torch ' + torch.__version__ + ' sees none on this machine (torch.cuda.is_available() is False)')"

.PHONY: help install test test-all test-gpu lint format demo bench bench-scaling bench-compare fingerprint bench-gpu docs lock clean

help:  ## list the commands
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml requirements/lock.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check --no-deps -r requirements/lock.txt
	$(PIP) install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e '.[all,dev,examples,docs]'
	touch $(STAMP)

install: $(STAMP)  ## create .venv if missing and install -e .[all,dev,examples,docs] from the lock file

test: $(STAMP)  ## run the test suite (slow cases excluded)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS)

test-all: $(STAMP)  ## run every test, slow cases and many more property-test examples included
	LAPLACE_HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q -n $(PYTEST_WORKERS) -m ''

test-gpu: $(STAMP)  ## on a CUDA GPU: every device-parametrised test on cuda, then the oracle tests in float64 on cuda
	@$(NEED_CUDA)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m '' -k cuda
	LAPLACE_TEST_DEVICE=cuda $(PY) -m pytest -q -n $(PYTEST_WORKERS) -m 'oracle and not slow'

lint: $(STAMP)  ## ruff lint and format check; mypy on a user script (tests/typing)
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m ruff format --check src tests benchmarks examples
	$(PY) -m mypy tests/typing/user_script.py

format: $(STAMP)  ## apply ruff fixes and formatting
	$(PY) -m ruff check --fix src tests benchmarks examples
	$(PY) -m ruff format src tests benchmarks examples

demo: $(STAMP)  ## run the regression and calibration examples (PNG + JSON under outputs/)
	MPLBACKEND=Agg $(PY) examples/regression_example.py
	MPLBACKEND=Agg $(PY) examples/calibration_example.py
	@echo "demo figures: outputs/regression_example/regression.png, outputs/calibration_example/reliability.png"

bench: $(STAMP)  ## time fit/predict and peak memory (benchmarks/run.py); BENCH_ARGS=--large adds ResNet-50 and a 1.1B Llama with LoRA
	$(PY) benchmarks/run.py $(BENCH_ARGS)

bench-gpu: $(STAMP)  ## on a CUDA GPU: the benchmark cases on cuda, fits against their floor (results/run-cuda.json)
	@$(NEED_CUDA)
	$(PY) benchmarks/run.py --device cuda

bench-scaling: $(STAMP)  ## fit/predict time and memory against N and width, growth exponents (slow)
	$(PY) benchmarks/scaling.py

fingerprint: $(STAMP)  ## float64 numbers of the benchmark scenarios, this checkout against BASE=<git rev> (default HEAD)
	rm -rf .fingerprint && mkdir -p .fingerprint/base
	git archive $(or $(BASE),HEAD) src | tar -x -C .fingerprint/base
	PYTHONPATH=.fingerprint/base/src $(PY) benchmarks/fingerprint.py .fingerprint/base.pt
	PYTHONPATH=src $(PY) benchmarks/fingerprint.py .fingerprint/this.pt
	$(PY) benchmarks/fingerprint.py --compare .fingerprint/base.pt .fingerprint/this.pt

docs: $(STAMP)  ## build the documentation site into site/ (mkdocs, warnings are errors)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

bench-compare: $(STAMP)  ## run the benchmark cases against laplace-torch 0.3 in a throwaway venv; print ratios
	REF_VENV=$${REF_VENV:-$${TMPDIR:-/tmp}/laplace-torch-0.3-venv} bash benchmarks/compare.sh

lock: $(STAMP)  ## regenerate requirements/lock.txt from the current venv
	@head -4 requirements/lock.txt > requirements/lock.new
	$(PIP) freeze --all --exclude-editable | grep -v "^pip==" | sed "s/+cpu//" >> requirements/lock.new
	mv requirements/lock.new requirements/lock.txt

clean:  ## remove the venv and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache build src/*.egg-info site outputs
