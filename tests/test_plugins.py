"""The plugin system end to end: the `engine plugins` command, the allow-list, and a real
out-of-tree plugin package (pip-installed from a temporary directory) built for another
interface version, refused with one line while the rest load."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from engine.plugins import load_plugins

ENGINE = os.path.join(os.path.dirname(sys.executable), "engine")
SHIPPED = ("models-llama", "attention-torch", "quant-gguf", "quant-int8", "quant-fp8", "quant-mxfp4")


def run_engine(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([ENGINE, *args], capture_output=True, text=True, timeout=120)


def test_engine_plugins_lists_shipped_plugins_and_builtins():
    result = run_engine("plugins")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for name in ("builtin", *SHIPPED):
        assert any(line.startswith(f"{name}  (") and line.endswith("loaded") for line in out.splitlines()), out
    assert "attention backend: torch  [runs here]" in out
    assert "platform: cpu  [runs here]" in out
    assert "platform: cuda  [cannot run here:" in out  # on machines without a GPU
    assert "model: LlamaForCausalLM" in out and "model loader: gguf" in out
    assert "scheduler: default" in out and "kv cache manager: default" in out
    # quant methods say which path they take here, and why
    assert "quant method: gguf  [runs here: 32-group formats on int4pack planes" in out
    assert "quant method: fp8  [runs here: dequantized at load" in out and "no FP8 matmul units" in out


def test_allow_list_limits_loading():
    registry = load_plugins(["attention-torch"])
    assert set(registry.plugins) >= {"builtin", "attention-torch"}
    assert "models-llama" not in registry.plugins
    assert registry.names("models") == []
    with pytest.raises(ValueError, match="unknown plugin"):
        load_plugins(["no-such-plugin"])
    assert load_plugins(["attention-torch"]) is registry  # idempotent per process


def test_unknown_plugin_on_the_cli_is_one_clear_line():
    result = run_engine("--plugins", "nope", "plugins")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "unknown plugin" in result.stderr


@pytest.fixture
def wrong_version_plugin(tmp_path):
    package = tmp_path / "engine_attention_future"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent("""
        from engine import hookimpl

        @hookimpl
        def register_attention_backends(register):
            register("future", "engine_attention_future:Backend", api=99)
        """))
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "tessellm-attention-future"
        version = "9.0.0"

        [project.entry-points."engine.plugins"]
        attention-future = "engine_attention_future"

        [tool.setuptools]
        packages = ["engine_attention_future"]
        """))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", str(tmp_path)], check=True,
                   capture_output=True, timeout=300)
    yield
    subprocess.run([*pip, "uninstall", "-y", "tessellm-attention-future"], check=True, capture_output=True)


def test_wrong_interface_version_is_refused_with_one_line(wrong_version_plugin):
    result = run_engine("plugins")
    assert result.returncode == 0, result.stderr
    mentions = [line for line in result.stderr.splitlines() if "attention-future" in line]
    assert len(mentions) == 1 and "Traceback" not in result.stderr, result.stderr
    line = mentions[0]
    assert "tessellm-attention-future 9.0.0" in line and "refused" in line
    assert "interface v99" in line and "provides v1" in line
    assert "attention-future  (tessellm-attention-future 9.0.0)  refused:" in result.stdout
    assert "attention backend: future" not in result.stdout
    for name in SHIPPED:
        assert f"{name}  (" in result.stdout and "loaded" in result.stdout
