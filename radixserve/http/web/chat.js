// The chat page of radixserve (served at GET / by radixserve/http/web_ui.py).
//
// One conversation, streamed from /v1/chat/completions with usage in the last chunk, so each
// reply shows its prompt tokens and how many of them the prefix cache served. Everything the
// model or the server says is inserted with textContent, never as HTML. The API key, when the
// server wants one, lives in this tab's sessionStorage only.
"use strict";

const KEY_STORAGE = "radixserve.apiKey";
const $ = (id) => document.getElementById(id);

const state = {
  messages: [],      // {role: "user" | "assistant" | "error", content, stats?, state?}
  controller: null,  // the AbortController of the reply being streamed, if any
};

// ---------------------------------------------------------------- the server

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function headers() {
  const out = { "Content-Type": "application/json" };
  const key = apiKey();
  if (key) out.Authorization = "Bearer " + key;
  return out;
}

// The message of an error answer (OpenAI's shape on every route of radixserve), or its text.
async function errorOf(response) {
  const text = await response.text();
  let message = text.trim() || response.statusText;
  try {
    const body = JSON.parse(text);
    if (body && body.error && typeof body.error.message === "string") message = body.error.message;
  } catch (_) { /* not JSON: the text itself */ }
  if (response.status === 401) askForKey();
  return new Error(`${response.status}: ${message}`);
}

async function call(path, init) {
  const response = await fetch(path, { ...init, headers: headers() });
  if (!response.ok) throw await errorOf(response);
  return response;
}

// The JSON payloads of a server-sent event stream, until `data: [DONE]`.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

// Whether the server answers (with the key, if it needs one); shows the model's name.
async function connect() {
  try {
    const models = await (await call("/v1/models", { method: "GET" })).json();
    $("model").textContent = models.data && models.data.length ? models.data[0].id : "no model";
    $("key-form").hidden = true;
    $("forget-key").hidden = !apiKey();
    return true;
  } catch (err) {
    $("model").textContent = "not connected";
    addError(err);
    return false;
  }
}

function askForKey() {
  $("key-form").hidden = false;
  $("forget-key").hidden = !apiKey();
  $("api-key").focus();
}

// ---------------------------------------------------------------- the conversation

function requestBody() {
  const body = {
    messages: [],
    stream: true,
    stream_options: { include_usage: true },
  };
  const system = $("system").value;
  if (system.trim()) body.messages.push({ role: "system", content: system });
  for (const m of state.messages) {
    if (m.role === "user" || m.role === "assistant") body.messages.push({ role: m.role, content: m.content });
  }
  // sent as typed: a value the server refuses comes back as its 400, shown in the conversation
  const temperature = $("temperature").value.trim();
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("max-tokens").value.trim();
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  const stops = $("stop").value.split("\n").filter((s) => s !== "");
  if (stops.length) body.stop = stops;
  return body;
}

// Stream the assistant's reply to the conversation as it stands.
async function reply() {
  dropTrailingErrors();
  const body = JSON.stringify(requestBody());  // before the reply's own (empty) message joins it
  const message = { role: "assistant", content: "", state: "streaming" };
  const controller = new AbortController();
  state.messages.push(message);
  state.controller = controller;
  render();
  const started = performance.now();
  let first = null;
  let usage = null;
  let finish = null;
  try {
    const response = await call("/v1/chat/completions", {
      method: "POST", body, signal: controller.signal,
    });
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);  // failed after it started
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const text = choice.delta && choice.delta.content;
        if (text) {
          if (first === null) first = performance.now();
          message.content += text;
          message.contentNode.textContent = message.content;
          scrollDown();
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    message.stats = stats(usage, finish, started, first, performance.now());
  } catch (err) {
    if (err.name === "AbortError") {
      message.stats = { stopped: true };
    } else {
      if (!message.content) state.messages.pop();
      addError(err);
    }
  } finally {
    delete message.state;
    if (state.controller === controller) state.controller = null;  // not a newer reply's
    render();
  }
}

function stats(usage, finish, started, first, ended) {
  const out = { finish };
  if (usage) {
    out.prompt = usage.prompt_tokens;
    out.cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    // of the cached tokens, those reused from the segment cache (segment parts, wherever they sit)
    out.segment = (usage.prompt_tokens_details && usage.prompt_tokens_details.segment_tokens) || 0;
    out.completion = usage.completion_tokens;
  }
  if (first !== null) out.ttftMs = first - started;
  // decode speed: the tokens after the first, over the time after the first
  if (first !== null && usage && usage.completion_tokens > 1 && ended > first) {
    out.tokensPerS = (usage.completion_tokens - 1) / ((ended - first) / 1000);
  }
  return out;
}

function dropTrailingErrors() {
  while (state.messages.length && state.messages[state.messages.length - 1].role === "error") state.messages.pop();
}

function addError(err) {
  state.messages.push({ role: "error", content: err.message || String(err) });
  render();
}

function busy() {
  return state.controller !== null;
}

function send(text) {
  if (busy() || !text.trim()) return;
  dropTrailingErrors();
  state.messages.push({ role: "user", content: text });
  reply();
}

// Same conversation, a new last reply: every token of its prompt was cached by the last one.
function regenerate() {
  if (busy()) return;
  dropTrailingErrors();
  if (state.messages.length && state.messages[state.messages.length - 1].role === "assistant") state.messages.pop();
  reply();
}

// Replace user message `index` and drop what came after: the turns before it are a cached prefix.
function resend(index, text) {
  if (busy() || !text.trim()) return;
  state.messages = state.messages.slice(0, index);
  state.messages.push({ role: "user", content: text });
  reply();
}

// ---------------------------------------------------------------- rendering

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(label, onClick) {
  const node = el("button", null, label);
  node.type = "button";
  node.disabled = busy();
  node.addEventListener("click", onClick);
  return node;
}

function statsNode(s) {
  const node = el("div", "stats");
  if (s.stopped) {
    node.append(el("span", null, "stopped"));
    return node;
  }
  const parts = [];
  if (s.prompt !== undefined) {
    node.dataset.promptTokens = s.prompt;
    node.dataset.cachedTokens = s.cached;
    node.dataset.completionTokens = s.completion;
    const share = s.prompt ? Math.round((100 * s.cached) / s.prompt) : 0;
    parts.push(el("span", "prompt", `prompt ${s.prompt} tok`));
    parts.push(el("span", "cached" + (s.cached > 0 ? " hit" : ""), `cached ${s.cached} (${share}%)`));
    node.dataset.segmentTokens = s.segment || 0;
    if (s.segment > 0) parts.push(el("span", "segment hit", `segments reused ${s.segment}`));
    parts.push(el("span", "completion", `output ${s.completion} tok`));
  }
  parts.push(el("span", "ttft", s.ttftMs === undefined ? "TTFT —" : `TTFT ${Math.round(s.ttftMs)} ms`));
  parts.push(el("span", "speed", s.tokensPerS === undefined ? "— tok/s" : `${s.tokensPerS.toFixed(1)} tok/s`));
  if (s.finish) parts.push(el("span", "finish", s.finish));
  parts.forEach((p, i) => node.append(...(i ? [" · ", p] : [p])));
  return node;
}

function messageNode(m, index, last) {
  const node = el("li", "msg " + m.role);
  node.dataset.index = index;
  if (m.state) node.dataset.state = m.state;
  node.append(el("div", "role", m.role === "error" ? "error" : m.role));
  const content = el("div", "content", m.content);
  if (m.state === "streaming") m.contentNode = content;  // where reply() writes the next tokens
  node.append(content);
  if (m.stats) node.append(statsNode(m.stats));
  const tools = el("div", "tools");
  if (m.role === "user") {
    tools.append(button("Edit and resend", () => startEdit(node, content, tools, index)));
  } else if (last && m.role === "assistant" && !m.state) {
    tools.append(button("Regenerate", regenerate));
  } else if (last && m.role === "error" && state.messages.some((x) => x.role === "user")) {
    tools.append(button("Retry", regenerate));
  }
  if (tools.childNodes.length) node.append(tools);
  return node;
}

function startEdit(node, content, tools, index) {
  const area = el("textarea", "edit");
  area.value = state.messages[index].content;
  area.rows = Math.min(10, Math.max(2, area.value.split("\n").length));
  content.replaceWith(area);
  tools.replaceChildren(
    button("Send", () => resend(index, area.value)),
    button("Cancel", render),
  );
  area.focus();
}

function render() {
  const list = $("messages");
  list.replaceChildren(...state.messages.map((m, i) => messageNode(m, i, i === state.messages.length - 1)));
  $("send").disabled = busy();
  $("stop-reply").hidden = !busy();
  let prompt = 0;
  let cached = 0;
  for (const m of state.messages) {
    if (m.stats && m.stats.prompt !== undefined) {
      prompt += m.stats.prompt;
      cached += m.stats.cached;
    }
  }
  $("totals").textContent = prompt
    ? `cache served ${cached} of ${prompt} prompt tokens (${Math.round((100 * cached) / prompt)}%)`
    : "";
  scrollDown();
}

function scrollDown() {
  const list = $("messages");
  list.scrollTop = list.scrollHeight;
}

// ---------------------------------------------------------------- wiring

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (busy() || !text.trim()) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop-reply").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    render();
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("api-key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORAGE, key);
    $("api-key").value = "";
    dropTrailingErrors();
    render();
    connect().then((ok) => {
      const last = state.messages[state.messages.length - 1];
      if (ok && last && last.role === "user" && !busy()) reply();  // the message the key was missing for
    });
  });
  $("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    askForKey();
  });
  render();
  connect();
});
