// The playground: the controls, generation through POST /v1/completions (stream, echo, logprobs), and the
// attention view of a selected token. Every call goes to this page's own server, through its public API.

import { AttentionView } from "./attention.js";
import { call, ready, ServerError, setKey, stream } from "./api.js";
import { Tip, Transcript } from "./text.js";

const $ = (id) => document.getElementById(id);
const ALTERNATIVES = 5; // top alternatives the tip shows for each generated token
// The controls: element id, API field, whether it takes an integer.
const FIELDS = [
  ["temperature", "temperature", false],
  ["max-tokens", "max_tokens", true],
  ["top-k", "top_k", true],
  ["top-p", "top_p", false],
  ["min-p", "min_p", false],
  ["seed", "seed", true],
  ["presence-penalty", "presence_penalty", false],
  ["frequency-penalty", "frequency_penalty", false],
  ["repetition-penalty", "repetition_penalty", false],
];
const CONTROL = Object.fromEntries([...FIELDS.map(([id, field]) => [field, id]), ["prompt", "prompt"],
  ["stop", "stop-strings"]]);

const tip = new Tip($("tip"));
const view = new AttentionView(tip);
const transcript = new Transcript($("text"), $("prompt-tokens"), $("output"), tip, select);
let running = null; // the AbortController of the generation under way
let ids = []; // the text's token ids, as the server gives them: the prompt's, then each generated one

function showError(message, param = null) {
  $("error").textContent = message;
  $("error").hidden = false;
  const control = param && $(CONTROL[param] || "");
  if (control) {
    control.setAttribute("aria-invalid", "true");
    control.focus();
  }
}

function clearError() {
  $("error").hidden = true;
  document.querySelectorAll("[aria-invalid]").forEach((el) => el.removeAttribute("aria-invalid"));
}

function status(text) {
  $("status").textContent = text;
}

/** The request body from the controls; an empty control leaves its field to the server's default. */
function body() {
  const request = { prompt: $("prompt").value, stream: true, echo: true, logprobs: ALTERNATIVES,
    return_token_ids: true };
  for (const [id, field, integer] of FIELDS) {
    const input = $(id);
    const value = input.value.trim();
    if (input.validity.badInput) throw new ServerError(`${field}: it must be a number`, { param: field });
    if (value === "") continue;
    // An integer past 2**53 is sent as typed: a JavaScript number would round it (another seed).
    request[field] = integer && /^\d+$/.test(value) && !Number.isSafeInteger(Number(value))
      ? BigInt(value) : Number(value);
  }
  const unescape = (s) => s.replace(/\\(n|t|\\)/g, (_, c) => ({ n: "\n", t: "\t", "\\": "\\" })[c]);
  const stops = $("stop-strings").value.split("\n").filter((s) => s !== "").map(unescape);
  if (stops.length) request.stop = stops;
  return request;
}

async function generate() {
  if (running) return;
  clearError();
  let request;
  try {
    request = body();
  } catch (e) {
    showError(e.message, e.param);
    return;
  }
  running = new AbortController();
  const { signal } = running;
  setRunning(true);
  transcript.reset();
  view.hide();
  ids = [];
  status("Starting…");
  const started = performance.now();
  try {
    let first = true;
    for await (const chunk of stream("/v1/completions", request, signal)) {
      const choice = chunk.choices[0];
      if (!choice) continue;
      ids.push(...(choice.prompt_token_ids || []), ...(choice.token_ids || []));
      if (first) transcript.setPrompt(choice);
      else transcript.extend(choice);
      first = false;
      status(`Generating… ${transcript.generated.length} tokens`);
    }
    transcript.finish();
    const n = transcript.generated.length;
    const seconds = (performance.now() - started) / 1000;
    const why = { stop: "an end-of-text token or a stop string", length: "the token limit or the window" };
    status(`Done: ${n} tokens in ${seconds.toFixed(1)} s, ended by ${why[transcript.finishReason] ||
      transcript.finishReason}. Select a token to see its attention.`);
  } catch (e) {
    transcript.finish(e.name === "AbortError" ? "stopped" : "failed");
    if (e.name === "AbortError") status(`Stopped after ${transcript.generated.length} tokens.`);
    else {
      status("");
      showError(e.message, e.param);
    }
  } finally {
    running = null;
    setRunning(false);
  }
}

function setRunning(on) {
  $("generate").disabled = on;
  $("stop").disabled = !on;
  $("text").setAttribute("aria-busy", String(on));
}

async function select(index) {
  const given = transcript.tokens.length - transcript.generated.length; // (the prompt's tokens)
  await view.show(ids.slice(0, transcript.tokens.length), index, given);
  $("attention").scrollIntoView({ block: "nearest", behavior: "smooth" });
}

async function start() {
  $("controls").addEventListener("submit", (e) => {
    e.preventDefault();
    generate();
  });
  $("stop").addEventListener("click", () => running?.abort());
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      generate();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && running) running.abort();
  });
  $("api-key").addEventListener("change", () => {
    setKey($("api-key").value);
    connect();
  });
  await ready((state) => status(state === "unreachable" ? "Cannot reach the server; retrying…"
    : `The model is ${state}; the page is ready once it is loaded.`));
  status("");
  await connect();
}

async function connect() {
  try {
    const model = (await call("/v1/models")).data[0];
    $("model").textContent = `${model.id} · window ${model.max_model_len} tokens`;
    clearError();
  } catch (e) {
    if (e.status === 401) $("key-box").open = true;
    showError(e.message);
  }
}

start();
