// Speculative decoding in the step view: each verifying request's k (the drafts it sent this step) and how many
// the target accepted, and, under the automatic k (speculative_config auto_k), the k it chose for the request's
// next step and its acceptance estimate, in the words of the TUI's batch panel (tui/widgets/batch.py). Pure
// functions of one StepEvent: node's tests run them (tests/web/spec.test.mjs).
import { fixed0 } from "./fold.mjs";

/** tui/widgets/batch.py's auto_k_note: the automatic k's choice for the next step ("" for a fixed k). */
export function autoKNote(s) {
  if (s.spec_k === null || s.spec_k === undefined) return "";
  const known = s.spec_acceptance !== null && s.spec_acceptance !== undefined;
  const estimate = known ? `, ${fixed0(s.spec_acceptance * 100)}% kept` : "";
  return s.spec_k ? `  next k=${s.spec_k}${estimate}` : `  next k=0 (speculation off${estimate})`;
}

/** One line per decoding request that speculates this step or chose its next k: "r1 k=3: 2/3 accepted  next
 * k=2, 61% kept" (a fixed k says only this step's verdict; a request that sent no drafts, "no drafts"). */
export function speculationLines(ev) {
  const lines = [];
  for (const s of (ev && ev.scheduled) || []) {
    const drafts = (s.draft_token_ids || []).length;
    const note = autoKNote(s);
    if (s.kind !== "decode" || (!drafts && !note)) continue;
    const verdict = drafts ? `k=${drafts}: ${s.num_accepted}/${drafts} accepted` : "no drafts";
    lines.push(`${s.request_id} ${verdict}${note}`);
  }
  return lines;
}
