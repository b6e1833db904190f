"""This process's place in a Ray cluster, and the placement group the worker ranks get.

As vLLM does, the driver joins the cluster ``RAY_ADDRESS`` names, else the one running on
this machine (``ray start --head``); with neither it starts a local one. The ranks'
bundles are packed (``PACK``: as few nodes as the cluster allows), one bundle per worker
rank: the driver is not placed by Ray and reserves nothing in the cluster.
"""

from __future__ import annotations

import itertools
import logging
import os

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from engine.interfaces import ExecutorFailure

logger = logging.getLogger(__name__)

STRATEGY = "PACK"
# the Ray resource a rank of each device type holds: its cores on the CPU, one GPU on CUDA
RESOURCE_OF_DEVICE = {"cpu": "CPU", "cuda": "GPU"}
_GROUPS = itertools.count()


def connect() -> str:
    """Join a Ray cluster (or start a local one); a line saying which, also logged."""
    if ray.is_initialized():
        return "using this process's Ray connection"
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return _say(f"joined the Ray cluster at {address} (RAY_ADDRESS)")
    try:
        ray.init(address="auto")
        return _say("joined the Ray cluster running on this machine")
    except ConnectionError:
        ray.init()
        return _say(
            "no Ray cluster was running (RAY_ADDRESS unset, none on this machine): started a local one"
        )


def _say(line: str) -> str:
    logger.warning("ray executor: %s", line)
    return line


def rank_resources(device_type: str, cpus: int) -> dict[str, float]:
    """One worker rank's bundle: ``cpus`` cores on the CPU, one device elsewhere."""
    if device_type not in RESOURCE_OF_DEVICE:
        raise ValueError(
            f"distributed_executor_backend: ray places {', '.join(RESOURCE_OF_DEVICE)} ranks; "
            f"the platform's device is {device_type!r}"
        )
    key = RESOURCE_OF_DEVICE[device_type]
    return {key: float(cpus) if key == "CPU" else 1.0}


def place(bundle: dict[str, float], count: int, timeout_s: float):
    """A placement group of ``count`` copies of ``bundle``, ready; raises
    :class:`ExecutorFailure` saying what the cluster has when it cannot be placed in time."""
    group = placement_group(
        [dict(bundle) for _ in range(count)],
        strategy=STRATEGY,
        name=f"engine-tp-{os.getpid()}-{next(_GROUPS)}",
    )
    if not group.wait(timeout_s):
        remove_placement_group(group)
        raise ExecutorFailure(
            f"Ray could not place {count} tensor-parallel rank(s) of {bundle} ({STRATEGY}) "
            f"within {timeout_s:g} s; the cluster has {ray.available_resources()} free of "
            f"{ray.cluster_resources()} (see `ray status`)"
        )
    nodes = set(placement_group_table(group)["bundles_to_node_id"].values())
    if len(nodes) > 1:
        logger.warning(
            "ray executor: the tensor-parallel ranks span %d nodes; every layer's all-reduce "
            "then crosses the network",
            len(nodes),
        )
    return group
