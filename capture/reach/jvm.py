"""JVM agents: the proxy and trust settings Java reads (`JAVA_TOOL_OPTIONS`), and the trust store they name.

The JVM ignores `HTTPS_PROXY` and `SSL_CERT_FILE`: it reads system properties, which every JVM
also takes from `JAVA_TOOL_OPTIONS`. Java's `HttpClient`, `HttpURLConnection` and OkHttp all use
the default `ProxySelector` (`https.proxyHost`, `http.nonProxyHosts`) and the default trust store
(`javax.net.ssl.trustStore`). Java cannot present proxy credentials from properties (tunnels refuse
Basic authentication, and `HttpClient` has no authenticator unless the program sets one), so a JVM
is pointed at its episode's own loopback port, which needs none (`Front.listen_episode`).

The trust store is a PKCS#12 file holding the system roots and lcap's CA, written here without
keytool: each certificate is a trusted entry (Oracle's trusted-key-usage attribute, which is what
makes Java read a PKCS#12 certificate as trusted), with no password and no MAC, the format of the
JDK's own `cacerts` since JDK 18; JDK 11.0.12+ and 17 read it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from lcap.files import atomic_write

TRUST_STORE = "java-truststore.p12"

# --- a minimal DER encoder, for the one structure written here ----------------------------------------


def _der(tag: int, content: bytes) -> bytes:
    n = len(content)
    if n < 0x80:
        return bytes((tag, n)) + content
    size = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes((tag, 0x80 | len(size))) + size + content


def _oid(dotted: str) -> bytes:
    parts = [int(p) for p in dotted.split(".")]
    out = bytearray((parts[0] * 40 + parts[1],))
    for part in parts[2:]:
        chunk = [part & 0x7F]
        part >>= 7
        while part:
            chunk.append(0x80 | (part & 0x7F))
            part >>= 7
        out += bytes(reversed(chunk))
    return _der(0x06, bytes(out))


def _seq(*items: bytes) -> bytes:
    return _der(0x30, b"".join(items))


def _set(*items: bytes) -> bytes:
    return _der(0x31, b"".join(sorted(items)))  # DER orders a SET OF by encoding


def _explicit(content: bytes) -> bytes:
    return _der(0xA0, content)


DATA = "1.2.840.113549.1.7.1"
CERT_BAG = "1.2.840.113549.1.12.10.1.3"
X509_CERTIFICATE = "1.2.840.113549.1.9.22.1"
FRIENDLY_NAME = "1.2.840.113549.1.9.20"
ORACLE_TRUSTED_KEY_USAGE = "2.16.840.1.113894.746875.1.1"
ANY_EXTENDED_KEY_USAGE = "2.5.29.37.0"


def pkcs12_trust_store(certificates: Iterable[tuple[str, bytes]]) -> bytes:
    """A PKCS#12 file (no password, no MAC) whose entries are the given (alias, DER certificate) as trusted
    certificates."""
    bags = []
    for alias, der in certificates:
        value = _explicit(_seq(_oid(X509_CERTIFICATE), _explicit(_der(0x04, der))))
        attributes = _set(
            _seq(_oid(FRIENDLY_NAME), _set(_der(0x1E, alias.encode("utf-16-be")))),
            _seq(_oid(ORACLE_TRUSTED_KEY_USAGE), _set(_oid(ANY_EXTENDED_KEY_USAGE))),
        )
        bags.append(_seq(_oid(CERT_BAG), value, attributes))
    safe_contents = _seq(*bags)
    authenticated_safe = _seq(_seq(_oid(DATA), _explicit(_der(0x04, safe_contents))))
    return _seq(_der(0x02, b"\x03"), _seq(_oid(DATA), _explicit(_der(0x04, authenticated_safe))))


def trust_store(bundle: Path, directory: Path) -> Path:
    """`directory/java-truststore.p12`: every certificate of the PEM `bundle` (the system roots and lcap's CA)
    as a trusted entry; rewritten when the bundle is newer."""
    store = directory / TRUST_STORE
    if store.exists() and store.stat().st_mtime >= bundle.stat().st_mtime:
        return store
    certificates: list[tuple[str, bytes]] = []
    seen: set[bytes] = set()
    for block in _pem_blocks(bundle.read_bytes()):
        try:
            cert = x509.load_pem_x509_certificate(block)
        except ValueError:  # an unreadable one is left out (`lcap doctor ca.bundle` says what is wrong)
            continue
        der = cert.public_bytes(Encoding.DER)
        if der in seen:
            continue
        seen.add(der)
        certificates.append((f"{len(certificates)}-{cert.subject.rfc4514_string()[:64]}", der))
    atomic_write(store, pkcs12_trust_store(certificates))
    return store


def _pem_blocks(data: bytes) -> list[bytes]:
    begin, end = b"-----BEGIN CERTIFICATE-----", b"-----END CERTIFICATE-----"
    return [begin + part.split(end, 1)[0] + end + b"\n" for part in data.split(begin)[1:] if end in part]


# --- JAVA_TOOL_OPTIONS -----------------------------------------------------------------------------------

DEFAULT_NON_PROXY = ("localhost", "127.*", "[::1]", "0.0.0.0", "[::0]")  # the JVM's own default


def non_proxy_hosts(no_proxy: str | None) -> list[str]:
    """`http.nonProxyHosts` entries: the JVM's default ones, plus NO_PROXY's (already stripped of LLM hosts) in
    Java's syntax (`*.example.com`; ports and CIDR ranges have no equivalent and are left out)."""
    hosts = list(DEFAULT_NON_PROXY)
    for entry in (e.strip() for e in (no_proxy or "").split(",")):
        if not entry or "/" in entry:
            continue
        host = entry.rsplit(":", 1)[0] if entry.count(":") == 1 else entry
        if host.startswith("."):
            host = "*" + host
        if host and host not in hosts:
            hosts.append(host)
    return hosts


def java_tool_options(existing: str | None, store: Path) -> str:
    """`JAVA_TOOL_OPTIONS` with lcap's trust store after the user's own options (a later -D wins, so lcap's does)."""
    options = _quoted([f"-Djavax.net.ssl.trustStore={store}", "-Djavax.net.ssl.trustStoreType=PKCS12"])
    return " ".join(([existing.strip()] if existing and existing.strip() else []) + options)


def java_proxy_options(proxy: tuple[str, int], non_proxy: Sequence[str] = DEFAULT_NON_PROXY) -> str:
    """The properties that send a JVM's HTTP and HTTPS connections through `proxy` (host, port), to add to
    `JAVA_TOOL_OPTIONS`."""
    host, port = proxy
    options = [f"-Dhttp.proxyHost={host}", f"-Dhttp.proxyPort={port}", f"-Dhttps.proxyHost={host}"]
    options += [f"-Dhttps.proxyPort={port}", f"-Dhttp.nonProxyHosts={'|'.join(non_proxy)}"]
    return " ".join(_quoted(options))


def _quoted(options: list[str]) -> list[str]:
    return [f'"{o}"' if any(c.isspace() for c in o) else o for o in options]  # the JVM splits on white space
