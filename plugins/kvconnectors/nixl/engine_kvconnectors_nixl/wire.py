"""The side channel's messages (ZMQ, ``kv_ip:kv_port`` of the prefill instance): a kind frame and a
JSON header, the hello's reply adding NIXL's agent metadata. The KV bytes never pass here: the
decode instance reads them with NIXL once a lease is granted.

    decode -> prefill   [b"hello", {engine_id, layout}]                   before the first read
                        [b"lease", {id, engine_id, request_id, block_ids}] may I read these?
                        [b"release", {engine_id, request_id}]              done with the request
    prefill -> decode   [b"hello", {engine_id, layout, regions}, agent metadata]
                        [b"grant", {id}]                                   read now, within the timeout
                        [b"err", {id, error}]                              (id "hello": the hello failed)
"""

from __future__ import annotations

import json

HELLO, LEASE, RELEASE, GRANT, ERR = b"hello", b"lease", b"release", b"grant", b"err"
HELLO_ID = "hello"


def endpoint(host: str, port: int) -> str:
    """The ZMQ address of a side channel (an IPv6 host in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def header(**fields) -> bytes:
    return json.dumps(fields, separators=(",", ":")).encode()


def parse(frame) -> dict:
    """ValueError when the frame is not a header (a peer of another kind)."""
    try:
        head = json.loads(bytes(frame))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a nixl side-channel header: {exc}") from exc
    if not isinstance(head, dict):
        raise ValueError(f"not a nixl side-channel header: {head!r}")  # noqa: TRY004
    return head


def block_ids(head: dict) -> list[int]:
    """The header's ``block_ids``; ValueError unless a list of block ids."""
    ids = head.get("block_ids")
    if not isinstance(ids, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids
    ):
        raise ValueError("block_ids: not a list of block ids")
    return ids
