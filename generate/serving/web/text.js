// The text: one element per token (prompt and generated), shaded by the probability the model gave it, with
// a tip on hover or focus (the token, its log-probability, the alternatives). The completions stream (echo,
// logprobs) gives the tokens and the settled text; each token shows the part of that text which starts at its
// text_offset, so the output's text is exactly the generated text.

export const EOT = "<|endoftext|>";

/** A token as it reads in labels: a space as ␣, a newline as ↵, a tab as ⇥; nothing as ∅. */
export function visible(piece) {
  return piece.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/\r/g, "␍") || "∅";
}

/** A probability as a percentage. */
export function percent(p) {
  return p >= 0.9995 ? "100%" : p >= 0.1 ? `${(100 * p).toFixed(1)}%` : `${(100 * p).toPrecision(2)}%`;
}

/** The background of a token the model gave log-probability `logprob`: red (p <= 1e-4) through yellow
 * (p = 0.01) to green (p = 1), on a log scale (most tokens of real text have p between 1e-3 and 0.5). */
export function shade(logprob) {
  const t = Math.max(0, Math.min(1, 1 + logprob / Math.LN10 / 4));
  return `hsl(${Math.round(120 * t)} 75% ${Math.round(78 + 12 * t)}%)`;
}

/** The UTF-8 bytes a token string stands for (OpenAI writes part of a character as `bytes:\xNN...`). */
export function bytesOf(piece) {
  if (piece.startsWith("bytes:")) {
    return Uint8Array.from(piece.slice(6).match(/\\x[0-9a-f]{2}/g) || [], (x) => parseInt(x.slice(2), 16));
  }
  return new TextEncoder().encode(piece);
}

/** An element: `h("li", {class: "x", "data-k": 1}, child, "text")` (no inline style: the page's CSP). */
export function h(tag, attributes = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) el.setAttribute(name, value);
  el.append(...children);
  return el;
}

/** The one floating tip of the page, placed under (or above) what it describes. A touch has no hover: a tapped
 * thing's tip stays until a click or tap elsewhere (the tap's own mouse events leave it as soon as it ends, and
 * a scroll is no click). */
export class Tip {
  constructor(el) {
    this.el = el;
    this.anchor = null; // what it describes: an element, or something with getBoundingClientRect and contains
    document.addEventListener("click", (e) => this.anchor?.contains(e.target) || this.hide());
  }

  /** Hide the tip when a mouse or pen leaves `region`. */
  hideOnLeave(region) {
    region.addEventListener("pointerleave", (e) => e.pointerType !== "touch" && this.hide());
  }

  show(anchor, ...content) {
    this.anchor = anchor;
    this.el.replaceChildren(...content);
    this.el.hidden = false;
    const a = anchor.getBoundingClientRect();
    const t = this.el.getBoundingClientRect();
    const width = document.documentElement.clientWidth;
    const left = Math.max(8, Math.min(a.left, width - t.width - 8));
    const below = a.bottom + t.height + 12 < window.innerHeight || a.top < t.height + 12;
    this.el.style.left = `${left + window.scrollX}px`;
    this.el.style.top = `${(below ? a.bottom + 6 : a.top - t.height - 6) + window.scrollY}px`;
  }

  hide() {
    this.anchor = null;
    this.el.hidden = true;
  }
}

/** The prompt's and the generated tokens, as the stream brings them. */
export class Transcript {
  constructor(root, promptEl, outputEl, tip, onSelect) {
    Object.assign(this, { root, promptEl, outputEl, tip, onSelect });
    root.addEventListener("mouseover", (e) => this.hover(e.target.closest(".tok")));
    tip.hideOnLeave(root);
    root.addEventListener("focusin", (e) => this.hover(e.target.closest(".tok")));
    root.addEventListener("focusout", (e) => tip.anchor === e.target && tip.hide()); // (not a cell's tip)
    root.addEventListener("click", (e) => {
      const el = e.target.closest(".tok");
      if (el) this.select(Number(el.dataset.index));
    });
    root.addEventListener("keydown", (e) => this.key(e));
    this.reset();
  }

  reset() {
    this.tokens = []; // {kind, piece, logprob, top, start, el}: start is in code points of its part's text
    this.texts = { prompt: [], generated: [] }; // code points of the prompt's text, of the generated text
    this.settled = { prompt: 0, generated: 0 }; // tokens of each part whose text is final
    this.base = null; // the first generated token's text_offset: where the generated text starts
    this.finishReason = null;
    this.ending = "done"; // how the stream ended: "done", "stopped" (the Stop button) or "failed" (an error)
    this.selected = null;
    this.promptEl.replaceChildren();
    this.outputEl.replaceChildren();
  }

  /** The stream's first chunk, the echo: the prompt's text and its tokens' logprobs. */
  setPrompt(choice) {
    this.texts.prompt = Array.from(choice.text);
    const lp = choice.logprobs;
    lp.tokens.forEach((piece, i) => this.add("prompt", piece, lp.token_logprobs[i], null, lp.text_offset[i]));
    this.render("prompt");
    this.markCut("prompt");
  }

  /** A later chunk: more settled text, more tokens, and at the end why it finished. */
  extend(choice) {
    this.texts.generated.push(...Array.from(choice.text));
    const lp = choice.logprobs;
    (lp ? lp.tokens : []).forEach((piece, i) => {
      if (this.base === null) this.base = lp.text_offset[i];
      const start = lp.text_offset[i] - this.base;
      this.add("generated", piece, lp.token_logprobs[i], lp.top_logprobs[i], start);
    });
    if (choice.finish_reason) this.finishReason = choice.finish_reason;
    const atEnd = this.root.scrollTop + this.root.clientHeight >= this.root.scrollHeight - 4;
    this.render("generated");
    if (atEnd) this.root.scrollTop = this.root.scrollHeight; // follow the text unless the reader scrolled up
  }

  get generated() {
    return this.tokens.filter((t) => t.kind === "generated");
  }

  add(kind, piece, logprob, top, start) {
    const index = this.tokens.length;
    const el = h("span", { class: `tok ${kind}`, "data-testid": "token", "data-index": index, "data-kind": kind,
      "data-text": piece, role: "button", "aria-pressed": "false", tabindex: index === 0 ? "0" : "-1" });
    if (kind === "generated") el.dataset.logprob = String(logprob);
    if (logprob !== null && logprob !== undefined) el.style.backgroundColor = shade(logprob);
    el.setAttribute("aria-label", `token ${index}: ${visible(piece)}`);
    (kind === "prompt" ? this.promptEl : this.outputEl).append(el);
    this.tokens.push({ index, kind, piece, logprob, top, start, el });
  }

  /** Give each token of `kind` whose text may have changed the part of the text it starts. */
  render(kind) {
    const part = this.tokens.filter((t) => t.kind === kind);
    const text = this.texts[kind];
    for (let i = this.settled[kind]; i < part.length; i++) {
      const end = i + 1 < part.length ? Math.min(part[i + 1].start, text.length) : text.length;
      const shown = text.slice(Math.min(part[i].start, end), end).join("");
      if (part[i].el.textContent !== shown) part[i].el.replaceChildren(...withMarks(shown));
      if (i + 1 < part.length && part[i + 1].start <= text.length) this.settled[kind] = i + 1;
    }
  }

  /** The end (`ending`: see reset): tokens past the text show their text struck out. */
  finish(ending = "done") {
    this.ending = ending;
    this.render("generated");
    this.markCut("generated");
  }

  markCut(kind) {
    const text = this.texts[kind];
    for (const t of this.tokens.filter((token) => token.kind === kind)) {
      const piece = t.piece.startsWith("bytes:") ? [] : Array.from(t.piece);
      const rest = piece.slice(Math.max(0, text.length - t.start)).join("");
      if (rest && t.start + piece.length > text.length) {
        t.el.dataset.rest = visible(rest);
        t.el.classList.add("cut");
      }
    }
  }

  hover(el) {
    if (!el) return;
    this.tip.show(el, ...this.describe(this.tokens[Number(el.dataset.index)]));
  }

  describe(t) {
    const lines = [h("div", { class: "tip-token" }, visible(t.piece)),
      h("div", { class: "muted" }, `token ${t.index} · ${t.kind}`)];
    const why = t.kind === "prompt" ? "an empty prompt starts from the end-of-text token"
      : this.ending === "stopped" ? "Stop came while it was held back (a stop string's start, or part of a character)"
        : this.ending === "failed" ? "the stream ended in an error while it was held back (a stop string's start, or "
          + "part of a character)"
        : t.piece === EOT ? "the end-of-text token ended the text" : "part of a stop string, which is not returned";
    if (t.el.dataset.rest !== undefined) lines.push(h("div", { class: "muted" }, `Not in the text: ${why}.`));
    if (t.logprob === null || t.logprob === undefined) {
      lines.push(h("div", {}, "The first token: nothing before it predicts it."));
      return lines;
    }
    lines.push(h("div", {}, `p = ${percent(Math.exp(t.logprob))} · logprob ${t.logprob.toFixed(4)}`));
    const rows = Object.entries(t.top || {}).sort((a, b) => b[1] - a[1]);
    if (rows.length) { // (bars relative to the likeliest)
      lines.push(h("table", { class: "alts" }, ...rows.map(([piece, lp]) => {
        const bar = h("span", { class: "bar" });
        bar.style.width = `${Math.max(1, Math.round(80 * Math.exp(lp - rows[0][1])))}px`;
        return h("tr", piece === t.piece ? { class: "chosen" } : {}, h("td", {}, visible(piece)),
          h("td", {}, bar), h("td", {}, percent(Math.exp(lp))));
      })));
    }
    const given = t.kind === "prompt" ? "given the tokens before it" : "before temperature, filters and penalties";
    lines.push(h("div", { class: "muted small" }, `The model's own probabilities, ${given}.`));
    return lines;
  }

  select(index) {
    const t = this.tokens[index];
    if (!t) return;
    if (this.selected !== null) this.tokens[this.selected]?.el.setAttribute("aria-pressed", "false");
    this.selected = index;
    t.el.setAttribute("aria-pressed", "true");
    this.onSelect(index);
  }

  key(e) {
    const el = e.target.closest(".tok");
    if (!el) return;
    const index = Number(el.dataset.index);
    const moves = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1, Home: -index, End: Infinity };
    if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();
      this.select(index);
    } else if (e.key in moves) {
      e.preventDefault();
      const next = this.tokens[Math.max(0, Math.min(this.tokens.length - 1, index + moves[e.key]))];
      el.tabIndex = -1;
      next.el.tabIndex = 0;
      next.el.focus();
    }
  }
}

/** A token's text as nodes, a newline preceded by a mark (drawn by CSS, so it is not part of the text). */
function withMarks(text) {
  const nodes = [];
  text.split("\n").forEach((line, i) => {
    if (i > 0) nodes.push(h("span", { class: "nl", "aria-hidden": "true" }), "\n");
    if (line) nodes.push(line);
  });
  return nodes;
}
