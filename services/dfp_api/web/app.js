// The jobs page of dflash-pipeline: plain JavaScript over the REST API, no build step, no CDN.
// The API key is kept in sessionStorage and sent only as an Authorization header, never in a URL.
"use strict";

const KEY = "dflash-api-key";
const POLL_MS = 2000;
const $ = (id) => document.getElementById(id);
let timer = null;
let view = null; // {jobId, points, after, metricsJob}

function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

function row(cells) {
  const tr = el("tr");
  for (const c of cells) {
    const td = el("td");
    if (c instanceof Node) td.appendChild(c); else td.textContent = c === undefined || c === null ? "-" : String(c);
    tr.appendChild(td);
  }
  return tr;
}

function fmt(v) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number") return String(v);
  return Number.isInteger(v) ? String(v) : v.toPrecision(4);
}

function when(ts) { return ts ? new Date(ts * 1000).toISOString().replace("T", " ").slice(0, 19) : "-"; }

class Unauthorized extends Error {}

async function api(path) {
  const key = sessionStorage.getItem(KEY);
  const resp = await fetch(path, {headers: {"Authorization": "Bearer " + key}, cache: "no-store"});
  if (resp.status === 401) throw new Unauthorized((await resp.json()).message || "unauthenticated");
  if (!resp.ok) throw new Error(path + ": HTTP " + resp.status);
  return resp.json();
}

function show(section) {
  for (const id of ["login", "jobs", "job"]) $(id).hidden = id !== section;
  $("logout").hidden = section === "login";
}

function fail(err) {
  if (err instanceof Unauthorized) {
    sessionStorage.removeItem(KEY);
    $("error").textContent = "API key refused: " + err.message;
    $("error").hidden = false;
    stop();
    show("login");
    return;
  }
  $("error").textContent = String(err.message || err);
  $("error").hidden = false;
}

function stop() { if (timer) clearTimeout(timer); timer = null; }

function every(fn) {
  stop();
  const tick = async () => {
    try { await fn(); $("error").hidden = true; } catch (err) { fail(err); if (err instanceof Unauthorized) return; }
    timer = setTimeout(tick, POLL_MS);
  };
  tick();
}

function progressText(p) {
  return p.fraction === null || p.fraction === undefined ? "-" : `${Math.round(100 * p.fraction)}% ${p.primary_unit}`;
}

async function renderJobs() {
  const page = await api("/v1/jobs?limit=100");
  const body = $("job-rows");
  body.replaceChildren(...page.items.map((job) => row([
    el("a", job.id, {href: "#/jobs/" + encodeURIComponent(job.id)}), job.type, job.stage, job.state,
    progressText(job.progress), job.progress.eta_s === null ? "-" : `${Math.round(job.progress.eta_s)} s`,
    job.owner, when(job.created_at)])));
}

function counterText(rec) {
  return Object.entries(rec.progress.units).map(([unit, u]) =>
    `${unit} ${fmt(u.done)}${u.total === null ? "" : " / " + fmt(u.total)}`).join(", ");
}

function drawChart(canvas, series) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 36;
  ctx.clearRect(0, 0, w, h);
  const pts = series.flatMap((s) => s.points);
  ctx.strokeStyle = "#8a93a3";
  ctx.strokeRect(pad, 8, w - pad - 8, h - pad - 8);
  if (!pts.length) { ctx.fillStyle = "#5a6270"; ctx.fillText("no points yet", w / 2 - 30, h / 2); return; }
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const X = (x) => pad + (x - x0) / (x1 - x0) * (w - pad - 8);
  const Y = (y) => h - pad - (y - y0) / (y1 - y0) * (h - pad - 16);
  ctx.fillStyle = "#5a6270";
  ctx.fillText(fmt(y1), 2, 16);
  ctx.fillText(fmt(y0), 2, h - pad);
  ctx.fillText("step " + x0, pad, h - pad + 16);
  ctx.fillText(String(x1), w - 40, h - pad + 16);
  series.forEach((s, i) => {
    ctx.strokeStyle = s.colour;
    ctx.fillStyle = s.colour;
    ctx.beginPath();
    s.points.forEach(([x, y], j) => (j ? ctx.lineTo(X(x), Y(y)) : ctx.moveTo(X(x), Y(y))));
    ctx.stroke();
    s.points.forEach(([x, y]) => ctx.fillRect(X(x) - 2, Y(y) - 2, 4, 4));
    ctx.fillText(s.name, pad + 8 + 90 * i, 22);
  });
}

function seriesOf(points, key) { return points.filter((p) => key in p).map((p) => [p.step, p[key]]); }

function drawCharts(points) {
  const canvases = {loss: $("chart-loss"), accuracy: $("chart-accuracy"), tau: $("chart-tau")};
  drawChart(canvases.loss, [{name: "train", colour: "#1f6feb", points: seriesOf(points, "loss")},
                            {name: "held-out", colour: "#d1242f", points: seriesOf(points, "heldout_loss")}]);
  drawChart(canvases.accuracy, [{name: "train", colour: "#1f6feb", points: seriesOf(points, "accuracy")},
                                {name: "held-out", colour: "#d1242f", points: seriesOf(points, "heldout_accuracy")}]);
  drawChart(canvases.tau, [{name: "τ", colour: "#1a7f37", points: seriesOf(points, "tau")}]);
  canvases.loss.dataset.points = String(seriesOf(points, "loss").length);
  canvases.tau.dataset.points = String(seriesOf(points, "tau").length);
  const last = points[points.length - 1];
  $("latest").textContent = last ? Object.entries(last).filter(([k]) => !k.startsWith("accuracy_pos_"))
    .map(([k, v]) => `${k} ${fmt(v)}`).join("  ") : "no metric points yet";
}

// one POSIX shell word, whatever the text holds (quotes, $(...), backticks, newlines): safe to paste
function shellQuote(text) {
  const s = String(text);
  return /^[A-Za-z0-9_@%+=:,./-]+$/.test(s) ? s : "'" + s.replace(/'/g, "'\\''") + "'";
}

function localPath(uri) { return String(uri).replace(/^file:\/\//, "").replace(/\/$/, "") || "/"; }

function servingText(spec, outputs) {
  const train = spec.train || spec;
  if (!outputs.drafter) return "The serving commands appear when the drafter is exported.";
  const serving = outputs.serving && typeof outputs.serving === "object" ? outputs.serving : {};
  // the trainer's own command line (quoted there); else one built here, every word quoted
  let vllm = typeof serving.vllm === "string" ? serving.vllm : null;
  if (vllm === null) {
    const config = JSON.stringify({method: "dflash", model: localPath(outputs.drafter),
                                   num_speculative_tokens: (Number(train.block_size) || 16) - 1});
    vllm = ["vllm", "serve", shellQuote(localPath(train.target || "<target>")), "--speculative-config",
            shellQuote(config)].join(" ");
  }
  const lines = [vllm];
  if (outputs.tensorboard) lines.push("tensorboard --logdir " + shellQuote(localPath(outputs.tensorboard)));
  return lines.join("\n");
}

// any output value as text: a string as it is, a list item by item, anything else as JSON
function outputText(value) {
  if (typeof value === "string") return value;
  if (Array.isArray(value)) return value.map(outputText).join(", ");
  return JSON.stringify(value);
}

function artifactItem(name, value) {
  const li = el("li", name + ": ");
  const text = outputText(value);
  const http = typeof value === "string" && /^https?:\/\//.test(text);
  li.appendChild(http ? el("a", text, {href: text, rel: "noreferrer"}) : el("code", text));
  return li;
}

async function renderJob(jobId) {
  const job = await api("/v1/jobs/" + encodeURIComponent(jobId));
  $("job-id").textContent = job.id;
  $("job-state").textContent = job.state;
  $("job-summary").textContent = `${job.type}${job.stage ? " (" + job.stage + ")" : ""} · owner ${job.owner || "-"} · ` +
    `progress ${progressText(job.progress)} · ETA ${job.progress.eta_s === null ? "-" : Math.round(job.progress.eta_s) + " s"}` +
    (job.error ? " · error: " + job.error : "");
  const stages = [["job", job]];
  for (const name of ["generate", "tokenize", "train"]) {
    const id = job.outputs[name + "_job"];
    if (id) stages.push([name, await api("/v1/jobs/" + encodeURIComponent(id))]);
  }
  $("stage-rows").replaceChildren(...stages.map(([name, rec]) => row([name, rec.id, rec.state, counterText(rec)])));
  const bad = stages.filter(([, rec]) => rec.counters.bad_lines !== undefined);
  $("bad-lines").replaceChildren(...(bad.length ? bad.map(([name, rec]) => el("p",
    `${name}: ${fmt(rec.counters.bad_lines)} bad lines` + (rec.outputs.stats ? ` (per reason in ${rec.outputs.stats})` : "")))
    : [el("p", "none reported")]));
  const outputs = {};
  for (const [, rec] of stages) {
    for (const [k, v] of Object.entries(rec.outputs)) if (!k.endsWith("_job") && typeof v !== "number") outputs[k] = v;
  }
  $("artifacts").replaceChildren(...Object.entries(outputs).map(([k, v]) => artifactItem(k, v)));
  $("serving").textContent = servingText(job.spec, outputs);
  for (;;) { // every new point since the last poll
    const page = await api(`/v1/jobs/${encodeURIComponent(jobId)}/metrics?after=${view.after}&limit=1000`);
    if (page.items.length) {
      view.points = view.points.filter((p) => p.step <= view.after).concat(page.items);
      view.after = page.items[page.items.length - 1].step;
    }
    if (page.next_after === null) break;
  }
  drawCharts(view.points);
}

function route() {
  $("error").hidden = true;
  if (!sessionStorage.getItem(KEY)) { stop(); show("login"); return; }
  const match = location.hash.match(/^#\/jobs\/([A-Za-z0-9_-]+)$/);
  if (match) {
    view = {jobId: match[1], points: [], after: -1};
    show("job");
    every(() => renderJob(match[1]));
  } else {
    view = null;
    show("jobs");
    every(renderJobs);
  }
}

$("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY, $("key").value);
  $("key").value = "";
  route();
});
$("logout").addEventListener("click", () => { sessionStorage.removeItem(KEY); route(); });
window.addEventListener("hashchange", route);
route();
