"""The core's own defaults, registered through the same hooks as any plugin."""

from engine.hookspecs import hookimpl


@hookimpl
def register_platforms(register):
    register("cpu", "engine.builtin.platforms:CpuPlatform", api=3)
    register("cuda", "engine.builtin.platforms:CudaPlatform", api=3)


@hookimpl
def register_schedulers(register):
    register("default", "engine.builtin.scheduler:DefaultScheduler", api=3)


@hookimpl
def register_kv_cache_managers(register):
    register("default", "engine.builtin.kv_cache_manager:PrefixCachingKVCacheManager", api=3)


@hookimpl
def register_model_loaders(register):
    register("safetensors", "engine.builtin.safetensors_loader:SafetensorsLoader", api=3)


@hookimpl
def register_quant_methods(register):
    register("unquantized", "engine.layers.unquantized:UnquantizedLinearMethod", api=3)


@hookimpl
def register_commands(register):
    register("plugins", "engine.entrypoints.cli:PluginsCommand", api=1)
    register("generate", "engine.entrypoints.cli:GenerateCommand", api=1)


@hookimpl
def register_executors(register):
    register("uni", "engine.executors.uniproc:UniprocExecutor", api=3)
    register("mp", "engine.executors.multiproc:MultiprocExecutor", api=3)
