"""NATS authentication and TLS, passed through to a real nats-server that requires them: a
token or user and password in the URL, a credentials file (an operator-mode server trusting
JWTs minted here with nkeys), TLS with our CA, mutual TLS with a client certificate. A client
without the right secret never gets in; one with a bad setting stops in one line.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import ipaddress
import json
import os
import subprocess
import time
from pathlib import Path

import nkeys
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from omni_cli.natsd import EmbeddedNats
from omni_pipeline.connection import connect_nats
from omni_pipeline.control import ControlError
from tests.helpers import HTTP, OMNI, ROOT, start_gateway, start_stage, wait_for

PIPELINE = ROOT / "tests" / "data" / "echo.yaml"


def _issue(
    name: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None, ca: bool = False
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer or (subject, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        builder = builder.add_extension(san, critical=False)
    return key, builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, ca = _issue("omni test CA", None, ca=True)
    files: dict[str, Path] = {}
    for name, (key, cert) in {
        "ca": (ca_key, ca),
        "server": _issue("nats", (ca.subject, ca_key)),
        "client": _issue("omni", (ca.subject, ca_key)),
    }.items():
        files[f"{name}.crt"] = d / f"{name}.crt"
        files[f"{name}.crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[f"{name}.key"] = d / f"{name}.key"
        files[f"{name}.key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return files


def _jwt(issuer: nkeys.KeyPair, subject: nkeys.KeyPair, name: str, nats: dict[str, object]) -> str:
    """A NATS JWT (ed25519-nkey) that `issuer` signs for `subject`."""

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    claims = {"iat": int(time.time()), "iss": issuer.public_key.decode(), "name": name}
    claims |= {"sub": subject.public_key.decode(), "nats": nats}
    claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims).encode()).digest()).decode()
    header = {"typ": "JWT", "alg": "ed25519-nkey"}
    signed = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
    return f"{signed}.{b64(issuer.sign(signed.encode()))}"


def _keypair(prefix: int) -> tuple[nkeys.KeyPair, bytes]:
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    return nkeys.from_seed(seed), seed


def _operator_mode(d: Path) -> tuple[tuple[str, ...], Path, Path]:
    """nats-server args trusting one operator and its account; a user's creds file signed by that
    account, and one signed by an account the server does not know."""
    op, _ = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    (d / "operator.jwt").write_text(_jwt(op, op, "operator", {"type": "operator", "version": 2}))
    unlimited = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "conn": -1, "leaf": -1}
    creds = []
    for name in ("trusted", "stranger"):
        account, _ = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
        account_jwt = _jwt(op, account, name, {"type": "account", "version": 2, "limits": unlimited})
        user, seed = _keypair(nkeys.PREFIX_BYTE_USER)
        user_jwt = _jwt(
            account, user, "omni", {"type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1}
        )
        (path := d / f"{name}.creds").write_text(
            f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n"
        )
        creds.append(path)
        if name == "trusted":
            trusted_account = f"{account.public_key.decode()}: {json.dumps(account_jwt)}"
    (d / "server.conf").write_text(
        f"operator: {json.dumps(str(d / 'operator.jwt'))}\nresolver: MEMORY\n"
        f"resolver_preload: {{ {trusted_account} }}\n"
    )
    return ("-c", str(d / "server.conf")), creds[0], creds[1]


def _server(
    mode: str, pki: dict[str, Path], more: tuple[str, ...] = ()
) -> tuple[EmbeddedNats, str, dict[str, str]]:
    """A nats-server requiring `mode`; the URL and environment a client that may enter uses."""
    tls = ("--tls", "--tlscert", str(pki["server.crt"]), "--tlskey", str(pki["server.key"]))
    ca_env = {"OMNI_NATS_TLS_CA": str(pki["ca.crt"])}
    if mode == "token":
        s = EmbeddedNats(args=("--auth", "s3cret-token"))
        return s, s.url.replace("nats://", "nats://s3cret-token@"), {}
    if mode == "user-password":
        s = EmbeddedNats(args=("--user", "omni", "--pass", "pa55word"))
        return s, s.url.replace("nats://", "nats://omni:pa55word@"), {}
    if mode == "creds":
        args, trusted, _ = _operator_mode(pki["ca.crt"].parent)
        s = EmbeddedNats(args=args)
        return s, s.url, {"OMNI_NATS_CREDS": str(trusted)}
    if mode == "tls":
        s = EmbeddedNats(args=tls)
        return s, s.url.replace("nats://", "tls://"), ca_env
    assert mode == "mutual-tls"
    s = EmbeddedNats(args=(*tls, "--tlsverify", "--tlscacert", str(pki["ca.crt"]), *more))
    client = {"OMNI_NATS_TLS_CERT": str(pki["client.crt"]), "OMNI_NATS_TLS_KEY": str(pki["client.key"])}
    return s, s.url.replace("nats://", "tls://"), {**ca_env, **client}


async def _round_trip(url: str, retry_for_s: float = 10) -> bytes:
    nc = await connect_nats(url, "security-test", retry_for_s=retry_for_s)
    assert nc is not None
    try:
        sub = await nc.subscribe("omni.security.echo")
        await nc.publish("omni.security.echo", b"through")
        return (await sub.next_msg(timeout=5)).data
    finally:
        await nc.close()


MODES = ["token", "user-password", "creds", "tls", "mutual-tls"]


@pytest.mark.parametrize("mode", MODES)
def test_the_right_secret_gets_in_and_no_other(
    mode: str, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, url, env = _server(mode, pki)
    try:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert asyncio.run(_round_trip(url)) == b"through"
        # Without the secret: a wrong token or password, no CA, no client certificate.
        wrong_url = url.replace("s3cret-token", "guess").replace("pa55word", "guess")
        wrong_env = {k: v for k, v in env.items() if k == "OMNI_NATS_TLS_CA" and mode == "mutual-tls"}
        if mode == "creds":  # a well-formed credentials file of an account this server does not trust
            wrong_env = {"OMNI_NATS_CREDS": env["OMNI_NATS_CREDS"].replace("trusted", "stranger")}
        for k in env:
            monkeypatch.delenv(k)
        for k, v in wrong_env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(ControlError, match="unreachable"):
            asyncio.run(_round_trip(wrong_url, retry_for_s=3))
    finally:
        server.stop()


def test_a_pipeline_serves_over_mutual_tls_with_a_password(pki: dict[str, Path], tmp_path: Path) -> None:
    server, url, env = _server("mutual-tls", pki, ("--user", "u", "--pass", "p"))
    url = url.replace("tls://", "tls://u:p@")
    stage = start_stage(PIPELINE, "echo", "0", url, ROOT, tmp_path, env)
    gw, base = start_gateway(PIPELINE, url, ROOT, tmp_path, env=env)
    try:
        wait_for(lambda: HTTP.get(f"{base}/health").status_code == 200, 60, "the stage registered")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        r = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content == "tok0 tok1 tok2 "
    finally:
        for p in (gw, stage):
            assert p.stop() == 0, p.output()[-2000:]
        server.stop()


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {"OMNI_NATS_TLS_CA": "/nonexistent/ca.crt"},
            "OMNI_NATS_TLS_CA=/nonexistent/ca.crt: no such readable file",
        ),
        ({"OMNI_NATS_CREDS": "/nonexistent/user.creds"}, "OMNI_NATS_CREDS=/nonexistent/user.creds: no such"),
        ({"OMNI_NATS_TLS_CA": str(PIPELINE)}, "NATS TLS files"),
    ],
    ids=["missing-ca", "missing-creds", "not-a-certificate"],
)
def test_bad_security_settings_stop_a_stage_in_one_line(env: dict[str, str], says: str) -> None:
    args = ["stage", "--pipeline", str(PIPELINE), "--stage", "echo", "--nats", "nats://127.0.0.1:1"]
    out = subprocess.run(
        [*OMNI, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, **env},
    )
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and says in out.stderr, out.stderr
