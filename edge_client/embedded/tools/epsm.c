/* epsm: the SDK's MQTT client (src/mqtt.c) over a POSIX socket, driven by lines on stdin, for the
 * tests against Mosquitto; and `epsm fuzz SEED COUNT`, its reader fed mutated packet streams.
 *
 *   epsm HOST PORT CLIENT_ID [RX_BYTES]   (rx: 64 KiB unless said) then lines:
 *     connect [WILL_TOPIC WILL_TEXT]  open the socket, CONNECT (persistent session), wait for CONNACK
 *     sub FILTER                      SUBSCRIBE at QoS 1
 *     pub TOPIC SIZE QOS [CUT]        publish SIZE bytes (byte i = i % 251); with CUT, the link is cut
 *                                     after CUT bytes of it went out (the publish stays in flight)
 *     recv N SECONDS                  wait for N messages
 *     wait SECONDS                    keep polling
 *     close                           drop the socket (no DISCONNECT: the will fires)
 *     disconnect                      DISCONNECT, then close
 *     stream PREFIX                   messages on topics starting with PREFIX are handed over piece by
 *                                     piece (eps_mqtt_stream) through a 512-byte window, their CRC-32
 *                                     computed as they pass; "msg ..." as the others, "cut ..." when a
 *                                     link broke half way through one
 *   Each line answers one line: "ok ...", or "error ..."; messages print as "msg TOPIC LEN CRC32". */
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "edgeps.h"
#include "edgeps_mqtt.h"

typedef struct {
    int fd;
    long cut_after; /* bytes still to send before the link breaks; -1: never */
    /* fuzz: an inbound stream */
    const uint8_t *in;
    size_t in_len, in_pos;
} link_t;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static long sock_send(void *ctx, const uint8_t *data, size_t len) {
    link_t *l = ctx;
    if (l->fd < 0) return -1;
    if (l->cut_after >= 0 && (size_t)l->cut_after < len) len = (size_t)l->cut_after;
    if (l->cut_after == 0) return -1;
    ssize_t n = send(l->fd, data, len, MSG_NOSIGNAL);
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
    if (l->cut_after > 0) l->cut_after -= n;
    return (long)n;
}

static long sock_recv(void *ctx, uint8_t *data, size_t cap) {
    link_t *l = ctx;
    if (l->fd < 0) return -1;
    ssize_t n = recv(l->fd, data, cap, 0);
    if (n == 0) return -1; /* closed by the broker */
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
    return (long)n;
}

static int messages, quiet;

/* ---- a stream consumer: a 512-byte window, the CRC-32 and the count of what passed ---- */
static char stream_prefix[256];
static char stream_topic[257];
static uint8_t window[512];
static size_t stream_len, stream_got;
static uint32_t stream_crc;
static unsigned long streamed, stream_cuts;
static uint64_t fuzz_state = 1;
static int fuzzing;

static uint64_t next(void) {
    fuzz_state ^= fuzz_state << 13, fuzz_state ^= fuzz_state >> 7, fuzz_state ^= fuzz_state << 17;
    return fuzz_state;
}

static int st_begin(void *ctx, const char *topic, size_t len) {
    (void)ctx;
    if (fuzzing ? next() % 2 != 0 : stream_prefix[0] == '\0' || strncmp(topic, stream_prefix, strlen(stream_prefix)) != 0)
        return 0;
    snprintf(stream_topic, sizeof stream_topic, "%s", topic);
    stream_len = len, stream_got = 0, stream_crc = 0;
    return 1;
}

static uint8_t *st_room(void *ctx, size_t *cap) {
    (void)ctx;
    *cap = fuzzing ? 1 + (size_t)(next() % sizeof window) : sizeof window;
    return window;
}

static void st_wrote(void *ctx, size_t n) {
    (void)ctx;
    stream_crc = eps_crc32(stream_crc, window, n);
    stream_got += n;
}

static void st_end(void *ctx, int complete) {
    (void)ctx;
    if (complete && stream_got != stream_len) { /* the client handed over more or less than the message */
        fprintf(stderr, "epsm: a streamed message of %zu bytes ended after %zu\n", stream_len, stream_got);
        exit(1);
    }
    if (!complete) stream_cuts++;
    else streamed++, messages++;
    if (quiet) return;
    if (complete) printf("msg %s %zu %u\n", stream_topic, stream_len, (unsigned)stream_crc);
    else printf("cut %s %zu of %zu\n", stream_topic, stream_got, stream_len);
    fflush(stdout);
}

static const eps_mqtt_stream STREAM = {st_begin, st_room, st_wrote, st_end};

static void on_message(void *ctx, const char *topic, const uint8_t *payload, size_t len) {
    (void)ctx;
    messages++;
    if (quiet) return;
    if (payload == NULL) printf("past %s %zu\n", topic, len); /* larger than rx: read past */
    else printf("msg %s %zu %u\n", topic, len, (unsigned)eps_crc32(0, payload, len));
    fflush(stdout);
}

static int open_socket(const char *host, int port) {
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1) return -1;
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
}

/* Poll until done() or the deadline; the status of the last poll. */
static eps_mqtt_status pump(eps_mqtt *c, double seconds, int (*done)(const eps_mqtt *)) {
    double until = now_s() + seconds;
    eps_mqtt_status st = EPS_MQTT_OK;
    while (now_s() < until) {
        st = eps_mqtt_poll(c, now_s());
        if (st != EPS_MQTT_OK || (done && done(c))) return st;
        struct timespec t = {0, 1000000};
        nanosleep(&t, NULL);
    }
    return st;
}

static int connected(const eps_mqtt *c) { return c->connected && c->tx_len == 0 && !c->writing; }
static int flushed(const eps_mqtt *c) { return c->tx_len == 0 && !c->writing; }
static int acked(const eps_mqtt *c) { return !eps_mqtt_sending(c); }
static int cut(const eps_mqtt *c) { return ((const link_t *)c->io.ctx)->cut_after == 0; }


static long fz_send(void *ctx, const uint8_t *data, size_t len) {
    (void)ctx, (void)data;
    return (long)(next() % 4 == 0 ? 0 : len);
}

static long fz_recv(void *ctx, uint8_t *data, size_t cap) {
    link_t *l = ctx;
    if (l->in_pos >= l->in_len) return next() % 8 == 0 ? -1 : 0;
    size_t n = 1 + (size_t)(next() % 64);
    n = n < cap ? n : cap;
    n = n < l->in_len - l->in_pos ? n : l->in_len - l->in_pos;
    memcpy(data, l->in + l->in_pos, n);
    l->in_pos += n;
    return (long)n;
}

/* The client's reader and writer on COUNT streams of valid packets, mutated. */
static int fuzz(uint64_t seed, unsigned long count) {
    static const uint8_t valid[] = {
        0x20, 0x02, 0x01, 0x00,                                     /* CONNACK, session present */
        0x90, 0x03, 0x00, 0x01, 0x01,                               /* SUBACK */
        0x32, 0x0b, 0x00, 0x05, 'e', 'd', 'g', 'e', '/', 0x00, 0x07, 'h', 'i', /* PUBLISH QoS 1 */
        0x30, 0x07, 0x00, 0x01, 't', 'a', 'b', 'c', 'd',            /* PUBLISH QoS 0 */
        0x40, 0x02, 0x00, 0x01,                                     /* PUBACK */
        0xd0, 0x00,                                                 /* PINGRESP */
        0xb0, 0x02, 0x00, 0x02,                                     /* UNSUBACK */
        0x32, 0x83, 0x01, 0x00, 0x01, 'x', 0x00, 0x09,              /* PUBLISH QoS 1 of 131 bytes: rx holds 64 */
    };
    static uint8_t stream[sizeof valid + 256], rx[64], payload[300];
    link_t l = {-1, -1, stream, 0, 0};
    eps_mqtt_transport io = {&l, fz_send, fz_recv};
    eps_mqtt_options o = {"fz", "u", "p", "w", (const uint8_t *)"x", 1, 1, 5, 0};
    eps_mqtt c;
    unsigned long ok = 0, dropped = 0, resent = 0;
    fuzz_state = seed | 1;
    quiet = fuzzing = 1;
    for (unsigned long i = 0; i < count; i++) {
        size_t len = sizeof valid;
        memcpy(stream, valid, len);
        for (int k = (int)(next() % 4); k > 0; k--) stream[next() % len] ^= (uint8_t)(1u << (next() % 8));
        if (next() % 4 == 0) len = (size_t)(next() % (len + 1));
        if (next() % 8 == 0) { /* random bytes after them */
            for (size_t j = 0; j < 256; j++) stream[len + j] = (uint8_t)next();
            len += 256;
        }
        l.in_len = len, l.in_pos = 0;
        eps_mqtt_init(&c, &io, rx, sizeof rx, on_message, NULL);
        c.stream = STREAM; /* half the messages handed over piece by piece */
        eps_mqtt_connect(&c, &o, 0.0);
        double t = 0;
        int replayed = 0, published = 0;
        for (int k = 0; k < 200; k++) {
            eps_mqtt_status st = eps_mqtt_poll(&c, t += 0.5);
            if (k == 3) eps_mqtt_subscribe(&c, "edge/#");
            if (k >= 1 && !published) published = eps_mqtt_publish(&c, "edge/grad", payload, sizeof payload, 1, 0) == 0;
            if (st == EPS_MQTT_LOST || st == EPS_MQTT_PROTOCOL || st == EPS_MQTT_REFUSED) {
                ok += st != EPS_MQTT_LOST;
                eps_mqtt_connect(&c, &o, t); /* the link again: the publish in flight goes again */
                if (replayed++) break;
                l.in_pos = 0; /* the broker's packets again, on the new link */
            }
        }
        dropped += c.dropped, resent += c.resent;
    }
    printf("fuzzed %lu streams: %d messages delivered, %lu too large for rx (acknowledged), %lu publishes sent "
           "again, %lu links dropped for a protocol error or refusal, %lu messages streamed, %lu streams cut\n",
           count, messages, dropped, resent, ok, streamed, stream_cuts);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "fuzz") == 0) return fuzz(strtoull(argv[2], NULL, 10), strtoul(argv[3], NULL, 10));
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: epsm HOST PORT CLIENT_ID [RX_BYTES] (commands on stdin) | epsm fuzz SEED COUNT\n");
        return 2;
    }
    static uint8_t rx[1 << 16], payload[1 << 20];
    static char topic[256], will_topic[256], will_text[256];
    for (size_t i = 0; i < sizeof payload; i++) payload[i] = (uint8_t)(i % 251);
    link_t l = {-1, -1, NULL, 0, 0};
    eps_mqtt_transport io = {&l, sock_send, sock_recv};
    eps_mqtt c;
    size_t rx_cap = argc == 5 ? strtoul(argv[4], NULL, 10) : sizeof rx;
    eps_mqtt_init(&c, &io, rx, rx_cap < sizeof rx ? rx_cap : sizeof rx, on_message, NULL);
    c.stream = STREAM;
    char line[1024];
    while (fgets(line, sizeof line, stdin) != NULL) {
        char cmd[32] = "";
        unsigned long size = 0, n = 0, cut_at = 0;
        int qos = 0, fields;
        double seconds = 0;
        eps_mqtt_status st = EPS_MQTT_OK;
        sscanf(line, "%31s", cmd);
        if (strcmp(cmd, "connect") == 0) {
            fields = sscanf(line, "%*s %255s %255s", will_topic, will_text);
            if (l.fd >= 0) close(l.fd);
            l.fd = open_socket(argv[1], atoi(argv[2]));
            l.cut_after = -1;
            eps_mqtt_options o = {argv[3], NULL, NULL, fields == 2 ? will_topic : NULL, (const uint8_t *)will_text,
                                  fields == 2 ? strlen(will_text) : 0, 1, 10, 0};
            if (l.fd < 0 || (st = eps_mqtt_connect(&c, &o, now_s())) != EPS_MQTT_OK ||
                (st = pump(&c, 10, connected)) != EPS_MQTT_OK || !c.connected)
                printf("error connect %d\n", (int)st);
            else
                printf("ok connected session_present=%d resent=%u\n", c.session_present, (unsigned)c.resent);
        } else if (sscanf(line, "sub %255s", topic) == 1) {
            st = eps_mqtt_subscribe(&c, topic);
            if (st == EPS_MQTT_OK) st = pump(&c, 5, flushed);
            printf("%s sub %d\n", st == EPS_MQTT_OK ? "ok" : "error", (int)st);
        } else if ((fields = sscanf(line, "pub %255s %lu %d %lu", topic, &size, &qos, &cut_at)) >= 3 &&
                   size <= sizeof payload) {
            st = eps_mqtt_publish(&c, topic, payload, size, qos, 0);
            if (st == EPS_MQTT_OK && fields == 4) {
                l.cut_after = (long)cut_at;
                pump(&c, 10, cut);
                close(l.fd);
                l.fd = -1;
                eps_mqtt_lost(&c);
                printf("ok cut in_flight=%d\n", eps_mqtt_sending(&c));
            } else {
                if (st == EPS_MQTT_OK) st = pump(&c, 10, acked);
                printf("%s pub %d acked=%d\n", st == EPS_MQTT_OK && !eps_mqtt_sending(&c) ? "ok" : "error", (int)st,
                       !eps_mqtt_sending(&c));
            }
        } else if (sscanf(line, "recv %lu %lf", &n, &seconds) == 2) {
            double until = now_s() + seconds;
            while (messages < (int)n && now_s() < until && (st = pump(&c, 0.05, NULL)) == EPS_MQTT_OK) {
            }
            st = pump(&c, 0.05, flushed); /* the PUBACKs out */
            printf("%s recv %d\n", messages >= (int)n ? "ok" : "error", messages);
            messages = 0;
        } else if (sscanf(line, "wait %lf", &seconds) == 1) {
            st = pump(&c, seconds, NULL);
            printf("%s wait %d\n", st == EPS_MQTT_OK ? "ok" : "error", (int)st);
        } else if (sscanf(line, "stream %255s", stream_prefix) == 1) {
            printf("ok stream\n");
        } else if (strcmp(cmd, "close") == 0) {
            close(l.fd);
            l.fd = -1;
            eps_mqtt_lost(&c);
            printf("ok closed\n");
        } else if (strcmp(cmd, "disconnect") == 0) {
            eps_mqtt_disconnect(&c);
            pump(&c, 2, flushed);
            close(l.fd);
            l.fd = -1;
            printf("ok disconnected\n");
        } else {
            printf("error unknown %s", line);
        }
        fflush(stdout);
    }
    if (l.fd >= 0) close(l.fd);
    return 0;
}
