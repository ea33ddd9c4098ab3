// The edgeps dashboard: subscribes to a job's metrics, barrier and device statuses over MQTT on
// WebSockets (MQTT.js, vendor/mqtt.min.js: reconnecting) and sends operator commands, answered on the
// dashboard's own reply topic. The job and the broker's WebSockets address come from the URL
// (?job=J&broker=ws://HOST:PORT) or else from the server that serves the page (config.json). Never a
// password in the URL: the page connects anonymously (the local demo's broker), and where the broker
// refuses, it asks for an account in a form; the password stays in this page's memory only.
"use strict";

const params = new URLSearchParams(location.search);
let job = "demo", brokerUrl = "", prefix = "edgeps/demo";
const client = `dashboard-${Math.random().toString(16).slice(2, 10)}`;
let replyTopic = "";
const $ = (id) => document.getElementById(id);
const devices = new Map(); // id -> {state, backend, push_every, busy_s, idle_s}
const curve = [], losses = [];
let barrier = { waiting_for: [], committed: [] };

function megabytes(n) { return (n / 1e6).toFixed(2) + " MB"; }

function drawCurve(id, points, color) {
  const canvas = $(id), ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (points.length < 2) return;
  const t0 = points[0][0], t1 = points[points.length - 1][0] || 1;
  const top = Math.max(1e-9, ...points.map(([, a]) => a));  // from 0 to the highest value seen
  ctx.strokeStyle = color; ctx.lineWidth = 2; ctx.beginPath();
  points.forEach(([t, a], i) => {
    const x = ((t - t0) / (t1 - t0 || 1)) * (canvas.width - 4) + 2, y = canvas.height - 2 - (a / top) * (canvas.height - 4);
    i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
  });
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
  if (!curve.length || curve[curve.length - 1][0] !== m.elapsed_s) {
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

function connect(username, password) {
  if (session) session.end(true);
  replyTopic = `${prefix}/reply/${username || client}`;  // an operator reads its own reply topic only
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

function onMessage(topic, payload) {
  if (!payload.length) return;
  const body = JSON.parse(new TextDecoder().decode(payload));
  if (topic === `${prefix}/metrics`) onMetrics(body);
  else if (topic === `${prefix}/barrier`) {
    barrier = body;
    $("state").textContent = body.state;
    $("state").className = `state-${body.state}`;
    $("pace").textContent = body.pace;
    renderDevices();
  } else if (topic.startsWith(`${prefix}/status/`)) {
    devices.set(body.device, { ...(devices.get(body.device) || {}), state: body.state, backend: body.backend,
                               busy_s: body.busy_s, idle_s: body.idle_s });
    renderDevices();
  } else if (topic === replyTopic) onReply(body);
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  connect($("username").value || undefined, $("password").value || undefined);
  $("password").value = "";
});

for (const cmd of ["pause", "resume", "status", "stop"]) {
  $(cmd).addEventListener("click", () => {
    const command = { cmd, reason: "dashboard", reply_to: replyTopic, correlation: `${client}-${Date.now()}` };
    session.publish(`${prefix}/cmd`, JSON.stringify(command), { qos: 1 });
    $("reply").textContent = `sent ${cmd} …`;
  });
}

async function start() {
  let served = {};
  try { served = await (await fetch("config.json")).json(); } catch (e) { /* a page opened from a file */ }
  job = params.get("job") || served.job || "demo";
  brokerUrl = params.get("broker") || served.broker || `ws://${location.hostname || "127.0.0.1"}:9001`;
  prefix = `edgeps/${job}`;
  $("job").textContent = job;
  connect(undefined, undefined);
}
start();
