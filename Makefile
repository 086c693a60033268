# Every target creates or reuses .venv in the repo root and installs the project with its extras.
# torch is pinned to the CPU build that lies on this machine's disk: an unpinned torch would pull CUDA.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
TORCH  := torch==2.13.0

.PHONY: test demo bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" -e ".[test,cli]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) bench/bench_export.py
	$(PY) bench/bench_stream.py
	$(PY) bench/bench_replicas.py
	$(PY) bench/bench_plan.py
	$(PY) bench/bench_sources.py
	$(PY) bench/bench_convert.py

clean:
	rm -rf $(VENV) build src/*.egg-info
