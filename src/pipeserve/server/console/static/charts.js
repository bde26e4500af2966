// Small line charts as inline SVG (no library): a few series over the same time axis.
const NS = "http://www.w3.org/2000/svg";
const WIDTH = 360;
const HEIGHT = 140;
const PAD = { left: 44, right: 8, top: 8, bottom: 18 };

function svg(tag, attrs) {
  const node = document.createElementNS(NS, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  return node;
}

// series: [{label, color, values: [number|null]}], times: [epoch seconds]
export function lineChart(times, series, unit) {
  const root = svg("svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, role: "img" });
  const values = series.flatMap((s) => s.values).filter((v) => v !== null && v !== undefined);
  const top = niceMax(Math.max(0, ...values));
  const x = (i) => PAD.left + (i * (WIDTH - PAD.left - PAD.right)) / Math.max(1, times.length - 1);
  const y = (v) => HEIGHT - PAD.bottom - (v / top) * (HEIGHT - PAD.top - PAD.bottom);
  for (const tick of [0, top / 2, top]) {
    root.append(svg("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: y(tick), y2: y(tick), stroke: "#e3e7ee" }));
    const label = svg("text", { x: PAD.left - 4, y: y(tick) + 4, "text-anchor": "end", "font-size": 10, fill: "#6b7482" });
    label.textContent = `${formatNumber(tick)}${unit}`;
    root.append(label);
  }
  if (times.length) {
    const minutes = Math.round((times[times.length - 1] - times[0]) / 60);
    const label = svg("text", { x: PAD.left, y: HEIGHT - 4, "font-size": 10, fill: "#6b7482" });
    label.textContent = `${minutes} min ago`;
    const now = svg("text", { x: WIDTH - PAD.right, y: HEIGHT - 4, "font-size": 10, fill: "#6b7482", "text-anchor": "end" });
    now.textContent = "now";
    root.append(label, now);
  }
  for (const s of series) {
    let d = "";
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) return;
      const joined = i > 0 && s.values[i - 1] !== null && s.values[i - 1] !== undefined;
      d += `${joined ? "L" : "M"}${x(i).toFixed(1)},${y(v).toFixed(1)}`;
    });
    if (d) root.append(svg("path", { d, fill: "none", stroke: s.color, "stroke-width": 1.8 }));
    s.values.forEach((v, i) => {
      const lonely = v !== null && v !== undefined && [s.values[i - 1], s.values[i + 1]].every((n) => n === null || n === undefined);
      if (lonely) root.append(svg("circle", { cx: x(i), cy: y(v), r: 2.2, fill: s.color }));
    });
  }
  return root;
}

function niceMax(value) {
  if (value <= 0) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (value <= step * power) return step * power;
  return 10 * power;
}

function formatNumber(value) {
  return value >= 100 || Number.isInteger(value) ? String(Math.round(value)) : value.toFixed(value < 1 ? 2 : 1);
}
