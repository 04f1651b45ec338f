// The console page: the job form, the live request, the player, the trace timeline, and the
// recent-requests / stages / counters panels.  Everything the server sends is put in the page as text.
"use strict";

const $ = (id) => document.getElementById(id);
const REFRESH_MS = 5000;
const TERMINAL = new Set(["done", "failed", "rejected", "cancelled"]);
let info = null;
let following = null; // AbortController of the open event stream
let currentId = null;
let videoUrl = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "style") node.setAttribute("style", v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function table(node, head, rows) {
  node.replaceChildren(
    el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map((r) => el("tr", {}, r.map((c) => el("td", {}, c ?? "–"))))),
  );
}

const fmtS = (s) => (s === null || s === undefined ? "–" : s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s");
function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}
const badge = (state) => el("span", { class: "badge state-" + state }, state);

// ---------------------------------------------------------------- token

function askToken(message) {
  $("token-error").textContent = message || "";
  $("token-button").hidden = false;
  if (!$("token-dialog").open) $("token-dialog").showModal();
}

Api.onUnauthorized = () => askToken(Api.token() ? "That token was refused." : "");

$("token-form").addEventListener("submit", () => {
  Api.setToken($("token-input").value.trim());
  $("token-input").value = "";
  refreshPanels();
});
$("token-button").addEventListener("click", () => askToken(""));

// ---------------------------------------------------------------- the form

function showTaskFields() {
  const task = $("f-task").value;
  for (const node of document.querySelectorAll(".field.media")) {
    node.hidden = !node.dataset.tasks.split(" ").includes(task);
  }
}
$("f-task").addEventListener("change", showTaskFields);

function clearErrors() {
  for (const node of document.querySelectorAll(".field-error[data-error-for]")) node.textContent = "";
  for (const node of document.querySelectorAll(".field.invalid")) node.classList.remove("invalid");
  $("form-error").textContent = "";
}

// Puts each field error next to its field; errors for fields the form does not show go on top.
function showErrors(message, fieldErrors) {
  const unplaced = [];
  for (const fe of fieldErrors) {
    const slot = document.querySelector(`.field-error[data-error-for="${CSS.escape(fe.field)}"]`);
    if (slot && !slot.closest(".field").hidden) {
      slot.textContent = slot.textContent ? slot.textContent + "; " + fe.message : fe.message;
      slot.closest(".field").classList.add("invalid");
    } else {
      unplaced.push(fe.field + ": " + fe.message);
    }
  }
  $("form-error").textContent = [fieldErrors.length ? "" : message, ...unplaced].filter(Boolean).join(" · ");
}

function buildForm() {
  const data = new FormData();
  const errors = [];
  const value = (id) => $(id).value.trim();
  data.append("prompt", value("f-prompt"));
  for (const [id, name] of [["f-size", "size"], ["f-seconds", "seconds"], ["f-fps", "fps"],
    ["f-steps", "num_inference_steps"], ["f-seed", "seed"], ["f-flow-shift", "flow_shift"]]) {
    if (value(id)) data.append(name, value(id));
  }
  const extra = { task: $("f-task").value };
  if (value("f-audio-flow-shift")) {
    const n = Number(value("f-audio-flow-shift"));
    if (Number.isFinite(n)) extra.audio_flow_shift = n;
    else errors.push({ field: "extra_params.audio_flow_shift", message: "must be a number" });
  }
  data.append("extra_params", JSON.stringify(extra));
  for (const input of document.querySelectorAll(".field.media input[type=file]")) {
    if (input.closest(".field").hidden || !input.files.length) continue;
    const file = input.files[0];
    if (info && file.size > info.limits.max_upload_bytes) {
      errors.push({ field: input.name, message: `larger than ${fmtBytes(info.limits.max_upload_bytes)}` });
    }
    data.append(input.name, file, file.name);
  }
  return { data, errors };
}

$("job-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  clearErrors();
  const { data, errors } = buildForm();
  if (errors.length) return showErrors("", errors);
  $("submit").disabled = true;
  try {
    const video = await Api.post("/v1/videos", data);
    openRequest(video.id);
  } catch (e) {
    if (e instanceof Api.ApiError) showErrors(e.message, e.fieldErrors);
    else showErrors("could not reach the gateway: " + e.message, []);
  } finally {
    $("submit").disabled = false;
  }
});

// ---------------------------------------------------------------- one request

function setState(state, stage, step) {
  const node = $("current-state");
  node.textContent = state;
  node.className = "badge state-" + state;
  $("current-stage").textContent = stage ? "stage " + stage : "";
  $("current-step").textContent = step || "";
}

function setProgress(frame) {
  if (!info) return;
  const stages = info.stages;
  let pct = 0;
  if (frame.state === "done") pct = 100;
  else if (frame.state === "running" && stages.includes(frame.stage)) {
    const part = frame.total ? Math.min(1, frame.step / frame.total) : 0;
    pct = (100 * (stages.indexOf(frame.stage) + part)) / stages.length;
  } else return;
  $("progress-bar").style.width = pct.toFixed(0) + "%";
}

function logFrame(frame) {
  const log = $("event-log");
  const text = `${new Date(frame.timestamp * 1000).toISOString().slice(11, 23)}  ${frame.event}` +
    (frame.stage ? `  [${frame.stage}${frame.rank !== null && frame.rank !== undefined ? "/" + frame.rank : ""}]` : "") +
    (frame.detail ? "  " + frame.detail : "");
  log.append(el("li", { class: frame.kind }, text));
  while (log.children.length > 200) log.firstChild.remove();
}

async function openRequest(id) {
  if (following) following.abort();
  currentId = id;
  $("current-id").textContent = id;
  $("event-log").replaceChildren();
  $("progress-bar").style.width = "0%";
  $("player-box").hidden = true;
  $("timeline").replaceChildren(el("p", { class: "muted" }, "waiting for the request to end…"));
  setState("queued");
  const controller = new AbortController();
  following = controller;
  let last = null;
  let running = true;
  let live = null; // the live player's promise, once the last stage runs
  try {
    await Api.follow(`/v1/videos/${encodeURIComponent(id)}/events`, (kind, frame) => {
      if (id !== currentId) return;
      if (kind === "end") { logFrame({ kind: "log", event: "stream ended: " + frame.code, timestamp: Date.now() / 1000 }); return; }
      logFrame(frame);
      if (!live && frame.kind === "status" && frame.state === "running" && info && frame.stage === info.stages.at(-1)) {
        live = playLive(id, controller.signal, () => running); // the last stage may write as it goes
      }
      if (frame.kind === "status" || frame.step !== null) {
        const step = frame.step !== null && frame.step !== undefined ? `step ${frame.step}/${frame.total}` : "";
        if (frame.kind === "status") { last = frame; setState(frame.state, frame.stage, step); }
        else if (last) setState(last.state, frame.stage || last.stage, step);
        setProgress(frame.kind === "status" ? frame : Object.assign({}, last || {}, frame, { state: "running" }));
      }
    }, controller.signal);
  } catch (e) {
    if (e.name === "AbortError") return;
    logFrame({ kind: "log", event: "live events unavailable: " + e.message, timestamp: Date.now() / 1000 });
  }
  running = false;
  if (id !== currentId) return;
  // The stream closed: the request ended (or the stream was refused); read where it stands.
  try {
    const video = await Api.json(`/v1/videos/${encodeURIComponent(id)}`);
    setState(video.stageferry_state, null, video.error ? `${video.error.code}: ${video.error.message}` : "");
    const streamed = live ? await live : null;
    if (id !== currentId) return;
    if (video.stageferry_state === "done") {
      $("progress-bar").style.width = "100%";
      if (streamed) setDownload(id, URL.createObjectURL(streamed.blob)); // the player has it all already
      else await showVideo(id);
    }
    if (TERMINAL.has(video.stageferry_state)) await showTrace(id);
  } catch (e) {
    logFrame({ kind: "log", event: "status unavailable: " + e.message, timestamp: Date.now() / 1000 });
  }
  refreshPanels();
}

async function showVideo(id) {
  const data = await Api.blob(`/v1/videos/${encodeURIComponent(id)}/content`);
  const url = URL.createObjectURL(data);
  loadPlayer(url);
  setDownload(id, url);
}

function loadPlayer(url) {
  if (videoUrl && videoUrl !== url) URL.revokeObjectURL(videoUrl);
  videoUrl = url;
  const player = $("player");
  player.removeAttribute("poster");
  player.addEventListener("loadeddata", () => posterFromFirstFrame(player), { once: true });
  if (player.src !== url) player.src = url;
  $("player-box").hidden = false;
}

function setDownload(id, url) {
  const link = $("download");
  if (link.href.startsWith("blob:") && link.href !== videoUrl) URL.revokeObjectURL(link.href);
  link.href = url;
  link.download = id + ".mp4";
  $("player-box").hidden = false;
}

// The running video played as its last stage writes it (live_player.js); null where it does not stream
// (the reason is in the event log) or the request was left: the whole file is loaded once done.
async function playLive(id, signal, isRunning) {
  const player = $("player");
  try {
    return await LivePlayer.play(id, player, {
      signal,
      isRunning,
      onStart: (url) => {
        loadPlayer(url);
        logFrame({ kind: "log", event: "playing as it arrives: " + window.stageferryLive.codec, timestamp: Date.now() / 1000 });
        player.play().catch(() => { /* autoplay refused: the controls play it */ });
      },
    }).then((result) => {
      if (!result && id === currentId) {
        logFrame({ kind: "log", event: "not played live: " + window.stageferryLive.reason, timestamp: Date.now() / 1000 });
      }
      return result;
    });
  } catch (e) {
    if (e.name !== "AbortError" && id === currentId) {
      logFrame({ kind: "log", event: "live playback stopped: " + e.message, timestamp: Date.now() / 1000 });
    }
    if (window.stageferryLive) window.stageferryLive.reason = "stopped: " + e.message;
    return null;
  }
}

// The preview frame: the first decoded frame, drawn once, kept as the poster.
function posterFromFirstFrame(player) {
  try {
    const canvas = el("canvas", { width: player.videoWidth, height: player.videoHeight });
    canvas.getContext("2d").drawImage(player, 0, 0);
    player.poster = canvas.toDataURL("image/jpeg", 0.8);
  } catch (_) { /* the frame is not drawable yet: no poster */ }
}

// ---------------------------------------------------------------- trace

async function showTrace(id) {
  const trace = await Api.json(`/v1/videos/${encodeURIComponent(id)}/trace`);
  const total = Math.max(trace.total_s || 0, 1e-6);
  const rows = trace.hops.map((hop) => {
    const left = (100 * hop.offset_s) / total;
    const width = Math.max(0.5, (100 * (hop.seconds ?? total - hop.offset_s)) / total);
    const label = `${hop.state}${hop.stage ? " " + hop.stage : ""} ${fmtS(hop.seconds)}` +
      (hop.transports.length ? " via " + hop.transports.join(", ") : "");
    return el("div", { class: "lane" },
      el("span", { class: "lane-label" }, label),
      el("div", { class: "lane-track" },
        el("div", { class: "lane-bar hop-" + hop.state, style: `left:${left}%;width:${Math.min(width, 100 - left)}%`, title: label })));
  });
  $("timeline").replaceChildren(el("p", { class: "muted" }, `${trace.events.length} events over ${fmtS(trace.total_s)}`), ...rows);
  table($("spans"), ["stage", "queue wait", "model time", "input via", "bytes", "transfer", "fan-out"],
    trace.stages.map((s) => [s.stage, fmtS(s.queue_wait_s), fmtS(s.model_s), s.transport, fmtBytes(s.payload_bytes),
      fmtS(s.transfer_s), `${s.fan_out} rank${s.fan_out === 1 ? "" : "s"}`]));
  const note = (title, list) => el("p", {}, el("strong", {}, title + ": "),
    list.length ? list.map((r) => `${r.event} (${r.stage || r.service || "?"}${r.detail ? ", " + r.detail : ""})`).join("; ") : "none");
  $("trace-notes").replaceChildren(
    note("Fallbacks", trace.fallbacks), note("Retries", trace.retries),
    el("p", {}, el("strong", {}, "Memory kinds: "), trace.memory_kinds.length ? trace.memory_kinds.join(", ") : "not logged"));
  table($("trace-events"), ["t+s", "event", "service", "stage", "rank", "transport", "memory", "bytes", "seconds", "detail"],
    trace.events.map((r) => [r.offset_s.toFixed(3), r.event, r.service, r.stage, r.rank, r.transport, r.memory,
      r.bytes === null ? null : fmtBytes(r.bytes), r.seconds === null ? null : fmtS(r.seconds), r.detail]));
}

// ---------------------------------------------------------------- panels

async function refreshRecent() {
  try {
    const report = await Api.json("/console/api/requests?limit=15");
    table($("recent"), ["id", "state", "stage", "%", "prompt"], report.requests.map((r) => [
      el("a", { href: "#" + r.id, onclick: (e) => { e.preventDefault(); openRequest(r.id); } }, r.id),
      badge(r.state), r.stage, String(r.progress), r.error_code ? r.error_code : (r.prompt || "").slice(0, 60),
    ]));
  } catch (_) { /* shown by the health pill / token dialog */ }
}

async function refreshStages() {
  try {
    const report = await Api.json("/console/api/stages");
    const pill = $("health");
    pill.textContent = report.problems.length ? report.problems.length + " problem(s)" : "healthy";
    pill.className = "pill " + (report.problems.length ? "bad" : "good");
    pill.title = report.problems.join("\n");
    $("stages").replaceChildren(...report.stages.map((s) => el("div", { class: "stage" },
      el("h3", {}, s.name, el("span", { class: "muted" }, ` ${s.layout} · ${s.device}`)),
      el("p", {}, `queue ${s.queue_length ?? "–"} · in flight ${s.pending ?? "–"} · dead letters ${s.dead_letters ?? "–"}`),
      el("ul", { class: "replicas" }, s.replicas.length ? s.replicas.map((r) => el("li", {},
        el("span", { class: "dot " + (r.live ? "live" : "dead") }), `${r.id} · beat ${fmtS(r.heartbeat_age_s)} ago`))
        : el("li", { class: "muted" }, "no replicas")),
      el("p", { class: "muted" }, "ranks → devices: " + s.ranks.map((r) => `${r.rank}→${r.device}`).join(", ")),
      el("p", { class: "muted" }, "pools: " + s.pools.map((p) => `${p.kind} ${fmtBytes(p.capacity_bytes)}`).join(", ")),
    )));
  } catch (e) {
    if (e.status === 401) return;  // the token dialog says it (a refusal of an older token: nothing to say)
    $("health").textContent = "unreachable";
    $("health").className = "pill bad";
  }
}

async function refreshCounters() {
  try {
    const report = await Api.json("/console/api/counters");
    $("sources").textContent = "sources: " + report.sources.map((s) => s.source + (s.ok ? "" : " (" + s.error + ")")).join(", ");
    const rows = [];
    for (const [family, values] of Object.entries(report.counters)) {
      for (const [labels, value] of Object.entries(values)) {
        const big = family.includes("bytes");
        rows.push([family.replace(/^stageferry_/, ""), labels, big ? fmtBytes(value) : String(value)]);
      }
    }
    table($("counters"), ["counter", "labels", "value"], rows);
  } catch (_) { /* see refreshStages */ }
}

function refreshPanels() {
  refreshRecent();
  refreshStages();
  refreshCounters();
}

async function start() {
  showTaskFields();
  try {
    info = await Api.json("/console/api/info");
  } catch (e) {
    $("form-error").textContent = "could not reach the gateway: " + e.message;
    return;
  }
  $("steps-hint").textContent = `at most ${info.limits.max_steps}`;
  $("prompt-hint").textContent = `at most ${info.limits.max_prompt_chars} characters`;
  $("upload-hint").textContent = `Uploads: at most ${fmtBytes(info.limits.max_upload_bytes)} each.`;
  if (info.auth_required) {
    $("token-button").hidden = false;
    if (!Api.token()) askToken("");
  }
  refreshPanels();
  setInterval(refreshPanels, REFRESH_MS);
  if (location.hash.length > 1) openRequest(decodeURIComponent(location.hash.slice(1)));
}

start();
