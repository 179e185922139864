// The live view: reads the engine's StepEvents (GET /v1/events, or a trace embedded in the page by
// `minipaged export-html` / `watch --replay --web`), folds them with fold.mjs and draws. Everything is drawn
// here, in each browser; the server only streams events. Viewer controls (freeze, step, slider, projector)
// act on the buffered events and never touch the engine.
import { SSEParser } from "./sse.mjs";
import { newState, applyEvent, colour, blockState, usedBlocks, queues, orderedRequests, verificationTotals,
  FREE, CACHED, PALETTE, describeLookup, nameOf, budgetScale } from "./fold.mjs";
import { mapWindow, blocksInUse } from "./mapwindow.mjs";
import { busyElement } from "./busy.mjs";
import { speculationLines } from "./spec.mjs";

const MAX_CELLS = 1024;           // the host pool: a bigger one draws 2, 4, 8 ... blocks per cell, as the TUI does
// The KV map draws a window of the pool that holds the blocks in use (mapwindow.mjs): this many cells at most,
// which fill a third of a 1366x768 screen (8 rows) and, bigger, of a projector's (projector layout).
const WINDOW_CELLS = 256;
const PROJECTOR_WINDOW_CELLS = 128;
const SLICE_MS = 10;              // reading the stream yields to the browser after this long (stays responsive)
const KEY_STORE = "minipaged-api-key";
const SILENCE_MS = 30000;         // nothing at all (not even the server's heartbeat comment): reconnect
const $ = (id) => document.getElementById(id);
const el = (tag, props = {}, ...children) => {
  const node = Object.assign(document.createElement(tag), props);
  for (const c of children) node.append(c);
  return node;
};

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
  view.window = null;                     // drawMap chooses the KV map's window
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

function buildCells(container, n, maxCells = MAX_CELLS) {
  let group = 1;
  while (Math.ceil(n / group) > maxCells) group *= 2;
  fillCells(container, { start: 0, group, count: Math.ceil(n / group) });
}

/** ``w.count`` empty cells for blocks ``w.start`` ... in cells of ``w.group`` blocks (a window of the pool:
 * mapwindow.mjs); each cell knows its first block (data-first: clicks and tests read it). */
function fillCells(container, w) {
  container.dataset.start = String(w.start);
  container.dataset.group = String(w.group);
  container.replaceChildren();
  for (let i = 0; i < w.count; i++) {
    const cell = el("div", { className: "cell free" });
    cell.dataset.first = String(w.start + i * w.group);
    container.append(cell);
  }
}

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

function draw() {
  if (!view.info) return;
  let st = foldAtCursor();
  if (textHidden()) st = withOwnTextOnly(st);
  view.shown = st;
  if (presenter) followTeacher(st);
  const selected = view.selected && st.requests.has(view.selected) ? st.requests.get(view.selected) : null;
  const dim = selected && (selected.blocks.length || selected.cpu_blocks.length);
  drawMap(st, dim);
  fitMapCells();
  drawCpuMap(st, dim);
  drawBatch(st);
  drawGauges(st);
  drawQueues(st);
  drawTable(st);
  drawLog(st);
  drawOutput(st);
  const slider = $("slider");
  slider.max = String(Math.max(0, view.events.length - 1));
  slider.value = String(Math.max(0, view.cursor));
  $("step-label").textContent = `step ${st.step}` + (view.events.length ? ` (${view.cursor + 1}/${view.events.length} buffered)` : "");
  setStatus();
}

function poolName(device) {
  return device.startsWith("cuda") ? "GPU KV blocks" : `KV blocks (${device.split(":")[0].toUpperCase()} memory)`;
}

function paint(cell, cls, background, text, title) {
  const look = cls + background + text;
  if (cell.dataset.look !== look) {
    cell.dataset.look = look;
    cell.className = cls;
    cell.style.background = background;
    cell.textContent = text;
  }
  cell.title = title;
}

/** One cell of ``group`` blocks from ``first``: owners of each block via ``ownersOf(b)``; drawn in the colour of
 * the request holding most of them, partly filled when only some are in use (the TUI's grouped cells). */
function drawCells(st, container, n, ownersOf, describe, dim) {
  const cells = container.children;
  const group = Number(container.dataset.group || 1), start = Number(container.dataset.start || 0);
  for (let i = 0; i < cells.length; i++) {
    const first = start + i * group, last = Math.min(n, first + group) - 1;
    const counts = new Map();
    let used = 0, refs = 0, cached = false, anySelected = false, anyMine = false;
    for (let b = first; b <= last; b++) {
      const owners = ownersOf(b);
      if (owners.length) used += 1;
      refs = Math.max(refs, owners.length);
      cached = cached || (!owners.length && st.blockCached[b] && container.id === "map");
      for (const rid of owners) {
        counts.set(rid, (counts.get(rid) || 0) + 1);
        anySelected = anySelected || rid === view.selected;
        anyMine = anyMine || isMine(rid);
      }
    }
    const title = describe(first, last);
    if (!used) { paint(cells[i], `cell ${cached ? "cached" : "free"}`, "", "", title); continue; }
    const owner = anySelected ? view.selected : [...counts].sort((a, b) => b[1] - a[1])[0][0];
    const size = last - first + 1;
    let cls = `cell ${refs > 1 ? "shared" : "used"}`;
    if (anyMine) cls += " mine";
    if (dim && !anySelected) cls += " dimmed";
    const c = colour(st, owner);
    const background = used < size ? `linear-gradient(to top, ${c} ${Math.round((100 * used) / size)}%, #1a1a1a 0)` : c;
    const text = refs > 1 ? (size === 1 ? `x${refs}` : "+") : anyMine ? "★" : "";
    paint(cells[i], cls, background, text, title);
  }
}

const count = (n) => n.toLocaleString("en-US");
const names = (st, rids) => rids.map((rid) => nameOf(st, rid)).join(", ");

/** The window of the pool the map draws now (mapwindow.mjs): it holds every block in use at the step shown. */
function chooseWindow(st) {
  const cells = document.body.classList.contains("projector") ? PROJECTOR_WINDOW_CELLS : WINDOW_CELLS;
  const [lo, hi] = blocksInUse(st.blockOwners);
  const chosen = mapWindow(st.info.num_blocks, lo, hi, cells, view.window);
  if (chosen !== view.window) { view.window = chosen; fillCells($("map"), chosen); legend(); }
  return chosen;
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

function drawMap(st, dim) {
  const owners = (b) => st.blockOwners[b];
  const w = chooseWindow(st);
  drawCells(st, $("map"), st.info.num_blocks, owners, (first, last) => {
    if (first !== last) {
      const held = st.blockOwners.slice(first, last + 1).filter((o) => o.length);
      const who = [...new Set(held.flat())];
      return `blocks #${first}-#${last}: ${held.length} in use` + (who.length ? ` (${names(st, who)})` : "");
    }
    const o = owners(first);
    return `block #${first}: ${blockState(st, first)}` + (o.length ? `, owners ${names(st, o)}, ref count ${o.length}` : "")
      + (st.blockCached[first] ? ", cached (its hash lets a later prompt reuse it)" : "");
  }, dim);
  const n = st.info.num_blocks, end = Math.min(n, w.start + w.group * w.count) - 1;
  const whole = w.start === 0 && end === n - 1;
  $("map-title").textContent = `${poolName(st.info.device)}: `
    + (whole ? `${count(n)} blocks` : `blocks ${count(w.start)}-${count(end)} of ${count(n)}`)
    + ` · ${count(usedBlocks(st))} in use, `
    + `${count(st.blockOwners.filter((o, b) => !o.length && st.blockCached[b]).length)} free but cached`;
  $("map-title").title = whole ? "" : "the map shows a window of the pool that holds every block in use; it "
    + "follows them as the free queue hands out blocks further on";
}

function drawCpuMap(st, dim) {
  const owners = (b) => (st.cpuBlockOwner[b] === null ? [] : [st.cpuBlockOwner[b]]);
  drawCells(st, $("cpu-map"), st.info.num_cpu_blocks, owners, (first, last) => (first === last
    ? `host block #${first}: ` + (st.cpuBlockOwner[first] === null ? "free" : `${nameOf(st, st.cpuBlockOwner[first])}'s KV, swapped out`)
    : `host blocks #${first}-#${last}`), dim);
  const held = st.cpuBlockOwner.filter((o) => o !== null).length;
  const group = Number($("cpu-map").dataset.group || 1);
  $("cpu-title").textContent = `host pool (swap): ${held}/${st.info.num_cpu_blocks} in use`
    + (group > 1 ? ` (1 cell = ${group} blocks)` : "");
}

function drawBatch(st) {
  const ev = st.lastEvent;
  const bar = $("batch-bar");
  bar.replaceChildren();
  drawSpeculation(ev);
  if (!ev) return;
  // The bar's width stands for the budget, or for 8, 16, 32 ... tokens when the step used under an eighth of it
  // (budgetScale: 2 of serve's 2,048 were a sliver); the strip under it stays to the budget's scale.
  const limit = budgetScale(ev.budget_used, ev.budget_limit || 1);
  const zoomed = limit < Math.max(ev.budget_limit, ev.budget_used);
  const width = (n) => `${(100 * n) / limit}%`;
  $("budget-scale").textContent = zoomed ? `bar: 0-${count(limit)} tokens, zoomed ×${Math.round(ev.budget_limit / limit)}`
    + ` (the line: ${count(ev.budget_used)} of the ${count(ev.budget_limit)}-token budget)` : "";
  $("budget-scale").hidden = !zoomed;
  $("budget-whole-used").style.width = `${Math.min(100, (100 * ev.budget_used) / Math.max(1, ev.budget_limit))}%`;
  for (const s of ev.scheduled || []) {
    const c = colour(st, s.request_id);
    const drafts = (s.draft_token_ids || []).length;
    const span = s.end - s.start;
    if (!drafts) {
      const what = s.kind === "prefill" ? `prefill ${s.start}→${s.end}` : "decode";
      bar.append(el("div", { className: `seg ${s.kind}`, title: `${nameOf(st, s.request_id)}: ${what}, ${span} tokens`,
        style: `width:${width(span)};background-color:${c}` }));
      continue;
    }
    const rejected = drafts - s.num_accepted;
    const parts = [["", span - drafts, "the last token"], ["accepted", s.num_accepted, "drafts accepted"],
      ["rejected", rejected, "drafts rejected"]];
    for (const [cls, n, what] of parts) {
      if (n > 0) bar.append(el("div", { className: `seg decode ${cls}`, title: `${nameOf(st, s.request_id)}: ${n} ${what}`,
        style: `width:${width(n)};background-color:${c}` }));
    }
  }
  const [verified, drafted, accepted] = verificationTotals(ev);
  const prefill = (ev.scheduled || []).filter((s) => s.kind === "prefill").reduce((n, s) => n + s.end - s.start, 0);
  $("batch-title").textContent = `step ${ev.step}: ${ev.budget_used}/${ev.budget_limit} tokens of the budget, `
    + `${(ev.scheduled || []).length}/${ev.max_num_seqs} sequences`;
  $("batch-text").textContent = `prefill ${prefill} tokens (striped), decode ${ev.budget_used - prefill}`
    + (verified ? `; drafts ${accepted}/${drafted} accepted (green) / rejected (red)` : "")
    + `; ${(ev.duration_s * 1e3).toFixed(1)} ms`;
}

/** Under the batch bar: each speculating request's k and acceptance (spec.mjs), a line each; hidden without. */
function drawSpeculation(ev) {
  let box = $("spec-text");
  if (!box) {                          // made here, so the page's layout (index.html) needs no slot for it
    box = el("div", { id: "spec-text", className: "dim" });
    box.style.whiteSpace = "pre-line";
    $("batch-text").after(box);
  }
  const lines = speculationLines(ev);
  box.textContent = lines.join("\n");
  box.hidden = !lines.length;
}

const GAUGES = [["kv_usage", "KV used", (x) => `${(x * 100).toFixed(0)}%`],
  ["hit_rate", "prefix-cache hit rate", (x) => `${(x * 100).toFixed(0)}%`],
  ["tokens_per_s", "generation tok/s", (x) => x.toFixed(1)], ["step_ms", "step ms", (x) => x.toFixed(1)],
  ["ttft_ms", "TTFT ms", (x) => x.toFixed(0)], ["itl_ms", "ITL ms", (x) => x.toFixed(1)]];

function sparkline(history) {
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", "0 0 120 28");
  svg.setAttribute("preserveAspectRatio", "none");
  if (history.length > 1) {
    const top = Math.max(...history) || 1;
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", history.map((v, i) => `${(i * 120) / (history.length - 1)},${27 - (v / top) * 26}`).join(" "));
    svg.append(line);
  }
  return svg;
}

function drawGauges(st) {
  const panel = $("gauges");
  panel.replaceChildren();
  const gauges = st.metrics.acceptance_rate.length
    ? [...GAUGES, ["acceptance_rate", "drafts accepted", (x) => `${(x * 100).toFixed(0)}%`]] : GAUGES;
  for (const [name, label, format] of gauges) {
    const history = st.metrics[name];
    const last = history.length ? format(history[history.length - 1]) : "–";
    panel.append(el("div", { className: "gauge" }, el("div", { className: "dim", textContent: label }),
      el("div", { className: "value", textContent: last }), sparkline(history)));
  }
  const busy = busyElement(st);             // how busy the device kept (busy.mjs); null in older traces
  if (busy) panel.append(busy);
}

/** A request's name (r0, r1 ... as the TUI says; its full id on hover) in its colour; mine carry a ★ badge. */
function chip(st, rid) {
  const node = el("span", { className: "chip" + (isMine(rid) ? " mine" : ""), textContent: nameOf(st, rid),
    title: rid + (isMine(rid) ? " (mine)" : "") });
  node.style.background = colour(st, rid);
  node.onclick = () => select(rid);
  return node;
}

function drawQueues(st) {
  const q = queues(st);
  $("queues").replaceChildren(...["running", "waiting", "swapped", "finished"].map((name) =>
    el("div", {}, el("h3", { textContent: `${name} (${q[name].length})` }), ...q[name].slice(0, 40).map((rid) => chip(st, rid)))));
}

function preview(prompt) {
  return prompt.replace(/<\|im_start\|>\w+|<\|[^|>]{1,20}\|>|<\/?s>|\[\/?INST\]/g, " ").split(/\s+/).join(" ").trim();
}

// The request table's columns: [class, heading, what hovering the heading says]. The classes let style.css drop
// the least needed ones on a narrow screen rather than scroll sideways.
const COLUMNS = [["name", "request", "r0, r1 ... in arrival order; hover a name for the request's id"],
  ["state", "state", "waiting, running, swapped (its KV on the host) or finished"],
  ["prompt", "prompt", "the start of the prompt; hover for all the page has of it"],
  ["computed", "KV computed", "tokens whose keys and values are in the cache, of the prompt plus the tokens "
    + "generated so far (the newest token's KV is computed when it is fed back, next step)"],
  ["output", "output", "tokens generated, of max_tokens"],
  ["cached", "cached", "prompt tokens found in the prefix cache at admission"],
  ["preempted", "preempted", "times this request was preempted"],
  ["finish", "finish", "why it finished: stop, length or abort"]];

/** "245 of 291", over a bar filled as far: tokens with their KV computed, of prompt + generated so far. */
function computedCell(r) {
  const known = r.prompt_len + r.num_output_tokens;
  const share = known ? Math.min(100, Math.round((100 * r.num_computed) / known)) : 0;
  const cell = el("td", { className: "computed", textContent: `${r.num_computed} of ${known}`,
    title: `${r.num_computed} of ${known} tokens have their KV in the cache (prompt ${r.prompt_len} + generated `
      + `${r.num_output_tokens})` });
  cell.style.setProperty("--done", `${share}%`);
  return cell;
}

function drawTable(st) {
  const table = $("requests");
  const head = el("tr", {}, ...COLUMNS.map(([cls, h, help]) => el("th", { className: cls, textContent: h, title: help })));
  const rows = orderedRequests(st).slice(0, 200).map((rid) => {
    const r = st.requests.get(rid);
    const row = el("tr", { className: rid === view.selected ? "selected" : "" },
      el("td", { className: "name" }, chip(st, rid), ...(isMine(rid) ? [el("span", { className: "mine-badge", textContent: "★ mine" })] : [])),
      el("td", { className: "state", textContent: r.state }),
      el("td", { className: "prompt", textContent: preview(r.prompt), title: r.prompt }),
      computedCell(r),
      el("td", { className: "output", textContent: `${r.num_output_tokens} of ${r.max_tokens}` }),
      el("td", { className: "cached", textContent: String(r.num_cached_tokens),
        title: r.prefix_lookup ? describeLookup(r.prefix_lookup) : "" }),
      el("td", { className: "preempted", textContent: String(r.num_preemptions) }),
      el("td", { className: "finish", textContent: r.finish_reason || "" }));
    row.dataset.request = rid;
    if (isMine(rid)) row.dataset.mine = "true";
    row.onclick = () => select(rid);
    return row;
  });
  table.replaceChildren(head, ...rows);
}

function drawLog(st) {
  // The fold's lines name requests by id, as Python's do; a line about one request starts with it: its name here.
  const named = (line) => (line.request_id && line.text.startsWith(line.request_id)
    ? nameOf(st, line.request_id) + line.text.slice(line.request_id.length) : line.text);
  $("log").replaceChildren(...st.log.slice(-150).reverse().map((line) =>
    el("li", { className: line.kind, textContent: `${String(line.step).padStart(5)}  ${named(line)}`, title: line.text })));
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
  view.window = null;                     // the projector's map draws fewer, bigger cells
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

/** What the map's cells mean, at the map's grouping now: "1 cell = N blocks", what a partly filled cell and a "+"
 * say; the ★ of mine in a grey no request is drawn in (live pages only: a replay has no "mine"). */
function legend() {
  const swatch = (cls, background, text = "") => {
    const c = el("span", { className: `cell ${cls}`, textContent: text });
    c.style.background = background;
    return c;
  };
  const group = view.window ? view.window.group : 1;
  const item = (help, ...parts) => el("span", { title: help }, ...parts);
  const tokens = view.info ? ` of ${view.info.block_size} tokens` : "";
  const items = [item(group > 1 ? `the pool is drawn ${group} blocks to a cell` : "", el("strong", {
    textContent: group > 1 ? `1 cell = ${group} blocks` : `1 cell = 1 block${tokens}` }))];
  if (group > 1) {
    items.push(item(`a cell is filled as far as its ${group} blocks are in use, in the colour of the request `
      + "holding most of them", swatch("used", `linear-gradient(to top, ${PALETTE[0]} 50%, #1a1a1a 0)`), "filled: part in use"),
    item("one of the cell's blocks is shared by 2 or more requests (a prefix-cache hit)",
      swatch("shared", PALETTE[0], "+"), "holds a shared block"));
  } else {
    items.push(item("a block some request holds, in its colour", swatch("used", PALETTE[0]), "a request's"),
      item("a block 2 requests share (a prefix-cache hit): its ref count is 2", swatch("shared", PALETTE[0], "x2"),
        "shared by 2"));
  }
  items.push(item("no request holds it, but its content is cached: a later prompt with the same prefix reuses it",
    swatch("cached", ""), "free, cached"), item("free", swatch("free", ""), "free"));
  if (!replay) {
    items.push(item("the requests you sent from this page: a white ring and a ★, never a request's colour",
      swatch("used mine", "#555", "★"), "mine"));
  }
  $("legend").replaceChildren(...items);
}

// ------------------------------------------------------------------------------------------ start

// What tests read over the DevTools protocol (and a curious student in the console).
window.minipaged = {
  get state() { return view.shown; }, get head() { return view.head; }, view,
  usedBlocks: () => (view.shown ? usedBlocks(view.shown) : null), draw, goto, freeze, live, projector, colour: (rid) => colour(view.shown, rid),
  FREE, CACHED,
};

legend();
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
