// verispec logprob playground: streams a chat or completion answer from this server's OpenAI routes and
// shows each token's probability, its alternatives, raw against processed values, and how speculation
// produced it. Model text is only ever inserted with textContent, never as markup.
"use strict";

const $ = (id) => document.getElementById(id);
const OTHER_MODE = { processed_logprobs: "raw_logprobs", raw_logprobs: "processed_logprobs" };
const MODE_LABEL = { processed_logprobs: "processed", raw_logprobs: "raw" };
const SOURCE_TEXT = {
  sampled: "sampled (no drafts this step)",
  accepted: "accepted draft",
  recovered: "recovered (the target's token where a draft was rejected)",
  bonus: "bonus (every draft of the step was accepted)",
};

const state = {
  promptIds: null, // the prompt's token ids (return_token_ids)
  tokens: [], // one per output token, see addToken
  promptTokens: [], // {text, logprob, rank} per prompt position, from the scoring pass
  mode: "processed_logprobs", // the mode the last answer was coloured by
  body: null, // the last generation request, as sent
  abort: null,
  pinned: null, // index of the token whose popover stays open
  quiet: null, // index of the token that gets focus back from an open popover (Escape)
};

// ----------------------------------------------------------------------------------- requests
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function postJSON(path, body) {
  const resp = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body) });
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) throw new Error(data.error ? `${resp.status} ${data.error.message}` : `HTTP ${resp.status}`);
  return data;
}

// Server-sent events from a streaming POST: calls onEvent with each parsed JSON payload.
async function streamSSE(path, body, onEvent, signal) {
  const resp = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!resp.ok) {
    const data = await resp.json().catch(() => ({}));
    throw new Error(data.error ? `${resp.status} ${data.error.message}` : `HTTP ${resp.status}`);
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const payload = line.slice(6);
        if (payload === "[DONE]") return;
        const data = JSON.parse(payload);
        if (data.error) throw new Error(data.error.message);
        onEvent(data);
      }
    }
  }
}

function readControls() {
  const num = (id) => ($(id).value === "" ? null : Number($(id).value));
  const body = {
    temperature: num("temperature"), top_p: num("top_p"), top_k: num("top_k"), min_p: num("min_p"),
    max_tokens: num("max_tokens"), logprobs_mode: $("logprobs_mode").value,
    speculative: $("speculative").checked, return_token_ids: true, return_token_sources: true, stream: true,
  };
  if (num("seed") !== null) body.seed = num("seed");
  const extra = $("extra").value.trim();
  if (extra) {
    let parsed;
    try { parsed = JSON.parse(extra); } catch (e) { throw new Error(`extra request fields: ${e.message}`); }
    if (typeof parsed !== "object" || parsed === null || Array.isArray(parsed)) {
      throw new Error("extra request fields: a JSON object is expected");
    }
    Object.assign(body, parsed);
  }
  return body;
}

function generationRequest(mode) {
  const body = readControls();
  const k = Math.max(1, Math.min(20, Number($("top_logprobs").value) || 5));
  if (mode === "chat") {
    const messages = [];
    if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value });
    messages.push({ role: "user", content: $("prompt").value });
    return ["/v1/chat/completions", { ...body, messages, logprobs: true, top_logprobs: k }];
  }
  return ["/v1/completions", { ...body, prompt: $("prompt").value, logprobs: k }];
}

// ----------------------------------------------------------------------------------- chunks
// One chunk's choice -> tokens: {id, text, logprob, top: [{token, logprob}], source}.
function chunkTokens(chunk) {
  const choice = chunk.choices && chunk.choices[0];
  if (!choice || choice.index !== 0) return []; // the page shows the first choice (n > 1 in extra fields)
  const ids = choice.token_ids || [];
  const sources = choice.token_sources || [];
  let entries = [];
  if (choice.logprobs && choice.logprobs.content) { // chat
    entries = choice.logprobs.content.map((e) => ({
      text: e.token, logprob: e.logprob, top: e.top_logprobs.map((t) => ({ token: t.token, logprob: t.logprob })),
    }));
  } else if (choice.logprobs && choice.logprobs.tokens) { // completion
    const lp = choice.logprobs;
    entries = lp.tokens.map((text, i) => ({
      text, logprob: lp.token_logprobs[i],
      top: Object.entries(lp.top_logprobs[i] || {}).map(([token, logprob]) => ({ token, logprob }))
        .sort((a, b) => b.logprob - a.logprob),
    }));
  }
  return ids.map((id, i) => ({ id, ...(entries[i] || { text: "", logprob: null, top: [] }), source: sources[i] || null }));
}

function onChunk(chunk) {
  if (chunk.prompt_token_ids && state.promptIds === null) state.promptIds = chunk.prompt_token_ids;
  const choice = chunk.choices && chunk.choices[0];
  if (choice && choice.prompt_token_ids && state.promptIds === null) state.promptIds = choice.prompt_token_ids;
  for (const tok of chunkTokens(chunk)) addToken(tok);
}

// ----------------------------------------------------------------------------------- scoring
// After an answer: the prompt and the answer scored as one prompt (max_tokens 0, prompt_logprobs), in
// the other mode (raw against processed, side by side) and, for the prompt's own tokens, in this one.
// The rows also name each alternative's token id, which continuing from an alternative needs.
async function scoreRows(mode, k) {
  const ids = state.promptIds.concat(state.tokens.map((t) => t.id));
  const body = {
    prompt: ids, max_tokens: 0, prompt_logprobs: k, logprobs_mode: mode,
    temperature: state.body.temperature, top_p: state.body.top_p, top_k: state.body.top_k, min_p: state.body.min_p,
  };
  const data = await postJSON("/v1/completions", body);
  return data.choices[0].prompt_logprobs;
}

function rowEntries(row) {
  return Object.entries(row || {}).map(([id, v]) => ({ id: Number(id), ...v }));
}

async function scorePass() {
  if (state.promptIds === null || !state.tokens.length) return;
  const k = Math.max(1, Math.min(20, Number($("top_logprobs").value) || 5));
  const other = await scoreRows(OTHER_MODE[state.mode], k);
  const offset = state.promptIds.length;
  state.tokens.forEach((tok, i) => {
    const entries = rowEntries(other[offset + i]);
    const own = entries.find((e) => e.id === tok.id);
    tok.rank = own ? own.rank : null;
    tok.other = { logprob: own ? own.logprob : null, byText: new Map() };
    tok.altIds = new Map();
    for (const e of entries) {
      if (!tok.other.byText.has(e.decoded_token)) tok.other.byText.set(e.decoded_token, e.logprob);
      if (!tok.altIds.has(e.decoded_token)) tok.altIds.set(e.decoded_token, e.id);
    }
  });
  if ($("show_prompt").checked) {
    const rows = await scoreRows(state.mode, 1);
    state.promptTokens = state.promptIds.map((id, i) => {
      const own = rowEntries(rows[i]).find((e) => e.id === id);
      return own ? { text: own.decoded_token, logprob: own.logprob, rank: own.rank } : { text: null, logprob: null, rank: null };
    });
    await fillFirstPromptToken();
  }
  renderPrompt();
}

async function fillFirstPromptToken() {
  // Position 0 has no logprob, so no row names its text: ask the tokenizer route.
  if (!state.promptTokens.length || state.promptTokens[0].text !== null) return;
  const data = await postJSON("/detokenize", { tokens: [state.promptIds[0]] });
  state.promptTokens[0].text = data.prompt;
}

// ----------------------------------------------------------------------------------- generating
function setBusy(busy) {
  $("generate").disabled = busy;
  $("stop").disabled = !busy;
  document.body.dataset.state = busy ? "running" : "done";
}

function showRequest(path, body) {
  $("last-request").textContent = JSON.stringify({ url: path, body }, null, 2);
}

async function run(path, body, keep) {
  $("error").textContent = "";
  hidePopover();
  state.tokens = [];
  state.promptTokens = [];
  $("tokens").replaceChildren();
  renderPrompt();
  state.body = body;
  state.mode = body.logprobs_mode;
  showRequest(path, body);
  for (const tok of keep) addToken(tok);
  state.abort = new AbortController();
  setBusy(true);
  try {
    await streamSSE(path, body, (chunk) => { onChunk(chunk); renderStats(); }, state.abort.signal);
    state.abort = null;
    renderStats();
    await scorePass();
  } catch (e) {
    if (e.name !== "AbortError") $("error").textContent = e.message;
  } finally {
    state.abort = null;
    setBusy(false);
  }
}

async function generate() {
  let path, body;
  try {
    [path, body] = generationRequest(document.querySelector("input[name=mode]:checked").value);
  } catch (e) {
    $("error").textContent = e.message;
    return;
  }
  state.promptIds = null;
  await run(path, body, []);
}

// Continue from an alternative: the prompt, the answer before it and the alternative become a
// token-id prompt (the prefix cache holds all but the last token), with the same sampling fields.
async function continueWith(index, id, alt) {
  if (id === undefined || state.promptIds === null) return;
  const kept = state.tokens.slice(0, index).map((t) => ({ ...t }));
  const chosen = { ...state.tokens[index], id, text: alt.token, logprob: alt.logprob, source: null, user: true };
  const prompt = state.promptIds.concat(kept.map((t) => t.id), [id]);
  const body = { ...state.body, prompt, logprobs: state.body.top_logprobs || state.body.logprobs };
  delete body.messages;
  delete body.top_logprobs;
  body.max_tokens = Math.max(1, (state.body.max_tokens || 16) - kept.length - 1);
  // state.promptIds stays the original prompt's: what was kept and chosen are output tokens.
  await run("/v1/completions", body, kept.concat([chosen]));
}

function init() {
  tokenEvents();
  for (const el of document.querySelectorAll(".legend .tok")) {
    el.style.backgroundColor = tokenColour(Number(el.dataset.p));
  }
  const syncMode = () => {
    const mode = document.querySelector("input[name=mode]:checked").value;
    document.body.classList.toggle("mode-completion", mode === "completion");
  };
  for (const el of document.querySelectorAll("input[name=mode]")) el.addEventListener("change", syncMode);
  syncMode();
  $("api-key").value = sessionStorage.getItem("verispec-api-key") || "";
  $("api-key").addEventListener("change", () => sessionStorage.setItem("verispec-api-key", $("api-key").value));
  $("generate").addEventListener("click", generate);
  $("stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("show_prompt").addEventListener("change", () => renderPrompt());
  $("copy").addEventListener("click", () => navigator.clipboard && navigator.clipboard.writeText($("last-request").textContent));
  $("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) generate(); });
  fetch("/playground/config.json").then((r) => r.json()).then((cfg) => {
    $("model").textContent = cfg.speculative_method
      ? `${cfg.model} \u00b7 drafter: ${cfg.speculative_method} (k = ${cfg.num_speculative_tokens})`
      : `${cfg.model} \u00b7 no drafter`;
    $("speculative").disabled = !cfg.speculative_method;
    document.body.dataset.state = "ready";
  });
}

document.addEventListener("DOMContentLoaded", init);
