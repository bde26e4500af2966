// Markdown from a model, rendered safely: every piece of model text becomes a text node
// (textContent), never HTML, so `<script>` or `<img onerror>` in an answer shows as text.
// Covers what chat answers use: paragraphs, headings, fenced code, lists, quotes,
// inline code, bold, italic and http(s) links.
import { el } from "./dom.js";

export function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(```|~~~)\s*([\w+#.-]*)/);
    if (fence) {
      const code = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) code.push(lines[i++]);
      i += 1; // the closing fence (or the end of a still-streaming answer)
      root.append(codeBlock(code.join("\n"), fence[2]));
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      root.append(el(`h${Math.min(6, heading[1].length + 2)}`, {}, inline(heading[2])));
      i += 1;
      continue;
    }
    if (/^\s*([-*+]|\d+[.)])\s+/.test(line)) {
      const ordered = /^\s*\d+[.)]\s+/.test(line);
      const list = el(ordered ? "ol" : "ul");
      while (i < lines.length && /^\s*([-*+]|\d+[.)])\s+/.test(lines[i])) {
        list.append(el("li", {}, inline(lines[i].replace(/^\s*([-*+]|\d+[.)])\s+/, ""))));
        i += 1;
      }
      root.append(list);
      continue;
    }
    if (/^\s*>/.test(line)) {
      const quoted = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) quoted.push(lines[i++].replace(/^\s*>\s?/, ""));
      root.append(el("blockquote", {}, renderMarkdown(quoted.join("\n"))));
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const paragraph = [];
    while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) paragraph.push(lines[i++]);
    const p = el("p");
    paragraph.forEach((part, n) => {
      if (n) p.append(el("br"));
      p.append(inline(part));
    });
    root.append(p);
  }
  return root;
}

function startsBlock(line) {
  return /^\s*(```|~~~)|^#{1,6}\s|^\s*([-*+]|\d+[.)])\s+|^\s*>/.test(line);
}

function codeBlock(code, language) {
  const block = el("pre", {}, el("code", {}, code));
  return language ? el("div", {}, el("span", { class: "lang" }, language), block) : block;
}

// Inline spans: `code`, **bold**, *italic* / _italic_, [text](http...). Text in between
// stays text nodes.
const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*([^*]+)\*\*|(?<![\w*])\*([^*\s][^*]*?)\*(?![\w*])|(?<![\w_])_([^_\s][^_]*?)_(?![\w_])|\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g;

export function inline(text) {
  const out = document.createDocumentFragment();
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    out.append(document.createTextNode(text.slice(last, match.index)));
    const [, , code, bold, star, under, label, href] = match;
    if (code !== undefined) out.append(el("code", {}, code));
    else if (bold !== undefined) out.append(el("strong", {}, inline(bold)));
    else if (star !== undefined || under !== undefined) out.append(el("em", {}, inline(star ?? under)));
    else out.append(link(label, href));
    last = match.index + match[0].length;
  }
  out.append(document.createTextNode(text.slice(last)));
  return out;
}

function link(label, href) {
  const url = new URL(href);
  if (url.protocol !== "http:" && url.protocol !== "https:") return document.createTextNode(label);
  return el("a", { href: url.href, rel: "noopener noreferrer nofollow", target: "_blank" }, label);
}
