// The chat page: the conversation is kept here and sent whole to /v1/chat/completions (stream: true) on every
// turn; the server's prompt cache keeps the shared beginning, so only the new turn is evaluated.
"use strict";

const $ = (id) => document.getElementById(id);
const messagesEl = $("messages"), promptEl = $("prompt"), sendEl = $("send"), stopEl = $("stop");
const speedEl = $("speed"), statusEl = $("status");
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "api_key"];

let history = [];  // [{role, content}] of the turns that completed or were stopped
let controller = null;  // the AbortController of the reply being streamed

for (const id of SETTINGS) {  // settings survive a reload (the API key too: it is this browser's own storage)
  const saved = localStorage.getItem("ninfer." + id);
  if (saved !== null) $(id).value = saved;
  $(id).addEventListener("change", () => localStorage.setItem("ninfer." + id, $(id).value));
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "message " + role;
  el.textContent = text;  // text, never HTML: the model's output is not trusted markup
  messagesEl.appendChild(el);
  messagesEl.scrollTop = messagesEl.scrollHeight;
  return el;
}

function number(id, low, high, integer) {
  const v = Number($(id).value);
  if ($(id).value.trim() === "" || !Number.isFinite(v) || v < low || v > high || (integer && !Number.isInteger(v))) {
    throw new Error(`${id} must be ${integer ? "an integer" : "a number"} from ${low} to ${high}`);
  }
  return v;
}

function requestBody(messages) {
  return {
    messages, stream: true, stream_options: { include_usage: true },
    temperature: number("temperature", 0, 2, false), top_p: number("top_p", 0, 1, false),
    max_tokens: number("max_tokens", 1, 1e9, true),
  };
}

// Server-sent events from a fetch body: yields each `data:` payload as it completes.
async function* sseData(body) {
  const reader = body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

function showSpeed(tokens, tFirst, tEnd, tSend, stopped) {
  // Decode speed: the tokens after the first over the time since the first arrived (the prompt is not in it).
  const rate = tokens > 1 && tEnd > tFirst ? (tokens - 1) / ((tEnd - tFirst) / 1e3) : 0;
  speedEl.dataset.tokensPerSecond = rate.toFixed(2);
  speedEl.textContent = `${rate.toFixed(1)} tokens/s (${tokens} tokens${stopped ? ", stopped" : ""}, ` +
    `first token after ${Math.round(tFirst - tSend)} ms)`;
}

async function send(text) {
  statusEl.textContent = "";
  const system = $("system").value.trim();
  const turn = { role: "user", content: text };
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...history, turn];
  let body;
  try {
    body = requestBody(messages);
  } catch (e) {
    statusEl.textContent = e.message;
    return;
  }
  promptEl.value = "";
  addMessage("user", text);
  const replyEl = addMessage("assistant", "");
  controller = new AbortController();
  sendEl.disabled = true;
  stopEl.disabled = false;
  let reply = "", tokens = 0, chunks = 0, tFirst = 0, stopped = false;
  const tSend = performance.now();
  try {
    const r = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!r.ok) {
      let message = `HTTP ${r.status}`;
      try { message = (await r.json()).error.message || message; } catch (_) { /* not JSON */ }
      throw new Error(message);
    }
    for await (const data of sseData(r.body)) {
      if (data === "[DONE]") break;
      const event = JSON.parse(data);
      if (event.error) throw new Error(event.error.message);
      if (event.usage) tokens = event.usage.completion_tokens;
      const piece = event.choices && event.choices[0] && event.choices[0].delta.content;
      if (piece) {
        if (!tFirst) tFirst = performance.now();
        chunks += 1;
        reply += piece;
        replyEl.textContent = reply;
        messagesEl.scrollTop = messagesEl.scrollHeight;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      stopped = true;
      replyEl.classList.add("stopped");
    } else {
      replyEl.classList.add("error");
      replyEl.textContent = (reply ? reply + "\n" : "") + "Error: " + e.message;
    }
  } finally {
    controller = null;
    sendEl.disabled = false;
    stopEl.disabled = true;
  }
  // A stopped reply has no usage chunk: its chunks count its tokens (a chunk holds at least one).
  if (tFirst) showSpeed(tokens || chunks, tFirst, performance.now(), tSend, stopped);
  if (reply) history.push(turn, { role: "assistant", content: reply });
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = promptEl.value.trim();
  if (text && !controller) send(text);
});
promptEl.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
stopEl.addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  history = [];
  messagesEl.textContent = "";
  speedEl.textContent = "";
});

function showModel() {  // (again when the API key changes: without the right one the server says 401)
  fetch("v1/models", { headers: headers() })
    .then((r) => (r.ok ? r.json() : null))
    .then((m) => { $("model").textContent = m && m.data && m.data[0] ? m.data[0].id : ""; })
    .catch(() => {});
}
$("api_key").addEventListener("change", showModel);
showModel();
