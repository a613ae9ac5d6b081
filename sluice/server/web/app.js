// The sluice playground: a chat through /v1/chat/completions (streamed), and a panel of
// what the server is doing, polled from /get_server_info and /metrics. Model output only
// ever reaches the page as text nodes (markdown.js builds elements, never parses HTML).
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "sluice.conversation";
const SETTINGS = "sluice.settings";
const KEY = "sluice.apiKey";
const POLL_MS = 2000;
const SAMPLES = 30; // one minute of polls

let conversation = JSON.parse(localStorage.getItem(STORE) || "[]");
let modelId = "";
let running = null; // the AbortController of the reply being streamed
let pendingImage = null; // a data URL for the next message

// ------------------------------------------------------------ requests

async function askForKey() {
  const dialog = $("key-dialog");
  dialog.showModal();
  await new Promise((resolve) => dialog.addEventListener("close", resolve, { once: true }));
  sessionStorage.setItem(KEY, $("key-input").value.trim());
}

async function api(path, options = {}) {
  for (;;) {
    const headers = { ...(options.headers || {}) };
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    await askForKey();
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}

// ------------------------------------------------------------ the conversation

function save() {
  // Images stay in the page only: their data URLs would soon fill localStorage.
  const stored = conversation.map((message) =>
    typeof message.content === "string"
      ? message
      : { ...message, content: message.content.filter((part) => part.type === "text") });
  try {
    localStorage.setItem(STORE, JSON.stringify(stored));
  } catch (error) {
    console.warn("the conversation is not kept:", error);
  }
}

function messageText(message) {
  if (typeof message.content === "string") return message.content;
  return message.content.filter((part) => part.type === "text").map((part) => part.text).join("\n");
}

function renderMessage(message, index) {
  const box = document.createElement("div");
  box.className = `message ${message.role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.append(document.createTextNode(message.role === "user" ? "you" : "model"));
  const copy = document.createElement("button");
  copy.type = "button";
  copy.textContent = "copy";
  copy.addEventListener("click", () => copyText(messageText(message)));
  who.append(copy);
  if (message.role === "assistant" && index === conversation.length - 1) {
    const again = document.createElement("button");
    again.type = "button";
    again.className = "regenerate";
    again.textContent = "regenerate";
    again.addEventListener("click", regenerate);
    who.append(again);
  }
  box.append(who);
  if (typeof message.content !== "string") {
    for (const part of message.content) {
      if (part.type === "image_url") {
        const img = document.createElement("img");
        img.src = part.image_url.url; // a data: URL the user chose, never model output
        box.append(img);
      }
    }
  }
  const content = document.createElement("div");
  content.className = "content";
  content.append(Markdown.render(messageText(message)));
  box.append(content);
  if (message.error) {
    const error = document.createElement("div");
    error.className = "error";
    error.textContent = message.error;
    box.append(error);
  }
  return box;
}

function renderAll() {
  const list = $("messages");
  list.replaceChildren(...conversation.map(renderMessage));
  list.scrollTop = list.scrollHeight;
}

function copyText(text) {
  if (navigator.clipboard?.writeText) {
    navigator.clipboard.writeText(text).catch(() => copyByHand(text));
  } else {
    copyByHand(text);
  }
}

function copyByHand(text) {
  const area = document.createElement("textarea");
  area.value = text;
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

function settings() {
  return {
    system: $("system").value,
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
    schema: $("schema").value,
  };
}

function saveSettings() {
  localStorage.setItem(SETTINGS, JSON.stringify(settings()));
}

function loadSettings() {
  const saved = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
  if (saved.system !== undefined) $("system").value = saved.system;
  if (saved.temperature !== undefined) $("temperature").value = saved.temperature;
  if (saved.top_p !== undefined) $("top-p").value = saved.top_p;
  if (saved.max_tokens !== undefined) $("max-tokens").value = saved.max_tokens;
  if (saved.schema !== undefined) $("schema").value = saved.schema;
}

function requestBody() {
  const chosen = settings();
  const messages = [];
  if (chosen.system.trim()) messages.push({ role: "system", content: chosen.system });
  for (const message of conversation) messages.push({ role: message.role, content: message.content });
  const body = {
    model: modelId,
    messages,
    stream: true,
    temperature: chosen.temperature,
    top_p: chosen.top_p,
    max_tokens: chosen.max_tokens,
  };
  $("schema-error").hidden = true;
  if (chosen.schema.trim()) {
    try {
      const schema = JSON.parse(chosen.schema);
      body.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
    } catch (error) {
      $("schema-error").textContent = `The JSON schema is not valid JSON: ${error.message}`;
      $("schema-error").hidden = false;
      return null;
    }
  }
  return body;
}

async function streamReply() {
  const body = requestBody();
  if (!body) return;
  const reply = { role: "assistant", content: "" };
  conversation.push(reply);
  renderAll();
  const view = $("messages").lastElementChild.querySelector(".content");
  running = new AbortController();
  setBusy(true);
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: running.signal,
    });
    if (!response.ok) {
      reply.error = await errorText(response);
      return;
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) {
            reply.error = chunk.error.message;
            continue;
          }
          const delta = chunk.choices?.[0]?.delta?.content;
          if (delta) {
            reply.content += delta;
            view.replaceChildren(Markdown.render(reply.content));
            $("messages").scrollTop = $("messages").scrollHeight;
          }
        }
      }
    }
  } catch (error) {
    if (error.name !== "AbortError") reply.error = String(error);
    else reply.stopped = true;
  } finally {
    running = null;
    setBusy(false);
    save();
    renderAll();
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  document.body.dataset.busy = busy ? "yes" : "no";
}

async function send(event) {
  event.preventDefault();
  if (running) return;
  const text = $("prompt").value;
  if (!text.trim() && !pendingImage) return;
  const content = pendingImage
    ? [{ type: "text", text }, { type: "image_url", image_url: { url: pendingImage } }]
    : text;
  conversation.push({ role: "user", content });
  $("prompt").value = "";
  pendingImage = null;
  $("attachments").replaceChildren();
  $("image").value = "";
  save();
  renderAll();
  await streamReply();
}

async function regenerate() {
  if (running) return;
  if (conversation.length && conversation[conversation.length - 1].role === "assistant") conversation.pop();
  save();
  renderAll();
  await streamReply();
}

function chooseImage() {
  const file = $("image").files[0];
  if (!file) return;
  const reader = new FileReader();
  reader.onload = () => {
    pendingImage = reader.result;
    const img = document.createElement("img");
    img.src = pendingImage;
    $("attachments").replaceChildren(img);
  };
  reader.readAsDataURL(file);
}

// ------------------------------------------------------------ the server panel

const history = { running: [], waiting: [], kv: [], tps: [] };
const tokenCounts = []; // {tokens, at} of the last minute's polls

function fact(list, name, value, id) {
  const dt = document.createElement("dt");
  dt.textContent = name;
  const dd = document.createElement("dd");
  dd.textContent = value;
  if (id) dd.id = id;
  list.append(dt, dd);
}

function metricValues(text) {
  const values = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const [name, value] = line.split(/\s+/);
    const bare = name.replace(/\{.*\}$/, "");
    values[bare] = (values[bare] || 0) + Number(value);
  }
  return values;
}

function plot(canvas, series, colors, ceiling) {
  const context = canvas.getContext("2d");
  const { width, height } = canvas;
  context.clearRect(0, 0, width, height);
  const top = Math.max(ceiling ?? 0, ...series.flat(), 1);
  series.forEach((values, k) => {
    context.strokeStyle = colors[k];
    context.lineWidth = 1.5;
    context.beginPath();
    values.forEach((value, i) => {
      const x = (i / (SAMPLES - 1)) * width;
      const y = height - 2 - (value / top) * (height - 4);
      if (i) context.lineTo(x, y);
      else context.moveTo(x, y);
    });
    context.stroke();
  });
}

function remember(name, value) {
  history[name].push(value);
  if (history[name].length > SAMPLES) history[name].shift();
}

async function poll() {
  try {
    const [info, metrics] = await Promise.all([api("/get_server_info"), api("/metrics")]);
    if (!info.ok || !metrics.ok) return;
    const states = (await info.json()).internal_states[0];
    const values = metricValues(await metrics.text());
    // Output tokens of the requests that ended over the last minute (the counter moves when a
    // request ends), per second.
    const now = performance.now();
    tokenCounts.push({ tokens: values["sluice:generation_tokens_total"] || 0, at: now });
    while (tokenCounts.length > SAMPLES + 1) tokenCounts.shift();
    const first = tokenCounts[0];
    const last = tokenCounts[tokenCounts.length - 1];
    const tps = last.at > first.at ? Math.max(last.tokens - first.tokens, 0) / ((last.at - first.at) / 1000) : 0;
    const kvShare = states.kv_tokens_total ? states.kv_tokens_in_use / states.kv_tokens_total : 0;
    remember("running", states.num_running_reqs);
    remember("waiting", states.num_waiting_reqs);
    remember("kv", kvShare * 100);
    remember("tps", tps);
    plot($("plot-requests"), [history.running, history.waiting], ["#1f6f5c", "#c26d00"]);
    plot($("plot-kv"), [history.kv], ["#3a5fb0"], 100);
    plot($("plot-tps"), [history.tps], ["#7a3ab0"]);
    const prompt = values["sluice:prompt_tokens_total"] || 0;
    const cached = values["sluice:cached_tokens_total"] || 0;
    const live = $("server-live");
    live.replaceChildren();
    fact(live, "running", String(states.num_running_reqs), "live-running");
    fact(live, "waiting", String(states.num_waiting_reqs), "live-waiting");
    fact(live, "KV in use", `${(kvShare * 100).toFixed(1)}% of ${states.kv_tokens_total} tokens`);
    fact(live, "cached prompt tokens", prompt ? `${((cached / prompt) * 100).toFixed(1)}%` : "-");
    fact(live, "tokens/s", tps.toFixed(1), "live-tps");
  } catch (error) {
    console.warn("server panel:", error);
  }
}

async function describeServer() {
  const [modelInfo, serverInfo, models] = await Promise.all([
    api("/get_model_info").then((r) => r.json()),
    api("/get_server_info").then((r) => r.json()),
    api("/v1/models").then((r) => r.json()),
  ]);
  modelId = models.data[0].id;
  $("model-name").textContent = modelId;
  const execution = serverInfo.execution || {};
  const facts = $("server-facts");
  facts.replaceChildren();
  fact(facts, "model", modelId);
  fact(facts, "context", `${modelInfo.context_len} tokens`);
  fact(facts, "weights", modelInfo.weight_version);
  fact(facts, "kernels", [execution.backend, execution.kernels_isa].filter(Boolean).join(" / "));
  fact(facts, "KV dtype", execution.kv_cache_dtype || "");
  fact(facts, "replicas", String(serverInfo.dp_size || 1));
  $("image-label").hidden = !modelInfo.has_image_understanding;
}

// ------------------------------------------------------------ start

$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => running?.abort());
$("new-chat").addEventListener("click", () => {
  running?.abort();
  conversation = [];
  save();
  renderAll();
});
$("image").addEventListener("change", chooseImage);
for (const id of ["system", "temperature", "top-p", "max-tokens", "schema"]) $(id).addEventListener("change", saveSettings);

loadSettings();
renderAll();
describeServer().then(() => {
  poll();
  setInterval(poll, POLL_MS);
});
