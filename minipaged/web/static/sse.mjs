// Server-sent events, parsed from a byte stream that arrives in arbitrary pieces (fetch()'s ReadableStream:
// EventSource cannot send the API key header). Comment lines (": heartbeat") are skipped; each message is
// {event, data}, event "message" when the server named none, so callers can ignore names they do not know.
//
// Each piece is scanned once: the unfinished line is kept as a list of pieces and joined when its newline
// comes. (Appending to one buffer and searching it from its start on every piece was quadratic: a 32 MB line
// took the page 10.7 s.) A line longer than `maxLineChars` is skipped whole, unread, and counted in `skipped`:
// one oversized event costs the page nothing but the bytes passing through.

export const MAX_LINE_CHARS = 8 * 1024 * 1024;

export class SSEParser {
  constructor(maxLineChars = MAX_LINE_CHARS) {
    this.maxLineChars = maxLineChars;
    this.pieces = [];            // the line so far, in the pieces it came in
    this.pending = 0;            // characters in `pieces`
    this.oversized = false;      // the current line passed the limit: drop it up to its newline
    this.skipped = 0;            // lines dropped for their size
    this.afterCR = false;        // the last piece ended with "\r": a "\n" first in the next one is part of it
    this.event = ""; this.data = [];
  }

  /** Feed decoded text; returns the messages it completed. */
  feed(text) {
    const messages = [];
    let start = 0;
    if (this.afterCR) { this.afterCR = false; if (text.startsWith("\n")) start = 1; }
    const newline = /\r\n?|\n/g;
    newline.lastIndex = start;
    let match;
    while ((match = newline.exec(text)) !== null) {
      const end = match.index;
      if (match[0] === "\r" && end === text.length - 1) this.afterCR = true;   // "\r\n" may be split here
      this.keep(text, start, end);
      const line = this.oversized ? null : this.pieces.join("");
      if (this.oversized) this.skipped += 1;
      this.pieces = []; this.pending = 0; this.oversized = false;
      start = newline.lastIndex;
      if (line !== null) this.line(line, messages);
    }
    this.keep(text, start, text.length);
    return messages;
  }

  keep(text, start, end) {
    if (end <= start || this.oversized) return;
    this.pending += end - start;
    if (this.pending > this.maxLineChars) { this.oversized = true; this.pieces = []; return; }
    this.pieces.push(text.slice(start, end));
  }

  line(line, messages) {
    if (line === "") {
      if (this.data.length) messages.push({ event: this.event || "message", data: this.data.join("\n") });
      this.event = ""; this.data = [];
    } else if (!line.startsWith(":")) {
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "data") this.data.push(value);
      else if (field === "event") this.event = value;
    }
  }
}
