// The embedded default served before its routed pair is prepared (`serving` on /v1/models): a header
// line says that SmolLM2 answers alone, with the preparation's stage and time left, then that the pair
// serves, or why it will not. While the pair is on its way the page reads the group again every
// POLL_MS, so the switch brings the pair's members, legend and threshold.

const POLL_MS = 3000;

const duration = (s) => (s < 90 ? `${Math.round(s)} s` : `${Math.round(s / 60)} min`);

export function describe(serving) {
  const p = serving.pair;
  if (p.state === "preparing") {
    const stage = p.stage ? `stage ${p.stage_number} of ${p.stages}: ${p.stage}` : "starting the preparation";
    const left = p.eta_s === null ? "" : p.eta_s > 0 ? `; about ${duration(p.eta_s)} left` : "; finishing";
    return `SmolLM2 answers alone while the routed pair is prepared (${stage}${left}).`;
  }
  if (p.state === "starting") {
    return `The routed pair is prepared (in ${duration(p.prepared_s)}) and starting; SmolLM2 answers alone until it serves.`;
  }
  if (p.state === "serving") {
    return `The routed pair serves, prepared in ${duration(p.prepared_s)} while SmolLM2 answered alone; `
      + `the ${p.in_flight_at_switch} request(s) running at the switch ${p.drained ? "finished" : "finish"} on SmolLM2.`;
  }
  return `The routed pair will not serve: ${p.reason}. SmolLM2 answers alone.`;
}

// The function to call with each fresh model card's `serving`: it shows it and, while the pair is
// being prepared or started, calls `reload` (which reads the card again) after POLL_MS.
export function watchServing(el, reload) {
  let timer = null;
  return (serving) => {
    el.hidden = !serving;
    el.textContent = serving ? describe(serving) : "";
    el.dataset.state = serving ? serving.pair.state : "";
    clearTimeout(timer);
    const pending = serving && (serving.pair.state === "preparing" || serving.pair.state === "starting");
    timer = pending ? setTimeout(reload, POLL_MS) : null;
  };
}
