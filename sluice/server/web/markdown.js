// A small Markdown renderer that builds DOM nodes, never HTML strings: whatever the model
// writes (tags included) ends up as text. Fenced code blocks, inline code, **bold**,
// *italic*, headings, bullet and numbered lists, paragraphs.
"use strict";

const Markdown = (() => {
  function inline(parent, text) {
    // `code`, then **bold**, then *italic*; everything else is a text node.
    const pattern = /(`[^`\n]+`|\*\*[^*\n]+\*\*|\*[^*\n]+\*)/g;
    let last = 0;
    for (const match of text.matchAll(pattern)) {
      if (match.index > last) parent.append(document.createTextNode(text.slice(last, match.index)));
      const token = match[0];
      let node;
      if (token.startsWith("`")) {
        node = document.createElement("code");
        node.textContent = token.slice(1, -1);
      } else if (token.startsWith("**")) {
        node = document.createElement("strong");
        node.textContent = token.slice(2, -2);
      } else {
        node = document.createElement("em");
        node.textContent = token.slice(1, -1);
      }
      parent.append(node);
      last = match.index + token.length;
    }
    if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
  }

  function render(text) {
    const root = document.createDocumentFragment();
    const lines = text.split("\n");
    let paragraph = [];
    let list = null;

    const flushParagraph = () => {
      if (!paragraph.length) return;
      const p = document.createElement("p");
      paragraph.forEach((line, i) => {
        if (i) p.append(document.createElement("br"));
        inline(p, line);
      });
      root.append(p);
      paragraph = [];
    };
    const closeList = () => { list = null; };

    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^```\s*([\w+-]*)\s*$/);
      if (fence) {
        flushParagraph(); closeList();
        const body = [];
        i++;
        while (i < lines.length && !/^```\s*$/.test(lines[i])) body.push(lines[i++]);
        const pre = document.createElement("pre");
        const code = document.createElement("code");
        if (fence[1]) code.dataset.lang = fence[1];
        code.textContent = body.join("\n");
        pre.append(code);
        root.append(pre);
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      const bullet = line.match(/^\s*[-*]\s+(.*)$/);
      const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
      if (heading) {
        flushParagraph(); closeList();
        const h = document.createElement(`h${Math.min(heading[1].length + 2, 6)}`);
        inline(h, heading[2]);
        root.append(h);
      } else if (bullet || numbered) {
        flushParagraph();
        const kind = bullet ? "ul" : "ol";
        if (!list || list.tagName.toLowerCase() !== kind) {
          list = document.createElement(kind);
          root.append(list);
        }
        const item = document.createElement("li");
        inline(item, (bullet || numbered)[1]);
        list.append(item);
      } else if (!line.trim()) {
        flushParagraph(); closeList();
      } else {
        closeList();
        paragraph.push(line);
      }
    }
    flushParagraph();
    return root;
  }

  return { render };
})();
