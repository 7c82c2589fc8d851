// The server's own endpoints, as the page calls them: same origin only, the API key (when there is one) as
// "Authorization: Bearer", every failure turned into an ApiError whose message a person can act on.

export class ApiError extends Error {
  /** kind: "network" (no answer), "auth" (401: a key is needed or wrong), "http" (another error status),
   * "stream" (an error event inside a stream). */
  constructor(kind, message, status = 0) {
    super(message);
    this.kind = kind;
    this.status = status;
  }
}

export class Api {
  constructor(getKey) {
    this.getKey = getKey;
  }

  headers(extra = {}) {
    const key = this.getKey();
    return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
  }

  async request(path, options = {}) {
    let response;
    try {
      response = await fetch(path, { ...options, headers: this.headers(options.headers), cache: "no-store" });
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw new ApiError("network", `Cannot reach the server at ${location.origin}: is llmfw serve still running?`);
    }
    if (!response.ok) {
      throw await errorFromResponse(response);
    }
    return response;
  }

  async models() {
    const body = await (await this.request("/v1/models")).json();
    return Array.isArray(body.data) ? body.data : [];
  }

  async metricsText() {
    return (await this.request("/metrics")).text();
  }

  /** POSTs a streaming chat completion and calls onChunk(chunk) for each server-sent event until [DONE]. */
  async streamChat(body, signal, onChunk) {
    const response = await this.request("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), signal, headers: { "Content-Type": "application/json" },
    });
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      let part;
      try {
        part = await reader.read();
      } catch (error) {
        if (error.name === "AbortError") throw error;
        throw new ApiError("network", "The connection to the server broke off in the middle of the reply.");
      }
      if (part.done) break;
      buffer += decoder.decode(part.value, { stream: true });
      let end;
      while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
        if (readEvent(event, onChunk)) return;
      }
    }
    throw new ApiError("network", "The server closed the stream before the reply was finished.");
  }
}

/** One server-sent event: true at [DONE]; an in-stream error event throws. */
function readEvent(event, onChunk) {
  const data = event.split(/\r?\n/).filter((line) => line.startsWith("data:"))
    .map((line) => line.slice(5).trimStart()).join("\n");
  if (!data) return false;
  if (data === "[DONE]") return true;
  let chunk;
  try {
    chunk = JSON.parse(data);
  } catch {
    throw new ApiError("stream", "The server sent an event that is not JSON.");
  }
  if (chunk.error) {
    throw new ApiError("stream", `The server stopped the reply: ${chunk.error.message || "unknown error"}`);
  }
  onChunk(chunk);
  return false;
}

async function errorFromResponse(response) {
  let message = "";
  try {
    const body = await response.json();
    message = body?.error?.message || "";
  } catch {
    // not the server's JSON error shape (a proxy's page): the status says enough
  }
  if (response.status === 401) {
    return new ApiError("auth", message || "The server needs an API key.", 401);
  }
  const what = response.status >= 500 ? "The server failed" : "The server refused the request";
  return new ApiError("http", `${what} (HTTP ${response.status}): ${message || response.statusText}`,
    response.status);
}
