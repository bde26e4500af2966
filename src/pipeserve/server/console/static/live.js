// Live: requests in flight, queue, output per second and TTFT percentiles over the
// last minutes, from /console/api/live (polled every 2 s while shown).
import { clear, el, every } from "./dom.js";
import { getJson } from "./http.js";
import { lineChart } from "./charts.js";

export function showLive(root) {
  clear(root);
  const numbers = el("div", { class: "numbers", id: "live-numbers" });
  const charts = el("div", { class: "charts", id: "live-charts" });
  const notice = el("p", { class: "error", role: "alert" });
  root.append(notice, numbers, charts);
  return every(2000, async () => {
    try {
      const body = await getJson("/console/api/live");
      notice.textContent = "";
      draw(body, numbers, charts);
    } catch (error) {
      if (error.name !== "AuthError") notice.textContent = error.message;
      throw error;
    }
  });
}

function draw(body, numbers, charts) {
  const series = body.series;
  const last = series[series.length - 1] ?? {};
  const recent = series.slice(-6); // the last minute
  const ttfts = recent.map((b) => b.ttft_p50).filter((v) => v !== null);
  clear(numbers);
  numbers.append(
    number("in flight", body.in_flight, "in-flight"),
    number("queued", body.queue, "queue"),
    number("tok/s (last 10 s)", (last.tokens_per_s ?? 0).toFixed(1), "tps"),
    number("TTFT p50 (last min)", ttfts.length ? `${Math.round(Math.max(...ttfts) * 1000)} ms` : "–", "ttft"),
    number("requests (5 min)", series.reduce((n, b) => n + b.requests, 0), "requests"));
  const times = series.map((b) => b.t);
  clear(charts);
  charts.append(
    chart("Requests in flight and queued", times, [
      { label: "in flight", color: "#2f6fde", values: series.map((b) => b.in_flight) },
      { label: "queued", color: "#b7791f", values: series.map((b) => b.queue) },
    ], ""),
    chart("Output tokens per second", times, [
      { label: "tok/s", color: "#1f8a4c", values: series.map((b) => b.tokens_per_s) },
    ], ""),
    chart("Time to first token", times, [
      { label: "p50", color: "#2f6fde", values: series.map((b) => b.ttft_p50) },
      { label: "p90", color: "#b7791f", values: series.map((b) => b.ttft_p90) },
      { label: "p99", color: "#c53030", values: series.map((b) => b.ttft_p99) },
    ], " s"));
}

function number(label, value, id) {
  return el("div", { class: "number", id: `live-${id}` }, el("b", {}, value), el("span", {}, label));
}

function chart(title, times, series, unit) {
  return el("div", { class: "card chart" },
    el("h3", {}, title),
    lineChart(times, series, unit),
    el("div", { class: "legend" }, series.flatMap((s) => [swatch(s.color), s.label, " "])));
}

function swatch(color) {
  const node = el("i");
  node.style.background = color; // a CSSOM property, allowed by the page's CSP (a style attribute is not)
  return node;
}
