"""kvconnectors-p2p against the core's KV connector contract, run through a prefill and a decode
instance (engine.testing.pd_connector): every request's prompt blocks cross a real ZMQ/TCP
connection into the other instance's block ids."""

from engine.testing.pd_connector import PDConnectorContract


class TestP2pConnector(PDConnectorContract):
    connector_name = "p2p"
