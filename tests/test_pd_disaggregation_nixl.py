"""The prefill/decode end-to-end tests of ``test_pd_disaggregation.py`` over NIXL: a prefill
`engine serve` (kv_producer) and decode `engine serve` instances (kv_consumer) with the nixl
connector under vLLM's name (``NixlConnector``), `engine proxy` in front, the official `openai`
client; the decode instance READs each prompt's blocks out of the prefill instance's registered
caches (UCX over host memory).

The tests are those of the p2p module, run against these instances (only ``instances`` differs):
16 concurrent mixed-length requests give a single instance's greedy float32 output and the decode
instance computed none of the pulled blocks; killing the decode instance mid-transfer fails only
its requests (OpenAI-shaped errors) and the prefill instance frees what nobody will read; killing
the prefill instance fails only the requests that still needed it, a failed pull is recomputed,
and KV usage returns to 0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json

import pytest

from engine_kvconnectors_nixl import nixl_api
from tests import test_pd_disaggregation as p2p
from tests.serving import free_port, serve
from tests.test_pd_disaggregation import (  # noqa: F401 - the p2p module's fixtures, reused as they are
    COMMON,
    HOLD_SECONDS,
    decode_instance,
    prefill_instance,
    prompts,
)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(nixl_api.missing_reason() is not None, reason=str(nixl_api.missing_reason()))]


def transfer(role: str, port: int = 0) -> str:
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_ip": "127.0.0.1",
              "kv_connector_extra_config": {"abort_request_timeout": HOLD_SECONDS, "transfer_timeout": 10,
                                            "backends": ["UCX"]}}
    if port:
        config["kv_port"] = port
    return json.dumps(config)


@pytest.fixture(scope="module")
def instances(tiny_llama):
    """(prefill, decode, a second decode for the last test), started side by side."""
    specs = [transfer("kv_producer", free_port()), transfer("kv_consumer"), transfer("kv_consumer")]
    managers = [serve(tiny_llama[0], *COMMON, "--kv-transfer-config", spec) for spec in specs]
    with contextlib.ExitStack() as stack, concurrent.futures.ThreadPoolExecutor(len(managers)) as pool:
        started = [pool.submit(manager.__enter__) for manager in managers]
        for manager in managers:
            stack.push(manager)
        yield [future.result(timeout=600) for future in started]


# the p2p module's tests, in its order (each kill leaves the next test the instances it needs)
test_pd_through_the_proxy_gives_the_single_instance_output = p2p.test_pd_through_the_proxy_gives_the_single_instance_output
test_killing_the_decode_instance_fails_only_its_requests = p2p.test_killing_the_decode_instance_fails_only_its_requests
test_killing_the_prefill_instance_fails_only_its_requests = p2p.test_killing_the_prefill_instance_fails_only_its_requests
