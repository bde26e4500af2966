// Config: the YAML this server runs (API keys redacted), its pipelines, and, after a
// reload the server refused, each problem with its position in the refused file.
import { clear, el } from "./dom.js";
import { getJson } from "./http.js";

export function showConfig(root) {
  clear(root);
  const notice = el("p", { class: "error", role: "alert" });
  const body = el("div", { id: "config" }, el("p", { class: "muted" }, "loading..."));
  root.append(notice, body);
  getJson("/console/api/config")
    .then((config) => draw(config, body))
    .catch((error) => {
      if (error.name !== "AuthError") notice.textContent = error.message;
    });
  return null;
}

function draw(config, body) {
  clear(body);
  const reload = config.reload;
  if (reload && !reload.ok) {
    body.append(el("div", { class: "card", id: "reload-problems" },
      el("h2", { class: "error" }, `Reload refused at ${reload.at}: the server keeps running the config below`),
      el("ul", { class: "problems" }, reload.problems.map((p) => el("li", {},
        p.line ? el("code", {}, `${p.file}:${p.line}:${p.col}`) : null, " ",
        p.path ? el("strong", {}, p.path) : null, p.path ? ": " : "", p.message)))));
  } else if (reload) {
    body.append(el("p", { class: "muted" }, `Last reload applied at ${reload.at}.`));
  }
  body.append(el("h2", {}, config.path || "config"), yaml(config.text));
  for (const pipeline of config.pipelines) {
    const details = el("details", { class: "card" }, el("summary", {}, `pipeline ${pipeline.name} (${pipeline.path})`),
      yaml(pipeline.text));
    body.append(details);
  }
}

// The text with line numbers, each line a text node.
function yaml(text) {
  const pre = el("pre", { class: "yaml" });
  text.split("\n").forEach((line, index) => {
    pre.append(el("span", { class: "line" }, el("span", { class: "no" }, index + 1), line));
  });
  return pre;
}
