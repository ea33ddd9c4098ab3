// The edgeps dashboard: subscribes to a job's metrics, barrier and device statuses over MQTT on
// WebSockets and sends operator commands, answered on the dashboard's own reply topic.
// URL parameters: job (default demo), broker (default ws://<this host>:9001). Never a password: the
// page connects anonymously (the local demo's broker), and where the broker refuses, it asks for an
// account in a form; the password stays in this page's memory only.
"use strict";

const params = new URLSearchParams(location.search);
const job = params.get("job") || "demo";
const brokerUrl = params.get("broker") || `ws://${location.hostname || "127.0.0.1"}:9001`;
const prefix = `edgeps/${job}`;
const client = `dashboard-${Math.random().toString(16).slice(2, 10)}`;
let replyTopic = `${prefix}/reply/${client}`;
const $ = (id) => document.getElementById(id);
const devices = new Map(); // id -> {state, backend, push_every, barrier}
const curve = [];
let barrier = { waiting_for: [], committed: [] };

$("job").textContent = job;

function megabytes(n) { return (n / 1e6).toFixed(2) + " MB"; }

function drawCurve() {
  const canvas = $("curve"), ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (curve.length < 2) return;
  const t0 = curve[0][0], t1 = curve[curve.length - 1][0] || 1;
  const top = Math.max(1, ...curve.map(([, a]) => a));  // accuracy-like metrics in [0, 1]; errors may exceed 1
  ctx.strokeStyle = "#3b6fd8"; ctx.lineWidth = 2; ctx.beginPath();
  curve.forEach(([t, a], i) => {
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
    for (const text of [id, d.state, d.push_every ?? "–", place, d.backend ?? ""]) row.insertCell().textContent = text;
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
  $("rejected").textContent = rejected || "none";
  $("bytes_up").textContent = megabytes(m.bytes_up);
  $("bytes_down").textContent = megabytes(m.bytes_down);
  $("frequency").textContent = m.frequency;
  const step = m.server_step ?? 1;  // 1: plain averaging; more: the aggregate was extrapolated
  $("server_step").textContent = step === 1 ? "1 (plain average)" : `${step.toFixed(2)}x (extrapolated)`;
  $("pace").textContent = m.pace;
  for (const [id, push] of Object.entries(m.push_every || {})) {
    devices.set(id, { ...(devices.get(id) || { state: "online" }), push_every: push });
  }
  if (!curve.length || curve[curve.length - 1][0] !== m.elapsed_s) curve.push([m.elapsed_s, value]);
  drawCurve();
  renderDevices();
}

function onReply(r) {
  $("reply").textContent = r.status ? JSON.stringify(r.status, null, 1) : `${r.ok ? "ok" : "refused"}: ${r.cmd}: ${r.detail}`;
}

let mqtt = null;

function connect(username, password) {
  if (mqtt) mqtt.close();
  replyTopic = `${prefix}/reply/${username || client}`;  // an operator reads its own reply topic only
  mqtt = new MqttLite(brokerUrl, { clientId: client, username, password });
  mqtt.on("connect", (code) => {
    const ok = code === 0;
    $("connection").textContent = ok ? `connected to ${brokerUrl}${username ? " as " + username : ""}` : `refused (code ${code})`;
    $("connection").className = ok ? "ok" : "bad";
    $("login").hidden = ok;
    if (ok) mqtt.subscribe([`${prefix}/metrics`, `${prefix}/barrier`, `${prefix}/status/+`, replyTopic]);
  });
  mqtt.on("close", () => {
    if ($("connection").className === "ok") $("connection").textContent = "disconnected";
    $("connection").className = "bad";
    $("login").hidden = false;
  });
  mqtt.on("message", onMessage);
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
    devices.set(body.device, { ...(devices.get(body.device) || {}), state: body.state, backend: body.backend });
    renderDevices();
  } else if (topic === replyTopic) onReply(body);
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  connect($("username").value || undefined, $("password").value || undefined);
  $("password").value = "";
});
connect(undefined, undefined);

for (const cmd of ["pause", "resume", "status", "stop"]) {
  $(cmd).addEventListener("click", () => {
    const command = { cmd, reason: "dashboard", reply_to: replyTopic, correlation: `${client}-${Date.now()}` };
    mqtt.publish(`${prefix}/cmd`, JSON.stringify(command));
    $("reply").textContent = `sent ${cmd} …`;
  });
}
