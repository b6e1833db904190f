"""models-qwen-vl against the core's multimodal model contract: ``transformers``'
Qwen2_5_VLForConditionalGeneration on a tiny random checkpoint (window and full attention in
the vision tower, variable resolution, M-RoPE's three position axes), for prompts with and
without images, batched, chunked and prefix-cached; M-RoPE's positions against
``get_rope_index``; Qwen2-VL's parity; a chat request with an image over ``engine serve``."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from transformers import AutoConfig

from engine.messages.multimodal import build_processor, expand_placeholders
from engine.testing.multimodal import MultiModalContract, random_image
from engine_models_qwen_vl.model import mrope_positions
from engine_models_qwen_vl.processor import QwenVLImageProcessor
from engine_models_qwen_vl.testing import IMAGE_PLACEHOLDER, save_tiny_qwen_vl
from tests.serving import serve

PLUGINS = ("models-qwen-vl", "attention-torch")


class TestQwen2_5VL(MultiModalContract):
    model_class = "engine_models_qwen_vl.model:QwenVLForConditionalGeneration"
    image_placeholder = IMAGE_PLACEHOLDER
    plugins = PLUGINS

    @classmethod
    def save_checkpoint(cls, folder: str):
        return save_tiny_qwen_vl(folder)

    def test_prompt_positions_are_transformers_rope_index(self, checkpoint):
        """Two images, one not square, between text: the same 3-D positions and decode offset
        as ``get_rope_index`` (the placeholder widening as the reference processor's)."""
        folder, model, processor = checkpoint
        images = [random_image(2), random_image(3, (40, 70))]
        text = self._text("<image> deep blue <image> sea")
        inputs = processor(text, images)
        expected, delta = model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
        )
        ours = QwenVLImageProcessor(folder, AutoConfig.from_pretrained(folder))
        ids, items = expand_placeholders(processor.tokenizer(text)["input_ids"], images, ours)
        assert ids == inputs["input_ids"][0].tolist()
        positions, offset = mrope_positions(len(ids), items, merge=2)
        assert torch.equal(positions, expected[:, 0]) and offset == int(delta) != 0

    @pytest.mark.slow  # starts a server, as the kit's own version starts an engine-core process
    def test_images_cross_the_engine_core_process(self, checkpoint):
        """The kit's crossing of the engine-core process, taken through a real server instead
        (one process start for both): a chat request's base64 image goes through the chat
        template and the API process's processor, its items over ZMQ to the engine core, and
        the tokens come back as transformers' greedy ones."""
        folder = checkpoint[0]
        image = random_image(5, (40, 70))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        content = [{"type": "text", "text": "deep "}, {"type": "image_url", "image_url": {"url": url}}]
        args = ("--plugins", ",".join((*PLUGINS, "server")), "--dtype", "float32", "--block-size", "8")
        with (
            serve(folder, *args, "--num-blocks", "64", "--max-model-len", "128") as server,
            server.openai() as client,
        ):
            response = client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=[{"role": "user", "content": content}],
                max_tokens=8,
                temperature=0,
                logprobs=True,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
            )
        tokens = [
            int(entry.token.removeprefix("token_id:")) for entry in response.choices[0].logprobs.content
        ]
        assert tokens == self._reference(checkpoint, "user: deep <image>\nassistant: ", [image])[0]


def test_qwen2_vl_matches_transformers(tmp_path):
    """Qwen2-VL (full attention throughout its tower, another merger), its LM head tied to the
    embeddings at the config's top level: an image request batched with a text-only one."""
    model, processor = save_tiny_qwen_vl(
        str(tmp_path), architecture="Qwen2VLForConditionalGeneration", tied=True
    )
    contract = TestQwen2_5VL()
    checkpoint = (str(tmp_path), model, processor)
    cases = [("deep <image> blue sea", [random_image(4, (40, 70))]), ("red green", [])]
    contract._check_parity(checkpoint, contract._llm(checkpoint[0]), cases)


def test_mm_processor_kwargs_bound_the_image_tokens(tmp_path):
    """vLLM's --mm-processor-kwargs: max_pixels lowers a large image's tokens in the engine's
    processor; an unknown key, a bad value and a processor that takes none are refused."""
    from engine import LLM

    save_tiny_qwen_vl(str(tmp_path))
    image = random_image(6, (400, 300))
    options = dict(dtype="float32", plugins=PLUGINS, num_blocks=24, block_size=8, max_model_len=128)
    bounded = LLM(str(tmp_path), mm_processor_kwargs={"max_pixels": 56 * 56 * 4}, **options)
    processed = bounded.engine.mm_processor.process_image(image)
    assert processed.data["image_grid_thw"].tolist() == [[1, 6, 8]] and processed.num_tokens == 12
    hf_config = AutoConfig.from_pretrained(str(tmp_path))
    assert QwenVLImageProcessor(str(tmp_path), hf_config).process_image(image).num_tokens == 54
    for bad, says in (({"fps": 2}, "'fps' is not an option"), ({"max_pixels": 0}, "positive integer")):
        with pytest.raises(ValueError, match=says):
            QwenVLImageProcessor(str(tmp_path), hf_config, bad)

    class WithoutOptions(QwenVLImageProcessor):
        def __init__(self, model_path, hf_config):  # a processor written before the options
            super().__init__(model_path, hf_config)

    assert (
        build_processor(WithoutOptions, str(tmp_path), hf_config, None).process_image(image).num_tokens == 54
    )
    with pytest.raises(ValueError, match="mm_processor_kwargs: WithoutOptions takes no options"):
        build_processor(WithoutOptions, str(tmp_path), hf_config, {"max_pixels": 3136})
