// A small, safe Markdown renderer for model replies: the text is HTML-escaped before any markup is added, so
// nothing the model writes can become an element, an attribute or a script. Supported: fenced code blocks (with a
// copy button), inline code, headings, bold, italic, strikethrough, bullet and numbered lists, block quotes,
// horizontal rules, and links whose target is http(s) only. An unclosed fence (a reply still streaming) renders
// as code up to the end.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (ch) => ESCAPES[ch]);
}

const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const BULLET = /^\s{0,3}[-*+]\s+(.*)$/;
const NUMBERED = /^\s{0,3}(\d{1,9})[.)]\s+(.*)$/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const QUOTE = /^\s{0,3}>\s?(.*)$/;
const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
// a link target: http(s), no spaces, no quotes or angle brackets (the text is escaped already, so none are left)
const LINK = /\[([^\]\n]+)\]\((https?:\/\/[^\s()]+)\)/g;

function emphasis(html) {
  return html
    .replace(/\*\*(?=\S)([^*]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/__(?=\S)([^_]*?\S)__/g, "<strong>$1</strong>")
    .replace(/~~(?=\S)([^~]*?\S)~~/g, "<del>$1</del>")
    .replace(/(^|[^*\w])\*(?=\S)([^*]*?\S)\*(?![*\w])/g, "$1<em>$2</em>")
    .replace(/(^|[^_\w])_(?=\S)([^_]*?\S)_(?![_\w])/g, "$1<em>$2</em>");
}

/** Inline markup of one line: escaped first; code spans and links are set aside (so emphasis never reaches
 * inside them), emphasis applied, then they are put back. */
export function renderInline(text) {
  const stashed = [];
  // placeholders are NUL-delimited: NULs in the text itself are dropped first
  const stash = (html) => `\u0000${stashed.push(html) - 1}\u0000`;
  const unstash = (html) => html.replace(/\u0000(\d+)\u0000/g, (_, i) => unstash(stashed[Number(i)]));
  let out = escapeHtml(String(text).replace(/\u0000/g, ""));
  out = out.replace(/`([^`\n]+)`/g, (_, code) => stash(`<code>${code}</code>`));
  out = out.replace(LINK, (_, label, url) =>
    stash(`<a href="${url}" target="_blank" rel="noopener noreferrer nofollow">${emphasis(label)}</a>`));
  return unstash(emphasis(out));
}

function codeBlock(lang, lines) {
  const label = lang ? `<span class="code-lang">${escapeHtml(lang)}</span>` : "<span></span>";
  return `<div class="code-block"><div class="code-head">${label}` +
    `<button type="button" class="copy" aria-label="Copy code">Copy</button></div>` +
    `<pre><code${lang ? ` data-lang="${escapeHtml(lang)}"` : ""}>${escapeHtml(lines.join("\n"))}</code></pre></div>`;
}

function listBlock(tag, items, start) {
  const startAttr = tag === "ol" && start !== 1 ? ` start="${start}"` : "";
  return `<${tag}${startAttr}>${items.map((item) => `<li>${renderInline(item)}</li>`).join("")}</${tag}>`;
}

/** Consecutive lines matching ``pattern`` from ``lines[i]``: [their captured texts, the next index]. */
function collect(lines, i, pattern, group) {
  const items = [];
  while (i < lines.length) {
    const match = pattern.exec(lines[i]);
    if (match) {
      items.push(match[group]);
    } else if (items.length && /^\s{2,}\S/.test(lines[i])) {
      items[items.length - 1] += " " + lines[i].trim(); // a wrapped list item continues
    } else {
      break;
    }
    i += 1;
  }
  return [items, i];
}

function startsBlock(line) {
  return FENCE.test(line) || BULLET.test(line) || NUMBERED.test(line) || HEADING.test(line) ||
    QUOTE.test(line) || RULE.test(line);
}

/** The reply's Markdown as HTML (a string built only from escaped text and the tags above). */
export function renderMarkdown(source) {
  const lines = String(source).replace(/\r\n?/g, "\n").split("\n");
  const html = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if (!line.trim()) {
      i += 1;
    } else if ((match = FENCE.exec(line))) {
      const fence = match[1];
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence)) {
        body.push(lines[i]);
        i += 1;
      }
      i += 1; // the closing fence (or past the end)
      html.push(codeBlock(match[2], body));
    } else if ((match = HEADING.exec(line))) {
      const level = match[1].length;
      html.push(`<h${level}>${renderInline(match[2])}</h${level}>`);
      i += 1;
    } else if (RULE.test(line)) {
      html.push("<hr>");
      i += 1;
    } else if (BULLET.test(line)) {
      let items;
      [items, i] = collect(lines, i, BULLET, 1);
      html.push(listBlock("ul", items, 1));
    } else if ((match = NUMBERED.exec(line))) {
      let items;
      [items, i] = collect(lines, i, NUMBERED, 2);
      html.push(listBlock("ol", items, Number(match[1])));
    } else if (QUOTE.test(line)) {
      let quoted;
      [quoted, i] = collect(lines, i, QUOTE, 1);
      html.push(`<blockquote>${renderMarkdown(quoted.join("\n"))}</blockquote>`);
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() && (para.length === 0 || !startsBlock(lines[i]))) {
        para.push(renderInline(lines[i]));
        i += 1;
      }
      html.push(`<p>${para.join("<br>")}</p>`);
    }
  }
  return html.join("");
}
