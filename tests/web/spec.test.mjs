// The page's speculation lines (minipaged/web/static/spec.mjs) against Python's words for the same records.
// tests/test_web_spec.py records speculative runs on the tiny model, writes each decode record with what the TUI
// says of it (tui/widgets/batch.py's auto_k_note) and runs this file with MINIPAGED_SPEC_CASES pointing at them;
// run alone, without it, the first test skips.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { autoKNote, speculationLines } from "../../minipaged/web/static/spec.mjs";

const casesPath = process.env.MINIPAGED_SPEC_CASES;

test("each request's next k and acceptance read as the TUI says them", { skip: !casesPath }, () => {
  const cases = JSON.parse(readFileSync(casesPath, "utf8"));
  assert.ok(cases.records.length > 0);
  for (const { record, note } of cases.records) {
    assert.equal(autoKNote(record), note, JSON.stringify(record));
  }
  for (const { event, lines } of cases.events) {
    assert.deepEqual(speculationLines(event), lines, `step ${event.step}`);
  }
});

test("a verification says its k and how many drafts were kept; a prefill or a plain decode says nothing", () => {
  const ev = { scheduled: [
    { request_id: "r1", kind: "decode", draft_token_ids: [4, 5, 6], num_accepted: 2, spec_k: 2, spec_acceptance: 0.613 },
    { request_id: "r2", kind: "decode", draft_token_ids: [], num_accepted: 0, spec_k: 0, spec_acceptance: 0.05 },
    { request_id: "r3", kind: "decode", draft_token_ids: [7], num_accepted: 1, spec_k: null, spec_acceptance: null },
    { request_id: "r4", kind: "decode", draft_token_ids: [], num_accepted: 0 },
    { request_id: "r5", kind: "prefill", draft_token_ids: [], num_accepted: 0, spec_k: 3, spec_acceptance: 0.9 },
  ] };
  assert.deepEqual(speculationLines(ev), ["r1 k=3: 2/3 accepted  next k=2, 61% kept",
    "r2 no drafts  next k=0 (speculation off, 5% kept)", "r3 k=1: 1/1 accepted"]);
  assert.deepEqual(speculationLines(null), []);
});
