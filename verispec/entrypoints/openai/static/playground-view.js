// verispec logprob playground, the token view: colours, the token list, the statistics, the
// popover of alternatives and its keyboard handling. Loaded before playground.js, whose `state`,
// `$` and `continueWith` it calls at event time. Model text goes in with textContent only.
"use strict";

// ----------------------------------------------------------------------------------- colour
// p in [0, 1] -> hue 0 (red) .. 120 (green); docs/server.md states the same formula.
function tokenColour(p) {
  const hue = Math.round(120 * Math.min(1, Math.max(0, p)));
  return `hsl(${hue}, 75%, 80%)`;
}

function band(p) {
  return p >= 0.5 ? "band-high" : p >= 0.1 ? "band-mid" : "band-low";
}

function shown(text) {
  // Whitespace made visible in the popover (the token itself keeps its text).
  return text.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
}

function fmt(x, digits = 4) {
  return x === null || x === undefined ? "-" : Number(x).toFixed(digits);
}

// ----------------------------------------------------------------------------------- rendering
function addToken(tok) {
  const index = state.tokens.length;
  const prev = state.tokens[index - 1];
  tok.other = null; // the other mode's values, from the scoring pass
  tok.rank = null;
  tok.altIds = null; // alternative text -> token id, from the scoring pass
  state.tokens.push(tok);
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = tok.text;
  span.tabIndex = 0;
  span.setAttribute("role", "listitem");
  span.dataset.index = String(index);
  span.dataset.tokenId = String(tok.id);
  if (tok.logprob !== null && tok.logprob !== undefined) {
    const p = Math.exp(tok.logprob);
    span.dataset.logprob = String(tok.logprob);
    span.dataset.p = String(p);
    span.style.backgroundColor = tokenColour(p);
    span.classList.add(band(p));
  } else {
    span.classList.add("no-logprob");
  }
  if (tok.source) {
    span.dataset.source = tok.source.kind;
    span.dataset.step = String(tok.source.step);
    if (tok.source.kind === "accepted") span.classList.add("src-accepted");
    if (!prev || !prev.source || prev.source.step !== tok.source.step) span.classList.add("step-start");
  }
  if (tok.user) span.classList.add("src-user");
  span.setAttribute("aria-label", ariaLabel(tok));
  $("tokens").appendChild(span);
}

function ariaLabel(tok) {
  const p = tok.logprob === null || tok.logprob === undefined ? "no logprob" : `${(100 * Math.exp(tok.logprob)).toFixed(1)} percent`;
  const src = tok.user ? ", chosen by you" : tok.source ? `, ${tok.source.kind}` : "";
  return `${JSON.stringify(tok.text)}, ${p}${src}`;
}

function renderStats() {
  const toks = state.tokens.filter((t) => t.source);
  const steps = new Map();
  for (const t of toks) {
    const s = steps.get(t.source.step) || { drafts: t.source.drafts, accepted: 0, emitted: 0 };
    s.emitted += 1;
    if (t.source.kind === "accepted") s.accepted += 1;
    steps.set(t.source.step, s);
  }
  const drafted = [...steps.values()].filter((s) => s.drafts > 0);
  const accepted = drafted.reduce((a, s) => a + s.accepted, 0);
  const proposed = drafted.reduce((a, s) => a + s.drafts, 0);
  let text = `${state.tokens.length} tokens in ${steps.size} steps`;
  if (drafted.length) {
    const length = (accepted + drafted.length) / drafted.length;
    text += ` \u00b7 ${drafted.length} drafted steps \u00b7 ${accepted} of ${proposed} drafts accepted ` +
      `(acceptance rate ${(100 * accepted / proposed).toFixed(1)}%) \u00b7 mean acceptance length ${length.toFixed(2)}`;
  } else if (state.tokens.length) {
    text += " \u00b7 no drafts";
  }
  $("stats").textContent = text;
  $("stats").dataset.accepted = String(accepted);
  $("stats").dataset.drafted = String(proposed);
}

function renderPrompt() {
  const box = $("prompt-tokens");
  box.replaceChildren();
  box.hidden = !$("show_prompt").checked || !state.promptTokens.length;
  for (const [i, t] of state.promptTokens.entries()) {
    const span = document.createElement("span");
    span.className = "tok prompt-tok";
    span.textContent = t.text;
    span.dataset.index = String(i);
    if (t.logprob === null) {
      span.classList.add("no-logprob");
      span.title = "the first token has no logprob";
    } else {
      const p = Math.exp(t.logprob);
      span.dataset.logprob = String(t.logprob);
      span.style.backgroundColor = tokenColour(p);
      span.classList.add(band(p));
      span.title = `p=${fmt(p)} logprob=${fmt(t.logprob)} rank=${t.rank}`;
    }
    box.appendChild(span);
  }
}

// ----------------------------------------------------------------------------------- popover
function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function stepSummary(index) {
  const tok = state.tokens[index];
  if (!tok.source) return tok.user ? "chosen by you" : "";
  const same = state.tokens.filter((t) => t.source && t.source.step === tok.source.step);
  const accepted = same.filter((t) => t.source.kind === "accepted").length;
  const base = `${SOURCE_TEXT[tok.source.kind]} \u00b7 step ${tok.source.step}`;
  if (!tok.source.drafts) return base;
  return `${base}: ${accepted} of ${tok.source.drafts} drafts accepted, ${same.length} tokens (acceptance length ${same.length})`;
}

function showPopover(index, focusFirst) {
  const tok = state.tokens[index];
  const span = $("tokens").children[index];
  const pop = $("popover");
  pop.replaceChildren();
  pop.dataset.index = String(index);
  const mode = MODE_LABEL[state.mode];
  const other = MODE_LABEL[OTHER_MODE[state.mode]];
  const h = document.createElement("h2");
  const code = document.createElement("code");
  code.textContent = shown(tok.text);
  h.append("Token ", code, ` (id ${tok.id})`);
  pop.appendChild(h);
  const info = document.createElement("p");
  const p = tok.logprob === null ? null : Math.exp(tok.logprob);
  const rank = tok.rank !== null ? tok.rank : derivedRank(tok);
  info.textContent = `p = ${fmt(p)} \u00b7 ${mode} logprob ${fmt(tok.logprob)} \u00b7 ${other} logprob ` +
    `${tok.other ? fmt(tok.other.logprob) : "\u2026"} \u00b7 rank ${rank}`;
  info.className = "summary";
  pop.appendChild(info);
  const src = document.createElement("p");
  src.className = "source";
  src.textContent = stepSummary(index);
  pop.appendChild(src);
  pop.appendChild(alternativesTable(index, tok, mode, other));
  pop.hidden = false;
  const r = span.getBoundingClientRect();
  pop.style.left = `${Math.max(8, Math.min(window.scrollX + r.left, window.scrollX + document.documentElement.clientWidth - pop.offsetWidth - 8))}px`;
  pop.style.top = `${window.scrollY + r.bottom + 6}px`;
  if (focusFirst) {
    const first = pop.querySelector("button");
    if (first) first.focus();
  }
}

function derivedRank(tok) {
  const i = tok.top.findIndex((t) => t.token === tok.text && t.logprob === tok.logprob);
  return i >= 0 ? String(i + 1) : `> ${tok.top.length}`;
}

function alternativesTable(index, tok, mode, other) {
  const table = document.createElement("table");
  const head = table.createTHead().insertRow();
  for (const t of ["rank", "token", "p", `${mode} logprob`, `${other} logprob`, ""]) {
    const th = document.createElement("th");
    th.textContent = t;
    head.appendChild(th);
  }
  const body = table.createTBody();
  tok.top.forEach((alt, j) => {
    const row = body.insertRow();
    row.className = "alt-row";
    row.dataset.token = alt.token;
    row.dataset.logprob = String(alt.logprob);
    if (alt.token === tok.text && alt.logprob === tok.logprob) row.classList.add("sampled");
    cell(row, String(j + 1), "num");
    const c = cell(row, "");
    const code = document.createElement("code");
    code.textContent = shown(alt.token);
    c.appendChild(code);
    cell(row, fmt(Math.exp(alt.logprob)), "num");
    cell(row, fmt(alt.logprob), "num");
    const otherLp = tok.other && tok.altIds ? tok.other.byText.get(alt.token) : undefined;
    cell(row, otherLp === undefined ? "\u2026" : fmt(otherLp), "num");
    const td = cell(row, "");
    const id = tok.altIds ? tok.altIds.get(alt.token) : undefined;
    const button = document.createElement("button");
    button.type = "button";
    button.className = "alt";
    button.textContent = "continue";
    button.setAttribute("aria-label", `Continue from here with ${JSON.stringify(alt.token)}`);
    button.disabled = id === undefined || state.abort !== null;
    button.addEventListener("click", () => continueWith(index, id, alt));
    td.appendChild(button);
  });
  return table;
}

function hidePopover() {
  $("popover").hidden = true;
  state.pinned = null;
}

function tokenEvents() {
  const box = $("tokens");
  const indexOf = (el) => (el && el.classList && el.classList.contains("tok") ? Number(el.dataset.index) : null);
  box.addEventListener("mouseover", (e) => { const i = indexOf(e.target); if (i !== null && state.pinned === null) showPopover(i, false); });
  box.addEventListener("focusin", (e) => {
    const i = indexOf(e.target);
    if (i === null) return;
    if (state.quiet === i) { state.quiet = null; return; } // focus given back by Escape: stays closed
    showPopover(i, false);
  });
  box.addEventListener("click", (e) => {
    const i = indexOf(e.target);
    if (i === null) return;
    state.pinned = state.pinned === i ? null : i; // a tap pins (or unpins) the popover
    showPopover(i, false);
  });
  box.addEventListener("keydown", (e) => {
    const i = indexOf(e.target);
    if (i === null) return;
    const move = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
    if (move) {
      const next = box.children[i + move];
      if (next) next.focus();
      e.preventDefault();
    } else if (e.key === "Enter" || e.key === " ") {
      state.pinned = i;
      showPopover(i, true);
      e.preventDefault();
    } else if (e.key === "Escape") {
      hidePopover();
    }
  });
  $("popover").addEventListener("keydown", (e) => {
    if (e.key !== "Escape") return;
    const i = Number($("popover").dataset.index);
    hidePopover();
    state.quiet = i;
    box.children[i].focus();
  });
  document.addEventListener("click", (e) => {
    if (state.pinned !== null && !$("popover").contains(e.target) && !box.contains(e.target)) hidePopover();
  });
}
