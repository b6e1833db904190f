"""kvconnectors-nixl against the core's KV connector contract, run through a prefill and a decode
instance (engine.testing.pd_connector): every request's prompt blocks are read with NIXL (UCX,
host memory) out of the producer's caches into the consumer's own block ids."""

import pytest

from engine.testing.pd_connector import PDConnectorContract
from engine_kvconnectors_nixl import nixl_api

pytestmark = pytest.mark.skipif(nixl_api.missing_reason() is not None, reason=str(nixl_api.missing_reason()))


class TestNixlConnector(PDConnectorContract):
    connector_name = "nixl"
