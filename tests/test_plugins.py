"""The plugin system end to end: the `engine plugins` command, the allow-list, and real
out-of-tree plugin distributions (installed into a temporary folder on the path) that are broken in
every way a plugin can be — another interface version, no `api=`, a raising hook, a target
that cannot be imported, a misspelled hook — each reported in one line while the rest load
and the engine runs; in-process, every kind of misregistration and selection around a
target that cannot be imported."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from engine import hookimpl, plugins
from engine.interfaces import AttentionBackend, AttentionSpec
from engine.plugins import RegistrationError, load_plugins
from tests.plugin_packages import environ_with, write_distribution
from tests.plugins.ban_tokens import BanTokens

ENGINE = os.path.join(os.path.dirname(sys.executable), "engine")
SHIPPED = (
    "models-llama",
    "models-qwen3",
    "models-moe",
    "models-gemma",
    "models-bert",
    "models-phi3",
    "models-granite",
    "models-olmo2",
    "models-glm4",
    "attention-torch",
    "attention-triton",
    "attention-flash-attn",
    "attention-flashinfer",
    "quant-gguf",
    "quant-int8",
    "quant-fp8",
    "quant-mxfp4",
    "loraresolvers-filesystem",
)


def run_engine(*args: str, site=None) -> subprocess.CompletedProcess:
    """``engine ARGS`` in a subprocess, with the distributions under ``site`` installed."""
    return subprocess.run(
        [ENGINE, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=environ_with(site) if site else None,
    )


def test_engine_plugins_lists_shipped_plugins_and_builtins():
    result = run_engine("plugins")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for name in ("builtin", *SHIPPED):
        assert any(line.startswith(f"{name}  (") and line.endswith("loaded") for line in out.splitlines()), (
            out
        )
    assert "attention backend: torch  [runs here]" in out
    if not torch.cuda.is_available():  # the GPU backends say why not, importing no kernel library
        assert (
            "attention backend: triton  [cannot run here: on the cpu platform Triton kernels run only" in out
        )
        assert (
            "attention backend: flash-attn  [cannot run here: FlashAttention runs on the cuda platform only"
            in out
        )
        assert (
            "attention backend: flashinfer  [cannot run here: FlashInfer runs on the cuda platform only"
            in out
        )
    assert "platform: cpu  [runs here]" in out
    assert "platform: cuda  [cannot run here:" in out  # on machines without a GPU
    assert (
        "model: LlamaForCausalLM" in out
        and "model: MixtralForCausalLM" in out
        and "model loader: gguf" in out
    )
    assert "scheduler: default" in out and "kv cache manager: default" in out
    assert "lora resolver: filesystem" in out
    # quant methods say which path they take here, and why
    assert (
        "quant method: gguf  [runs here: 32-group formats on the platform's packed kernel or int4pack" in out
    )
    assert "quant method: fp8  [runs here: dequantized at load" in out and "no FP8 matmul units" in out
    # and what tensor parallelism does with the experts each stores
    assert "unquantized  [runs here: experts split by intermediate slice under tensor parallelism]" in out
    assert "int8-w8a16  [runs here: " in out and (
        "experts whole on every rank under tensor parallelism: each expert's int8 row scales" in out
    )


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
    source = """
        from engine import hookimpl

        @hookimpl
        def register_attention_backends(register):
            register("future", "engine_attention_future:Backend", api=99)
        """
    write_distribution(
        tmp_path, "tessellm-attention-future", "attention-future", "engine_attention_future", source
    )
    return tmp_path


def test_wrong_interface_version_is_refused_with_one_line(wrong_version_plugin):
    result = run_engine("plugins", site=wrong_version_plugin)
    assert result.returncode == 0, result.stderr
    mentions = [line for line in result.stderr.splitlines() if "attention-future" in line]
    assert len(mentions) == 1 and "Traceback" not in result.stderr, result.stderr
    line = mentions[0]
    assert "tessellm-attention-future 9.0.0" in line and "refused" in line
    assert "interface v99" in line and "provides v6" in line and "it loads v1, v2, v3, v4, v5, v6" in line
    assert "attention-future  (tessellm-attention-future 9.0.0)  refused:" in result.stdout
    assert "attention backend: future" not in result.stdout
    for name in SHIPPED:
        assert f"{name}  (" in result.stdout and "loaded" in result.stdout


# Four broken plugins, each a real distribution. "platforms-fancy" is a working platform that
# outranks cpu and cpu-native and prefers its own attention backend, whose kernel library is
# missing: automatic selection must skip it for torch.
BROKEN = {
    "attention-noapi": (
        "engine_attention_noapi",
        """
        from engine import hookimpl

        @hookimpl
        def register_attention_backends(register):
            register("noapi", "engine_attention_torch.backend:TorchAttentionBackend")
        """,
    ),
    "models-raising": (
        "engine_models_raising",
        """
        from engine import hookimpl

        @hookimpl
        def register_models(register):
            raise RuntimeError("config registry unreachable")
        """,
    ),
    "platforms-fancy": (
        "engine_platforms_fancy",
        """
        from engine import hookimpl
        from engine.builtin.platforms import CpuPlatform

        class FancyCpu(CpuPlatform):
            name = "cpu-fancy"
            priority = 5
            preferred_attention_backends = ("fancy", "torch")

        @hookimpl
        def register_platforms(register):
            register("cpu-fancy", FancyCpu, api=1)

        @hookimpl
        def register_attention_backends(register):
            register("fancy", "engine_platforms_fancy.kernels:FancyAttention", api=1)
        """,
    ),
    "logits-typo": (
        "engine_logits_typo",
        """
        from engine import hookimpl
        from engine.interfaces import AttentionBackend, LogitsProcessor

        class Ban(LogitsProcessor):
            \"\"\"Bans the token ids a request lists in extra_args["ban"].\"\"\"

            def apply(self, logits, requests):
                for row, request in enumerate(requests):
                    logits[row, (request.sampling_params.extra_args or {}).get("ban", [])] = float("-inf")
                return logits

        @hookimpl
        def register_atention_backends(register):
            register("typo", AttentionBackend, api=1)

        @hookimpl
        def register_logits_processors(register):
            register("typo-ban", Ban, api=1)
        """,
    ),
}


def _distribution(entry_point: str) -> str:
    return f"tessellm-{entry_point}"


@pytest.fixture(scope="module")
def broken_plugins(tmp_path_factory):
    """The folder holding the four broken distributions."""
    site = tmp_path_factory.mktemp("broken-plugins")
    packages = [
        write_distribution(site, _distribution(ep), ep, package, source)
        for ep, (package, source) in BROKEN.items()
    ]
    (packages[2] / "kernels.py").write_text(
        "import fancy_attention_kernels  # not installed: the backend cannot be imported\n"
    )
    return site


def test_each_broken_plugin_is_one_line_in_engine_plugins(broken_plugins):
    result = run_engine("plugins", site=broken_plugins)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stdout.splitlines()
    noapi = _only(lines, "attention-noapi  (tessellm-attention-noapi 9.0.0)  refused: ")
    assert "attention backend 'noapi' registered without api=" in noapi and "provides v6" in noapi
    raising = _only(lines, "models-raising  (tessellm-models-raising 9.0.0)  refused: ")
    assert raising.endswith("register_models raised RuntimeError: config registry unreachable")
    fancy = _only(lines, "attention backend: fancy")
    assert (
        "cannot run here: cannot be imported: ModuleNotFoundError: No module named 'fancy_attention_kernels'"
    ) in fancy
    assert (
        _only(lines, "platforms-fancy  (tessellm-platforms-fancy 9.0.0)  loaded")
        and "    platform: cpu-fancy  [runs here]  (interface v1 of v3)" in lines
    )
    typo = _only(lines, "logits-typo  (tessellm-logits-typo 9.0.0)  loaded; ")
    assert typo.endswith(
        "ignored hook register_atention_backends: no such hook (did you mean register_attention_backends?)"
    )
    assert "    logits processor: typo-ban" in lines  # its other hook loaded
    assert not any("attention backend: noapi" in line or "attention backend: typo" in line for line in lines)
    for name in ("builtin", *SHIPPED):
        _only(lines, f"{name}  (")
    # stderr: one warning per refusal or ignored hook, and one per selection that skipped fancy
    for entry_point in ("attention-noapi", "models-raising", "logits-typo"):
        assert sum(entry_point in line for line in result.stderr.splitlines()) == 1, result.stderr


def _only(lines: list[str], text: str) -> str:
    """The one line containing ``text``."""
    found = [line for line in lines if text in line]
    assert len(found) == 1, (text, found)
    return found[0]


ENGINE_RUN = """
import json, sys
from engine import LLM, SamplingParams

llm = LLM(sys.argv[1], dtype="float32", num_blocks=64, max_model_len=256, logits_processors=["typo-ban"])
first = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
banned = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0, extra_args={"ban": [first[0]]}))
try:
    LLM(sys.argv[1], dtype="float32", num_blocks=64, max_model_len=256, attention_backend="fancy")
    explicit = None
except RuntimeError as exc:
    explicit = str(exc)
print(json.dumps({"platform": llm.engine.platform.name, "attention": llm.engine.attention.name,
                  "first": list(first), "banned": list(banned[0].outputs[0].token_ids),
                  "explicit": explicit}))
"""


def test_engine_runs_with_the_rest_and_skips_the_backend_that_cannot_import(broken_plugins, tiny_llama):
    result = subprocess.run(
        [sys.executable, "-c", ENGINE_RUN, tiny_llama[0]],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=environ_with(broken_plugins),
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["platform"] == "cpu-fancy" and out["attention"] == "torch"
    assert len(out["first"]) == 4 and out["banned"][0] != out["first"][0]
    assert out["explicit"] == (
        "attention backend 'fancy' (plugin 'platforms-fancy') cannot be imported: "
        "ModuleNotFoundError: No module named 'fancy_attention_kernels'"
    )
    skipped = [line for line in result.stderr.splitlines() if "'fancy'" in line and "skipped" in line]
    assert skipped and "Traceback" not in result.stderr, result.stderr


def registry_with(monkeypatch, name: str, plugin, *others: str):
    """A fresh registry of builtin, ``others`` and the in-process ``plugin``, which is
    forgotten after the test."""
    monkeypatch.setitem(plugins._local, name, plugin)
    return plugins.PluginRegistry([name, *others])


def hooks(**functions):
    """An in-process plugin object whose attributes are the given hook implementations."""
    return types.SimpleNamespace(**{name: hookimpl(fn) for name, fn in functions.items()})


MISREGISTRATIONS = {
    "not-a-subclass": (
        ("x", object),
        {"api": 1},
        (
            "attention backend 'x': target is <class 'object'>, "
            "not a subclass of engine.interfaces.attention.AttentionBackend"
        ),
    ),
    "bad-lazy-target": (
        ("x", "no colon here"),
        {"api": 1},
        "attention backend 'x': target 'no colon here' is not \"module:Attribute\"",
    ),
    "name-with-space": (
        ("two words", "pkg.mod:Backend"),
        {"api": 1},
        "attention backend name 'two words' is not a non-empty string without spaces or commas",
    ),
    "name-not-a-string": ((None, "pkg.mod:Backend"), {"api": 1}, "attention backend name None is not"),
    "api-positional": (("x", "pkg.mod:Backend", 1), {}, "register_attention_backends raised TypeError: "),
}


@pytest.mark.parametrize("case", sorted(MISREGISTRATIONS))
def test_misregistration_refuses_the_plugin_with_its_reason(monkeypatch, case):
    args, kwargs, reason = MISREGISTRATIONS[case]
    registry = registry_with(
        monkeypatch, "bad", hooks(register_attention_backends=lambda register: register(*args, **kwargs))
    )
    assert registry.plugins["bad"].status.startswith(f"refused: {reason}")
    assert registry.names("attention_backends") == [] and registry.names("platforms") == ["cpu", "cuda"]


def test_attention_backends_built_for_v1_still_load(monkeypatch):
    """v2 and v3 only added defaulted members (cuda_graph_support, describe, build_graph_metadata):
    a v1 backend loads with them."""
    target = "engine_attention_torch.backend:TorchAttentionBackend"
    registry = registry_with(
        monkeypatch, "old", hooks(register_attention_backends=lambda register: register("old", target, api=1))
    )
    assert registry.names("attention_backends") == ["old"]
    assert registry.get("attention_backends", "old").cuda_graph_support == "none"
    refused = registry_with(
        monkeypatch,
        "older",
        hooks(register_attention_backends=lambda register: register("older", target, api=0)),
    )
    assert refused.plugins["older"].status.startswith("refused: built for attention_backends interface v0")


def test_a_plugin_that_swallows_the_refusal_is_still_refused(monkeypatch):
    def register_models(register):
        try:
            register("Broken", "pkg:Model")
        except ValueError:
            pass
        register("Fine", "pkg:Model", api=2)

    registry = registry_with(monkeypatch, "sly", hooks(register_models=register_models))
    assert registry.plugins["sly"].status == (
        "refused: model 'Broken' registered without api= (the interface "
        "version it targets; this core provides v6)"
    )
    assert registry.names("models") == []


def test_hook_arguments_the_spec_lacks_refuse_the_plugin(monkeypatch):
    registry = registry_with(monkeypatch, "args", hooks(register_models=lambda registrar: None))
    status = registry.plugins["args"].status
    assert (
        status.startswith("refused: PluginValidationError: ") and "registrar" in status and "\n" not in status
    )


def test_unmarked_hook_is_reported_and_marked_ones_load(monkeypatch):
    plugin = hooks(register_logits_processors=lambda register: register("ban", BanTokens, api=1))
    plugin.register_models = lambda register: register("M", "pkg:Model", api=2)  # forgot @hookimpl
    registry = registry_with(monkeypatch, "half", plugin)
    assert registry.plugins["half"].describe() == (
        "half  ((in-process) -)  loaded; ignored register_models: not marked @engine.hookimpl"
    )
    assert registry.names("logits_processors") == ["ban"] and registry.names("models") == []


def test_auto_selection_skips_what_cannot_be_imported_and_explicit_selection_names_it(monkeypatch):
    from engine.builtin.platforms import CpuPlatform
    from engine.core.setup import select_attention_backend, select_platform

    class Preferring(CpuPlatform):
        preferred_attention_backends = ("gone", "torch")

    def register_attention_backends(register):
        register("gone", "engine_no_such_kernels.attention:Backend", api=1)

    def register_platforms(register):
        register("ghost", "engine_no_such_platform:Platform", api=1)

    plugin = hooks(
        register_attention_backends=register_attention_backends, register_platforms=register_platforms
    )
    registry = registry_with(monkeypatch, "missing", plugin, "attention-torch")
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, block_size=16)
    assert select_attention_backend(registry, None, spec, Preferring()).name == "torch"
    assert select_platform(registry, None).name == "cpu"
    with pytest.raises(RegistrationError) as err:
        select_attention_backend(registry, "gone", spec, Preferring())
    assert str(err.value) == (
        "attention backend 'gone' (plugin 'missing') cannot be imported: "
        "ModuleNotFoundError: No module named 'engine_no_such_kernels'"
    )
    big = AttentionSpec(num_heads=6, num_kv_heads=4, head_dim=32, dtype=torch.float32, block_size=16)
    with pytest.raises(RuntimeError, match=r"gone: cannot be imported: ModuleNotFoundError.*; torch: "):
        select_attention_backend(registry, None, big, Preferring())


class RaisingBackend(AttentionBackend):
    """A backend whose capability check itself is broken."""

    name = "raising"

    @classmethod
    def supports(cls, spec, platform):
        raise KeyError("compute capability")

    def forward(self, query, key, value, kv_cache, metadata):
        raise AssertionError("never selected")


def test_a_capability_check_that_raises_is_a_reason_not_a_crash(monkeypatch, capsys):
    from engine.builtin.platforms import CpuPlatform
    from engine.core.setup import select_attention_backend
    from engine.entrypoints.cli import PluginsCommand

    class Preferring(CpuPlatform):
        preferred_attention_backends = ("raising", "torch")

    plugin = hooks(register_attention_backends=lambda register: register("raising", RaisingBackend, api=6))
    registry = registry_with(monkeypatch, "checks", plugin, "attention-torch")
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, block_size=16)
    assert select_attention_backend(registry, None, spec, Preferring()).name == "torch"
    big = AttentionSpec(num_heads=6, num_kv_heads=4, head_dim=32, dtype=torch.float32, block_size=16)
    with pytest.raises(
        RuntimeError, match=r"raising: RaisingBackend.supports raised KeyError: 'compute capability'"
    ):
        select_attention_backend(registry, None, big, Preferring())
    monkeypatch.setattr(plugins, "_loaded", {frozenset(["checks"]): registry})
    assert PluginsCommand().run(argparse.Namespace(plugins=["checks"])) == 0
    assert (
        "    attention backend: raising  [cannot run here: its check raised KeyError: 'compute capability']"
        in capsys.readouterr().out.splitlines()
    )
