"""The whole plugin contract: one hook per extension kind.

Every hook receives a ``register`` callable. Call it once per thing your plugin
provides::

    register(name, "my_package.module:MyClass", api=1)

* ``name`` is what users select (``--attention-backend torch``, ``architectures``
  in ``config.json`` for models, ``--quantization int8`` ...): a non-empty string without
  spaces or commas.
* the target is a ``"module:Attribute"`` string (imported only when selected, so a heavy
  kernel library costs nothing until used) or the class itself. Either way it must be a
  subclass of the kind's interface (named in each hook below); a class is checked when
  registered, a string when it is imported.
* ``api`` (keyword, required) is the interface version of that kind your plugin was written
  against (``engine.INTERFACE_VERSIONS``). The engine keeps it: a kind's new version is
  whatever a plugin must honour, and the engine never hands a plugin built for an older one
  what it cannot have known (an attention backend registered for v1-v3 is never given a spec
  with a sliding window, soft-capped logits, another query scale or bidirectional attention:
  it is refused for those layers, with the reason, and another backend serves them).
* ``priority`` (keyword, default 0) settles a name two plugins register (two plugins serving
  one architecture, two backends called ``torch``): the higher priority wins; on a tie an
  installed plugin wins over a built-in, then the plugin whose entry-point name sorts first.
  The other stays selectable as ``"<plugin>:<name>"`` (``--attention-backend
  attention-mine:torch``) and through ``--plugins``; the engine logs one warning naming both
  and ``engine plugins`` shows who wins and why. It also ranks a kind's default where the
  user names none (the grammar backend).

A plugin is refused as a whole, with one line naming it, its distribution and version and
the reason, when its module fails to import, a hook raises, or a ``register`` call is
malformed (no ``api=``, another version, a bad name, a target of the wrong kind);
``register`` raises ValueError on a malformed call, and catching it does not save the
plugin. The other plugins still load and ``engine plugins`` lists the refused one. A
function marked ``@hookimpl`` whose name is no hook below (a typo), or a hook-named function
left unmarked, is reported in one line and ignored; the plugin's other hooks load. A second
distribution whose entry point has a name another already took is refused in one line before
its module is imported (the first on ``sys.path`` keeps the name, then the first by
distribution name); naming anything a refused plugin registers is an error saying it was
refused and why, not that it is absent.

A target that fails to import when selected is skipped by automatic selection (logged, and
listed among the reasons if nothing else can run); when the user named it, the engine stops
with one error naming it and the import error.

Implement hooks with ``engine.hookimpl`` in the module your entry point names
(group ``engine.plugins``)::

    [project.entry-points."engine.plugins"]
    attention-mykernel = "engine_attention_mykernel"

The core's own defaults (scheduler, KV cache manager, cpu/cuda platforms,
safetensors loader, unquantized linear method, the ``plugins`` and ``generate`` commands)
register through these same hooks from ``engine.builtin``.
"""

import pluggy

hookspec = pluggy.HookspecMarker("engine")
hookimpl = pluggy.HookimplMarker("engine")


class EngineHookSpecs:
    @hookspec
    def register_platforms(self, register):
        """Register :class:`engine.interfaces.Platform` subclasses (``cpu``, ``cuda``, a vendor's
        device), constructed with no arguments. Unless ``device=NAME`` names one, the engine
        runs on the available platform (``unavailable_reasons()`` empty) with the highest
        ``priority``, the first registered on a tie. Subclass ``engine.builtin.platforms.
        CpuPlatform`` / ``CudaPlatform`` to extend a built-in one."""

    @hookspec
    def register_attention_backends(self, register):
        """Register :class:`engine.interfaces.AttentionBackend` subclasses, constructed as
        ``cls(spec, platform, registry=registry)`` (an :class:`engine.interfaces.AttentionSpec`,
        the platform, and from interface v4 the engine's plugin registry, for a backend that hands
        some batches to another: ``engine.interfaces.attention.build_backend``; backends
        registered for v1-v3 get ``cls(spec, platform)``).
        Unless ``attention_backend=NAME`` names one, selection walks the platform's
        ``preferred_attention_backends`` then every other backend, and takes the first whose
        ``supports(spec, platform)`` returns no reasons (a backend that attends only causally
        returns one for ``spec.causal`` False) — once per attention kind among the model's
        layers (``spec.sliding_window``, ``logit_softcap``, ``query_scale``). Those fields and
        ``causal`` are part of the contract since v4: a backend registered for v1-v3 is never
        handed a spec that sets one (a query scale equal to ``head_dim ** -0.5`` is dropped for
        it, exactly)."""

    @hookspec
    def register_models(self, register):
        """Register :class:`engine.interfaces.Model` subclasses under the Hugging Face
        architecture name they serve (``"LlamaForCausalLM"``), constructed with an
        :class:`engine.interfaces.ModelContext`. One class may be registered under several
        names. The checkpoint's ``architectures`` select it (then transformers' causal-LM
        class for its ``model_type``); build it from ``engine.layers``. Interface v2 is the
        ``engine.layers`` of this release (v1 models, built on release 1's, are refused).
        Layers that attend differently (a sliding window, soft-capped logits) say so in
        ``KVLayout.layer_kinds``; the engine builds one attention backend per kind. The
        pooling runner (embeddings) pools what ``forward`` returns; an encoder without an LM
        head sets ``generative = False``, ``default_pooling_type`` and ``KVLayout(causal=False)``.
        A class registered as ``engine.interfaces.FALLBACK_ARCHITECTURE`` (``"*"``) is a
        fallback: ``model_impl="auto"`` (vLLM's --model-impl) runs it for an architecture no
        other registration claims, ``"transformers"`` for every one, ``"native"`` never; its
        ``supports(hf_config)`` refuses what it cannot run (models-transformers is the one shipped)."""

    @hookspec
    def register_model_loaders(self, register):
        """Register :class:`engine.interfaces.ModelLoader` subclasses: checkpoint formats
        (HF safetensors folder, GGUF file ...), constructed with the model path. The first
        loader whose ``detect(path)`` returns no reasons loads the model unless
        ``load_format=NAME`` names one. Interface v3 (v2 still loads):
        ``iter_weight_slices(hf_config, keep_quantized=...)``."""

    @hookspec
    def register_quant_methods(self, register):
        """Register :class:`engine.interfaces.QuantMethod` subclasses, constructed with an
        :class:`engine.interfaces.QuantContext`, under the name a checkpoint's
        ``quantization_config.quant_method`` uses, or that ``quantization=NAME`` selects for
        online quantization (default: ``unquantized``). Interface v3 (v2 still loads): what
        ``shards_for_tensor_parallel`` promises for packed and kept-quantized weights."""

    @hookspec
    def register_kv_connectors(self, register):
        """Register :class:`engine.interfaces.KVConnector` subclasses (host offload, P/D
        transfer ...), interface v3 (v2 still loads): constructed once per half with a
        :class:`engine.interfaces.KVConnectorContext` and selected with
        ``kv_transfer_config={"kv_connector": NAME, ...}`` (``--kv-transfer-config``) or
        ``kv_connector=NAME``. A P/D connector subclasses :class:`engine.kv_transfer.PDConnector`
        and supplies only its :class:`engine.kv_transfer.Transport`."""

    @hookspec
    def register_grammar_backends(self, register):
        """Register :class:`engine.interfaces.GrammarBackend` subclasses for structured
        outputs, constructed with an :class:`engine.interfaces.GrammarContext` when the first
        structured request arrives, selected with ``structured_outputs_backend=NAME``
        (default: the registration of highest ``priority``, on a tie the first name — built-ins,
        then plugins by entry-point name; ``engine plugins`` marks it), or ``"auto"``: every
        one, each request compiled by the first in that order that accepts it."""

    @hookspec
    def register_drafters(self, register):
        """Register :class:`engine.interfaces.Drafter` subclasses for speculative decoding,
        constructed with an :class:`engine.interfaces.DrafterContext` and selected by
        ``speculative_config={"method": NAME, "num_speculative_tokens": K, ...}``; the whole
        dict is the drafter's ``method_config``."""

    @hookspec
    def register_logits_processors(self, register):
        """Register :class:`engine.interfaces.LogitsProcessor` subclasses, constructed once
        with the :class:`engine.EngineConfig` and enabled per engine with
        ``logits_processors=[NAME, ...]``; ``apply`` gets each sampling request
        (:class:`engine.interfaces.Request`)."""

    @hookspec
    def register_schedulers(self, register):
        """Register :class:`engine.interfaces.Scheduler` subclasses, constructed with an
        :class:`engine.interfaces.SchedulerContext` and selected with ``scheduler=NAME``
        (default: ``default``). Interface v3 is policy only: the core applies each step's
        result, finishes requests and runs the KV connector's protocol; a scheduler admits
        through ``ctx.kv_admission``. One registered with ``api=2`` runs through the core's
        v2 adapter."""

    @hookspec
    def register_kv_cache_managers(self, register):
        """Register :class:`engine.interfaces.KVCacheManager` subclasses, constructed as
        ``cls(config, num_blocks)`` and selected with ``kv_cache_manager=NAME`` (default:
        ``default``). For a model with sliding-window layers the engine passes
        ``groups=`` (:class:`engine.interfaces.KVCacheGroup`) and needs the class to set
        ``supports_groups = True``."""

    @hookspec
    def register_tool_parsers(self, register):
        """Register :class:`engine.interfaces.ToolParser` subclasses (server side),
        constructed with the tokenizer: the model's tool-call format for
        ``tool_choice="auto"``, chosen with ``engine serve --tool-call-parser NAME``."""

    @hookspec
    def register_reasoning_parsers(self, register):
        """Register :class:`engine.interfaces.ReasoningParser` subclasses (server side): how a
        reasoning model marks its reasoning, split into ``reasoning_content``, chosen with
        ``engine serve --reasoning-parser NAME``."""

    @hookspec
    def register_commands(self, register):
        """Register ``engine`` CLI subcommands: :class:`engine.entrypoints.cli.Command` subclasses,
        constructed with no arguments, under the subcommand name (``serve``, ``bench`` ...).
        ``add_arguments(parser)`` adds its flags, ``run(args)`` returns the exit status."""

    @hookspec
    def register_executors(self, register):
        """Register :class:`engine.interfaces.Executor` subclasses, constructed with an
        :class:`engine.interfaces.ExecutorContext` and selected with
        ``distributed_executor_backend=NAME`` (default: ``uni`` for one rank, ``mp`` for
        ``tensor_parallel_size > 1``). Built in: ``uni`` (this process) and ``mp`` (local
        worker processes joined by ``torch.distributed``); ``ray`` is a plugin's name."""

    @hookspec
    def register_lora_resolvers(self, register):
        """Register :class:`engine.interfaces.LoRAResolver` subclasses (server side), constructed
        once per server with an :class:`engine.interfaces.LoRAResolverContext`. With runtime
        adapter loading allowed, a request naming a model the server does not serve asks every
        registered resolver, in registry order (built-ins, then plugins by entry-point name),
        for the adapter's folder; the first answer is loaded and served under that name."""
