// Requests to this server: the API key (kept in this tab's sessionStorage only) goes
// out as a bearer token; a 401 tells the shell to ask for a key.
export const KEY_ITEM = "pipeserve.console.key";

export class AuthError extends Error {
  constructor(message) {
    super(message);
    this.name = "AuthError";
  }
}

export function authHeaders() {
  const key = sessionStorage.getItem(KEY_ITEM);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

export async function needKey(response) {
  const message = await errorMessage(response);
  window.dispatchEvent(new CustomEvent("pipeserve:key-needed", { detail: message }));
  return new AuthError(message);
}

export async function getJson(path, signal) {
  const response = await fetch(path, { headers: authHeaders(), signal });
  if (response.status === 401) throw await needKey(response);
  if (!response.ok) throw new Error(await errorMessage(response));
  return response.json();
}

// The message of an error body in any of the protocols' shapes.
export async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    const error = body.error ?? body;
    const message = typeof error === "string" ? error : error.message ?? text;
    return `${response.status}: ${message}`;
  } catch {
    return `${response.status}: ${text.slice(0, 300)}`;
  }
}
