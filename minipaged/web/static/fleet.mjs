// The fleet view (minipaged fleet): every replica's block map, queues and gauges side by side, each folded in
// this browser from that replica's own StepEvents (relayed by the fleet command at replica/N/v1/events), with
// fold.mjs, the single-engine view's model. A request's blocks are drawn in the colour of the replica that
// holds them: where the router sent it. The prompt box sends through the router; the page finds the replica
// whose events carry the answer's id, and marks the request as the student's own.
//
// Lesson 11 asks which replica each tenant landed on: every request the page knows of is listed with its replica
// and the start of its prompt (a tenant's system prompt comes first), in the landed panel and under its replica.
// The fleet command follows the replicas from the start (view.py's RoutingHistory): a page that opens late is
// given the routing so far (landed.json). ?projector=1 (or P) draws it for a room.
import { SSEParser } from "./sse.mjs";
import { newState, applyEvent, usedBlocks, queues, nameOf } from "./fold.mjs";

export const REPLICA_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7"];
const MAX_CELLS = 512;            // per replica; a bigger pool draws 2, 4, 8 ... blocks per cell
const LANDED_KEPT = 200;
const LISTED_PER_REPLICA = 12;
const $ = (id) => document.getElementById(id);
const el = (tag, props = {}, ...children) => {
  const node = Object.assign(document.createElement(tag), props);
  for (const c of children) node.append(c);
  return node;
};

const fleet = { layout: null, replicas: [], mine: new Set(), landed: [], known: new Set() };
let drawPending = false;

function replicaColour(i) { return REPLICA_COLOURS[i % REPLICA_COLOURS.length]; }

// ------------------------------------------------------------------------------------------ events in

function panel(i, url) {
  const nodes = { title: el("h2"), status: el("span", { className: "status", textContent: "connecting" }),
    numbers: el("div", { className: "numbers" }), map: el("div", { className: "cells" }), queues: el("div"),
    here: el("ol", { className: "here" }) };
  const section = el("section", { className: "panel replica", id: `replica-${i}` },
    nodes.title, nodes.numbers, nodes.map, nodes.queues, el("h3", { textContent: "requests it was sent (newest first)" }),
    nodes.here);
  section.style.setProperty("--replica", replicaColour(i));
  nodes.title.append(el("span", { className: "swatch" }), `replica ${i} · ${url} `, nodes.status);
  $("replicas").append(section);
  return nodes;
}

async function connect(replica) {
  let response;
  try {
    response = await fetch(`replica/${replica.index}/v1/events`, { cache: "no-store" });
  } catch (err) { return lost(replica, err.message); }
  if (!response.ok) return lost(replica, `answered ${response.status}`);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = new SSEParser();
  replica.connected = true;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      for (const msg of parser.feed(value)) {
        if (msg.event !== "message") continue;          // dropped, goodbye: reconnect below
        const record = JSON.parse(msg.data);
        if (record.type === "engine") { replica.state = newState(record); replica.info = record; buildCells(replica); }
        else if (record.type === "step" && replica.state) receive(replica, record);
      }
    }
  } catch (err) { /* the connection broke: reconnect */ }
  lost(replica, "the event stream ended");
}

function lost(replica, why) {
  replica.connected = false;
  replica.why = why;
  schedule();
  setTimeout(() => connect(replica), 2000);
}

function receive(replica, ev) {
  applyEvent(replica.state, ev);
  for (const a of ev.arrivals || []) {
    if (fleet.known.has(a.request_id)) continue;          // (a reconnection's snapshot repeats the live ones)
    replica.served += 1;
    land({ rid: a.request_id, replica: replica.index, prompt: a.prompt || "", name: nameOf(replica.state, a.request_id) }, true);
  }
  schedule();
}

/** One request's landing: newest first (``newest``), or after the others (the history a late page is given). */
function land(entry, newest) {
  if (fleet.known.has(entry.rid)) return;
  fleet.known.add(entry.rid);
  if (newest) fleet.landed.unshift(entry); else fleet.landed.push(entry);
  while (fleet.landed.length > LANDED_KEPT) fleet.known.delete(fleet.landed.pop().rid);
}

/** The routing before this page opened (the fleet command's RoutingHistory), newest first. */
async function loadHistory() {
  try {
    const body = await (await fetch("landed.json", { cache: "no-store" })).json();
    for (const l of body.landed || []) {
      land({ rid: l.request_id, replica: l.replica, prompt: l.prompt || "", name: l.name || l.request_id }, false);
    }
  } catch { /* an older fleet command: the page shows what it sees from now on */ }
  schedule();
}

// ------------------------------------------------------------------------------------------ drawing

function buildCells(replica) {
  const n = replica.info.num_blocks;
  let group = 1;
  while (Math.ceil(n / group) > MAX_CELLS) group *= 2;
  replica.group = group;
  replica.nodes.map.replaceChildren();
  for (let b = 0; b < n; b += group) replica.nodes.map.append(el("div", { className: "cell free" }));
}

function schedule() {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => { drawPending = false; draw(); });
}

const isMine = (rid) => fleet.mine.has(rid) || fleet.mine.has(rid.replace(/(-\d+)?(\.\d+)?$/, ""));

function draw() {
  for (const replica of fleet.replicas) drawReplica(replica);
  drawLanded();
}

function drawReplica(replica) {
  const { nodes, state: st } = replica;
  nodes.status.textContent = replica.connected ? "live" : `lost (${replica.why || "connecting"})`;
  nodes.status.className = `status ${replica.connected ? "live" : "lost"}`;
  if (!st) return;
  const colour = replicaColour(replica.index);
  const cells = nodes.map.children;
  for (let i = 0; i < cells.length; i++) {
    const first = i * replica.group, last = Math.min(st.info.num_blocks, first + replica.group) - 1;
    let used = 0, cached = false, mine = false;
    const owners = new Set();
    for (let b = first; b <= last; b++) {
      if (st.blockOwners[b].length) used += 1;
      cached = cached || (!st.blockOwners[b].length && st.blockCached[b]);
      for (const rid of st.blockOwners[b]) { owners.add(rid); mine = mine || isMine(rid); }
    }
    const cell = cells[i];
    const cls = used ? `cell used${mine ? " mine" : ""}` : `cell ${cached ? "cached" : "free"}`;
    if (cell.className !== cls) cell.className = cls;
    cell.style.background = used ? colour : "";
    cell.title = used ? `blocks #${first}-#${last}: ${[...owners].join(", ")}` : `blocks #${first}-#${last}: ${cached ? "free, cached" : "free"}`;
  }
  const q = queues(st);
  const hitRate = st.metrics.hit_rate.length ? st.metrics.hit_rate[st.metrics.hit_rate.length - 1] : 0;
  const number = (label, value) => el("div", { className: "gauge" }, el("div", { className: "dim", textContent: label }),
    el("div", { className: "value", textContent: value }));
  nodes.numbers.replaceChildren(
    number("prefix-cache hit rate", `${(hitRate * 100).toFixed(0)}%`),
    number("KV blocks in use", `${usedBlocks(st)}/${st.info.num_blocks}`),
    number("requests since the page opened", String(replica.served)),
    number("running", String(q.running.length)), number("waiting", String(q.waiting.length)),
    number("step", String(st.step)));
  nodes.queues.replaceChildren(...["running", "waiting"].map((name) => el("div", {},
    el("h3", { textContent: `${name} (${q[name].length})` }), ...q[name].slice(0, 20).map((rid) => chip(rid, replica.index, nameOf(st, rid))))));
}

/** A request's chip: its name (r0, r1 ...: the replica's engine names its requests, and every view of that replica
 * says the same; the colour says which replica), its id on hover. */
function chip(rid, index, name = rid) {
  const node = el("span", { className: "chip" + (isMine(rid) ? " mine" : ""), textContent: name, title: `${rid}: replica ${index}` });
  node.style.background = replicaColour(index);
  return node;
}

/** A prompt's start as a room reads it: the chat template's markup out (app.mjs's preview). */
export function preview(prompt) {
  return (prompt || "").replace(/<\|im_start\|>\w+|<\|[^|>]{1,20}\|>|<\/?s>|\[\/?INST\]/g, " ").split(/\s+/).join(" ").trim();
}

/** One request in a list: its chip in its replica's colour, the replica, and the start of its prompt. */
function landedLine({ rid, replica, prompt, name }, withReplica = true) {
  const text = preview(prompt) || "(no text: hidden by the teacher)";
  return el("li", { className: "landed-line", title: `${rid} on replica ${replica}: ${prompt}` }, chip(rid, replica, name || rid),
    ...(withReplica ? [el("span", { className: "where", textContent: ` replica ${replica} ` })] : []),
    el("span", { className: "prompt", textContent: text }));
}

function drawLanded() {
  $("landed").replaceChildren(...fleet.landed.slice(0, 60).map((l) => landedLine(l)));
  for (const replica of fleet.replicas) {
    replica.nodes.here.replaceChildren(...fleet.landed.filter((l) => l.replica === replica.index)
      .slice(0, LISTED_PER_REPLICA).map((l) => landedLine(l, false)));
  }
}

function projector(on = !document.body.classList.contains("projector")) {
  document.body.classList.toggle("projector", on);
  $("projector").classList.toggle("on", on);
  schedule();
}

/** The replica whose events carry request ``rid`` (-1: none yet). */
function whereIs(rid) {
  const found = fleet.replicas.find((r) => r.state && (r.state.requests.has(rid) || [...r.state.requests.keys()].some((k) => k.startsWith(`${rid}.`))));
  return found ? found.index : -1;
}

// ------------------------------------------------------------------------------------------ the prompt box

async function send(text) {
  const status = $("prompt-status");
  status.textContent = "sending to the router ...";
  let response;
  try {
    response = await fetch("v1/chat/completions", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ messages: [{ role: "user", content: text }], max_tokens: 64, stream: true }) });
  } catch (err) { status.textContent = `cannot reach the router (${err.message})`; return; }
  if (!response.ok) {
    const body = await response.text();
    status.textContent = `refused (${response.status}): ${body.slice(0, 300)}`;
    return;
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = new SSEParser();
  let rid = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    for (const msg of parser.feed(value)) {
      if (msg.data === "[DONE]" || rid) continue;
      const chunk = JSON.parse(msg.data);
      if (chunk.id) { rid = chunk.id; fleet.mine.add(rid); schedule(); }
    }
  }
  const where = rid ? whereIs(rid) : -1;
  const name = where >= 0 ? nameOf(fleet.replicas[where].state, rid) : rid;
  status.textContent = where >= 0 ? `your request ${name} (${rid}) landed on replica ${where}; its blocks and chips are marked ★`
    : `your request ${rid || ""} finished`;
}

$("prompt-form").onsubmit = (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (text) { $("prompt").value = ""; send(text); }
};
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("prompt-form").requestSubmit(); }
});

// ------------------------------------------------------------------------------------------ start

$("projector").onclick = () => projector();
document.addEventListener("keydown", (e) => {
  if (e.target.tagName !== "TEXTAREA" && e.target.tagName !== "INPUT" && (e.key === "p" || e.key === "P")) projector();
});
const query = new URLSearchParams(location.search);
projector(query.get("projector") === "1" || query.get("projector") === "true");

// What tests read over the DevTools protocol (and a curious student in the console).
window.fleet = { fleet, whereIs, replicaColour, REPLICA_COLOURS, projector };

async function main() {
  let layout;
  try {
    layout = await (await fetch("fleet.json", { cache: "no-store" })).json();
  } catch (err) {
    $("banner").hidden = false;
    $("banner").textContent = `cannot read the fleet's layout (${err.message})`;
    return;
  }
  fleet.layout = layout;
  $("fleet-name").textContent = `${layout.replicas.length} replicas behind sglang-router (policy ${layout.policy}) · `
    + `clients use ${layout.router}/v1`;
  for (const r of layout.replicas) {
    const replica = { index: r.index, url: r.url, nodes: panel(r.index, r.url), state: null, info: null,
      connected: false, served: 0, group: 1, why: null };
    fleet.replicas.push(replica);
  }
  await loadHistory();                       // first: the live streams' snapshots then add only what is new
  for (const replica of fleet.replicas) connect(replica);
}
main();
