// The status view: slots busy, requests waiting and tokens per second, read from the server's /metrics
// (Prometheus text) every few seconds while the page is visible.

const POLL_MS = 2000;

/** The samples of the Prometheus text format by name, as a map; a server with several models labels each
 * sample with its model, and those are added up (histogram buckets, labelled ``le``, are left out). */
export function parseMetrics(text) {
  const values = new Map();
  for (const line of text.split("\n")) {
    const match = /^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)/.exec(line);
    if (!match || /(^|,)le=/.test(match[2] ?? "")) continue;
    values.set(match[1], (values.get(match[1]) ?? 0) + Number(match[3]));
  }
  return values;
}

export class StatusView {
  constructor(elements, api, slots) {
    this.el = elements; // {slots, queue, speed, state}
    this.api = api;
    this.slots = slots; // () => the server's parallel slots (from /v1/models), or null
    this.previous = null; // [time ms, generated tokens] of the last poll
    this.timer = null;
  }

  start() {
    const poll = async () => {
      if (document.visibilityState === "visible") await this.poll();
      this.timer = setTimeout(poll, POLL_MS);
    };
    poll();
  }

  async poll() {
    let metrics;
    try {
      metrics = parseMetrics(await this.api.metricsText());
    } catch (error) {
      this.show("–", "–", "–", error.kind === "auth" ? "API key needed" : "Server unreachable", "down");
      this.previous = null;
      return;
    }
    const running = metrics.get("llmfw_requests_running") ?? 0;
    const waiting = metrics.get("llmfw_requests_waiting") ?? 0;
    const generated = metrics.get("llmfw_generated_tokens_total") ?? 0;
    const now = performance.now();
    let speed = "–";
    if (this.previous) {
      const [then, before] = this.previous;
      speed = (Math.max(0, generated - before) / ((now - then) / 1000)).toFixed(1);
    }
    this.previous = [now, generated];
    const slots = this.slots();
    this.show(slots ? `${running} / ${slots}` : String(running), String(waiting), speed, "Connected", "up");
  }

  show(slots, queue, speed, state, kind) {
    this.el.slots.textContent = slots;
    this.el.queue.textContent = queue;
    this.el.speed.textContent = speed;
    this.el.state.textContent = state;
    this.el.state.dataset.kind = kind;
  }
}
