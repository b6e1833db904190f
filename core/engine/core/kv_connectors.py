"""The engine core's KV connector: which plugin ``kv_connector`` / ``--kv-transfer-config`` names,
its two halves (one :class:`~engine.interfaces.KVConnector` instance per role), and the transfer
counters the worker half reports (bytes and seconds of loads, bytes saved)."""

from __future__ import annotations

import uuid

import attrs
import torch

from engine.interfaces import SCHEDULER_ROLE, WORKER_ROLE, KVConnector, KVConnectorContext, KVTransferReport

TRANSFER_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config", "engine_id", "kv_ip", "kv_port")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_KV_PORT = 14579  # vLLM's kv_port


@attrs.frozen
class ConnectorSpec:
    name: str
    kv_role: str = "kv_both"
    extra_config: dict = attrs.Factory(dict)
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_KV_PORT


def connector_spec(config) -> ConnectorSpec | None:
    """The connector the config names, or None; ValueError naming the field when it is malformed."""
    transfer = config.kv_transfer_config
    if transfer is None:
        return ConnectorSpec(config.kv_connector) if config.kv_connector else None
    if not isinstance(transfer, dict):
        raise ValueError("kv_transfer_config: must be a JSON object")  # noqa: TRY004 - a config error
    unknown = sorted(set(transfer) - set(TRANSFER_KEYS))
    if unknown:
        raise ValueError(f"kv_transfer_config: unknown key(s) {unknown}; known: {list(TRANSFER_KEYS)}")
    name = transfer.get("kv_connector")
    if not isinstance(name, str) or not name:
        raise ValueError("kv_transfer_config.kv_connector: the connector's name is required")
    if config.kv_connector and config.kv_connector != name:
        raise ValueError(
            f"kv_connector: {config.kv_connector!r} contradicts kv_transfer_config.kv_connector {name!r}"
        )
    role = transfer.get("kv_role", "kv_both")
    if role not in KV_ROLES:
        raise ValueError(f"kv_transfer_config.kv_role: {role!r} is not one of {list(KV_ROLES)}")
    extra = transfer.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_transfer_config.kv_connector_extra_config: must be a JSON object")  # noqa: TRY004
    return ConnectorSpec(name, role, dict(extra), _engine_id(transfer), *_address(transfer))


def _engine_id(transfer: dict) -> str | None:
    engine_id = transfer.get("engine_id")
    if engine_id is not None and (not isinstance(engine_id, str) or not engine_id):
        raise ValueError(f"kv_transfer_config.engine_id: a non-empty string, got {engine_id!r}")
    return engine_id


def _address(transfer: dict) -> tuple[str, int]:
    """(kv_ip, kv_port); vLLM's configs write the port as a number or a string."""
    ip = transfer.get("kv_ip", "127.0.0.1")
    if not isinstance(ip, str) or not ip:
        raise ValueError(f"kv_transfer_config.kv_ip: a host name or address, got {ip!r}")
    port = transfer.get("kv_port", DEFAULT_KV_PORT)
    if (
        isinstance(port, bool)
        or not isinstance(port, int | str)
        or not str(port).isdigit()
        or int(port) > 65535
    ):
        raise ValueError(f"kv_transfer_config.kv_port: a TCP port (0-65535), got {port!r}")
    return ip, int(port)


def build_halves(registry, config, kv_caches: list[torch.Tensor], block_dim: int):
    """(scheduler half, worker half) of the configured connector, or (None, None)."""
    spec = connector_spec(config)
    if spec is None:
        return None, None
    if config.cache.calculate_kv_scales and config.cache.kv_cache_dtype != "auto":
        raise ValueError(
            "calculate_kv_scales: not with a KV connector: the blocks it moves would be read at "
            "scales another instance (or run) calculated from its own first prefill"
        )
    cls = registry.get("kv_connectors", spec.name)
    block_bytes = sum(cache.select(block_dim, 0).nbytes for cache in kv_caches)
    engine_id = spec.engine_id or uuid.uuid4().hex  # one id for both halves

    def half(role: str):
        return cls(
            KVConnectorContext(
                config,
                role,
                config.cache.block_size,
                len(kv_caches),
                block_bytes,
                spec.kv_role,
                spec.extra_config,
                engine_id,
                spec.kv_ip,
                spec.kv_port,
            )
        )

    return half(SCHEDULER_ROLE), half(WORKER_ROLE)


def name_of(connector: KVConnector) -> str:
    """The name the engine's config gave ``connector`` (either half)."""
    spec = connector_spec(connector.ctx.config)
    return spec.name if spec is not None else type(connector).__name__


def forgets_blocks(connector: KVConnector) -> bool:
    """Whether the connector's class can forget what it stores (overrides ``reset_cache``)."""
    return type(connector).reset_cache is not KVConnector.reset_cache


def forget_blocks(connector: KVConnector, what: str) -> None:
    """Have the scheduler half forget every block it stores (before ``what`` changes the weights
    that computed them); raises naming the connector if it cannot now."""
    if connector.reset_cache() is not True:
        raise ValueError(f"{what}: KV connector {name_of(connector)!r} could not forget its stored blocks")


class TransferCounters:
    """Running totals of the worker half's reports (the engine's ``kv_load_bytes``,
    ``kv_load_seconds``, ``kv_save_bytes`` stats)."""

    def __init__(self):
        self._totals = {"kv_load_bytes": 0, "kv_load_seconds": 0.0, "kv_save_bytes": 0}

    def add(self, report: KVTransferReport) -> None:
        self._totals["kv_load_bytes"] += report.loaded_bytes
        self._totals["kv_load_seconds"] += report.load_seconds
        self._totals["kv_save_bytes"] += report.saved_bytes

    def stats(self) -> dict[str, float]:
        return dict(self._totals)
