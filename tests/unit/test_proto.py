"""The proto: stubs are fresh, and the service is wire-compatible with smg-grpc-proto."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from sglang_admin.pb import common_pb2

ROOT = Path(__file__).resolve().parents[2]

# Runs in a child process: smg-grpc-proto defines the same package, so its descriptors
# cannot share one descriptor pool with ours.
_DUMP_SMG = r"""
import json
from google.protobuf.descriptor import FieldDescriptor
from smg_grpc_proto import sglang_scheduler_pb2 as m

def fields(desc, out):
    if desc.full_name in out:
        return
    out[desc.full_name] = {}
    for f in desc.fields:
        out[desc.full_name][f.name] = [f.number, f.type, f.is_repeated,
            f.message_type.full_name if f.message_type else None]
        if f.message_type:
            fields(f.message_type, out)

svc = m.DESCRIPTOR.services_by_name["SglangScheduler"]
methods, messages = {}, {}
for meth in svc.methods:
    methods[meth.name] = [meth.input_type.full_name, meth.output_type.full_name,
                          meth.server_streaming, meth.client_streaming]
    fields(meth.input_type, messages)
    fields(meth.output_type, messages)
print(json.dumps({"service": svc.full_name, "methods": methods, "messages": messages}))
"""


def _smg_service() -> dict:
    pytest.importorskip("smg_grpc_proto")
    out = subprocess.run(
        [sys.executable, "-c", _DUMP_SMG], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def _ours(desc: Descriptor) -> dict[str, list]:
    return {
        f.name: [f.number, f.type, f.is_repeated, f.message_type.full_name if f.message_type else None]
        for f in desc.fields
    }


def _short(name: str | None) -> str | None:
    return name.rsplit(".", 1)[-1] if name else None


def test_service_is_wire_compatible_with_smg_grpc_proto() -> None:
    smg = _smg_service()
    ours = common_pb2.DESCRIPTOR.services_by_name["SglangScheduler"]
    assert ours.full_name == smg["service"] == "sglang.grpc.scheduler.SglangScheduler"
    by_name = {m.name: m for m in ours.methods}
    for name, (inp, outp, server_streaming, client_streaming) in smg["methods"].items():
        assert name in by_name, f"method {name} missing"
        meth = by_name[name]
        assert meth.server_streaming == server_streaming, name
        assert meth.client_streaming == client_streaming, name
        assert _short(meth.input_type.full_name) == _short(inp), name
        assert _short(meth.output_type.full_name) == _short(outp), name

    # Every field both sides define has the same number, type and label, recursively.
    ours_by_short: dict[str, Descriptor] = {}

    def collect(desc: Descriptor) -> None:
        if desc.name in ours_by_short:
            return
        ours_by_short[desc.name] = desc
        for f in desc.fields:
            if f.message_type is not None:
                collect(f.message_type)

    for meth in ours.methods:
        collect(meth.input_type)
        collect(meth.output_type)
    checked = 0
    for full_name, smg_fields in smg["messages"].items():
        short = _short(full_name)
        if short not in ours_by_short:
            continue
        mine = _ours(ours_by_short[short])
        for fname, (number, ftype, repeated, msg_type) in smg_fields.items():
            if fname not in mine:
                # A field we do not define must not collide with one of ours.
                assert number not in {v[0] for v in mine.values()}, f"{short}.{fname}"
                continue
            m_number, m_type, m_repeated, m_msg = mine[fname]
            assert (m_number, m_type, m_repeated) == (number, ftype, repeated), f"{short}.{fname}"
            assert _short(m_msg) == _short(msg_type), f"{short}.{fname}"
            checked += 1
    assert checked > 200


def test_extensions_use_numbers_from_100() -> None:
    smg = _smg_service()
    known = {_short(k): v for k, v in smg["messages"].items()}
    for desc in common_pb2.DESCRIPTOR.message_types_by_name.values():
        if desc.name not in known:
            continue
        theirs = set(known[desc.name])
        for f in desc.fields:
            if f.name not in theirs:
                assert f.number >= 100, f"{desc.name}.{f.name} extension numbered {f.number}"


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    """`make proto` output equals the committed stubs."""
    grpc_tools = pytest.importorskip("grpc_tools")
    src = tmp_path / "sglang_admin"
    src.mkdir()
    shutil.copy(ROOT / "protos" / "common.proto", src / "common.proto")
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    rc = protoc.main(
        [
            "protoc",
            f"-I{tmp_path}",
            f"-I{include}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(src / "common.proto"),
        ]
    )
    assert rc == 0
    grpc_file = (src / "common_pb2_grpc.py").read_text().replace(
        "from sglang_admin import common_pb2 as", "from sglang_admin.pb import common_pb2 as"
    )
    pb_dir = ROOT / "sglang_admin" / "pb"
    assert (src / "common_pb2.py").read_text() == (pb_dir / "common_pb2.py").read_text(), (
        "sglang_admin/pb/common_pb2.py is stale: run `make proto`"
    )
    assert (src / "common_pb2.pyi").read_text() == (pb_dir / "common_pb2.pyi").read_text()
    assert grpc_file == (pb_dir / "common_pb2_grpc.py").read_text()


def test_field_type_constants_are_stable() -> None:
    # Guard against protobuf renumbering its enum (the comparison above relies on it).
    assert FieldDescriptor.TYPE_STRING == 9


def test_our_stubs_and_smg_grpc_proto_do_not_load_in_one_process() -> None:
    """What the README and the Makefile say: both define package sglang.grpc.scheduler, so
    the second import in one process fails (hence the child process above)."""
    pytest.importorskip("smg_grpc_proto")
    code = (
        "from sglang_admin.pb import common_pb2\n"
        "try:\n"
        "    from smg_grpc_proto import sglang_scheduler_pb2\n"
        "except TypeError as e:\n"
        "    print('refused:', 'duplicate symbol' in str(e))\n"
        "else:\n"
        "    print('loaded')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "refused: True", out.stdout[-500:]
