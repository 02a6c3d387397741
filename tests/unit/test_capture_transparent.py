"""`--transparent`'s in-process parts: DNS bounds, the JVM trust store and options, what is missing, the hints and
refusals (agents in real namespaces: tests/integration/test_capture_transparent.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fixtures_capture import dns_query

from lcap.capture.reach import netns
from lcap.capture.reach.dns import NamespaceDns, Resolver
from lcap.capture.reach.jvm import (
    java_proxy_options,
    java_tool_options,
    non_proxy_hosts,
    pkcs12_trust_store,
    trust_store,
)
from lcap.capture.reach.names import STAND_IN, Names


def test_dns_bounds():
    """Names kept are bounded (the oldest name's stand-in address is reused); questions in flight per namespace
    are bounded (more are dropped, the client retries)."""
    names = Names(max_names=2)
    first, second = names.stand_in("a.test"), names.stand_in("b.test")
    third = names.stand_in("c.test")
    assert third == first and len({first, second}) == 2 and names.stand_in("b.test") == second
    assert all(ipaddress_in(a) for a in (first, second))

    class Slow(Resolver):
        async def answer(self, query: bytes) -> bytes | None:
            import asyncio

            await asyncio.sleep(10)
            return None

    import asyncio

    async def main() -> int:
        protocol = NamespaceDns(Slow(Names(), lambda: False, nameservers=[]))
        for _ in range(100):
            protocol.datagram_received(dns_query("a.test"), ("127.0.0.1", 5))
        protocol.connection_lost(None)
        return protocol.dropped

    assert asyncio.run(main()) == 100 - 64


def ipaddress_in(address: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(address) in STAND_IN


def test_jvm_trust_store_and_options(tmp_path):
    """The PKCS#12 trust store holds each certificate with its alias (Java's reading of it is checked by the Java
    tests); JAVA_TOOL_OPTIONS keeps the user's own options first and quotes paths with spaces."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding, pkcs12

    from lcap.capture.trust.ca import ensure_ca

    ca = x509.load_pem_x509_certificate(ensure_ca().read_bytes())
    store = pkcs12.load_pkcs12(pkcs12_trust_store([("lcap", ca.public_bytes(Encoding.DER))]), None)
    (entry,) = store.additional_certs
    assert entry.certificate == ca and entry.friendly_name == b"lcap"
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(b"-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n" + ensure_ca().read_bytes())
    written = pkcs12.load_pkcs12(trust_store(bundle, tmp_path).read_bytes(), None)  # the unreadable one left out
    assert [c.certificate for c in written.additional_certs] == [ca]
    options = java_tool_options("-Xmx1g", Path("/a b/s.p12"))
    assert options.startswith("-Xmx1g ") and '"-Djavax.net.ssl.trustStore=/a b/s.p12"' in options
    assert "proxyHost" not in options
    proxy = java_proxy_options(("127.0.0.1", 8080))
    assert "-Dhttps.proxyPort=8080" in proxy and "-Dhttp.nonProxyHosts=localhost|127.*" in proxy
    assert non_proxy_hosts(".corp.example,db:5432,10.0.0.0/8,internal")[-3:] == ["*.corp.example", "db", "internal"]


def test_collect_summary_hint_under_transparent():
    """Episodes without a turn: the summary suggests --transparent, except to a collect that used it."""
    from lcap.dataset.build.explain import NO_CALLS_FIX, NO_CALLS_FIX_TRANSPARENT
    from lcap.dataset.collect.summary import CollectSummary

    default = "\n".join(CollectSummary(episodes=1, no_turns=1).lines())
    transparent = "\n".join(CollectSummary(episodes=1, no_turns=1, transparent=True).lines())
    assert NO_CALLS_FIX in default and "--transparent" in NO_CALLS_FIX
    assert NO_CALLS_FIX_TRANSPARENT in transparent and "try --transparent" not in transparent


def test_what_is_missing_is_said(monkeypatch):
    """Not root and no user namespaces, or no iptables: `missing` names it (lcap's one-line error carries it)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns, "user_namespaces_allowed", lambda: False)
    assert netns.missing() == "root, or unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)"
    monkeypatch.setattr(netns, "restore_program", lambda: None)
    assert netns.missing().startswith("iptables (iptables-restore")


def test_transparent_does_not_go_with_ray():
    """Namespaces are made on this machine: collect --transparent --ray is a one-line error before anything runs."""
    from lcap.config import LcapError
    from lcap.dataset.options import CollectOptions

    with pytest.raises(LcapError, match="--transparent runs episodes on this machine"):
        CollectOptions(transparent=True, ray="auto")
