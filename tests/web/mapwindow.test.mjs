// The block map's window (minipaged/web/static/mapwindow.mjs): it holds every block in use, at one block a cell
// while they fit, follows them through a big pool, and stays put while it still holds them.
// tests/test_web_room.py runs this file with node's built-in test runner.
import { test } from "node:test";
import assert from "node:assert/strict";
import { mapWindow, blocksInUse } from "../../minipaged/web/static/mapwindow.mjs";

const holds = (w, lo, hi) => w.start <= lo && hi < w.start + w.group * w.count;

test("a pool that fits is drawn whole, one block a cell", () => {
  assert.deepEqual(mapWindow(160, 3, 150, 256), { start: 0, group: 1, count: 160 });
});

test("serve's 1,456-block pool: eight requests' blocks in a 256-block window, not two rows of 1,456", () => {
  assert.deepEqual(mapWindow(1456, 0, 79, 256), { start: 0, group: 1, count: 256 });
  assert.deepEqual(mapWindow(1456, null, null, 256), { start: 0, group: 1, count: 256 });
});

test("the window follows the blocks in use through the pool and stays put while it holds them", () => {
  const first = mapWindow(1456, 0, 79, 256);
  const later = mapWindow(1456, 300, 380, 256, first);            // the free queue handed out later blocks
  assert.deepEqual(later, { start: 288, group: 1, count: 256 });
  assert.equal(mapWindow(1456, 320, 500, 256, later), later);      // still inside: the same window, no jump
  const end = mapWindow(1456, 1400, 1455, 256, later);             // near the end: the last 256 blocks
  assert.deepEqual(end, { start: 1200, group: 1, count: 256 });
});

test("blocks spread wider than the window are grouped 2, 4 ... a cell, and zoom back in when they gather", () => {
  const wide = mapWindow(1456, 100, 500, 256);
  assert.equal(wide.group, 2);
  assert.ok(holds(wide, 100, 500));
  const wrapped = mapWindow(1456, 3, 1450, 256, wide);             // in use at both ends of the pool
  assert.deepEqual(wrapped, { start: 0, group: 8, count: 182 });
  assert.deepEqual(mapWindow(1456, 40, 60, 256, wrapped), { start: 32, group: 1, count: 256 });
});

test("every window holds the blocks in use and draws at most the cells asked for", () => {
  let current = null;
  for (let i = 0; i < 2000; i++) {
    const n = 100 + ((i * 7919) % 5000), a = (i * 104729) % n, b = (i * 1299709) % n;
    const lo = Math.min(a, b), hi = Math.max(a, b), cells = i % 2 ? 256 : 128;
    current = mapWindow(n, lo, hi, cells, i % 3 ? current : null);
    assert.ok(holds(current, lo, hi) && current.count <= cells && current.start + (current.count - 1) * current.group < n,
      JSON.stringify({ n, lo, hi, cells, current }));
  }
});

test("the blocks in use: the lowest and the highest with an owner", () => {
  assert.deepEqual(blocksInUse([[], ["a"], [], ["a", "b"], []]), [1, 3]);
  assert.deepEqual(blocksInUse([[], []]), [null, null]);
});
