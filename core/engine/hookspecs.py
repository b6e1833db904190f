"""The whole plugin contract: one hook per extension kind.

Every hook receives a ``register`` callable. Call it once per thing your plugin
provides::

    register(name, "my_package.module:MyClass", api=1)

* ``name`` is what users select (``--attention-backend torch``, ``architectures``
  in ``config.json`` for models, ``--quantization int8`` ...).
* the target is a ``"module:attribute"`` string (imported only when selected, so a
  heavy kernel library costs nothing until used) or the object itself.
* ``api`` is the interface version of that kind your plugin was written against
  (``engine.INTERFACE_VERSIONS``). A plugin that registers anything for another
  version is refused as a whole, with one line naming it, its version and the
  core's; the other plugins still load.

Implement hooks with ``engine.hookimpl`` in the module your entry point names
(group ``engine.plugins``)::

    [project.entry-points."engine.plugins"]
    attention-mykernel = "engine_attention_mykernel"

The core's own defaults (scheduler, KV cache manager, cpu/cuda platforms,
safetensors loader, unquantized linear method) register through these same hooks
from ``engine.builtin``.
"""

import pluggy

hookspec = pluggy.HookspecMarker("engine")
hookimpl = pluggy.HookimplMarker("engine")


class EngineHookSpecs:
    @hookspec
    def register_platforms(self, register):
        """Register :class:`engine.interfaces.Platform` subclasses (``cpu``, ``cuda``, a vendor's
        device). The first registered platform whose ``unavailable_reasons()`` is empty and
        that has the highest ``priority`` runs the engine unless ``--device`` names one."""

    @hookspec
    def register_attention_backends(self, register):
        """Register :class:`engine.interfaces.AttentionBackend` subclasses. Selection walks the
        platform's ``preferred_attention_backends`` then every other backend, and takes the
        first whose ``supports(spec, platform)`` returns no reasons."""

    @hookspec
    def register_models(self, register):
        """Register :class:`engine.interfaces.Model` subclasses under the Hugging Face
        architecture name they serve (``"LlamaForCausalLM"``). One class may be registered
        under several names."""

    @hookspec
    def register_model_loaders(self, register):
        """Register :class:`engine.interfaces.ModelLoader` subclasses: checkpoint formats
        (HF safetensors folder, GGUF file ...). The first loader whose ``detect(path)``
        returns no reasons loads the model unless ``load_format`` names one."""

    @hookspec
    def register_quant_methods(self, register):
        """Register :class:`engine.interfaces.QuantMethod` subclasses under the name a
        checkpoint's ``quantization_config.quant_method`` uses, or that ``--quantization``
        selects for online quantization."""

    @hookspec
    def register_kv_connectors(self, register):
        """Register :class:`engine.interfaces.KVConnector` subclasses (host offload, P/D
        transfer ...), selected with ``kv_connector=NAME``."""

    @hookspec
    def register_grammar_backends(self, register):
        """Register :class:`engine.interfaces.GrammarBackend` subclasses for structured
        outputs, selected with ``structured_outputs_backend=NAME``."""

    @hookspec
    def register_drafters(self, register):
        """Register :class:`engine.interfaces.Drafter` subclasses for speculative decoding,
        selected by ``speculative_config={"method": NAME, ...}``."""

    @hookspec
    def register_logits_processors(self, register):
        """Register :class:`engine.interfaces.LogitsProcessor` subclasses, enabled per engine
        with ``logits_processors=[NAME, ...]``."""

    @hookspec
    def register_schedulers(self, register):
        """Register :class:`engine.interfaces.Scheduler` subclasses (``scheduler_cls=NAME``)."""

    @hookspec
    def register_kv_cache_managers(self, register):
        """Register :class:`engine.interfaces.KVCacheManager` subclasses
        (``kv_cache_manager=NAME``)."""

    @hookspec
    def register_tool_parsers(self, register):
        """Register :class:`engine.interfaces.ToolParser` subclasses (server side): the
        model's tool-call format for ``tool_choice="auto"``, chosen with
        ``engine serve --tool-call-parser NAME``."""

    @hookspec
    def register_reasoning_parsers(self, register):
        """Register :class:`engine.interfaces.ReasoningParser` subclasses (server side): how a
        reasoning model marks its reasoning, split into ``reasoning_content``, chosen with
        ``engine serve --reasoning-parser NAME``."""

    @hookspec
    def register_commands(self, register):
        """Register ``engine`` CLI subcommands: :class:`engine.cli.Command` subclasses under
        the subcommand name (``serve``, ``bench`` ...)."""
