"""The plugin's own checks that need no cluster; its acceptance on a real local Ray cluster
(TP=2 parity, a killed actor under `engine serve`, a killed driver) runs with the project's
tensor-parallel tests (tests/test_tensor_parallel.py, parametrized over mp and ray)."""

from __future__ import annotations

import sys

import pytest

from engine.plugins import RegistrationError, load_plugins


def test_registered_under_its_vllm_name():
    assert "ray" in load_plugins(None).names("executors")


def test_selected_without_ray_installed_it_names_the_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as it does when ray is absent
    for module in [m for m in sys.modules if m.startswith("engine_executors_ray.")]:
        monkeypatch.delitem(sys.modules, module)
    with pytest.raises(
        RegistrationError, match=r"executor 'ray' .*needs the PyPI package `ray` \(pip install ray\)"
    ):
        load_plugins(None).get("executors", "ray")


def test_a_rank_holds_its_cores_on_the_cpu_and_one_gpu_on_cuda():
    from engine_executors_ray.cluster import rank_resources

    assert rank_resources("cpu", 3) == {"CPU": 3.0}
    assert rank_resources("cuda", 3) == {"GPU": 1.0}
    with pytest.raises(ValueError, match="ray places cpu, cuda ranks; the platform's device is 'xpu'"):
        rank_resources("xpu", 1)
