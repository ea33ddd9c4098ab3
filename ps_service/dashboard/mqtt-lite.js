// A minimal MQTT 3.1.1 client over WebSocket for the dashboard: CONNECT, SUBSCRIBE and PUBLISH
// at QoS 0, keep-alive pings. Enough to watch a job and send commands; no dependencies.
"use strict";

class MqttLite {
  constructor(url, { clientId, username, password, keepalive = 30 } = {}) {
    this.handlers = { connect: [], message: [], close: [] };
    this.nextId = 1;
    this.buffer = new Uint8Array(0);
    this.ws = new WebSocket(url, ["mqtt"]);
    this.ws.binaryType = "arraybuffer";
    this.ws.onopen = () => this._send(this._connectPacket(clientId, username, password, keepalive));
    this.ws.onmessage = (event) => this._receive(new Uint8Array(event.data));
    this.ws.onclose = () => this._emit("close");
    this.ping = setInterval(() => this.ws.readyState === 1 && this._send(new Uint8Array([0xc0, 0])), keepalive * 500);
  }

  on(event, handler) { this.handlers[event].push(handler); return this; }
  close() { clearInterval(this.ping); this.handlers.close = []; this.ws.close(); }
  _emit(event, ...args) { for (const handler of this.handlers[event]) handler(...args); }
  _send(bytes) { this.ws.send(bytes); }

  static _utf8(text) { return new TextEncoder().encode(text); }
  static _string(text) {
    const bytes = MqttLite._utf8(text);
    return [bytes.length >> 8, bytes.length & 0xff, ...bytes];
  }
  static _packet(type, body) {
    const length = [];
    let n = body.length;
    do { let digit = n % 128; n = Math.floor(n / 128); if (n > 0) digit |= 0x80; length.push(digit); } while (n > 0);
    return new Uint8Array([type, ...length, ...body]);
  }

  _connectPacket(clientId, username, password, keepalive) {
    let flags = 0x02; // clean session
    const payload = [...MqttLite._string(clientId)];
    if (username) { flags |= 0x80; payload.push(...MqttLite._string(username)); }
    if (password) { flags |= 0x40; payload.push(...MqttLite._string(password)); }
    const header = [...MqttLite._string("MQTT"), 4, flags, keepalive >> 8, keepalive & 0xff];
    return MqttLite._packet(0x10, [...header, ...payload]);
  }

  subscribe(topics) {
    const id = this.nextId++;
    const body = [id >> 8, id & 0xff];
    for (const topic of topics) body.push(...MqttLite._string(topic), 0);
    this._send(MqttLite._packet(0x82, body));
  }

  publish(topic, text) {
    this._send(MqttLite._packet(0x30, [...MqttLite._string(topic), ...MqttLite._utf8(text)]));
  }

  _receive(chunk) {
    const merged = new Uint8Array(this.buffer.length + chunk.length);
    merged.set(this.buffer);
    merged.set(chunk, this.buffer.length);
    this.buffer = merged;
    for (;;) {
      let length = 0, multiplier = 1, i = 1, digit;
      do {
        if (i >= this.buffer.length) return;
        digit = this.buffer[i++];
        length += (digit & 0x7f) * multiplier;
        multiplier *= 128;
      } while (digit & 0x80);
      if (this.buffer.length < i + length) return;
      const type = this.buffer[0] >> 4, flags = this.buffer[0] & 0x0f;
      const body = this.buffer.slice(i, i + length);
      this.buffer = this.buffer.slice(i + length);
      if (type === 2) this._emit("connect", body[1]); // CONNACK: return code 0 is success
      if (type === 3) {
        const topicLength = (body[0] << 8) | body[1];
        const topic = new TextDecoder().decode(body.slice(2, 2 + topicLength));
        const qos = (flags >> 1) & 3;
        const start = 2 + topicLength + (qos > 0 ? 2 : 0);
        if (qos === 1) this._send(new Uint8Array([0x40, 2, body[2 + topicLength], body[3 + topicLength]]));
        this._emit("message", topic, body.slice(start), (flags & 1) === 1);
      }
    }
  }
}
