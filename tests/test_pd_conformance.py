"""`pytest --engine-conformance` and P/D connectors: a connector built on the P/D seam
(``engine.kv_transfer.PDConnector``) gets the P/D contract with nothing declared, every other one
the plain KV connector contract; with the offload, p2p and nixl plugins installed every generated
KV connector class passes, as a plugin author runs it from their own project folder."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from engine.kv_transfer import PDConnector
from engine.plugins import Registration, load_plugins
from engine.testing import conformance_all
from engine.testing.kv_connector import KVConnectorContract
from engine.testing.pd_connector import PDConnectorContract


class MyConnector(PDConnector):
    """A plugin author's P/D connector on the seam (its transport is irrelevant to the choice)."""


def registration(name: str, target) -> Registration:
    return Registration("kv_connectors", name, target, "my-plugin")


def test_each_kv_connector_gets_its_contract():
    assert conformance_all.kv_connector_contract(registration("mine", MyConnector)) is PDConnectorContract
    by_name = {r.name: r for r in load_plugins().registrations("kv_connectors")}
    assert conformance_all.kv_connector_contract(by_name["p2p"]) is PDConnectorContract
    assert conformance_all.kv_connector_contract(by_name["offload"]) is KVConnectorContract
    # one that cannot load: the plain contract, whose tests then fail naming the import error
    broken = registration("broken", "no_such_module:Connector")
    assert conformance_all.kv_connector_contract(broken) is KVConnectorContract


@pytest.mark.slow  # a pytest session running 27 contract cases over real transports (~10 s)
def test_engine_conformance_passes_for_every_kv_connector(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-v",
            "-p",
            "no:cacheprovider",
            "--engine-conformance",
            "-k",
            "kv_connector",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    passed: dict[str, set[str]] = {}
    for cls, test in re.findall(r"::(Test_kv_connector_\w+)::(\w+) PASSED", result.stdout):
        passed.setdefault(cls, set()).add(test)
    pd_only = {name for name in dir(PDConnectorContract) if name.startswith("test_")} - {
        name for name in dir(KVConnectorContract) if name.startswith("test_")
    }
    assert pd_only and pd_only <= passed["Test_kv_connector_p2p"]
    assert (
        pd_only <= passed["Test_kv_connector_nixl_NixlConnector"]
    )  # one class for both names of one connector
    assert passed["Test_kv_connector_offload"] and not pd_only & passed["Test_kv_connector_offload"]
    assert (
        " failed" not in result.stdout.splitlines()[-1] and " skipped" not in result.stdout.splitlines()[-1]
    )
