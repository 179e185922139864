// Server-sent events, parsed from a byte stream that arrives in arbitrary pieces (fetch()'s ReadableStream:
// EventSource cannot send the API key header). Comment lines (": heartbeat") are skipped; each message is
// {event, data}, event "message" when the server named none, so callers can ignore names they do not know.

export class SSEParser {
  constructor() { this.buffer = ""; this.event = ""; this.data = []; }

  /** Feed decoded text; returns the messages it completed. */
  feed(text) {
    this.buffer += text;
    const messages = [];
    let newline;
    while ((newline = this.buffer.search(/\r\n|\r|\n/)) >= 0) {
      const width = this.buffer.startsWith("\r\n", newline) ? 2 : 1;
      if (this.buffer[newline] === "\r" && width === 1 && newline === this.buffer.length - 1) break;  // \r\n split
      const line = this.buffer.slice(0, newline);
      this.buffer = this.buffer.slice(newline + width);
      if (line === "") {
        if (this.data.length) messages.push({ event: this.event || "message", data: this.data.join("\n") });
        this.event = ""; this.data = [];
      } else if (line.startsWith(":")) {
        continue;
      } else {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "data") this.data.push(value);
        else if (field === "event") this.event = value;
      }
    }
    return messages;
  }
}
