// The chat page: conversations kept in localStorage, replies streamed from /v1/chat/completions and rendered
// as sanitized markdown, per-conversation settings, stop / regenerate / edit.
"use strict";

const STORE_KEY = "hybridd.conversations";
const DEFAULT_SETTINGS = {system: "", temperature: 0.7, top_p: 1, max_tokens: 512, seed: null};
const CONTEXT_WARNING = 0.9;  // share of the context window that brings up the notice

const key = new URLSearchParams(location.search).get("key");
const headers = {"Content-Type": "application/json"};
if (key) headers["Authorization"] = "Bearer " + key;

const $ = (id) => document.getElementById(id);
const log = $("log"), input = $("input"), sendButton = $("send"), stopButton = $("stop");
let model = null, maxModelLen = null, running = null;  // running: {controller} of the reply being streamed

// ---------------------------------------------------------------- storage

function loadStore() {
  try {
    const store = JSON.parse(localStorage.getItem(STORE_KEY));
    if (store && Array.isArray(store.items)) return store;
  } catch (e) { /* a corrupt store starts afresh */ }
  return {items: [], current: null};
}

const store = loadStore();

function save() { localStorage.setItem(STORE_KEY, JSON.stringify(store)); }

function newConversation() {
  const conv = {id: crypto.randomUUID ? crypto.randomUUID() : String(Date.now() + Math.random()), title: "New chat",
                created: Date.now(), settings: {...DEFAULT_SETTINGS}, messages: []};
  store.items.unshift(conv);
  store.current = conv.id;
  save();
  return conv;
}

function current() {
  return store.items.find((c) => c.id === store.current) || newConversation();
}

// ---------------------------------------------------------------- rendering

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") { node.setAttribute("target", "_blank"); node.setAttribute("rel", "noopener noreferrer"); }
});

function renderMarkdown(el, text) {
  el.innerHTML = DOMPurify.sanitize(marked.parse(text, {gfm: true, breaks: true}), {USE_PROFILES: {html: true}});
  for (const pre of el.querySelectorAll("pre")) {
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "small copy";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => copyText(pre.querySelector("code")?.textContent ?? pre.textContent, copy));
    pre.appendChild(copy);
  }
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (e) {
    const area = document.createElement("textarea");
    area.value = text;
    document.body.appendChild(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1200);
}

function element(tag, cls, text) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  if (text !== undefined) el.textContent = text;
  return el;
}

function button(label, cls, onClick, title) {
  const b = element("button", cls, label);
  b.type = "button";
  if (title) b.title = title;
  b.addEventListener("click", onClick);
  return b;
}

function statsText(s) {
  if (!s) return "";
  const parts = [];
  if (s.ttft_ms != null) parts.push("TTFT " + Math.round(s.ttft_ms) + " ms");
  if (s.tokens_per_s != null) parts.push(s.tokens_per_s.toFixed(1) + " tokens/s");
  if (s.prompt_tokens != null) parts.push(s.prompt_tokens + " prompt + " + s.completion_tokens + " completion tokens");
  if (s.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function renderLog() {
  const conv = current();
  log.replaceChildren();
  const lastUser = conv.messages.map((m) => m.role).lastIndexOf("user");
  const last = conv.messages.length - 1;
  conv.messages.forEach((m, i) => {
    if (m.role === "user") {
      log.appendChild(element("div", "msg user", m.content));
      if (i === lastUser && !running) {
        const actions = element("div", "actions");
        actions.appendChild(button("Edit", "small", () => editLast(i), "Edit this message and ask again"));
        log.appendChild(actions);
      }
    } else {
      const div = element("div", m.error ? "msg error" : "msg assistant");
      if (m.error) div.textContent = "error: " + m.error; else renderMarkdown(div, m.content);
      div.dataset.state = "done";
      log.appendChild(div);
      const stats = element("div", "stats");
      stats.appendChild(element("span", "", statsText(m.stats)));
      if (i === last && !running) stats.appendChild(button("Regenerate", "small regenerate", regenerate));
      log.appendChild(stats);
    }
  });
  log.scrollTop = log.scrollHeight;
  showContextNotice(conv);
}

function renderConversations() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conv of store.items) {
    const li = element("li", conv.id === store.current ? "current" : "");
    li.dataset.id = conv.id;
    const open = button(conv.title, "open", () => switchTo(conv.id), conv.title);
    if (conv.id === store.current) open.setAttribute("aria-current", "true");
    li.append(open, button("✎", "rename", () => rename(li, conv), "Rename"),
              button("✕", "delete", () => remove(conv.id), "Delete"));
    list.appendChild(li);
  }
}

function renderSettings() {
  const s = current().settings;
  $("set-system").value = s.system;
  $("set-temperature").value = s.temperature;
  $("set-top-p").value = s.top_p;
  $("set-max-tokens").value = s.max_tokens;
  $("set-seed").value = s.seed ?? "";
}

function renderAll() {
  renderConversations();
  renderSettings();
  renderLog();
}

function showContextNotice(conv) {
  const notice = $("notice");
  const lastStats = [...conv.messages].reverse().find((m) => m.stats && m.stats.prompt_tokens != null)?.stats;
  const used = lastStats ? lastStats.prompt_tokens + lastStats.completion_tokens : 0;
  if (maxModelLen && used >= CONTEXT_WARNING * maxModelLen) {
    notice.textContent = `This conversation uses ${used} of the model's ${maxModelLen} tokens of context: ` +
      "start a new chat, or the next replies will be cut short.";
    notice.hidden = false;
  } else {
    notice.hidden = true;
  }
}

// ---------------------------------------------------------------- conversations

function switchTo(id) {
  if (running) return;
  store.current = id;
  save();
  renderAll();
  document.getElementById("app").classList.remove("sidebar-open");
  input.focus();
}

function rename(li, conv) {
  const field = element("input");
  field.value = conv.title;
  field.setAttribute("aria-label", "Conversation name");
  const done = (keep) => {
    if (keep && field.value.trim()) conv.title = field.value.trim();
    save();
    renderConversations();
  };
  field.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter") done(true);
    if (ev.key === "Escape") done(false);
  });
  field.addEventListener("blur", () => done(true));
  li.replaceChildren(field);
  field.focus();
  field.select();
}

function remove(id) {
  if (running && id === store.current) return;
  store.items = store.items.filter((c) => c.id !== id);
  if (store.current === id) store.current = store.items[0]?.id ?? null;
  save();
  renderAll();
}

// ---------------------------------------------------------------- requests

function requestBody(conv) {
  const s = conv.settings;
  const messages = conv.messages.filter((m) => !m.error).map((m) => ({role: m.role, content: m.content}));
  if (s.system.trim()) messages.unshift({role: "system", content: s.system});
  const body = {model, messages, stream: true, stream_options: {include_usage: true}, max_tokens: s.max_tokens,
                temperature: s.temperature, top_p: s.top_p};
  if (s.seed !== null) body.seed = s.seed;
  return body;
}

async function* sseEvents(response) {
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (event.startsWith("data: ") && event.slice(6) !== "[DONE]") yield JSON.parse(event.slice(6));
    }
  }
}

async function reply() {
  const conv = current();
  const controller = new AbortController();
  running = {controller};
  setBusy(true);
  renderLog();
  const out = element("div", "msg assistant");
  out.dataset.state = "streaming";
  log.appendChild(out);
  const message = {role: "assistant", content: ""};
  const start = performance.now();
  let first = null, usage = null, pending = false;
  const draw = () => {
    pending = false;
    renderMarkdown(out, message.content);
    log.scrollTop = log.scrollHeight;
  };
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers, body: JSON.stringify(requestBody(conv)),
                                                   signal: controller.signal});
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error(body.error ? body.error.message : "HTTP " + r.status);
    }
    for await (const chunk of sseEvents(r)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta?.content || "";
        if (!delta) continue;
        if (first === null) first = performance.now();
        message.content += delta;
        if (!pending) { pending = true; requestAnimationFrame(draw); }
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") message.error = e.message;
  }
  const end = performance.now();
  const tokens = usage ? usage.completion_tokens : null;
  message.stats = {
    ttft_ms: first !== null ? first - start : null,
    tokens_per_s: first !== null && tokens > 1 ? (tokens - 1) / ((end - first) / 1000) : null,
    prompt_tokens: usage ? usage.prompt_tokens : null, completion_tokens: tokens,
    stopped: controller.signal.aborted || undefined,
  };
  if (message.stats.tokens_per_s != null) $("rate").textContent = message.stats.tokens_per_s.toFixed(1) + " tokens/s";
  conv.messages.push(message);
  save();
  running = null;
  setBusy(false);
  renderLog();
  input.focus();
}

function setBusy(busy) {
  sendButton.disabled = busy;
  sendButton.hidden = busy;
  stopButton.hidden = !busy;
}

function stop() {
  if (running) running.controller.abort();
}

function send(text) {
  const conv = current();
  conv.messages.push({role: "user", content: text});
  if (conv.title === "New chat") conv.title = text.length > 40 ? text.slice(0, 40) + "…" : text;
  save();
  renderConversations();
  reply();
}

function regenerate() {
  const conv = current();
  if (running || !conv.messages.length || conv.messages[conv.messages.length - 1].role === "user") return;
  conv.messages.pop();
  save();
  reply();
}

function editLast(index) {
  const conv = current();
  const box = element("div", "edit-box");
  const area = element("textarea");
  area.value = conv.messages[index].content;
  area.rows = Math.min(10, area.value.split("\n").length + 1);
  area.setAttribute("aria-label", "Edit message");
  const row = element("div");
  const apply = () => {
    const text = area.value.trim();
    if (!text) return;
    conv.messages.splice(index);
    send(text);
  };
  row.append(button("Cancel", "small", renderLog), button("Send", "", apply));
  area.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); apply(); }
    if (ev.key === "Escape") renderLog();
  });
  box.append(area, row);
  const bubbles = log.querySelectorAll(".user");
  bubbles[bubbles.length - 1].replaceWith(box);
  log.querySelector(".actions")?.remove();
  area.focus();
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", {headers});
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    model = body.data[0].id;
    maxModelLen = body.data[0].max_model_len;
    $("model").textContent = model + " · context " + maxModelLen;
    showContextNotice(current());
  } catch (e) {
    $("model").textContent = "not connected: " + e.message;
  }
}

// ---------------------------------------------------------------- wiring

function readSettings() {
  const s = current().settings;
  const number = (id, fallback) => {
    const v = parseFloat($(id).value);
    return Number.isFinite(v) ? v : fallback;
  };
  s.system = $("set-system").value;
  s.temperature = number("set-temperature", DEFAULT_SETTINGS.temperature);
  s.top_p = number("set-top-p", DEFAULT_SETTINGS.top_p);
  s.max_tokens = Math.max(1, Math.round(number("set-max-tokens", DEFAULT_SETTINGS.max_tokens)));
  const seed = $("set-seed").value.trim();
  s.seed = seed === "" ? null : Math.round(Number(seed));
  save();
}

$("settings").addEventListener("input", readSettings);
$("settings").addEventListener("submit", (ev) => ev.preventDefault());
$("toggle-settings").addEventListener("click", (ev) => {
  const panel = $("settings");
  panel.hidden = !panel.hidden;
  ev.currentTarget.setAttribute("aria-expanded", String(!panel.hidden));
  if (!panel.hidden) $("set-system").focus();
});
$("toggle-sidebar").addEventListener("click", (ev) => {
  const open = document.getElementById("app").classList.toggle("sidebar-open");
  ev.currentTarget.setAttribute("aria-expanded", String(open));
});
$("new-chat").addEventListener("click", () => {
  if (running) return;
  if (current().messages.length) newConversation();
  renderAll();
  input.focus();
});
$("form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = input.value.trim();
  if (!text || running) return;
  input.value = "";
  send(text);
});
input.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("form").requestSubmit(); }
});
stopButton.addEventListener("click", stop);
document.addEventListener("keydown", (ev) => {
  if (ev.key === "Escape" && running) { ev.preventDefault(); stop(); }
  if (ev.altKey && (ev.key === "n" || ev.key === "N")) { ev.preventDefault(); $("new-chat").click(); }
});

renderAll();
loadModel();
input.focus();
