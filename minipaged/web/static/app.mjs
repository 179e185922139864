// The live view: reads the engine's StepEvents (GET /v1/events, or a trace embedded in the page by
// `minipaged export-html` / `watch --replay --web`), folds them with fold.mjs and draws. Everything is drawn
// here, in each browser; the server only streams events. Viewer controls (freeze, step, slider, projector)
// act on the buffered events and never touch the engine.
import { SSEParser } from "./sse.mjs";
import { newState, applyEvent, colour, usedBlocks, orderedRequests, FREE, CACHED, describeLookup, nameOf }
  from "./fold.mjs";
import { el, MAX_CELLS, buildCells, drawMap, drawCpuMap, drawBatch, drawGauges, drawQueues, drawTable, drawLog,
  legend } from "./draw.mjs";

const SLICE_MS = 10;              // reading the stream yields to the browser after this long (stays responsive)
const KEY_STORE = "minipaged-api-key";
const SILENCE_MS = 30000;         // nothing at all (not even the server's heartbeat comment): reconnect
const $ = (id) => document.getElementById(id);
const embedded = $("trace");
const replay = Boolean(embedded);
const params = new URLSearchParams(location.search);
// ?presenter: the teacher's view (with the API key), which selects the teacher's newest request by itself.
const presenter = params.has("presenter") && params.get("presenter") !== "0";
const HIDDEN_TEXT = "(hidden: the teacher shows each student only their own text)";
// Steps kept for stepping back, by count and by the size of their JSON; older ones are folded into `base`.
// (A step of 128 samples sharing a 1,000-token prompt is 0.5 MB: 2,000 of them would be a gigabyte.)
// ?buffer=N and ?buffer_mb=M keep less, for small laptops.
const MAX_BUFFER = Math.max(10, Number(params.get("buffer")) || 2000);
const MAX_BUFFER_CHARS = Math.max(0.1, Number(params.get("buffer_mb")) || 32) * 2 ** 20;
const view = {
  info: null, base: null, events: [], head: null,  // head: the fold of every event (the live state)
  cursor: -1, frozen: replay, shown: null, selected: null, mine: new Set(), cached: null,
  connected: false, goodbye: false, drops: 0, playing: null, abort: null, retry: null, countdown: null,
  streams: 0,                                      // event streams reading now: one (two for a moment on a new key)
  settings: null, own: new Map(), ownLookups: new Map(), teacherIds: [], followed: null,   // the teacher's controls (teacher.py)
};
let drawPending = false;

// ------------------------------------------------------------------------------------------ events in

function start(info) {
  view.info = info;
  view.base = newState(info);
  view.head = newState(info);
  view.events = [];
  view.sizes = [];
  view.bufferChars = 0;
  view.cursor = -1;
  $("engine-name").textContent = `${info.model} · ${info.device} ${info.dtype} · ${info.num_blocks} blocks of `
    + `${info.block_size} tokens · budget ${info.max_num_batched_tokens}` + (info.speculative ? ` · ${info.speculative}` : "");
  ui.window = null;                       // drawMap chooses the KV map's window
  buildCells($("cpu-map"), info.num_cpu_blocks, MAX_CELLS / 4);
  $("cpu-title").hidden = $("cpu-map").hidden = info.num_cpu_blocks === 0;
}

function receive(ev, size) {
  view.events.push(ev);
  view.sizes.push(size);
  view.bufferChars += size;
  applyEvent(view.head, ev);
  while (view.events.length > MAX_BUFFER || (view.bufferChars > MAX_BUFFER_CHARS && view.events.length > 1)) {
    applyEvent(view.base, view.events.shift());
    view.bufferChars -= view.sizes.shift();
    if (view.frozen) view.cursor = Math.max(0, view.cursor - 1);
  }
  if (!view.frozen) view.cursor = view.events.length - 1;
  schedule();
}

/** The "forget key" control: the key leaves this browser, and the stream that used it is closed. */
function forgetKey() {
  localStorage.removeItem(KEY_STORE);
  $("forget-key").hidden = true;
  $("prompt-status").textContent = "the key is forgotten: this browser no longer keeps it";
  connect();                                     // the stream that used it is closed: watch without it, or ask
}

function authHeaders() {
  const key = localStorage.getItem(KEY_STORE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/** One stream at a time: a new connect() (a key given or forgotten, a reconnect) closes the one before. Two would
 * fold steps into one picture, and a keyless one (others' text hidden) would overwrite what a keyed one shows. */
async function connect() {
  if (view.abort) view.abort.abort();
  clearTimeout(view.retry);                      // a reconnect planned for a stream before: this one replaces it
  const abort = new AbortController();
  view.abort = abort;
  const superseded = () => view.abort !== abort;
  view.connected = view.goodbye = false;
  setStatus();
  let response;
  try {
    response = await fetch("v1/events", { headers: authHeaders(), cache: "no-store", signal: abort.signal });
  } catch (err) {
    return superseded() ? undefined : lost(`cannot reach the server (${err.message})`);
  }
  if (superseded()) return;
  if (response.status === 401) { askKey(); return; }
  if (!response.ok) return lost(`the event stream answered ${response.status}`);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = new SSEParser();
  view.connected = true;
  banner(null);
  loadSettings(superseded);
  let dropped = null;
  let heard = Date.now();
  const watchdog = setInterval(() => { if (Date.now() - heard > SILENCE_MS) abort.abort(); }, 1000);
  let slice = performance.now();
  view.streams += 1;
  try {
    for (;;) {
      // Pieces that are already there resolve read() at once, without giving the browser a turn: a big burst
      // would be one long task (a frozen page). Yield every SLICE_MS.
      if (performance.now() - slice > SLICE_MS) {
        await new Promise((resume) => setTimeout(resume, 0));
        slice = performance.now();
      }
      const { value, done } = await reader.read();
      if (done) break;
      heard = Date.now();
      for (const msg of parser.feed(value)) {
        if (msg.event === "message") {
          const record = JSON.parse(msg.data);
          if (record.type === "engine") start(record);
          else if (record.type === "step") receive(record, msg.data.length);
        } else if (msg.event === "teacher") {   // a request the teacher sent (only a keyed page hears these)
          view.teacherIds = [...view.teacherIds.slice(-63), JSON.parse(msg.data).request_id];
          schedule();
        } else if (msg.event === "own_lookup") {  // with others' text hidden: where my own prompt missed
          const own = JSON.parse(msg.data);
          view.ownLookups.set(own.request_id, own.prefix_lookup);
          if (view.ownLookups.size > 64) view.ownLookups.delete(view.ownLookups.keys().next().value);
          schedule();
        } else if (msg.event === "dropped") {
          dropped = JSON.parse(msg.data).reason || "too far behind";
        } else if (msg.event === "goodbye") {
          view.goodbye = true;
          banner(`the server stopped: ${JSON.parse(msg.data).reason || "shutting down"}; this page will `
            + "reconnect when it is back");
        }                               // other names: a newer server's; ignored
      }
    }
  } catch (err) {
    dropped = dropped || `the connection broke (${err.message})`;
  } finally {
    clearInterval(watchdog);
    view.streams -= 1;
  }
  if (superseded()) return;                                             // a newer stream took over
  view.connected = false;
  if (view.goodbye) { setStatus(); view.retry = setTimeout(connect, 5000); return; }   // found again when back
  if (dropped) { view.drops += 1; return lost(`this page fell behind and was dropped (${dropped}); reconnecting from a fresh snapshot`, 500); }
  lost("lost the server; reconnecting");
}

function lost(message, delay = 2000) {
  view.connected = false;
  banner(message);
  setStatus();
  view.retry = setTimeout(connect, delay);
}

function askKey() {
  $("key-form").hidden = false;
  banner("this server wants an API key (asked once, kept in this browser)");
}

// ------------------------------------------------------------------------------------------ drawing


function schedule() {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => { drawPending = false; draw(); });
}

/** The fold at the cursor: the head when live, else the base plus the buffered events up to the cursor. */
function foldAtCursor() {
  if (view.cursor === view.events.length - 1) return view.head;
  const at = view.events[view.cursor];
  if (view.cached && view.cached.event === at) return view.cached.state;   // frozen: events still arrive
  const st = structuredClone(view.base);
  for (let i = 0; i <= view.cursor; i++) applyEvent(st, view.events[i]);
  view.cached = { event: at, state: st };
  return st;
}

const isMine = (rid) => view.mine.has(rid) || view.mine.has(rid.replace(/\.\d+$/, ""));
// What draw.mjs's functions ask of the page (the notebook widget passes its own).
const ui = {
  $, isMine, select: (rid) => select(rid), window: null,
  get selected() { return view.selected; },
  get projector() { return document.body.classList.contains("projector"); },
  get info() { return view.info; },
  showMine: !replay,
};

function draw() {
  if (!view.info) return;
  let st = foldAtCursor();
  if (textHidden()) st = withOwnTextOnly(st);
  view.shown = st;
  if (presenter) followTeacher(st);
  const selected = view.selected && st.requests.has(view.selected) ? st.requests.get(view.selected) : null;
  const dim = selected && (selected.blocks.length || selected.cpu_blocks.length);
  drawMap(ui, st, dim);
  fitMapCells();
  drawCpuMap(ui, st, dim);
  drawBatch(ui, st);
  drawGauges(ui, st);
  drawQueues(ui, st);
  drawTable(ui, st);
  drawLog(ui, st);
  drawOutput(st);
  const slider = $("slider");
  slider.max = String(Math.max(0, view.events.length - 1));
  slider.value = String(Math.max(0, view.cursor));
  $("step-label").textContent = `step ${st.step}` + (view.events.length ? ` (${view.cursor + 1}/${view.events.length} buffered)` : "");
  setStatus();
}

/** Projector mode: the map's cells as big as the space the layout gives the map lets them be (style.css makes the
 * map take what its panel leaves), so that a 1920x1080 screen is filled as a 1366x768 one is; the desk view keeps
 * its fixed cells. */
function fitMapCells() {
  const map = $("map");
  if (!document.body.classList.contains("projector") || !map.children.length) {
    map.style.removeProperty("--cell");
    view.fitted = null;
    return;
  }
  const width = map.clientWidth, height = map.clientHeight, n = map.children.length;
  const key = `${width}x${height}:${n}`;
  if (view.fitted === key) return;
  view.fitted = key;
  const gap = parseFloat(getComputedStyle(map).columnGap) || 0;
  let size = 12;
  for (let s = 160; s > 12; s--) {
    const cols = Math.floor((width + gap) / (s + gap));
    if (cols >= 1 && Math.ceil(n / cols) * (s + gap) - gap <= height) { size = s; break; }
  }
  map.style.setProperty("--cell", `${size}px`);
}


function drawOutput(st) {
  let rid = view.selected;
  if (!rid || !st.requests.has(rid)) {
    const order = orderedRequests(st);
    rid = order.find(isMine) || order[0];
  }
  const r = rid && st.requests.get(rid);
  $("output-title").textContent = r ? `output of ${nameOf(st, rid)}${isMine(rid) ? " ★ mine" : ""}: ${r.state}` : "output";
  $("output-title").title = rid || "";
  $("output").replaceChildren(...(r ? colouredOutput(r) : []));
  // What the prefix cache said when it was admitted, in the TUI's words (tui/widgets/output.py).
  $("output-cache").textContent = r && r.prefix_lookup
    ? `prefix cache: ${describeLookup(r.prefix_lookup)}` : "";
  // Events carry a preview of a long prompt (its start and end around " … "): the whole text on demand, from the
  // server while the request runs and for its last RECENT_PROMPTS finished ones (serve/async_engine.py).
  const button = $("whole-prompt");
  button.hidden = replay || !r || !r.prompt.includes(" … ");
  button.dataset.request = rid || "";
  if ($("whole-prompt-text").dataset.request !== rid) $("whole-prompt-text").hidden = true;
}

async function showWholePrompt(rid) {
  const out = $("whole-prompt-text");
  out.dataset.request = rid;
  out.hidden = false;
  out.textContent = "fetching the whole prompt ...";
  try {
    const response = await fetch(`v1/events/prompts/${encodeURIComponent(rid)}`, { headers: authHeaders() });
    const body = await response.json();
    out.textContent = response.ok ? body.prompt : (body.error && body.error.message) || response.statusText;
  } catch (err) { out.textContent = `cannot reach the server (${err.message})`; }
}

// tui/widgets/output.py's PROBABILITY_COLOURS: a step's tokens coloured by their probability (requests that
// asked for logprobs carry text_probs; the others are plain text).
const PROBABILITY_COLOURS = [[0.5, "#59a14f"], [0.2, "#8cd17d"], [0.05, "#edc948"], [0.01, "#f28e2b"], [0.0, "#e15759"]];

function colouredOutput(r) {
  const chars = [...r.text];
  const pieces = [];
  let start = 0;
  for (const [length, probability] of r.text_probs || []) {
    const piece = chars.slice(start, start + length).join("");
    start += length;
    if (!piece) continue;
    const colour = probability === null ? null : PROBABILITY_COLOURS.find(([bound]) => probability >= bound)[1];
    const span = el("span", { textContent: piece });
    if (colour) { span.style.color = colour; span.title = `p = ${probability.toPrecision(3)}`; }
    pieces.push(span);
  }
  pieces.push(document.createTextNode(chars.slice(start).join("")));
  return pieces;
}

function select(rid) { view.selected = view.selected === rid ? null : rid; schedule(); }

function setStatus() {
  const status = $("status");
  let text = replay ? "replay" : view.connected ? "live" : view.goodbye ? "server stopped" : "disconnected";
  let cls = view.connected || replay ? "live" : "lost";
  if (view.frozen && !replay) { text = "frozen"; cls = "frozen"; }
  status.textContent = text;
  status.title = cls === "frozen" ? "the view is frozen; events keep buffering (L: back to live)" : text;
  status.className = `status ${cls}`;
  $("freeze").classList.toggle("on", view.frozen);
}

function banner(message) {
  $("banner").hidden = !message;
  $("banner").textContent = message || "";
}

// ------------------------------------------------------------------------------------ viewer controls

function goto(index) {
  view.cursor = Math.max(0, Math.min(view.events.length - 1, index));
  view.frozen = replay || view.cursor < view.events.length - 1 || view.frozen;
  schedule();
}
function freeze(on = !view.frozen) { view.frozen = on || replay; if (!view.frozen) view.cursor = view.events.length - 1; schedule(); }
function live() { if (replay) goto(view.events.length - 1); else freeze(false); }
function play() {
  if (view.playing) { clearInterval(view.playing); view.playing = null; return; }
  if (view.cursor >= view.events.length - 1) goto(0);
  view.playing = setInterval(() => {
    if (view.cursor >= view.events.length - 1) { clearInterval(view.playing); view.playing = null; return; }
    goto(view.cursor + 1);
  }, 250);
}
function projector(on = !document.body.classList.contains("projector")) {
  document.body.classList.toggle("projector", on);
  $("projector").classList.toggle("on", on);
  ui.window = null;                       // the projector's map draws fewer, bigger cells
  schedule();
}

$("freeze").onclick = () => freeze();
$("back").onclick = () => { view.frozen = true; goto(view.cursor - 1); };
$("forward").onclick = () => goto(view.cursor + 1);
$("live").onclick = () => live();
$("play").onclick = () => play();
$("slider").oninput = (e) => { view.frozen = true; goto(Number(e.target.value)); };
$("projector").onclick = () => projector();
window.addEventListener("resize", () => schedule());       // projector mode fits the map to the window again
document.addEventListener("keydown", (e) => {
  if (e.target.tagName === "TEXTAREA" || e.target.tagName === "INPUT") return;
  if (e.key === " ") { e.preventDefault(); freeze(); } else if (e.key === "ArrowLeft") { view.frozen = true; goto(view.cursor - 1); }
  else if (e.key === "ArrowRight") goto(view.cursor + 1);
  else if (e.key === "l" || e.key === "L") live();
  else if (e.key === "p" || e.key === "P") projector();
});
$("map").addEventListener("click", (e) => {
  if (!e.target.classList.contains("cell") || !view.shown) return;
  $("block-info").textContent = e.target.title;
  const group = Number($("map").dataset.group || 1), first = Number(e.target.dataset.first);
  const owner = view.shown.blockOwners.slice(first, first + group).find((o) => o.length);
  if (owner) select(owner[0]);
});
$("map").addEventListener("mouseover", (e) => { if (e.target.classList.contains("cell")) $("block-info").textContent = e.target.title; });

// ------------------------------------------------------------------------------------------ the prompt box

// Page prompts take their own route, with the teacher's limits (minipaged/serve/teacher.py): the server picks
// the length (--page-max-tokens) and greedy decoding; the page asks for nothing more.
/** A 429's "try again in N s" counted down each second (the Retry-After header, else the number in the message),
 * then "you may send again"; a class trial's page said "try again in 48 s" for a whole minute. */
function countDown(message, seconds) {
  clearInterval(view.countdown);
  const status = $("prompt-status");
  const until = Date.now() + seconds * 1000;
  const tick = () => {
    const left = Math.ceil((until - Date.now()) / 1000);
    if (left <= 0) {
      clearInterval(view.countdown);
      status.textContent = "you may send a prompt again now";
      return;
    }
    status.textContent = message.replace(/try again in \d+ s/, `try again in ${left} s`);
  };
  tick();
  view.countdown = setInterval(tick, 1000);
}

async function send(text) {
  const status = $("prompt-status");
  clearInterval(view.countdown);
  status.textContent = "sending ...";
  let response;
  try {
    response = await fetch("v1/page/prompt", { method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({ prompt: text, stream: true }) });
  } catch (err) { status.textContent = `cannot reach the server (${err.message})`; return; }
  if (response.status === 401) { askKey(); status.textContent = "needs the API key"; return; }
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    const message = `refused (${response.status}): ${(body.error && body.error.message) || response.statusText}`;
    const wait = Number(response.headers.get("Retry-After")) || Number((/try again in (\d+) s/.exec(message) || [])[1]);
    if (response.status === 429 && wait > 0) countDown(message, wait);
    else status.textContent = message;
    return;
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = new SSEParser();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    for (const msg of parser.feed(value)) {
      if (msg.data === "[DONE]") continue;
      const chunk = JSON.parse(msg.data);
      if (chunk.id) {                   // its own text: the page shows it even when others' text is hidden
        const own = view.own.get(chunk.id) || { prompt: text, text: "" };
        own.text += ((chunk.choices || [])[0] || { delta: {} }).delta?.content || "";
        view.own.set(chunk.id, own);
        if (view.own.size > 64) view.own.delete(view.own.keys().next().value);
      }
      if (chunk.id && !view.mine.has(chunk.id)) {
        view.mine.add(chunk.id);
        view.selected = chunk.id;
        status.textContent = `your request is in the engine, marked ★ (its id: ${chunk.id})`;
        schedule();
      }
    }
  }
  status.textContent = `your request finished; its blocks and rows are marked ★`;
}

// ------------------------------------------------------------------------------ the teacher's controls

/** The teacher's settings (GET v1/page/settings), shown under the box; the box is disabled when prompts are off. */
async function loadSettings(superseded = () => false) {
  let body;
  try {
    const response = await fetch("v1/page/settings", { headers: authHeaders(), cache: "no-store" });
    if (!response.ok) return;                     // an older server: no settings to show
    body = await response.json();
  } catch { return; }
  if (superseded()) return;                       // asked with an old key: the new stream's own answer counts
  view.settings = body;
  const off = body.page_prompts === "off" && !body.teacher;
  $("prompt").disabled = $("send").disabled = off;
  $("prompt").placeholder = off ? "the teacher has turned student prompts off"
    : "ask the engine something; your request joins the batch";
  if (off) $("prompt-status").textContent = "student prompts are off (the teacher's setting): watch the engine";
  $("teacher-settings").textContent = "teacher's settings: student prompts " + body.page_prompts
    + (body.prompt_rate_per_minute ? `, at most ${body.prompt_rate_per_minute} a minute each` : "")
    + ` · answers up to ${body.max_tokens} tokens, greedy (temperature up to ${body.max_temperature} if asked)`
    + ` · others' prompts and outputs ${body.others_text}`
    + (body.teacher ? " · this page holds the API key: it sees everything" : "");
  if (presenter && !body.teacher) {
    if (body.presenter_available) {
      askKey();
      banner("the presenter view follows the teacher's requests: give the API key (asked once, kept in this browser)");
    } else banner("the presenter view follows the teacher's requests: it needs a server started with --api-key");
  }
  schedule();
}

const textHidden = () => Boolean(view.settings && view.settings.others_text === "hidden" && !view.settings.teacher);

/** Others' text never reached this page (the server sent none); its own comes from what it sent and got back.
 * A copy to draw: the fold itself keeps what the stream said, so that text the page may see (a key given
 * meanwhile: its stream's first steps can come before its settings do) is never overwritten by the placeholder. */
function withOwnTextOnly(st) {
  const requests = new Map();
  for (const [rid, r] of st.requests) {
    const own = view.own.get(rid) || view.own.get(rid.replace(/\.\d+$/, ""));
    // The stream leaves out where a prompt first differs from a cached one; the server tells this page that of
    // its own requests alone (own_lookup messages, teacher.py).
    const lookup = view.ownLookups.get(rid);
    requests.set(rid, { ...r, prompt: own ? own.prompt : HIDDEN_TEXT,
      text: own ? own.text : (r.num_output_tokens ? HIDDEN_TEXT : ""),
      prefix_lookup: lookup || r.prefix_lookup });
  }
  return { ...st, requests };
}

/** The presenter view: the teacher's newest request is selected as soon as the engine shows it. */
function followTeacher(st) {
  const newest = view.teacherIds[view.teacherIds.length - 1];
  if (!newest || newest === view.followed) return;
  const rid = st.requests.has(newest) ? newest : st.requests.has(`${newest}.0`) ? `${newest}.0` : null;
  if (rid) { view.selected = rid; view.followed = newest; }
}

$("prompt-form").onsubmit = (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (text) { $("prompt").value = ""; send(text); }
};
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("prompt-form").requestSubmit(); }
});
$("forget-key").onclick = () => forgetKey();
$("whole-prompt").onclick = () => showWholePrompt($("whole-prompt").dataset.request);
$("forget-key").hidden = !localStorage.getItem(KEY_STORE);
$("key-form").onsubmit = (e) => {
  e.preventDefault();
  localStorage.setItem(KEY_STORE, $("key").value);
  $("key").value = "";
  $("forget-key").hidden = false;
  $("key-form").hidden = true;
  banner(null);
  connect();
};


// ------------------------------------------------------------------------------------------ start

// What tests read over the DevTools protocol (and a curious student in the console).
window.minipaged = {
  get state() { return view.shown; }, get head() { return view.head; }, view,
  usedBlocks: () => (view.shown ? usedBlocks(view.shown) : null), draw, goto, freeze, live, projector, colour: (rid) => colour(view.shown, rid),
  FREE, CACHED,
};

legend(ui);
projector(params.get("projector") === "1" || params.get("projector") === "true");
if (replay) {
  // A recording: nothing here is live, and nobody's requests are "mine".
  $("prompt-panel").hidden = true;
  $("play").hidden = false;
  $("freeze").hidden = true;
  $("live").hidden = true;
  $("forget-key").hidden = true;
  document.body.classList.add("replay");
  const lines = embedded.textContent.split("\n").filter((line) => line.trim());
  const records = lines.map((line) => JSON.parse(line));
  const header = records.find((r) => r.type === "engine");
  start(header);
  for (const r of records) if (r.type === "step") { view.events.push(r); applyEvent(view.head, r); }
  view.cursor = params.has("step") ? Number(params.get("step")) : 0;
  schedule();
} else {
  connect();
}
