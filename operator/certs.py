"""The certificates of a deployment's mutual TLS between the operator and its agents, issued by the operator.

Each InferenceDeployment gets its own CA (ECDSA P-256), made once with its agent-token Secret; the CA signs one
server certificate that every agent of the deployment serves (the name `AGENT_TLS_NAME`: pods are reached by IP)
and one client certificate the operator presents. The CA's private key is thrown away after signing, so nothing
can issue more certificates for the deployment; a new CA (a rotation) comes with a new Secret, as when the
deployment is re-created. The agents refuse a client without a certificate of their CA, so a pod that reads
neither the Secret nor the operator's memory cannot open a channel, let alone send the token.

    files = issue("llm")      # {"ca.crt", "tls.crt", "tls.key" (the agents'), "client.crt", "client.key"}
"""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from shardwise.controllers.world import AGENT_TLS_NAME

#: how long the certificates hold (a deployment lives as long as its Secret; ten years is "for good")
VALIDITY = datetime.timedelta(days=3650)
#: the Secret keys: the agents mount ca.crt, tls.crt and tls.key; the operator reads ca.crt and client.*
AGENT_FILES = ("ca.crt", "tls.crt", "tls.key")
CLIENT_CERT, CLIENT_KEY = "client.crt", "client.key"


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
                 now: datetime.datetime, *, ca: bool = False, server: bool = False) -> x509.Certificate:
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(AGENT_TLS_NAME)]),
                                            critical=False)
    return builder.sign(signer, hashes.SHA256())


def issue(deployment: str, now: datetime.datetime | None = None) -> dict[str, bytes]:
    """A fresh CA for `deployment` and the agents' and the operator's certificates, as PEM files by Secret key."""
    now = now or datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"shardwise {deployment} agents CA")])
    ca = _certificate(f"shardwise {deployment} agents CA", ca_key, ca_name, ca_key, now, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server = _certificate(AGENT_TLS_NAME, server_key, ca_name, ca_key, now, server=True)
    client = _certificate(f"shardwise operator for {deployment}", client_key, ca_name, ca_key, now)
    pem = serialization.Encoding.PEM
    return {"ca.crt": ca.public_bytes(pem), "tls.crt": server.public_bytes(pem), "tls.key": _pem(server_key),
            CLIENT_CERT: client.public_bytes(pem), CLIENT_KEY: _pem(client_key)}
