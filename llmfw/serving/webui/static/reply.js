// One message of the conversation: the state an assistant reply builds up from the stream's chunks (content,
// reasoning, tool calls, token counts, speed) and its element on the page. The state is plain data, saved with
// the conversation; the element is rebuilt from it on every update (its reasoning block keeps its open state).
import { escapeHtml, renderMarkdown } from "./markdown.js";

/** A new, empty assistant reply. */
export function newReply(model) {
  return { role: "assistant", content: "", reasoning: "", toolCalls: [], model, state: "streaming",
    finishReason: null, usage: null, deltas: 0, firstAt: null, lastAt: null, error: null };
}

/** Folds one chat.completion.chunk into the reply; true when something visible changed. */
export function applyChunk(reply, chunk, now) {
  if (chunk.usage) reply.usage = { prompt: chunk.usage.prompt_tokens, completion: chunk.usage.completion_tokens };
  const choice = Array.isArray(chunk.choices) ? chunk.choices[0] : null;
  if (!choice) return false;
  if (choice.finish_reason) reply.finishReason = choice.finish_reason;
  const delta = choice.delta || {};
  let changed = false;
  if (typeof delta.content === "string" && delta.content) {
    reply.content += delta.content;
    changed = true;
  }
  if (typeof delta.reasoning_content === "string" && delta.reasoning_content) {
    reply.reasoning += delta.reasoning_content;
    changed = true;
  }
  for (const call of Array.isArray(delta.tool_calls) ? delta.tool_calls : []) {
    const index = Number.isInteger(call.index) ? call.index : reply.toolCalls.length;
    const entry = reply.toolCalls[index] || (reply.toolCalls[index] = { id: "", name: "", arguments: "" });
    if (call.id) entry.id = call.id;
    if (call.function?.name) entry.name = call.function.name;
    if (call.function?.arguments) entry.arguments += call.function.arguments;
    changed = true;
  }
  if (changed) {
    reply.deltas += 1;
    reply.firstAt ??= now;
    reply.lastAt = now;
  }
  return changed;
}

/** "N tokens · P prompt tokens · S tokens/s": the server's counts when it sent them, else the deltas seen. */
export function replyStats(reply) {
  const parts = [];
  const completion = reply.usage ? reply.usage.completion : reply.deltas;
  if (completion || reply.state !== "error") {
    parts.push(`${reply.usage ? "" : "≈"}${completion} token${completion === 1 ? "" : "s"}`);
  }
  if (reply.usage) parts.push(`${reply.usage.prompt} prompt tokens`);
  const seconds = reply.firstAt !== null && reply.lastAt !== null ? (reply.lastAt - reply.firstAt) / 1000 : 0;
  if (seconds > 0 && completion > 1) parts.push(`${((completion - 1) / seconds).toFixed(1)} tokens/s`);
  if (reply.state === "stopped") parts.push("stopped");
  if (reply.finishReason === "length") parts.push("cut at max tokens");
  return parts.join(" · ");
}

function toolCallsHtml(calls) {
  return calls.filter(Boolean).map((call) =>
    `<div class="tool-call"><div class="tool-call-head"><span class="badge">Tool call</span> ` +
    `<code>${escapeHtml(call.name || "?")}</code></div>` +
    `<pre><code>${escapeHtml(prettyJson(call.arguments))}</code></pre></div>`).join("");
}

function prettyJson(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text; // still streaming, or not JSON: as sent
  }
}

const ROLE_NAMES = { user: "You", assistant: "Assistant" };

/** The element of a message, empty parts hidden; ``update`` fills it in. */
export function messageElement(message) {
  const article = document.createElement("article");
  article.className = `msg ${message.role}`;
  article.innerHTML =
    `<div class="msg-role">${ROLE_NAMES[message.role] || escapeHtml(message.role)}</div>` +
    `<details class="reasoning" hidden><summary>Reasoning</summary><div class="reasoning-body"></div></details>` +
    `<div class="content"></div><div class="tool-calls" hidden></div>` +
    `<div class="msg-error" role="alert" hidden></div><div class="msg-meta" hidden></div>`;
  updateMessageElement(article, message);
  return article;
}

export function updateMessageElement(article, message) {
  const part = (name) => article.querySelector(`.${name}`);
  if (message.role !== "assistant") {
    part("content").textContent = message.content; // what the user typed, shown as typed
    return;
  }
  article.dataset.state = message.state;
  article.setAttribute("aria-busy", String(message.state === "streaming"));
  const reasoning = part("reasoning");
  reasoning.hidden = !message.reasoning;
  if (message.reasoning) part("reasoning-body").innerHTML = renderMarkdown(message.reasoning);
  reasoning.querySelector("summary").textContent =
    message.state === "streaming" && !message.content ? "Reasoning…" : "Reasoning";
  const content = part("content");
  content.innerHTML = renderMarkdown(message.content);
  content.classList.toggle("waiting", message.state === "streaming" && !message.content && !message.reasoning);
  const tools = part("tool-calls");
  tools.hidden = !message.toolCalls.length;
  tools.innerHTML = toolCallsHtml(message.toolCalls);
  const error = part("msg-error");
  error.hidden = !message.error;
  error.textContent = message.error || "";
  const meta = part("msg-meta");
  meta.hidden = message.state === "streaming";
  meta.textContent = message.state === "streaming" ? "" : replyStats(message);
}
