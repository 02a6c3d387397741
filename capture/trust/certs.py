"""The TLS certificates the front shows agents for the hosts it intercepts, made with lcap's CA."""

from __future__ import annotations

import ipaddress
import ssl
import tempfile
from collections import OrderedDict
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from mitmproxy.certs import CertStore

from lcap.capture.proxy.mitm_guards import bounded_lru


class LeafCerts:
    """TLS server contexts for intercepted hosts, signed by lcap's CA: made on first use, the `max_certs` most
    recently used kept (a context holds its certificate and key; a client names as many hosts as it likes)."""

    def __init__(self, confdir: Path, basename: str, max_certs: int = 1000) -> None:
        self.store = bounded_lru(CertStore.from_store(confdir, basename, 2048), max_certs)
        self.max_certs = max_certs
        self.contexts: OrderedDict[str, ssl.SSLContext] = OrderedDict()

    def context(self, host: str) -> ssl.SSLContext:
        ctx = self.contexts.get(host)
        if ctx is None:
            ctx = self.contexts[host] = self._make(host)
            if len(self.contexts) > self.max_certs:
                self.contexts.popitem(last=False)
        else:
            self.contexts.move_to_end(host)
        return ctx

    def pem(self, host: str) -> tuple[bytes, bytes]:
        """The certificate chain for `host` and its private key, PEM-encoded."""
        try:
            name: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            name = x509.DNSName(host.encode("idna").decode())
        entry = self.store.get_cert(host, [name])
        key = entry.privatekey.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return entry.cert.to_pem() + b"".join(c.to_pem() for c in entry.chain_certs), key

    def _make(self, host: str) -> ssl.SSLContext:
        chain, key = self.pem(host)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.set_alpn_protocols(["http/1.1"])
        # No TLS 1.3 session tickets: sent right after the handshake, they cross the agent's first write, and a
        # client that reads in one thread while it writes in another (websockets' sync client) may lose that write.
        ctx.num_tickets = 0
        with tempfile.TemporaryDirectory(prefix="lcap-leaf-") as tmp:  # ssl loads key pairs from files only
            cert_file, key_file = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
            cert_file.write_bytes(chain)
            key_file.touch(0o600)
            key_file.write_bytes(key)
            ctx.load_cert_chain(cert_file, key_file)
        return ctx
