// The chat page: conversations (kept in this browser), streaming replies from the server's own
// /v1/chat/completions, settings, the API-key prompt and the status view. Everything it fetches comes from the
// server it was loaded from.
import { Api } from "./api.js";
import { ConversationStore, loadApiKey, loadSettings, saveApiKey, saveSettings } from "./store.js";
import { applyChunk, messageElement, newReply, updateMessageElement } from "./reply.js";
import { StatusView } from "./status.js";

const $ = (id) => document.getElementById(id);

/** settings key -> [element id, request field, parse] (an empty field is left out of the request) */
const NUMBER_FIELDS = {
  temperature: ["temperature", "temperature", Number],
  topP: ["top-p", "top_p", Number],
  topK: ["top-k", "top_k", parseInteger],
  minP: ["min-p", "min_p", Number],
  maxTokens: ["max-tokens", "max_tokens", parseInteger],
  seed: ["seed", "seed", parseInteger],
};
const TEXT_FIELDS = { systemPrompt: "system-prompt", jsonSchema: "json-schema" };
const RENDER_DELAY_MS = 16;

function parseInteger(text) {
  return /^-?\d+$/.test(text.trim()) ? Number(text) : NaN;
}

function fieldLabel(id) {
  return document.querySelector(`label[for="${id}"]`).textContent;
}

class ChatPage {
  constructor() {
    this.store = new ConversationStore();
    this.apiKey = loadApiKey();
    this.api = new Api(() => this.apiKey);
    this.settings = loadSettings({ model: "" });
    this.models = [];
    this.controller = null; // the running reply's AbortController
    this.afterKey = null; // what to retry once a key is given
    this.status = new StatusView(
      { slots: $("status-slots"), queue: $("status-queue"), speed: $("status-speed"), state: $("status-state") },
      this.api, () => this.slotCount());
  }

  start() {
    this.bindComposer();
    this.bindSidebar();
    this.bindSettings();
    this.bindKeyDialog();
    $("messages").addEventListener("click", (event) => this.copyCode(event));
    $("alert-close").addEventListener("click", () => this.hideAlert());
    this.renderConversations();
    this.renderMessages();
    this.loadModels();
    this.status.start();
    $("prompt").focus();
  }

  // -- composer and keyboard ------------------------------------------------------------------------------------
  bindComposer() {
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    $("stop").addEventListener("click", () => this.stop());
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && this.controller && !$("key-dialog").open) {
        event.preventDefault();
        this.stop();
      }
    });
  }

  setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("new-chat").disabled = busy;
    for (const button of document.querySelectorAll("#conversations button")) button.disabled = busy;
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  async send() {
    const text = $("prompt").value;
    if (this.controller || !text.trim()) return;
    let options;
    try {
      options = this.requestOptions();
    } catch (error) {
      this.showAlert(error.message);
      return;
    }
    this.hideAlert();
    const conversation = this.store.current || this.store.create();
    const message = this.store.append(conversation, { role: "user", content: text });
    $("prompt").value = "";
    this.renderConversations();
    this.showMessage(message);
    await this.reply(conversation, options);
  }

  /** Streams the assistant's reply to the conversation so far. */
  async reply(conversation, options) {
    const body = { ...options, messages: [...this.systemMessages(), ...this.history(conversation)] };
    const reply = newReply(body.model);
    const element = this.showMessage(reply);
    let pending = null;
    const render = () => {
      pending = null;
      const following = this.atEnd(); // a reader who scrolled up to read is left where they are
      updateMessageElement(element, reply);
      if (following) this.scrollToEnd();
    };
    this.controller = new AbortController();
    this.setBusy(true);
    let needsKey = false;
    try {
      await this.api.streamChat(body, this.controller.signal, (chunk) => {
        const first = reply.deltas === 0;
        if (applyChunk(reply, chunk, performance.now()) && pending === null) {
          pending = setTimeout(render, RENDER_DELAY_MS);
          if (first) this.status.poll(); // the busy slot shows at once
        }
      });
      reply.state = "done";
    } catch (error) {
      if (error.name === "AbortError") {
        reply.state = "stopped";
      } else {
        reply.state = "error";
        reply.error = error.message;
        needsKey = error.kind === "auth";
        this.showAlert(error.message);
      }
    } finally {
      clearTimeout(pending);
      this.controller = null;
      this.setBusy(false);
    }
    if (needsKey) {
      element.remove(); // nothing was generated: the reply is asked for again once there is a key
      this.askForKey(this.apiKey ? "The server refused this API key." : "This server needs an API key.",
        () => this.reply(conversation, options));
      return;
    }
    this.store.append(conversation, reply);
    render();
    this.renderConversations();
    this.status.poll(); // the slot just freed shows at once, not at the next tick
  }

  systemMessages() {
    const system = this.settings.systemPrompt || "";
    return system.trim() ? [{ role: "system", content: system }] : [];
  }

  history(conversation) {
    return conversation.messages
      .filter((m) => m.role === "user" || (m.role === "assistant" && m.state !== "error" && m.content))
      .map((m) => ({ role: m.role, content: m.content }));
  }

  /** The request's fields from the settings (a setting that does not parse is an error, never dropped). */
  requestOptions() {
    const options = { model: $("model").value || undefined, stream: true, stream_options: { include_usage: true } };
    for (const [key, [id, field, parse]] of Object.entries(NUMBER_FIELDS)) {
      const text = String(this.settings[key] ?? "").trim();
      if (!text) continue;
      const value = parse(text);
      if (!Number.isFinite(value)) throw new Error(`Settings: ${fieldLabel(id)} must be a number, not "${text}".`);
      options[field] = value;
    }
    const schemaText = String(this.settings.jsonSchema ?? "").trim();
    if (schemaText) {
      let schema;
      try {
        schema = JSON.parse(schemaText);
      } catch (error) {
        throw new Error(`Settings: the JSON schema is not valid JSON (${error.message}).`);
      }
      options.response_format = { type: "json_schema", json_schema: { name: "reply", schema, strict: true } };
    }
    return options;
  }

  // -- messages ---------------------------------------------------------------------------------------------------
  showMessage(message) {
    $("empty").hidden = true;
    const element = messageElement(message);
    $("messages").append(element);
    this.scrollToEnd();
    return element;
  }

  renderMessages() {
    const container = $("messages");
    container.querySelectorAll(".msg").forEach((element) => element.remove());
    const conversation = this.store.current;
    const messages = conversation ? conversation.messages : [];
    $("empty").hidden = messages.length > 0;
    for (const message of messages) container.append(messageElement(message));
    this.scrollToEnd();
  }

  atEnd() {
    const container = $("messages");
    return container.scrollHeight - container.scrollTop - container.clientHeight < 60;
  }

  scrollToEnd() {
    const container = $("messages");
    container.scrollTop = container.scrollHeight;
  }

  async copyCode(event) {
    const button = event.target.closest(".copy");
    if (!button) return;
    const code = button.closest(".code-block").querySelector("code").textContent;
    try {
      await navigator.clipboard.writeText(code);
      button.textContent = "Copied";
    } catch {
      button.textContent = "Copy failed";
    }
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  }

  // -- conversation list ----------------------------------------------------------------------------------------------
  bindSidebar() {
    $("new-chat").addEventListener("click", () => {
      if (this.store.current?.messages.length !== 0) this.store.create(); // an empty one is reused
      this.renderConversations();
      this.renderMessages();
      $("prompt").focus();
    });
  }

  renderConversations() {
    const list = $("conversations");
    list.replaceChildren();
    for (const conversation of this.store.ordered()) {
      const item = document.createElement("li");
      item.className = "conversation";
      const open = document.createElement("button");
      open.type = "button";
      open.className = "conversation-open";
      open.textContent = conversation.title;
      open.title = conversation.title;
      if (conversation.id === this.store.currentId) open.setAttribute("aria-current", "true");
      open.addEventListener("click", () => {
        this.store.select(conversation.id);
        this.renderConversations();
        this.renderMessages();
      });
      const rename = this.iconButton("✎", `Rename conversation "${conversation.title}"`, "rename",
        () => this.startRename(item, conversation));
      const remove = this.iconButton("×", `Delete conversation "${conversation.title}"`, "delete", () => {
        this.store.remove(conversation.id);
        this.renderConversations();
        this.renderMessages();
      });
      item.append(open, rename, remove);
      list.append(item);
    }
    if (this.controller) this.setBusy(true);
  }

  iconButton(symbol, label, className, onClick) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = `icon ${className}`;
    button.textContent = symbol;
    button.setAttribute("aria-label", label);
    button.title = label;
    button.addEventListener("click", onClick);
    return button;
  }

  startRename(item, conversation) {
    const input = document.createElement("input");
    input.type = "text";
    input.className = "rename-input";
    input.value = conversation.title;
    input.setAttribute("aria-label", "New name of the conversation");
    let done = false;
    const finish = (save) => {
      if (done) return;
      done = true;
      if (save) this.store.rename(conversation.id, input.value);
      this.renderConversations();
    };
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") finish(true);
      if (event.key === "Escape") {
        event.stopPropagation();
        finish(false);
      }
    });
    input.addEventListener("blur", () => finish(true));
    item.replaceChildren(input);
    input.focus();
    input.select();
  }

  // -- settings and models ------------------------------------------------------------------------------------------
  bindSettings() {
    const toggle = $("settings-toggle");
    toggle.addEventListener("click", () => {
      const open = $("settings").hidden;
      $("settings").hidden = !open;
      toggle.setAttribute("aria-expanded", String(open));
    });
    $("settings-form").addEventListener("submit", (event) => event.preventDefault()); // fields save as typed
    const fields = { ...TEXT_FIELDS, ...Object.fromEntries(Object.entries(NUMBER_FIELDS).map(([k, v]) => [k, v[0]])) };
    for (const [key, id] of Object.entries(fields)) {
      const input = $(id);
      input.value = this.settings[key] ?? "";
      input.addEventListener("input", () => {
        this.settings[key] = input.value;
        saveSettings(this.settings);
      });
    }
    $("model").addEventListener("change", () => {
      this.settings.model = $("model").value;
      saveSettings(this.settings);
    });
    $("change-key").addEventListener("click", () => this.askForKey("Change or clear the API key.", null));
  }

  async loadModels() {
    try {
      this.models = await this.api.models();
    } catch (error) {
      if (error.kind === "auth") {
        this.askForKey(this.apiKey ? "The server refused this API key." : "This server needs an API key.",
          () => this.loadModels());
      } else {
        this.showAlert(error.message);
      }
      return;
    }
    const select = $("model");
    select.replaceChildren(...this.models.map((model) => new Option(model.id, model.id)));
    if (this.models.some((model) => model.id === this.settings.model)) select.value = this.settings.model;
    select.disabled = this.models.length === 0;
  }

  slotCount() {
    const total = this.models.reduce((sum, model) => sum + (model.meta?.parallel || 0), 0);
    return total || null;
  }

  // -- API key --------------------------------------------------------------------------------------------------------
  bindKeyDialog() {
    const dialog = $("key-dialog");
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.apiKey = $("api-key").value.trim();
      saveApiKey(this.apiKey);
      dialog.close();
      const retry = this.afterKey;
      this.afterKey = null;
      this.hideAlert();
      if (retry) {
        retry();
      } else if (!this.models.length) {
        this.loadModels();
      }
    });
    $("key-cancel").addEventListener("click", () => {
      this.afterKey = null;
      dialog.close();
    });
  }

  askForKey(reason, retry) {
    const dialog = $("key-dialog");
    $("key-reason").textContent = reason;
    $("api-key").value = this.apiKey;
    if (retry) {
      const previous = this.afterKey;
      this.afterKey = previous ? () => { previous(); retry(); } : retry;
    }
    if (!dialog.open) dialog.showModal();
    $("api-key").focus();
  }

  // -- errors ---------------------------------------------------------------------------------------------------------
  showAlert(message) {
    $("alert-text").textContent = message;
    $("alert").hidden = false;
  }

  hideAlert() {
    $("alert").hidden = true;
  }
}

new ChatPage().start();
