// Heatmaps on canvases: attention weights pale to dark blue, the masked future hatched as the page's CSS does.

import { h } from "./text.js";

/** The colour of an attention weight: pale to dark blue, by its square root (small weights stay visible). */
export function weightColor(w) {
  const t = Math.sqrt(Math.max(0, Math.min(1, w)));
  const mix = (a, b) => Math.round(a + (b - a) * t);
  return `rgb(${mix(246, 8)} ${mix(249, 48)} ${mix(253, 107)})`;
}

/** One strip: a query's weights over every key, the masked future hatched (drawn at twice its CSS size). */
export function strip(weights, q, T) {
  const canvas = h("canvas", { class: "strip-canvas" });
  const [width, height] = [176, 28];
  canvas.width = width;
  canvas.height = height;
  const ctx = canvas.getContext("2d");
  const x = (k) => Math.round((k * width) / T);
  for (let k = 0; k <= q; k++) {
    ctx.fillStyle = weightColor(weights[k]);
    ctx.fillRect(x(k), 0, Math.max(1, x(k + 1) - x(k)), height);
  }
  if (q + 1 < T) {
    ctx.beginPath();
    ctx.rect(x(q + 1), 0, width - x(q + 1), height);
    hatch(ctx, width, height);
  }
  return canvas;
}

/** Hatch the current path (the masked future) as the page's CSS does. */
function hatch(ctx, width, height) {
  ctx.save();
  ctx.clip();
  ctx.fillStyle = "#e4e7eb";
  ctx.fillRect(0, 0, width, height);
  ctx.strokeStyle = "#b4bac3";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  for (let x = -height; x < width; x += 7) {
    ctx.moveTo(x, height);
    ctx.lineTo(x + height, 0);
  }
  ctx.stroke();
  ctx.restore();
}

/** Paint a T x T matrix `m` with `cell` pixels a cell on `canvas`, the future hatched, row `q` marked. */
export function paintMatrix(canvas, m, cell, q) {
  const T = m.length;
  canvas.width = canvas.height = T * cell;
  const ctx = canvas.getContext("2d");
  for (let row = 0; row < T; row++) {
    for (let k = 0; k <= row; k++) {
      ctx.fillStyle = weightColor(m[row][k]);
      ctx.fillRect(k * cell, row * cell, cell, cell);
    }
  }
  ctx.beginPath(); // the future: above the diagonal
  for (let row = 0; row + 1 < T; row++) ctx.rect((row + 1) * cell, row * cell, (T - row - 1) * cell, cell);
  hatch(ctx, T * cell, T * cell);
  ctx.fillStyle = "rgb(221 51 51 / 0.45)"; // the selected row
  ctx.fillRect(0, q * cell - 1, T * cell, cell + 2);
}
