// The server's public API as the page uses it: JSON calls, the completions stream, errors said plainly.
// Nothing here calls anything but this page's own server.

/** A request the server refused or could not serve: its message, HTTP status and the field at fault. */
export class ServerError extends Error {
  constructor(message, { status = 0, param = null, code = null } = {}) {
    super(message);
    this.name = "ServerError";
    this.status = status;
    this.param = param;
    this.code = code;
  }
}

let apiKey = "";

/** Use `key` as the bearer token of every call (an empty key: none). */
export function setKey(key) {
  apiKey = key.trim();
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

function explain(status, said) {
  if (status === 429) return `The server is busy: ${said}`;
  if (status === 401) return `This server needs an API key: enter it under "API key". (${said})`;
  if (status === 503) return `The server cannot take this now: ${said}`;
  if (status >= 500) return `The server failed: ${said}`;
  return said;
}

/** The ServerError an error answer or an error event (OpenAI's error body) stands for. */
function refusal(status, body) {
  const error = body && body.error;
  const said = (error && error.message) || `HTTP ${status}`;
  return new ServerError(explain(status, said), {
    status,
    param: (error && error.param) || null,
    code: (error && error.code) || null,
  });
}

/** `body` as JSON text; a BigInt goes as its digits (JSON.stringify refuses one, and a number would round). */
function json(body) {
  const mark = `bigint-${Math.random().toString(36).slice(2)}:`;
  return JSON.stringify(body, (_, v) => (typeof v === "bigint" ? mark + v : v))
    .replace(new RegExp(`"${mark}(\\d+)"`, "g"), "$1");
}

async function send(path, body, signal) {
  const init = { headers: headers(), signal };
  if (body !== undefined) Object.assign(init, { method: "POST", body: json(body) });
  let response;
  try {
    response = await fetch(path, init);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ServerError("Cannot reach the server: is gptgen still running? Reload the page once it is.");
  }
  if (!response.ok) {
    let answer = null;
    try {
      answer = await response.json();
    } catch {
      // not JSON: the status says it
    }
    throw refusal(response.status, answer);
  }
  return response;
}

/** GET (no body) or POST `body` as JSON to `path`; resolves to the JSON answer. */
export async function call(path, body, signal) {
  return (await send(path, body, signal)).json();
}

/** POST `body` to a streaming endpoint; yields each server-sent event's JSON until `[DONE]`. */
export async function* stream(path, body, signal) {
  const response = await send(path, body, signal);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read().catch((e) => {
      if (e.name === "AbortError") throw e;
      return { done: true }; // the connection broke (the server was stopped, say): a stream that ended early
    });
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    for (let end = buffer.indexOf("\n\n"); end >= 0; end = buffer.indexOf("\n\n")) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        if (line === "data: [DONE]") return;
        const data = JSON.parse(line.slice(6));
        if (data.error) throw refusal(500, data);
        yield data;
      }
    }
  }
  throw new ServerError("The server closed the stream before it finished; try again.");
}

/** Wait until GET /health says ok, calling `waiting(status)` while the model loads. */
export async function ready(waiting) {
  for (;;) {
    try {
      const response = await fetch("/health");
      if (response.ok) return;
      waiting((await response.json()).status);
    } catch {
      waiting("unreachable");
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}
