/* The SDK's MQTT 3.1.1 client (include/edgeps_mqtt.h). No heap: the caller's rx buffer, a small
 * tx buffer in the struct, and the payload of a PUBLISH written from where it lies. */
#include <string.h>

#include "edgeps_mqtt.h"

enum { CONNECT = 1, CONNACK, PUBLISH, PUBACK, SUBSCRIBE = 8, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP,
       DISCONNECT };

#define MAX_REMAINING 268435455u /* the most a 4-byte remaining length says */

enum { READ_NONE, READ_WHOLE, READ_STREAM, READ_PAST };

void eps_mqtt_init(eps_mqtt *c, const eps_mqtt_transport *io, uint8_t *rx, size_t rx_cap, eps_mqtt_on_message on_message,
                   void *ctx) {
    memset(c, 0, sizeof *c);
    c->io = *io;
    c->rx = rx;
    c->rx_cap = rx_cap;
    c->on_message = on_message;
    c->ctx = ctx;
    c->next_id = 1;
}

static void read_reset(eps_mqtt *c);

/* ---- building packets into tx ---- */

static size_t varint(uint8_t *p, size_t n) {
    size_t i = 0;
    do {
        uint8_t b = (uint8_t)(n % 128);
        n /= 128;
        p[i++] = (uint8_t)(b | (n ? 0x80 : 0));
    } while (n);
    return i;
}

/* Room for a packet of `body` bytes after its fixed header; NULL (nothing written) if it does not fit. */
static uint8_t *packet(eps_mqtt *c, uint8_t first, size_t body) {
    uint8_t head[5];
    head[0] = first;
    size_t h = 1 + varint(head + 1, body);
    if (body > MAX_REMAINING || h + body > sizeof c->tx - c->tx_len) return NULL;
    memcpy(c->tx + c->tx_len, head, h);
    uint8_t *at = c->tx + c->tx_len + h;
    c->tx_len += h + body;
    return at;
}

static uint8_t *put16(uint8_t *p, size_t v) {
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
    return p + 2;
}

static uint8_t *put_bytes(uint8_t *p, const void *data, size_t len) {
    p = put16(p, len);
    if (len) memcpy(p, data, len);
    return p + len;
}

static uint16_t next_id(eps_mqtt *c) {
    uint16_t id = c->next_id;
    c->next_id = (uint16_t)(c->next_id == 65535 ? 1 : c->next_id + 1);
    return id;
}

eps_mqtt_status eps_mqtt_connect(eps_mqtt *c, const eps_mqtt_options *o, double now) {
    size_t id = strlen(o->client_id), user = o->username ? strlen(o->username) : 0;
    size_t pass = o->password ? strlen(o->password) : 0, will = o->will_topic ? strlen(o->will_topic) : 0;
    if (id > 65535 || user > 65535 || pass > 65535 || will > 65535 || o->will_len > 65535) return EPS_MQTT_TOO_LONG;
    size_t body = 10 + 2 + id + (o->will_topic ? 4 + will + o->will_len : 0) + (o->username ? 2 + user : 0) +
                  (o->password ? 2 + pass : 0);
    /* a fresh link: nothing half-written survives it; the publish in flight goes again after CONNACK */
    c->tx_len = c->tx_sent = c->header_end = 0;
    read_reset(c);
    c->connected = c->ping_out = c->refused = c->resend_due = 0;
    if (c->writing) c->writing = 0, c->awaiting = 1;
    uint8_t *p = packet(c, CONNECT << 4, body);
    if (p == NULL) return EPS_MQTT_TOO_LONG;
    p = put_bytes(p, "MQTT", 4);
    *p++ = 4; /* 3.1.1 */
    *p++ = (uint8_t)((o->username ? 0x80 : 0) | (o->password ? 0x40 : 0) |
                     (o->will_topic ? 0x04 | 0x08 | (o->will_retain ? 0x20 : 0) : 0) | (o->clean_session ? 0x02 : 0));
    p = put16(p, o->keep_alive_s);
    p = put_bytes(p, o->client_id, id);
    if (o->will_topic) {
        p = put_bytes(p, o->will_topic, will);
        p = put_bytes(p, o->will_payload, o->will_len);
    }
    if (o->username) p = put_bytes(p, o->username, user);
    if (o->password) p = put_bytes(p, o->password, pass);
    c->keep_alive = o->keep_alive_s;
    c->last_sent = now;
    return EPS_MQTT_OK;
}

eps_mqtt_status eps_mqtt_subscribe(eps_mqtt *c, const char *filter) {
    size_t n = strlen(filter);
    uint8_t *p = n <= 65535 ? packet(c, (SUBSCRIBE << 4) | 2, 2 + 2 + n + 1) : NULL;
    if (p == NULL) return n > 65535 || 7 + n > sizeof c->tx ? EPS_MQTT_TOO_LONG : EPS_MQTT_BUSY;
    p = put16(p, next_id(c));
    p = put_bytes(p, filter, n);
    *p = 1; /* QoS 1 */
    return EPS_MQTT_OK;
}

eps_mqtt_status eps_mqtt_unsubscribe(eps_mqtt *c, const char *filter) {
    size_t n = strlen(filter);
    uint8_t *p = n <= 65535 ? packet(c, (UNSUBSCRIBE << 4) | 2, 2 + 2 + n) : NULL;
    if (p == NULL) return n > 65535 || 6 + n > sizeof c->tx ? EPS_MQTT_TOO_LONG : EPS_MQTT_BUSY;
    p = put16(p, next_id(c));
    put_bytes(p, filter, n);
    return EPS_MQTT_OK;
}

/* The PUBLISH header of the message in flight (DUP when it goes again), payload to follow. */
static int publish_header(eps_mqtt *c, int qos, int dup) {
    size_t n = strlen(c->out_topic), body = 2 + n + (qos ? 2 : 0) + c->out_len;
    if (c->tx_len != 0 || body > MAX_REMAINING) return 0; /* the payload must follow its header at once */
    uint8_t first = (uint8_t)((PUBLISH << 4) | (dup ? 8 : 0) | (qos << 1) | (c->out_retain ? 1 : 0));
    uint8_t head[5];
    size_t h = 1 + varint(head + 1, body);
    if (h + 2 + n + 2 > sizeof c->tx) return 0;
    head[0] = first;
    memcpy(c->tx, head, h);
    uint8_t *p = put_bytes(c->tx + h, c->out_topic, n);
    if (qos) p = put16(p, c->out_id);
    c->tx_len = c->header_end = (size_t)(p - c->tx);
    c->tx_sent = 0;
    c->out_sent = 0;
    c->writing = 1;
    return 1;
}

eps_mqtt_status eps_mqtt_publish(eps_mqtt *c, const char *topic, const uint8_t *payload, size_t len, int qos,
                                 int retain) {
    if (strlen(topic) > 65535 || strlen(topic) + 9 > sizeof c->tx || len > MAX_REMAINING - 65539) return EPS_MQTT_TOO_LONG;
    if (!c->connected || c->writing || c->awaiting || c->tx_len != 0) return EPS_MQTT_BUSY;
    c->out_topic = topic;
    c->out_payload = payload;
    c->out_len = len;
    c->out_retain = retain;
    c->out_id = qos ? next_id(c) : 0;
    if (!publish_header(c, qos ? 1 : 0, 0)) return EPS_MQTT_BUSY;
    c->awaiting = 0;
    return EPS_MQTT_OK;
}

int eps_mqtt_sending(const eps_mqtt *c) { return c->writing || c->awaiting; }

eps_mqtt_status eps_mqtt_disconnect(eps_mqtt *c) { return packet(c, DISCONNECT << 4, 0) ? EPS_MQTT_OK : EPS_MQTT_BUSY; }

void eps_mqtt_lost(eps_mqtt *c) {
    c->connected = 0;
    read_reset(c);
    if (c->writing) { /* half written: the whole PUBLISH goes again after the next CONNACK (QoS 1) */
        c->writing = 0;
        c->awaiting = c->out_id != 0;
    }
    c->tx_len = c->tx_sent = c->header_end = 0;
}

/* ---- writing ---- */

static eps_mqtt_status write_some(eps_mqtt *c, double now) {
    for (;;) {
        const uint8_t *from;
        size_t len;
        if (c->writing && c->tx_sent >= c->header_end && c->out_sent < c->out_len) {
            from = c->out_payload + c->out_sent, len = c->out_len - c->out_sent;
        } else if (c->tx_sent < (c->writing ? c->header_end : c->tx_len)) {
            from = c->tx + c->tx_sent, len = (c->writing ? c->header_end : c->tx_len) - c->tx_sent;
        } else if (c->writing) { /* header and payload out: QoS 1 waits for its PUBACK */
            c->writing = 0;
            c->awaiting = c->out_id != 0;
            continue;
        } else {
            c->tx_len = c->tx_sent = c->header_end = 0;
            if (!c->resend_due || !publish_header(c, 1, 1)) return EPS_MQTT_OK;
            c->resend_due = c->awaiting = 0; /* the publish in flight, again, with DUP */
            c->resent++;
            continue;
        }
        long n = c->io.send(c->io.ctx, from, len);
        if (n < 0) return EPS_MQTT_LOST;
        if (n == 0) return EPS_MQTT_OK; /* would block: later */
        if (from == c->out_payload + c->out_sent) c->out_sent += (size_t)n;
        else c->tx_sent += (size_t)n;
        c->last_sent = now;
    }
}

/* ---- reading ---- */

static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }

static eps_mqtt_status queue_ack(eps_mqtt *c, uint16_t id) {
    uint8_t *p = packet(c, PUBACK << 4, 2);
    if (p == NULL) return EPS_MQTT_BUSY;
    put16(p, id);
    return EPS_MQTT_OK;
}

/* One whole packet other than PUBLISH: its first byte, its body in rx (body_len bytes). */
static eps_mqtt_status handle(eps_mqtt *c, uint8_t first) {
    const uint8_t *b = c->rx;
    size_t n = c->body_len;
    switch (first >> 4) {
    case CONNACK:
        if (n != 2 || (b[0] & 0xFE)) return EPS_MQTT_PROTOCOL;
        if (b[1] != 0) {
            c->refused = b[1];
            return EPS_MQTT_REFUSED;
        }
        c->connected = 1;
        c->session_present = b[0] & 1;
        c->resend_due = c->awaiting; /* the publish in flight goes again once the output is free */
        return EPS_MQTT_OK;
    case PUBACK:
        if (n != 2) return EPS_MQTT_PROTOCOL;
        if (c->awaiting && get16(b) == c->out_id) c->awaiting = 0;
        return EPS_MQTT_OK;
    case SUBACK:
        return n >= 3 ? EPS_MQTT_OK : EPS_MQTT_PROTOCOL;
    case UNSUBACK:
        return n == 2 ? EPS_MQTT_OK : EPS_MQTT_PROTOCOL;
    case PINGRESP:
        if (n != 0) return EPS_MQTT_PROTOCOL;
        c->ping_out = 0;
        return EPS_MQTT_OK;
    default:
        return EPS_MQTT_PROTOCOL; /* a broker sends no other packet to a 3.1.1 client */
    }
}

/* A PUBLISH's topic and packet id are in vh: where its payload goes. */
static eps_mqtt_status publish_begins(eps_mqtt *c) {
    size_t t = get16(c->vh);
    c->topic_ok = t < sizeof c->topic && memchr(c->vh + 2, 0, t) == NULL; /* longer than any edgeps topic: not ours */
    if (c->topic_ok) {
        memcpy(c->topic, c->vh + 2, t);
        c->topic[t] = '\0';
    }
    size_t len = c->body_len - c->vh_len;
    c->packet_id = ((c->head[0] >> 1) & 3) == 1 ? get16(c->vh + 2 + t) : 0;
    if (c->topic_ok && c->stream.begin != NULL && c->stream.begin(c->ctx, c->topic, len)) c->reading = READ_STREAM;
    else c->reading = c->topic_ok && len <= c->rx_cap ? READ_WHOLE : READ_PAST;
    c->payload_got = 0;
    return EPS_MQTT_OK;
}

/* A PUBLISH is all in: acknowledged (QoS 1), then handed over. */
static eps_mqtt_status publish_ends(eps_mqtt *c) {
    size_t len = c->body_len - c->vh_len;
    int reading = c->reading;
    c->reading = READ_NONE;
    if (c->packet_id != 0 && queue_ack(c, c->packet_id) != EPS_MQTT_OK)
        return EPS_MQTT_PROTOCOL; /* tx full of acks: drop the link (the broker sends it again) */
    if (reading == READ_STREAM) c->stream.end(c->ctx, 1);
    else if (reading == READ_WHOLE && c->on_message) c->on_message(c->ctx, c->topic, c->rx, len);
    else {
        c->dropped++; /* read past: acknowledged, or the broker would send it again for ever; counted */
        if (c->topic_ok && c->on_message) c->on_message(c->ctx, c->topic, NULL, len);
    }
    return EPS_MQTT_OK;
}

/* Where the next bytes of the packet's body go, and at most how many. */
static uint8_t *body_room(eps_mqtt *c, size_t *cap) {
    if ((c->head[0] >> 4) != PUBLISH) {
        *cap = c->body_len - c->body_got;
        return c->rx + c->body_got;
    }
    if (c->reading == READ_NONE) { /* the topic's length, then the topic and the packet id */
        *cap = (c->vh_got < 2 ? 2 : c->vh_len) - c->vh_got;
        return c->vh + c->vh_got;
    }
    size_t left = c->body_len - c->body_got;
    if (c->reading == READ_STREAM) {
        uint8_t *at = c->stream.room(c->ctx, cap);
        if (*cap > left) *cap = left;
        return at;
    }
    if (c->reading == READ_WHOLE) {
        *cap = left;
        return c->rx + c->payload_got;
    }
    *cap = left < c->rx_cap ? left : c->rx_cap; /* read past, a chunk of rx at a time */
    return c->rx;
}

/* n bytes of the body came where body_room said. */
static eps_mqtt_status body_wrote(eps_mqtt *c, size_t n) {
    c->body_got += n;
    if ((c->head[0] >> 4) != PUBLISH) return EPS_MQTT_OK;
    if (c->reading != READ_NONE) {
        c->payload_got += n;
        if (c->reading == READ_STREAM) c->stream.wrote(c->ctx, n);
        return EPS_MQTT_OK;
    }
    c->vh_got += n;
    if (c->vh_got == 2) {
        unsigned qos = (c->head[0] >> 1) & 3;
        c->vh_len = 2 + (size_t)get16(c->vh) + (qos ? 2 : 0);
        if (c->vh_len > c->body_len) return EPS_MQTT_PROTOCOL;
        if (c->vh_len > sizeof c->vh) { /* a topic longer than any of ours: read past it, unacknowledged */
            c->vh_len = c->vh_got;
            c->reading = READ_PAST;
            c->topic_ok = 0;
            c->packet_id = 0;
            return EPS_MQTT_OK;
        }
    }
    if (c->vh_got < 2 || c->vh_got < c->vh_len) return EPS_MQTT_OK;
    if (((c->head[0] >> 1) & 3) == 1 && get16(c->vh + c->vh_len - 2) == 0) return EPS_MQTT_PROTOCOL;
    return publish_begins(c);
}

/* The reading of a packet stops (it ended, or the link broke: a message half read is dropped, and
 * the broker sends it again). */
static void read_reset(eps_mqtt *c) {
    if (c->reading == READ_STREAM) c->stream.end(c->ctx, 0);
    c->reading = READ_NONE;
    c->head_len = c->body_len = c->body_got = c->vh_got = c->vh_len = c->payload_got = 0;
    c->packet_id = 0;
}

static eps_mqtt_status read_some(eps_mqtt *c, double now) {
    for (;;) {
        if (c->head_len < 2 || (c->head[c->head_len - 1] & 0x80)) { /* the fixed header, a byte at a time */
            if (c->head_len >= 2 && c->head_len == 5) return EPS_MQTT_PROTOCOL; /* a remaining length of 5 bytes */
            long got = c->io.recv(c->io.ctx, c->head + c->head_len, 1);
            if (got < 0) return EPS_MQTT_LOST;
            if (got == 0) return EPS_MQTT_OK;
            c->last_recv = now;
            c->head_len++;
            if (c->head_len < 2 || (c->head[c->head_len - 1] & 0x80)) continue;
            size_t len = 0, scale = 1;
            for (size_t i = 1; i < c->head_len; i++, scale *= 128) len += (c->head[i] & 0x7Fu) * scale;
            c->body_len = len;
            c->body_got = 0;
            unsigned type = c->head[0] >> 4;
            if (type == PUBLISH ? (((c->head[0] >> 1) & 3) > 1 || len < 2) : len > c->rx_cap)
                return EPS_MQTT_PROTOCOL; /* it subscribes at QoS 1: the broker sends no QoS 2 */
        }
        while (c->body_got < c->body_len) {
            size_t cap;
            uint8_t *at = body_room(c, &cap);
            long got = c->io.recv(c->io.ctx, at, cap);
            if (got < 0) return EPS_MQTT_LOST;
            if (got == 0) return EPS_MQTT_OK;
            c->last_recv = now;
            eps_mqtt_status st = body_wrote(c, (size_t)got);
            if (st != EPS_MQTT_OK) return st;
        }
        eps_mqtt_status st = (c->head[0] >> 4) == PUBLISH ? publish_ends(c) : handle(c, c->head[0]);
        read_reset(c);
        if (st != EPS_MQTT_OK) return st;
    }
}

eps_mqtt_status eps_mqtt_poll(eps_mqtt *c, double now) {
    eps_mqtt_status st = read_some(c, now);
    if (st == EPS_MQTT_OK) st = write_some(c, now);
    if (st == EPS_MQTT_OK && c->connected && c->keep_alive) {
        /* no PINGRESP, nor any byte, for keep_alive after the PINGREQ: the link is dead (a PINGRESP
         * queued behind a long message on a slow link comes late, but its bytes keep coming) */
        if (c->ping_out && now - c->ping_at > c->keep_alive && now - c->last_recv > c->keep_alive) st = EPS_MQTT_LOST;
        else if (!c->ping_out && now - c->last_sent >= c->keep_alive * 0.75 && packet(c, PINGREQ << 4, 0)) {
            c->ping_out = 1;
            c->ping_at = now;
            st = write_some(c, now);
        }
    }
    if (st != EPS_MQTT_OK && st != EPS_MQTT_BUSY) eps_mqtt_lost(c);
    return st;
}
