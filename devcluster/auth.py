"""Who a request to the local API server comes from: the server's credentials (its CA and serving certificate, the
admin's token, the key that signs ServiceAccount tokens), the `Authorization` header as Kubernetes' bearer token
authenticator reads it, and ServiceAccount tokens as the TokenRequest API issues them. Pure, apart from drawing
random keys; apiserver.py looks the token's ServiceAccount (and the object it is bound to) up in its store.

- Credentials: generated per server (`Credentials.generate`): a CA (ECDSA P-256) and a serving certificate it
  signed for 127.0.0.1, ::1, localhost and the `kubernetes.default.svc` names (what an in-cluster client dials),
  a random admin token and a random signing key. A restarted server is given the same credentials (as a real one
  keeps its PKI on disk), so that kubeconfigs and the tokens the pods hold stay valid.
- The header: `Bearer <token>`, the scheme in any case, as Kubernetes reads it (the second space-separated field is
  the token). A token that is not the admin's nor a valid ServiceAccount token, or another scheme (`Basic ...`), is
  refused: `UNAUTHORIZED`.
- ServiceAccount tokens are JWTs (HS256 here, RS256 on a real cluster) with Kubernetes' claims: `iss`, `sub`
  (`system:serviceaccount:NS:NAME`), `aud`, `exp`, `iat`, `nbf`, `jti` and `kubernetes.io` (namespace, the
  ServiceAccount's name and uid, and the Pod or Secret the token is bound to). The server accepts one whose
  signature is its own, whose `exp` has not passed and whose audiences include the API's (`API_AUDIENCES`), while
  its ServiceAccount, and the object it is bound to, exist with the uids it names: a token outlives neither.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import ssl
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: the issuer and default audience of ServiceAccount tokens, as a cluster's `--service-account-issuer` sets them
ISSUER = "https://kubernetes.default.svc.cluster.local"
API_AUDIENCES = (ISSUER,)
#: the names an in-cluster client may dial the API server by (the `kubernetes` Service in `default`)
SERVICE_NAMES = ("kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local")
CERT_VALIDITY = datetime.timedelta(days=365)
#: the body of every 401, as the API server writes it
UNAUTHORIZED: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                "message": "Unauthorized", "reason": "Unauthorized", "code": 401}


@dataclass(frozen=True)
class User:
    """An authenticated user as the authorizer sees it (Kubernetes' user.Info)."""

    name: str
    groups: tuple[str, ...] = ()
    uid: str = ""


#: who the admin token (and a request without credentials on the plain-HTTP port) is
ADMIN = User("kubernetes-admin", ("system:masters", "system:authenticated"))
#: who a request without credentials on the TLS port is
ANONYMOUS = User("system:anonymous", ("system:unauthenticated",))


def service_account_user(namespace: str, name: str, uid: str = "") -> User:
    return User(f"system:serviceaccount:{namespace}:{name}",
                ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"), uid)


@dataclass(frozen=True)
class Credentials:
    """What identifies the server and lets it tell its users apart; PEM bytes and secrets, kept across restarts."""

    ca_pem: bytes = field(repr=False)
    cert_pem: bytes = field(repr=False)
    key_pem: bytes = field(repr=False)
    admin_token: str = field(repr=False)
    signing_key: bytes = field(repr=False)

    @classmethod
    def generate(cls, hosts: Sequence[str] = ("127.0.0.1",), *,
                 now: datetime.datetime | None = None) -> Credentials:
        """A fresh CA, a serving certificate for `hosts` (IP addresses or names) and the local names, a random
        admin token and signing key."""
        now = now or datetime.datetime.now(datetime.UTC)
        ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shardwise local cluster CA")])
        ca = _certificate(ca_name, ca_key, ca_name, ca_key, now, ca=True)
        names: list[x509.GeneralName] = []
        for host in dict.fromkeys([*hosts, "127.0.0.1", "::1", "localhost", *SERVICE_NAMES]):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        serving = _certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]), key,
                               ca_name, ca_key, now, names=names)
        pem = serialization.Encoding.PEM
        return cls(ca_pem=ca.public_bytes(pem), cert_pem=serving.public_bytes(pem),
                   key_pem=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
                   admin_token=secrets.token_urlsafe(32), signing_key=secrets.token_bytes(32))

    def server_ssl_context(self) -> ssl.SSLContext:
        """The TLS context the server serves its certificate with."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        with tempfile.TemporaryDirectory() as scratch:  # ssl loads certificate chains from files only
            cert, key = Path(scratch, "tls.crt"), Path(scratch, "tls.key")
            cert.write_bytes(self.cert_pem)
            key.write_bytes(self.key_pem)
            os.chmod(key, 0o600)
            context.load_cert_chain(cert, key)
        return context

    # -- ServiceAccount tokens ------------------------------------------------------------------------------------

    def issue(self, claims: Mapping[str, Any]) -> str:
        """A signed JWT carrying `claims`."""
        header = _b64({"alg": "HS256", "kid": self.key_id, "typ": "JWT"})
        payload = _b64(dict(claims))
        return f"{header}.{payload}.{self._sign(f'{header}.{payload}')}"

    def verify(self, token: str, now: datetime.datetime) -> dict[str, Any] | None:
        """The claims of a token this server signed that is valid at `now` for the API's audiences, else None."""
        parts = token.split(".")
        if len(parts) != 3 or not hmac.compare_digest(self._sign(f"{parts[0]}.{parts[1]}"), parts[2]):
            return None
        try:
            claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        except ValueError:
            return None
        if not isinstance(claims, dict) or not isinstance(claims.get("kubernetes.io"), dict):
            return None
        moment = now.timestamp()
        if not (isinstance(claims.get("exp"), int) and moment < claims["exp"]):
            return None
        if isinstance(claims.get("nbf"), int) and moment < claims["nbf"] - 60:  # a minute of leeway, as Kubernetes
            return None
        audiences = claims.get("aud")
        if not isinstance(audiences, list) or not set(audiences) & set(API_AUDIENCES):
            return None
        return claims

    @property
    def key_id(self) -> str:
        return hashlib.sha256(self.signing_key).hexdigest()[:16]

    def _sign(self, signed: str) -> str:
        digest = hmac.new(self.signing_key, signed.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def token_claims(*, namespace: str, name: str, uid: str, audiences: Sequence[str], issued: datetime.datetime,
                 seconds: int, bound: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The claims of a ServiceAccount token, as the TokenRequest API writes them; `bound`: the Pod or Secret it is
    bound to ({"kind", "name", "uid"})."""
    private: dict[str, Any] = {"namespace": namespace, "serviceaccount": {"name": name, "uid": uid}}
    if bound is not None:
        private[bound["kind"].lower()] = {"name": bound["name"], "uid": bound["uid"]}
    at = int(issued.timestamp())
    return {"aud": list(audiences), "exp": at + seconds, "iat": at, "nbf": at, "iss": ISSUER, "jti": str(uuid.uuid4()),
            "kubernetes.io": private, "sub": f"system:serviceaccount:{namespace}:{name}"}


def bearer_token(header: str) -> str | None:
    """The token of an `Authorization` header as Kubernetes reads it: the scheme `bearer` in any case, a space, the
    token (the next space-separated field); None for another scheme or an empty token. `Bearer bearer x` reads as
    the token `bearer`, which no one holds."""
    parts = header.strip().split(" ", 2)
    if len(parts) < 2 or parts[0].lower() != "bearer" or not parts[1]:
        return None
    return parts[1]


def _b64(obj: Mapping[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj, separators=(",", ":")).encode()).rstrip(b"=").decode()


def _certificate(subject: x509.Name, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
                 signer: ec.EllipticCurvePrivateKey, now: datetime.datetime, *, ca: bool = False,
                 names: Sequence[x509.GeneralName] = ()) -> x509.Certificate:
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + CERT_VALIDITY)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()),
                              critical=False))  # Python 3.13's strict verification wants both
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        builder = (builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                   .add_extension(x509.SubjectAlternativeName(list(names)), critical=False))
    return builder.sign(signer, hashes.SHA256())
