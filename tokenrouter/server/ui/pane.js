// One run's answer: tokens coloured (and underlined) by the model that wrote them, hand-off markers,
// the router's score at every position with the threshold, and the live figures. Token text only
// ever reaches the page as text (textContent, text nodes), never as markup.

const SVG = "http://www.w3.org/2000/svg";
const STRIP_H = 60;  // the score strip's height in SVG units (scores are in [0, 1])
const BAR_W = 4;

function el(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

export function fmt(x) {
  return x === null || x === undefined ? "none" : Number(x).toFixed(4);
}

export class Pane {
  // models: the group's members (first = the entry model); scoreName: what the router's score is;
  // tip: the shared tooltip element.
  // note: why there is no score, when scoreName is null.
  constructor(parent, { title, models, scoreName, tip, note = "this algorithm gives no per-token score" }) {
    this.models = models;
    this.scoreName = scoreName;
    this.tip = tip;
    this.counts = Object.fromEntries(models.map((m) => [m, 0]));
    this.handoffs = 0;
    this.rejectedRuns = 0;
    this.rejectedTokens = 0;
    this.n = 0;
    this.started = performance.now();
    this.firstAt = null;
    this.lastAt = null;
    this.threshold = null;
    this.points = [];  // [rect, score] of each scored position, for re-scaling the strip
    this.lo = null;  // the strip's score axis, fitted to the scores and threshold seen
    this.hi = null;

    this.root = el("section", { class: "pane", "data-state": "running" });
    this.root.append(el("h2", {}, title));
    this.stats = el("dl", { class: "stats" });
    this.statNodes = {};
    for (const m of models) this.addStat(`tokens-${m}`, `${m} tokens`, "0", m);
    if (models.length > 1) this.addStat("share", this.shareLabel(), "0.0%");
    this.addStat("handoffs", "hand-offs", "0");
    this.addStat("tps", "tok/s", "-");
    this.status = el("p", { class: "status", role: "status" }, "running");
    this.answer = el("div", { class: "answer", tabindex: "0", "aria-label": "answer, one element per token; arrow keys move between tokens" });
    this.strip = svg("svg", { class: "strip", viewBox: `0 0 ${50 * BAR_W} ${STRIP_H}`, preserveAspectRatio: "none",
      role: "img", "aria-label": scoreName ? `${scoreName} at each position, threshold as a line` : "no router score" });
    this.bars = svg("g");
    this.thresholdHalo = svg("line", { class: "threshold-halo", x1: 0, x2: 50 * BAR_W, y1: -10, y2: -10 });
    this.thresholdLine = svg("line", { class: "threshold", x1: 0, x2: 50 * BAR_W, y1: -10, y2: -10 });
    this.strip.append(this.bars, this.thresholdHalo, this.thresholdLine);
    const stripBox = el("figure", { class: "strip-box" });
    this.caption = el("figcaption", {}, scoreName ? `router score (${scoreName}) per position; dashed line: threshold`
      : note);
    stripBox.append(this.strip, this.caption);
    this.root.append(this.stats, this.status, this.answer, stripBox);
    parent.append(this.root);

    this.answer.addEventListener("keydown", (e) => this.onKey(e));
    this.answer.addEventListener("focusin", (e) => this.showTip(e.target));
    this.answer.addEventListener("focusout", () => this.hideTip());
    this.answer.addEventListener("mouseover", (e) => this.showTip(e.target));
    this.answer.addEventListener("mouseleave", () => this.hideTip());
  }

  shareLabel() {
    return this.models.length === 2 ? `${this.models[1]} share` : `share not by ${this.models[0]}`;
  }

  addStat(key, label, value, model = null) {
    const dt = el("dt", {}, label);
    if (model !== null) dt.prepend(el("span", { class: `swatch w${this.models.indexOf(model)}` }));
    const dd = el("dd", { "data-stat": key }, value);
    this.statNodes[key] = dd;
    this.stats.append(dt, dd);
  }

  writerClass(model) {
    const i = this.models.indexOf(model);
    return `w${i < 0 ? "x" : Math.min(i, 5)}`;
  }

  // One chunk's trace entries: {token, text, model, handoff, score, threshold, rejected, rejected_text}.
  addTokens(entries) {
    for (const e of entries) this.addToken(e);
    this.refresh();
  }

  addToken(e) {
    const now = performance.now();
    if (this.firstAt === null) this.firstAt = now;
    this.lastAt = now;
    const path = e.handoff || [];
    for (let k = 1; k < path.length; k++) this.addMarker(path[k - 1], path[k]);
    if (e.rejected && e.rejected.length) this.addRejected(e);
    const span = el("span", { class: `tok ${this.writerClass(e.model)}`, tabindex: "-1", "data-model": e.model,
      "data-step": String(this.n), "data-token": String(e.token) });
    if (e.score !== null && e.score !== undefined) span.dataset.score = String(e.score);
    if (e.threshold !== null && e.threshold !== undefined) span.dataset.threshold = String(e.threshold);
    if (path.length > 1) span.dataset.handoff = path.join(" → ");
    span.dataset.text = e.text;
    span.textContent = e.text;
    if (!e.text) span.classList.add("empty");
    this.answer.append(span);
    this.counts[e.model] = (this.counts[e.model] || 0) + 1;
    this.addBar(e);
    this.n += 1;
  }

  // A run of drafts the writer of `e` rejected at its position (speculative decoding): shown struck
  // through before the token that replaced it, never counted as output.
  addRejected(e) {
    if (!this.statNodes.rejected) this.addStat("rejected", "drafts rejected (runs)", "");
    this.rejectedRuns += 1;
    this.rejectedTokens += e.rejected.length;
    this.statNodes.rejected.textContent = `${this.rejectedTokens} (${this.rejectedRuns})`;
    const n = e.rejected.length;
    this.answer.append(el("del", { class: "rejected", "data-model": e.model, "data-tokens": e.rejected.join(" "),
      title: `${n} draft${n === 1 ? "" : "s"} rejected by ${e.model}` }, e.rejected_text));
  }

  addMarker(from, to) {
    this.handoffs += 1;
    const up = this.models.indexOf(to) > this.models.indexOf(from);
    const mark = el("span", { class: `handoff ${up ? "up" : "down"}`, "data-from": from, "data-to": to,
      role: "img", "aria-label": `hand-off ${this.handoffs}: ${from} to ${to}`, title: `hand-off ${this.handoffs}: ${from} → ${to}` },
      up ? "▲" : "▼");
    this.answer.append(mark);
  }

  addBar(e) {
    const width = Math.max(50, this.n + 1) * BAR_W;
    this.strip.setAttribute("viewBox", `0 0 ${width} ${STRIP_H}`);
    for (const line of [this.thresholdLine, this.thresholdHalo]) line.setAttribute("x2", String(width));
    if (e.score === null || e.score === undefined) return;
    const rect = svg("rect", { class: this.writerClass(e.model), x: this.n * BAR_W, width: BAR_W - 0.6 });
    this.bars.append(rect);
    this.points.push([rect, e.score]);
    const hasThreshold = e.threshold !== null && e.threshold !== undefined;
    if (hasThreshold) this.threshold = e.threshold;
    const inside = (v) => this.lo !== null && v >= this.lo && v <= this.hi;
    if (!inside(e.score) || (hasThreshold && !inside(e.threshold))) this.fit();
    else this.place(rect, e.score);
  }

  // The score axis: the range of the scores and threshold seen, padded (random scores in [0, 1]
  // fill it; CITER confidences or entropies near 1 get a readable close-up).
  fit() {
    const values = this.points.map((p) => p[1]);
    if (this.threshold !== null) values.push(this.threshold);
    let lo = Math.min(...values);
    let hi = Math.max(...values);
    const pad = Math.max(0.005, (hi - lo) * 0.15);
    lo = Math.max(0, lo - pad);
    hi = Math.min(1, hi + pad);
    if (hi - lo < 1e-6) hi = lo + 1e-6;
    this.lo = lo;
    this.hi = hi;
    for (const [rect, score] of this.points) this.place(rect, score);
    if (this.threshold !== null) {
      for (const line of [this.thresholdLine, this.thresholdHalo]) {
        line.setAttribute("y1", String(this.y(this.threshold)));
        line.setAttribute("y2", String(this.y(this.threshold)));
      }
    }
    this.caption.textContent = `router score (${this.scoreName}) per position, axis ${lo.toFixed(3)} to `
      + `${hi.toFixed(3)}; dashed line: threshold ${fmt(this.threshold)}`;
  }

  y(v) {
    return STRIP_H * (1 - (v - this.lo) / (this.hi - this.lo));
  }

  place(rect, score) {
    const top = Math.min(STRIP_H - 0.5, this.y(score));
    rect.setAttribute("y", String(top));
    rect.setAttribute("height", String(STRIP_H - top));
  }

  // Text released without a token of its own (the end of the answer held back until it finished).
  addText(text) {
    if (text) this.answer.append(document.createTextNode(text));
  }

  refresh() {
    for (const m of this.models) this.statNodes[`tokens-${m}`].textContent = String(this.counts[m] || 0);
    if (this.statNodes.share) {
      const others = this.n - (this.counts[this.models[0]] || 0);
      this.statNodes.share.textContent = this.n ? `${((100 * others) / this.n).toFixed(1)}%` : "0.0%";
    }
    this.statNodes.handoffs.textContent = String(this.handoffs);
    if (this.firstAt !== null && this.lastAt > this.firstAt) {
      this.statNodes.tps.textContent = ((this.n - 1) / ((this.lastAt - this.firstAt) / 1000)).toFixed(1);
    }
  }

  // The final `routing` object: the panel shows the server's own figures, and says whether the
  // per-token trace adds up to them.
  finish(routing, reason) {
    const server = routing.tokens_per_model || {};
    const agree = this.models.every((m) => (server[m] || 0) === (this.counts[m] || 0))
      && routing.handoffs === this.handoffs;
    for (const m of this.models) this.counts[m] = server[m] || 0;
    this.n = Object.values(this.counts).reduce((a, b) => a + b, 0);
    this.handoffs = routing.handoffs;
    this.refresh();
    this.root.dataset.state = "done";
    this.root.dataset.reconciled = agree ? "yes" : "no";
    this.status.textContent = `finished (${reason}); ` + (agree ? "the trace matches the server's routing figures"
      : "the server's routing figures differ from the trace; the panel shows the server's");
  }

  stopped() {
    this.root.dataset.state = "stopped";
    this.status.textContent = `stopped after ${this.n} tokens`;
  }

  fail(message) {
    this.root.dataset.state = "error";
    this.status.textContent = `error: ${message}`;
  }

  onKey(e) {
    const toks = [...this.answer.querySelectorAll(".tok")];
    if (!toks.length) return;
    const at = toks.indexOf(document.activeElement);
    let next = null;
    if (e.key === "ArrowRight") next = toks[Math.min(toks.length - 1, at + 1)];
    else if (e.key === "ArrowLeft") next = toks[Math.max(0, at < 0 ? 0 : at - 1)];
    else if (e.key === "Home") next = toks[0];
    else if (e.key === "End") next = toks[toks.length - 1];
    if (next) {
      e.preventDefault();
      next.focus();
    }
  }

  showTip(target) {
    if (!(target instanceof HTMLElement) || !target.classList.contains("tok")) return;
    const d = target.dataset;
    const lines = [
      `step ${d.step}, written by ${d.model}`,
      d.handoff ? `hand-off before it: ${d.handoff}` : "no hand-off before it",
      this.scoreName ? `${this.scoreName}: ${fmt(d.score)} (threshold ${fmt(d.threshold)})` : "no router score",
      `token ${d.token}, text ${JSON.stringify(d.text)}`,
    ];
    this.tip.replaceChildren(...lines.map((l) => el("div", {}, l)));
    this.tip.hidden = false;
    const r = target.getBoundingClientRect();
    this.tip.style.left = `${Math.max(4, Math.min(window.innerWidth - 380, r.left + window.scrollX))}px`;
    this.tip.style.top = `${r.bottom + window.scrollY + 6}px`;
  }

  hideTip() {
    this.tip.hidden = true;
  }
}
