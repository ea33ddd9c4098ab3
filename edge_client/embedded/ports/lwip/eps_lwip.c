/* The edgeps device on lwIP's MQTT client: see eps_lwip.h. */
#define _POSIX_C_SOURCE 200809L /* Debian's lwIP unix port reads POSIX headers (ssize_t, SSIZE_MAX) */
#include "eps_lwip.h"

#include <string.h>

#if MQTT_REQ_MAX_IN_FLIGHT < 8
#error "edgeps needs MQTT_REQ_MAX_IN_FLIGHT >= 8 in lwipopts.h: a device subscribes to five topics at once"
#endif

static int lwip_publish(void *ctx, const char *topic, const uint8_t *payload, size_t len, int retain) {
    eps_lwip *net = ctx;
    if (!net->connected || len > 0xFFFFu) return -1; /* lwIP's mqtt_publish takes a u16_t length */
    return mqtt_publish(net->client, topic, payload, (u16_t)len, 1, retain ? 1 : 0, NULL, NULL) == ERR_OK ? 0 : -1;
}

static int lwip_subscribe(void *ctx, const char *topic) {
    eps_lwip *net = ctx;
    return mqtt_subscribe(net->client, topic, 1, NULL, NULL) == ERR_OK ? 0 : -1;
}

static int lwip_unsubscribe(void *ctx, const char *topic) {
    eps_lwip *net = ctx;
    return mqtt_unsubscribe(net->client, topic, NULL, NULL) == ERR_OK ? 0 : -1;
}

/* A PUBLISH begins: its topic now, its payload in fragments (on_data). */
static void on_publish(void *arg, const char *topic, u32_t total) {
    eps_lwip *net = arg;
    size_t n = strlen(topic);
    net->inbound_len = 0;
    net->topic[0] = '\0';
    if (n < sizeof net->topic && total <= net->inbound_cap) memcpy(net->topic, topic, n + 1);
    else net->dropped++;
}

static void on_data(void *arg, const u8_t *data, u16_t len, u8_t flags) {
    eps_lwip *net = arg;
    if (net->topic[0] == '\0') return; /* a message too large for the buffer: dropped */
    if (len > net->inbound_cap - net->inbound_len) { /* more than announced: drop it */
        net->topic[0] = '\0';
        net->dropped++;
        return;
    }
    memcpy(net->inbound + net->inbound_len, data, len);
    net->inbound_len += len;
    if (flags & MQTT_DATA_FLAG_LAST) {
        eps_device_message(net->device, net->topic, net->inbound, net->inbound_len);
        net->topic[0] = '\0';
    }
}

static void on_connection(mqtt_client_t *client, void *arg, mqtt_connection_status_t status) {
    eps_lwip *net = arg;
    (void)client;
    net->connected = status == MQTT_CONNECT_ACCEPTED;
    if (net->connected) eps_device_connected(net->device); /* subscribes, says hello */
}

void eps_lwip_init(eps_lwip *net, eps_device *device, uint8_t *inbound, size_t inbound_cap) {
    memset(net, 0, sizeof *net);
    net->device = device;
    net->inbound = inbound;
    net->inbound_cap = inbound_cap;
}

void eps_lwip_port(eps_lwip *net, eps_port *port) {
    port->ctx = net;
    port->publish = lwip_publish;
    port->subscribe = lwip_subscribe;
    port->unsubscribe = lwip_unsubscribe;
}

err_t eps_lwip_connect(eps_lwip *net, const ip_addr_t *broker, u16_t port,
                       const struct mqtt_connect_client_info_t *client_info) {
    if (net->client == NULL && (net->client = mqtt_client_new()) == NULL) return ERR_MEM;
    mqtt_set_inpub_callback(net->client, on_publish, on_data, net);
    return mqtt_client_connect(net->client, broker, port, on_connection, net, client_info);
}
