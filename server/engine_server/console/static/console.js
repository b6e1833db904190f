// The engine's web console: a chat playground that streams from /v1/chat/completions and a
// dashboard that samples /metrics. Every URL is relative to the page (<root>/ui/), so the
// console works behind a proxy's --root-path. No library, no build step; a module, so its
// names stay out of the page's globals.

const $ = (id) => document.getElementById(id);
const API = "../";
const POLL_MS = Number(new URLSearchParams(location.search).get("poll")) || 1000;
const HISTORY_MS = 5 * 60 * 1000; // what the charts show at most
const MIN_SPAN_MS = 60 * 1000; // ... and at least, while the page is younger
const RATE_WINDOW_MS = 3000; // tokens/s is the counters' change over this
const LATENCY_WINDOW_MS = 30 * 1000; // percentiles of the requests seen over this
const KEY_STORAGE = "engine-console-api-key";

// -- talking to the API --------------------------------------------------------------------

function headers() {
  const key = $("api-key").value.trim();
  return key ? { "Content-Type": "application/json", Authorization: `Bearer ${key}` } : { "Content-Type": "application/json" };
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// The JSON payloads of a server-sent-events body, until [DONE]; keep-alive comments skipped.
async function* serverEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        if (line === "data: [DONE]") return;
        yield JSON.parse(line.slice(6));
      }
    }
  }
}

async function loadModels() {
  const response = await fetch(API + "v1/models", { headers: headers() }).catch(() => null);
  if (!response?.ok) {
    $("connection").textContent = response ? await errorText(response) : "the server is unreachable";
    return;
  }
  const { data } = await response.json();
  const select = $("model");
  const previous = select.value;
  select.replaceChildren(
    ...data.map((model) => new Option(model.parent ? `${model.id} (adapter of ${model.parent})` : model.id, model.id)),
  );
  if (data.some((model) => model.id === previous)) select.value = previous;
  $("connection").textContent = "";
}

// -- chat ----------------------------------------------------------------------------------

const chat = { messages: [], controller: null };

function setStatus(text) {
  $("status").textContent = text;
}

function addMessage(role, text) {
  const message = document.createElement("div");
  message.className = `message ${role}`;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  message.append(label, body);
  $("transcript").append(message);
  message.scrollIntoView({ block: "end" });
  return body;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("clear").disabled = busy;
}

function chatRequest() {
  const system = $("system").value.trim();
  return {
    model: $("model").value,
    messages: system ? [{ role: "system", content: system }, ...chat.messages] : chat.messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chat.controller) return;
  $("prompt").value = "";
  chat.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const output = addMessage("assistant", "");
  chat.controller = new AbortController();
  setBusy(true);
  setStatus("generating…");
  const started = performance.now();
  try {
    const response = await fetch(API + "v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(chatRequest()),
      signal: chat.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    let usage = null;
    for await (const event of serverEvents(response)) {
      if (event.error) throw new Error(event.error.message);
      const delta = event.choices?.[0]?.delta?.content;
      if (delta) {
        output.textContent += delta;
        output.parentElement.scrollIntoView({ block: "end" });
      }
      usage = event.usage || usage;
    }
    const took = ((performance.now() - started) / 1000).toFixed(1);
    setStatus(usage ? `${usage.completion_tokens} tokens in ${took} s` : `done in ${took} s`);
  } catch (error) {
    // stopping aborts the fetch: the server sees the client leave and ends the request
    const stopped = error.name === "AbortError";
    output.parentElement.classList.add(stopped ? "stopped" : "error");
    setStatus(stopped ? "stopped" : error.message);
  } finally {
    if (output.textContent) chat.messages.push({ role: "assistant", content: output.textContent });
    chat.controller = null;
    setBusy(false);
  }
}

function newChat() {
  chat.messages = [];
  $("transcript").replaceChildren();
  setStatus("");
}

// -- dashboard -----------------------------------------------------------------------------

const samples = []; // {t, values: Map name -> [sum, count], buckets: Map family -> Map le -> count}
const points = []; // what the charts plot: one per poll, the last HISTORY_MS of them

// Prometheus text: each family's values summed over its label sets (one per engine core).
function parseMetrics(text) {
  const values = new Map();
  const buckets = new Map();
  for (const line of text.split("\n")) {
    const match = /^([^\s{#]+)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (!match) continue;
    const [, name, labels = "", raw] = match;
    const value = Number(raw);
    if (name.endsWith("_bucket")) {
      const le = /le="([^"]+)"/.exec(labels)?.[1];
      const family = buckets.get(name.slice(0, -7)) || new Map();
      family.set(le, (family.get(le) || 0) + value);
      buckets.set(name.slice(0, -7), family);
    } else {
      const [sum, count] = values.get(name) || [0, 0];
      values.set(name, [sum + value, count + 1]);
    }
  }
  return { values, buckets };
}

// vLLM's names under whichever prefix the server uses (--metrics-prefix).
function prefixOf(values) {
  for (const name of values.keys()) if (name.endsWith(":num_requests_running")) return name.split(":")[0];
  return "vllm";
}

function sampleAgo(ms) {
  const now = samples.at(-1).t;
  for (let i = samples.length - 2; i >= 0; i--) if (now - samples[i].t >= ms) return samples[i];
  return samples.length > 1 ? samples[0] : null;
}

function rate(prefix, name) {
  const now = samples.at(-1);
  const before = sampleAgo(RATE_WINDOW_MS);
  const key = `${prefix}:${name}_total`;
  if (!before || !now.values.has(key)) return null;
  return (now.values.get(key)[0] - (before.values.get(key)?.[0] || 0)) / ((now.t - before.t) / 1000);
}

// histogram_quantile over the observations since `before`: linear within the bucket.
function quantile(now, before, q) {
  if (!now) return null;
  const buckets = [...now]
    .map(([le, count]) => [le === "+Inf" ? Infinity : Number(le), count - (before?.get(le) || 0)])
    .sort((a, b) => a[0] - b[0]);
  const total = buckets.at(-1)?.[1] || 0;
  if (total <= 0) return null;
  const rank = q * total;
  let lower = 0;
  let below = 0;
  for (const [upper, count] of buckets) {
    if (count >= rank) {
      if (upper === Infinity) return lower;
      return lower + ((upper - lower) * (rank - below)) / Math.max(count - below, 1e-9);
    }
    [lower, below] = [upper, count];
  }
  return lower;
}

function latency(prefix, name) {
  const family = `${prefix}:${name}`;
  const before = sampleAgo(LATENCY_WINDOW_MS)?.buckets.get(family);
  const now = samples.at(-1).buckets.get(family);
  return [quantile(now, before, 0.5), quantile(now, before, 0.95)].map((s) => (s === null ? null : s * 1000));
}

function gauge(prefix, name, mean = false) {
  const entry = samples.at(-1).values.get(`${prefix}:${name}`);
  return entry ? (mean ? entry[0] / entry[1] : entry[0]) : null;
}

function show(id, value, format = (v) => v.toFixed(0)) {
  $(id).textContent = value === null || Number.isNaN(value) ? "–" : format(value);
}

async function poll() {
  const response = await fetch(API + "metrics", { headers: headers() }).catch(() => null);
  if (!response?.ok) {
    $("connection").textContent = response?.status === 401 ? "enter the API key" : "metrics unavailable";
    return;
  }
  const t = Date.now();
  samples.push({ t, ...parseMetrics(await response.text()) });
  while (samples.length && t - samples[0].t > HISTORY_MS + LATENCY_WINDOW_MS) samples.shift();
  const prefix = prefixOf(samples.at(-1).values);
  const point = {
    t,
    running: gauge(prefix, "num_requests_running"),
    waiting: gauge(prefix, "num_requests_waiting"),
    kv: (gauge(prefix, "kv_cache_usage_perc", true) ?? NaN) * 100,
    generation: rate(prefix, "generation_tokens"),
    prompt: rate(prefix, "prompt_tokens"),
    ttft: latency(prefix, "time_to_first_token_seconds"),
    tpot: latency(prefix, "time_per_output_token_seconds"),
  };
  points.push(point);
  while (t - points[0].t > HISTORY_MS) points.shift();
  render(point);
}

const ms = (pair) => pair.map((v) => (v === null ? "–" : v.toFixed(v < 10 ? 1 : 0))).join(" / ") + " ms";

function render(point) {
  show("stat-running", point.running);
  show("stat-waiting", point.waiting);
  show("stat-kv", point.kv, (v) => `${v.toFixed(1)} %`);
  show("stat-gen", point.generation, (v) => v.toFixed(1));
  show("stat-prompt", point.prompt, (v) => v.toFixed(1));
  $("stat-ttft").textContent = ms(point.ttft);
  $("stat-tpot").textContent = ms(point.tpot);
  plot("chart-throughput", [(p) => p.generation, (p) => p.prompt]);
  plot("chart-requests", [(p) => p.running, (p) => p.waiting]);
  plot("chart-kv", [(p) => p.kv]);
  plot("chart-latency", [(p) => p.ttft[0], (p) => p.tpot[0]]);
}

function plot(id, series) {
  const canvas = $(id);
  const scale = window.devicePixelRatio || 1;
  const width = canvas.clientWidth * scale;
  const height = canvas.clientHeight * scale;
  [canvas.width, canvas.height] = [width, height];
  const context = canvas.getContext("2d");
  const style = getComputedStyle(document.documentElement);
  const colors = [style.getPropertyValue("--accent"), style.getPropertyValue("--second")];
  const values = points.flatMap((p) => series.map((get) => get(p))).filter((v) => Number.isFinite(v));
  const top = Math.max(1, ...values) * 1.1;
  const now = points.at(-1).t;
  const span = Math.min(HISTORY_MS, Math.max(MIN_SPAN_MS, now - points[0].t)); // fills up, then scrolls
  const x = (t) => width - ((now - t) / span) * width;
  const y = (v) => height - (v / top) * (height - 14 * scale);
  context.font = `${11 * scale}px system-ui`;
  context.fillStyle = style.getPropertyValue("--muted");
  context.fillText(top.toPrecision(3), 4 * scale, 12 * scale);
  series.forEach((get, i) => {
    context.strokeStyle = colors[i];
    context.lineWidth = 1.5 * scale;
    context.beginPath();
    let drawing = false;
    for (const point of points) {
      const value = get(point);
      if (!Number.isFinite(value)) {
        drawing = false;
        continue;
      }
      context[drawing ? "lineTo" : "moveTo"](x(point.t), y(value));
      drawing = true;
    }
    context.stroke();
  });
}

// -- start ---------------------------------------------------------------------------------

function start() {
  $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    loadModels();
  });
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => chat.controller?.abort());
  $("clear").addEventListener("click", newChat);
  loadModels();
  poll();
  setInterval(poll, POLL_MS);
}

start();
