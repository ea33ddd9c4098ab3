/* The device of docs/PROTOCOL.md §6 (edge_client/core.py in Python): parameters and control in,
 * local SGD steps, commit frames out, all through the port. Its memory is the eps_device struct
 * and the arena, laid out once the first parameter frame says what the model is. */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <string.h>

#include "edgeps.h"
#include "json.h"
#include "size.h"
#include "wire.h"

#define MAX_ID 9007199254740991u /* 2^53 - 1: ids and versions are JSON-safe */

#define SPEED_SAMPLES 3u     /* local steps timed before the first speed report */
#define STATUS_INTERVAL_S 1.0 /* speed reports at most this often (in timed seconds) */
#define SAFE_INT 9007199254740991u

static int valid_name(const char *s) {
    size_t n = strlen(s);
    if (n < 1 || n > EPS_MAX_NAME) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int alnum = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
        if (!alnum && (i == 0 || (c != '_' && c != '.' && c != '-'))) return 0;
    }
    return 1;
}

/* ---- memory ---- */

static size_t largest_tensor(const eps_mlp *m) {
    size_t big = 0;
    for (uint32_t i = 0; i < m->layers; i++) {
        size_t w = eps_size_mul(m->sizes[i], m->sizes[i + 1]);
        big = w > big ? w : big;
    }
    return big;
}

/* One tensor record of n values: its fixed fields, and its payload in codec or in fp32 if that is
 * larger. SIZE_MAX if n does not fit the wire's 32-bit count. */
static size_t record_bytes(size_t n, eps_codec codec, int fp32_fits) {
    if (n > UINT32_MAX) return SIZE_MAX;
    size_t fp32 = fp32_fits ? eps_size_mul(4, n) : 0, coded = eps_codec_max_size(codec, (uint32_t)n);
    return eps_size_add(1 + EPS_MAX_NAME + 1 + 2 * 4 + 4, coded > fp32 ? coded : fp32);
}

/* A frame of the model in codec; with fp32_fits, in fp32 if that is larger (it is, but for top-k
 * keeping more than about four fifths of the values). */
static size_t model_frame_bytes(const eps_mlp *m, eps_codec codec, int fp32_fits) {
    size_t size = EPS_HEADER_BYTES + 1 + EPS_MAX_NAME + 2 + 4;
    for (uint32_t i = 0; i < m->layers; i++) {
        size = eps_size_add(size, record_bytes(eps_size_mul(m->sizes[i], m->sizes[i + 1]), codec, fp32_fits));
        size = eps_size_add(size, record_bytes(m->sizes[i + 1], codec, fp32_fits));
    }
    return size;
}

/* The commit frame: a set_codec to fp32 always fits; top-k commits are compact (one payload). */
static size_t frame_bytes(const eps_mlp *m, eps_codec codec) {
    size_t records = model_frame_bytes(m, codec, 1), p = eps_mlp_params(m);
    if (codec.id != EPS_TOPK || p > UINT32_MAX) return records;
    size_t compact = eps_size_add(EPS_HEADER_BYTES + 1 + EPS_MAX_NAME + 2 + 4 + 4, /* + the varint's room */
                                  eps_topk_compact_max_size(codec.arg, (uint32_t)p));
    return compact > records ? compact : records;
}

size_t eps_device_receive_size(const eps_mlp *m, eps_codec pull_codec) {
    size_t delta = pull_codec.id == EPS_FP32 ? 0 : model_frame_bytes(m, pull_codec, 0);
    return delta > EPS_MESSAGE_MAX ? delta : EPS_MESSAGE_MAX;
}

/* Floats of the work area: a training step's scratch, or one decoded tensor (of a snapshot, a
 * delta, or a commit to compute its residual or carry it): never both at once. */
static size_t work_floats(const eps_mlp *m, uint32_t max_batch) {
    size_t scratch = eps_mlp_scratch(m, max_batch), tensor = largest_tensor(m);
    return scratch > tensor ? scratch : tensor;
}

/* local, anchor; the work area; a batch; the replica (the server's model: a snapshot lands in it
 * as its bytes arrive, and compressed pulls keep it as the base of the next delta, bit for bit);
 * the residual (biased commit codecs); the commit frame. SIZE_MAX when it does not fit size_t (a
 * frame's shapes are chosen by whoever sent it). */
static size_t layout_bytes(const eps_mlp *m, uint32_t max_batch, int residual, eps_codec codec) {
    size_t copies = 3 + (residual != 0);
    size_t floats = eps_size_mul(copies, eps_mlp_params(m));
    floats = eps_size_add(floats, work_floats(m, max_batch));
    floats = eps_size_mad(max_batch, m->sizes[0], floats);
    floats = eps_size_add(floats, max_batch); /* the batch's labels */
    return eps_size_add(eps_size_mul(floats, sizeof(float)), frame_bytes(m, codec));
}

size_t eps_device_arena_size(const eps_mlp *m, uint32_t max_batch, eps_codec codec) {
    return layout_bytes(m, max_batch, eps_codec_biased(codec), codec);
}

/* Lay the arena out for the model and the control in force; 0 if it does not fit. The regions
 * that every job has come first; a later set_codec may add the residual and grow the frame (the
 * newest commit's frame is then no longer kept: a refusal of it is not carried). */
static int lay_out(eps_device *d, const eps_mlp *m) {
    const eps_codec codec = d->control.codec; /* regions only ever come, so that none moves with its content */
    const int residual = eps_codec_biased(codec) || d->residual != NULL;
    if (layout_bytes(m, d->max_batch, residual, codec) > d->arena_size) return 0;
    size_t p = eps_mlp_params(m);
    float *f = (float *)(void *)d->arena;
    d->local = f, f += p;
    d->anchor = f, f += p;
    d->work = f, f += work_floats(m, d->max_batch);
    d->batch_x = f, f += (size_t)d->max_batch * m->sizes[0];
    d->replica = f, f += p;
    if (residual && d->residual == NULL) d->residual_held = 0; /* a residual region new to this job */
    d->residual = residual ? f : NULL, f += residual ? p : 0;
    d->batch_y = f;
    d->frame = (uint8_t *)(d->batch_y + d->max_batch);
    d->frame_cap = frame_bytes(m, codec);
    d->has_sent = 0;
    d->mlp = *m;
    d->has_model = 1;
    return 1;
}

/* ---- text without printf (a microcontroller's libc printf is large, and may lack 64-bit and
 * float formats) ---- */

typedef struct {
    char *p;
    size_t cap, len;
} writer;

static void put(writer *t, const char *s) {
    for (; *s; s++, t->len++)
        if (t->len + 1 < t->cap) t->p[t->len] = *s;
    if (t->cap) t->p[t->len < t->cap ? t->len : t->cap - 1] = '\0';
}

/* *v / d into *v, and the remainder (d below 2^63), by shifts and subtractions: a 32-bit part then
 * needs no 64-bit division routine (libgcc's, 750 bytes of flash on the Cortex-M4F). */
static uint64_t divide(uint64_t *v, uint64_t d) {
    uint64_t q = 0, r = 0;
    for (int bit = 63; bit >= 0; bit--) {
        r = r << 1 | (*v >> bit & 1u);
        q <<= 1;
        if (r >= d) r -= d, q |= 1u;
    }
    *v = q;
    return r;
}

static void put_uint(writer *t, uint64_t v) {
    char digits[24];
    size_t i = sizeof digits;
    digits[--i] = '\0';
    do digits[--i] = (char)('0' + divide(&v, 10)); while (v != 0);
    put(t, digits + i);
}

/* A non-negative number with six decimals (seconds to the microsecond). */
static void put_fixed6(writer *t, double v) {
    uint64_t micros = (uint64_t)(v * 1e6 + 0.5);
    uint32_t frac = (uint32_t)divide(&micros, 1000000);
    char six[8] = "000000";
    put_uint(t, micros);
    put(t, ".");
    for (int i = 5; i >= 0; i--, frac /= 10) six[i] = (char)('0' + frac % 10);
    put(t, six);
}

/* "dense{layer}.{kind}" into out. */
static void tensor_name(char out[24], uint32_t layer, char kind) {
    writer t = {out, 24, 0};
    char suffix[3] = {'.', kind, '\0'};
    put(&t, "dense");
    put_uint(&t, layer);
    put(&t, suffix);
}

/* ---- problems said out loud ---- */

/* The reason, from pieces of text up to a NULL; the status into d->error; the port's log hook. */
static eps_status say(eps_device *d, eps_status status, ...) {
    char text[EPS_REASON_MAX];
    writer t = {text, sizeof text, 0};
    va_list pieces;
    va_start(pieces, status);
    for (const char *piece; (piece = va_arg(pieces, const char *)) != NULL;) put(&t, piece);
    va_end(pieces);
    for (char *c = text; *c; c++) /* printable ASCII without quotes: it goes into the status's JSON as is */
        if (*c < ' ' || *c > '~' || *c == '"' || *c == '\\') *c = '?';
    memcpy(d->reason, text, sizeof text);
    if (status != EPS_OK) d->error = status;
    if (d->port.log != NULL) d->port.log(d->port.ctx, status, d->reason);
    return status;
}

/* A number as text for say(): n into out. */
static const char *num(char out[24], uint64_t n) {
    writer t = {out, 24, 0};
    put_uint(&t, n);
    return out;
}

static void publish_status(eps_device *d, const char *state);

/* The device cannot take part in the job as it stands: said in its status, which the server logs,
 * counts and shows (PROTOCOL.md §3, DeviceStatus.error). */
static eps_status unable(eps_device *d, eps_status status, int by_control) {
    int news = d->unable != status || strcmp(d->unable_reason, d->reason) != 0;
    d->unable = status;
    d->unable_by_control = by_control;
    memcpy(d->unable_reason, d->reason, sizeof d->reason); /* later problems do not change what it says */
    if (news) publish_status(d, "online");
    return status;
}

/* What made it unable (a Control, or a model) is gone: it can take part again. */
static void able(eps_device *d, int by_control) {
    if (d->unable == EPS_OK || by_control != d->unable_by_control) return;
    d->unable = EPS_OK;
    d->unable_reason[0] = '\0';
    publish_status(d, "online");
}

/* The port refused a publish or a subscription: try again from eps_device_tick. */
static void port_failed(eps_device *d, const char *what) {
    d->port_failures++;
    if (d->retry_at <= 0) {
        d->retry_s = d->retry_s > 0 ? d->retry_s : 1.0;
        d->retry_at = d->port.clock(d->port.ctx) + d->retry_s;
    }
    say(d, EPS_ERR_PORT, "the port refused to ", what, "; trying again", NULL);
}

/* ---- status and topics ---- */

size_t eps_device_status(const eps_device *d, const char *state, char *out, size_t cap) {
    writer t = {out, cap, 0};
    put(&t, "{\"device\":\"");
    put(&t, d->device);
    put(&t, "\",\"state\":\"");
    put(&t, state);
    put(&t, "\",\"incarnation\":");
    put_uint(&t, d->incarnation);
    put(&t, ",\"samples\":");
    put_uint(&t, d->samples);
    put(&t, ",\"backend\":\"");
    put(&t, d->backend);
    put(&t, "\",\"busy_s\":");
    put_fixed6(&t, d->busy_s > 0 ? d->busy_s : 0);
    put(&t, ",\"idle_s\":");
    put_fixed6(&t, d->idle_s > 0 ? d->idle_s : 0);
    put(&t, ",\"step_s\":");
    if (d->step_s > 0) put_fixed6(&t, d->step_s < 3600 ? d->step_s : 3600);
    else put(&t, "null");
    if (d->unable != EPS_OK) { /* the reason is ASCII without quotes or backslashes: see say() callers */
        put(&t, ",\"error\":\"");
        put(&t, d->unable_reason);
        put(&t, "\"");
    }
    put(&t, "}");
    return t.len < cap ? t.len : 0;
}

static void publish_status(eps_device *d, const char *state) {
    char body[320 + EPS_REASON_MAX];
    size_t n = eps_device_status(d, state, body, sizeof body);
    d->status_pending = 0;
    if (n && d->port.publish(d->port.ctx, d->t_status, (const uint8_t *)body, n, 1) != 0) {
        d->status_pending = strcmp(state, "online") == 0; /* an offline one is the will's to say */
        port_failed(d, "publish the status");
    }
}

static void subscribe(eps_device *d, const char *topic, int on) {
    if ((on ? d->port.subscribe : d->port.unsubscribe)(d->port.ctx, topic) != 0) {
        d->subscriptions_pending = 1;
        port_failed(d, on ? "subscribe" : "unsubscribe");
    }
}

/* Subscribe to params while a snapshot is needed: fp32 pulls, no version yet, or a gap. */
static void sync_subscriptions(eps_device *d) {
    int deltas = d->has_control && d->control.pull_codec.id != EPS_FP32;
    int want = !deltas || d->server_version < 0 || d->gap;
    if (d->resync) { /* a new run: its newest version is the retained snapshot */
        d->resync = 0;
        subscribe(d, d->t_params, 1);
        d->params_subscribed = 1;
    } else if (want != d->params_subscribed) {
        subscribe(d, d->t_params, want);
        d->params_subscribed = want;
    }
}

eps_status eps_device_init(eps_device *d, const eps_port *port, const char *job, const char *device, uint32_t samples,
                           void *arena, size_t arena_size, uint32_t max_batch) {
    memset(d, 0, sizeof *d);
    if (!valid_name(job) || !valid_name(device) || samples == 0 || max_batch == 0) return EPS_ERR_NAME;
    d->port = *port;
    strcpy(d->device, device);
    struct {
        char *topic;
        const char *kind, *who;
    } topics[] = {{d->t_status, "/status/", device}, {d->t_grad, "/grad/", device}, {d->t_ctrl, "/ctrl/", device},
                  {d->t_notice, "/notice/", device},  {d->t_params, "/params", ""},   {d->t_delta, "/delta", ""},
                  {d->t_barrier, "/barrier", ""}};
    for (size_t i = 0; i < sizeof topics / sizeof topics[0]; i++) {
        writer t = {topics[i].topic, EPS_TOPIC_MAX, 0};
        put(&t, "edgeps/");
        put(&t, job);
        put(&t, topics[i].kind);
        put(&t, topics[i].who);
    }
    d->samples = samples;
    d->arena = arena;
    d->arena_size = arena_size;
    d->max_batch = max_batch;
    d->rng = port->entropy(port->ctx) | 1u;
    uint64_t drawn = port->entropy(port->ctx);
    d->incarnation = 1 + divide(&drawn, SAFE_INT);
    d->server_version = -1;
    d->committed_on = -1;
    d->resend_s = EPS_RESEND_S;
    strcpy(d->backend, "c");
    return EPS_OK;
}

static void subscribe_all(eps_device *d) {
    const char *topics[] = {d->t_delta, d->t_ctrl, d->t_barrier, d->t_notice};
    d->subscriptions_pending = 0;
    for (size_t i = 0; i < sizeof topics / sizeof topics[0]; i++) subscribe(d, topics[i], 1);
    d->params_subscribed = 0;
    d->resync = 0;
    sync_subscriptions(d);
}

void eps_device_connected(eps_device *d) {
    subscribe_all(d);
    publish_status(d, "online");
}

void eps_device_leave(eps_device *d) { publish_status(d, "offline"); }

/* ---- replica and adoption ---- */

static void forget(eps_device *d) {
    d->server_version = -1;
    d->has_replica = d->has_local = d->has_sent = 0;
    d->steps = d->step_samples = d->since_commit = 0;
    d->waiting = 0;
    d->committed_on = -1;
    d->residual_held = 0;
    d->resync = 1;
}

/* Train on the replica of version from now on, keeping uncommitted progress (local - anchor). */
static void adopt(eps_device *d, int64_t version) {
    size_t p = eps_mlp_params(&d->mlp);
    d->server_version = version;
    if (!d->has_local || d->waiting) memcpy(d->local, d->replica, p * sizeof(float));
    else
        for (size_t i = 0; i < p; i++) d->local[i] = d->replica[i] + (d->local[i] - d->anchor[i]);
    memcpy(d->anchor, d->replica, p * sizeof(float));
    d->has_local = 1;
    d->waiting = 0;
}

/* Where a tensor of the model lives in the parameter arrays (*at), which of the model's tensors it
 * is (*slot: 2i for dense{i}.w, 2i + 1 for .b), and whether its shape is the model's. */
static int place(const eps_device *d, const eps_tensor *t, size_t *at, uint32_t *slot) {
    for (uint32_t i = 0; i < d->mlp.layers; i++) {
        char name[24];
        uint32_t in = d->mlp.sizes[i], out = d->mlp.sizes[i + 1];
        tensor_name(name, i, 'w');
        if (strcmp(name, t->name) == 0) {
            *at = eps_mlp_weight_at(&d->mlp, i);
            *slot = 2 * i;
            return t->ndim == 2 && t->dims[0] == in && t->dims[1] == out;
        }
        name[strlen(name) - 1] = 'b';
        if (strcmp(name, t->name) == 0) {
            *at = eps_mlp_bias_at(&d->mlp, i);
            *slot = 2 * i + 1;
            return t->ndim == 1 && t->dims[0] == out;
        }
    }
    return 0;
}

/* ---- parameter snapshots, read as their bytes arrive (docs/EMBEDDED.md, "Receiving") ----
 *
 * A snapshot of the model this device holds lands straight in the replica: each fp32 tensor's
 * payload is read into its place there, the CRC-32 computed as the bytes pass. The replica counts
 * as invalid from the first byte placed until the CRC matched; only then is it adopted (the local
 * model, the anchor and the residual are untouched before). A snapshot of another model (the first
 * one, or a new run's) is read for its shape only: the arena is laid out for it, and the snapshot
 * is read again (the retained one, by subscribing to params anew; a whole message, at once). */

enum { IN_IDLE, IN_SKIP, IN_READ };

static int little_endian(void) {
    const uint16_t one = 1;
    return *(const uint8_t *)&one == 1;
}

/* The header is in: whether this snapshot is for us. */
static void params_header(eps_device *d) {
    const eps_frame *f = &d->in.head;
    d->in_mode = IN_SKIP;
    if (f->kind == EPS_COMMIT) d->in_status = say(d, EPS_ERR_KIND, "a commit frame where parameters go", NULL);
    else if (f->kind != EPS_PARAMS) return; /* a delta on params: not ours */
    else if (f->base_version > MAX_ID || f->seq > MAX_ID) /* versions and runs are JSON-safe ids */
        d->in_status = say(d, EPS_ERR_FIELD, "parameters: version or run beyond 2^53 - 1", NULL);
    else if (!d->has_control) d->params_ignored = 1; /* the layout needs the Control: read it again after it */
    else if (f->seq != d->run) return;                /* a snapshot of another run */
    else if (d->has_replica && f->seq == d->replica_run && (int64_t)f->base_version <= d->server_version) return;
    else d->in_mode = IN_READ;
}

/* A record is in: its payload goes to its place in the replica if it is the model's, in fp32. */
static void params_tensor(eps_device *d) {
    const eps_tensor *t = &d->in.tensor;
    size_t at;
    uint32_t slot;
    eps_mlp_shape_add(&d->in_shape, t);
    if (d->in_mode != IN_READ || !d->has_model || d->in.head.codec.id != EPS_FP32 || !place(d, t, &at, &slot) ||
        t->length != 4 * t->elements || (d->in_placed >> slot & 1u))
        return; /* read past: the frame is judged once it is all in */
    d->in.dest = (uint8_t *)(void *)(d->replica + at);
    d->in_ordered &= d->in_placed == (1u << slot) - 1u; /* dense0.w, dense0.b, dense1.w, ...: the arena's order */
    d->in_placed |= 1u << slot;
    d->has_replica = 0; /* being overwritten: whole again once the CRC matched */
}

/* The frame is all in (complete), or the link broke first. */
static eps_status params_end(eps_device *d, int complete) {
    eps_mlp shape;
    const eps_frame *f = &d->in.head;
    int mode = d->in_mode, placed = d->in_placed != 0;
    d->in_mode = IN_IDLE;
    if (!complete) return EPS_OK; /* the broker sends it again (QoS 1, not acknowledged) */
    if (!d->in.done) {
        eps_status st = d->in.error != EPS_OK ? d->in.error : EPS_ERR_SHORT;
        if (placed) d->resync = 1; /* the replica is no longer whole: the retained snapshot again */
        return say(d, st, "parameters: ", eps_status_name(st), NULL);
    }
    if (mode != IN_READ) return d->in_status;
    if (eps_mlp_shape_end(&d->in_shape, &shape) != EPS_OK) {
        say(d, EPS_ERR_MODEL, "the job's model is not an MLP the C trainer computes (dense{i}.w and .b of matching "
            "shapes; first tensor ", d->in_shape.first, ")", NULL);
        return unable(d, EPS_ERR_MODEL, 0);
    }
    if (!d->has_model || memcmp(&shape, &d->mlp, sizeof shape) != 0) { /* a new model: nothing carries over */
        d->has_model = d->has_replica = d->has_local = d->unpublished = 0;
        d->residual = NULL;
        d->residual_held = 0;
        if (!lay_out(d, &shape)) {
            size_t need = layout_bytes(&shape, d->max_batch, eps_codec_biased(d->control.codec), d->control.codec);
            char a[24], b[24];
            if (need == SIZE_MAX) say(d, EPS_ERR_SPACE, "the job's model is larger than this device's memory", NULL);
            else say(d, EPS_ERR_SPACE, "the job's model needs an arena of ", num(a, need), " bytes; this device has ",
                     num(b, d->arena_size), NULL);
            return unable(d, EPS_ERR_SPACE, 0);
        }
        d->in_again = 1; /* laid out: now the snapshot can land in place */
        return EPS_OK;
    }
    if (d->in_placed != (1u << (2 * d->mlp.layers)) - 1u) { /* a tensor not in fp32, or not of its shape's size */
        if (placed) d->resync = 1;
        return say(d, EPS_ERR_PAYLOAD, "parameters: a tensor not in fp32 or not of its shape's length", NULL);
    }
    if (!little_endian()) { /* the wire's float32 is little-endian */
        uint8_t *b = (uint8_t *)(void *)d->replica;
        for (size_t i = 0, p = eps_mlp_params(&d->mlp); i < p; i++) d->replica[i] = eps_get_f32(b + 4 * i);
    }
    d->has_replica = 1;
    d->ordered = d->in_ordered;
    d->replica_run = f->seq;
    d->gap = 0;
    adopt(d, (int64_t)f->base_version);
    able(d, 0);
    return EPS_OK;
}

int eps_device_stream_begin(eps_device *d, const char *topic, size_t len) {
    if (strcmp(topic, d->t_params) != 0) return 0;
    eps_frame_stream_begin(&d->in, len, 0); /* a new run may bring a bigger model: the layout decides */
    eps_mlp_shape_begin(&d->in_shape);
    d->in_placed = 0;
    d->in_ordered = 1;
    d->in_status = EPS_OK;
    d->in_again = 0;
    d->in_mode = IN_READ;
    return 1;
}

uint8_t *eps_device_stream_room(eps_device *d, size_t *cap) { return eps_frame_stream_room(&d->in, cap); }

void eps_device_stream_wrote(eps_device *d, size_t n) {
    eps_stream_event event = eps_frame_stream_wrote(&d->in, n);
    if (event == EPS_STREAM_HEADER) params_header(d);
    else if (event == EPS_STREAM_TENSOR) params_tensor(d);
}

eps_status eps_device_stream_end(eps_device *d, int complete) {
    eps_status st = params_end(d, complete);
    if (d->in_again) { /* the retained snapshot, again: it now lands in place */
        d->in_again = 0;
        d->resync = 1;
    }
    sync_subscriptions(d);
    return st;
}

/* A whole snapshot in memory: checked whole first (nothing is placed from a frame that fails),
 * then read as if it arrived piece by piece; twice for a new model. */
static eps_status on_params(eps_device *d, const uint8_t *payload, size_t len) {
    eps_frame f;
    eps_status st = eps_frame_parse(payload, len, 0, &f);
    if (st != EPS_OK) return say(d, st, "parameters: ", eps_status_name(st), NULL);
    for (int pass = 0; pass < 2; pass++) {
        eps_device_stream_begin(d, d->t_params, len);
        for (size_t got = 0; got < len;) {
            size_t cap;
            uint8_t *at = eps_device_stream_room(d, &cap);
            size_t n = cap < len - got ? cap : len - got;
            memcpy(at, payload + got, n);
            eps_device_stream_wrote(d, n);
            got += n;
        }
        st = params_end(d, 1);
        if (!d->in_again) break;
        d->in_again = 0;
    }
    return st;
}

static eps_status on_delta(eps_device *d, const eps_frame *f) {
    eps_tensor t;
    size_t cursor = 0, at;
    uint32_t slot;
    eps_status st;
    if ((int64_t)f->base_version <= d->server_version) return EPS_OK;
    if (d->control.pull_codec.id == EPS_FP32) return EPS_OK; /* fp32 pulls: deltas are not for us */
    if ((int64_t)f->seq != d->server_version || !d->has_replica || !d->has_run || d->replica_run != d->run) {
        d->gap = 1; /* resubscribe to params; unsubscribe once its snapshot repaired the gap */
        return EPS_OK;
    }
    if (f->count != 2 * d->mlp.layers) return say(d, EPS_ERR_NAME, "delta: not the model's tensors", NULL);
    while (eps_frame_next(f, &cursor, &t)) {
        if (!place(d, &t, &at, &slot)) {
            d->gap = 1;
            return say(d, EPS_ERR_NAME, "delta: tensor ", t.name, " is not the model's", NULL);
        }
        if ((st = eps_codec_decode(f->codec, t.payload, t.length, (uint32_t)t.elements, d->work)) != EPS_OK) {
            d->gap = 1;
            d->has_replica = 0;
            return say(d, st, "delta: tensor ", t.name, " does not decode", NULL);
        }
        for (uint64_t i = 0; i < t.elements; i++) d->replica[at + i] += d->work[i]; /* float32, as the server */
    }
    adopt(d, (int64_t)f->base_version);
    return EPS_OK;
}

/* ---- JSON messages: every field range-checked before it is used, the message refused whole ---- */

/* A field of message out of its rule: the message is refused whole. Returns 0. */
static int refuse_field(eps_device *d, const char *message, const char *key, const char *rule) {
    say(d, EPS_ERR_FIELD, message, ": ", key, " ", rule, NULL);
    return 0;
}

/* An integer field in lo .. hi (digits only), or the message's refusal. */
static int field_uint(eps_device *d, const char *message, const eps_json_value *v, const char *key, uint64_t lo,
                      uint64_t hi, uint64_t *out) {
    char a[24], b[24];
    if (eps_json_uint(v, out) && *out >= lo && *out <= hi) return 1;
    say(d, EPS_ERR_FIELD, message, ": ", key, " not an integer in ", num(a, lo), "..", num(b, hi), NULL);
    return 0;
}

/* A string field: ASCII, no escapes, shorter than cap (see eps_json_string). */
static int field_string(eps_device *d, const char *message, const eps_json_value *v, const char *key, char *out,
                        size_t cap) {
    return eps_json_string(v, out, cap) || refuse_field(d, message, key, "not a short plain string");
}


static eps_status on_control(eps_device *d, const char *text, size_t len) {
    static const char *const M = "Control";
    eps_json j;
    eps_json_value v;
    eps_control c = {0};
    char device[EPS_MAX_NAME + 1] = "", spec[32] = "", loss[32] = "";
    uint64_t u = 0;
    double x = 0;
    int r, b = 0, seen = 0, ok = 1, has_loss = 0;
    c.codec.id = c.pull_codec.id = EPS_FP32;
    c.staleness_bound = -1;
    if (!eps_json_begin(&j, text, len)) return say(d, EPS_ERR_FIELD, "Control: not a JSON object", NULL);
    while (ok && (r = eps_json_member(&j, &v)) == 1) {
        if (eps_json_is(&v, "device")) ok = field_string(d, M, &v, "device", device, sizeof device), seen |= 1;
        else if (eps_json_is(&v, "run")) ok = field_uint(d, M, &v, "run", 1, MAX_ID, &u), c.run = u, seen |= 2;
        else if (eps_json_is(&v, "incarnation"))
            ok = field_uint(d, M, &v, "incarnation", 1, MAX_ID, &u), c.incarnation = u, seen |= 4;
        else if (eps_json_is(&v, "seq_base")) ok = field_uint(d, M, &v, "seq_base", 0, MAX_ID, &u), c.seq_base = u;
        else if (eps_json_is(&v, "max_uncommitted_steps"))
            ok = field_uint(d, M, &v, "max_uncommitted_steps", 1, 10000000, &u), c.max_uncommitted_steps = (uint32_t)u;
        else if (eps_json_is(&v, "push_every"))
            ok = field_uint(d, M, &v, "push_every", 1, 100000, &u), c.push_every = (uint32_t)u, seen |= 8;
        else if (eps_json_is(&v, "batch_size"))
            ok = field_uint(d, M, &v, "batch_size", 1, 65536, &u), c.batch_size = (uint32_t)u, seen |= 16;
        else if (eps_json_is(&v, "lr")) {
            ok = (eps_json_number(&v, &x) && x > 0 && x <= 100) || refuse_field(d, M, "lr", "not a number in (0, 100]");
            c.lr = ok ? (float)x : 0.0f, seen |= 32;
        } else if (eps_json_is(&v, "loss")) ok = field_string(d, M, &v, "loss", loss, sizeof loss), has_loss = 1;
        else if (eps_json_is(&v, "codec") || eps_json_is(&v, "pull_codec")) {
            int commit = eps_json_is(&v, "codec");
            ok = field_string(d, M, &v, commit ? "codec" : "pull_codec", spec, sizeof spec);
            if (ok && eps_codec_parse(spec, commit ? &c.codec : &c.pull_codec) != EPS_OK) {
                say(d, EPS_ERR_CODEC, "Control: codec ", spec, " is not one this device implements", NULL);
                return unable(d, EPS_ERR_CODEC, 1);
            }
        } else if (eps_json_is(&v, "wait_for_params") || eps_json_is(&v, "one_commit_per_version")) {
            int wait = eps_json_is(&v, "wait_for_params");
            ok = eps_json_bool(&v, &b) || refuse_field(d, M, wait ? "wait_for_params" : "one_commit_per_version",
                                                       "not true or false");
            if (wait) c.wait_for_params = b;
            else c.one_commit_per_version = b;
        } else if (eps_json_is(&v, "staleness_bound")) {
            if (v.type == EPS_JSON_NULL) c.staleness_bound = -1;
            else ok = field_uint(d, M, &v, "staleness_bound", 0, MAX_ID, &u), c.staleness_bound = (int64_t)u;
        }
    } /* any other field, of any type, is a newer server's: ignored */
    if (!ok) return EPS_ERR_FIELD;
    if (r < 0) return say(d, EPS_ERR_FIELD, "Control: not valid JSON", NULL);
    if (seen != 63) return say(d, EPS_ERR_FIELD, "Control: lacks one of device, run, incarnation, push_every, batch_size, lr", NULL);
    if (strcmp(device, d->device) != 0 || c.incarnation != d->incarnation) return EPS_OK; /* an earlier boot's */
    c.loss = EPS_LOSS_CROSS_ENTROPY; /* a 1.1 server's */
    if (has_loss && !eps_loss_from_name(loss, strlen(loss), &c.loss)) {
        say(d, EPS_ERR_MODEL, "the job's loss ", loss, " is not one the C trainer computes (cross_entropy, bce, mse, mae)", NULL);
        return unable(d, EPS_ERR_MODEL, 1);
    }
    if (c.max_uncommitted_steps == 0) c.max_uncommitted_steps = 8 * c.push_every; /* absent: the reference's */
    if (d->has_run && c.run != d->run) forget(d); /* a new run of the job: start from its parameters */
    if (d->has_replica && d->replica_run != c.run) forget(d);
    int relayout = d->has_model && ((eps_codec_biased(c.codec) && d->residual == NULL) ||
                                    frame_bytes(&d->mlp, c.codec) > d->frame_cap);
    d->run = c.run;
    d->has_run = 1;
    d->seq = c.seq_base > d->seq ? c.seq_base : d->seq;
    d->control = c;
    d->has_control = 1;
    able(d, 1);
    if (relayout) { /* a codec that needs another layout (set_codec): the model stays where it is */
        eps_mlp shape = d->mlp;
        d->unpublished = 0;
        if (!lay_out(d, &shape)) {
            d->has_model = d->has_replica = d->has_local = 0;
            say(d, EPS_ERR_SPACE, "the job's codecs need a larger arena than this device has", NULL);
            return unable(d, EPS_ERR_SPACE, 1);
        }
    }
    if (d->params_ignored) { /* a snapshot came before this Control: read it again */
        d->params_ignored = 0;
        d->resync = 1;
    }
    return EPS_OK;
}

static eps_status on_barrier(eps_device *d, const char *text, size_t len) {
    static const char *const M = "Barrier";
    eps_json j;
    eps_json_value v;
    uint64_t run = 0, slowest = 0;
    char state[16] = "";
    int r, ok = 1;
    if (!eps_json_begin(&j, text, len)) return say(d, EPS_ERR_FIELD, "Barrier: not a JSON object", NULL);
    while (ok && (r = eps_json_member(&j, &v)) == 1) {
        if (eps_json_is(&v, "run")) ok = field_uint(d, M, &v, "run", 1, MAX_ID, &run);
        else if (eps_json_is(&v, "slowest_clock")) ok = field_uint(d, M, &v, "slowest_clock", 0, MAX_ID, &slowest);
        else if (eps_json_is(&v, "state")) ok = field_string(d, M, &v, "state", state, sizeof state);
    }
    if (!ok) return EPS_ERR_FIELD;
    if (r < 0) return say(d, EPS_ERR_FIELD, "Barrier: not valid JSON", NULL);
    if (!d->has_run || run != d->run) return EPS_OK; /* another run's barrier says nothing about ours */
    d->slowest_clock = slowest;
    if (strcmp(state, "finished") == 0) d->finished = 1;
    return EPS_OK;
}

static eps_status on_notice(eps_device *d, const char *text, size_t len) {
    static const char *const carried[] = {"rate_limited", "unknown_device", "replayed", "out_of_order"};
    eps_json j;
    eps_json_value v;
    uint64_t seq = 0;
    int has_seq = 0, r, ok = 1;
    char reason[32] = "";
    if (!eps_json_begin(&j, text, len)) return say(d, EPS_ERR_FIELD, "Notice: not a JSON object", NULL);
    while (ok && (r = eps_json_member(&j, &v)) == 1) {
        if (eps_json_is(&v, "seq") && v.type != EPS_JSON_NULL) ok = has_seq = field_uint(d, "Notice", &v, "seq", 0, MAX_ID, &seq);
        else if (eps_json_is(&v, "reason")) ok = field_string(d, "Notice", &v, "reason", reason, sizeof reason);
    }
    if (!ok) return EPS_ERR_FIELD;
    if (r < 0) return say(d, EPS_ERR_FIELD, "Notice: not valid JSON", NULL);
    if (strcmp(reason, "evicted") == 0) {
        d->finished = 1;
        return say(d, EPS_OK, "evicted from the job by an operator", NULL);
    }
    if (!d->has_sent || !has_seq || seq != d->sent_seq) return EPS_OK; /* not about our newest commit */
    if (strcmp(reason, "finished") == 0) { /* one about another commit was queued for an earlier run */
        d->finished = 1;
        return EPS_OK;
    }
    char a[24];
    say(d, EPS_OK, "commit ", num(a, seq), " refused: ", reason, NULL);
    d->has_sent = 0;
    d->waiting = 0; /* a refused commit releases the device */
    if (d->committed_on == d->sent_base) d->committed_on = -1;
    for (size_t i = 0; i < sizeof carried / sizeof carried[0]; i++) {
        eps_frame f;
        eps_tensor t;
        size_t cursor = 0, at;
        uint32_t slot;
        if (strcmp(reason, carried[i]) != 0 || !d->has_local || d->sent_base > d->server_version) continue;
        if (eps_frame_parse(d->frame, d->frame_len, 0, &f) != EPS_OK) return EPS_OK;
        if (f.compact) /* what the server would have added goes into the next commit */
            (void)eps_topk_compact_add(f.codec.arg, f.records, f.records_len, (uint32_t)eps_mlp_params(&d->mlp), -1.0f,
                                       d->anchor);
        while (eps_frame_next(&f, &cursor, &t)) /* what the server would have added goes into the next commit */
            if (place(d, &t, &at, &slot) && eps_codec_decode(f.codec, t.payload, t.length, (uint32_t)t.elements,
                                                      d->work) == EPS_OK)
                for (uint64_t k = 0; k < t.elements; k++) d->anchor[at + k] -= d->work[k];
        d->steps += d->sent_steps;
        d->step_samples += d->sent_samples;
    }
    return EPS_OK;
}

eps_status eps_device_message(eps_device *d, const char *topic, const uint8_t *payload, size_t len) {
    eps_status st = EPS_OK;
    if (payload == NULL) { /* too large for the port's receive buffer: read past */
        if (strcmp(topic, d->t_delta) == 0) d->gap = 1; /* a version missed: the snapshot repairs it */
        st = say(d, EPS_ERR_SPACE, "a message larger than the receive buffer on ", topic, NULL);
    } else if (strcmp(topic, d->t_params) == 0) {
        st = on_params(d, payload, len);
    } else if (strcmp(topic, d->t_delta) == 0) {
        eps_frame f;
        /* a delta declares no more values than the model has */
        if ((st = eps_frame_parse(payload, len, d->has_model ? eps_mlp_params(&d->mlp) : 0, &f)) != EPS_OK)
            st = say(d, st, "delta: ", eps_status_name(st), NULL);
        else if (f.base_version > MAX_ID || f.seq > MAX_ID) /* versions and runs are JSON-safe ids */
            st = say(d, EPS_ERR_FIELD, "delta: version or run beyond 2^53 - 1", NULL);
        else if (f.kind == EPS_DELTA && d->has_model) st = on_delta(d, &f);
        else if (f.kind == EPS_COMMIT) st = say(d, EPS_ERR_KIND, "a commit frame where parameters go", NULL);
    } else if (len > 0 && strcmp(topic, d->t_ctrl) == 0) st = on_control(d, (const char *)payload, len);
    else if (len > 0 && strcmp(topic, d->t_barrier) == 0) st = on_barrier(d, (const char *)payload, len);
    else if (strcmp(topic, d->t_notice) == 0) st = on_notice(d, (const char *)payload, len);
    sync_subscriptions(d);
    return st;
}

/* ---- training ---- */

static int holding(const eps_device *d) {
    return d->control.one_commit_per_version && d->committed_on == d->server_version;
}

static int blocked(const eps_device *d) {
    return d->control.staleness_bound >= 0 && (int64_t)(d->seq - d->slowest_clock) > d->control.staleness_bound;
}

/* A commit is due; not while one the port refused is still to go, nor while the transport still
 * reads the last one's bytes (its frame would be overwritten). */
static int commit_due(const eps_device *d) {
    return d->since_commit >= d->control.push_every && !holding(d) && !d->unpublished &&
           !(d->port.sending != NULL && d->port.sending(d->port.ctx));
}

int eps_device_ready(const eps_device *d) {
    if (!d->has_control || !d->has_model || !d->has_local || !d->has_replica || d->replica_run != d->run ||
        d->waiting || d->finished || d->unable != EPS_OK || blocked(d))
        return 0;
    return d->since_commit < d->control.max_uncommitted_steps || commit_due(d);
}

static int train(eps_device *d) {
    uint32_t batch = d->control.batch_size < d->samples ? d->control.batch_size : d->samples;
    batch = batch < d->max_batch ? batch : d->max_batch;
    uint32_t features = d->mlp.sizes[0];
    for (uint32_t b = 0; b < batch; b++) {
        d->rng ^= d->rng << 13, d->rng ^= d->rng >> 7, d->rng ^= d->rng << 17;
        uint64_t draw = d->rng;
        uint32_t index = (uint32_t)divide(&draw, d->samples);
        if (!d->port.sample(d->port.ctx, index, d->batch_x + (size_t)b * features, d->batch_y + b)) return 0;
    }
    float loss =
        eps_mlp_step(&d->mlp, d->local, d->batch_x, d->batch_y, batch, d->control.lr, d->control.loss, d->work);
    if (loss < 0) { /* a label beyond the model's classes, or outputs the loss does not take */
        say(d, EPS_ERR_VALUE, "this device's labels or the model's outputs do not fit the job's loss", NULL);
        unable(d, EPS_ERR_VALUE, 0);
        return 0;
    }
    if (!(loss <= FLT_MAX)) { /* NaN or infinite: every commit from here on would be refused as non_finite */
        d->diverged = d->finished = 1;
        say(d, EPS_ERR_VALUE, "the local loss is not finite (the job's lr is too high for this data): stopping", NULL);
        return 0;
    }
    d->last_loss = loss;
    d->steps++;
    d->since_commit++;
    d->step_samples += batch;
    return 1;
}

/* The smoothed step time; the online status again with step_s after SPEED_SAMPLES steps and when
 * it drifts by a quarter (at most once per STATUS_INTERVAL_S of timed steps). */
static void timed(eps_device *d, double seconds) {
    if (!(seconds > 0)) return;
    d->timed_steps++;
    d->untimed_s += seconds;
    d->mean_step_s = d->timed_steps == 1 ? (float)seconds : 0.8f * d->mean_step_s + 0.2f * (float)seconds;
    if (d->timed_steps < SPEED_SAMPLES) return;
    if (d->step_s > 0 && fabsf(d->mean_step_s - d->step_s) <= 0.25f * d->step_s) return;
    if (d->step_s > 0 && d->untimed_s < STATUS_INTERVAL_S) return;
    d->step_s = d->mean_step_s > 1e-6f ? d->mean_step_s : 1e-6f;
    d->untimed_s = 0;
    publish_status(d, "online");
}

/* Hand the commit in the arena to the port; only once it took it is the commit sent (§6). */
static void deliver(eps_device *d) {
    if (d->port.publish(d->port.ctx, d->t_grad, d->frame, d->frame_len, 0) != 0) {
        d->unpublished = 1;
        port_failed(d, "publish a commit");
        return;
    }
    d->unpublished = 0;
    d->has_sent = 1;
    d->sent_seq = d->pending_seq;
    d->sent_base = d->pending_base;
    d->sent_steps = d->pending_steps;
    d->sent_samples = d->pending_samples;
    d->committed_on = d->pending_base;
    d->waiting = d->control.wait_for_params && d->pending_base == d->server_version;
    d->progress_at = d->port.clock(d->port.ctx); /* the resend clock starts with the commit */
    d->progress_seq = d->seq;
    d->progress_version = d->server_version;
}

static void commit(eps_device *d) {
    static const char kinds[] = {'w', 'b'};
    const eps_codec codec = d->control.codec;
    const int biased = eps_codec_biased(codec);
    size_t p = eps_mlp_params(&d->mlp), len = 0;
    eps_writer w;
    eps_status st;
    d->seq++;
    for (size_t i = 0; i < p; i++) { /* t = local - anchor (+ the residual), in anchor's place */
        float t = d->local[i] - d->anchor[i];
        d->anchor[i] = d->residual_held ? t + d->residual[i] : t;
    }
    eps_writer_begin(&w, d->frame, d->frame_cap, EPS_COMMIT, codec, (uint64_t)d->server_version, d->seq,
                     d->step_samples, d->steps, d->device);
    const int compact = codec.id == EPS_TOPK && d->ordered; /* the model's order is the arena's */
    if (compact) { /* a compact commit: the model's values in one payload (protocol 1.9) */
        const uint8_t *payload = NULL;
        size_t length = 0;
        eps_writer_compact_topk(&w, (uint16_t)(2 * d->mlp.layers), d->anchor, (uint32_t)p, &payload, &length);
        if (w.error == EPS_OK) { /* what the server adds is decode(encode(t)); the rest waits for the next commit */
            memcpy(d->residual, d->anchor, p * sizeof(float));
            if (eps_topk_compact_add(codec.arg, payload, length, (uint32_t)p, -1.0f, d->residual) != EPS_OK)
                w.error = EPS_ERR_VALUE;
        }
    }
    for (uint32_t layer = 0; layer < d->mlp.layers && !compact; layer++)
        for (int k = 0; k < 2; k++) {
            char name[24];
            uint32_t dims[2] = {d->mlp.sizes[layer], d->mlp.sizes[layer + 1]};
            uint8_t ndim = k == 0 ? 2 : 1;
            size_t at = k == 0 ? eps_mlp_weight_at(&d->mlp, layer) : eps_mlp_bias_at(&d->mlp, layer);
            uint32_t n = k == 0 ? dims[0] * dims[1] : dims[1];
            if (k == 1) dims[0] = dims[1];
            tensor_name(name, layer, kinds[k]);
            size_t before = w.len + 1 + strlen(name) + 1 + 4u * ndim + 4; /* where the payload starts */
            eps_writer_tensor(&w, name, ndim, dims, d->anchor + at, &d->rng);
            if (!biased || w.error != EPS_OK) continue;
            /* what the server adds is decode(encode(t)); the rest waits for the next commit */
            if (eps_codec_decode(codec, w.buf + before, w.len - before, n, d->work) != EPS_OK) w.error = EPS_ERR_VALUE;
            for (uint32_t i = 0; i < n && w.error == EPS_OK; i++) d->residual[at + i] = d->anchor[at + i] - d->work[i];
        }
    d->residual_held = biased;
    memcpy(d->anchor, d->local, p * sizeof(float));
    if ((st = eps_writer_end(&w, &len)) != EPS_OK) {
        say(d, st, "a commit could not be encoded: ", eps_status_name(st), NULL);
        return;
    }
    d->frame_len = len;
    d->pending_seq = d->seq;
    d->pending_base = d->server_version;
    d->pending_steps = d->steps;
    d->pending_samples = d->step_samples;
    d->steps = d->step_samples = d->since_commit = 0;
    d->has_sent = 0; /* the frame in the arena is this commit from now on */
    deliver(d);
}

int eps_device_step(eps_device *d) {
    if (!eps_device_ready(d)) return 0;
    d->trained = 0;
    if (d->since_commit < d->control.max_uncommitted_steps) {
        double started = d->port.clock(d->port.ctx);
        d->trained = train(d);
        if (d->trained) timed(d, d->port.clock(d->port.ctx) - started);
    }
    if (commit_due(d)) commit(d);
    return d->trained;
}

eps_status eps_device_tick(eps_device *d, double now) {
    eps_status st = EPS_OK;
    if (d->retry_at > 0 && now >= d->retry_at) { /* what the port refused, again */
        uint32_t failures = d->port_failures;
        d->retry_at = 0;
        if (d->subscriptions_pending) subscribe_all(d);
        if (d->status_pending) publish_status(d, "online");
        if (d->unpublished && d->has_model) deliver(d);
        if (d->port_failures != failures) { /* failed again: wait twice as long (port_failed set retry_at) */
            d->retry_s = d->retry_s * 2 < EPS_RETRY_MAX_S ? d->retry_s * 2 : EPS_RETRY_MAX_S;
            d->retry_at = now + d->retry_s;
            st = EPS_ERR_PORT;
        } else {
            d->retry_s = 0;
        }
    }
    if (d->progress_at <= 0 || d->server_version != d->progress_version || d->seq != d->progress_seq) {
        d->progress_at = now; /* a new version or a new commit restarts the resend clock */
        d->progress_version = d->server_version;
        d->progress_seq = d->seq;
    } else if (now - d->progress_at >= d->resend_s && d->has_sent && !d->finished &&
               (d->waiting || holding(d) || blocked(d))) {
        d->progress_at = now; /* every resend_s while nothing comes */
        if (d->port.publish(d->port.ctx, d->t_grad, d->frame, d->frame_len, 0) != 0) return EPS_ERR_PORT;
        d->resends++;
        char a[24];
        say(d, EPS_OK, "commit ", num(a, d->sent_seq), " brought no new version: sent again", NULL);
    }
    return st;
}
