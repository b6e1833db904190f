"""``kv_transfer_params``: the per-request field vLLM's P/D proxies and instances exchange.

The proxy sends a request to the prefill instance with ``{"do_remote_decode": true}`` and
``max_tokens=1``; the prefill instance's response carries where its blocks are
(:func:`prefill_params`); the proxy sends the original request to the decode instance with those
params (``do_remote_prefill: true``), which pulls the blocks (:class:`RemotePrefill`).
"""

from __future__ import annotations

import attrs

DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
PROMPT_HASH = "remote_prompt_hash"  # not vLLM's: lets a decode instance check it has the same prompt


@attrs.frozen
class Peer:
    """An instance another one pulls blocks from: its engine id and its transport's address."""

    engine_id: str
    host: str
    port: int


@attrs.frozen
class RemotePrefill:
    """What a decode instance needs to pull one request's prompt blocks from the prefill instance
    that computed them: block ``i`` of ``block_ids`` holds prompt positions ``i * block_size ..``."""

    peer: Peer
    request_id: str  # the request's id on the prefill instance
    block_ids: tuple[int, ...]
    prompt_hash: str | None = (
        None  # hex chained hash of its prompt's last full block (this engine's extension)
    )

    @classmethod
    def parse(cls, params: dict) -> RemotePrefill:
        """ValueError naming the key when ``params`` cannot say where the blocks are."""
        engine_id = _text(params, "remote_engine_id")
        request_id = _text(params, "remote_request_id")
        host = _text(params, "remote_host")
        port = params.get("remote_port")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
            raise ValueError(f"kv_transfer_params.remote_port: a TCP port, got {port!r}")
        block_ids = params.get("remote_block_ids")
        if not isinstance(block_ids, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids
        ):
            raise ValueError("kv_transfer_params.remote_block_ids: a list of block ids (integers >= 0)")
        prompt_hash = params.get(PROMPT_HASH)
        if prompt_hash is not None and not isinstance(prompt_hash, str):
            raise ValueError(f"kv_transfer_params.{PROMPT_HASH}: a hex string, got {prompt_hash!r}")
        return cls(Peer(engine_id, host, port), request_id, tuple(block_ids), prompt_hash)

    def matches(self, block_hashes: tuple[bytes, ...], num_prompt_tokens: int, block_size: int) -> bool:
        """Whether a decode instance's prompt is the one prefilled, as far as whole blocks go (only
        whole blocks are pulled): the chained hash of its last full block covers every token before
        it and the cache salt. Params without the hash (another engine's) are trusted."""
        if self.prompt_hash is None:
            return True
        full = num_prompt_tokens // block_size
        return 0 < full <= len(block_hashes) and block_hashes[full - 1].hex() == self.prompt_hash

    @classmethod
    def of(cls, params: dict | None) -> RemotePrefill | None:
        """The remote prefill these params ask for, or None (none asked, or unusable params:
        the server refuses those with a 400 before they reach the engine)."""
        if not isinstance(params, dict) or params.get(DO_REMOTE_PREFILL) is not True:
            return None
        try:
            return cls.parse(params)
        except ValueError:
            return None


def _text(params: dict, key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"kv_transfer_params.{key}: a non-empty string, got {value!r}")
    return value


def wants_remote_decode(params: dict | None) -> bool:
    """Whether a request asks this (prefill) instance to keep its blocks for a decode instance."""
    return isinstance(params, dict) and params.get(DO_REMOTE_DECODE) is True


def prefill_params(
    peer: Peer, request_id: str, block_ids: list[int], prompt_hash: bytes | None = None
) -> dict:
    """The params a prefill instance hands on with a request's output (vLLM's keys, and the
    chained hash of the prompt's last full block when it has one)."""
    params = {
        DO_REMOTE_PREFILL: True,
        DO_REMOTE_DECODE: False,
        "remote_engine_id": peer.engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": list(block_ids),
        "remote_host": peer.host,
        "remote_port": peer.port,
        "tp_size": 1,
    }
    if prompt_hash is not None:
        params[PROMPT_HASH] = prompt_hash.hex()
    return params


def check_kv_transfer_params(params) -> str | None:
    """Why a request's ``kv_transfer_params`` are unusable (a message naming the key), or None.
    Keys this engine does not read (vLLM's proxies send e.g. ``remote_engine_id: null`` to a
    prefill instance) are accepted."""
    if params is None:
        return None
    if not isinstance(params, dict):
        return "kv_transfer_params: must be a JSON object"
    for flag in (DO_REMOTE_DECODE, DO_REMOTE_PREFILL):
        if params.get(flag) not in (None, True, False):
            return f"kv_transfer_params.{flag}: must be true or false"
    if params.get(DO_REMOTE_PREFILL) and params.get(DO_REMOTE_DECODE):
        return "kv_transfer_params: do_remote_prefill and do_remote_decode exclude each other"
    if params.get(DO_REMOTE_PREFILL):
        try:
            RemotePrefill.parse(params)
        except ValueError as exc:
            return str(exc)
    return None
