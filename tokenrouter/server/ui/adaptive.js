// Load adaptation on the routing page: while the server adapts (`routing.adaptive` on /v1/models),
// a header line gives the share knob's live value (what new requests start with, between the served
// point and the floor) and the last window's p99 time per output token against the target, refreshed
// every POLL_MS.

const POLL_MS = 2000;

const num = (x) => Number(x).toPrecision(4);

export function describe(a) {
  const p99 = a.p99_s === null ? "no adapting request in the last window"
    : `p99 time per output token ${(a.p99_s * 1e3).toFixed(1)} ms`;
  return `load adaptation: ${a.param} = ${num(a.value)} now (served ${num(a.served)}, floor ${num(a.floor)}); `
    + `${p99}, target ${(a.target_s * 1e3).toFixed(1)} ms. Runs from this page set ${a.param} themselves, `
    + "so the adaptation leaves them at their own value.";
}

function show(el, adaptive) {
  el.hidden = !adaptive;
  el.textContent = adaptive ? describe(adaptive) : "";
}

// The function to call with each fresh model card's `routing.adaptive`: it shows it, and from the
// first adaptive card on polls /v1/models (with the page's headers) to keep the line live.
export function watchAdaptive(el, headers) {
  let timer = null;
  async function refresh() {
    try {
      const resp = await fetch("/v1/models", { headers: headers() });
      if (resp.ok) show(el, (await resp.json()).data[0]?.routing?.adaptive);
    } catch {
      // the server is restarting or gone: the next tick tries again
    }
  }
  return (adaptive) => {
    show(el, adaptive);
    if (adaptive && timer === null) timer = setInterval(refresh, POLL_MS);
  };
}
