/* The SDK's MQTT 3.1.1 client, at the transport level (in the manner of coreMQTT): C99, no heap,
 * every buffer the caller's, a transport of non-blocking send/recv with partial reads and writes,
 * time from the caller. What PROTOCOL.md §2 asks of a device's client: a persistent session
 * (clean session off), a will, credentials, SUBSCRIBE at QoS 1, QoS 1 PUBLISH with the message
 * in flight sent again (DUP) after a reconnect until its PUBACK, PUBACK for what it receives,
 * PINGREQ for keep-alive. One QoS 1 publish is in flight at a time; its payload is written from
 * where it lies (no copy) and must stay unchanged until eps_mqtt_sending() is 0.
 *
 *   eps_mqtt_init(&c, &io, rx, sizeof rx, on_message, ctx);  // then c.stream = ... (optional)
 *   eps_mqtt_connect(&c, &options, now);        // after the transport connected
 *   loop: eps_mqtt_poll(&c, now);               // EPS_MQTT_LOST: reconnect the transport, connect again
 *         eps_mqtt_subscribe / eps_mqtt_publish (EPS_MQTT_BUSY: try again later)
 */
#ifndef EDGEPS_MQTT_H
#define EDGEPS_MQTT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The link: both non-blocking. Return the bytes sent or read (0: none now), -1 if the link is broken. */
typedef struct {
    void *ctx;
    long (*send)(void *ctx, const uint8_t *data, size_t len);
    long (*recv)(void *ctx, uint8_t *data, size_t cap);
} eps_mqtt_transport;

typedef enum {
    EPS_MQTT_OK = 0,
    EPS_MQTT_BUSY,     /* not now: a publish is in flight, or the output buffer holds a packet */
    EPS_MQTT_LOST,     /* the link broke, or the broker stopped answering: connect the transport again */
    EPS_MQTT_REFUSED,  /* CONNACK refused the connection (its return code in c->refused) */
    EPS_MQTT_PROTOCOL, /* the broker sent bytes that are not MQTT 3.1.1: the link is dropped */
    EPS_MQTT_TOO_LONG  /* a topic or packet beyond what the buffers or MQTT hold */
} eps_mqtt_status;

typedef struct {
    const char *client_id;       /* 1..23 characters is what every broker takes; Mosquitto takes up to 65535 */
    const char *username, *password; /* NULL: none */
    const char *will_topic;      /* NULL: no will; else QoS 1, retained as will_retain says */
    const uint8_t *will_payload;
    size_t will_len;
    int will_retain;
    uint16_t keep_alive_s;       /* PINGREQ after this long without sending; 0: none */
    int clean_session;           /* 0 for edgeps (a persistent session) */
} eps_mqtt_options;

/* An inbound PUBLISH: its topic (terminated) and payload, valid during the call. payload NULL: a
 * message of len bytes larger than rx, read past (acknowledged) and counted in dropped. */
typedef void (*eps_mqtt_on_message)(void *ctx, const char *topic, const uint8_t *payload, size_t len);

/* Optional: messages handed over piece by piece as their bytes arrive, into memory the caller
 * names (a parameter frame straight into the device's arena: eps_device_stream_*), instead of
 * whole in rx. Every function gets the client's ctx. */
typedef struct {
    /* A PUBLISH of len payload bytes on topic begins: 1 to take it piece by piece, 0 to have it whole. */
    int (*begin)(void *ctx, const char *topic, size_t len);
    /* Where its next bytes go, at most *cap of them (>= 1). */
    uint8_t *(*room)(void *ctx, size_t *cap);
    /* n bytes were read there. */
    void (*wrote)(void *ctx, size_t n);
    /* It is all in (complete 1; acknowledged just before), or the link broke first (0: a QoS 1
     * message comes again after the reconnect, the session being persistent). */
    void (*end)(void *ctx, int complete);
} eps_mqtt_stream;

#define EPS_MQTT_TX 640u /* control packets and a PUBLISH's header: topics up to 512 bytes */

typedef struct {
    eps_mqtt_transport io;
    eps_mqtt_on_message on_message;
    void *ctx;
    eps_mqtt_stream stream;   /* optional (all NULL: every message whole in rx); set after init */
    uint8_t *rx;              /* one inbound payload or control packet (the caller's: the largest message it takes whole) */
    size_t rx_cap;
    /* reading: the fixed header; a PUBLISH's topic and packet id into vh, its payload whole into
     * rx, piece by piece where the stream says, or read past (larger than rx: acknowledged, counted) */
    uint8_t head[5];
    size_t head_len, body_len, body_got;
    uint8_t vh[2 + 256 + 2];
    size_t vh_got, vh_len, payload_got;
    char topic[257];
    int topic_ok, reading;
    uint16_t packet_id;
    /* writing: tx holds packets; a PUBLISH's payload goes out from the caller's memory after its header */
    uint8_t tx[EPS_MQTT_TX];
    size_t tx_len, tx_sent, header_end;
    /* the QoS 1 publish in flight */
    const char *out_topic;
    const uint8_t *out_payload;
    size_t out_len, out_sent;
    uint16_t out_id, next_id;
    int out_retain, writing, awaiting, resend_due;
    /* the session */
    int connected, session_present, refused, ping_out;
    double last_sent, last_recv, ping_at;
    uint16_t keep_alive;
    uint32_t dropped, resent;  /* PUBLISHes too large for rx; publishes sent again after a reconnect */
} eps_mqtt;

void eps_mqtt_init(eps_mqtt *c, const eps_mqtt_transport *io, uint8_t *rx, size_t rx_cap, eps_mqtt_on_message on_message,
                   void *ctx);

/* Queue CONNECT (the transport has just connected). The publish in flight, if any, goes out again
 * (DUP) once CONNACK came. */
eps_mqtt_status eps_mqtt_connect(eps_mqtt *c, const eps_mqtt_options *options, double now);

/* Write what is queued, read what came, keep the link alive. EPS_MQTT_OK, or why the link is gone. */
eps_mqtt_status eps_mqtt_poll(eps_mqtt *c, double now);

/* Queue a SUBSCRIBE (QoS 1) or UNSUBSCRIBE of one filter. */
eps_mqtt_status eps_mqtt_subscribe(eps_mqtt *c, const char *filter);
eps_mqtt_status eps_mqtt_unsubscribe(eps_mqtt *c, const char *filter);

/* Publish at QoS 0 or 1; payload (and topic) must stay unchanged until eps_mqtt_sending() is 0. */
eps_mqtt_status eps_mqtt_publish(eps_mqtt *c, const char *topic, const uint8_t *payload, size_t len, int qos,
                                 int retain);

/* Whether a publish still needs its payload (being written, or QoS 1 awaiting its PUBACK). */
int eps_mqtt_sending(const eps_mqtt *c);

/* Queue DISCONNECT (a clean end: no will). */
eps_mqtt_status eps_mqtt_disconnect(eps_mqtt *c);

/* The link broke (the caller's transport says so, or it closed it): what was being written will
 * be written again after the next connect. */
void eps_mqtt_lost(eps_mqtt *c);

#ifdef __cplusplus
}
#endif
#endif /* EDGEPS_MQTT_H */
