"""Bounded per-proxy state, in-process: the certificate cache, idle episodes, the redaction cache (the connection,
body and memory limits on a running proxy: tests/integration/test_capture_limits.py)."""

from __future__ import annotations

from lcap.capture.proxy.calls import Calls
from lcap.capture.proxy.mitm_guards import bounded_lru
from lcap.capture.routing.routes import Router
from lcap.capture.trust.ca import CA_BASENAME, ca_dir
from lcap.capture.turns.turn import PendingTurn


def test_mitmproxys_certificate_store_drops_the_least_recently_used():
    """A host every call goes to keeps its certificate however many others come and go (mitmproxy's own bound
    drops the certificate made first)."""
    from cryptography import x509
    from mitmproxy.certs import CertStore

    store = bounded_lru(CertStore.from_store(ca_dir(), CA_BASENAME, 2048), 2)

    def cert(host: str):
        return store.get_cert(host, [x509.DNSName(host)])

    busy = cert("busy.example")
    cert("a.example")
    assert cert("busy.example") is busy  # a hit
    cert("b.example")  # one too many: a.example, used least recently, goes
    assert cert("busy.example") is busy
    assert {e.cert.cn for e in store.expire_queue} == {"busy.example", "b.example"}


def test_idle_episodes_are_forgotten_and_still_sort(tmp_path):
    """Past `max_episodes` idle episodes, the least recently used one's numbering is forgotten; if it comes back,
    its calls are numbered above any number it had."""

    class Writer:
        def put(self, pending: PendingTurn) -> None:
            pass

    calls = Calls(Writer(), Router(None, None), token_ids=False, max_episodes=3)  # type: ignore[arg-type]

    def one_call(episode: str) -> int:
        pending = PendingTurn(episode_id=episode, seq=None, host="h", path="/v1/chat/completions", dialect="chat")
        pending.seq = calls.next_seq(episode)
        calls.close_call(pending)
        return pending.seq

    first = [one_call("a"), one_call("a"), one_call("a")]
    for i in range(20):
        one_call(f"e{i}")
    assert first == [0, 1, 2] and calls.tracked_episodes() == 3
    assert one_call("a") > 2  # forgotten, and still after its earlier calls
    assert calls.tracked_episodes() == 3 and not calls.busy(any_episode=True)


def test_the_redaction_cache_keeps_only_short_names():
    """Field names are checked against credential names through a cache: an agent's long keys do not enter it."""
    from lcap import redact

    before = redact._secret_name.cache_info().currsize
    assert redact.redact_json({"k" * 100_000: "v", "x_unique_api_key": "v"}) == {
        "k" * 100_000: "v",
        "x_unique_api_key": redact.REDACTED,
    }
    assert redact._secret_name.cache_info().currsize == before + 1
