# Quick start: `make demo` (serve the model repository and answer an image question), `make test`.
PY := .venv/bin/python
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
OPENAI ?= 1
export HTTP_PORT GRPC_PORT METRICS_PORT OPENAI_PORT

.PHONY: setup serve demo test

setup:
	@bash scripts/setup.sh

# tritonserver in the foreground on 127.0.0.1 with the environment the Python backend needs, and the OpenAI-compatible
# endpoint on $(OPENAI_PORT) beside it (`make serve OPENAI=0` leaves it out).
serve: setup
	$(PY) -m backend.deploy.local_server --model-repository model_repository --openai-port $(if $(filter 0,$(OPENAI)),0,$(OPENAI_PORT))

demo: setup
	$(PY) -m clients.demo

# The suite on TEST_WORKERS xdist workers (2, CI's default; 0: one process), each taking the next test file as it
# finishes one (run_order: a solo module first, unit files beside it, the slowest next); fault and overload modules
# beside unit-test modules only, memory-heavy ones one at a time (tests/conftest.py).
# Fresh-clone .ci/runs on 2 cores: 20.9-24.3 min on two workers (EngineCores forked, no auto-complete stubs), 31.2-33.5 with
# EngineCores spawned, 38.9 in one process
# (docs/results/ci-time.md).
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)
