"""The blocking Client, derived from AsyncClient, against a small in-process gRPC server.

The server here is a test double of the worker (the real one is exercised by
tests/integration/test_client_cli.py); it answers a few RPCs with known values, checks the
``authorization`` header, can hold a call open until the client gives up, and records
when a stream it serves ends.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from sglang_admin.client import AsyncClient, Client, ClientClosedError
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from tests.integration.test_security import make_pki

KEY = "unit-key"
HANG = "hang"  # Generate request ids starting with this are never answered
ENDLESS = "endless"  # a Generate request id whose stream never completes by itself


class Worker(pb_grpc.SglangSchedulerServicer):
    """Answers HealthCheck, FlushCache and Generate; everything else is UNIMPLEMENTED."""

    def __init__(self) -> None:
        self.stream_ended = threading.Event()
        self.release = threading.Event()  # set at teardown: held calls return
        self.held: dict[str, threading.Event] = {}  # request id -> set once it is held

    def _check_key(self, context: grpc.ServicerContext) -> None:
        if dict(context.invocation_metadata()).get("authorization") != f"Bearer {KEY}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")

    def HealthCheck(self, request: pb.HealthCheckRequest, context: grpc.ServicerContext) -> pb.HealthCheckResponse:
        self._check_key(context)
        return pb.HealthCheckResponse(healthy=True, message="ok")

    def FlushCache(self, request: pb.FlushCacheRequest, context: grpc.ServicerContext) -> pb.FlushCacheResponse:
        self._check_key(context)
        return pb.FlushCacheResponse(success=True, message=f"waited up to {request.timeout_s}")

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        self._check_key(context)
        ids = list(request.tokenized.input_ids)
        if not ids:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "input_ids is empty")
        if request.request_id.startswith(HANG):
            if request.request_id in self.held:
                self.held[request.request_id].set()
            while context.is_active() and not self.release.wait(0.05):
                pass
            return
        if request.request_id == ENDLESS:
            try:
                while context.is_active() and not self.release.is_set():
                    yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[1]))
                    self.release.wait(0.01)
            finally:
                self.stream_ended.set()
            return
        out = [ids[-1] + i + 1 for i in range(request.sampling_params.max_new_tokens)]
        if request.stream:
            for token in out:
                yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[token]))
        yield pb.GenerateResponse(complete=pb.GenerateComplete(
            output_ids=out, finish_reason="length", prompt_tokens=len(ids)))


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[str, Worker]]:
    servicer = Worker()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        servicer.release.set()
        server.stop(grace=None)


def client_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sglang-admin-client ")]


def test_every_async_method_has_a_blocking_twin() -> None:
    members = {name: getattr(AsyncClient, name) for name in dir(AsyncClient)}
    assert "update_weights_from_distributed" in members  # a base's method is mirrored too
    for name, member in members.items():
        if name.startswith("_") or not (
            inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member)
        ):
            continue
        twin = getattr(Client, name)
        assert not inspect.iscoroutinefunction(twin), name
        if name in vars(Client):  # written by hand (close): only its parameters must match
            assert inspect.signature(twin).parameters == inspect.signature(member).parameters
            continue
        assert twin.__doc__ == member.__doc__, name
        ours, theirs = inspect.signature(twin), inspect.signature(member)
        assert list(ours.parameters.values()) == list(theirs.parameters.values()), name
    assert inspect.signature(Client.generate).return_annotation == "Iterator[pb.GenerateResponse]"
    assert inspect.signature(Client.health).return_annotation == "pb.HealthCheckResponse"


def test_outside_a_loop(worker: tuple[str, Worker]) -> None:
    target, _ = worker
    with Client(target, api_key=KEY, timeout=30) as client:
        assert client.target == target and client.timeout == 30
        assert client.health().message == "ok"
        assert client.flush_cache(2.5).message == "waited up to 2.5"
        responses = list(client.generate([7, 8], 3, stream=True))
        assert [r.chunk.token_ids[0] for r in responses[:-1]] == [9, 10, 11]
        assert responses[-1].complete.finish_reason == "length"
        result = client.generate_tokens([7, 8], 3)
        assert result.tokens == [9, 10, 11] and result.complete.prompt_tokens == 2
        assert client.generate_tokens([7, 8], 3, stream=True).tokens == result.tokens


def test_inside_a_running_loop(worker: tuple[str, Worker]) -> None:
    target, _ = worker

    async def main() -> tuple[bool, list[int], list[int]]:
        async with AsyncClient(target, api_key=KEY, timeout=30) as aclient:
            with Client(target, api_key=KEY, timeout=30) as client:
                healthy = client.health().healthy
                blocking = client.generate_tokens([1], 2).tokens
                awaited = (await aclient.generate_tokens([1], 2)).tokens
        return healthy, blocking, awaited

    assert asyncio.run(main()) == (True, [2, 3], [2, 3])


def test_errors_keep_their_grpc_status(worker: tuple[str, Worker]) -> None:
    target, _ = worker
    with Client(target, timeout=30) as anonymous:
        with pytest.raises(grpc.RpcError) as err:
            anonymous.health()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.value.details() == "missing or wrong API key"
    with Client(target, api_key=KEY, timeout=30) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate([]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "input_ids is empty" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.call(lambda c: c.stub.Embed(pb.EmbedRequest(), metadata=c.metadata))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert client.health().healthy  # still usable after failures


def test_deadline_propagates(worker: tuple[str, Worker]) -> None:
    target, _ = worker
    with Client(target, api_key=KEY, timeout=0.3) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate_tokens([1], 1, request_id=HANG)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert client.health().healthy


def test_leaving_a_stream_early_cancels_it(worker: tuple[str, Worker]) -> None:
    target, servicer = worker
    servicer.stream_ended.clear()
    with Client(target, api_key=KEY, timeout=30) as client:
        stream = client.generate([1], request_id=ENDLESS, stream=True)
        assert [next(stream).chunk.token_ids[0] for _ in range(3)] == [1, 1, 1]
        stream.close()
        assert servicer.stream_ended.wait(10)
        assert client.health().healthy


def test_close_stops_the_loop_and_refuses_later_calls(worker: tuple[str, Worker]) -> None:
    target, _ = worker
    before = len(client_threads())
    client = Client(target, api_key=KEY, timeout=30)
    assert len(client_threads()) == before + 1
    stream = client.generate([1], request_id=ENDLESS, stream=True)
    next(stream)
    client.close()
    assert client.closed and len(client_threads()) == before
    client.close()  # a second close does nothing
    with pytest.raises(ClientClosedError):
        client.health()
    with pytest.raises(ClientClosedError):
        next(stream)


def test_a_client_never_closed_stops_its_thread_when_collected(worker: tuple[str, Worker]) -> None:
    target, _ = worker
    before = len(client_threads())
    client = Client(target, api_key=KEY, timeout=30)
    assert client.health().healthy
    assert len(client_threads()) == before + 1
    del client
    gc.collect()
    assert len(client_threads()) == before


def test_close_cancels_a_call_in_flight(worker: tuple[str, Worker]) -> None:
    target, servicer = worker
    client = Client(target, api_key=KEY)  # no deadline: only close() ends the call
    outcome: list[BaseException] = []
    servicer.held["hang-until-close"] = threading.Event()

    def held() -> None:
        try:
            client.generate_tokens([1], 1, request_id="hang-until-close")
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    thread = threading.Thread(target=held)
    thread.start()
    assert servicer.held["hang-until-close"].wait(10)
    client.close()
    thread.join(10)
    assert not thread.is_alive()
    assert len(outcome) == 1
    exc = outcome[0]
    assert isinstance(exc, futures.CancelledError) or (
        isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.CANCELLED
    ), repr(exc)


def test_bad_tls_arguments_fail_without_leaking_a_thread(worker: tuple[str, Worker]) -> None:
    target, _ = worker
    before = len(client_threads())
    with pytest.raises(ValueError, match="tls_cert and tls_key must be given together"):
        Client(target, tls_cert="cert.pem")
    assert len(client_threads()) == before


def test_mutual_tls(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    (tmp_path / "client.pem").write_bytes(pki.client_cert)
    (tmp_path / "client.key").write_bytes(pki.client_key)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_SglangSchedulerServicer_to_server(Worker(), server)
    creds = grpc.ssl_server_credentials(
        [(pki.server_key.read_bytes(), pki.server_cert.read_bytes())],
        root_certificates=pki.ca_pem, require_client_auth=True,
    )
    target = f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', creds)}"
    server.start()
    try:
        with Client(target, api_key=KEY, timeout=30, tls_ca=str(pki.ca),
                    tls_cert=str(tmp_path / "client.pem"),
                    tls_key=str(tmp_path / "client.key")) as client:
            assert client.health().healthy
        with Client(target, api_key=KEY, timeout=30, tls_ca=str(pki.ca)) as no_cert:
            with pytest.raises(grpc.RpcError) as err:
                no_cert.health()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(grace=None)
