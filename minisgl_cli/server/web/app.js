// minisgl web page: a chat pane on /v1/chat/completions, an image tab on /v1/images/generations (streamed
// previews), and a live view of the engine (and the media queue) polled from /metrics/live. Plain JS, no
// libraries, same origin only.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "minisgl.apiKey"; // sessionStorage: this tab only
const PLOT_POINTS = 120;
const RECENT_ROWS = 12;
const query = new URLSearchParams(location.search);
const INTERVAL_S = Math.max(0.2, Number(query.get("interval")) || 1);

const state = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  config: null,
  history: [], // the conversation sent with each turn (the system prompt is added per request)
  chat: null, // the AbortController of the answer being streamed
  series: { prefill: [], decode: [] },
  recentId: -1, // the newest request in the table
};

// --- HTTP ------------------------------------------------------------------------------------------------
class AuthError extends Error {}

function headers(extra = {}) {
  return state.key ? { ...extra, Authorization: `Bearer ${state.key}` } : extra;
}

async function errorText(res) {
  try {
    const body = await res.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (_) {
    return `HTTP ${res.status}`;
  }
}

// POST JSON; 401 raises AuthError, any other non-2xx an Error with the server's message.
async function post(path, body, signal) {
  const res = await fetch(path, {
    method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body), signal,
  });
  if (res.status === 401) throw new AuthError(await errorText(res));
  if (!res.ok) throw new Error(await errorText(res));
  return res;
}

// Server-sent events from a fetch response: the chat stream (a POST with a key, which EventSource cannot send).
async function* events(res) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, end);
      buf = buf.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of frame.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// --- the API key -----------------------------------------------------------------------------------------
let keyWait = null;

// Show the key prompt (once, however many callers ask) and resolve when a key is entered.
function askKey(message) {
  $("key-error").textContent = message || "";
  if (keyWait) return keyWait;
  $("key-overlay").hidden = false;
  $("key-input").value = "";
  $("key-input").focus();
  keyWait = new Promise((resolve) => {
    $("key-form").onsubmit = (e) => {
      e.preventDefault();
      state.key = $("key-input").value.trim();
      sessionStorage.setItem(KEY_STORE, state.key);
      $("key-overlay").hidden = true;
      $("forget-key").hidden = false;
      keyWait = null;
      resolve();
    };
  });
  return keyWait;
}

function forgetKey() {
  sessionStorage.removeItem(KEY_STORE);
  state.key = "";
  location.reload();
}

// --- the live engine pane --------------------------------------------------------------------------------
function setConn(text, cls) {
  const el = $("conn");
  el.textContent = text;
  el.className = `conn ${cls || ""}`;
}

// Poll /metrics/live every INTERVAL_S while the tab is visible (a hidden tab costs the server nothing).
async function watchEngine() {
  for (;;) {
    if (document.hidden) await new Promise((r) => document.addEventListener("visibilitychange", r, { once: true }));
    const t0 = performance.now();
    try {
      const res = await fetch("/metrics/live", { headers: headers(), cache: "no-store" });
      if (res.status === 401) {
        setConn("API key needed", "bad");
        await askKey(state.key ? "That key was refused." : "");
        continue;
      }
      if (!res.ok) throw new Error(await errorText(res));
      const m = await res.json();
      applyConfig(m.page);
      render(m);
      setConn("live", "live");
    } catch (err) {
      setConn(`offline (${err.message})`, "bad");
      await sleep(2000);
      continue;
    }
    await sleep(Math.max(0, INTERVAL_S * 1000 - (performance.now() - t0)));
  }
}

function applyConfig(cfg) {
  state.config = cfg;
  show("model", `${cfg.model} · engine ${cfg.engine} on ${cfg.device} ${cfg.dtype} · context ${cfg.max_context_len}`);
  const tab = $("image-tab");
  if (tab.hidden !== !cfg.image_model) {
    tab.hidden = !cfg.image_model;
    tab.title = cfg.image_model || "";
  }
}

// Write only what changed: an unchanged page costs the browser no layout or paint.
function show(id, text) {
  const el = $(id);
  if (el.textContent !== text) el.textContent = text;
}

function width(id, percent) {
  const el = $(id);
  const w = `${percent.toFixed(2)}%`;
  if (el.style.width !== w) el.style.width = w;
}

const fmt = (n) => (n == null ? "–" : Number(n).toLocaleString("en-US"));
const fixed = (n, d = 1) => (n == null ? "–" : Number(n).toFixed(d));
// A figure the engine does not have (null in /metrics: the hf and mlx engines' KV pool, hf's cache hits).
const na = (n, text) => (n == null ? "n/a" : text);

function render(m) {
  const s = m.scheduler;
  const tp = m.throughput || {};
  show("m-running", fmt(s.running));
  show("m-waiting", fmt(s.waiting));
  show("m-inflight", fmt(m.server.inflight));
  show("m-hit", na(s.cache_hit_rate, `${fixed(100 * s.cache_hit_rate)}%`));
  show("m-finished", fmt(s.finished_requests));
  show("m-aborted", fmt(s.aborted_requests));
  show("uptime", `up ${Math.round(m.uptime_s)} s`);

  const total = s.tokens_total || 1;
  width("kv-used-bar", (100 * s.tokens_in_use) / total);
  width("kv-cached-bar", (100 * s.tokens_cached) / total);
  show("m-kv-used", na(s.tokens_in_use, fmt(s.tokens_in_use)));
  show("m-kv-cached", na(s.tokens_cached, fmt(s.tokens_cached)));
  show("m-kv-free", na(s.tokens_free, fmt(s.tokens_free)));
  show("m-kv-total", na(s.tokens_total, fmt(s.tokens_total)));

  const prefill = tp.prefill_tok_s ?? s.prefill_tok_s;
  const decode = tp.decode_tok_s ?? s.decode_tok_s;
  show("m-prefill", fixed(prefill));
  show("m-decode", fixed(decode));
  // Which CPU decode step runs (cpu_step/compiled.py); CUDA decodes through graphs, not this.
  const cpu = m.engine && m.engine.device === "cpu";
  show("m-step", !cpu ? "" : s.decode_step === "building" ? "(eager: the compiled step is building)"
    : `(${s.decode_step} step)`);
  plot("plot-prefill", state.series.prefill, prefill, "#e0802c");
  plot("plot-decode", state.series.decode, decode, "#2f6fde");
  renderRecent(m.recent || []);
  renderMedia(m.media);
}

// The media worker's queue, where /metrics has a "media" section (a server without one shows nothing): its
// waiting and running jobs, then the jobs ended, the batch sizes and the step time (MediaService.metrics).
function renderMedia(media) {
  $("media-live").hidden = !media;
  if (!media) return;
  show("m-media-queued", fmt(media.queued));
  show("m-media-inflight", fmt(media.running));
  const jobs = media.jobs || {};
  const batches = media.batches || {};
  const step = media.step_ms || {};
  show("m-media-extra", [`completed ${fmt(jobs.completed)}`, `cancelled ${fmt(jobs.cancelled)}`,
    `failed ${fmt(jobs.failed)}`, `batch ${fixed(batches.mean_size, 2)} (last ${fmt(batches.last_size)})`,
    `step ${fixed(step.mean, 1)} ms (last ${fixed(step.last, 1)})`].join(" · "));
}

// The last requests, newest first; rebuilt only when a request has ended since the last event.
function renderRecent(recent) {
  const newest = recent.length ? recent[recent.length - 1].id : 0;
  if (newest === state.recentId) return;
  state.recentId = newest;
  const rows = recent.slice(-RECENT_ROWS).reverse();
  const body = document.createElement("tbody");
  for (const r of rows) {
    const tr = body.insertRow();
    const cells = [r.id, r.api || "", r.finish, fmt(r.prompt_tokens), fmt(r.cached_tokens), fmt(r.completion_tokens),
      fixed(r.ttft_ms, 0), fixed(r.tpot_ms, 1)];
    for (const c of cells) tr.insertCell().textContent = c;
    tr.cells[2].className = r.finish;
  }
  $("recent").tBodies[0].replaceWith(body);
}

// A small time plot: the last PLOT_POINTS samples, scaled to their maximum; not redrawn while all are 0.
function plot(id, series, value, color) {
  series.push(Number(value) || 0);
  if (series.length > PLOT_POINTS) series.shift();
  const canvas = $(id);
  const flat = series.every((v) => v === 0);
  if (flat && canvas.dataset.flat === "1") return;
  canvas.dataset.flat = flat ? "1" : "0";
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 300;
  const h = canvas.clientHeight || 70;
  if (canvas.width !== Math.round(w * dpr)) { canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr); }
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  const top = Math.max(1, ...series) * 1.15;
  const x = (i) => w - (series.length - 1 - i) * (w / (PLOT_POINTS - 1));
  const y = (v) => h - 2 - (v / top) * (h - 14);
  g.beginPath();
  series.forEach((v, i) => (i ? g.lineTo(x(i), y(v)) : g.moveTo(x(i), y(v))));
  g.strokeStyle = color;
  g.lineWidth = 1.5;
  g.stroke();
  g.lineTo(x(series.length - 1), h);
  g.lineTo(x(0), h);
  g.closePath();
  g.globalAlpha = 0.15;
  g.fillStyle = color;
  g.fill();
  g.globalAlpha = 1;
  g.fillStyle = "#6b7383";
  g.font = "10px system-ui, sans-serif";
  g.fillText(`max ${top / 1.15 >= 10 ? Math.round(top / 1.15) : (top / 1.15).toFixed(1)}`, 4, 11);
}

// --- chat ------------------------------------------------------------------------------------------------
function addMessage(role, text) {
  $("empty").hidden = true;
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const span = document.createElement("span");
  span.className = "text";
  span.textContent = text;
  div.append(span);
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function setMeta(div, text) {
  let meta = div.querySelector(".meta");
  if (!meta) {
    meta = document.createElement("span");
    meta.className = "meta";
    div.append(meta);
  }
  meta.textContent = text;
}

function chatBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function sendChat(text) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content: text });
  const body = {
    model: (state.config && state.config.model) || "default", messages, stream: true,
    stream_options: { include_usage: true }, temperature: Number($("temperature").value) || 0,
  };
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;

  addMessage("user", text);
  const div = addMessage("assistant", "");
  const out = div.querySelector(".text");
  div.classList.add("streaming");
  const controller = new AbortController();
  state.chat = controller;
  chatBusy(true);
  const t0 = performance.now();
  let ttft = null;
  let finish = null;
  let usage = null;
  try {
    let res;
    for (;;) {
      try {
        res = await post("/v1/chat/completions", body, controller.signal);
        break;
      } catch (err) {
        if (!(err instanceof AuthError)) throw err;
        await askKey(state.key ? "That key was refused." : "");
      }
    }
    for await (const ev of events(res)) {
      if (ev.data === "[DONE]") break;
      const chunk = JSON.parse(ev.data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = (choice.delta && choice.delta.content) || "";
        if (piece) {
          if (ttft === null) ttft = performance.now() - t0;
          out.textContent += piece;
          div.scrollIntoView({ block: "end" });
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    const secs = (performance.now() - t0) / 1000;
    const tokens = usage ? usage.completion_tokens : null;
    const rate = tokens && ttft !== null && secs > ttft / 1000 ? (tokens - 1) / (secs - ttft / 1000) : null;
    setMeta(div, [tokens != null ? `${tokens} tokens` : null, ttft !== null ? `TTFT ${Math.round(ttft)} ms` : null,
      rate ? `${rate.toFixed(1)} tok/s` : null, finish].filter(Boolean).join(" · "));
    state.history.push({ role: "user", content: text }, { role: "assistant", content: out.textContent });
  } catch (err) {
    if (controller.signal.aborted) {
      setMeta(div, "stopped: the request was aborted");
      div.dataset.finish = "stopped";
      // Keep what was shown, so the next turn continues the conversation as the user saw it.
      state.history.push({ role: "user", content: text }, { role: "assistant", content: out.textContent });
    } else {
      div.classList.add("error");
      out.textContent = out.textContent || err.message;
      setMeta(div, `error: ${err.message}`);
    }
  } finally {
    div.classList.remove("streaming");
    if (finish) div.dataset.finish = finish;
    state.chat = null;
    chatBusy(false);
  }
}

function stopChat() {
  if (state.chat) state.chat.abort();
}

function newChat() {
  stopChat();
  state.history = [];
  for (const el of [...$("messages").querySelectorAll(".msg")]) el.remove();
  $("empty").hidden = false;
}

// --- images ----------------------------------------------------------------------------------------------
// Asked for as a stream (OpenAI's images streaming API): `image_generation.partial_image` events carry previews
// ({b64_json, partial_image_index}), then `image_generation.completed` the final image, one per image of n
// (an `index` field, where the server sends one, says which). A server that answers JSON instead gets the
// whole answer shown at once.
const IMAGE_PREVIEWS = 2;

function imageSlots(n, prompt) {
  const slots = [];
  for (let i = 0; i < n; i++) {
    const img = document.createElement("img");
    img.alt = prompt;
    img.className = "pending";
    slots.push(img);
  }
  $("images").prepend(...slots);
  return slots;
}

function showImage(img, data, final) {
  img.src = `data:image/${data.output_format || "png"};base64,${data.b64_json}`;
  img.classList.toggle("pending", !final);
  img.dataset.final = final ? "1" : "0";
}

async function generateImage() {
  const prompt = $("image-prompt").value.trim();
  if (!prompt) return;
  const n = Math.max(1, parseInt($("image-n").value, 10) || 1);
  const body = { prompt, size: $("image-size").value.trim(), steps: parseInt($("image-steps").value, 10) || 9,
    n, response_format: "b64_json", stream: true, partial_images: IMAGE_PREVIEWS };
  const seed = $("image-seed").value;
  if (seed !== "") body.seed = parseInt(seed, 10);
  $("image-go").disabled = true;
  $("image-status").textContent = "generating…";
  const t0 = performance.now();
  const secs = () => ((performance.now() - t0) / 1000).toFixed(1);
  let slots = null;
  try {
    let res;
    for (;;) {
      try {
        res = await post("/v1/images/generations", body);
        break;
      } catch (err) {
        if (!(err instanceof AuthError)) throw err;
        await askKey(state.key ? "That key was refused." : "");
      }
    }
    slots = imageSlots(n, prompt);
    let size = body.size;
    if ((res.headers.get("content-type") || "").startsWith("text/event-stream")) {
      let done = 0;
      let previews = 0;
      for await (const ev of events(res)) {
        if (ev.data === "[DONE]") break;
        const data = JSON.parse(ev.data);
        const type = ev.event !== "message" ? ev.event : data.type;
        if (type === "error" || data.error) throw new Error((data.error && data.error.message) || ev.data);
        const slot = slots[Math.min(n - 1, data.index ?? done)];
        if (type === "image_generation.partial_image") {
          previews += 1;
          showImage(slot, data, false);
          $("image-status").textContent = `preview ${data.partial_image_index + 1} of image ${Math.min(n, done + 1)}`
            + `/${n} · ${secs()} s`;
        } else if (type === "image_generation.completed") {
          showImage(slot, data, true);
          done += 1;
          size = data.size || size;
          $("image-status").textContent = `image ${done}/${n} · ${secs()} s`;
        }
      }
      if (done < n) throw new Error(`the stream ended after ${done} of ${n} images`);
      $("image-status").textContent = `${size} · ${n} image${n > 1 ? "s" : ""} in ${secs()} s`
        + ` · ${previews} preview${previews === 1 ? "" : "s"} (streamed)`;
    } else {
      const out = await res.json();
      out.data.forEach((item, i) => showImage(slots[i] || imageSlots(1, prompt)[0], item, true));
      for (const img of slots.slice(out.data.length)) img.remove();
      $("image-status").textContent = `${out.size || size} · ${out.data.length} image`
        + `${out.data.length > 1 ? "s" : ""} in ${secs()} s`;
    }
  } catch (err) {
    for (const img of slots || []) if (img.dataset.final !== "1") img.remove();
    $("image-status").textContent = `error: ${err.message}`;
  } finally {
    $("image-go").disabled = false;
  }
}

// --- wiring ----------------------------------------------------------------------------------------------
function showTab(name) {
  for (const b of document.querySelectorAll(".tabs button")) b.classList.toggle("active", b.dataset.tab === name);
  $("chat-pane").hidden = name !== "chat";
  $("image-pane").hidden = name !== "image";
}

function main() {
  $("forget-key").hidden = !state.key;
  $("forget-key").onclick = forgetKey;
  for (const b of document.querySelectorAll(".tabs button")) b.onclick = () => showTab(b.dataset.tab);
  $("chat-form").onsubmit = (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.chat) return;
    $("prompt").value = "";
    sendChat(text);
  };
  $("prompt").onkeydown = (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  };
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") stopChat(); });
  $("stop").onclick = stopChat;
  $("new-chat").onclick = newChat;
  $("image-form").onsubmit = (e) => {
    e.preventDefault();
    generateImage();
  };
  watchEngine();
}

main();
