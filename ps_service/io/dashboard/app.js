// The edgeps dashboard: subscribes to a job's metrics, barrier and device statuses over MQTT on
// WebSockets (MQTT.js, vendor/mqtt.min.js: reconnecting) and sends operator commands, answered on the
// dashboard's own reply topic. The job and the broker's WebSockets address come from the server that
// serves the page (config.json); a link's ?broker= is ignored there (it once sent an operator's login
// to a stranger's broker from the genuine page's origin), and honoured only for a page opened from a
// file, which then never sends an account. Never a password in the URL: the page connects
// anonymously (the local demo's broker), and where the broker refuses, it asks for an account in a
// form, sent only to the served broker over wss:// (or on loopback); it stays in this page's memory.
// What the broker hands the page is checked before it is shown: a status that names another device
// than its topic's, or that is not JSON, changes nothing.
"use strict";

const params = new URLSearchParams(location.search);
let job = "demo", brokerUrl = "", prefix = "edgeps/demo", served = false;
const client = `dashboard-${Math.random().toString(16).slice(2, 10)}`;
let replyTopic = "", cmdTopic = "";
const $ = (id) => document.getElementById(id);
const devices = new Map(); // id -> {state, backend, push_every, busy_s, idle_s}
const curve = [], losses = [];
let barrier = { waiting_for: [], committed: [] };

function megabytes(n) { return (n / 1e6).toFixed(2) + " MB"; }

// A line chart with its axes: the value from 0 (or the lowest value, if below) to the highest seen,
// against seconds since the job started, three labelled ticks on each axis.
function drawCurve(id, points, color) {
  const canvas = $(id), ctx = canvas.getContext("2d");
  canvas.dataset.points = String(points.length);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const left = 48, bottom = 18, right = 24, top = 10;
  const w = canvas.width - left - right, h = canvas.height - top - bottom;
  const t0 = points.length ? points[0][0] : 0, t1 = points.length ? points[points.length - 1][0] : 1;
  const values = points.map(([, a]) => a);
  const high = Math.max(1e-9, ...values), low = Math.min(0, ...values);
  const x = (t) => left + ((t - t0) / (t1 - t0 || 1)) * w, y = (a) => top + h - ((a - low) / (high - low || 1)) * h;
  ctx.strokeStyle = "#c5cad3"; ctx.fillStyle = "#68707d"; ctx.lineWidth = 1; ctx.font = "11px system-ui, sans-serif";
  ctx.beginPath(); ctx.moveTo(left, top); ctx.lineTo(left, top + h); ctx.lineTo(left + w, top + h); ctx.stroke();
  ctx.textAlign = "right"; ctx.textBaseline = "middle";
  for (const a of [low, (low + high) / 2, high]) ctx.fillText(a.toPrecision(3), left - 4, y(a));
  ctx.textAlign = "center"; ctx.textBaseline = "top";
  for (const t of [t0, (t0 + t1) / 2, t1]) ctx.fillText(`${t.toFixed(1)} s`, x(t), top + h + 3);
  if (points.length < 2) return;
  ctx.strokeStyle = color; ctx.lineWidth = 2; ctx.beginPath();
  points.forEach(([t, a], i) => (i ? ctx.lineTo(x(t), y(a)) : ctx.moveTo(x(t), y(a))));
  ctx.stroke();
}

function renderDevices() {
  const table = $("devices");
  while (table.rows.length > 1) table.deleteRow(1);
  let online = 0;
  for (const [id, d] of [...devices.entries()].sort()) {
    if (d.state === "online") online++;
    const place = barrier.committed.includes(id) ? "committed" : barrier.waiting_for.includes(id) ? "waiting" : "";
    const row = table.insertRow();
    const total = (d.busy_s || 0) + (d.idle_s || 0);
    const idle = total > 0 ? `${Math.round((100 * d.idle_s) / total)}%` : "–";
    for (const text of [id, d.state, d.push_every ?? "–", idle, place, d.backend ?? ""]) row.insertCell().textContent = text;
  }
  $("online").textContent = online;
}

function onMetrics(m) {
  const value = m.value ?? m.accuracy;  // the task's metric (protocol 1.2), or a 1.1 server's accuracy
  $("metric").textContent = m.metric ?? "accuracy";
  $("accuracy").textContent = value.toFixed(4);
  $("version").textContent = m.version;
  $("loss").textContent = m.loss.toFixed(4);
  $("elapsed").textContent = m.elapsed_s.toFixed(1);
  $("commits").textContent = m.commits;
  $("applied").textContent = m.applied;
  const rejected = Object.entries(m.rejected).map(([k, v]) => `${k} ${v}`).join(", ");
  $("rejected").textContent = rejected || "none";  // by reason
  $("bytes_up").textContent = megabytes(m.bytes_up);
  $("bytes_down").textContent = megabytes(m.bytes_down);
  $("frequency").textContent = m.frequency;
  const step = m.server_step ?? 1;  // 1: plain averaging; more: the aggregate was extrapolated
  $("server_step").textContent = step === 1 ? "1 (plain average)" : `${step.toFixed(2)}x (extrapolated)`;
  $("pace").textContent = m.pace;
  for (const [id, push] of Object.entries(m.push_every || {})) {
    devices.set(id, { ...(devices.get(id) || { state: "online" }), push_every: push });
  }
  if (!curve.length || curve[curve.length - 1][0] < m.elapsed_s) {
    curve.push([m.elapsed_s, value]);
    losses.push([m.elapsed_s, m.loss]);
  }
  drawCurve("curve", curve, "#3b6fd8");
  drawCurve("losses", losses, "#d8503b");
  if (m.finished) { $("state").textContent = "finished"; $("state").className = "state-finished"; }
  renderDevices();
}

function onReply(r) {
  $("reply").textContent = r.status ? JSON.stringify(r.status, null, 1) : `${r.ok ? "ok" : "refused"}: ${r.cmd}: ${r.detail}`;
}

let session = null;

// An account goes only to the broker the serving page names, over TLS unless it is on this machine.
function mayLogIn(url) {
  if (!served) return false;
  const { protocol, hostname } = new URL(url);
  return protocol === "wss:" || ["localhost", "127.0.0.1", "[::1]", "::1"].includes(hostname);
}

function connect(username, password) {
  if (username !== undefined && !mayLogIn(brokerUrl)) {
    $("connection").textContent = `not sending an account to ${brokerUrl}: only to the broker this page's server names, over wss://`;
    $("connection").className = "bad";
    return;
  }
  if (session) session.end(true);
  replyTopic = `${prefix}/reply/${username || client}`;  // an operator reads its own reply topic only
  cmdTopic = username ? `${prefix}/cmd/${username}` : `${prefix}/cmd`;  // an account's own: answered on its reply topic
  // MQTT.js reconnects by itself (a broker restart): every reconnect subscribes again.
  session = mqtt.connect(brokerUrl, { clientId: client, username, password, protocolVersion: 4, clean: true,
                                      reconnectPeriod: 1000, connectTimeout: 5000 });
  session.on("connect", () => {
    $("connection").textContent = `connected to ${brokerUrl}${username ? " as " + username : ""}`;
    $("connection").className = "ok";
    $("login").hidden = true;
    session.subscribe([`${prefix}/metrics`, `${prefix}/barrier`, `${prefix}/status/+`, replyTopic], { qos: 1 });
  });
  session.on("reconnect", () => { $("connection").textContent = `reconnecting to ${brokerUrl}…`; $("connection").className = "bad"; });
  session.on("close", () => { if ($("connection").className === "ok") $("connection").textContent = "disconnected"; $("connection").className = "bad"; });
  session.on("error", (error) => {  // refused: a secure broker wants an account
    $("connection").textContent = `refused: ${error.message}`;
    $("connection").className = "bad";
    $("login").hidden = false;
    session.end(true);
  });
  session.on("message", onMessage);
}

const STATES = ["online", "offline"], JOB_STATES = ["running", "paused", "finished"];
const isObject = (x) => typeof x === "object" && x !== null && !Array.isArray(x);
const isNumber = (x) => typeof x === "number" && Number.isFinite(x);
const names = (x) => Array.isArray(x) && x.every((d) => typeof d === "string");

function onMessage(topic, payload) {
  if (!payload.length) return;
  let body;
  try { body = JSON.parse(new TextDecoder().decode(payload)); } catch (e) { return; }  // not JSON: ignored
  if (!isObject(body)) return;
  try {
    if (topic === `${prefix}/metrics`) {
      if (isNumber(body.version) && isNumber(body.loss) && isNumber(body.elapsed_s) && isObject(body.rejected)
          && isNumber(body.value ?? body.accuracy)) onMetrics(body);
    } else if (topic === `${prefix}/barrier`) {
      if (!JOB_STATES.includes(body.state) || !names(body.waiting_for) || !names(body.committed)) return;
      barrier = body;
      $("state").textContent = body.state;
      $("state").className = `state-${body.state}`;
      $("pace").textContent = String(body.pace);
      renderDevices();
    } else if (topic.startsWith(`${prefix}/status/`)) {
      const id = topic.slice(`${prefix}/status/`.length);
      if (body.device !== id || !STATES.includes(body.state)) return;  // a status speaks for its own device only
      devices.set(id, { ...(devices.get(id) || {}), state: body.state,
                        backend: typeof body.backend === "string" ? body.backend : undefined,
                        busy_s: isNumber(body.busy_s) ? body.busy_s : undefined,
                        idle_s: isNumber(body.idle_s) ? body.idle_s : undefined });
      renderDevices();
    } else if (topic === replyTopic) onReply(body);
  } catch (e) { /* one bad message never stops the page */ }
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  connect($("username").value || undefined, $("password").value || undefined);
  $("password").value = "";
});

for (const cmd of ["pause", "resume", "status", "stop"]) {
  $(cmd).addEventListener("click", () => {
    const command = { cmd, reason: "dashboard", reply_to: replyTopic, correlation: `${client}-${Date.now()}` };
    session.publish(cmdTopic, JSON.stringify(command), { qos: 1 });
    $("reply").textContent = `sent ${cmd} …`;
  });
}

async function start() {
  let page = {};
  try { page = await (await fetch("config.json")).json(); served = true; } catch (e) { /* a page opened from a file */ }
  job = (served ? page.job : params.get("job")) || "demo";
  brokerUrl = (served ? page.broker : params.get("broker")) || `ws://${location.hostname || "127.0.0.1"}:9001`;
  prefix = `edgeps/${job}`;
  $("job").textContent = job;
  if (served) {  // the job's curves so far, from the server: the page shows the whole job, not only what comes next
    try {
      for (const [t, value, loss] of await (await fetch("history.json")).json()) {
        if (isNumber(t) && isNumber(value) && isNumber(loss)) { curve.push([t, value]); losses.push([t, loss]); }
      }
    } catch (e) { /* an older server: live points only */ }
    drawCurve("curve", curve, "#3b6fd8");
    drawCurve("losses", losses, "#d8503b");
  }
  connect(undefined, undefined);
}
start();
