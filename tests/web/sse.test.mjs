// The page's server-sent-events parser: pieces cut anywhere, comments skipped, named events kept.
import { test } from "node:test";
import assert from "node:assert/strict";
import { SSEParser } from "../../minipaged/web/static/sse.mjs";

test("messages survive any split, comments are skipped, names are kept", () => {
  const stream = "data: {\"a\":1}\n\n: heartbeat\n\nevent: dropped\ndata: {\"reason\":\"slow\"}\n\n"
    + "event: future-thing\r\ndata: x\r\n\r\ndata: [DONE]\n\n";
  const want = [{ event: "message", data: "{\"a\":1}" }, { event: "dropped", data: "{\"reason\":\"slow\"}" },
    { event: "future-thing", data: "x" }, { event: "message", data: "[DONE]" }];
  for (let cut = 1; cut < stream.length; cut++) {
    const parser = new SSEParser();
    const got = [...parser.feed(stream.slice(0, cut)), ...parser.feed(stream.slice(cut))];
    assert.deepEqual(got, want, `cut at ${cut}`);
  }
});

test("a long line costs time linear in its length: each piece is scanned once", () => {
  // 8 MB of data in 8 KB pieces: rescanning the buffer per piece (the old parser) read 4 G characters.
  const piece = "x".repeat(8192);
  const parser = new SSEParser(16 * 1024 * 1024);
  const started = performance.now();
  let got = parser.feed("data: ");
  for (let i = 0; i < 1024; i++) got = got.concat(parser.feed(piece));
  got = got.concat(parser.feed("\n\n"));
  const took = performance.now() - started;
  assert.equal(got.length, 1);
  assert.equal(got[0].data.length, 8 * 1024 * 1024);
  assert.ok(took < 1000, `8 MB in 8 KB pieces took ${took.toFixed(0)} ms`);
});

test("a line over the limit is skipped unread; the messages around it arrive", () => {
  const parser = new SSEParser(1000);
  const big = "data: " + "y".repeat(5000) + "\n\n";
  const stream = "data: before\n\n" + big + "data: after\n\n";
  const got = [];
  for (let i = 0; i < stream.length; i += 333) got.push(...parser.feed(stream.slice(i, i + 333)));
  assert.deepEqual(got.map((m) => m.data), ["before", "after"]);
  assert.equal(parser.skipped, 1);
  assert.equal(parser.pieces.length, 0);
});
