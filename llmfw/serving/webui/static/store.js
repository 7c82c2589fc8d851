// What the page keeps in the browser (localStorage, nothing on the server): the conversations, the settings and
// the server's API key. Every value is JSON under a "llmfw." key; a value that does not parse reads as missing.

const KEYS = { conversations: "llmfw.conversations", current: "llmfw.current", settings: "llmfw.settings",
  apiKey: "llmfw.apiKey" };

function read(key, fallback) {
  try {
    const text = localStorage.getItem(key);
    return text === null ? fallback : JSON.parse(text);
  } catch {
    return fallback;
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
    return true;
  } catch {
    return false; // storage full or disabled: the page keeps working for this visit
  }
}

export const DEFAULT_TITLE = "New chat";

export function newId() {
  return `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
}

export class ConversationStore {
  constructor() {
    const saved = read(KEYS.conversations, []);
    this.conversations = Array.isArray(saved) ? saved.filter((c) => c && c.id && Array.isArray(c.messages)) : [];
    this.currentId = read(KEYS.current, null);
  }

  save() {
    write(KEYS.current, this.currentId);
    return write(KEYS.conversations, this.conversations);
  }

  get current() {
    return this.conversations.find((c) => c.id === this.currentId) || null;
  }

  /** The newest first, as the list shows them. */
  ordered() {
    return [...this.conversations].sort((a, b) => b.updated - a.updated);
  }

  create() {
    const now = Date.now();
    const conversation = { id: newId(), title: DEFAULT_TITLE, created: now, updated: now, messages: [] };
    this.conversations.push(conversation);
    this.currentId = conversation.id;
    this.save();
    return conversation;
  }

  select(id) {
    if (this.conversations.some((c) => c.id === id)) {
      this.currentId = id;
      this.save();
    }
  }

  rename(id, title) {
    const conversation = this.conversations.find((c) => c.id === id);
    if (conversation && title.trim()) {
      conversation.title = title.trim().slice(0, 200);
      this.save();
    }
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.currentId === id) {
      this.currentId = this.ordered()[0]?.id ?? null;
    }
    this.save();
  }

  /** Adds a message to a conversation (the first user message names it) and returns it. */
  append(conversation, message) {
    conversation.messages.push(message);
    if (conversation.title === DEFAULT_TITLE && message.role === "user") {
      const words = message.content.trim().replace(/\s+/g, " ");
      conversation.title = words.length > 48 ? `${words.slice(0, 47)}…` : words || DEFAULT_TITLE;
    }
    conversation.updated = Date.now();
    this.save();
    return message;
  }
}

export function loadSettings(defaults) {
  const saved = read(KEYS.settings, {});
  return { ...defaults, ...(saved && typeof saved === "object" ? saved : {}) };
}

export function saveSettings(settings) {
  write(KEYS.settings, settings);
}

export function loadApiKey() {
  const key = read(KEYS.apiKey, "");
  return typeof key === "string" ? key : "";
}

export function saveApiKey(key) {
  write(KEYS.apiKey, key);
}
