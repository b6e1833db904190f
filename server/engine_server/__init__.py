"""tessellm-server: the OpenAI-compatible front end, registered as CLI commands."""

from engine import hookimpl


@hookimpl
def register_commands(register):
    register("serve", "engine_server.serve:ServeCommand", api=1)
    register("bench", "engine_server.bench:BenchCommand", api=1)
    register("proxy", "engine_server.pd_proxy:ProxyCommand", api=1)


@hookimpl
def register_tool_parsers(register):
    register("hermes", "engine_server.tools:HermesToolParser", api=2)
    register("llama3_json", "engine_server.tool_parsers:Llama3JsonToolParser", api=2)
    register("mistral", "engine_server.tool_parsers:MistralToolParser", api=2)
    register("pythonic", "engine_server.tool_parsers:PythonicToolParser", api=2)
    register("openai", "engine_server.harmony_parsers:HarmonyToolParser", api=2)


@hookimpl
def register_reasoning_parsers(register):
    register("deepseek_r1", "engine_server.reasoning:DeepSeekR1ReasoningParser", api=2)
    register("qwen3", "engine_server.reasoning:Qwen3ReasoningParser", api=2)
    register("openai_gptoss", "engine_server.harmony_parsers:HarmonyReasoningParser", api=2)
