"""The ``engine`` command. Subcommands are registered through the ``register_commands``
hook — the built-ins (``plugins``, ``generate``) the same way as a plugin's (``serve``)."""

from __future__ import annotations

import argparse
import logging
import sys
from abc import ABC, abstractmethod

from engine.config import AUTO_QUEUE
from engine.entrypoints.cli_args import (
    ArgumentParser,
    add_engine_arguments,
    engine_options,
    expand_config_files,
    parse_count,
    parse_size,
)
from engine.interfaces.model import FALLBACK_ARCHITECTURE
from engine.plugins import RegistrationError, kind_label, load_plugins, one_line

# AUTO_QUEUE: a front end's default max_queued_requests; parse_count / parse_size: its own flags' units
__all__ = [
    "AUTO_QUEUE",
    "Command",
    "add_engine_arguments",
    "engine_options",
    "main",
    "parse_count",
    "parse_size",
]

# kinds whose default, when the user names none, is the registry's rule (PluginRegistry.default)
DEFAULTED_KINDS = ("grammar_backends",)


class Command(ABC):
    help: str = ""

    @abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    @abstractmethod
    def run(self, args: argparse.Namespace) -> int: ...


class PluginsCommand(Command):
    help = "list installed plugins, what they register, and whether it can run here"

    def add_arguments(self, parser):
        parser.add_argument("--model", help="also say which model implementation would serve this checkpoint")
        parser.add_argument(
            "--model-impl",
            default="auto",
            choices=("auto", "native", "vllm", "transformers"),
            help="as for serve: which implementation --model's line considers",
        )

    def run(self, args) -> int:
        """One line per plugin (refused and failed ones say why; a distribution refused for an
        entry-point name already taken follows the one that has it), then one per registration:
        whether it runs here, the interface version it was built for where older than the core's,
        and which of two registrations of one name wins and why. With ``--model``, a last line
        says which implementation serves it (a native plugin or the transformers fallback) or why
        none can. A broken plugin is reported here, never an error: the command exits 0."""
        from engine.core.setup import select_platform

        registry = load_plugins(args.plugins)
        try:
            platform = select_platform(registry, None)
        except RuntimeError as exc:
            print(f"engine plugins: {exc}", file=sys.stderr)
            platform = None
        for name, info in registry.plugins.items():
            print(info.describe())
            for reg in registry.registered_by(name):
                print(
                    f"    {kind_label(reg.kind)}: {reg.name}{_runnable(reg, platform)}{_version_note(reg)}"
                    f"{_precedence_note(registry, reg)}"
                )
            for duplicate in (d for d in registry.duplicates if d.name == name):
                print(duplicate.describe())
        model = getattr(args, "model", None)  # a caller building its own Namespace may leave it out
        if model:
            impl = _model_implementation(registry, model, getattr(args, "model_impl", "auto"))
            print(f"model {model}: {impl}")
            for note in _cache_notes(registry, model, getattr(args, "model_impl", "auto")):
                print(f"model {model}: {note}")
        return 0


def _model_implementation(registry, model: str, model_impl: str) -> str:
    """Which model class would serve ``model`` under ``model_impl``, in words, or why none can
    (read from its config: no weights are loaded)."""
    from engine.config import ModelConfig
    from engine.core.setup import choose_model_class, select_loader

    try:
        loader, _ = select_loader(registry, model, None)
        return choose_model_class(
            registry, loader.hf_config(), ModelConfig(model_impl=model_impl).model_impl
        )[1]
    except (ValueError, RegistrationError) as exc:
        return f"cannot be served: {exc}"


def _cache_notes(registry, model: str, model_impl: str) -> list[str]:
    """What the model's cache layout turns off, and why (a model with Mamba layers runs
    without prefix caching), from its start-up plan (built on the meta device); none where the
    plan cannot be made (the line above says why it cannot be served)."""
    from engine.config import EngineConfig
    from engine.core import setup, startup

    try:
        report = startup.plan(EngineConfig.from_kwargs(model=model, model_impl=model_impl), registry)
    except Exception:  # noqa: BLE001 - the implementation line already reports a model it cannot serve
        return []
    return [note for note in report.notes if note == setup.STATE_NO_PREFIX_CACHING]


def _version_note(registration) -> str:
    """For a registration built for an older interface version than the core's: which, what
    the engine therefore never hands it (attention kinds a v1-v3 backend never knew), and the
    release that stops loading it where that version is deprecated."""
    from engine.interfaces import INTERFACE_VERSIONS, attention

    current = INTERFACE_VERSIONS[registration.kind]
    if registration.api == current:
        return ""
    unknown = attention.unknown_to(registration.api) if registration.kind == "attention_backends" else []
    never = f": never handed {', '.join(label for label, _ in unknown)}" if unknown else ""
    dropped = f"; deprecated: {registration.dropped_in} stops loading it" if registration.dropped_in else ""
    return f"  (interface v{registration.api} of v{current}{never}{dropped})"


def _precedence_note(registry, registration) -> str:
    note = registry.precedence(registration)
    if registration.kind == "models" and registration.name == FALLBACK_ARCHITECTURE:
        fallback = (
            "the fallback: any architecture no model plugin claims; every one with --model-impl transformers"
        )
        note = "; ".join(filter(None, [fallback, note]))
    if (
        registration.kind in DEFAULTED_KINDS
        and registry.default(registration.kind) == registration.name
        and registry.shadowing(registration) is None
    ):
        note = "; ".join(filter(None, ["default (highest priority, then the first name)", note]))
    if registration.kind == "grammar_backends" and registry.shadowing(registration) is None:
        note = "; ".join(filter(None, [note, _auto_place(registry, registration)]))
    return f"  [{note}]" if note else ""


def _auto_place(registry, registration) -> str:
    """Where ``--structured-outputs-backend auto`` tries this grammar backend (by priority)."""
    order = registry.by_preference("grammar_backends")
    return f"auto tries it {order.index(registration.name) + 1} of {len(order)}"


def _runnable(registration, platform) -> str:
    """Whether ``registration`` imports and, for the kinds with a capability check, can run
    on ``platform``. A check that raises is reported on the line, not fatal."""
    try:
        return _capability(registration.kind, registration.load(), platform)
    except RegistrationError as exc:
        return f"  [cannot run here: {exc.reason}]"
    except Exception as exc:  # noqa: BLE001 - any error in the plugin's own check
        return f"  [cannot run here: its check raised {one_line(exc)}]"


def _capability(kind: str, cls, platform) -> str:
    if platform is None and kind in ("attention_backends", "quant_methods"):
        return "  [cannot run here: no platform is available]"
    if kind == "platforms":
        reasons = cls.unavailable_reasons()
    elif kind == "quant_methods":
        reasons = cls.supports(platform)
        path = "; ".join(filter(None, [cls.describe(platform), _experts_note(cls)]))
        if path and not reasons:
            return f"  [runs here: {path}]"
    elif kind == "attention_backends":
        spec = _probe_spec()
        reasons = cls.supports(spec, platform)
        path = cls.describe(spec, platform)
        if path and not reasons:
            return f"  [runs here: {path}]"
    else:
        return ""
    return "  [runs here]" if not reasons else f"  [cannot run here: {'; '.join(reasons)}]"


def _experts_note(method_cls) -> str:
    """What tensor parallelism does with the experts a method stores (or leaves unquantized);
    nothing for a method tensor parallelism refuses outright."""
    from engine.layers.moe import expert_split_note
    from engine.layers.unquantized import UnquantizedLinearMethod

    if not method_cls.shards_for_tensor_parallel:
        return ""
    return expert_split_note(method_cls if method_cls.quantizes_experts else UnquantizedLinearMethod)


def _probe_spec():
    import torch

    from engine.interfaces import AttentionSpec

    return AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16)


class GenerateCommand(Command):
    help = "generate from one prompt, streaming text to the terminal"

    def add_arguments(self, parser):
        parser.add_argument("--prompt", required=True)
        parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
        parser.add_argument("--max-tokens", type=int, default=128)
        parser.add_argument("--temperature", type=float, default=0.0)
        parser.add_argument("--top-p", type=float, default=1.0)
        parser.add_argument("--top-k", type=int, default=0)
        add_engine_arguments(parser)

    def run(self, args) -> int:
        from engine.entrypoints.llm import LLM
        from engine.messages.sampling_params import SamplingParams

        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )  # --seed seeds the engine and this request
        llm = LLM(plugins=args.plugins, **engine_options(args))
        ids = (
            llm.apply_chat_template([{"role": "user", "content": args.prompt}])
            if args.chat
            else llm.tokenizer.encode(args.prompt)
        )
        for piece in llm.stream({"prompt": args.prompt, "prompt_token_ids": ids}, params):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0


PLUGINS_HELP = "comma-separated allow-list of plugins (default: all installed)"


def _plugin_names(text: str) -> list[str]:
    return [p for p in text.split(",") if p]


def build_parser(registry) -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="engine", description="LLM inference engine (tessellm)")
    parser.add_argument("--plugins", type=_plugin_names, default=None, help=PLUGINS_HELP)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    for registration in registry.registrations("commands"):
        try:
            command = registration.load()()
        except Exception as exc:  # noqa: BLE001 - one broken plugin command must not take the CLI down
            print(
                f"engine: command {registration.name!r} from plugin {registration.plugin!r} "
                f"failed to load: {exc!r}",
                file=sys.stderr,
            )
            continue
        command_parser = sub.add_parser(registration.name, help=command.help)
        # after the command too (`engine serve --plugins ...`); SUPPRESS keeps one given before it
        command_parser.add_argument(
            "--plugins", type=_plugin_names, default=argparse.SUPPRESS, help=PLUGINS_HELP
        )
        command.add_arguments(command_parser)
        command_parser.set_defaults(handler=command)
    return parser


def _pre_parse_plugins(argv: list[str]) -> list[str] | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--plugins", type=_plugin_names, default=None)
    known, _ = pre.parse_known_args(argv)
    return known.plugins


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        argv = expand_config_files(argv)
        registry = load_plugins(_pre_parse_plugins(argv))
    except ValueError as exc:
        print(f"engine: {exc}", file=sys.stderr)
        return 2
    args = build_parser(registry).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler.run(args)
    except (ValueError, RuntimeError) as exc:
        print(f"engine {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
