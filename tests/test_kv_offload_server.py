"""`engine serve --kv-transfer-config` with the offload connector, through the official client:
a prefix the small pool evicted comes back from the CPU tier, the reply's
usage.prompt_tokens_details.cached_tokens counts it (completions and chat), /metrics counts the
external hits and bytes, and the greedy reply equals the one that computed the prefix."""

import json

import pytest

from engine.testing import reference
from tests.serving import serve

TRANSFER = {
    "kv_connector": "offload",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes": 1 << 24},
}


@pytest.mark.slow
def test_offloaded_prefix_is_cached_tokens_and_metrics(tiny_llama):
    shared, *others = reference.random_prompts(
        tiny_llama[1].config.vocab_size, [64, 120, 120, 120, 5], seed=9
    )
    with serve(
        tiny_llama[0],
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--num-blocks",
        "26",
        "--block-size",
        "8",
        "--max-model-len",
        "192",
        "--max-num-seqs",
        "2",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        json.dumps(TRANSFER),
    ) as server:
        client = server.openai()

        def complete(prompt):
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)

        first = complete(shared + others[3])
        for filler in others[:3]:  # they take the whole pool: the shared prefix is evicted
            complete(filler)
        again = complete(shared + others[3])
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == 64
        assert again.choices[0].text == first.choices[0].text
        assert server.wait_for_metric("vllm:external_prefix_cache_hits_total", lambda v: v == 64) == 64
        assert server.metric("vllm:kv_connector_load_bytes_total") > 0
        assert server.metric("vllm:prefix_cache_hits_total") == 0

        messages = [{"role": "user", "content": " ".join(f"item {i}" for i in range(40))}]
        chat = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)]
        for filler in others[:2]:
            complete(filler)
        chat.append(
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        )
        prompt_blocks = (chat[1].usage.prompt_tokens - 1) // 8 * 8
        assert chat[0].usage.prompt_tokens_details.cached_tokens == 0
        assert chat[1].usage.prompt_tokens_details.cached_tokens == prompt_blocks > 64
        assert chat[1].choices[0].message.content == chat[0].choices[0].message.content
