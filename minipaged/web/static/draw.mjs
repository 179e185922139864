// The page's drawing: the KV block map (and the host pool), the batch bar with its budget, the gauges, the queues,
// the request table, the event log and the map's legend, each drawn from one fold (fold.mjs) into elements found
// by id. The web page (app.mjs) and the notebook widget (minipaged/notebook/widget.mjs) both draw with these
// functions, each passing its own ``ui``:
//   ui.$(id)         the element of that id (the page's document, or the widget's shadow root)
//   ui.selected      the request the viewer selected (or null); ui.select(rid) selects or clears it
//   ui.isMine(rid)   whether this viewer sent it (★); ui.showMine: whether the legend explains the ★
//   ui.projector     bigger cells, a smaller window of the pool; ui.window: the map's window now (mapwindow.mjs)
//   ui.info          the engine header (EngineInfo as JSON)
import { colour, blockState, usedBlocks, queues, orderedRequests, verificationTotals, PALETTE, describeLookup,
  nameOf, budgetScale } from "./fold.mjs";
import { mapWindow, blocksInUse } from "./mapwindow.mjs";
import { busyElement } from "./busy.mjs";
import { speculationLines } from "./spec.mjs";

export const MAX_CELLS = 1024;           // the host pool: a bigger one draws 2, 4, 8 ... blocks per cell, as the TUI does
// The KV map draws a window of the pool that holds the blocks in use (mapwindow.mjs): this many cells at most,
// which fill a third of a 1366x768 screen (8 rows) and, bigger, of a projector's (projector layout).
const WINDOW_CELLS = 256;
const PROJECTOR_WINDOW_CELLS = 128;
export const el = (tag, props = {}, ...children) => {
  const node = Object.assign(document.createElement(tag), props);
  for (const c of children) node.append(c);
  return node;
};


export function buildCells(container, n, maxCells = MAX_CELLS) {
  let group = 1;
  while (Math.ceil(n / group) > maxCells) group *= 2;
  fillCells(container, { start: 0, group, count: Math.ceil(n / group) });
}

/** ``w.count`` empty cells for blocks ``w.start`` ... in cells of ``w.group`` blocks (a window of the pool:
 * mapwindow.mjs); each cell knows its first block (data-first: clicks and tests read it). */
export function fillCells(container, w) {
  container.dataset.start = String(w.start);
  container.dataset.group = String(w.group);
  container.replaceChildren();
  for (let i = 0; i < w.count; i++) {
    const cell = el("div", { className: "cell free" });
    cell.dataset.first = String(w.start + i * w.group);
    container.append(cell);
  }
}

export function poolName(device) {
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
function drawCells(ui, st, container, n, ownersOf, describe, dim) {
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
        anySelected = anySelected || rid === ui.selected;
        anyMine = anyMine || ui.isMine(rid);
      }
    }
    const title = describe(first, last);
    if (!used) { paint(cells[i], `cell ${cached ? "cached" : "free"}`, "", "", title); continue; }
    const owner = anySelected ? ui.selected : [...counts].sort((a, b) => b[1] - a[1])[0][0];
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

export const count = (n) => n.toLocaleString("en-US");
export const names = (st, rids) => rids.map((rid) => nameOf(st, rid)).join(", ");

/** The window of the pool the map draws now (mapwindow.mjs): it holds every block in use at the step shown. */
function chooseWindow(ui, st) {
  const cells = ui.projector ? PROJECTOR_WINDOW_CELLS : WINDOW_CELLS;
  const [lo, hi] = blocksInUse(st.blockOwners);
  const chosen = mapWindow(st.info.num_blocks, lo, hi, cells, ui.window);
  if (chosen !== ui.window) { ui.window = chosen; fillCells(ui.$("map"), chosen); legend(ui); }
  return chosen;
}

export function drawMap(ui, st, dim) {
  const owners = (b) => st.blockOwners[b];
  const w = chooseWindow(ui, st);
  drawCells(ui, st, ui.$("map"), st.info.num_blocks, owners, (first, last) => {
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
  ui.$("map-title").textContent = `${poolName(st.info.device)}: `
    + (whole ? `${count(n)} blocks` : `blocks ${count(w.start)}-${count(end)} of ${count(n)}`)
    + ` · ${count(usedBlocks(st))} in use, `
    + `${count(st.blockOwners.filter((o, b) => !o.length && st.blockCached[b]).length)} free but cached`;
  ui.$("map-title").title = whole ? "" : "the map shows a window of the pool that holds every block in use; it "
    + "follows them as the free queue hands out blocks further on";
}

export function drawCpuMap(ui, st, dim) {
  const owners = (b) => (st.cpuBlockOwner[b] === null ? [] : [st.cpuBlockOwner[b]]);
  drawCells(ui, st, ui.$("cpu-map"), st.info.num_cpu_blocks, owners, (first, last) => (first === last
    ? `host block #${first}: ` + (st.cpuBlockOwner[first] === null ? "free" : `${nameOf(st, st.cpuBlockOwner[first])}'s KV, swapped out`)
    : `host blocks #${first}-#${last}`), dim);
  const held = st.cpuBlockOwner.filter((o) => o !== null).length;
  const group = Number(ui.$("cpu-map").dataset.group || 1);
  ui.$("cpu-title").textContent = `host pool (swap): ${held}/${st.info.num_cpu_blocks} in use`
    + (group > 1 ? ` (1 cell = ${group} blocks)` : "");
}

export function drawBatch(ui, st) {
  const ev = st.lastEvent;
  const bar = ui.$("batch-bar");
  bar.replaceChildren();
  drawSpeculation(ui, ev);
  if (!ev) return;
  // The bar's width stands for the budget, or for 8, 16, 32 ... tokens when the step used under an eighth of it
  // (budgetScale: 2 of serve's 2,048 were a sliver); the strip under it stays to the budget's scale.
  const limit = budgetScale(ev.budget_used, ev.budget_limit || 1);
  const zoomed = limit < Math.max(ev.budget_limit, ev.budget_used);
  const width = (n) => `${(100 * n) / limit}%`;
  const scale = ui.$("budget-scale"), wholeUsed = ui.$("budget-whole-used");   // (the page has them)
  if (scale) {
    scale.textContent = zoomed ? `bar: 0-${count(limit)} tokens, zoomed ×${Math.round(ev.budget_limit / limit)}`
      + ` (the line: ${count(ev.budget_used)} of the ${count(ev.budget_limit)}-token budget)` : "";
    scale.hidden = !zoomed;
  }
  if (wholeUsed) wholeUsed.style.width = `${Math.min(100, (100 * ev.budget_used) / Math.max(1, ev.budget_limit))}%`;
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
  ui.$("batch-title").textContent = `step ${ev.step}: ${ev.budget_used}/${ev.budget_limit} tokens of the budget, `
    + `${(ev.scheduled || []).length}/${ev.max_num_seqs} sequences`;
  ui.$("batch-text").textContent = `prefill ${prefill} tokens (striped), decode ${ev.budget_used - prefill}`
    + (verified ? `; drafts ${accepted}/${drafted} accepted (green) / rejected (red)` : "")
    + `; ${(ev.duration_s * 1e3).toFixed(1)} ms`;
}

/** Under the batch bar: each speculating request's k and acceptance (spec.mjs), a line each; hidden without. */
function drawSpeculation(ui, ev) {
  let box = ui.$("spec-text");
  if (!box) {                          // made here, so the page's layout (index.html) needs no slot for it
    box = el("div", { id: "spec-text", className: "dim" });
    box.style.whiteSpace = "pre-line";
    ui.$("batch-text").after(box);
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

export function drawGauges(ui, st) {
  const panel = ui.$("gauges");
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
export function chip(ui, st, rid) {
  const node = el("span", { className: "chip" + (ui.isMine(rid) ? " mine" : ""), textContent: nameOf(st, rid),
    title: rid + (ui.isMine(rid) ? " (mine)" : "") });
  node.style.background = colour(st, rid);
  node.onclick = () => ui.select(rid);
  return node;
}

export function drawQueues(ui, st) {
  const q = queues(st);
  ui.$("queues").replaceChildren(...["running", "waiting", "swapped", "finished"].map((name) =>
    el("div", {}, el("h3", { textContent: `${name} (${q[name].length})` }), ...q[name].slice(0, 40).map((rid) => chip(ui, st, rid)))));
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

export function drawTable(ui, st) {
  const table = ui.$("requests");
  const head = el("tr", {}, ...COLUMNS.map(([cls, h, help]) => el("th", { className: cls, textContent: h, title: help })));
  const rows = orderedRequests(st).slice(0, 200).map((rid) => {
    const r = st.requests.get(rid);
    const row = el("tr", { className: rid === ui.selected ? "selected" : "" },
      el("td", { className: "name" }, chip(ui, st, rid), ...(ui.isMine(rid) ? [el("span", { className: "mine-badge", textContent: "★ mine" })] : [])),
      el("td", { className: "state", textContent: r.state }),
      el("td", { className: "prompt", textContent: preview(r.prompt), title: r.prompt }),
      computedCell(r),
      el("td", { className: "output", textContent: `${r.num_output_tokens} of ${r.max_tokens}` }),
      el("td", { className: "cached", textContent: String(r.num_cached_tokens),
        title: r.prefix_lookup ? describeLookup(r.prefix_lookup) : "" }),
      el("td", { className: "preempted", textContent: String(r.num_preemptions) }),
      el("td", { className: "finish", textContent: r.finish_reason || "" }));
    row.dataset.request = rid;
    if (ui.isMine(rid)) row.dataset.mine = "true";
    row.onclick = () => ui.select(rid);
    return row;
  });
  table.replaceChildren(head, ...rows);
}

export function drawLog(ui, st) {
  // The fold's lines name requests by id, as Python's do; a line about one request starts with it: its name here.
  const named = (line) => (line.request_id && line.text.startsWith(line.request_id)
    ? nameOf(st, line.request_id) + line.text.slice(line.request_id.length) : line.text);
  ui.$("log").replaceChildren(...st.log.slice(-150).reverse().map((line) =>
    el("li", { className: line.kind, textContent: `${String(line.step).padStart(5)}  ${named(line)}`, title: line.text })));
}

/** What the map's cells mean, at the map's grouping now: "1 cell = N blocks", what a partly filled cell and a "+"
 * say; the ★ of mine in a grey no request is drawn in (live pages only: a replay has no "mine"). */
export function legend(ui) {
  const swatch = (cls, background, text = "") => {
    const c = el("span", { className: `cell ${cls}`, textContent: text });
    c.style.background = background;
    return c;
  };
  const group = ui.window ? ui.window.group : 1;
  const item = (help, ...parts) => el("span", { title: help }, ...parts);
  const tokens = ui.info ? ` of ${ui.info.block_size} tokens` : "";
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
  if (ui.showMine) {
    items.push(item("the requests you sent from this page: a white ring and a ★, never a request's colour",
      swatch("used mine", "#555", "★"), "mine"));
  }
  ui.$("legend").replaceChildren(...items);
}
