"""lcap's certificate authority: made on first use in `LCAP_HOME/ca` (its key 0600), and the bundle a child trusts
(the system roots plus lcap's CA). The front and mitmproxy sign the hosts they intercept with it
(capture/trust/certs.py); `lcap ca` prints where its certificate is."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import certifi
from mitmproxy.certs import CertStore

from lcap.config import LcapError, lcap_home
from lcap.files import atomic_write
from lcap.locks import file_lock

CA_BASENAME = "mitmproxy"
CA_CREATE_WAIT = 60.0  # seconds a proxy waits while another makes lcap's CA (one RSA key)


def ca_dir() -> Path:
    return lcap_home() / "ca"


def ca_files() -> tuple[Path, Path]:
    """lcap's CA certificate and its private key (which may not exist yet)."""
    directory = ca_dir()
    return directory / f"{CA_BASENAME}-ca-cert.pem", directory / f"{CA_BASENAME}-ca.pem"


def ensure_ca() -> Path:
    """Create lcap's CA on first use (key 0600) and return the path of its certificate."""
    directory = ca_dir()
    cert, key = ca_files()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not (key.exists() and cert.exists()):
            # two proxies starting on a new home make one CA, not two
            with file_lock(directory / ".create.lock", wait=CA_CREATE_WAIT, doing="making lcap's CA"):
                if not (key.exists() and cert.exists()):
                    CertStore.create_store(directory, CA_BASENAME, 2048)
        elif not os.access(key, os.R_OK):
            raise PermissionError(f"cannot read {key}")
        for secret in (key, directory / f"{CA_BASENAME}-ca.p12"):
            if secret.exists():
                secret.chmod(0o600)
    except Exception as exc:
        raise LcapError(f"bad CA dir {directory}: {exc}") from None
    return cert


def _system_roots() -> str | None:
    paths = ssl.get_default_verify_paths()
    candidates = [
        paths.cafile,
        paths.openssl_cafile,
        "/etc/ssl/certs/ca-certificates.crt",
        "/etc/pki/tls/certs/ca-bundle.crt",
        certifi.where(),
    ]
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def ca_bundle(cert: Path | None = None) -> Path:
    """System roots plus lcap's CA (`cert`, else made on first use) in one file: children trust both the real
    internet and the proxy. Written again when the CA or the system roots are newer."""
    cert = cert or ensure_ca()
    bundle = ca_dir() / "bundle.pem"
    roots = _system_roots()
    newest = max(cert.stat().st_mtime, os.path.getmtime(roots) if roots else 0)
    if not bundle.exists() or bundle.stat().st_mtime < newest:
        parts = [Path(roots).read_bytes().rstrip(b"\n") + b"\n"] if roots else []
        parts.append(cert.read_bytes())
        atomic_write(bundle, b"".join(parts))
    return bundle
