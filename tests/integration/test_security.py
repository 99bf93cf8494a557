"""Authentication (SGLang's API-key rules) and TLS / mutual TLS, against real servers.

Certificates are made at run time with the ``cryptography`` package (a CA, a server
certificate for 127.0.0.1/localhost, a client certificate, and a second, untrusted CA).
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sglang_admin.config import ServerArgs
from sglang_admin.pb import common_pb2 as pb
from sglang_admin.pb import common_pb2_grpc as pb_grpc
from sglang_admin.server.interceptors import ADMIN_METHODS, SERVICE, AuthInterceptor
from tests.conftest import ROOT, ServerProc, free_port, greedy, start_server, wait_serving

API_KEY = "api-" + secrets.token_hex(12)
ADMIN_KEY = "admin-" + secrets.token_hex(12)
WRONG_KEY = "wrong-" + secrets.token_hex(12)
UNAUTH = grpc.StatusCode.UNAUTHENTICATED


def bearer(key: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")] if key else []


# ---------------------------------------------------------------------- certificates


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: bytes
    client_key: bytes
    other_ca: bytes
    other_client_cert: bytes
    other_client_key: bytes

    @property
    def ca_pem(self) -> bytes:
        return self.ca.read_bytes()


def make_pki(out: Path) -> Pki:
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def key_pem(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def cert(subject: str, key, issuer: str, issuer_key, *, ca: bool, usage=None, san=None):
        b = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if usage is not None:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if san is not None:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    def new_key():
        return ec.generate_private_key(ec.SECP256R1())

    ca_key, other_key = new_key(), new_key()
    ca_pem = cert("test-ca", ca_key, "test-ca", ca_key, ca=True)
    other_ca_pem = cert("other-ca", other_key, "other-ca", other_key, ca=True)
    srv_key = new_key()
    srv_pem = cert(
        "localhost", srv_key, "test-ca", ca_key, ca=False,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    cli_key, other_cli_key = new_key(), new_key()
    cli_pem = cert("client", cli_key, "test-ca", ca_key, ca=False,
                   usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    other_cli_pem = cert("intruder", other_cli_key, "other-ca", other_key, ca=False,
                         usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    (out / "ca.pem").write_bytes(ca_pem)
    (out / "server.pem").write_bytes(srv_pem)
    (out / "server.key").write_bytes(key_pem(srv_key))
    (out / "server.key").chmod(0o600)
    return Pki(
        ca=out / "ca.pem",
        server_cert=out / "server.pem",
        server_key=out / "server.key",
        client_cert=cli_pem,
        client_key=key_pem(cli_key),
        other_ca=other_ca_pem,
        other_client_cert=other_cli_pem,
        other_client_key=key_pem(other_cli_key),
    )


# ---------------------------------------------------------------------- servers


@dataclass
class Servers:
    both: ServerProc  # --api-key and --admin-api-key
    tls: ServerProc  # TLS + --api-key (no admin key: the API key alone opens every RPC)
    mtls: ServerProc  # mutual TLS
    pki: Pki


def tls_creds(pki: Pki, *, client: bool = False, other_client: bool = False,
              roots: bytes | None = None) -> grpc.ChannelCredentials:
    kw = {}
    if client:
        kw = {"private_key": pki.client_key, "certificate_chain": pki.client_cert}
    if other_client:
        kw = {"private_key": pki.other_client_key, "certificate_chain": pki.other_client_cert}
    return grpc.ssl_channel_credentials(root_certificates=roots or pki.ca_pem, **kw)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("security")
    pki = make_pki(tmp)
    tls_files = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    started = [
        start_server(tmp, "--log-requests", "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY,
                     wait=False),
        start_server(tmp, *tls_files, "--api-key", API_KEY, wait=False),
        start_server(tmp, *tls_files, "--tls-client-ca", str(pki.ca), wait=False),
    ]
    makers = [
        None,
        lambda: grpc.secure_channel(started[1].target, tls_creds(pki)),
        lambda: grpc.secure_channel(started[2].target, tls_creds(pki, client=True)),
    ]
    try:
        for srv, make in zip(started, makers):
            if make is None:
                wait_serving(srv.target, srv.proc)
            else:
                wait_serving(srv.target, srv.proc, make=make)
    except Exception:  # noqa: BLE001 - show every server's log, then fail
        logs = "\n".join(s.log()[-2000:] for s in started)
        for s in started:
            s.stop()
        raise RuntimeError(f"servers failed to start:\n{logs}") from None
    yield Servers(*started, pki=pki)
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def both(servers: Servers) -> Iterator[pb_grpc.SglangSchedulerStub]:
    with servers.both.channel() as ch:
        yield pb_grpc.SglangSchedulerStub(ch)


def code_of(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def generate(stub: pb_grpc.SglangSchedulerStub, key: str | None, **kw) -> list[int]:
    tokens: list[int] = []
    for resp in stub.Generate(greedy([1, 2, 3], 3, stream=True, **kw), timeout=30,
                              metadata=bearer(key)):
        tokens.extend(resp.chunk.token_ids)
    return tokens


# ---------------------------------------------------------------------- the auth matrix

OK = grpc.StatusCode.OK
NORMAL = {
    "GetModelInfo": lambda s, md: s.GetModelInfo(pb.GetModelInfoRequest(), timeout=10,
                                                 metadata=md),
    "GetServerInfo": lambda s, md: s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10,
                                                   metadata=md),
    "GetLoads": lambda s, md: s.GetLoads(pb.GetLoadsRequest(), timeout=10, metadata=md),
    "Generate": lambda s, md: list(s.Generate(greedy([1, 2], 2), timeout=30, metadata=md)),
}
ADMIN = {
    "FlushCache": lambda s, md: s.FlushCache(pb.FlushCacheRequest(), timeout=30, metadata=md),
    "StartProfile": lambda s, md: s.StartProfile(
        pb.StartProfileRequest(num_steps=1, activities=["CPU"], with_stack=False,
                               record_shapes=False), timeout=60, metadata=md),
    "StopProfile": lambda s, md: s.StopProfile(pb.StopProfileRequest(), timeout=60, metadata=md),
    "DownloadProfile": lambda s, md: list(
        s.DownloadProfile(pb.DownloadProfileRequest(), timeout=30, metadata=md)
    ),
    # Weights from a trainer: authenticated, these bad requests are INVALID_ARGUMENT /
    # NOT_FOUND, never a join or a load.
    "InitWeightsUpdateGroup": lambda s, md: s.InitWeightsUpdateGroup(
        pb.InitWeightsUpdateGroupRequest(group_name="g"), timeout=30, metadata=md),
    "UpdateWeightsFromDistributed": lambda s, md: s.UpdateWeightsFromDistributed(
        pb.UpdateWeightsFromDistributedRequest(group_name="g"), timeout=30, metadata=md),
    "DestroyWeightsUpdateGroup": lambda s, md: s.DestroyWeightsUpdateGroup(
        pb.DestroyWeightsUpdateGroupRequest(group_name="g"), timeout=30, metadata=md),
    "UpdateWeightsFromTensor": lambda s, md: s.UpdateWeightsFromTensor(
        pb.UpdateWeightsFromTensorRequest(shm_name="g"), timeout=30, metadata=md),
}


@pytest.mark.parametrize("rpc", sorted(NORMAL))
@pytest.mark.parametrize(
    "key, expect_ok",
    [(None, False), (WRONG_KEY, False), (ADMIN_KEY, False), (API_KEY, True)],
    ids=["no-key", "wrong-key", "admin-key", "api-key"],
)
def test_normal_rpcs_need_the_api_key(both, rpc: str, key: str | None, expect_ok: bool) -> None:
    code = code_of(lambda: NORMAL[rpc](both, bearer(key)))
    assert (code == OK) if expect_ok else (code == UNAUTH), code


@pytest.mark.parametrize(
    "key, one_code, all_code",
    [(None, UNAUTH, UNAUTH), (WRONG_KEY, UNAUTH, UNAUTH), (API_KEY, OK, UNAUTH),
     (ADMIN_KEY, OK, OK)],
    ids=["no-key", "wrong-key", "api-key", "admin-key"],
)
def test_abort_takes_the_api_key_and_abort_all_the_admin_key(
    both, key: str | None, one_code: grpc.StatusCode, all_code: grpc.StatusCode
) -> None:
    """Abort of one request is a normal call (the router sends its API key); abort_all is
    an admin op, so with both keys set only the admin key opens it, and that key also
    opens the one-request form."""
    one = code_of(lambda: both.Abort(pb.AbortRequest(request_id="nope"), timeout=10,
                                     metadata=bearer(key)))
    every = code_of(lambda: both.Abort(pb.AbortRequest(abort_all=True), timeout=30,
                                       metadata=bearer(key)))
    assert (one, every) == (one_code, all_code)


@pytest.mark.parametrize("rpc", sorted(ADMIN))
@pytest.mark.parametrize(
    "key, expect_ok",
    [(None, False), (WRONG_KEY, False), (API_KEY, False), (ADMIN_KEY, True)],
    ids=["no-key", "wrong-key", "api-key", "admin-key"],
)
def test_admin_rpcs_need_the_admin_key(both, rpc: str, key: str | None, expect_ok: bool) -> None:
    code = code_of(lambda: ADMIN[rpc](both, bearer(key)))
    if expect_ok:
        # Authenticated: whatever the RPC answers (the profiler may be busy, have nothing to
        # download, or not be built yet), it is not an authentication failure.
        assert code != UNAUTH
    else:
        assert code == UNAUTH, code


def test_refusal_messages(both) -> None:
    cases = [
        (lambda: both.GetModelInfo(pb.GetModelInfoRequest(), timeout=10),
         "missing 'authorization: Bearer <API key>' metadata"),
        (lambda: both.GetModelInfo(pb.GetModelInfoRequest(), timeout=10,
                                   metadata=bearer(WRONG_KEY)), "invalid API key"),
        (lambda: both.FlushCache(pb.FlushCacheRequest(), timeout=10, metadata=bearer(API_KEY)),
         "invalid admin API key (this admin RPC accepts only the admin API key)"),
        (lambda: both.GetModelInfo(pb.GetModelInfoRequest(), timeout=10,
                                   metadata=[("authorization", f"Basic {API_KEY}")]),
         "invalid API key"),
        (lambda: both.GetModelInfo(pb.GetModelInfoRequest(), timeout=10,
                                   metadata=[("authorization", API_KEY)]), "invalid API key"),
    ]
    for fn, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            fn()
        assert err.value.code() == UNAUTH
        assert err.value.details() == message
        assert API_KEY not in err.value.details() and ADMIN_KEY not in err.value.details()


def test_bearer_scheme_is_case_insensitive(both) -> None:
    md = [("authorization", f"bearer {API_KEY}")]
    assert both.GetModelInfo(pb.GetModelInfoRequest(), timeout=10, metadata=md).vocab_size


def test_health_and_reflection_are_open(servers: Servers, both) -> None:
    assert both.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    with servers.both.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", SERVICE):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(iter(watch)).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
            ProtoReflectionDescriptorDatabase,
        )

        services = ProtoReflectionDescriptorDatabase(ch).get_services()
        assert SERVICE in services
        # An unknown method is not a way around the key.
        code = code_of(lambda: ch.unary_unary("/some.Other/Method")(b"", timeout=10))
        assert code == UNAUTH


def test_refused_calls_do_no_work(servers: Servers, both) -> None:
    rid = "unauthenticated-" + secrets.token_hex(4)
    for key in (None, WRONG_KEY, ADMIN_KEY):
        with pytest.raises(grpc.RpcError) as err:
            generate(both, key, request_id=rid)
        assert err.value.code() == UNAUTH
    # The server (started with --log-requests) logs every request the servicer sees.
    assert both.GetModelInfo(pb.GetModelInfoRequest(), timeout=10, metadata=bearer(API_KEY))
    assert rid not in servers.both.log()
    assert len(generate(both, API_KEY, request_id=rid + "-ok")) == 3
    assert rid + "-ok" in servers.both.log()


def test_keys_are_never_logged_nor_reported(servers: Servers, both) -> None:
    # After the whole matrix above (refusals included), with --log-requests on.
    info = both.GetServerInfo(pb.GetServerInfoRequest(), timeout=10, metadata=bearer(API_KEY))
    args = dict(info.server_args)
    assert args["api_key"] == "***" and args["admin_api_key"] == "***"
    for srv in (servers.both, servers.tls):
        log = srv.log()
        assert API_KEY not in log and ADMIN_KEY not in log and WRONG_KEY not in log
    assert API_KEY not in repr(ServerArgs(api_key=API_KEY, admin_api_key=ADMIN_KEY))


def test_api_key_alone_opens_the_admin_rpcs(servers: Servers) -> None:
    # the TLS worker has --api-key and no --admin-api-key (one worker fewer to start)
    with grpc.secure_channel(servers.tls.target, tls_creds(servers.pki)) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        for key in (None, WRONG_KEY, ADMIN_KEY):
            md = bearer(key)
            code = code_of(lambda md=md: stub.FlushCache(pb.FlushCacheRequest(), timeout=10,
                                                         metadata=md))
            assert code == UNAUTH
        resp = stub.FlushCache(pb.FlushCacheRequest(), timeout=30, metadata=bearer(API_KEY))
        assert resp.success
        code = code_of(lambda: stub.StopProfile(pb.StopProfileRequest(), timeout=30,
                                                metadata=bearer(API_KEY)))
        assert code != UNAUTH
        assert len(generate(stub, API_KEY)) == 3
        assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy


def test_admin_key_alone_guards_only_the_admin_rpcs() -> None:
    missing_admin = "missing 'authorization: Bearer <admin API key>' metadata"
    wrong_admin = "invalid admin API key (this admin RPC accepts only the admin API key)"
    auth = AuthInterceptor(api_key=None, admin_api_key=ADMIN_KEY)
    md = bearer(ADMIN_KEY)
    for method in (f"/{SERVICE}/Generate", f"/{SERVICE}/GetServerInfo", f"/{SERVICE}/Abort"):
        assert auth.check(method, ()) is None
    for method in ADMIN_METHODS:
        assert auth.check(method, ()) == missing_admin
        assert auth.check(method, bearer(API_KEY)) == wrong_admin
        assert auth.check(method, [("authorization", f"Basic {ADMIN_KEY}")]) == wrong_admin
        assert auth.check(method, md) is None
    both = AuthInterceptor(api_key=API_KEY, admin_api_key=ADMIN_KEY)
    assert both.check("/grpc.health.v1.Health/Check", ()) is None
    assert both.check("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", ()) is None
    assert both.check(f"/{SERVICE}/HealthCheck", ()) is None
    generate = f"/{SERVICE}/Generate"
    assert both.check(generate, ()) == "missing 'authorization: Bearer <API key>' metadata"
    for empty in ("Bearer ", "Bearer", "bearer  "):
        assert both.check(generate, [("authorization", empty)]) == "invalid API key", empty
    assert both.check(generate, bearer(ADMIN_KEY)) == "invalid API key"
    assert both.check(generate, bearer(API_KEY)) is None
    assert both.check(generate, [("authorization", f"bearer {API_KEY}")]) is None
    assert both.check(next(iter(ADMIN_METHODS)), bearer(API_KEY)) == wrong_admin


# ---------------------------------------------------------------------- TLS


def test_tls_round_trip_with_api_key(servers: Servers) -> None:
    with grpc.secure_channel(servers.tls.target, tls_creds(servers.pki)) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        # the same greedy tokens as the plaintext worker of the same model gives
        with servers.both.channel() as plain:
            want = generate(pb_grpc.SglangSchedulerStub(plain), API_KEY)
        assert len(want) == 3 and generate(stub, API_KEY) == want
        assert code_of(lambda: generate(stub, None)) == UNAUTH
    # By host name too (the certificate names localhost and 127.0.0.1).
    with grpc.secure_channel(f"localhost:{servers.tls.port}", tls_creds(servers.pki)) as ch:
        assert pb_grpc.SglangSchedulerStub(ch).HealthCheck(
            pb.HealthCheckRequest(), timeout=10
        ).healthy


def test_tls_server_refuses_plaintext_and_untrusted_roots(servers: Servers) -> None:
    with servers.tls.channel() as ch:  # plaintext
        code = code_of(lambda: generate(pb_grpc.SglangSchedulerStub(ch), API_KEY))
        assert code == grpc.StatusCode.UNAVAILABLE
    creds = tls_creds(servers.pki, roots=servers.pki.other_ca)
    with grpc.secure_channel(servers.tls.target, creds) as ch:
        code = code_of(lambda: generate(pb_grpc.SglangSchedulerStub(ch), API_KEY))
        assert code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_round_trip(servers: Servers) -> None:
    with grpc.secure_channel(servers.mtls.target, tls_creds(servers.pki, client=True)) as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)
        assert len(generate(stub, None)) == 3
        assert stub.FlushCache(pb.FlushCacheRequest(), timeout=30).success


@pytest.mark.parametrize("client", ["no-certificate", "untrusted-certificate", "plaintext"])
def test_mutual_tls_refuses_clients_without_a_trusted_certificate(
    servers: Servers, client: str
) -> None:
    if client == "plaintext":
        ch = servers.mtls.channel()
    else:
        creds = tls_creds(servers.pki, other_client=client == "untrusted-certificate")
        ch = grpc.secure_channel(servers.mtls.target, creds)
    with ch:
        code = code_of(lambda: generate(pb_grpc.SglangSchedulerStub(ch), None))
        assert code == grpc.StatusCode.UNAVAILABLE
    # The server is unharmed.
    good = tls_creds(servers.pki, client=True)
    with grpc.secure_channel(servers.mtls.target, good) as ch:
        assert pb_grpc.SglangSchedulerStub(ch).HealthCheck(
            pb.HealthCheckRequest(), timeout=10
        ).healthy


def https(url: str, ctx: ssl.SSLContext, method: str = "GET",
          key: str | None = None) -> int:
    """The status of one HTTPS request to a sidecar."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_http_sidecar_serves_the_grpc_ports_tls(servers: Servers, tmp_path: Path) -> None:
    """The sidecar serves HTTPS with the gRPC port's certificate, its keys, and with
    --tls-client-ca only to clients with a trusted certificate."""
    ctx = ssl.create_default_context(cafile=str(servers.pki.ca))
    tls = f"https://127.0.0.1:{servers.tls.sidecar_port}"
    assert https(f"{tls}/health", ctx) == 200
    assert https(f"{tls}/flush_cache", ctx, "POST") == 401
    assert https(f"{tls}/flush_cache", ctx, "POST", API_KEY) == 200  # the API key alone
    with pytest.raises(OSError):  # plaintext HTTP to the TLS port: the connection is closed
        urllib.request.urlopen(f"http://127.0.0.1:{servers.tls.sidecar_port}/health", timeout=10)
    untrusted = ssl.create_default_context()  # the system's roots: not the test CA
    with pytest.raises(OSError):
        https(f"{tls}/health", untrusted)
    mtls = f"https://127.0.0.1:{servers.mtls.sidecar_port}"
    with pytest.raises(OSError):  # no client certificate: the handshake fails
        https(f"{mtls}/health", ctx)
    (tmp_path / "client.pem").write_bytes(servers.pki.client_cert)
    (tmp_path / "client.key").write_bytes(servers.pki.client_key)
    ctx.load_cert_chain(tmp_path / "client.pem", tmp_path / "client.key")
    assert https(f"{mtls}/health", ctx) == 200
    assert https(f"{mtls}/flush_cache", ctx) == 200


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tls-cert", "CERT"], "--tls-cert and --tls-key must be given together"),
        (["--tls-client-ca", "CERT"], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"],
         "cannot read /nonexistent/"),
        (["--tls-cert", "CERT", "--tls-key", "NOTPEM"], "--tls-key"),
        (["--tls-cert", "CERT", "--tls-key", "CERT"], "are not a certificate chain and its key"),
    ],
    ids=["cert-without-key", "client-ca-without-tls", "unreadable-files", "key-not-pem",
         "key-mismatch"],
)
def test_tls_misconfiguration_fails_fast(
    servers: Servers, tmp_path: Path, args: list[str], message: str
) -> None:
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("garbage\n")
    files = {"CERT": str(servers.pki.server_cert), "NOTPEM": str(not_pem)}
    args = [files.get(a, a) for a in args]
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_admin", "serve", "--port", str(free_port()), *args],
        capture_output=True, text=True, check=False, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 2
    assert message in proc.stdout + proc.stderr
