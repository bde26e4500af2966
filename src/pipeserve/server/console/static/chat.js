// Chat: any model over any protocol it is served on, streamed; reasoning in a
// collapsible block, tool calls shown, Stop aborts the request (the server sees the
// connection close and cancels the generation), TTFT and tok/s per answer.
// Conversations live in this browser's localStorage.
import { el, clear } from "./dom.js";
import { authHeaders, errorMessage, getJson, needKey } from "./http.js";
import { renderMarkdown } from "./markdown.js";
import { PROTOCOLS, handleEvent, readSse, requestBody, requestHeaders } from "./protocols.js";

const STORE = "pipeserve.console.conversations";
const SAMPLING = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"];
let state = null; // survives switching tabs: {conversations, current, models, running}

function load() {
  try {
    return JSON.parse(localStorage.getItem(STORE)) || [];
  } catch {
    return [];
  }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state.conversations.slice(0, 50)));
}

function current() {
  return state.conversations.find((c) => c.id === state.current);
}

function newConversation() {
  const conversation = { id: `c${Date.now()}${Math.random().toString(16).slice(2, 6)}`, title: "New chat", turns: [] };
  state.conversations.unshift(conversation);
  state.current = conversation.id;
  return conversation;
}

export function showChat(root) {
  state ??= { conversations: load(), current: null, models: [], running: null };
  if (!current()) state.current = state.conversations[0]?.id ?? newConversation().id;
  clear(root);
  const ui = layout();
  root.append(ui.grid);
  getJson("/console/api/models")
    .then((body) => {
      state.models = body.models.filter((m) => servedProtocols(m).length);
      fillModels(ui);
    })
    .catch((error) => {
      if (error.name !== "AuthError") ui.notice.textContent = `Models: ${error.message}`;
    });
  renderHistory(ui);
  renderTurns(ui);
  return null; // a running answer keeps streaming into the stored conversation
}

function servedProtocols(model) {
  const found = [];
  for (const route of model.routes) {
    if (model.kind === "generation" && route.api in PROTOCOLS && !found.some((r) => r.api === route.api)) {
      found.push({ api: route.api, path: route.paths[0] });
    }
  }
  return found;
}

function layout() {
  const ui = {};
  ui.list = el("ul");
  const fresh = el("button", { type: "button", id: "chat-new" }, "New chat");
  fresh.addEventListener("click", () => {
    newConversation();
    save();
    renderHistory(ui);
    renderTurns(ui);
  });
  ui.messages = el("div", { class: "messages", id: "chat-messages" });
  ui.input = el("textarea", { id: "chat-input", placeholder: "Ask something (Enter sends, Shift+Enter: new line)", "aria-label": "Message" });
  ui.send = el("button", { type: "button", id: "chat-send" }, "Send");
  ui.stop = el("button", { type: "button", id: "chat-stop", class: "danger", disabled: true }, "Stop");
  ui.notice = el("div", { class: "error", role: "alert" });
  ui.send.addEventListener("click", () => send(ui));
  ui.stop.addEventListener("click", () => state.running?.abort());
  ui.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      send(ui);
    }
  });
  ui.settings = settingsPanel(ui);
  ui.grid = el("div", { class: "chat" },
    el("div", { class: "history card" }, fresh, ui.list),
    el("div", { class: "main" }, ui.messages, ui.notice,
      el("div", { class: "composer" }, ui.input, el("div", { class: "buttons" }, ui.send, ui.stop))),
    ui.settings);
  syncRunning(ui);
  return ui;
}

function settingsPanel(ui) {
  ui.model = el("select", { id: "chat-model", "aria-label": "Model" });
  ui.protocol = el("select", { id: "chat-protocol", "aria-label": "Protocol" });
  ui.maxTokens = el("input", { id: "chat-max-tokens", type: "number", min: 1, value: 256 });
  ui.thinking = el("input", { id: "chat-thinking", type: "checkbox" });
  ui.system = el("textarea", { id: "chat-system", placeholder: "System prompt (optional)" });
  ui.tools = el("textarea", { id: "chat-tools", placeholder: '[{"name": "get_weather", "description": "...", "parameters": {"type": "object"}}]' });
  ui.sampling = {};
  const fields = SAMPLING.map((name) => {
    ui.sampling[name] = el("input", { id: `chat-${name}`, type: "number", step: "any", placeholder: "server default" });
    return el("label", {}, name.replace(/_/g, " "), ui.sampling[name]);
  });
  ui.model.addEventListener("change", () => fillSettings(ui));
  ui.protocol.addEventListener("change", () => markSampling(ui));
  return el("div", { class: "settings card" },
    el("label", {}, "model", ui.model),
    el("label", {}, "protocol", ui.protocol),
    el("div", { class: "row" }, el("label", {}, "max tokens", ui.maxTokens),
      el("label", {}, "reasoning", el("span", {}, ui.thinking, " ask for it"))),
    el("h3", {}, "Sampling (the model's defaults)"),
    el("div", { class: "row" }, fields),
    el("label", {}, "system", ui.system),
    el("label", {}, "tools (JSON: name, description, parameters)", ui.tools));
}

function fillModels(ui) {
  clear(ui.model);
  for (const model of state.models) ui.model.append(el("option", { value: model.name }, model.name));
  const remembered = current()?.model;
  if (remembered && state.models.some((m) => m.name === remembered)) ui.model.value = remembered;
  fillSettings(ui);
}

function selectedModel(ui) {
  return state.models.find((m) => m.name === ui.model.value);
}

function fillSettings(ui) {
  const model = selectedModel(ui);
  if (!model) return;
  clear(ui.protocol);
  for (const { api } of servedProtocols(model)) ui.protocol.append(el("option", { value: api }, PROTOCOLS[api].label));
  const remembered = current()?.protocol;
  if (remembered && servedProtocols(model).some((p) => p.api === remembered)) ui.protocol.value = remembered;
  for (const name of SAMPLING) {
    const value = model.sampling[name];
    ui.sampling[name].value = value === undefined || value === null ? "" : value;
  }
  ui.maxTokens.value = Math.min(model.default_max_tokens || 256, 512);
  ui.thinking.checked = model.capabilities.includes("thinking");
  markSampling(ui);
}

function markSampling(ui) {
  const carried = PROTOCOLS[ui.protocol.value]?.sampling ?? [];
  for (const name of SAMPLING) {
    const input = ui.sampling[name];
    input.disabled = !carried.includes(name);
    input.title = input.disabled ? "not sent over this protocol (the server's default applies)" : "";
  }
}

function renderHistory(ui) {
  clear(ui.list);
  for (const conversation of state.conversations) {
    const remove = el("button", { type: "button", title: "Delete" }, "×");
    const item = el("li", { class: conversation.id === state.current ? "current" : "" },
      el("span", {}, conversation.title), remove);
    item.addEventListener("click", () => {
      state.current = conversation.id;
      renderHistory(ui);
      renderTurns(ui);
    });
    remove.addEventListener("click", (event) => {
      event.stopPropagation();
      state.conversations = state.conversations.filter((c) => c !== conversation);
      if (state.current === conversation.id) state.current = state.conversations[0]?.id ?? newConversation().id;
      save();
      renderHistory(ui);
      renderTurns(ui);
    });
    ui.list.append(item);
  }
}

function renderTurns(ui) {
  clear(ui.messages);
  for (const turn of current().turns) ui.messages.append(turnNode(turn));
  ui.messages.scrollTop = ui.messages.scrollHeight;
  state.redraw = (turn) => {
    const nodes = ui.messages.querySelectorAll(".msg");
    const index = current().turns.indexOf(turn);
    if (index < 0 || !nodes[index]) return;
    nodes[index].replaceWith(turnNode(turn));
    ui.messages.scrollTop = ui.messages.scrollHeight;
  };
}

function turnNode(turn) {
  if (turn.role === "user") return el("div", { class: "msg user" }, el("div", { class: "who" }, "you"), turn.content);
  const node = el("div", { class: "msg assistant" }, el("div", { class: "who" }, `${turn.model} · ${PROTOCOLS[turn.api]?.label ?? turn.api}`));
  if (turn.reasoning) {
    const details = el("details", { class: "reasoning" }, el("summary", {}, "Reasoning"), turn.reasoning);
    details.open = Boolean(turn.reasoningOpen);
    details.addEventListener("toggle", () => (turn.reasoningOpen = details.open));
    node.append(details);
  }
  node.append(el("div", { class: "answer" }, renderMarkdown(turn.content)));
  for (const call of turn.tools ?? []) {
    node.append(el("div", { class: "tool" }, "tool call ", el("strong", {}, call.name), el("pre", {}, call.args)));
  }
  if (turn.error) node.append(el("div", { class: "failure" }, turn.error));
  if (turn.stats) node.append(el("div", { class: "stats" }, statsLine(turn.stats)));
  return node;
}

function statsLine(stats) {
  const parts = [];
  if (stats.ttftMs !== undefined) parts.push(`TTFT ${Math.round(stats.ttftMs)} ms`);
  if (stats.tokensPerSecond !== undefined) parts.push(`${stats.tokensPerSecond.toFixed(1)} tok/s`);
  if (stats.outputTokens !== undefined) parts.push(`${stats.outputTokens} tokens`);
  if (stats.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function syncRunning(ui) {
  ui.send.disabled = Boolean(state.running);
  ui.stop.disabled = !state.running;
}

function options(ui) {
  const sampling = {};
  for (const name of SAMPLING) {
    const input = ui.sampling[name];
    if (!input.disabled && input.value !== "") sampling[name] = Number(input.value);
  }
  const tools = ui.tools.value.trim() ? JSON.parse(ui.tools.value) : [];
  return {
    model: ui.model.value, maxTokens: Number(ui.maxTokens.value) || 256, sampling,
    system: ui.system.value.trim(), tools, thinking: ui.thinking.checked,
  };
}

async function send(ui) {
  const text = ui.input.value.trim();
  const model = selectedModel(ui);
  if (!text || !model || state.running) return;
  ui.notice.textContent = "";
  let settings;
  try {
    settings = options(ui);
  } catch (error) {
    ui.notice.textContent = `tools: ${error.message}`;
    return;
  }
  const api = ui.protocol.value;
  const path = servedProtocols(model).find((p) => p.api === api).path;
  const conversation = current();
  if (!conversation.turns.length) conversation.title = text.slice(0, 40);
  conversation.model = model.name;
  conversation.protocol = api;
  const history = conversation.turns.map((t) => ({ role: t.role, content: t.content }));
  const user = { role: "user", content: text };
  const answer = { role: "assistant", content: "", reasoning: "", tools: [], model: model.name, api, reasoningOpen: true };
  conversation.turns.push(user, answer);
  ui.input.value = "";
  renderHistory(ui);
  renderTurns(ui);
  const controller = new AbortController();
  state.running = controller;
  syncRunning(ui);
  await stream(path, api, [...history, user], settings, answer, controller.signal);
  state.running = null;
  answer.reasoningOpen = false;
  save();
  state.redraw(answer);
  const live = document.getElementById("chat-send");
  if (live) {
    live.disabled = false;
    document.getElementById("chat-stop").disabled = true;
  }
}

async function stream(path, api, turns, settings, answer, signal) {
  const started = performance.now();
  let first = null;
  let frame = null;
  const redraw = () => {
    if (frame === null) frame = requestAnimationFrame(() => {
      frame = null;
      state.redraw(answer);
    });
  };
  const output = () => {
    first ??= performance.now();
    redraw();
  };
  const tools = {}; // by the protocol's index of the call
  const call = (key, name = "") => {
    if (!tools[key]) answer.tools.push((tools[key] = { name, args: "" }));
    return tools[key];
  };
  const sink = {
    text: (t) => { answer.content += t; output(); },
    reasoning: (t) => { answer.reasoning += t; output(); },
    toolStart: (key, name) => { call(key, name).name = name; output(); },
    toolArgs: (key, delta) => { call(key).args += delta; output(); },
    usage: (u) => { if (u.output !== undefined) answer.outputTokens = u.output; },
    error: (message) => { answer.error = message; redraw(); },
  };
  try {
    const response = await fetch(path, {
      method: "POST", signal,
      headers: { ...requestHeaders(api), ...authHeaders() },
      body: JSON.stringify(requestBody(api, turns, settings)),
    });
    if (response.status === 401) throw await needKey(response);
    if (!response.ok) throw new Error(await errorMessage(response));
    await readSse(response, (event, data) => handleEvent(api, event, data, sink));
  } catch (error) {
    if (error.name === "AbortError") answer.stopped = true;
    else answer.error = error.message;
  }
  const ended = performance.now();
  answer.stats = { stopped: answer.stopped };
  if (first !== null) {
    answer.stats.ttftMs = first - started;
    const tokens = answer.outputTokens;
    if (tokens !== undefined) {
      answer.stats.outputTokens = tokens;
      if (ended > first && tokens > 1) answer.stats.tokensPerSecond = ((tokens - 1) * 1000) / (ended - first);
    }
  }
}
