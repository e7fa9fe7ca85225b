// The attention view: one token as the query, its weights over every token per layer and head (a grid of
// strips, one head enlarged), and one head's whole matrix with the future masked, or the mask itself.
// Everything comes from POST /v1/attention on the token ids of the text.

import { call } from "./api.js";
import { paintMatrix, strip, weightColor } from "./heatmap.js";
import { h, percent, visible } from "./text.js";

const CELLS_AS_ELEMENTS = 96; // tokens up to which the matrix is elements (above: drawn on a canvas)
const LABELS = 48; // tokens up to which the matrix's rows and columns are labelled (if the cells are not tiny)

export class AttentionView {
  constructor(tip) {
    this.tip = tip;
    const $ = (id) => document.getElementById(id);
    Object.assign(this, { root: $("attention"), strips: $("strips"), enlarged: $("enlarged"), box: $("matrix"),
      layerSelect: $("layer"), headSelect: $("head"), maskToggle: $("mask-toggle"),
      error: $("attention-error"), caption: $("matrix-caption") });
    this.layer = 0;
    this.head = 0;
    this.layerSelect.addEventListener("change", () => this.choose(Number(this.layerSelect.value), this.head));
    this.headSelect.addEventListener("change", () => this.choose(this.layer, Number(this.headSelect.value)));
    this.maskToggle.addEventListener("click", () => {
      const on = this.maskToggle.getAttribute("aria-pressed") !== "true";
      this.maskToggle.setAttribute("aria-pressed", String(on));
      this.box.classList.toggle("mask-mode", on);
      if (this.drawn) this.describeMatrix();
    });
    this.box.addEventListener("mouseover", (e) => this.hoverCell(e.target.closest(".cell")));
    tip.hideOnLeave(this.box);
    let resized = null; // the matrix fits the window again once it stops changing size
    window.addEventListener("resize", () => {
      clearTimeout(resized);
      resized = setTimeout(() => this.drawn && !this.root.hidden && this.drawMatrix(), 200);
    });
    this.hide();
  }

  /** Whether the box shows the chosen head's matrix (not after a failure, nor while it is computed). */
  get drawn() {
    return this.box.childElementCount > 0 && this.matrices.has(`${this.layer}/${this.head}`);
  }

  hide() {
    this.root.hidden = true;
    this.controller?.abort();
    this.ids = null;
  }

  /** Show token `index` of the token ids `ids` (the page's tokens, the first `given` the prompt's) as the query. */
  async show(ids, index, given) {
    this.controller?.abort();
    const controller = (this.controller = new AbortController());
    if (this.ids === null || this.ids.join() !== ids.join()) this.matrices = new Map();
    this.ids = ids;
    this.root.hidden = false;
    this.error.hidden = true;
    this.root.setAttribute("aria-busy", "true");
    try {
      const row = await call("/v1/attention", { prompt: ids, query: index }, controller.signal);
      Object.assign(this, { row, q: index, tokens: row.tokens, given });
      this.fillSelects(row.layers.length, row.heads.length);
      this.drawStrips();
      this.drawEnlarged();
      await this.drawMatrix(controller.signal);
    } catch (e) {
      if (e.name !== "AbortError") this.fail(e, ["strips", "enlarged", "box"]);
    } finally {
      if (this.controller === controller) this.root.removeAttribute("aria-busy");
    }
  }

  /** Say why there is no attention, clearing what shows another token's (`parts`) or another head's. */
  fail(e, parts) {
    this.error.textContent = `No attention: ${e.message}`;
    this.error.hidden = false;
    if (parts.includes("strips")) this.row = null; // (a layer or head chosen now has no row to draw)
    const titles = { strips: ["strips-title", "query-line"], enlarged: ["enlarged-title"], box: ["matrix-title"] };
    for (const part of parts) {
      this[part].replaceChildren();
      for (const id of titles[part]) document.getElementById(id).textContent = "";
    }
    this.caption.textContent = "";
  }

  fillSelects(layers, heads) {
    const fill = (select, count, value) => {
      if (select.options.length !== count) {
        select.replaceChildren(...Array.from({ length: count }, (_, i) => h("option", { value: i }, String(i))));
      }
      select.value = String(value);
    };
    this.layer = Math.min(this.layer, layers - 1);
    this.head = Math.min(this.head, heads - 1);
    fill(this.layerSelect, layers, this.layer);
    fill(this.headSelect, heads, this.head);
  }

  /** Enlarge and draw the matrix of layer `layer`, head `head`. */
  async choose(layer, head) {
    if (!this.row) return; // (the last token asked for has no attention to show)
    Object.assign(this, { layer, head });
    this.error.hidden = true;
    this.fillSelects(this.row.layers.length, this.row.heads.length);
    for (const button of this.strips.querySelectorAll(".strip")) { // (not drawn anew: one may have the focus)
      button.setAttribute("aria-pressed", String(button.dataset.layer === String(layer) &&
        button.dataset.head === String(head)));
    }
    this.drawEnlarged();
    this.controller?.abort();
    this.controller = new AbortController();
    try {
      await this.drawMatrix(this.controller.signal);
    } catch (e) {
      if (e.name !== "AbortError") this.fail(e, ["box"]);
    }
  }

  label(k) {
    return `${k} ${visible(this.tokens[k])}`;
  }

  drawStrips() {
    const { row, q } = this;
    const T = this.tokens.length;
    document.getElementById("strips-title").textContent =
      `Token ${q}, “${visible(this.tokens[q])}”, as the query: its weights per layer (rows) and head (columns)`;
    document.getElementById("query-line").textContent = q + 1 >= T
      ? "The last token: the model's output here would choose the next one."
      : q + 1 < this.given
        ? `The next token, ${this.label(q + 1)}, is the prompt's: the model's output here only predicted it.`
        : `The model's output at this position chose the next token, ${this.label(q + 1)}.`;
    const grid = [h("span"), ...row.heads.map((hd) => h("span", { class: "strip-head" }, `head ${hd}`))];
    row.weights.forEach((heads, l) => {
      grid.push(h("span", { class: "strip-layer" }, `layer ${l}`));
      heads.forEach((rows, hd) => {
        const weights = rows[0];
        const top = weights.indexOf(Math.max(...weights));
        const most = `layer ${l}, head ${hd}: most weight on ${this.label(top)}, ${percent(weights[top])}`;
        const button = h("button", { type: "button", class: "strip", "data-layer": l, "data-head": hd,
          "aria-pressed": String(l === this.layer && hd === this.head), "aria-label": most, title: most });
        button.append(strip(weights, q, T));
        button.addEventListener("click", () => this.choose(l, hd));
        grid.push(button);
      });
    });
    this.strips.style.setProperty("--heads", row.heads.length);
    this.strips.replaceChildren(...grid);
  }

  drawEnlarged() {
    const { q } = this;
    const weights = this.row.weights[this.layer][this.head][0];
    document.getElementById("enlarged-title").textContent =
      `Layer ${this.layer}, head ${this.head}, enlarged: the largest weights first`;
    const keys = weights.slice(0, q + 1).map((w, k) => [w, k]).sort((a, b) => b[0] - a[0]);
    const items = keys.map(([w, k]) => {
      const bar = h("span", { class: "bar" });
      bar.style.width = `${(100 * w).toFixed(2)}%`;
      bar.style.backgroundColor = weightColor(w);
      return h("li", k === q ? { class: "self" } : {}, h("span", { class: "key" }, this.label(k)),
        h("span", { class: "track" }, bar), h("span", { class: "value" }, percent(w)));
    });
    const later = this.tokens.length - q - 1;
    if (later > 0) items.push(h("li", { class: "masked-note" }, `${later} later token${later > 1 ? "s" : ""}: ` +
      "masked (−∞ before the softmax), weight 0"));
    this.enlarged.replaceChildren(...items);
  }

  async drawMatrix(signal) {
    const key = `${this.layer}/${this.head}`;
    document.getElementById("matrix-title").textContent =
      `Layer ${this.layer}, head ${this.head}: every query (rows) over every key (columns)`;
    if (!this.matrices.has(key)) {
      this.caption.textContent = "Computing…";
      const answer = await call("/v1/attention", { prompt: this.ids, layer: this.layer, head: this.head }, signal);
      this.matrices.set(key, answer.weights[0][0]);
    }
    const m = this.matrices.get(key);
    const T = m.length;
    const fit = (room) => Math.max(3, Math.min(22, Math.floor((this.box.clientWidth - room) / T)));
    const labels = T <= LABELS && fit(90) >= 12; // (smaller rows cannot hold a readable label)
    const cell = fit(labels ? 90 : 0);
    this.box.replaceChildren(T > CELLS_AS_ELEMENTS ? this.canvasMatrix(m, cell) : this.cellMatrix(m, cell, labels));
    this.describeMatrix();
  }

  describeMatrix() {
    const T = this.tokens.length;
    const mask = this.box.classList.contains("mask-mode");
    this.caption.textContent = (mask
      ? "The causal mask, added to the scores before the softmax: 0 where a query may look (itself and every " +
        "earlier token), −∞ above the diagonal (every later token), which the softmax turns into weight 0."
      : `Each row sums to 1. Cells above the diagonal are the future: masked (hatched), weight 0. Row ${this.q} ` +
        "is the selected token.") + (T > CELLS_AS_ELEMENTS ? ` ${T} tokens: drawn as an image${mask ? " of the " +
        "weights" : ""}; hover it to read a cell.` : "");
  }

  cellMatrix(m, cell, labels) {
    const T = m.length;
    const grid = h("div", { class: `matrix${cell >= 18 ? " big" : ""}`, role: "img",
      "aria-label": `attention matrix of layer ${this.layer}, head ${this.head}: ${T} by ${T}` });
    grid.style.setProperty("--cell", `${cell}px`);
    grid.style.gridTemplateColumns = `${labels ? "max-content " : ""}repeat(${T}, var(--cell))`;
    const cells = [];
    if (labels) cells.push(h("span"), ...this.tokens.map((_, k) => h("span", { class: "col-label" },
      this.label(k))));
    for (let q = 0; q < T; q++) {
      if (labels) cells.push(h("span", { class: `row-label${q === this.q ? " here" : ""}` }, this.label(q)));
      for (let k = 0; k < T; k++) {
        const c = h("span", { class: `cell${k > q ? " masked" : ""}${q === this.q ? " here" : ""}`,
          "data-testid": "attention-cell", "data-query": q, "data-key": k, "data-layer": this.layer,
          "data-head": this.head, "data-weight": m[q][k] });
        if (k > q) c.dataset.masked = "true";
        else c.style.backgroundColor = weightColor(m[q][k]);
        cells.push(c);
      }
    }
    grid.append(...cells);
    return grid;
  }

  canvasMatrix(m, cell) {
    const T = m.length;
    const canvas = h("canvas", { class: "matrix-canvas", role: "img",
      "aria-label": `attention matrix of layer ${this.layer}, head ${this.head}: ${T} by ${T}` });
    paintMatrix(canvas, m, cell, this.q);
    canvas.addEventListener("mousemove", (e) => {
      const r = canvas.getBoundingClientRect();
      const k = Math.floor(((e.clientX - r.left) / r.width) * T);
      const q = Math.floor(((e.clientY - r.top) / r.height) * T);
      const at = { getBoundingClientRect: () => new DOMRect(e.clientX, e.clientY + 8, 1, 1),
        contains: (node) => node === canvas };
      if (q >= 0 && q < T && k >= 0 && k < T) this.tip.show(at, ...this.describe(q, k, m[q][k]));
    });
    return canvas;
  }

  hoverCell(cell) {
    if (!cell) return;
    const { query, key, weight } = cell.dataset;
    this.tip.show(cell, ...this.describe(Number(query), Number(key), Number(weight)));
  }

  describe(q, k, w) {
    const lines = [h("div", { class: "tip-token" }, `${this.label(q)} → ${this.label(k)}`),
      h("div", { class: "muted" }, `query ${q}, key ${k} · layer ${this.layer}, head ${this.head}`)];
    if (k > q) {
      lines.push(h("div", {}, "Masked: a later token. Its score is −∞ before the softmax, so its weight is 0."));
    } else {
      lines.push(h("div", {}, `weight ${w.toPrecision(6)} (${percent(w)}); the mask adds 0 here`));
    }
    return lines;
  }
}
