// Why the GPU waits, drawn (the TUI's tui/widgets/busy.py): a gauge of how much of the recent steps' wall time
// the device was busy (on a CPU: the forward pass ran), and a lane of recent steps, one column each, the busy
// share above and the host's share below. fold.mjs computes both from each StepEvent's host_s, forward_s and
// device_s (st.metrics.device_busy, st.lane, st.busyLabel); lessons/lesson10_gpu_waits.md explains them.
//
// A self-contained element with its own small block at the end of style.css ("the busy gauge"): the page's
// layout and this gauge change independently. Shown only once the events carry the times (older traces do not).

function busyDiv(className, props = {}) { return Object.assign(document.createElement("div"), { className }, props); }

/** A cell of the lane, or the meter's fill: its height (or width) a share of its box, set through CSSOM (the
 * page's Content-Security-Policy allows no inline style markup). */
function sized(dimension, share) {
  const node = busyDiv("");
  node.style[dimension] = `${(share * 100).toFixed(1)}%`;
  return node;
}

/** The busy gauge and lane for the fold ``st``, or null when its events carry no host/forward times. */
export function busyElement(st) {
  if (!st.lane.length) return null;
  const history = st.metrics.device_busy;
  const share = history[history.length - 1];
  const onDevice = st.busyLabel === "device";
  const name = onDevice ? "device busy" : "forward";
  const node = busyDiv("gauge busy-gauge", { id: "busy" });
  const head = busyDiv("busy-head");
  head.append(busyDiv("dim", { textContent: name }),
    busyDiv("value", { id: "busy-value", textContent: `${(share * 100).toFixed(0)}%` }),
    busyDiv("dim", { textContent: `of the last steps' wall time; the rest the ${onDevice ? "device" : "forward pass"} `
      + "waited for the host" }));
  const meter = busyDiv("busy-meter", { title: `${name}: ${(share * 100).toFixed(1)}% (orange: the host's share)` });
  meter.append(sized("width", share));
  const busyLane = busyDiv("busy-lane busy");
  const hostLane = busyDiv("busy-lane host");
  for (const [host, busy] of st.lane) {
    busyLane.append(sized("height", busy));
    hostLane.append(sized("height", host));
  }
  const legend = busyDiv("dim");
  legend.append("per step, newest right:", busyDiv("swatch busy"), onDevice ? "device" : "forward",
    busyDiv("swatch host"), "host");
  node.append(head, meter, busyLane, hostLane, legend);
  return node;
}
