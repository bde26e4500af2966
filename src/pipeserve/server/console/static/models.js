// Models: each model's state, memory, device, aliases, sampling defaults, its pipeline
// drawn as the chain of stages with their params, the routes serving it and, when
// sharded, its ranks, hosts and layers with the group's health. Refreshed every 3 s.
import { bytes, clear, el, every } from "./dom.js";
import { getJson } from "./http.js";

export function showModels(root) {
  clear(root);
  const list = el("div", { id: "models" }, el("p", { class: "muted" }, "loading..."));
  const notice = el("p", { class: "error", role: "alert" });
  root.append(notice, list);
  return every(3000, async () => {
    try {
      const body = await getJson("/console/api/models");
      const cluster = body.models.some((m) => m.sharding) ? await clusterView() : {};
      notice.textContent = "";
      clear(list);
      if (!body.models.length) list.append(el("p", { class: "muted" }, "No model is visible to this key."));
      for (const model of body.models) list.append(modelCard(model, cluster[model.name]));
    } catch (error) {
      if (error.name !== "AuthError") notice.textContent = error.message;
      throw error;
    }
  });
}

// The live placement of node-placed sharded models (GET /v1/cluster; it needs a key
// without a model limit: without one the configured plan is shown alone).
async function clusterView() {
  try {
    return (await getJson("/v1/cluster")).models ?? {};
  } catch (error) {
    if (error.name === "AuthError") throw error;
    return {};
  }
}

function modelCard(model, placed) {
  const stateClass = model.state.replace(/\s/g, "-");
  return el("div", { class: "card model", "data-model": model.name },
    el("div", { class: "model-head" },
      el("h2", {}, model.name),
      el("span", { class: `badge ${stateClass}` }, model.state,
        model.loading_seconds !== null && model.loading_seconds !== undefined
          ? ` for ${Math.round(model.loading_seconds)} s (${bytes(model.memory_bytes)} of weights)` : ""),
      model.healthy ? null : el("span", { class: "badge bad" }, `unhealthy: ${model.health_reason}`),
      el("span", { class: "muted" }, `${model.family} · ${model.engine}`)),
    model.error ? el("p", { class: "error" }, model.error) : null,
    el("div", { class: "facts" },
      fact("aliases", model.aliases.join(", ") || "none"),
      fact("load", model.load + (model.keep_alive !== null ? ` (keep_alive ${model.keep_alive} s)` : "")),
      fact("memory", bytes(model.memory_bytes)),
      fact("device", model.device),
      fact("backend", model.backend),
      fact("context", model.context_length ? `${model.context_length} tokens` : "model default"),
      model.kv_bytes_per_token ? fact("KV cache", `${bytes(model.kv_bytes_per_token)} per token`) : null,
      fact("in flight / queue", `${model.in_flight} / ${model.queue}`),
      model.embedding ? null : fact("sampling defaults", samplingText(model.sampling)),
      ...embeddingFacts(model),
      fact("source", model.source)),
    el("h3", {}, model.embedding ? `Pipeline: ${model.kind}` : `Pipeline: ${model.pipeline}`),
    model.embedding ? embeddingChain(model) : chain(model.stages),
    model.adapters?.length ? adapters(model.adapters) : null,
    el("h3", {}, "Routes"),
    routes(model.routes),
    model.sharding ? sharding(model.sharding) : null,
    placed ? placement(placed) : null);
}

// An embedding or rerank model: its dimensions, pooling and limits, and its chain.
function embeddingFacts(model) {
  const spec = model.embedding;
  if (!spec) return [];
  return [
    fact("kind", model.kind),
    fact("dimensions", `${spec.dimensions}${spec.matryoshka ? " (shorter on request)" : ""}`),
    fact("pooling", `${spec.pooling}${spec.normalize ? ", normalised" : ""}`),
    fact("max input", `${spec.max_length} tokens`),
  ];
}

function embeddingChain(model) {
  const spec = model.embedding;
  const steps = model.kind === "rerank"
    ? ["tokenize", "encode", "score"]
    : ["tokenize", "encode", `pool (${spec.pooling})`, spec.normalize ? "normalise" : null];
  const node = el("div", { class: "chain" });
  steps.filter(Boolean).forEach((step, index) => {
    if (index) node.append(el("span", { class: "arrow" }, "→"));
    node.append(el("div", { class: "stage" }, el("div", { class: "kind" }, step)));
  });
  return node;
}

function fact(name, value) {
  return el("div", {}, el("b", {}, name), value);
}

function samplingText(sampling) {
  const entries = Object.entries(sampling);
  return entries.length ? entries.map(([k, v]) => `${k} ${v}`).join(", ") : "protocol defaults";
}

function chain(stages) {
  const node = el("div", { class: "chain" });
  stages.forEach((stage, index) => {
    if (index) node.append(el("span", { class: "arrow" }, "→"));
    const params = Object.entries(stage.params).filter(([, v]) => v !== null && v !== "" && !(Array.isArray(v) && !v.length));
    node.append(el("div", { class: `stage ${stage.role}` },
      el("div", { class: "kind" }, stage.kind),
      el("div", { class: "role" }, stage.role),
      params.length ? el("dl", {}, params.flatMap(([k, v]) => {
        const text = typeof v === "string" ? v : JSON.stringify(v);
        return [el("dt", {}, k), el("dd", { title: text }, text)];
      })) : null));
  });
  return node;
}

// LoRA adapters served with the model (each request names `model:adapter` or the adapter).
function adapters(list) {
  return el("div", {},
    el("h3", {}, "LoRA adapters"),
    el("table", { class: "adapters" },
      el("tr", {}, el("th", {}, "adapter"), el("th", {}, "request as"), el("th", {}, "folder"), el("th", {}, "state")),
      list.map((a) => el("tr", {}, el("td", {}, a.name), el("td", {}, `${a.request_name} or ${a.name}`),
        el("td", {}, a.path),
        el("td", { class: a.error ? "error" : "" }, a.error ? `refused: ${a.error}` : "served")))));
}

function routes(list) {
  return el("table", {},
    el("tr", {}, el("th", {}, "protocol"), el("th", {}, "paths")),
    list.map((r) => el("tr", {}, el("td", {}, r.api), el("td", {}, r.paths.join(", ")))));
}

function sharding(plan) {
  return el("div", {},
    el("h3", {}, `Sharding: ${plan.strategy} over ${plan.ranks.length} ranks (${plan.backend}) `,
      el("span", { class: `badge ${plan.healthy ? "ok" : "bad"}` }, plan.healthy ? "healthy" : `lost: ${plan.reason}`)),
    el("table", {},
      el("tr", {}, el("th", {}, "rank"), el("th", {}, "host"), el("th", {}, "layers")),
      plan.ranks.map((r) => el("tr", {}, el("td", {}, r.rank), el("td", {}, r.host), el("td", {}, r.layers)))));
}

function placement(view) {
  return el("div", {},
    el("h3", {}, "Placement now ",
      el("span", { class: `badge ${view.healthy ? "ok" : "bad"}` }, view.healthy ? "healthy" : `lost: ${view.reason}`)),
    el("ul", {}, (view.plan ?? []).map((line) => el("li", {}, line))),
    view.ranks?.length ? el("table", {},
      el("tr", {}, el("th", {}, "rank"), el("th", {}, "machine"), el("th", {}, "state"), el("th", {}, "last heartbeat")),
      view.ranks.map((r) => el("tr", {}, el("td", {}, r.rank), el("td", {}, r.address), el("td", {}, r.state),
        el("td", {}, `${r.heartbeat_age_s} s ago`)))) : null,
    view.left_out?.length ? el("p", { class: "muted" }, `left out: ${view.left_out.map((x) => (typeof x === "string" ? x : JSON.stringify(x))).join(", ")}`) : null);
}
