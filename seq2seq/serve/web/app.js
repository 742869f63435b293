// The translation page (seq2seq/serve/web.py serves it). It uses the server's public API, as any client would:
// /frontend/settings and /languages once, /detect for "auto", /v1/translate for text (sentence by sentence, with
// alignments and n-best lists), /translate_file for files. Every URL is relative, so the page works under a
// reverse proxy's prefix. Text from the server goes in with textContent only, never as markup.
"use strict";

const $ = (id) => document.getElementById(id);
const el = {
  source: $("source"), target: $("target"), swap: $("swap"), detected: $("detected"),
  text: $("source-text"), mirror: $("source-view"), output: $("output"), count: $("count"),
  translate: $("translate"), copy: $("copy"), glossary: $("glossary"), alternatives: $("alternatives"),
  alternativeList: $("alternative-list"), status: $("status"), error: $("error"), key: $("api-key"),
  keyRow: $("key-row"), theme: $("theme"), file: $("file"), drop: $("drop"), dropText: $("drop-text"),
  translateFile: $("translate-file"), progress: $("progress"), download: $("download"),
  tabs: { text: $("tab-text"), files: $("tab-files") }, panels: { text: $("text-mode"), files: $("files-mode") },
};

let settings = { keyRequired: false, charLimit: 5000, maxAlternatives: 3 };
let languages = [];          // [{code, name, targets}] from /languages
let names = {};              // code -> name
let current = null;          // the last translation: {source, target, sentences: [{text, words, start, nbest}]}
let asked = 0;               // the number of the newest translation asked for: older answers are dropped
let typing = null;           // the timer of the translation after typing stops
const NBEST = 4;             // hypotheses asked per sentence: the best and up to three alternatives

// -- the server ----------------------------------------------------------------------------------------------

function headers(json = true) {
  const h = json ? { "Content-Type": "application/json" } : {};
  const key = el.key.value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function call(path, body) {
  const response = await fetch(path, body === undefined ? { headers: headers(false) }
    : { method: "POST", headers: headers(), body: JSON.stringify(body) });
  let answer = null;
  try { answer = await response.json(); } catch (_) { /* not JSON: said below */ }
  if (!response.ok) {
    let message = (answer && answer.error) || `the server answered ${response.status}`;
    const retry = response.headers.get("Retry-After");
    if (retry) message += ` (retry in ${retry} s)`;
    throw new Error(message);
  }
  return answer;
}

// -- languages and the URL -----------------------------------------------------------------------------------

function targetsOf(code) {
  if (code === "auto") return [...new Set(languages.flatMap((l) => l.targets))].sort();
  const found = languages.find((l) => l.code === code);
  return found ? found.targets : [];
}

function option(select, code, label) {
  const o = document.createElement("option");
  o.value = code;
  o.textContent = label;
  select.append(o);
}

function fillTargets(wanted) {
  const targets = targetsOf(el.source.value);
  el.target.replaceChildren();
  for (const code of targets) option(el.target, code, names[code] || code);
  if (targets.includes(wanted)) el.target.value = wanted;
  updateSwap();
}

function updateSwap() {
  const from = el.source.value === "auto" ? (current && current.source) : el.source.value;
  el.swap.disabled = !from || !targetsOf(el.target.value).includes(from);
}

function keepInUrl() {
  const url = new URL(window.location.href);
  url.searchParams.set("source", el.source.value);
  url.searchParams.set("target", el.target.value);
  url.searchParams.set("mode", el.tabs.files.getAttribute("aria-selected") === "true" ? "files" : "text");
  window.history.replaceState(null, "", url);
}

// -- sentences, words and the mirror -------------------------------------------------------------------------

// The text cut into sentences (the browser's Intl.Segmenter, by the source language) and what lies between them,
// each sentence with its words and their places in the text: the server numbers words as split(" ") does on the
// sentence with single spaces, which is what is sent.
function segment(text, lang) {
  let segmenter = null;
  try { segmenter = new Intl.Segmenter(lang === "auto" ? undefined : lang, { granularity: "sentence" }); }
  catch (_) { segmenter = null; }  // a browser without it: a line is a sentence
  const sentences = [];
  let offset = 0;
  for (const line of text.split(/(\n)/)) {  // (the newlines kept, so that offsets add up)
    if (line !== "\n" && line.trim()) {
      const parts = segmenter ? [...segmenter.segment(line)] : [{ segment: line, index: 0 }];
      for (const part of parts) {
        const words = [...part.segment.matchAll(/\S+/g)].map((m) => ({ text: m[0], start: offset + part.index + m.index }));
        if (words.length) sentences.push(words);
      }
    }
    offset += line.length;
  }
  const pieces = [];
  let end = 0;
  for (const words of sentences) {
    if (words[0].start > end) pieces.push({ gap: text.slice(end, words[0].start) });
    pieces.push({ sentence: words.map((w) => w.text).join(" "), words });
    const last = words[words.length - 1];
    end = last.start + last.text.length;
  }
  if (end < text.length) pieces.push({ gap: text.slice(end) });
  return pieces;
}

function drawMirror(text, sentences) {
  el.mirror.replaceChildren();
  let at = 0;
  sentences.forEach((s, i) => {
    s.words.forEach((w, j) => {
      el.mirror.append(text.slice(at, w.start));
      const span = document.createElement("span");
      span.textContent = w.text;
      span.dataset.s = i;
      span.dataset.w = j;
      el.mirror.append(span);
      at = w.start + w.text.length;
    });
  });
  el.mirror.append(text.slice(at) + "\n");
  el.mirror.scrollTop = el.text.scrollTop;
}

// -- the output ----------------------------------------------------------------------------------------------

function sentenceSpan(i) {
  const span = document.createElement("span");
  span.className = "sentence";
  span.dataset.s = i;
  span.tabIndex = 0;
  span.contentEditable = "true";
  span.spellcheck = false;
  span.setAttribute("role", "textbox");
  span.setAttribute("aria-label", `sentence ${i + 1} of the translation`);
  fillSentence(span, current.sentences[i].nbest[0]);
  return span;
}

function fillSentence(span, hypothesis) {
  span.replaceChildren();
  const i = Number(span.dataset.s);
  const sourceWords = current.sentences[i].words.map((w) => w.text);
  hypothesis.text.split(" ").forEach((word, j) => {
    if (j) span.append(" ");
    const w = document.createElement("span");
    w.className = "word";
    w.dataset.w = j;
    w.textContent = word;
    const aligned = (hypothesis.alignment || []).filter(([, t]) => t === j).map(([s]) => sourceWords[s]);
    if (aligned.length) w.title = "from: " + aligned.join(" ");
    span.append(w);
  });
}

function drawOutput(pieces) {
  el.output.replaceChildren();
  let i = 0;
  for (const piece of pieces) {
    if (piece.sentence === undefined) el.output.append(piece.gap);
    else el.output.append(sentenceSpan(i++));
  }
}

function highlight(sentence, word) {
  for (const marked of document.querySelectorAll(".aligned, .hovered")) marked.classList.remove("aligned", "hovered");
  if (sentence === null || !current) return;
  const hypothesis = current.sentences[sentence].shown;
  for (const [s, t] of hypothesis.alignment || []) {
    if (t !== word) continue;
    const source = el.mirror.querySelector(`span[data-s="${sentence}"][data-w="${s}"]`);
    if (source) source.classList.add("aligned");
  }
  const target = el.output.querySelector(`.sentence[data-s="${sentence}"] .word[data-w="${word}"]`);
  if (target) target.classList.add("hovered");
}

function showAlternatives(i) {
  for (const s of el.output.querySelectorAll(".sentence.selected")) s.classList.remove("selected");
  const sentence = current && current.sentences[i];
  if (!sentence || sentence.nbest.length < 2) { el.alternatives.hidden = true; return; }
  el.output.querySelector(`.sentence[data-s="${i}"]`).classList.add("selected");
  el.alternativeList.replaceChildren();
  for (const hypothesis of sentence.nbest) {
    if (hypothesis === sentence.shown) continue;
    const item = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    button.className = "alternative";
    button.textContent = hypothesis.text;
    if (hypothesis.score !== null && hypothesis.score !== undefined) {
      const score = document.createElement("span");
      score.className = "score";
      score.textContent = hypothesis.score.toFixed(2);
      button.append(score);
    }
    button.addEventListener("click", () => {
      sentence.shown = hypothesis;
      fillSentence(el.output.querySelector(`.sentence[data-s="${i}"]`), hypothesis);
      showAlternatives(i);
    });
    item.append(button);
    el.alternativeList.append(item);
  }
  el.alternatives.hidden = false;
}

// -- translating ---------------------------------------------------------------------------------------------

function glossary() {
  const terms = {};
  for (const line of el.glossary.value.split("\n")) {
    const at = line.indexOf("=");
    if (at < 0) continue;
    const source = line.slice(0, at).trim(), target = line.slice(at + 1).trim();
    if (source && target) terms[source] = target;
  }
  return Object.keys(terms).length ? terms : null;
}

function request(source, target, q, extra = {}) {
  const body = { q, source, target, alignments: true, nbest: Math.min(NBEST, settings.maxAlternatives + 1), ...extra };
  body.beam_size = Math.max(body.nbest, settings.beamSize || 1);
  const terms = glossary();
  if (terms) body.glossary = terms;
  return call("v1/translate", body);
}

async function detect(text, target) {
  const ranked = await call("detect", { q: text });
  const best = ranked.find((r) => r.language !== target && targetsOf(r.language).includes(target));
  if (!best) throw new Error("the language of this text is not one this server translates into " + target);
  el.detected.textContent = `Detected: ${names[best.language] || best.language}`;
  return best.language;
}

async function translate() {
  clearTimeout(typing);
  const text = el.text.value, target = el.target.value;
  const number = ++asked;
  el.error.textContent = "";
  if (!text.trim()) { el.output.replaceChildren(); el.mirror.replaceChildren(); current = null; return; }
  el.status.textContent = "Translating…";
  try {
    const source = el.source.value === "auto" ? await detect(text, target) : el.source.value;
    if (el.source.value !== "auto") el.detected.textContent = "";
    const pieces = segment(text, source);
    const sentences = pieces.filter((p) => p.sentence !== undefined);
    const answer = await request(source, target, sentences.map((s) => s.sentence));
    if (number !== asked) return;  // a newer translation was asked for meanwhile
    current = { source, target, sentences: sentences.map((s, i) => ({
      text: s.sentence, words: s.words, nbest: answer.translations[i], shown: answer.translations[i][0] })) };
    drawMirror(text, sentences);
    drawOutput(pieces);
    el.alternatives.hidden = true;
    el.status.textContent = "";
    updateSwap();
  } catch (error) {
    if (number !== asked) return;
    el.status.textContent = "";
    el.error.textContent = error.message;
  }
}

// The start of sentence i's translation as the user has edited it (up to the caret), and the rest decoded again
// from it: /v1's target_prefix.
let completing = null;
async function complete(span) {
  const i = Number(span.dataset.s);
  const selection = window.getSelection();
  if (!selection.rangeCount || !span.contains(selection.focusNode)) return;
  const before = document.createRange();
  before.setStart(span, 0);
  before.setEnd(selection.focusNode, selection.focusOffset);
  const prefix = before.toString().replace(/\s+/g, " ").replace(/^ /, "");
  const number = ++asked;
  span.classList.add("completing");
  try {
    const answer = await request(current.source, current.target, [current.sentences[i].text], { target_prefix: [prefix] });
    if (number !== asked) return;
    const sentence = current.sentences[i];
    sentence.nbest = answer.translations[0];
    sentence.shown = sentence.nbest[0];
    fillSentence(span, sentence.shown);
    caretAt(span, prefix.length);
    el.error.textContent = "";
  } catch (error) {
    if (number === asked) el.error.textContent = error.message;
  } finally {
    span.classList.remove("completing");
  }
}

function caretAt(span, offset) {
  const walker = document.createTreeWalker(span, NodeFilter.SHOW_TEXT);
  let node, left = offset;
  while ((node = walker.nextNode())) {
    if (left <= node.length) {
      const range = document.createRange();
      range.setStart(node, left);
      range.collapse(true);
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
      return;
    }
    left -= node.length;
  }
}

// -- files ---------------------------------------------------------------------------------------------------

function chooseFile(file) {
  el.chosen = file;
  el.dropText.textContent = file ? `${file.name} (${file.size} bytes)` : "Drop a .txt, .html or .srt file here, or choose one";
  el.translateFile.disabled = !file;
  el.download.hidden = true;
}

function translateFile() {
  const file = el.chosen;
  if (!file) return;
  const form = new FormData();
  form.append("file", file);
  form.append("source", el.source.value);
  form.append("target", el.target.value);
  const xhr = new XMLHttpRequest();
  xhr.open("POST", "translate_file");
  for (const [name, value] of Object.entries(headers(false))) xhr.setRequestHeader(name, value);
  el.progress.hidden = false;
  el.progress.removeAttribute("value");  // indeterminate until the upload reports
  el.error.textContent = "";
  el.download.hidden = true;
  el.status.textContent = `Translating ${file.name}…`;
  xhr.upload.addEventListener("progress", (event) => {
    if (event.lengthComputable) el.progress.value = event.loaded / event.total;
    if (event.loaded === event.total) el.progress.removeAttribute("value");  // uploaded: translating now
  });
  xhr.addEventListener("load", () => {
    el.progress.hidden = true;
    el.status.textContent = "";
    let answer = null;
    try { answer = JSON.parse(xhr.responseText); } catch (_) { answer = null; }
    if (xhr.status !== 200 || !answer || !answer.translatedFileUrl) {
      el.error.textContent = (answer && answer.error) || `the server answered ${xhr.status}`;
      return;
    }
    const name = file.name.replace(/(\.[^.]*)?$/, (ext) => `.${el.target.value}${ext}`);
    el.download.href = answer.translatedFileUrl;
    el.download.download = name;
    el.download.textContent = `Download ${name}`;
    el.download.hidden = false;
    el.download.focus();
  });
  xhr.addEventListener("error", () => {
    el.progress.hidden = true;
    el.error.textContent = "the server could not be reached";
  });
  xhr.send(form);
}

// -- the page ------------------------------------------------------------------------------------------------

function showMode(mode) {
  for (const [name, tab] of Object.entries(el.tabs)) {
    tab.setAttribute("aria-selected", String(name === mode));
    el.panels[name].hidden = name !== mode;
  }
  keepInUrl();
}

function setTheme(theme) {
  document.documentElement.dataset.theme = theme;
  el.theme.setAttribute("aria-pressed", String(theme === "dark"));
  el.theme.textContent = theme === "dark" ? "Light theme" : "Dark theme";
  try { localStorage.setItem("theme", theme); } catch (_) { /* storage off: the choice lasts the page */ }
}

function wire() {
  el.source.addEventListener("change", () => { fillTargets(el.target.value); keepInUrl(); translate(); });
  el.target.addEventListener("change", () => { keepInUrl(); updateSwap(); translate(); });
  el.swap.addEventListener("click", () => {
    const from = el.source.value === "auto" ? current && current.source : el.source.value;
    const to = el.target.value;
    if (!from) return;
    const translated = el.output.textContent;
    el.source.value = to;
    fillTargets(from);
    el.detected.textContent = "";
    if (translated) el.text.value = translated;
    el.count.textContent = el.text.value.length;
    keepInUrl();
    translate();
  });
  el.text.addEventListener("input", () => {
    el.count.textContent = el.text.value.length;
    el.mirror.textContent = el.text.value + "\n";  // the marks belong to the text translated; it has changed
    clearTimeout(typing);
    typing = setTimeout(translate, 700);
  });
  el.text.addEventListener("scroll", () => { el.mirror.scrollTop = el.text.scrollTop; });
  el.text.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); translate(); }
  });
  el.translate.addEventListener("click", translate);
  el.copy.addEventListener("click", () => {
    navigator.clipboard?.writeText(el.output.textContent).then(() => { el.status.textContent = "Copied"; },
      () => { el.status.textContent = "Copying is not allowed here: select the text instead"; });
  });
  el.output.addEventListener("mouseover", (event) => {
    const word = event.target.closest(".word");
    if (!word) return highlight(null);
    highlight(Number(word.closest(".sentence").dataset.s), Number(word.dataset.w));
  });
  el.output.addEventListener("mouseleave", () => highlight(null));
  el.output.addEventListener("click", (event) => {
    const sentence = event.target.closest(".sentence");
    if (sentence) showAlternatives(Number(sentence.dataset.s));
  });
  el.output.addEventListener("focusin", (event) => {
    const sentence = event.target.closest(".sentence");
    if (sentence) showAlternatives(Number(sentence.dataset.s));
  });
  let editing = null;
  el.output.addEventListener("input", (event) => {
    const sentence = event.target.closest(".sentence");
    if (!sentence) return;
    clearTimeout(editing);
    editing = setTimeout(() => complete(sentence), 600);
  });
  el.output.addEventListener("keydown", (event) => {
    const sentence = event.target.closest(".sentence");
    if (sentence && event.key === "Enter") {  // a sentence is one line: Enter completes it now
      event.preventDefault();
      clearTimeout(editing);
      complete(sentence);
    }
  });
  el.glossary.addEventListener("change", translate);
  el.key.addEventListener("change", () => {
    try { localStorage.setItem("apiKey", el.key.value.trim()); } catch (_) { /* kept for this page only */ }
  });
  el.theme.addEventListener("click", () => setTheme(document.documentElement.dataset.theme === "dark" ? "light" : "dark"));
  el.tabs.text.addEventListener("click", () => showMode("text"));
  el.tabs.files.addEventListener("click", () => showMode("files"));
  for (const tab of Object.values(el.tabs)) {
    tab.addEventListener("keydown", (event) => {  // arrow keys move between tabs, as the ARIA pattern has it
      if (event.key !== "ArrowLeft" && event.key !== "ArrowRight") return;
      const other = tab === el.tabs.text ? el.tabs.files : el.tabs.text;
      other.focus();
      other.click();
    });
  }
  el.file.addEventListener("change", () => chooseFile(el.file.files[0] || null));
  el.drop.addEventListener("dragover", (event) => { event.preventDefault(); el.drop.classList.add("dragging"); });
  el.drop.addEventListener("dragleave", () => el.drop.classList.remove("dragging"));
  el.drop.addEventListener("drop", (event) => {
    event.preventDefault();
    el.drop.classList.remove("dragging");
    if (event.dataTransfer.files.length) chooseFile(event.dataTransfer.files[0]);
  });
  el.translateFile.addEventListener("click", translateFile);
}

async function start() {
  let theme = null;
  try { theme = localStorage.getItem("theme"); el.key.value = localStorage.getItem("apiKey") || ""; } catch (_) { /* */ }
  setTheme(theme || (window.matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light"));
  wire();
  try {
    settings = { ...settings, ...(await call("frontend/settings")) };
    el.keyRow.hidden = !settings.keyRequired;
    languages = await call("languages");
  } catch (error) {
    el.error.textContent = "The server's languages could not be read: " + error.message;
    return;
  }
  for (const l of languages) names[l.code] = l.name;
  const params = new URL(window.location.href).searchParams;
  option(el.source, "auto", "Detect language");
  for (const l of languages) if (l.targets.length) option(el.source, l.code, l.name);
  const wanted = params.get("source");
  el.source.value = wanted && [...el.source.options].some((o) => o.value === wanted) ? wanted
    : (languages.find((l) => l.targets.length) || { code: "auto" }).code;
  fillTargets(params.get("target"));
  showMode(params.get("mode") === "files" ? "files" : "text");
  document.body.dataset.ready = "true";  // for tests and scripts: the languages are in
}

start();
