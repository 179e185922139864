// The page's fold (minipaged/web/static/fold.mjs) against Python's WatchState at every step of recorded
// traces. tests/test_web_fold.py records the traces, folds them in Python, writes the cases and runs this
// file with MINIPAGED_FOLD_CASES pointing at them; run alone, without it, the test skips.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { newState, applyEvent, comparable, fixed0 } from "../../minipaged/web/static/fold.mjs";

const casesPath = process.env.MINIPAGED_FOLD_CASES;

/** Where two JSON values differ ("" if they agree; floats within a relative 1e-9). */
function difference(a, b, path = "$") {
  if (typeof a === "number" && typeof b === "number") {
    return Math.abs(a - b) <= 1e-9 * Math.max(1, Math.abs(a), Math.abs(b)) ? "" : `${path}: ${a} != ${b}`;
  }
  if (a === null || b === null || typeof a !== "object" || typeof b !== "object") {
    return a === b ? "" : `${path}: ${JSON.stringify(a)} != ${JSON.stringify(b)}`;
  }
  if (Array.isArray(a) !== Array.isArray(b)) return `${path}: array vs object`;
  const keys = new Set([...Object.keys(a), ...Object.keys(b)]);
  if (Array.isArray(a) && a.length !== b.length) return `${path}: length ${a.length} != ${b.length}`;
  for (const k of keys) {
    if (!(k in a) || !(k in b)) return `${path}.${k}: missing on one side`;
    const d = difference(a[k], b[k], `${path}.${k}`);
    if (d) return d;
  }
  return "";
}

test("the page's fold equals Python's WatchState after every step", { skip: !casesPath }, () => {
  const cases = JSON.parse(readFileSync(casesPath, "utf8"));
  assert.ok(cases.length > 0);
  for (const c of cases) {
    const st = newState(c.info);
    c.events.forEach((ev, i) => {
      applyEvent(st, ev);
      const d = difference(comparable(st), c.expected[i]);
      assert.equal(d, "", `trace ${c.name}, step index ${i} (step ${ev.step}): JS (left) and Python (right) differ at ${d}`);
    });
  }
});

test("whole-number formatting rounds ties to even, as Python does", () => {
  assert.deepEqual([0.5, 1.5, 2.5, 12.5, 3.4, 3.6].map(fixed0), ["0", "2", "2", "12", "3", "4"]);
});
