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

# The suite in one process (TEST_WORKERS=0, CI's default), or on TEST_WORKERS xdist workers, each taking the next test
# file as it finishes one, the slowest first (tests/conftest.py): 24.6 min instead of ~30 for .ci/run on 2 cores, but
# 2 of 3 fresh-clone runs on two workers had failures that one process has not shown (docs/results/ci-time.md).
TEST_WORKERS ?= 0
test: setup
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)
