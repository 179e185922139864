// Why the GPU waits, drawn (the TUI's tui/widgets/busy.py): a gauge of how much of the recent steps' wall time
// the device was busy (on a CPU: the forward pass ran), and a lane of recent steps, one column each, the busy
// share above and the host's share below. fold.mjs computes both from each StepEvent's host_s, forward_s and
// device_s (st.metrics.device_busy, st.lane, st.busyLabel); lessons/lesson10_gpu_waits.md explains them.
//
// A self-contained element with its own small style block (below, added once): the page's layout (style.css)
// and this gauge change independently. Shown only once the events carry the times (older traces do not).

export const BUSY_COLOUR = "#59a14f";     // tui/widgets/busy.py's colours
export const HOST_COLOUR = "#f28e2b";

const BUSY_CSS = `
.busy-gauge { grid-column: 1 / -1; }
.busy-gauge .busy-head { display: flex; gap: 8px; align-items: baseline; }
.busy-gauge .busy-meter { height: 8px; background: ${HOST_COLOUR}; margin: 3px 0; }
.busy-gauge .busy-meter > div { height: 100%; background: ${BUSY_COLOUR}; }
.busy-gauge .busy-lane { display: flex; gap: 1px; height: 20px; align-items: flex-end; }
.busy-gauge .busy-lane.host { align-items: flex-start; margin-top: 1px; }
.busy-gauge .busy-lane > div { flex: 1 1 0; min-width: 1px; max-width: 8px; }
.busy-gauge .busy-lane.busy > div { background: ${BUSY_COLOUR}; }
.busy-gauge .busy-lane.host > div { background: ${HOST_COLOUR}; }
.busy-gauge .swatch { display: inline-block; width: 8px; height: 8px; margin: 0 3px 0 8px; }
`;

function addBusyStyle() {
  if (document.getElementById("busy-style")) return;
  const style = document.createElement("style");
  style.id = "busy-style";
  style.textContent = BUSY_CSS;
  document.head.append(style);
}

function busyDiv(className, props = {}) { return Object.assign(document.createElement("div"), { className }, props); }

/** The busy gauge and lane for the fold ``st``, or null when its events carry no host/forward times. */
export function busyElement(st) {
  if (!st.lane.length) return null;
  addBusyStyle();
  const history = st.metrics.device_busy;
  const share = history[history.length - 1];
  const name = st.busyLabel === "device" ? "device busy" : "forward";
  const node = busyDiv("gauge busy-gauge", { id: "busy" });
  const head = busyDiv("busy-head");
  head.append(busyDiv("dim", { textContent: name }), busyDiv("value", { id: "busy-value", textContent: `${(share * 100).toFixed(0)}%` }),
    busyDiv("dim", { textContent: `of the last steps' wall time; the rest the ${st.busyLabel === "device" ? "device" : "forward pass"} waited for the host` }));
  const meter = busyDiv("busy-meter", { title: `${name}: ${(share * 100).toFixed(1)}% (orange: the host's share)` });
  meter.append(busyDiv("", { style: `width: ${(share * 100).toFixed(1)}%` }));
  const busyLane = busyDiv("busy-lane busy");
  const hostLane = busyDiv("busy-lane host");
  for (const [host, busy] of st.lane) {
    busyLane.append(busyDiv("", { style: `height: ${(busy * 100).toFixed(0)}%` }));
    hostLane.append(busyDiv("", { style: `height: ${(host * 100).toFixed(0)}%` }));
  }
  const legend = busyDiv("dim");
  const swatch = (colour) => Object.assign(busyDiv("swatch"), { style: `background: ${colour}` });
  legend.append("per step, newest right:", swatch(BUSY_COLOUR), st.busyLabel === "device" ? "device" : "forward",
    swatch(HOST_COLOUR), "host");
  node.append(head, meter, busyLane, hostLane, legend);
  return node;
}
