"""The project's frozen old plugins (``tests/old_plugins``) against today's core and contracts:
each passes, or is refused — whole when it registers, or per layer with the reason — and never
runs wrong. The v1 attention backend serves plain attention (the attention contract and the model
contract through it pass) and is never chosen for what v1 did not promise: Gemma 2's soft-capped
and sliding-window layers, Gemma 3's sliding-window ones (its global layers it serves, the query
scale equal to the default dropped exactly). The v1 model and KV connector are refused in one
line, and naming them says so. The v2 scheduler, a version in its release of deprecation warnings
(``engine.interfaces.DEPRECATED``), loads and runs; registering it logs one warning naming the
release that drops it, and ``engine plugins`` marks it."""

from __future__ import annotations

import argparse
import logging
import sys

import attrs
import pytest
import torch

from engine import LLM, SamplingParams, hookimpl, plugins
from engine.builtin.platforms import CpuPlatform
from engine.core import setup
from engine.entrypoints.cli import PluginsCommand
from engine.interfaces import DEPRECATED, INTERFACE_VERSIONS, STILL_LOADED, AttentionSpec
from engine.interfaces.attention import backend_reasons
from engine.plugins import load_plugins
from engine.testing import reference
from engine.testing.attention import BATCHES, KINDS, AttentionBackendContract, run_two_calls
from engine.testing.models import ModelContract
from engine_models_gemma.model import GemmaForCausalLM
from engine_models_llama.model import LlamaForCausalLM
from tests.old_plugins import OLD_PLUGINS, scheduler_v2
from tests.old_plugins.attention_v1 import NaiveAttention


class PrefersV1(CpuPlatform):
    """The CPU platform trying the v1 backend before any other (never chosen unless named)."""

    name = "cpu-prefers-v1"
    priority = -1
    preferred_attention_backends = ("naive-v1", "torch")


@hookimpl
def register_platforms(register):
    register("cpu-prefers-v1", PrefersV1, api=2)


@pytest.fixture(autouse=True, scope="module")
def old_plugins():
    """The old plugins and the platform preferring the v1 backend, for this module's tests only."""
    added = {**OLD_PLUGINS, "test-prefers-v1": sys.modules[__name__]}
    for name, module in added.items():
        plugins.add_plugin(module, name)
    yield
    for name in added:
        plugins.remove_plugin(name)


def test_each_old_plugin_loads_or_is_refused_in_one_line():
    registry = load_plugins()
    assert registry.plugins["old-attention-v1"].loaded
    assert registry.plugins["old-models-v1"].status == (
        "refused: built for models interface v1, this core provides v6 (it loads v2, v3, v4, v5, v6; what "
        'changed: "Interface versions" in the plugin authors\' guide)'
    )
    assert registry.plugins["old-kvconnectors-v1"].status == (
        "refused: built for kv_connectors interface v1, this core provides v4 (it loads v2, v3, v4; what "
        'changed: "Interface versions" in the plugin authors\' guide)'
    )


# -- the v1 attention backend ----------------------------------------------------------------------


class TestAttentionV1(AttentionBackendContract):
    """Today's attention contract: every plain case passes; the attention kinds and bidirectional
    attention are skipped as the engine refuses them, with the reason."""

    backend_name = "naive-v1"


SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float32, block_size=8)
ASKED = {**KINDS, "bidirectional": dict(causal=False)}
LABELS = {  # what each kind asks, and the interface version that made the last of it part of the contract
    "window": ("sliding window", 4),
    "softcap": ("logit soft-capping", 4),
    "scale": ("query scale", 4),
    "window-softcap-scale": ("sliding window, logit soft-capping, query scale", 4),
    "bidirectional": ("bidirectional attention", 4),
    "window-sinks": ("sliding window, attention sinks", 6),
}


@pytest.mark.parametrize("kind", sorted(ASKED))
def test_a_spec_v1_did_not_promise_is_refused_with_the_reason_and_would_attend_wrongly(kind):
    spec = attrs.evolve(SPEC, **ASKED[kind])
    _, reasons = backend_reasons(NaiveAttention, 1, spec, CpuPlatform())
    label, since = LABELS[kind]
    assert reasons == [f"built for interface v1: cannot serve {label} (part of the contract since v{since})"]
    backend = NaiveAttention(spec, CpuPlatform())
    if spec.sinks:  # its forward does not even take the sink logits
        with pytest.raises(TypeError, match="sinks"):
            run_two_calls(backend, spec, BATCHES["mixed"], num_blocks=64)
        return
    out, expected = run_two_calls(backend, spec, BATCHES["mixed"], num_blocks=64)[-1]
    assert not torch.allclose(out.double(), expected, atol=1e-3), "handed anyway, it would attend wrongly"


def test_the_default_query_scale_is_dropped_for_it_exactly():
    spec = attrs.evolve(SPEC, query_scale=SPEC.head_dim**-0.5)
    handed, reasons = backend_reasons(NaiveAttention, 1, spec, CpuPlatform())
    assert reasons == [] and handed.query_scale is None and handed.scale == spec.scale
    assert backend_reasons(NaiveAttention, 4, spec, CpuPlatform())[0] is spec  # a v4 backend gets it as it is


class PlainLlamaExamples(LlamaForCausalLM):
    """The llama plugin's example checkpoints that attend plainly (no sliding window)."""

    @classmethod
    def example_configs(cls):
        configs = super().example_configs()
        return {key: kwargs for key, kwargs in configs.items() if not kwargs.get("sliding_window")}


class TestLlamaOnAttentionV1(ModelContract):
    """Today's model contract for the llama plugin with the v1 backend named: it passes."""

    model_class = "tests.test_old_plugins:PlainLlamaExamples"
    attention_backend = "naive-v1"
    platform = "cpu"
    new_tokens = 6


def test_a_sliding_window_mistral_with_the_v1_backend_named_is_refused_with_the_reason(tmp_path):
    kwargs = LlamaForCausalLM.example_configs()["MistralForCausalLM-sliding-window"]
    reference.tiny_checkpoint(str(tmp_path), "MistralForCausalLM", kwargs)
    refusal = (
        "attention backend 'naive-v1' cannot run here: built for interface v1: cannot serve sliding "
        "window (part of the contract since v4)"
    )
    with pytest.raises(RuntimeError) as error:
        LLM(str(tmp_path), dtype="float32", attention_backend="naive-v1", num_blocks=32, max_model_len=128)
    assert str(error.value) == refusal


class GemmaExamples(GemmaForCausalLM):
    """Gemma 2 (every layer soft-capped, every other one sliding) and a Gemma 3 whose query scale
    is the default (``query_pre_attn_scalar`` = head_dim), as the released models have it."""

    @classmethod
    def example_configs(cls):
        configs = super().example_configs()
        return {
            "Gemma2ForCausalLM": configs["Gemma2ForCausalLM"],
            "Gemma3ForCausalLM": {**configs["Gemma3ForCausalLM"], "query_pre_attn_scalar": 16},
        }


class TestGemmaOnAPlatformPreferringV1(ModelContract):
    """Today's model contract on a platform that tries the v1 backend first: Gemma's output is
    right because the v1 backend is never chosen for a layer it cannot serve."""

    model_class = "tests.test_old_plugins:GemmaExamples"
    platform = "cpu-prefers-v1"
    long_prompt_lengths = (40,)
    new_tokens = 6


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(folder, transformers model) per example: tiny random checkpoints saved with transformers."""
    out = {}
    for key, kwargs in GemmaExamples.example_configs().items():
        folder = str(tmp_path_factory.mktemp(key))
        out[key] = folder, reference.tiny_checkpoint(folder, key, kwargs)
    return out


def layer_backends(folder: str, name: str | None = None) -> list[str]:
    registry, platform = load_plugins(), PrefersV1()
    loader, _ = setup.select_loader(registry, folder, None)
    model = setup.build_model(registry, loader, loader.hf_config(), torch.float32, platform, None)
    layers = setup.layer_attention(registry, name, model, torch.float32, 8, platform)
    return [layers.backends[b].name for b in layers.layer_backend]


def test_a_v1_backend_is_not_chosen_for_gemma_2s_soft_capped_and_sliding_window_layers(gemma):
    folder, _ = gemma["Gemma2ForCausalLM"]
    assert layer_backends(folder) == ["torch"] * 4
    with pytest.raises(RuntimeError) as error:
        layer_backends(folder, "naive-v1")
    assert str(error.value) == (
        "layers 0, 2 (sliding window 16, soft-cap 5.0, query scale 0.2041): attention backend "
        "'naive-v1' cannot run here: built for interface v1: cannot serve sliding window, logit "
        "soft-capping, query scale (part of the contract since v4)"
    )


def test_gemma_3s_global_layers_may_take_the_v1_backend_its_sliding_ones_never(gemma):
    assert layer_backends(gemma["Gemma3ForCausalLM"][0]) == ["torch", "torch", "naive-v1"]


@pytest.mark.parametrize("key", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_greedy_gemma_on_a_platform_preferring_v1_matches_transformers(gemma, key):
    """The engine as users run it, prompts longer than the window, chunked prefill."""
    folder, hf_model = gemma[key]
    llm = LLM(
        folder,
        dtype="float32",
        device="cpu-prefers-v1",
        num_blocks=64,
        block_size=8,
        max_model_len=128,
        max_num_batched_tokens=24,
    )
    prompts = reference.random_prompts(hf_model.config.vocab_size, [5, 40, 57], seed=1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == reference.hf_greedy(hf_model, prompts, 8)


# -- the v1 model and the v1 KV connector ------------------------------------------------------------


def test_the_v1_model_could_not_have_run_its_release_1_layers_are_gone():
    with pytest.raises(ImportError, match="silu_and_mul"):
        __import__("tests.old_plugins.models_v1.model")


def test_a_checkpoint_only_the_v1_model_serves_is_refused_with_the_reason(tiny_llama):
    allow = [name for name in load_plugins().plugins if name not in ("builtin", "models-llama")]
    with pytest.raises(ValueError) as error:
        LLM(tiny_llama[0], dtype="float32", num_blocks=32, max_model_len=128, plugins=allow)
    assert str(error.value) == (
        "model: model 'LlamaForCausalLM' cannot be used: plugin 'old-models-v1' ((in-process) -) was "
        "refused: built for models interface v1, this core provides v6 (it loads v2, v3, v4, v5, v6; what "
        'changed: "Interface versions" in the plugin authors\' guide)'
    )


def test_naming_the_v1_kv_connector_says_it_was_refused(tiny_llama):
    with pytest.raises(
        ValueError,
        match=r"^kv connector 'memory-v1' cannot be used: plugin "
        r"'old-kvconnectors-v1' \(\(in-process\) -\) was refused: built for "
        r"kv_connectors interface v1",
    ):
        LLM(tiny_llama[0], dtype="float32", num_blocks=32, max_model_len=128, kv_connector="memory-v1")


# -- the v1 grammar backend --------------------------------------------------------------------------


def test_the_v1_grammar_backend_is_refused_and_naming_it_says_so(tiny_llama):
    """It fails today's grammar contract (no EOS, terminated as soon as a choice is spelled, so
    "deep blue sea" is cut to "deep"): refused whole, never run."""
    assert load_plugins().plugins["old-grammar-v1"].status == (
        "refused: built for grammar_backends interface v1, this core provides v3 (it loads v2, v3; what "
        'changed: "Interface versions" in the plugin authors\' guide)'
    )
    with pytest.raises(
        ValueError,
        match=r"^grammar backend 'choice-v1' cannot be used: plugin "
        r"'old-grammar-v1' \(\(in-process\) -\) was refused",
    ):
        LLM(
            tiny_llama[0],
            dtype="float32",
            num_blocks=32,
            max_model_len=128,
            structured_outputs_backend="choice-v1",
        )


# -- a deprecated version: the v2 scheduler ----------------------------------------------------------

V2_WARNING = (
    "plugin 'old-scheduler-v2' ((in-process) -): scheduler 'old-fcfs' is built for schedulers interface "
    'v2, deprecated: release 3 stops loading it (this core provides v3; how to port: "Interface '
    "versions\" in the plugin authors' guide)"
)


def deprecation_warnings(caplog) -> list[str]:
    return [r.message for r in caplog.records if r.name == "engine.plugins" and "deprecated" in r.message]


@pytest.fixture
def scheduler_v2_added(monkeypatch):
    """The frozen v2 scheduler as an in-process plugin, and no registry cached yet: the next load
    registers it (and logs)."""
    monkeypatch.setitem(plugins._local, "old-scheduler-v2", scheduler_v2)
    monkeypatch.setattr(plugins, "_loaded", {})


def test_every_deprecated_version_still_loads_and_is_not_the_current_one():
    for kind, versions in DEPRECATED.items():
        for version, release in versions.items():
            assert version in STILL_LOADED[kind] and version != INTERFACE_VERSIONS[kind], (kind, version)
            assert release.startswith("release "), release


def test_a_v2_scheduler_runs_and_its_registration_warns_in_one_line_which_release_drops_it(
    scheduler_v2_added, caplog, tiny_llama
):
    with caplog.at_level(logging.WARNING, logger="engine.plugins"):
        llm = LLM(tiny_llama[0], dtype="float32", num_blocks=64, block_size=16, scheduler="old-fcfs")
    try:
        outs = llm.generate([[1, 5, 9, 13]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert type(llm.engine.lifecycle).__name__ == "SchedulerV2Lifecycle"
        assert len(outs[0].outputs[0].token_ids) == 4
    finally:
        llm.engine.shutdown()
    assert deprecation_warnings(caplog) == [V2_WARNING]


def test_engine_plugins_marks_a_deprecated_registration(scheduler_v2_added, capsys):
    assert PluginsCommand().run(argparse.Namespace(plugins=["old-scheduler-v2"])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "    scheduler: old-fcfs  (interface v2 of v3; deprecated: release 3 stops loading it)" in lines
    assert "    scheduler: default" in lines


def test_an_older_version_not_deprecated_logs_and_shows_no_deprecation(caplog, capsys):
    """The v1 attention backend still loads and is in no release of warnings; the current
    versions never are."""
    with caplog.at_level(logging.WARNING, logger="engine.plugins"):
        registry = plugins.PluginRegistry(["old-attention-v1"])
    assert registry.registration("attention_backends", "naive-v1").dropped_in is None
    assert deprecation_warnings(caplog) == []
    assert PluginsCommand().run(argparse.Namespace(plugins=["old-attention-v1"])) == 0
    assert "deprecated" not in capsys.readouterr().out


def test_the_table_alone_decides_which_versions_warn(monkeypatch, caplog):
    """Any kind's loaded version put in ``DEPRECATED`` warns: here the v1 attention backend."""
    monkeypatch.setitem(DEPRECATED, "attention_backends", {1: "release 9"})
    with caplog.at_level(logging.WARNING, logger="engine.plugins"):
        plugins.PluginRegistry(["old-attention-v1"])
    [warning] = deprecation_warnings(caplog)
    assert warning.startswith(
        "plugin 'old-attention-v1' ((in-process) -): attention backend 'naive-v1' is built for "
        "attention_backends interface v1, deprecated: release 9 stops loading it"
    )
