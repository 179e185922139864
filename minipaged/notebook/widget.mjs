// The notebook widget's view (anywidget's ``render``): the web page's block map, batch bar and budget, gauges,
// queues, request table and event log, drawn by the page's own modules. minipaged/notebook/bundle.py puts
// fold.mjs, mapwindow.mjs, busy.mjs, spec.mjs and draw.mjs before this file in one ES module, so newState,
// applyEvent and the draw* functions below are the page's (one fold, checked against Python's by
// tests/test_web_fold.py). Everything lives in a shadow root: the page's stylesheet cannot touch the notebook's.
//
// Messages from the kernel (minipaged/notebook/widget.py), each a custom message {kind, ...}:
//   {kind: "reset", info, mode}          a new engine (or a view opened late): start an empty fold
//   {kind: "steps", json, after}         a JSON array of StepEvents, in order (at most a few a second), following
//                                        step ``after`` (a view whose fold is elsewhere waits for a snapshot)
//   {kind: "snapshot", json, skipped}    the state now as one StepEvent (a long burst coalesced): start over from it
//   {kind: "status", text}               "running", "idle", "replay", "lost the server" ...
// A live engine's header is the widget's ``info`` trait, so a view draws from the first step even while the kernel
// is busy. The view also says {kind: "hello", id}; the kernel answers it alone ({for: id}) with a reset and the
// state then, which a view that missed steps needs and a view in step ignores. A replay comes that way entirely.

const WIDGET_HTML = `
<div class="mp-body">
<header>
  <strong>minipaged</strong>
  <span id="engine-name">waiting for the engine ...</span>
  <span id="status" class="status">waiting</span>
  <span class="controls">
    <button id="back" title="one step back">◀</button>
    <button id="forward" title="one step forward">▶</button>
    <button id="play" title="play the kept steps">▶ play</button>
    <button id="live" title="back to the newest step">● live</button>
    <input id="slider" type="range" min="0" max="0" value="0" aria-label="step">
    <span id="step-label">step 0</span>
  </span>
</header>
<div id="banner" hidden></div>
<main>
  <section id="map-panel" class="panel">
    <h2 id="map-title">KV blocks</h2>
    <div id="map" class="cells"></div>
    <h3 id="cpu-title">host pool (swap)</h3>
    <div id="cpu-map" class="cells"></div>
    <div id="legend"></div>
    <div id="block-info" class="dim">hover a block: its owners, ref count, cached or not</div>
  </section>
  <section id="queues" class="panel"></section>
  <section id="batch-panel" class="panel">
    <h2 id="batch-title">this step's batch</h2>
    <div id="batch-bar"></div>
    <div id="batch-text" class="dim"></div>
  </section>
  <section id="gauges" class="panel"></section>
  <section id="table-panel" class="panel"><table id="requests"></table></section>
  <section id="log-panel" class="panel"><h2>event log (newest first)</h2><ol id="log"></ol></section>
</main>
</div>`;

// The widget's own layout: narrower than a browser tab, so one column of panels under the map.
const WIDGET_CSS = `
:host { display: block; }
.mp-body main { grid-template-columns: minmax(0, 3fr) minmax(0, 2fr); grid-template-rows: auto auto auto auto; }
.mp-body #map-panel { grid-column: 1; grid-row: 1 / span 2; }
.mp-body #queues { grid-column: 2; grid-row: 1; }
.mp-body #gauges { grid-column: 2; grid-row: 2; }
.mp-body #batch-panel { grid-column: 1 / span 2; grid-row: 3; }
.mp-body #table-panel { grid-column: 1; grid-row: 4; max-height: 320px; overflow: auto; }
.mp-body #log-panel { grid-column: 2; grid-row: 4; max-height: 320px; overflow: auto; }
`;

function render({ model, el }) {
  const host = document.createElement("div");
  host.className = "minipaged-widget";
  el.append(host);
  const root = host.attachShadow({ mode: "open" });
  root.innerHTML = `<style>${model.get("page_css")}\n${WIDGET_CSS}</style>${WIDGET_HTML}`;
  const $ = (id) => root.getElementById(id);
  const view = { info: null, base: null, head: null, events: [], cursor: -1, frozen: false, selected: null,
    keep: Math.max(1, model.get("keep") || 500), playing: null, shown: null, cached: null, skipped: 0,
    replay: false, synced: false };
  const ui = { $, isMine: () => false, select: (rid) => { view.selected = view.selected === rid ? null : rid; schedule(); },
    window: null, get selected() { return view.selected; }, projector: false, get info() { return view.info; },
    showMine: false };
  let pending = false;
  const id = Math.random().toString(36).slice(2);      // the kernel answers this view's hello to it alone

  function schedule() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; draw(); });
  }

  function reset(info, keep = null, replay = false) {
    view.info = info;
    view.keep = Math.max(1, keep || model.get("keep") || 500);
    view.replay = replay;
    view.frozen = replay;                          // a recording opens at its first step, as the page's replay does
    $("banner").hidden = true;
    view.skipped = 0;
    view.base = newState(info);
    view.head = newState(info);
    view.events = [];
    view.cursor = -1;
    view.cached = null;
    ui.window = null;
    buildCells($("cpu-map"), info.num_cpu_blocks, MAX_CELLS / 4);
    $("cpu-title").hidden = $("cpu-map").hidden = info.num_cpu_blocks === 0;
    $("engine-name").textContent = `${info.model} · ${info.device} ${info.dtype} · ${info.num_blocks} blocks of `
      + `${info.block_size} tokens · budget ${info.max_num_batched_tokens}`
      + (info.speculative ? ` · ${info.speculative}` : "");
    legend(ui);
  }

  /** One step in: folded into the head; the widget keeps the last ``keep`` (older ones fold into the base). */
  function receive(ev) {
    view.events.push(ev);
    applyEvent(view.head, ev);
    while (view.events.length > view.keep) {
      applyEvent(view.base, view.events.shift());
      if (view.frozen) view.cursor = Math.max(0, view.cursor - 1);
    }
    if (!view.frozen) view.cursor = view.events.length - 1;
    else if (view.cursor < 0) view.cursor = 0;
  }

  function foldAtCursor() {
    if (view.cursor === view.events.length - 1) return view.head;
    const at = view.events[view.cursor];
    if (view.cached && view.cached.event === at) return view.cached.state;
    const st = structuredClone(view.base);
    for (let i = 0; i <= view.cursor; i++) applyEvent(st, view.events[i]);
    view.cached = { event: at, state: st };
    return st;
  }

  function draw() {
    if (!view.info) return;
    const st = foldAtCursor();
    view.shown = st;
    const selected = view.selected && st.requests.has(view.selected) ? st.requests.get(view.selected) : null;
    const dim = selected && (selected.blocks.length || selected.cpu_blocks.length);
    drawMap(ui, st, dim);
    drawCpuMap(ui, st, dim);
    drawBatch(ui, st);
    drawGauges(ui, st);
    drawQueues(ui, st);
    drawTable(ui, st);
    drawLog(ui, st);
    $("slider").max = String(Math.max(0, view.events.length - 1));
    $("slider").value = String(Math.max(0, view.cursor));
    $("step-label").textContent = `step ${st.step}` + (view.events.length ? ` (${view.cursor + 1}/${view.events.length} kept)` : "");
    // What tests (and curious users) read without opening the shadow root.
    host.dataset.step = String(st.step);
    host.dataset.usedBlocks = String(usedBlocks(st));
    host.dataset.events = String(view.events.length);
  }

  function goto(index) {
    view.cursor = Math.max(0, Math.min(view.events.length - 1, index));
    view.frozen = view.replay || view.cursor < view.events.length - 1;
    schedule();
  }
  function play() {
    if (view.playing) { clearInterval(view.playing); view.playing = null; return; }
    if (view.cursor >= view.events.length - 1) goto(0);
    view.playing = setInterval(() => {
      if (view.cursor >= view.events.length - 1) { clearInterval(view.playing); view.playing = null; return; }
      goto(view.cursor + 1);
    }, 250);
  }
  $("back").onclick = () => goto(view.cursor - 1);
  $("forward").onclick = () => goto(view.cursor + 1);
  $("live").onclick = () => { goto(view.events.length - 1); view.frozen = false; };
  $("play").onclick = () => play();
  $("slider").oninput = (e) => goto(Number(e.target.value));
  $("map").addEventListener("mouseover", (e) => {
    if (e.target.classList.contains("cell")) $("block-info").textContent = e.target.title;
  });

  function setStatus(text) {
    const status = $("status");
    status.textContent = text;
    status.className = `status ${/lost|error/.test(text) ? "lost" : "live"}`;
  }

  function onMessage(msg) {
    if (msg.for != null && msg.for !== id) return;      // the answer to another view's hello
    const answer = msg.for != null;                     // the answer to this view's hello
    if (msg.kind === "reset") {
      if (answer && view.synced) return;                // in step already: keep the slider's history
      reset(msg.info, msg.keep, Boolean(msg.replay));
      view.synced = Boolean(msg.replay);
      if (msg.status) setStatus(msg.status);
    } else if (msg.kind === "steps" && view.info) {
      if (msg.after != null && (!view.synced || view.head.step !== msg.after)) {
        view.synced = false;                            // missed steps: wait for the hello's snapshot
        return;
      }
      for (const ev of JSON.parse(msg.json)) receive(ev);
    } else if (msg.kind === "snapshot" && view.info) {
      if (answer && view.synced) return;
      view.synced = true;
      // A burst too long to send step by step: the kernel folded it and sends the state it left.
      const skipped = view.skipped + (msg.skipped || 0);
      reset(view.info, view.keep, view.replay);
      receive(JSON.parse(msg.json));
      view.skipped = skipped;
      $("banner").hidden = !view.skipped;
      $("banner").textContent = `${view.skipped} steps came faster than the widget draws them: it shows the state `
        + "they left (the block map and the table are exact; the slider starts there)";
    } else if (msg.kind === "status") {
      setStatus(msg.text);
    }
    schedule();
  }
  // A live engine's header comes as a trait: draw the empty map now and fold every step from the first.
  const initial = model.get("info");
  if (initial) { reset(initial); view.synced = true; setStatus("live"); }
  model.on("msg:custom", onMessage);
  model.send({ kind: "hello", id });
  return () => {
    model.off("msg:custom", onMessage);
    if (view.playing) clearInterval(view.playing);
  };
}
