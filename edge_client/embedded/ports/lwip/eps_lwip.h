/* The edgeps device on lwIP's MQTT client (lwip/apps/mqtt.h), the stack of many microcontroller
 * SDKs (STM32Cube, ESP-IDF's lwIP, NXP's MCUXpresso, Raspberry Pi Pico).
 *
 * lwipopts.h must give the MQTT client room for edgeps's messages:
 *   MQTT_OUTPUT_RINGBUF_SIZE > the commit frame (eps_device's frame_cap; about 20 KB for an
 *     MLP 64-64-10 in fp32): lwIP copies a whole PUBLISH into it;
 *   MQTT_REQ_MAX_IN_FLIGHT >= 8: a device subscribes to five topics at once;
 * and payloads are at most 65,535 bytes (mqtt_publish takes a u16_t length).
 * lwIP's client always asks for a clean session: after a reconnect the device gets the retained
 * messages (parameters, control, barrier) again, and repairs a missed delta from the snapshot
 * (PROTOCOL.md §6); QoS 1 messages sent while it was away are not kept for it.
 *
 * Usage (NO_SYS or one tcpip thread; every call below from that thread):
 *   eps_lwip_init(&net, &dev, inbound_buffer, sizeof inbound_buffer);
 *   eps_lwip_port(&net, &port);            // publish/subscribe/unsubscribe; set clock, entropy, sample,
 *                                          // and log (every problem the core meets, with its reason)
 *   eps_device_init(&dev, &port, job, device, samples, arena, sizeof arena, max_batch);
 *   eps_lwip_connect(&net, &broker_ip, 1883, &client_info);  // client_info's will: the offline status
 *   loop: sys_check_timeouts(); if (eps_device_ready(&dev)) eps_device_step(&dev);
 *         if (net.connected) eps_device_tick(&dev, port.clock(port.ctx));  // retries, resends
 * A publish lwIP refuses (its ring buffer full, no connection) is tried again by the tick.
 */
#ifndef EDGEPS_LWIP_H
#define EDGEPS_LWIP_H

#include "edgeps.h"
#include "lwip/apps/mqtt.h"

typedef struct {
    mqtt_client_t *client;
    eps_device *device;
    uint8_t *inbound;      /* one inbound message, reassembled from lwIP's fragments */
    size_t inbound_cap, inbound_len;
    char topic[EPS_TOPIC_MAX];
    int dropped;           /* inbound messages larger than inbound_cap (counted, not processed) */
    int connected;
} eps_lwip;

/* inbound must hold the largest message the device receives: the parameter frame (about 20 KB
 * for an MLP 64-64-10). */
void eps_lwip_init(eps_lwip *net, eps_device *device, uint8_t *inbound, size_t inbound_cap);

/* Fill the port's MQTT functions (publish, subscribe, unsubscribe) and its ctx; the integrator
 * sets clock, entropy and sample. */
void eps_lwip_port(eps_lwip *net, eps_port *port);

/* Connect (and, after a disconnection, connect again with the same arguments). */
err_t eps_lwip_connect(eps_lwip *net, const ip_addr_t *broker, u16_t port,
                       const struct mqtt_connect_client_info_t *client_info);

#endif /* EDGEPS_LWIP_H */
