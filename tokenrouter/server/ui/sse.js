// Server-sent events from a fetch response body: each `data:` payload, parsed as JSON, until [DONE].
// EventSource cannot POST or send an Authorization header, so the page reads the stream itself.

export async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = nextBoundary(buffer)) !== null) {
        const block = buffer.slice(0, cut.start);
        buffer = buffer.slice(cut.end);
        const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  } finally {
    reader.releaseLock();
  }
}

function nextBoundary(text) {
  const m = /\r?\n\r?\n/.exec(text);
  return m ? { start: m.index, end: m.index + m[0].length } : null;
}
