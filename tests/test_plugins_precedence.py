"""Collisions and precedence: two distributions with one entry-point name (the second refused in
one line, everything else loads, `engine plugins` exits 0), two plugins registering one name of a
kind (a deterministic winner by priority, then installed over built-in, then plugin name; one
warning naming both; the other selectable as "<plugin>:<name>"), the default grammar backend by
rule, and naming something a refused plugin registers: an error that says refused and why."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import types

import pytest
from transformers import LlamaConfig

from engine import hookimpl, plugins
from engine.core import setup
from engine.entrypoints.cli import PluginsCommand
from engine.interfaces import INTERFACE_VERSIONS, GrammarBackend, Model, Scheduler
from engine.plugins import PluginRegistry
from tests.plugin_packages import environ_with, write_distribution
from tests.test_plugins import run_engine

ACME_QWEN3 = """
    from engine import hookimpl

    @hookimpl
    def register_models(register):
        register("Qwen3ForCausalLM", "engine_models_qwen3.model:Qwen3ForCausalLM", api={api})
    """.format(api=INTERFACE_VERSIONS["models"])


def in_process(monkeypatch, **named_plugins) -> PluginRegistry:
    """A fresh registry of builtin and these in-process plugins (name -> object with hooks),
    forgotten after the test."""
    for name, plugin in named_plugins.items():
        monkeypatch.setitem(plugins._local, name.replace("_", "-"), plugin)
    return PluginRegistry([name.replace("_", "-") for name in named_plugins])


def registering(kind: str, *registrations):
    """A plugin whose ``register_<kind>`` makes these ``(name, target, keyword arguments)`` calls."""

    def hook(register):
        for name, target, options in registrations:
            register(name, target, **options)

    return types.SimpleNamespace(**{f"register_{kind}": hookimpl(hook)})


class ModelA(Model):
    architectures = ("LlamaForCausalLM",)


class ModelB(ModelA):
    pass


def model_plugin(cls, **options):
    return registering("models", ("LlamaForCausalLM", cls, {"api": INTERFACE_VERSIONS["models"], **options}))


# -- two distributions, one entry-point name -----------------------------------------------------


def test_a_second_distribution_of_a_taken_entry_point_name_is_refused_the_rest_load(
    tmp_path, monkeypatch, caplog
):
    """An outside author's ``models-qwen3`` installed after ours (later on sys.path): ours keeps
    the name, theirs is refused in one line before its module is imported, all else loads."""
    write_distribution(tmp_path, "acme-models-qwen3", "models-qwen3", "acme_models_qwen3", ACME_QWEN3)
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    with caplog.at_level(logging.WARNING, logger="engine.plugins"):
        registry = PluginRegistry()
    ours = registry.plugins["models-qwen3"]
    assert ours.describe() == "models-qwen3  (tessellm-models-qwen3 0.1.0)  loaded"
    [refused] = registry.duplicates
    reason = (
        "entry-point name 'models-qwen3' is taken by tessellm-models-qwen3 0.1.0 (the first on "
        "sys.path, then by distribution name; give the entry point a name of your own)"
    )
    assert refused.describe() == f"models-qwen3  (acme-models-qwen3 9.0.0)  refused: {reason}"
    assert "acme_models_qwen3" not in sys.modules
    assert [r.message for r in caplog.records if "acme" in r.message] == [
        f"plugin 'models-qwen3' (acme-models-qwen3 9.0.0) refused: {reason}"
    ]
    assert all(info.loaded for name, info in registry.plugins.items() if not name.startswith("test-")), [
        info.describe() for info in registry.plugins.values()
    ]
    assert registry.registration("models", "Qwen3ForCausalLM").plugin == "models-qwen3"


def test_in_one_folder_the_first_distribution_by_name_keeps_the_entry_point_name(tmp_path, monkeypatch):
    source = """
        from engine import hookimpl

        @hookimpl
        def register_schedulers(register):
            register("{name}", "engine.builtin.scheduler:DefaultScheduler", api={api})
        """
    api = INTERFACE_VERSIONS["schedulers"]
    for distribution in ("zeta-schedulers", "alpha-schedulers"):
        package = distribution.replace("-", "_")
        write_distribution(
            tmp_path, distribution, "schedulers-twin", package, source.format(name=package, api=api)
        )
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    registry = PluginRegistry(["schedulers-twin"])
    assert registry.plugins["schedulers-twin"].distribution == "alpha-schedulers"
    assert [d.distribution for d in registry.duplicates] == ["zeta-schedulers"]
    assert registry.names("schedulers") == ["default", "alpha_schedulers"]


GENERATE = """
import sys
from engine import LLM, SamplingParams

llm = LLM(sys.argv[1], dtype="float32", num_blocks=32, max_model_len=128)
print(llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids)
"""


def test_engine_plugins_and_the_engine_work_beside_a_duplicate_entry_point_name(tmp_path, tiny_llama):
    """The regression of issue 31: a duplicate name made ``engine plugins`` exit 1 with a KeyError
    and every ``LLM()`` fail. On PYTHONPATH the outside distribution comes first and keeps it."""
    write_distribution(tmp_path, "acme-models-qwen3", "models-qwen3", "acme_models_qwen3", ACME_QWEN3)
    result = run_engine("plugins", site=tmp_path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    lines = result.stdout.splitlines()
    first, second = (lines.index(line) for line in lines if line.startswith("models-qwen3  ("))
    assert lines[first] == "models-qwen3  (acme-models-qwen3 9.0.0)  loaded"
    assert lines[second] == (
        "models-qwen3  (tessellm-models-qwen3 0.1.0)  refused: entry-point name "
        "'models-qwen3' is taken by acme-models-qwen3 9.0.0 (the first on sys.path, "
        "then by distribution name; give the entry point a name of your own)"
    )
    assert second == first + 2 and lines[first + 1] == "    model: Qwen3ForCausalLM"
    assert sum("tessellm-models-qwen3" in line for line in result.stderr.splitlines()) == 1, result.stderr
    run = subprocess.run(
        [sys.executable, "-c", GENERATE, tiny_llama[0]],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=environ_with(tmp_path),
    )
    assert run.returncode == 0, run.stderr


# -- two registrations of one name ---------------------------------------------------------------


def test_two_plugins_serving_one_architecture_resolve_by_plugin_name_with_one_warning(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="engine.plugins"):
        registry = in_process(monkeypatch, models_zzz=model_plugin(ModelB), models_aaa=model_plugin(ModelA))
    config = LlamaConfig(architectures=["LlamaForCausalLM"])
    assert setup.select_model_class(registry, config) is ModelA
    [warning] = [r.message for r in caplog.records if "LlamaForCausalLM" in r.message]
    assert warning == (
        "model 'LlamaForCausalLM': plugin 'models-aaa' ((in-process) -) wins over plugin "
        "'models-zzz' ((in-process) -): equal priority 0, and plugin names in order: "
        "'models-aaa' < 'models-zzz'; the other is still selectable as "
        "'models-zzz:LlamaForCausalLM'"
    )
    assert registry.get("models", "models-zzz:LlamaForCausalLM") is ModelB
    assert [r.plugin for r in registry.registrations("models", shadowed=True)] == ["models-aaa", "models-zzz"]
    assert registry.names("models") == ["LlamaForCausalLM"]


def test_a_higher_priority_wins_whatever_the_names(monkeypatch):
    registry = in_process(
        monkeypatch, models_zzz=model_plugin(ModelB, priority=1), models_aaa=model_plugin(ModelA)
    )
    assert setup.select_model_class(registry, LlamaConfig(architectures=["LlamaForCausalLM"])) is ModelB
    loser = registry.registration("models", "models-aaa:LlamaForCausalLM")
    assert registry.precedence(loser) == (
        "shadowed by plugin 'models-zzz' (priority 1 > 0); select it as 'models-aaa:LlamaForCausalLM'"
    )
    assert (
        registry.precedence(registry.registration("models", "LlamaForCausalLM"))
        == "wins over plugin 'models-aaa' (priority 1 > 0)"
    )


class MyScheduler(Scheduler):
    """Never built: only its registration is looked at."""


def test_an_installed_plugin_replaces_a_built_in_of_the_same_name_unless_its_priority_is_lower(monkeypatch):
    api = INTERFACE_VERSIONS["schedulers"]
    mine = registering("schedulers", ("default", MyScheduler, {"api": api}))
    replacing = in_process(monkeypatch, mine=mine)
    assert replacing.get("schedulers", "default") is MyScheduler
    assert (
        replacing.precedence(replacing.registration("schedulers", "default"))
        == "wins over plugin 'builtin' (an installed plugin replaces a built-in of the same name)"
    )
    assert replacing.get("schedulers", "builtin:default").__name__ == "DefaultScheduler"
    yielding = in_process(
        monkeypatch, mine=registering("schedulers", ("default", MyScheduler, {"api": api, "priority": -1}))
    )
    assert yielding.get("schedulers", "default").__name__ == "DefaultScheduler"


def test_a_priority_that_is_not_an_integer_refuses_the_plugin(monkeypatch):
    registry = in_process(monkeypatch, odd=model_plugin(ModelA, priority="high"))
    assert (
        registry.plugins["odd"].status
        == "refused: model 'LlamaForCausalLM': priority 'high' is not an integer"
    )


def test_engine_plugins_says_who_wins_and_why(monkeypatch, capsys):
    registry = in_process(monkeypatch, models_zzz=model_plugin(ModelB), models_aaa=model_plugin(ModelA))
    monkeypatch.setattr(plugins, "_loaded", {frozenset(["models-zzz", "models-aaa"]): registry})
    assert PluginsCommand().run(argparse.Namespace(plugins=["models-zzz", "models-aaa"])) == 0
    lines = capsys.readouterr().out.splitlines()
    why = "equal priority 0, and plugin names in order: 'models-aaa' < 'models-zzz'"
    assert f"    model: LlamaForCausalLM  [wins over plugin 'models-zzz' ({why})]" in lines
    assert (
        f"    model: LlamaForCausalLM  [shadowed by plugin 'models-aaa' ({why}); "
        "select it as 'models-zzz:LlamaForCausalLM']"
    ) in lines


# -- the default grammar backend -----------------------------------------------------------------


class GrammarA(GrammarBackend):
    """Never built."""


def grammar_plugin(name: str, **options):
    return registering(
        "grammar_backends", (name, GrammarA, {"api": INTERFACE_VERSIONS["grammar_backends"], **options})
    )


def test_the_default_grammar_backend_is_chosen_by_rule_not_install_order(monkeypatch, capsys):
    assert in_process(monkeypatch).default("grammar_backends") is None
    tie = in_process(monkeypatch, grammar_b=grammar_plugin("alpha"), grammar_a=grammar_plugin("zeta"))
    assert tie.names("grammar_backends") == ["zeta", "alpha"]  # plugins by entry-point name
    assert tie.default("grammar_backends") == "zeta"
    ranked = in_process(
        monkeypatch, grammar_b=grammar_plugin("alpha", priority=1), grammar_a=grammar_plugin("zeta")
    )
    assert ranked.default("grammar_backends") == "alpha"
    assert ranked.by_preference("grammar_backends") == ["alpha", "zeta"]  # the order auto tries them
    monkeypatch.setattr(plugins, "_loaded", {frozenset(["grammar-b", "grammar-a"]): ranked})
    PluginsCommand().run(argparse.Namespace(plugins=["grammar-b", "grammar-a"]))
    out = capsys.readouterr().out.splitlines()
    assert (
        "    grammar backend: alpha  [default (highest priority, then the first name); auto tries it 1 of 2]"
        in out
    )
    assert "    grammar backend: zeta  [auto tries it 2 of 2]" in out


# -- refused, not absent -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(INTERFACE_VERSIONS))
def test_naming_what_a_refused_plugin_registers_says_it_was_refused_and_why(monkeypatch, kind):
    registry = in_process(monkeypatch, old=registering(kind, ("gone", "pkg.mod:Thing", {"api": 0})))
    provided = INTERFACE_VERSIONS[kind]
    with pytest.raises(ValueError) as error:
        registry.get(kind, "gone")
    assert str(error.value).startswith(
        f"{plugins.kind_label(kind)} 'gone' cannot be used: plugin 'old' ((in-process) -) was refused: "
        f"built for {kind} interface v0, this core provides v{provided} (it loads "
    )
    with pytest.raises(ValueError, match=r"no .* named 'other' \(available: "):
        registry.get(kind, "other")


def test_selection_errors_say_refused(monkeypatch):
    registry = in_process(monkeypatch, old=registering("models", ("LlamaForCausalLM", ModelA, {"api": 1})))
    with pytest.raises(
        ValueError,
        match=r"^model: model 'LlamaForCausalLM' cannot be used: plugin 'old' "
        r"\(\(in-process\) -\) was refused: built for models interface v1",
    ):
        setup.select_model_class(registry, LlamaConfig(architectures=["LlamaForCausalLM"]))


# -- every registration in the conformance run -----------------------------------------------------

SHADOWING_TORCH = """
    from engine import hookimpl

    @hookimpl
    def register_attention_backends(register):
        register("torch", "engine_attention_torch.backend:TorchAttentionBackend", api=4, priority=5)
    """


def test_the_conformance_run_covers_shadowed_registrations(tmp_path):
    write_distribution(tmp_path, "acme-attention", "attention-acme", "acme_attention", SHADOWING_TORCH)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--engine-conformance",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "attention and torch",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=environ_with(tmp_path),
        cwd=tmp_path,
    )
    classes = {line.split("::")[1] for line in result.stdout.splitlines() if "::" in line}
    assert {"Test_attention_torch", "Test_attention_attention_torch_torch"} <= classes, result.stdout[-3000:]
