# Every target creates or reuses .venv in the repo root and installs the project with its extras.
# torch is pinned to the CPU build that lies on this machine's disk: an unpinned torch would pull CUDA.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
TORCH  := torch==2.13.0

PEERS  := bench/.peers-venv
# ruff (lint and format) runs over these in `make test`, next to mypy
LINTED := src tests bench examples scripts

.PHONY: test demo bench bench-peers gpu-check clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" -e ".[test,cli]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider

demo: $(STAMP)
	$(PY) examples/demo.py

# Every benchmark with torch's default threads (nothing sets OMP_NUM_THREADS): on the machine as it is,
# then with --busy next to one other busy process (bench/busy.py; results in bench/results/*_busy.*).
# bench_threads and bench_startup measure both themselves. bench_replicas exits 1 when its targets
# are missed ("-": the rest still run).
bench: $(STAMP)
	$(PY) -m pip install -q "$(TORCH)" -e ".[bench]"
	$(PY) bench/bench_export.py
	$(PY) bench/bench_export.py --busy
	$(PY) bench/bench_threads.py
	$(PY) bench/bench_stream.py
	$(PY) bench/bench_stream.py --busy
	$(PY) bench/bench_targets.py
	$(PY) bench/bench_targets.py --busy
	-$(PY) bench/bench_replicas.py
	-$(PY) bench/bench_replicas.py --busy
	$(PY) bench/bench_reshard.py
	$(PY) bench/bench_reshard.py --busy
	$(PY) bench/bench_plan.py
	$(PY) bench/bench_plan.py --busy
	$(PY) bench/bench_sources.py
	$(PY) bench/bench_sources.py --busy
	$(PY) bench/bench_convert.py
	$(PY) bench/bench_convert.py --busy
	$(PY) bench/bench_digest.py
	$(PY) bench/bench_digest.py --busy
	$(PY) bench/bench_scaling.py
	$(PY) bench/bench_scaling.py --busy
	$(PY) bench/bench_cma.py
	$(PY) bench/bench_cma.py --busy
	$(PY) bench/bench_startup.py
	$(PY) bench/plots.py

# The peers run in their own venv (Paddle is never a dependency of shardsync).
$(PEERS)/.installed-stamp:
	test -x $(PEERS)/bin/python || python3 -m venv $(PEERS)
	$(PEERS)/bin/pip install -q paddlepaddle==3.3.1
	touch $@

bench-peers: $(STAMP) $(PEERS)/.installed-stamp
	$(PY) -m pip install -q "$(TORCH)" -e ".[bench]"
	$(PY) bench/bench_peers.py
	$(PY) bench/bench_peers.py --busy
	$(PY) bench/plots.py

# NCCL paths on the GPUs of this machine; prints "no CUDA: skipped" and exits 0 without CUDA.
gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py

clean:
	rm -rf $(VENV) $(PEERS) build src/*.egg-info
