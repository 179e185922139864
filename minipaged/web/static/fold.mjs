// The page's model: StepEvents folded into the block map, the request table, the queues, the event log and
// the gauges' histories. A line-by-line mirror of Python's EngineView (minipaged/event_view.py) and WatchState
// (tui/state.py), with no DOM, so that node's test runner can check it against Python at every step of
// recorded traces (tests/test_web_fold.py). Request objects keep Python's snake_case field names for the
// same reason: the comparison is field by field.

export const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
  "#9c755f", "#a0cbe8", "#8cd17d", "#d37295", "#f1ce63", "#86bcb6", "#d4a6c8", "#ffbe7d"];
export const FREE = "#4a4a4a";          // tui/widgets/block_map.py's colours
export const CACHED = "#7d8fa3";
export const UNKNOWN = "#888888";
export const HISTORY_LEN = 120;         // points kept for each sparkline
export const LOG_LEN = 400;             // event log lines kept
export const RATE_WINDOW = 10;          // steps averaged for tokens per second
export const FINISHED_KEPT = 200;       // finished requests remembered (tui/state.py's FINISHED_KEPT)
export const SHORT_ID = 8;              // ids this short name themselves (minipaged/request_names.py's SHORT_ID)
export const LANE_LEN = 40;             // recent steps the host/device lane shows (tui/state.py's LANE_LEN)
export const METRICS = ["kv_usage", "hit_rate", "tokens_per_s", "step_ms", "ttft_ms", "itl_ms",
  "acceptance_rate", "acceptance_length", "device_busy"];

/** An empty fold for an engine described by its header (EngineInfo as JSON). */
export function newState(info) {
  const metrics = {};
  for (const name of METRICS) metrics[name] = [];
  return {
    info,
    blockOwners: Array.from({ length: info.num_blocks }, () => []),   // ref count = owners.length
    blockCached: new Array(info.num_blocks).fill(false),
    cpuBlockOwner: new Array(info.num_cpu_blocks).fill(null),
    requests: new Map(),             // a Map: request ids are numerals, which plain objects would reorder
    lastEvent: null,
    step: 0,
    colours: new Map(),
    shortNames: new Map(),           // request id -> r0, r1 ... (shortName)
    numNamed: 0,
    // Kept as names come and go, so that naming an arrival does not look at every name held (tui/state.py's):
    baseNames: new Map(),            // a named id without its sample suffix -> its name's, likewise
    idsOfBase: new Map(),            // named ids per such base (a request's samples share one)
    namesTaken: new Map(),           // the bases' names in use -> how many bases hold each
    arrivalOrder: [],
    numArrived: 0,                   // colours go by it (arrivalOrder forgets finished requests)
    finishedOrder: [],
    log: [],
    numEvents: 0,
    metrics,
    engineS: 0,
    arrived: new Map(),              // LatencyFold
    lastToken: new Map(),
    recent: [],                      // (tokens, seconds) of the last RATE_WINDOW steps
    lane: [],                        // per recent step: [host share, busy share] of its wall time
    busyLabel: "forward",            // what "busy" counts: "device" (CUDA events) or "forward" (a CPU's)
    recentBusy: [],                  // (busy seconds, wall seconds) of the last RATE_WINDOW steps
  };
}

function newRequest(a, st) {
  // n samples share one prompt, sent with the first of them (prompt_of names it); old traces: prompt_preview
  const shared = a.prompt_of == null ? undefined : st.requests.get(a.prompt_of);
  const prompt = shared ? shared.prompt : a.prompt ?? a.prompt_preview ?? "";
  return { request_id: a.request_id, prompt_len: a.prompt_len, max_tokens: a.max_tokens, prompt,
    state: "waiting", num_computed: 0, num_cached_tokens: 0, num_output_tokens: 0, text: "",
    finish_reason: null, num_preemptions: 0, blocks: [], cpu_blocks: [], text_probs: [],
    prefix_lookup: a.prefix_lookup ?? null,         // an arrival carries one only in a late watcher's snapshot
    name: a.name ?? null };                          // the engine's name for it (request_names.py); null: old trace
}

/** event_view.py's step_probability: one probability for a step's tokens (their geometric mean), or null. */
export function stepProbability(logprobs) {
  if (!logprobs || !logprobs.length) return null;
  return Math.exp(logprobs.reduce((a, b) => a + b, 0) / logprobs.length);
}

function entries(obj) { return obj ? Object.entries(obj) : []; }

function computedEnd(s) {
  return s.end - ((s.draft_token_ids || []).length - (s.num_accepted || 0));
}

/** EngineView.apply: block ownership and the request table. */
function applyView(st, ev) {
  for (const a of ev.arrivals || []) st.requests.set(a.request_id, newRequest(a, st));
  const kv = ev.kv || {};
  for (const [rid, pairs] of entries(kv.swapped_out)) {
    for (const [, cpu] of pairs) st.cpuBlockOwner[cpu] = rid;
    const req = st.requests.get(rid);
    if (req) req.cpu_blocks = pairs.map(([, cpu]) => cpu);
  }
  release(st, kv.freed);
  for (const b of [...(kv.evicted || []), ...(kv.uncached || [])]) st.blockCached[b] = false;
  for (const [rid, pairs] of entries(kv.swapped_in)) {
    for (const [cpu, gpu] of pairs) { st.cpuBlockOwner[cpu] = null; st.blockOwners[gpu].push(rid); }
    const req = st.requests.get(rid);
    if (req) { req.blocks = pairs.map(([, gpu]) => gpu); req.cpu_blocks = []; }
  }
  for (const [rid, blocks] of entries(kv.allocated)) {
    for (const b of blocks) st.blockOwners[b].push(rid);
    const req = st.requests.get(rid);
    if (req) req.blocks.push(...blocks);
  }
  for (const b of kv.cached || []) st.blockCached[b] = true;
  release(st, kv.freed_on_finish);
  for (const p of ev.preempted || []) {
    const req = st.requests.get(p.request_id);
    if (req) { req.num_preemptions += 1; if (p.mode === "recompute") req.num_computed = 0; }
  }
  for (const s of ev.scheduled || []) {
    const req = st.requests.get(s.request_id);
    if (req) {
      req.num_computed = computedEnd(s);
      req.num_output_tokens = s.num_output_tokens;
      if (s.num_cached_tokens) req.num_cached_tokens = s.num_cached_tokens;
      if (s.prefix_lookup) req.prefix_lookup = s.prefix_lookup;
    }
  }
  for (const [rid, text] of entries(ev.new_text)) {
    const req = st.requests.get(rid);
    if (!req) continue;
    req.text += text;
    const logprobs = (ev.new_logprobs || {})[rid];
    // Python counts characters (code points), not UTF-16 units: [...text] does the same.
    if ((logprobs && logprobs.length) || req.text_probs.length) {
      req.text_probs.push([[...text].length, stepProbability(logprobs)]);
    }
  }
  for (const [queue, state] of [["waiting", "waiting"], ["running", "running"], ["swapped", "swapped"]]) {
    for (const rid of ev[queue] || []) { const req = st.requests.get(rid); if (req) req.state = state; }
  }
  for (const f of ev.finished || []) {
    const req = st.requests.get(f.request_id);
    if (req) { req.state = "finished"; req.finish_reason = f.finish_reason; req.num_output_tokens = f.num_output_tokens; }
  }
  st.lastEvent = ev;
  st.step = ev.step;
}

function release(st, freed) {
  for (const [rid, blocks] of entries(freed)) {
    for (const b of blocks) {
      const owners = st.blockOwners[b];
      const i = owners.indexOf(rid);
      if (i >= 0) owners.splice(i, 1);
    }
    const req = st.requests.get(rid);
    if (req) { const gone = new Set(blocks); req.blocks = req.blocks.filter((b) => !gone.has(b)); }
  }
}

/** events.py's describe_prefix_lookup: a request's prefix-cache hits and why its first miss missed. */
export function describeLookup(lookup) {
  const hits = `${lookup.num_hit_blocks}/${lookup.num_blocks} blocks hit`;
  if (lookup.reason === "all_hit") return hits;
  const why = {
    never: "never computed",
    evicted: `evicted at step ${lookup.evicted_step} for ${lookup.evicted_for}`,
    reset: `cache reset at step ${lookup.evicted_step}`,
    differs: lookup.differs_at == null ? "tokens differ from the cached ones"        // (hidden text)
      : `tokens differ at position ${lookup.differs_at}`,
    unrecorded: "evicted long ago, or never seen",
  }[lookup.reason] ?? lookup.reason;
  return `${hits}; block ${lookup.num_hit_blocks} missed: ${why}`;
}

// ------------------------------------------------------------------------------------------ the log

/** Python's "{:.0f}": round half to even (JavaScript's toFixed rounds ties up). */
export function fixed0(x) {
  const floor = Math.floor(x);
  const r = x - floor === 0.5 ? (floor % 2 === 0 ? floor : floor + 1) : Math.round(x);
  return String(r === 0 ? 0 : r);
}
const percent = (x) => fixed0(x * 100) + "%";
const plural = (n, word) => `${word}${n > 1 ? "s" : ""}`;

function knownTokens(s, ev) {
  return s.prompt_len + s.num_output_tokens - (ev.new_token_ids && s.request_id in ev.new_token_ids ? 1 : 0);
}

/** tui/state.py's budget_scale: the tokens the budget bar's width stands for (the budget, or 8, 16, 32 ... when a
 * step used less than an eighth of it: 2 tokens of 2,048 would be a sliver). */
export function budgetScale(used, limit) {
  limit = Math.max(limit, used, 1);
  if (used * 8 >= limit) return limit;
  let scale = 8;
  while (scale < 2 * used) scale *= 2;
  return Math.min(scale, limit);
}

export function verificationTotals(ev) {
  const verified = (ev.scheduled || []).filter((s) => (s.draft_token_ids || []).length);
  return [verified.length, verified.reduce((n, s) => n + s.draft_token_ids.length, 0),
    verified.reduce((n, s) => n + s.num_accepted, 0)];
}

// tui/state.py's EVICTION_WORDS: how the log names the free-block eviction order.
const EVICTION_WORDS = { lru: "least recently used", mru: "most recently freed first" };

/** tui/state.py's describe_event: what happened in one step, in words; ``st`` is the fold before ``ev``. */
export function describeEvent(ev, st) {
  const lines = [];
  const bs = st.info.block_size;
  const add = (kind, text, rid = null) => lines.push({ step: ev.step, kind, text, request_id: rid });
  for (const a of ev.arrivals || []) {
    add("arrive", `${a.request_id} arrived: ${a.prompt_len}-token prompt, max ${a.max_tokens} new`, a.request_id);
  }
  for (const p of ev.preempted || []) {
    if (p.mode === "swap") add("preempt", `${p.request_id} preempted (swap): ${p.num_blocks} blocks to CPU`, p.request_id);
    else add("preempt", `${p.request_id} preempted (recompute): ${p.num_blocks} blocks freed`, p.request_id);
  }
  for (const rid of ev.swapped_in || []) {
    add("swap", `${rid} swapped in: ${((ev.kv.swapped_in || {})[rid] || []).length} blocks from CPU`, rid);
  }
  const evicted = (ev.kv && ev.kv.evicted) || [];
  if (evicted.length) {
    const policy = st.info.eviction_policy ?? "lru";         // traces recorded before policies had no name
    const order = EVICTION_WORDS[policy] ?? policy;
    add("evict", `evicted ${evicted.length} cached ${plural(evicted.length, "block")} (${order}) for new KV`);
  }
  for (const s of ev.scheduled || []) {
    const prior = st.requests.get(s.request_id);
    if (prior === undefined || prior.state === "waiting") {
      const again = prior !== undefined && prior.num_preemptions ? " again (recomputes its KV)" : "";
      add("admit", `${s.request_id} admitted${again}`, s.request_id);
    }
    if (s.num_cached_tokens) {
      add("hit", `${s.request_id} cache hit: ${Math.floor(s.num_cached_tokens / bs)} blocks (${s.num_cached_tokens} `
        + "tokens) reused", s.request_id);
    }
    if (s.kind === "prefill") {
      const target = knownTokens(s, ev);
      if (s.start === s.num_cached_tokens && s.end >= target) {
        let what;
        if (target > s.prompt_len) {
          const tokens = `${s.prompt_len} prompt + ${target - s.prompt_len} generated tokens`;
          what = s.start ? `recomputes the rest of ${tokens}` : `recomputes ${tokens}`;
        } else {
          what = s.num_cached_tokens ? "rest of prompt" : "whole prompt";
        }
        add("chunk", `${s.request_id} prefill ${s.start}→${s.end} (${what})`, s.request_id);
      } else {
        const last = s.end >= target ? " (last chunk)" : "";
        add("chunk", `${s.request_id} prefill chunk ${s.start}→${s.end} of ${target}${last}`, s.request_id);
      }
    }
  }
  const [numVerified, drafted, accepted] = verificationTotals(ev);
  if (numVerified) {
    const produced = accepted + numVerified;
    add("spec", `verified ${drafted} ${plural(drafted, "draft")} of ${numVerified} ${plural(numVerified, "request")}: `
      + `${accepted} accepted (${percent(accepted / drafted)}), ${produced} ${plural(produced, "token")} in one forward pass`);
  }
  const constrained = entries(ev.constrained).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  if (constrained.length === 1) {
    const [[rid, [allowed, vocab]]] = constrained;
    add("mask", `${rid} structured-output mask: ${allowed} of ${vocab} tokens allowed`, rid);
  } else if (constrained.length) {
    const vocab = constrained[0][1][1];
    const each = constrained.map(([rid, [n]]) => `${rid} ${n}`).join(", ");
    add("mask", `structured-output masks on ${constrained.length} requests, tokens allowed of ${vocab}: ${each}`);
  }
  for (const f of ev.finished || []) {
    const ttft = f.ttft_s === null || f.ttft_s === undefined ? "" : `, TTFT ${fixed0(f.ttft_s * 1e3)} ms`;
    add("finish", `${f.request_id} finished (${f.finish_reason}): ${f.num_output_tokens} tokens${ttft}`, f.request_id);
  }
  return lines;
}

// ---------------------------------------------------------------------------------- WatchState.apply

function push(history, value, limit = HISTORY_LEN) {
  history.push(value);
  if (history.length > limit) history.splice(0, history.length - limit);
}

/** Request ids with new tokens, in the engine's order: scheduled order first (JSON objects with numeral
 * keys come back sorted, which is not the order Python's dict kept). */
function tokenOrder(ev) {
  const have = ev.new_token_ids || {};
  const ordered = (ev.scheduled || []).map((s) => s.request_id).filter((rid) => rid in have);
  const seen = new Set(ordered);
  return [...ordered, ...Object.keys(have).filter((rid) => !seen.has(rid))];
}

/** WatchState._forget_old_finished: only the FINISHED_KEPT most recently finished requests are kept. */
function forgetOldFinished(st, ev) {
  for (const f of ev.finished || []) st.finishedOrder.push(f.request_id);
  if (st.finishedOrder.length <= FINISHED_KEPT) return;
  const gone = new Set();
  for (const rid of st.finishedOrder.splice(0, st.finishedOrder.length - FINISHED_KEPT)) {
    const req = st.requests.get(rid);
    if (req && req.state === "finished") {
      st.requests.delete(rid); st.colours.delete(rid); forgetName(st, rid); gone.add(rid);
    }
  }
  st.arrivalOrder = st.arrivalOrder.filter((rid) => !gone.has(rid));
}

/** RequestNames._new_name (minipaged/request_names.py), for traces whose arrivals carry no name: the name a room reads, r0, r1 ... in arrival order (the TUI's own requests are named
 * so), for ids longer than SHORT_ID (a server's chatcmpl-95d...); samples of one request share it (r3.0, r3.1).
 * A short id is its own name unless another request holds that name already. */
function shortName(st, rid) {
  const [base, suffix] = splitSample(rid);
  if (st.baseNames.has(base)) return st.baseNames.get(base) + suffix;   // another sample of the same request
  if ([...base].length <= SHORT_ID && !st.namesTaken.has(base)) return rid;
  while (st.namesTaken.has(`r${st.numNamed}`)) st.numNamed += 1;
  st.numNamed += 1;
  return `r${st.numNamed - 1}${suffix}`;
}

/** tui/state.py's _split_sample: a sample's id into its request's id and its suffix (r3.1 -> r3, .1). */
function splitSample(id) { const m = /^(.*)\.([0-9]+)$/.exec(id); return m ? [m[1], `.${m[2]}`] : [id, ""]; }

const bump = (map, key, by) => { const n = (map.get(key) ?? 0) + by; if (n) map.set(key, n); else map.delete(key); };

/** RequestNames.give (minipaged/request_names.py). */
function giveName(st, rid, given) {
  // the name its arrival carries (the engine names requests: every view says the same), else one given here
  const named = given || shortName(st, rid), [base] = splitSample(rid);
  st.shortNames.set(rid, named);
  if (!st.idsOfBase.has(base)) {
    st.baseNames.set(base, named.split(".")[0]);
    bump(st.namesTaken, st.baseNames.get(base), 1);
  }
  bump(st.idsOfBase, base, 1);
}

/** RequestNames.forget. */
function forgetName(st, rid) {
  if (!st.shortNames.delete(rid)) return;
  const [base] = splitSample(rid);
  bump(st.idsOfBase, base, -1);
  if (!st.idsOfBase.has(base)) {
    bump(st.namesTaken, st.baseNames.get(base), -1);
    st.baseNames.delete(base);
  }
}

/** event_view.py's busy_seconds: the device's time on CUDA, the forward call's on a CPU; null in an old trace. */
export function busySeconds(ev) { return ev.device_s ?? ev.forward_s ?? null; }

/** event_view.py's busy_label. */
export function busyLabel(ev) { return ev.device_s == null ? "forward" : "device"; }

/** WatchState._track_busy: the "busy" gauge and the host/device lane. */
function trackBusy(st, ev) {
  const busy = busySeconds(ev);
  if (busy === null || ev.host_s == null || !(ev.duration_s > 0)) return;
  st.busyLabel = busyLabel(ev);
  push(st.recentBusy, [busy, ev.duration_s], RATE_WINDOW);
  let wall = 0, busyTotal = 0;
  for (const [, d] of st.recentBusy) wall += d;
  for (const [b] of st.recentBusy) busyTotal += b;
  push(st.metrics.device_busy, Math.min(1, busyTotal / wall));
  push(st.lane, [Math.min(1, ev.host_s / ev.duration_s), Math.min(1, busy / ev.duration_s)], LANE_LEN);
}

/** Fold one StepEvent (parsed JSON) into ``st``; returns ``st``. */
export function applyEvent(st, ev) {
  for (const a of ev.arrivals || []) {
    if (!st.colours.has(a.request_id)) {
      st.colours.set(a.request_id, PALETTE[st.numArrived % PALETTE.length]);
      giveName(st, a.request_id, a.name);
      st.arrivalOrder.push(a.request_id);
      st.numArrived += 1;
    }
  }
  for (const line of describeEvent(ev, st)) push(st.log, line, LOG_LEN);
  applyView(st, ev);
  st.numEvents += 1;
  forgetOldFinished(st, ev);
  const m = st.metrics;
  const total = ev.num_total_blocks || st.info.num_blocks;
  push(m.kv_usage, total ? (total - ev.num_free_blocks) / total : 0);
  push(m.hit_rate, Number((ev.counters || {}).prefix_cache_hit_rate || 0));
  push(m.step_ms, ev.duration_s * 1e3);
  let tokens = 0;
  for (const ids of Object.values(ev.new_token_ids || {})) tokens += ids.length;
  push(st.recent, [tokens, ev.duration_s], RATE_WINDOW);
  let busy = 0, made = 0;
  for (const [, d] of st.recent) busy += d;
  for (const [n] of st.recent) made += n;
  push(m.tokens_per_s, busy > 0 ? made / busy : 0);
  // Latencies on the engine's clock (the sum of step durations), as WatchState._track_latencies.
  const arrived = st.engineS;
  st.engineS += ev.duration_s;
  const now = st.engineS;
  for (const a of ev.arrivals || []) st.arrived.set(a.request_id, arrived);
  const gaps = [];
  for (const rid of tokenOrder(ev)) {
    const previous = st.lastToken.get(rid);
    if (previous !== undefined) gaps.push(now - previous);
    else if (st.arrived.has(rid)) push(m.ttft_ms, (now - st.arrived.get(rid)) * 1e3);
    st.lastToken.set(rid, now);
  }
  for (const f of ev.finished || []) { st.arrived.delete(f.request_id); st.lastToken.delete(f.request_id); }
  if (gaps.length) push(m.itl_ms, gaps.reduce((x, y) => x + y, 0) / gaps.length * 1e3);
  trackBusy(st, ev);
  const [numVerified, drafted, accepted] = verificationTotals(ev);
  if (numVerified) {
    push(m.acceptance_rate, accepted / drafted);
    push(m.acceptance_length, 1 + accepted / numVerified);
  }
  return st;
}

/** Fold a whole list of events into a fresh state. */
export function foldAll(info, events) {
  const st = newState(info);
  for (const ev of events) applyEvent(st, ev);
  return st;
}

// ------------------------------------------------------------------------------------ what to draw

export function colour(st, rid) { return st.colours.get(rid) || UNKNOWN; }

/** The name the page shows for a request (its id when it has none: an id from before the buffer began). */
export function nameOf(st, rid) { return st.shortNames.get(rid) ?? rid; }

/** free, cached (free but reusable), used or shared (ref count > 1): EngineView.block_state. */
export function blockState(st, b) {
  const owners = st.blockOwners[b];
  if (!owners.length) return st.blockCached[b] ? "cached" : "free";
  return owners.length > 1 ? "shared" : "used";
}

export function usedBlocks(st) { return st.blockOwners.reduce((n, o) => n + (o.length ? 1 : 0), 0); }

/** Request ids by queue, in the engine's order (finished: most recent first): WatchState.queues. */
export function queues(st) {
  const ev = st.lastEvent;
  const finished = [...st.arrivalOrder].reverse().filter((rid) => st.requests.get(rid).state === "finished");
  if (!ev) return { running: [], waiting: [], swapped: [], finished };
  return { running: [...(ev.running || [])], waiting: [...(ev.waiting || [])], swapped: [...(ev.swapped || [])],
    finished };
}

/** All requests in the order the request table lists them: WatchState.ordered_requests. */
export function orderedRequests(st) {
  const q = queues(st);
  const seen = [...q.running, ...q.swapped, ...q.waiting];
  const skip = new Set([...seen, ...q.finished]);
  return [...seen, ...st.arrivalOrder.filter((rid) => !skip.has(rid)), ...q.finished];
}

/** The fold as plain JSON, in the shape tests/test_web_fold.py writes Python's state in. */
export function comparable(st) {
  const requests = {};
  for (const [rid, r] of st.requests) requests[rid] = { ...r, blocks: [...r.blocks], cpu_blocks: [...r.cpu_blocks] };
  return {
    step: st.step, num_events: st.numEvents,
    block_owners: st.blockOwners.map((o) => [...o].sort()),
    block_cached: [...st.blockCached], cpu_block_owner: [...st.cpuBlockOwner], requests,
    colours: Object.fromEntries(st.colours), short_names: Object.fromEntries(st.shortNames), arrival_order: [...st.arrivalOrder],
    queues: queues(st), ordered_requests: orderedRequests(st), used_blocks: usedBlocks(st),
    log: st.log.map((l) => [l.step, l.kind, l.text, l.request_id]),
    lookups: Object.fromEntries([...st.requests].map(([rid, r]) =>
      [rid, r.prefix_lookup && describeLookup(r.prefix_lookup)])),
    metrics: Object.fromEntries(METRICS.map((name) => [name, [...st.metrics[name]]])),
    lane: st.lane.map((pair) => [...pair]), busy_label: st.busyLabel,
  };
}
