// The console's shell: tabs, the API key (asked for only when the server wants one,
// kept in this tab's sessionStorage, sent as a bearer token) and JSON requests.
import { el, clear } from "./dom.js";
import { KEY_ITEM } from "./http.js";
import { showChat } from "./chat.js";
import { showModels } from "./models.js";
import { showLive } from "./live.js";
import { showConfig } from "./config.js";

const views = { chat: showChat, models: showModels, live: showLive, config: showConfig };
let stopView = null;

function askForKey(message) {
  if (stopView) stopView();
  stopView = null;
  for (const view of document.querySelectorAll(".view")) view.hidden = true;
  document.getElementById("login").hidden = false;
  const known = sessionStorage.getItem(KEY_ITEM);
  document.getElementById("login-error").textContent = known ? message : "";
  document.getElementById("login-key").focus();
}

function setupLogin() {
  document.getElementById("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = document.getElementById("login-key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_ITEM, key);
    document.getElementById("login-key").value = "";
    route();
  });
}

function showKeyStatus() {
  const status = document.getElementById("key-status");
  clear(status);
  if (!sessionStorage.getItem(KEY_ITEM)) return;
  const forget = el("button", { class: "secondary", type: "button" }, "forget key");
  forget.addEventListener("click", () => {
    sessionStorage.removeItem(KEY_ITEM);
    route();
  });
  status.append("key set ", forget);
}

function route() {
  const name = location.hash.slice(1) in views ? location.hash.slice(1) : "chat";
  if (stopView) stopView();
  document.getElementById("login").hidden = true;
  for (const view of document.querySelectorAll(".view")) view.hidden = view.id !== `view-${name}`;
  for (const tab of document.querySelectorAll("#tabs a")) {
    tab.classList.toggle("active", tab.dataset.view === name);
  }
  showKeyStatus();
  stopView = views[name](document.getElementById(`view-${name}`)) || null;
}

setupLogin();
window.addEventListener("pipeserve:key-needed", (event) => askForKey(event.detail));
window.addEventListener("hashchange", route);
route();
