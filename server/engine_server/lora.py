"""LoRA adapters by name, as ``vllm serve`` serves them: ``--lora-modules name=path`` at start,
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` while serving (when runtime
updating is allowed), and LoRA resolver plugins for names nobody loaded.

The server gives each adapter it loads the next integer id (1, 2, ...), never reused: an id
is the adapter's identity in the engine core (its slot, its prefix-cache key), so an adapter
unloaded and loaded again under the same name, from other files, can never be mistaken for
the old one. Loading checks the adapter in the engine core itself (:func:`check_in_core`), so
whatever the core would refuse — files missing, corrupt or truncated, a rank above
``--max-lora-rank``, a target module the model lacks, a shape that is not the model's — is
refused at load with the loader's reason, and a request never meets it."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import uuid

import attrs
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from engine.client import EngineDead
from engine.interfaces import LoRAResolver
from engine.lora import LoRARequest
from engine.messages.sampling_params import SamplingParams
from engine_server.errors import APIError, bad_request, engine_unavailable, overloaded
from engine_server.schemas import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from engine_server.validation import decode_body

logger = logging.getLogger("engine_server")

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
RESOLVER_CACHE_ENV = "VLLM_LORA_RESOLVER_CACHE_DIR"


@attrs.frozen
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's ``LoRAModulePath``)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """``name=path``, or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
        if not isinstance(fields, dict) or not {"name", "path"} <= set(fields):
            raise argparse.ArgumentTypeError(f'{text!r}: the JSON form needs "name" and "path"')
        unknown = set(fields) - {"name", "path", "base_model_name"}
        if unknown:
            raise argparse.ArgumentTypeError(f"{text!r}: unknown field(s) {', '.join(sorted(unknown))}")
        return LoRAModulePath(str(fields["name"]), str(fields["path"]), fields.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected name=path or a JSON object")
    return LoRAModulePath(name, path)


def runtime_updating_allowed(flag: bool) -> bool:
    """``--allow-runtime-lora-updating``, or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (1 / true)."""
    return flag or os.environ.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


class UnknownModel(APIError):
    """vLLM's 404 for a model or adapter the server does not serve; ``name``: what was asked for."""

    def __init__(self, name: str):
        super().__init__(404, f"The model `{name}` does not exist.", "model", "model_not_found")
        self.name = name


async def check_in_core(client, lora: LoRARequest) -> None:
    """Have the engine core read and check the adapter (it keeps it loaded): a one-token
    request under it, whose refusal carries the loader's reason. Raises :class:`APIError`."""
    request_id = f"lora-check-{uuid.uuid4().hex}"
    probe = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        handle = client.submit([(request_id, [0], probe)], lora_request=lora)
    except EngineDead:
        raise engine_unavailable() from None
    try:
        async for delta in handle.deltas():
            if delta.finish_reason == "error":
                if delta.error_code == "overloaded":
                    raise overloaded(delta.error)
                raise bad_request(delta.error or f"LoRA adapter {lora.lora_name!r} was refused", "lora_path")
            return
    except EngineDead:
        raise engine_unavailable() from None
    finally:
        handle.close()


@attrs.define
class LoRAAdapters:
    """The adapters a server serves, by name, over the base model ``base_model_name``.

    ``runtime``: ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter`` and the resolvers are
    on. ``allowed_dir``: runtime loads must name a folder inside it (after resolving ``..`` and
    symlinks; a relative path is taken inside it); None: any folder the server can read, as vLLM."""

    base_model_name: str
    runtime: bool = False
    allowed_dir: str | None = None
    resolvers: list[LoRAResolver] = attrs.field(factory=list)
    _by_name: dict[str, tuple[LoRARequest, str]] = attrs.field(factory=dict)  # name -> (adapter, parent)
    _ids: itertools.count = attrs.field(factory=lambda: itertools.count(1))
    _lock: asyncio.Lock = attrs.field(factory=asyncio.Lock)

    def get(self, name: str) -> LoRARequest | None:
        entry = self._by_name.get(name)
        return None if entry is None else entry[0]

    @property
    def can_resolve(self) -> bool:
        return self.runtime and bool(self.resolvers)

    def cards(self, base_card: dict) -> list[dict]:
        """``/v1/models`` entries, vLLM's shape: the base model's ``base_card`` with ``id`` the
        adapter's name, ``root`` its folder and ``parent`` its base model."""
        return [
            {**base_card, "id": name, "root": lora.lora_path, "parent": parent}
            for name, (lora, parent) in self._by_name.items()
        ]

    async def add(self, client, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter in the engine core, then serve it as ``name``. Raises :class:`APIError`:
        a 400 for a name taken (vLLM's answer) or an adapter the core refuses."""
        async with self._lock:
            if name == self.base_model_name:
                raise bad_request(f"{name!r} is the base model's name; give the adapter another", "lora_name")
            if name in self._by_name:
                raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            lora = LoRARequest(name, next(self._ids), path)
            await check_in_core(client, lora)
            self._by_name[name] = (lora, base_model_name or self.base_model_name)
        logger.info("LoRA adapter %r (id %d) loaded from %s", name, lora.lora_int_id, path)
        return lora

    def remove(self, name: str) -> None:
        """Stop serving ``name``: requests already running under it finish, new ones get a 404."""
        if self._by_name.pop(name, None) is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "model_not_found")
        logger.info("LoRA adapter %r unloaded", name)

    def runtime_path(self, path: str) -> str:
        """The folder a runtime load may read: inside ``allowed_dir`` when one is set."""
        if self.allowed_dir is None:
            return path
        root = os.path.realpath(self.allowed_dir)
        resolved = os.path.realpath(os.path.join(root, path))
        if os.path.commonpath([root, resolved]) != root:
            raise APIError(
                400,
                f"lora_path {path!r} is outside the allowed folder (--lora-allowed-dir); "
                "'..' and symlinks may not leave it",
                "lora_path",
                "lora_path_not_allowed",
            )
        return resolved

    async def resolve(self, client, name: str) -> LoRARequest:
        """Ask the resolvers for ``name`` (each on a thread of its own, not the request-preparing
        pool: a resolver may download) and load the first folder one returns; a 404 when none
        has it. A resolver that raises is logged and counts as not having it."""
        for resolver in self.resolvers:
            try:
                path = await asyncio.to_thread(resolver.resolve, self.base_model_name, name)
            except Exception:  # a failing resolver is logged and passed over, as one without the name
                logger.exception("LoRA resolver %s failed on %r", type(resolver).__name__, name)
                continue
            if path is None:
                continue
            logger.info("LoRA adapter %r resolved by %s: %s", name, type(resolver).__name__, path)
            try:
                return await self.add(client, name, path)
            except APIError:
                found = self.get(name)  # another request resolved it meanwhile
                if found is None:
                    raise
                return found
        raise UnknownModel(name)


async def load_lora_adapter(request: Request):
    state = request.app.state.server
    body = decode_body(await state.read(request), LoadLoRAAdapterRequest, state.allow_unknown_fields)
    if not body.lora_name or not body.lora_path:
        raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
    path = state.lora.runtime_path(body.lora_path)
    await state.lora.add(state.client, body.lora_name, path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request):
    state = request.app.state.server
    body = decode_body(await state.read(request), UnloadLoRAAdapterRequest, state.allow_unknown_fields)
    if not body.lora_name:
        raise bad_request("'lora_name' must be provided.", "lora_name")
    state.lora.remove(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
