"""models-llava against the core's multimodal model contract: ``transformers``'
LlavaForConditionalGeneration on a tiny random checkpoint (CLIP tower, Llama text model)."""

import base64
import io

import pytest

from engine import LLM, SamplingParams
from engine.testing.multimodal import MultiModalContract, random_image
from engine_models_llava.testing import save_tiny_llava


class TestLlava(MultiModalContract):
    model_class = "engine_models_llava.model:LlavaForConditionalGeneration"
    plugins = ("models-llava", "attention-torch")

    @classmethod
    def save_checkpoint(cls, folder: str):
        return save_tiny_llava(folder)


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llava-chat"))
    save_tiny_llava(folder)
    return LLM(
        folder, dtype="float32", plugins=TestLlava.plugins, num_blocks=96, block_size=8, max_model_len=256
    )


def test_chat_image_parts_equal_the_rendered_prompt(llava):
    """vLLM's chat shapes: a base64 image_url part and an image_pil part become the template's
    placeholders, in order, and generate what the rendered prompt with those images does."""
    first, second = random_image(11), random_image(12, (50, 30))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "deep "},
                {"type": "image_url", "image_url": {"url": _data_url(first)}},
                {"type": "text", "text": " blue"},
                {"type": "image_pil", "image_pil": second},
            ],
        }
    ]
    params = SamplingParams(max_tokens=8, temperature=0)
    [chat] = llava.chat(messages, params)
    rendered = {
        "prompt": "user: deep <image> blue<image>\nassistant: ",
        "multi_modal_data": {"image": [first, second]},
    }
    [plain] = llava.generate(rendered, params)
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


def test_chat_refuses_bad_image_parts(llava):
    def ask(part):
        return llava.chat([{"role": "user", "content": [part]}], SamplingParams(max_tokens=1))

    with pytest.raises(ValueError, match="not valid base64"):
        ask({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}})
    with pytest.raises(ValueError, match="not an image"):
        ask(
            {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"hi").decode()},
            }
        )
    with pytest.raises(ValueError, match="unsupported content part 'input_audio'"):
        ask({"type": "input_audio", "input_audio": {}})


def test_limit_of_zero_images_serves_text_without_the_vision_tower(tmp_path):
    """--limit-mm-per-prompt '{"image": 0}': the vision tower is neither built nor loaded, text
    prompts run as transformers' text model does, and an image is refused naming the limit."""
    model, processor = save_tiny_llava(str(tmp_path))
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        plugins=TestLlava.plugins,
        num_blocks=96,
        block_size=8,
        max_model_len=256,
        limit_mm_per_prompt={"image": 0},
    )
    assert llm.engine.model.vision_tower is None and llm.engine.mm_processor is None
    assert not any("vision" in name for name, _ in llm.engine.model.named_parameters())
    prompt = "deep blue sea, red green"
    ids = processor.tokenizer(prompt, return_tensors="pt")["input_ids"]
    expected = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    [out] = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0))
    assert out.outputs[0].token_ids == expected
    with pytest.raises(ValueError, match="images are off: limit_mm_per_prompt allows 0"):
        llm.generate(
            {"prompt": "deep <image>", "multi_modal_data": {"image": random_image(1)}}, SamplingParams()
        )


def test_an_image_past_max_model_len_is_refused(tmp_path):
    """Placeholder tokens count toward the prompt: 16 image tokens + text exceed 16."""
    save_tiny_llava(str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", plugins=TestLlava.plugins, num_blocks=8, max_model_len=16)
    prompt = {"prompt": "deep <image>", "multi_modal_data": {"image": random_image(1)}}
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompt, SamplingParams())
    assert not llm.engine.has_unfinished()
