"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, and
``LLM(model, runner="pooling").embed(prompts)`` for embeddings, ``.classify(prompts)`` and
``.score(text_1, text_2)`` for classifiers, cross-encoders and rerankers. With ``enable_lora=True``,
``generate(..., lora_request=LoRARequest(name, int_id, path))`` runs PEFT adapters, one for
all prompts or one per prompt (None: the base model), mixed in the same steps. A multimodal
model takes vLLM's ``{"prompt": "... <image> ...", "multi_modal_data": {"image": pil_image}}``
(or ``prompt_token_ids``; a list of images for several placeholders)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import attrs
import numpy as np
from tqdm.auto import tqdm

from engine.client.inproc import InProcessClient
from engine.client.output_processor import OutputProcessor, RequestState, request_output
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.entrypoints.chat_template import conversation, template_options
from engine.entrypoints.harmony import HARMONY_MODEL_TYPES
from engine.entrypoints.harmony import render_chat as render_harmony
from engine.entrypoints.harmony import stop_token_ids as harmony_stops
from engine.entrypoints.images import split_images
from engine.messages.lora import LoRARequest
from engine.messages.multimodal import MultiModalItem, expand_placeholders, images_of
from engine.messages.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine.messages.pooling_params import PoolingParams, pooling_token_ids
from engine.messages.sampling_params import (
    SamplingParams,
    tokenize_bad_words,
    truncate_prompt,
    truncation_length,
)
from engine.messages.scoring import cosine, score_pairs, scores_by_cross_encoder
from engine.plugins import load_plugins

Prompt = str | Sequence[int] | dict
# num_scheduler_steps offline: greedy decode steps a scheduling pass may run in a row (on the
# default model's single stream, against one: 4 1.11x, 8 1.14x a token; docs/decisions.md)
OFFLINE_SCHEDULER_STEPS = 8


class LLM:
    """``LLM()`` serves the embedded default model; ``plugins=[...]`` is an allow-list of
    plugin entry-point names; any other keyword is an engine option (``max_num_seqs``,
    ``num_blocks``, ``attention_backend`` ...).

    Offline, no stream waits between steps, so prefill chunks take the whole token budget
    beside decoding requests (``shared_step_target_s=0``; the server keeps the step-time
    target that bounds its streams' inter-token gap), as vLLM's ``LLM`` class takes its own,
    throughput-minded defaults: 1.12× output tokens/s on 64 prompts × 128 tokens, default model.
    For the same reason greedy decoding runs up to :data:`OFFLINE_SCHEDULER_STEPS` decode steps
    a scheduling pass (``num_scheduler_steps``; the server's default is one): the same tokens,
    the step's host work paid once for them (1.14× a single-stream token of the default model).

    The engine core runs in this process, driven through an :class:`InProcessClient` (the
    client the engine-core process serves the server with): no step waits on another process."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        plugins: Sequence[str] | None = None,
        **engine_options,
    ):
        engine_options.setdefault("shared_step_target_s", 0.0)
        engine_options.setdefault("num_scheduler_steps", OFFLINE_SCHEDULER_STEPS)
        config = EngineConfig.from_kwargs(model=model, dtype=dtype, plugins=plugins, **engine_options)
        self.engine = EngineCore(config, load_plugins(config.plugins))
        self.client = InProcessClient(self.engine)
        self.config = self.engine.config  # resolved: model path, dtype, max_model_len
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's ``LLM.get_tokenizer``); None for a model without one."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        prompts = self._as_list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority: {len(priorities)} given for {len(prompts)} prompts")
        adapters = _per_prompt(lora_request, len(prompts))
        encoded, params = self._prepare(prompts, params)
        expanded = [self._with_images(prompt, ids) for prompt, (_, ids) in zip(prompts, encoded)]
        encoded = [(text, ids) for (text, _), (ids, _) in zip(encoded, expanded)]
        images = [items for _, items in expanded]
        checks = zip(encoded, params, priorities, adapters, images)
        for (_, ids), p, prio, lora, items in checks:  # every check before any work starts
            self.client.validate(ids, p, prio, lora, items)
        processor = OutputProcessor(self.tokenizer)
        order = [
            self._add(processor, text, ids, p, prio, lora, items).request_id
            for (text, ids), p, prio, lora, items in zip(encoded, params, priorities, adapters, images)
        ]
        return self._run(processor, order, use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (an engine built with ``runner="pooling"``, or a model
        without an LM head): every prompt is checked first, then all are queued at once, so
        they share engine steps (as many prompts per step as ``max_num_batched_tokens``
        holds, at least one whole prompt). ``truncate_prompt_tokens``: embed only each
        prompt's first k tokens (-1: ``max_model_len``), as :meth:`_pooling_ids` cuts them."""
        prompts = self._as_list(prompts)
        params = pooling_params or PoolingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"pooling_params: {len(params)} given for {len(prompts)} prompts")
        encoded = self._pooling_ids(prompts, truncate_prompt_tokens)
        pooled = self._pool(encoded, params, "embd")
        return [
            EmbeddingRequestOutput(rid, EmbeddingOutput(vector), ids)
            for (rid, vector), ids in zip(pooled, encoded)
        ]

    def classify(
        self, prompts: Prompt | Sequence[Prompt], *, truncate_prompt_tokens: int | None = None
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities from a sequence-classification model (vLLM's
        ``LLM.classify``): a softmax over its labels, the sigmoid of a one-label model's logit;
        ``truncate_prompt_tokens`` as :meth:`embed` takes it."""
        encoded = self._pooling_ids(self._as_list(prompts), truncate_prompt_tokens)
        pooled = self._pool(encoded, [PoolingParams(task="classify")] * len(encoded), "clsf")
        return [
            ClassificationRequestOutput(rid, ClassificationOutput(probs), ids)
            for (rid, probs), ids in zip(pooled, encoded)
        ]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: one score per pair, a single ``text_1`` against every
        ``text_2`` or the two lists zipped. A cross-encoder (a classifier with one label)
        scores each pair as one input (:func:`engine.messages.pooling_params.pooling_token_ids`):
        the sigmoid of its logit; an embedding model scores the cosine similarity of the texts'
        embeddings. ``truncate_prompt_tokens`` (-1: ``max_model_len``) cuts each input to its
        first k tokens: a cross-encoder's pair as its tokenizer truncates a pair (the longer
        text first, special tokens kept), an embedding model's texts each."""
        pairs = score_pairs(text_1, text_2)
        tokenizer = self._require_tokenizer("score")
        if scores_by_cross_encoder(self.engine.classifier_labels):
            keep = truncation_length(truncate_prompt_tokens, self.engine.max_model_len)
            encoded = [pooling_token_ids(tokenizer, a, b, keep) for a, b in pairs]
            pooled = self._pool(encoded, [PoolingParams(task="classify")] * len(encoded), "score")
            return [
                ScoringRequestOutput(rid, ScoringOutput(probs[0]), ids)
                for (rid, probs), ids in zip(pooled, encoded)
            ]
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        embedded = dict(zip(texts, self.embed(texts, truncate_prompt_tokens=truncate_prompt_tokens)))
        out = []
        for a, b in pairs:
            first, second = embedded[a], embedded[b]
            similarity = cosine(first.outputs.embedding, second.outputs.embedding)
            ids = first.prompt_token_ids + second.prompt_token_ids
            out.append(ScoringRequestOutput(f"score-{next(self._ids)}", ScoringOutput(similarity), ids))
        return out

    def _pooling_ids(self, prompts: list[Prompt], truncate_prompt_tokens: int | None) -> list[list[int]]:
        """Each prompt's token ids, cut to the first ``truncate_prompt_tokens`` (vLLM's pooling
        runner truncates on the right, a text as its tokenizer truncates it:
        :func:`engine.messages.pooling_params.pooling_token_ids`)."""
        keep = truncation_length(truncate_prompt_tokens, self.engine.max_model_len)
        if keep is None:
            return [ids for _, ids in map(self._encode, prompts)]
        return [self._encode_cut(prompt, keep) for prompt in prompts]

    def _encode_cut(self, prompt: Prompt, keep: int) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return pooling_token_ids(self._require_tokenizer("text prompts"), prompt, keep=keep)
        return self._encode(prompt)[1][:keep]

    def _pool(
        self, encoded: list[list[int]], params: list[PoolingParams], kind: str
    ) -> list[tuple[str, list[float]]]:
        """(request id, pooled vector) per prompt: every prompt checked first, then all queued."""
        for ids, p in zip(encoded, params):
            self.client.validate(ids, p)
        order = [f"{kind}-{next(self._ids)}" for _ in encoded]
        self.client.add(list(zip(order, encoded, params)))
        done = {}
        while self.client.has_unfinished():
            done.update((d.request_id, d) for d in self.client.step() if d.finish_reason is not None)
        failed = [(i, done[rid]) for i, rid in enumerate(order) if done[rid].embedding is None]
        if failed:
            index, delta = failed[0]
            raise RuntimeError(f"prompt {index}: {delta.error or delta.finish_reason}")
        return [(rid, np.frombuffer(done[rid].embedding, "<f4").tolist()) for rid in order]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """One prompt's text as it grows (its first sample's), each item the text new since the
        last; ``engine generate`` prints these. The same checks and fan-out as ``generate``."""
        [(text, ids)], [params] = self._prepare(
            [prompt], [sampling_params or self.get_default_sampling_params()]
        )
        self.client.validate(ids, params)
        processor = OutputProcessor(self.tokenizer)
        first = self._add(processor, text, ids, params, 0).sequences[0]
        shown = 0
        while self.client.has_unfinished():
            finished = self._step(processor)
            if finished:
                now = request_output(finished[0], self.tokenizer).outputs[0].text
            else:
                now = first.text[: first.emitted]
            yield now[shown:]
            shown = len(now)

    def _prepare(self, prompts: list, params: list) -> tuple[list, list]:
        """Prompts as (text, token ids) cut to ``truncate_prompt_tokens``, and the parameters
        with ``bad_words`` tokenized (once per distinct ``SamplingParams``)."""
        encoded = [
            (
                text,
                truncate_prompt(ids, getattr(p, "truncate_prompt_tokens", None), self.engine.max_model_len),
            )
            for (text, ids), p in zip((self._encode(prompt) for prompt in prompts), params)
        ]
        distinct = {id(p): p for p in params if getattr(p, "bad_words", None)}
        tokenized = {
            key: tokenize_bad_words(p, self._require_tokenizer("bad_words")) for key, p in distinct.items()
        }
        return encoded, [tokenized.get(id(p), p) for p in params]

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses when given no ``SamplingParams``: the built-in defaults
        overridden by the model's generation config (``generation_config="auto"``, the
        default; ``"vllm"`` ignores it; a folder reads its ``generation_config.json``)."""
        return SamplingParams(**self.engine.default_sampling_params)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block (False while requests hold blocks), as vLLM's."""
        return self.client.control("reset_prefix_cache")

    def sleep(self, level: int = 1) -> None:
        """Give the KV cache back, and the weights (level 1: to a temporary file; level 2:
        discarded), until :meth:`wake_up`; needs ``enable_sleep_mode=True``, as in vLLM."""
        self.client.control("sleep", level=level)

    def wake_up(self) -> None:
        self.client.control("wake_up")

    def update_weights_from_disk(self, model_path: str) -> None:
        """Serve the weights of the checkpoint at ``model_path`` (same architecture) from now on."""
        self.client.control("update_weights_from_disk", model_path=model_path)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> None:
        """Join a trainer's ``torch.distributed`` group (SGLang's call; the trainer is rank 0 and
        hosts the group's store: :mod:`engine.core.weight_sync`); waits for the trainer."""
        self.client.control(
            "init_weights_update_group",
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> None:
        """Receive the tensors the trainer broadcasts, in this order, by checkpoint name, and
        serve the checkpoint with them in place of its own."""
        self.client.control("update_weights_from_distributed", names=names, dtypes=dtypes, shapes=shapes)

    def destroy_weights_update_group(self) -> None:
        self.client.control("destroy_weights_update_group")

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """``continue_final_message`` continues the last message instead of opening a new
        turn (with ``add_generation_prompt=False``); ``chat_template_kwargs`` are variables
        for the template, e.g. ``{"enable_thinking": False}`` (vLLM's names); ``tools``: OpenAI
        function tools for the template; ``lora_request`` as :meth:`generate` takes it. A
        multimodal model's messages may hold image parts:
        ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` or
        ``{"type": "image_pil", "image_pil": image}`` (:mod:`engine.entrypoints.images`).

        A gpt-oss model's chats (without a ``chat_template``) are rendered in harmony, as the
        server renders them (``reasoning_effort`` from ``chat_template_kwargs``), and end at
        ``<|return|>`` or ``<|call|>``; the text is the raw harmony the model wrote, its special
        tokens kept (``<|channel|>final<|message|>...``), for ``openai-harmony`` to read."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        harmony = chat_template is None and self._speaks_harmony()
        prompts = []
        for c in conversations:
            c, images = split_images(c)
            if harmony:
                ids = self._harmony_prompt(
                    c, tools, add_generation_prompt, continue_final_message, chat_template_kwargs
                )
            else:
                ids = self.apply_chat_template(
                    c,
                    chat_template,
                    add_generation_prompt,
                    continue_final_message,
                    chat_template_kwargs,
                    tools,
                )
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}})
        params = sampling_params or self.get_default_sampling_params()
        if harmony:
            params = attrs.evolve(
                params,
                stop_token_ids=(*params.stop_token_ids, *harmony_stops()),
                skip_special_tokens=False,
            )
        return self.generate(prompts, params, use_tqdm, lora_request=lora_request)

    def _speaks_harmony(self) -> bool:
        return getattr(self.engine.hf_config, "model_type", None) in HARMONY_MODEL_TYPES

    @staticmethod
    def _harmony_prompt(
        messages: list[dict],
        tools: list[dict] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict | None,
    ) -> list[int]:
        if continue_final_message or not add_generation_prompt:
            field = "continue_final_message" if continue_final_message else "add_generation_prompt"
            raise ValueError(f"{field}: a harmony prompt always ends by opening the assistant's turn")
        return render_harmony(messages, tools, chat_template_kwargs)

    def apply_chat_template(
        self,
        messages: list[dict],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        tokenizer = self._require_tokenizer("chat")
        if chat_template is None and not tokenizer.chat_template:
            raise ValueError("chat_template: the model has none; pass chat_template=...")
        messages = conversation(messages, image_parts=True)
        options = template_options(add_generation_prompt, continue_final_message, chat_template_kwargs)
        ids = tokenizer.apply_chat_template(
            messages, chat_template=chat_template, tools=tools, tokenize=True, **options
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _as_list(self, prompts) -> list:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self._require_tokenizer("text prompts").encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return self._encode(prompt["prompt"])
        return None, list(prompt)

    def _with_images(self, prompt: Prompt, ids: list[int]) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """vLLM's ``{"prompt" | "prompt_token_ids", "multi_modal_data": {"image": ...}}``: the
        token ids with each image placeholder widened to its tokens, and the images' items."""
        images = images_of(prompt.get("multi_modal_data")) if isinstance(prompt, dict) else []
        if not images:
            return ids, ()
        if self.engine.mm_processor is None:
            raise ValueError(f"multi_modal_data: {self.engine.no_images_reason()}")
        return expand_placeholders(ids, images, self.engine.mm_processor)

    def _require_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ValueError(f"prompt: {what} need a tokenizer and this model has none; pass token ids")
        return self.tokenizer

    def _add(
        self,
        processor: OutputProcessor,
        text,
        ids,
        params: SamplingParams,
        priority: int,
        lora_request: LoRARequest | None = None,
        mm_items: tuple[MultiModalItem, ...] = (),
    ) -> RequestState:
        """Queue the prompt's samples (they share its blocks through the prefix cache)."""
        request, children = processor.add(str(next(self._ids)), text, ids, params)
        self.client.add(children, priority, lora_request=lora_request, mm_items=mm_items)
        return request

    def _step(self, processor: OutputProcessor) -> list[RequestState]:
        """One engine step fed to ``processor``; the prompts it finished."""
        for delta in self.client.step():
            processor.feed(delta)
        aborts = processor.take_aborts()
        if aborts:
            self.client.abort(aborts)
        return processor.take_finished()

    def _run(self, processor: OutputProcessor, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="Generating", disable=not use_tqdm) as bar:
            while self.client.has_unfinished():
                for request in self._step(processor):
                    done[request.request_id] = request_output(request, self.tokenizer)
                    bar.update()
        return [done[rid] for rid in order]


def _per_prompt(lora_request, num_prompts: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: a single request applies to every prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    adapters = list(lora_request)
    if len(adapters) != num_prompts:
        raise ValueError(f"lora_request: {len(adapters)} given for {num_prompts} prompts")
    return adapters
