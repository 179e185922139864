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
