// Tandem playground: ask the served model about an image, or chat with it.
//
// Plain JavaScript, no dependencies. It calls the server's public routes
// (/v1/chat/completions, /v1/query, /v1/caption, /v1/point, /v1/detect) and
// polls /v1/stats for the live figures. The API key, when the server has one,
// lives in sessionStorage and goes out as "Authorization: Bearer KEY".
"use strict";

const KEY_STORE = "tandem-api-key";
const MAX_IMAGE_SIDE = 2048; // larger images are scaled down before upload (the encoder resizes anyway)
const $ = (id) => document.getElementById(id);

const MODES = {
  chat: { image: "none", placeholder: "Say something",
          help: "Chat with the model, without an image. The conversation goes on until New chat." },
  query: { image: "optional", placeholder: "Ask a question about the image",
           help: "A question about the image (or, without one, to the model alone)." },
  caption: { image: "required", placeholder: "(a caption needs no question)",
             help: "Describe the image; choose how long." },
  point: { image: "required", placeholder: "What to point at, e.g. person",
           help: "Points come back as normalised (x, y) and are drawn as dots." },
  detect: { image: "required", placeholder: "What to find, e.g. face",
            help: "Boxes come back as normalised corners and are drawn as rectangles." },
};

const state = {
  image: null,       // the image as a data: URL, or null
  history: [],       // the chat so far: [{role, content}]
  abort: null,       // the AbortController of the request in flight
  needKey: false,    // the server answered 401: wait for a key
  lastStats: null,   // the previous /v1/stats answer (rates are differences)
  vision: undefined, // whether the model takes images (false: it said it does not)
};

// --------------------------------------------------------------------------- HTTP

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { Authorization: "Bearer " + key } : {};
}

// fetch, with the key; an error status becomes an ApiError carrying the server's message.
async function api(path, body, signal) {
  const init = body === undefined
    ? { headers: authHeaders(), signal }
    : { method: "POST", headers: { ...authHeaders(), "Content-Type": "application/json" },
        body: JSON.stringify(body), signal };
  const res = await fetch(path, init);
  if (res.ok) {
    if (state.needKey) keyAccepted();
    return res;
  }
  let message = `${res.status} ${res.statusText}`;
  try {
    message = (await res.json()).error.message;
  } catch (_) { /* not our JSON error: keep the status line */ }
  if (res.status === 401) askForKey();
  throw new ApiError(res.status, message);
}

// The JSON objects of a server-sent event stream ("data: {...}" lines; "[DONE]" ends it).
async function* sseEvents(res) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          yield JSON.parse(data);
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// --------------------------------------------------------------------------- API key

function askForKey() {
  state.needKey = true;
  showStatus(sessionStorage.getItem(KEY_STORE)
    ? "The server refused this API key: check it and enter it again."
    : "This server needs an API key: enter it above.", true);
}

function keyAccepted() {
  state.needKey = false;
  showStatus("API key accepted.");
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const key = $("api-key").value.trim();
  if (key) sessionStorage.setItem(KEY_STORE, key);
  else sessionStorage.removeItem(KEY_STORE);
  state.needKey = false;
  showStatus("");
  loadModel();
});

async function loadModel() {
  try {
    const models = await (await api("/v1/models")).json();
    $("model").textContent = models.data[0].id;
  } catch (e) {
    if (e.status !== 401) showStatus(`The server did not answer: ${e.message}`, true);
  }
}

// --------------------------------------------------------------------------- the image

function loadFile(file) {
  if (!file) return;
  if (!file.type.startsWith("image/")) {
    showStatus(`${file.name} is not an image.`, true);
    return;
  }
  const reader = new FileReader();
  reader.onload = () => setImage(reader.result, file.name).catch(() => showStatus(`${file.name}: cannot read this image.`, true));
  reader.readAsDataURL(file);
}

async function setImage(url, name) {
  const img = new Image();
  img.src = url;
  await img.decode();
  const side = Math.max(img.naturalWidth, img.naturalHeight);
  if (side > MAX_IMAGE_SIDE) {
    const scale = MAX_IMAGE_SIDE / side;
    const canvas = document.createElement("canvas");
    canvas.width = Math.round(img.naturalWidth * scale);
    canvas.height = Math.round(img.naturalHeight * scale);
    canvas.getContext("2d").drawImage(img, 0, 0, canvas.width, canvas.height);
    url = canvas.toDataURL("image/jpeg", 0.92);
  }
  state.image = url;
  $("photo").src = url;
  $("stage").hidden = false;
  $("drop-hint").hidden = true;
  $("clear-image").hidden = false;
  $("image-name").textContent = `${name} · ${img.naturalWidth}×${img.naturalHeight}`;
  clearMarks();
  if (state.vision === false) {
    showStatus(`This model (${$("model").textContent}) takes no images: questions go to it without the image.`);
  } else {
    if (currentMode() === "chat") setMode("query");
    showStatus("");
  }
}

function clearImage() {
  state.image = null;
  $("photo").removeAttribute("src");
  $("stage").hidden = true;
  $("drop-hint").hidden = false;
  $("clear-image").hidden = true;
  $("image-name").textContent = "";
  $("file").value = "";
  clearMarks();
}

const drop = $("drop");
drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (e) => {
  e.preventDefault();
  drop.classList.remove("over");
  loadFile(e.dataTransfer.files[0]);
});
document.addEventListener("paste", (e) => {
  const item = [...e.clipboardData.items].find((i) => i.type.startsWith("image/"));
  if (item) loadFile(item.getAsFile());
});
$("file").addEventListener("change", (e) => loadFile(e.target.files[0]));
$("clear-image").addEventListener("click", clearImage);

// --------------------------------------------------------------------------- marks over the image

// Marks sit at percentages of the image box, so they follow it when the page is resized.
// Each keeps the coordinates it was drawn from in data- attributes.
function drawPoints(points) {
  $("overlay").replaceChildren(...points.map((p, i) => {
    const el = mark("point", i, { x: p.x, y: p.y });
    el.style.left = pct(p.x);
    el.style.top = pct(p.y);
    return el;
  }));
}

function drawBoxes(objects) {
  $("overlay").replaceChildren(...objects.map((o, i) => {
    const el = mark("box", i, { "x-min": o.x_min, "y-min": o.y_min, "x-max": o.x_max, "y-max": o.y_max });
    const [x0, x1] = [Math.min(o.x_min, o.x_max), Math.max(o.x_min, o.x_max)];
    const [y0, y1] = [Math.min(o.y_min, o.y_max), Math.max(o.y_min, o.y_max)];
    Object.assign(el.style, { left: pct(x0), top: pct(y0), width: pct(x1 - x0), height: pct(y1 - y0) });
    return el;
  }));
}

function mark(kind, index, coords) {
  const el = document.createElement("div");
  el.className = "mark-" + kind;
  for (const [name, value] of Object.entries(coords)) el.setAttribute("data-" + name, String(value));
  const label = document.createElement("span");
  label.className = "mark-label";
  label.textContent = String(index + 1);
  el.append(label);
  return el;
}

function clearMarks() {
  $("overlay").replaceChildren();
}

const pct = (v) => `${100 * v}%`;

// --------------------------------------------------------------------------- modes

function currentMode() {
  return document.querySelector("input[name=mode]:checked").value;
}

function setMode(mode) {
  document.querySelector(`input[name=mode][value=${mode}]`).checked = true;
  showMode();
}

function showMode() {
  const mode = currentMode();
  const spec = MODES[mode];
  $("prompt").placeholder = spec.placeholder;
  $("prompt").disabled = mode === "caption";
  $("caption-length").hidden = mode !== "caption";
  $("mode-help").textContent = spec.help;
}

document.querySelectorAll("input[name=mode]").forEach((r) => r.addEventListener("change", showMode));

// Once the server says its model takes no images, the modes that need one are turned off.
function showVision(vision, model) {
  state.vision = vision;
  for (const [mode, spec] of Object.entries(MODES)) {
    const radio = document.querySelector(`input[name=mode][value=${mode}]`);
    radio.disabled = spec.image === "required" && vision === false;
    radio.parentElement.title = radio.disabled ? `this model (${model}) takes no images` : "";
  }
  if (vision === false && MODES[currentMode()].image === "required") setMode("chat");
}

// --------------------------------------------------------------------------- asking

$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  if (!state.abort) ask(currentMode(), $("prompt").value.trim());
});
$("stop").addEventListener("click", () => state.abort && state.abort.abort());
$("clear-chat").addEventListener("click", () => {
  state.history = [];
  $("transcript").replaceChildren();
  showJson({});
});

async function ask(mode, text) {
  const spec = MODES[mode];
  if (spec.image === "required" && !state.image) return showStatus("This mode needs an image: drop one on the left.", true);
  if (mode !== "caption" && !text) return showStatus("Type something first.", true);
  showStatus("");
  clearMarks();
  const sendImage = spec.image !== "none" && state.image && state.vision !== false;
  addTurn("user", `you · ${mode}${sendImage ? " · image" : ""}`, mode === "caption" ? `caption (${$("caption-length").value})` : text);
  const answer = addTurn("assistant", "tandem", "");
  const meter = new RequestMeter();
  state.abort = new AbortController();
  setBusy(true);
  try {
    if (mode === "point" || mode === "detect") {
      await located(mode, text, answer, state.abort.signal);
    } else {
      await streamed(mode, text, sendImage, answer, meter, state.abort.signal);
      $("prompt").value = "";
    }
  } catch (e) {
    if (e.name === "AbortError") {
      answer.text.textContent += " [stopped]";
    } else {
      answer.el.classList.add("error");
      answer.text.textContent = e.message;
    }
  } finally {
    answer.el.classList.remove("streaming");
    state.abort = null;
    setBusy(false);
  }
}

// Chat, query and caption: the answer streams in, piece by piece.
async function streamed(mode, text, sendImage, answer, meter, signal) {
  let route, body;
  if (mode === "chat") {
    const messages = [...state.history, { role: "user", content: text }];
    route = "/v1/chat/completions";
    body = { messages, stream: true, stream_options: { include_usage: true }, max_tokens: maxTokens() };
    const t = temperature();
    if (t !== undefined) body.temperature = t;
  } else {
    route = "/v1/" + mode;
    body = mode === "query" ? { question: text } : { length: $("caption-length").value };
    if (sendImage) body.image_url = state.image;
    body.stream = true;
    body.settings = settings();
  }
  answer.el.classList.add("streaming");
  const res = await api(route, body, signal);
  let full = "", finish = null, usage = null, id = null;
  for await (const ev of sseEvents(res)) {
    if (ev.error) throw new ApiError(500, ev.error.message);
    let piece = "";
    if (mode === "chat") {
      id = ev.id || id;
      const choice = ev.choices && ev.choices[0];
      if (choice) {
        piece = choice.delta.content || "";
        finish = choice.finish_reason || finish;
      }
      usage = ev.usage || usage;
    } else if (ev.completed) {
      finish = ev.finish_reason;
      usage = ev.usage;
    } else {
      piece = ev.chunk || "";
    }
    if (piece) {
      full += piece;
      answer.text.textContent = full;
      meter.piece();
      scrollTranscript();
    }
  }
  meter.usage(usage);
  if (mode === "chat") {
    state.history.push({ role: "user", content: text }, { role: "assistant", content: full });
    showJson({ id, object: "chat.completion", finish_reason: finish, message: { role: "assistant", content: full }, usage });
  } else {
    showJson({ [mode === "caption" ? "caption" : "answer"]: full, finish_reason: finish, usage });
  }
}

// Point and detect: one JSON answer, drawn over the image.
async function located(mode, text, answer, signal) {
  const body = { object: text, image_url: state.image, settings: settings() };
  const t0 = performance.now();
  const result = await (await api("/v1/" + mode, body, signal)).json();
  showJson(result);
  const ms = Math.round(performance.now() - t0);
  if (mode === "point") {
    drawPoints(result.points);
    answer.text.textContent = `${result.points.length} point${result.points.length === 1 ? "" : "s"} (${ms} ms)`;
  } else {
    drawBoxes(result.objects);
    answer.text.textContent = `${result.objects.length} object${result.objects.length === 1 ? "" : "s"} (${ms} ms)`;
  }
}

function settings() {
  const s = { max_tokens: maxTokens() };
  const t = temperature();
  if (t !== undefined) s.temperature = t;
  const n = parseInt($("max-objects").value, 10);
  if (n > 0) s.max_objects = n;
  return s;
}

function maxTokens() {
  return parseInt($("max-tokens").value, 10) || 256;
}

function temperature() {
  const t = parseFloat($("temperature").value);
  return Number.isFinite(t) ? t : undefined;
}

// --------------------------------------------------------------------------- page pieces

function addTurn(role, who, text) {
  const el = document.createElement("div");
  el.className = "turn " + role;
  const whoEl = document.createElement("div");
  whoEl.className = "who";
  whoEl.textContent = who;
  const textEl = document.createElement("div");
  textEl.className = "text";
  textEl.textContent = text;
  el.append(whoEl, textEl);
  $("transcript").append(el);
  scrollTranscript();
  return { el, text: textEl };
}

function scrollTranscript() {
  const t = $("transcript");
  t.scrollTop = t.scrollHeight;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
  document.body.dataset.busy = busy ? "1" : "";
}

function showStatus(message, isError = false) {
  const s = $("status");
  s.textContent = message;
  s.classList.toggle("error", isError && !!message);
}

function showJson(obj) {
  $("json").textContent = JSON.stringify(obj, null, 2);
}

// A figure, shown formatted; data-value keeps the number.
function showFigure(id, value, text) {
  const el = $(id);
  el.textContent = value === null || value === undefined ? "–" : text;
  el.dataset.value = value === null || value === undefined ? "" : String(value);
}

// --------------------------------------------------------------------------- figures

// This request's figures, measured here: time to first token (from sending to the first
// piece of text) and tokens/s after it (pieces while streaming; the server's count at the end).
class RequestMeter {
  constructor() {
    this.t0 = performance.now();
    this.first = null;
    this.pieces = 0;
    showFigure("fig-ttft", null);
    showFigure("fig-tps", null);
  }

  piece() {
    const now = performance.now();
    this.pieces += 1;
    if (this.first === null) {
      this.first = now;
      showFigure("fig-ttft", now - this.t0, `${Math.round(now - this.t0)} ms`);
    } else {
      this.rate(this.pieces - 1, now);
    }
  }

  usage(usage) {
    if (usage && this.first !== null) this.rate(usage.completion_tokens - 1, performance.now());
  }

  rate(tokens, now) {
    const seconds = (now - this.first) / 1000;
    if (seconds > 0 && tokens > 0) showFigure("fig-tps", tokens / seconds, formatRate(tokens / seconds));
  }

}

// The server's figures: rates over the interval between two /v1/stats answers.
function showStats(s) {
  const prev = state.lastStats;
  state.lastStats = s;
  $("model").textContent = s.model;
  const info = s.info;
  if (!info) return; // the server loop was too busy to answer this time
  showVision(info.vision, s.model);
  if (!info.worker_ready) showStatus("The model is loading…");
  else if ($("status").textContent === "The model is loading…") showStatus("");
  if (info.running === undefined) return; // no engine figures yet
  const waiting = info.waiting + (info.unsent || 0);
  showFigure("fig-requests", info.running, `${info.running} / ${waiting}`);
  const used = info.kv_pages_total ? (info.kv_pages_total - info.kv_pages_free) / info.kv_pages_total : null;
  showFigure("fig-kv", used, used === null ? "" : `${(100 * used).toFixed(1)}%`);

  const p = prev && prev.info;
  const dt = p ? s.time_s - prev.time_s : 0;
  if (!p || p.generation !== info.generation || dt <= 0) return; // counters restart with a new worker
  const tps = (info.committed_tokens - p.committed_tokens) / dt;
  showFigure("fig-server-tps", tps, formatRate(tps));
  const idle = info.bubble_idle_s - p.bubble_idle_s;
  const busy = info.bubble_busy_s - p.bubble_busy_s;
  if (idle + busy > 0) {
    showFigure("fig-idle", idle / (idle + busy), `${(100 * idle / (idle + busy)).toFixed(2)}%`);
    $("fig-idle-note").textContent = "of the decode loop, now";
  } else if (info.device_idle_fraction !== undefined) {
    showFigure("fig-idle", info.device_idle_fraction, `${(100 * info.device_idle_fraction).toFixed(2)}%`);
    $("fig-idle-note").textContent = "of the decode loop, since start";
  }
  const finished = s.requests.ttft_count - prev.requests.ttft_count;
  if (finished > 0) {
    const mean = (s.requests.ttft_sum_s - prev.requests.ttft_sum_s) / finished;
    $("fig-ttft").nextElementSibling.textContent = `this request · server ${Math.round(1000 * mean)} ms`;
  }
}

function formatRate(r) {
  return r >= 100 ? Math.round(r).toString() : r.toFixed(1);
}

async function pollStats() {
  if (!state.needKey) {
    try {
      showStats(await (await api("/v1/stats")).json());
    } catch (e) {
      // 401: askForKey has said so; anything else (a restart, the server gone): try again later
    }
  }
  setTimeout(pollStats, state.abort ? 250 : 1000);
}

// --------------------------------------------------------------------------- start

$("api-key").value = sessionStorage.getItem(KEY_STORE) || "";
showMode();
loadModel();
pollStats();
