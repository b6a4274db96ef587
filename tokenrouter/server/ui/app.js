// The routing page: reads the group from /v1/models, streams answers with a per-token trace
// (`routing: {trace: true}`) and shows who wrote what. The API key, when the server wants one, lives
// in this page's memory only.

import { watchAdaptive } from "./adaptive.js";
import { Pane } from "./pane.js";
import { watchServing } from "./serving.js";
import { sseData } from "./sse.js";

const $ = (id) => document.getElementById(id);
const state = {
  key: null,
  card: null,  // the /v1/models entry
  active: new Set(),  // AbortControllers of the runs in flight
  last: null,  // the settings of the last "Run", for "run again"
};

function headers(json = false) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (state.key) h.Authorization = `Bearer ${state.key}`;
  return h;
}

const showAdaptive = watchAdaptive($("adaptive"), headers);
const showServing = watchServing($("serving"), () => loadGroup());

async function errorText(resp) {
  try {
    const body = await resp.json();
    return body.error?.message || `HTTP ${resp.status}`;
  } catch {
    return `HTTP ${resp.status}`;
  }
}

async function loadGroup() {
  const resp = await fetch("/v1/models", { headers: headers() });
  if (resp.status === 401) {
    $("auth").hidden = false;
    $("auth-msg").textContent = state.key ? "that key was refused" : "this server wants an API key";
    $("key").focus();
    return;
  }
  if (!resp.ok) {
    $("group").textContent = `cannot read /v1/models: ${await errorText(resp)}`;
    return;
  }
  $("auth").hidden = true;
  const card = (await resp.json()).data[0];
  state.card = card;
  const routing = card.routing || {};
  const members = card.members || [card.id];
  $("group").textContent = `${card.id}: ${members.join(" + ")}, routed by ${routing.algorithm || "single"}`;
  buildLegend(members);
  buildKnob(routing);
  showAdaptive(routing.adaptive);
  showServing(card.serving);
  const only = $("only");
  only.replaceChildren();
  if (members.length > 1) {
    for (const m of members) {
      const b = document.createElement("button");
      b.type = "button";
      b.className = "only";
      b.dataset.model = m;
      b.textContent = `${m} only`;
      b.addEventListener("click", () => run({ compare: true, model: m }));
      only.append(b);
    }
  }
  $("run").disabled = false;
}

function buildLegend(members) {
  const legend = $("legend");
  legend.replaceChildren();
  members.forEach((m, i) => {
    const item = document.createElement("span");
    item.className = "legend-item";
    const sample = document.createElement("span");
    sample.className = `tok w${Math.min(i, 5)}`;
    sample.textContent = m;
    item.append(sample, document.createTextNode(i === 0 ? " wrote it (entry model)" : " wrote it"));
    legend.append(item);
  });
  if (members.length > 1) {
    const marks = document.createElement("span");
    marks.className = "legend-item";
    marks.textContent = `▲ hand-off to a later model (${members.slice(1).join(", ")}), ▼ back`;
    legend.append(marks);
  }
}

function buildKnob(routing) {
  const knob = routing.share_knob;
  const box = $("knob");
  box.hidden = !knob;
  if (!knob) return;
  const value = routing.params?.[knob] ?? 0.5;
  $("knob-name").textContent = knob;
  $("threshold").value = String(value);
  $("threshold-range").value = String(value);
  const more = routing.knob_raises_share ? "raising" : "lowering";
  $("knob-help").textContent = `this request only; the group serves ${knob} = ${value}. `
    + `${more} it hands more tokens to the larger model.`;
}

function settings() {
  const mode = document.querySelector("input[name=mode]:checked").value;
  const num = (id) => ($(id).value === "" ? null : Number($(id).value));
  return { mode, prompt: $("prompt").value, maxTokens: num("max-tokens"), temperature: num("temperature"),
    seed: num("seed"), threshold: num("threshold") };
}

function requestBody(s, { model = null, threshold = s.threshold } = {}) {
  const routing = { trace: true };
  const knob = state.card?.routing?.share_knob;
  if (model) routing.model = model;
  else if (knob && threshold !== null) routing[knob] = threshold;
  const body = { model: state.card.id, stream: true, routing };
  if (s.maxTokens !== null) body.max_tokens = s.maxTokens;
  if (s.temperature !== null) body.temperature = s.temperature;
  if (s.seed !== null) body.seed = s.seed;
  if (s.mode === "chat") body.messages = [{ role: "user", content: s.prompt }];
  else body.prompt = s.prompt;
  return body;
}

function paneTitle(s, { model = null, threshold = s.threshold } = {}) {
  if (model) return `${model} only`;
  const knob = state.card?.routing?.share_knob;
  return knob ? `${knob} = ${threshold}` : "routed";
}

// compare: open beside the last answer (else replace every answer); model: that model alone.
async function run({ compare = false, model = null } = {}) {
  if (!state.card) return;
  let s;
  if (compare && state.last) s = { ...state.last, threshold: settings().threshold };
  else {
    s = settings();
    state.last = s;
  }
  const panes = $("panes");
  if (!compare || panes.children.length === 0) panes.replaceChildren();
  else while (panes.children.length > 1) panes.lastChild.remove();
  const members = state.card.members || [state.card.id];
  const pane = new Pane(panes, { title: paneTitle(s, { model }), models: members,
    scoreName: model ? null : state.card.routing?.score, tip: $("tip"),
    note: model ? `${model} alone: no routing decision, so no score` : "this algorithm gives no per-token score" });
  const body = requestBody(s, { model });
  const path = s.mode === "chat" ? "/v1/chat/completions" : "/v1/completions";
  const ctl = new AbortController();
  state.active.add(ctl);
  syncButtons();
  try {
    const resp = await fetch(path, { method: "POST", headers: headers(true), body: JSON.stringify(body), signal: ctl.signal });
    if (!resp.ok) {
      pane.fail(await errorText(resp));
      if (resp.status === 401) loadGroup();
      return;
    }
    for await (const chunk of sseData(resp)) {
      if (chunk.error) {
        pane.fail(chunk.error.message);
        break;
      }
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const entries = choice.trace || [];
      pane.addTokens(entries);
      const text = choice.text ?? choice.delta?.content ?? "";
      const traced = entries.map((e) => e.text).join("");
      if (text.length > traced.length) pane.addText(text.slice(traced.length));
      if (chunk.routing) pane.finish(chunk.routing, choice.finish_reason);
    }
  } catch (err) {
    if (err.name === "AbortError") pane.stopped();
    else pane.fail(String(err.message || err));
  } finally {
    state.active.delete(ctl);
    syncButtons();
  }
}

function syncButtons() {
  $("stop").disabled = state.active.size === 0;
  $("again").disabled = state.last === null;
}

function stopAll() {
  for (const ctl of state.active) ctl.abort();  // closing the stream aborts the request on the server
}

function init() {
  $("form").addEventListener("submit", (e) => {
    e.preventDefault();
    run();
  });
  $("again").addEventListener("click", () => run({ compare: true }));
  $("stop").addEventListener("click", stopAll);
  $("threshold-range").addEventListener("input", () => { $("threshold").value = $("threshold-range").value; });
  $("threshold").addEventListener("input", () => { $("threshold-range").value = $("threshold").value; });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    state.key = $("key").value.trim() || null;
    $("key").value = "";
    loadGroup();
  });
  loadGroup();
}

init();
