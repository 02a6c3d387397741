"""The one bounded decoder of Content-Encoding (capture/turns/encoding.py): every coding lcap reads, exactly at the
limit and one byte past it, bombs stopped at the limit, corrupt and truncated streams refused with a clear error."""

from __future__ import annotations

import gzip
import json
import os
import zlib

import brotli
import pytest
import zstandard
from fixtures_memory import json_bomb

from lcap.capture.turns.encoding import BodyTooLarge, UndecodableBody, decode_body, raw_body
from lcap.capture.turns.turn import PendingTurn, build_row

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": os.urandom(20_000).hex()}]}).encode()


def deflate_raw(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


ENCODERS = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,
    "br": brotli.compress,
    "zstd": zstandard.ZstdCompressor().compress,
}


@pytest.mark.parametrize("coding", sorted(ENCODERS))
def test_each_coding_decodes_up_to_its_limit_and_not_a_byte_past_it(coding):
    encoded = ENCODERS[coding](BODY)
    assert decode_body(encoded, coding, len(BODY)) == BODY
    with pytest.raises(BodyTooLarge, match=f"the {coding} body decodes past the limit of {len(BODY) - 1} bytes"):
        decode_body(encoded, coding, len(BODY) - 1)


@pytest.mark.parametrize("coding", sorted(ENCODERS))
def test_truncated_and_corrupt_streams_are_refused(coding):
    encoded = ENCODERS[coding](BODY)
    with pytest.raises(UndecodableBody, match=f"the {coding} body ends before its stream does"):
        decode_body(encoded[: len(encoded) // 2], coding, len(BODY))
    corrupt = encoded[:8] + bytes(b ^ 0xFF for b in encoded[8:64]) + encoded[64:]
    with pytest.raises(UndecodableBody, match=f"the {coding} body"):
        decode_body(corrupt, coding, len(BODY))


@pytest.mark.parametrize("coding", ["gzip", "br", "zstd"])
def test_a_bomb_stops_at_the_limit(coding):
    """1 GiB in a megabyte at most: decoding stops one step past the 4 MiB limit."""
    encoded = json_bomb(coding, 1024)
    assert len(encoded) < 1_100_000
    with pytest.raises(BodyTooLarge):
        decode_body(encoded, coding, 4 << 20)


def test_lists_of_codings_concatenated_members_raw_deflate_and_unknown_codings():
    assert decode_body(gzip.compress(brotli.compress(BODY)), "br, gzip", len(BODY)) == BODY
    assert decode_body(gzip.compress(b"ab") + gzip.compress(b"cd"), "gzip", 4) == b"abcd"
    assert decode_body(gzip.compress(b"ab") + b"\0\0", "gzip", 4) == b"ab"  # padding after the member
    assert decode_body(deflate_raw(BODY), "deflate", len(BODY)) == BODY
    assert decode_body(BODY, "identity", 1) == BODY
    with pytest.raises(UndecodableBody, match="unknown content coding 'compress'"):
        decode_body(BODY, "compress", len(BODY))


def test_a_zstd_frame_asking_for_a_huge_window_is_refused():
    params = zstandard.ZstdCompressionParameters(window_log=27, write_content_size=False)
    compressor = zstandard.ZstdCompressor(compression_params=params).compressobj()
    encoded = compressor.compress(os.urandom(1 << 16) * 2) + compressor.flush()
    with pytest.raises(UndecodableBody, match=r"zstd body is corrupt: .*too much memory"):
        decode_body(encoded, "zstd", 64 << 20)


def test_the_writer_stores_an_answer_past_the_limit_as_it_came():
    """The writer's row of an answer that decodes past its turn's limit: the answer kept encoded (base64), and an
    error saying why; an answer under the limit is read as always."""
    answer = json.dumps({"choices": [{"message": {"role": "assistant", "content": "x" * 5000}}]}).encode()
    pending = PendingTurn(episode_id="e", seq=0, host="h", path="/v1/chat/completions", dialect="chat")
    pending.request_body, pending.status_code, pending.encoding = b'{"model": "m"}', 200, "gzip"
    pending.response_body, pending.body_limit = gzip.compress(answer), 1000
    row = build_row(pending)
    assert "the gzip body decodes past the limit of 1000 bytes" in row["error"]
    assert json.loads(row["response"]) == raw_body(pending.response_body, "gzip")
    pending.body_limit = len(answer)
    row = build_row(pending)
    assert row["error"] is None and row["completion_text"] == "x" * 5000
