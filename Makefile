# One-command set-up: `make serve` and `make test` install what they need first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install serve test proto lint bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv --system-site-packages $(VENV)

# torch 2.13.0 first (the CPU build on this disk); a torch that is already importable stands.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(PY) -m sglang_admin serve $(ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

proto: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=sglang_admin/pb --pyi_out=sglang_admin/pb \
	  --grpc_python_out=sglang_admin/pb protos/common.proto
	sed -i 's/^import common_pb2 as common__pb2/from sglang_admin.pb import common_pb2 as common__pb2/' \
	  sglang_admin/pb/common_pb2_grpc.py

lint: install
	$(PY) -m pip install -q ruff
	$(PY) -m ruff check sglang_admin tests tools

bench: install
	$(PY) tools/bench_admin.py

clean:
	rm -rf $(VENV) build *.egg-info
