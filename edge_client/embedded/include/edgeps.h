/* edgeps device SDK: the wire contract of docs/PROTOCOL.md (version 1.7: a device of every version
 * up to it, resend and error status included) in C99.
 *
 * This part: the tensor frame (CRC-32, a bounds-checked reader, a writer into a caller's
 * buffer) and the codecs (every decoder; encoders for what a device commits). Pure logic: no
 * heap, no I/O, no clock; every function works in memory the caller passes. Floats are IEEE-754
 * binary32; integers on the wire are little-endian whatever the host.
 */
#ifndef EDGEPS_H
#define EDGEPS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EPS_FORMAT_VERSION 1u
#define EPS_MAX_TENSORS 256u
#define EPS_MAX_NDIM 8u
#define EPS_MAX_NAME 64u
#define EPS_BUCKET 512u
#define EPS_HEADER_BYTES 36u
#define EPS_FLAG_COMPACT 0x01u /* a compact commit (protocol 1.9) */

/* Results. EPS_OK is 0; every other value names the first problem found. */
typedef enum {
    EPS_OK = 0,
    EPS_ERR_SHORT,     /* fewer bytes than a field needs */
    EPS_ERR_MAGIC,     /* not "EPSF" */
    EPS_ERR_VERSION,   /* a format version other than 1 */
    EPS_ERR_KIND,      /* a frame kind other than 1, 2, 3 */
    EPS_ERR_FLAGS,     /* flags other than 0, or 0x01 (compact) outside a commit */
    EPS_ERR_CODEC,     /* a codec id this side does not implement (the server's unsupported_codec) */
    EPS_ERR_ARG,       /* a codec argument the codec does not take */
    EPS_ERR_CRC,       /* CRC-32 mismatch */
    EPS_ERR_NAME,      /* a device id or tensor name that is too long, not ASCII, or repeated */
    EPS_ERR_NDIM,      /* more than 8 dimensions */
    EPS_ERR_TENSORS,   /* more than 256 tensors */
    EPS_ERR_TRAILING,  /* bytes between the last tensor and the CRC */
    EPS_ERR_PAYLOAD,   /* a payload whose length or content does not fit its codec and shape */
    EPS_ERR_SPACE,     /* the caller's buffer is too small */
    EPS_ERR_VALUE,     /* a value the codec cannot encode (NaN or infinity) */
    EPS_ERR_FIELD,     /* a JSON message that is not valid, or a field of it out of its range (NaN, Inf, too large) */
    EPS_ERR_MODEL,     /* a model this trainer does not compute (not an MLP of dense layers), or a loss it lacks */
    EPS_ERR_PORT       /* the port refused a publish or a subscription (tried again) */
} eps_status;

/* A short English name of a status, for logs. */
const char *eps_status_name(eps_status status);

typedef enum { EPS_COMMIT = 1, EPS_PARAMS = 2, EPS_DELTA = 3 } eps_kind;

typedef enum {
    EPS_FP32 = 0,
    EPS_FP16 = 1,
    EPS_INT8 = 2,
    EPS_SIGN = 3,
    EPS_TERNARY = 4,
    EPS_QSGD = 5,
    EPS_TOPK = 6
} eps_codec_id;

/* A codec and its argument (qsgd: levels 1..127; topk: fraction in (0, 1]; others 0). */
typedef struct {
    eps_codec_id id;
    float arg;
} eps_codec;

/* Parse a spec such as "fp32", "sign", "qsgd:4" or "topk:0.01" (bare "qsgd" is qsgd:16, bare
 * "topk" is topk:0.01). EPS_ERR_CODEC for an unknown name, EPS_ERR_ARG for a bad argument. */
eps_status eps_codec_parse(const char *spec, eps_codec *codec);

/* Check a codec as a frame header names it (PROTOCOL.md §4, §5). */
eps_status eps_codec_check(eps_codec codec);

/* Whether the codec is biased (used with error feedback on the device: fp16, int8, sign, topk). */
int eps_codec_biased(eps_codec codec);

/* topk: the number of values a tensor of n values keeps, ceil(P n) in double, 1..n (0 if n = 0). */
uint32_t eps_topk_keep(float fraction, uint32_t n);

/* The most bytes an encoding of n values may take (its exact size, except topk's upper bound). */
size_t eps_codec_max_size(eps_codec codec, uint32_t n);

/* Encode n float32 values into out (cap bytes); *written gets the payload's size. rng: the
 * state of the stochastic codecs' generator (ternary, qsgd), any nonzero value to start. */
eps_status eps_codec_encode(eps_codec codec, const float *x, uint32_t n, uint8_t *out, size_t cap, size_t *written,
                            uint64_t *rng);

/* Decode a payload of exactly len bytes holding n values into y (n floats). */
eps_status eps_codec_decode(eps_codec codec, const uint8_t *payload, size_t len, uint32_t n, float *y);

/* A compact commit's top-k payload (protocol 1.9, docs/PROTOCOL.md section 5) of the n values x:
 * float32 scale, the k = eps_topk_keep indices as LEB128 gaps, k int8 values. */
eps_status eps_topk_encode_compact(float fraction, const float *x, uint32_t n, uint8_t *out, size_t cap,
                                   size_t *written);

/* The most bytes eps_topk_encode_compact writes for n values. */
size_t eps_topk_compact_max_size(float fraction, uint32_t n);

/* Add scale x (the values a compact top-k payload of exactly len bytes holds for n values) into y:
 * scale -1 takes them away. For payloads this SDK wrote (its residual, a refused commit carried):
 * reads and writes stay in bounds, but a malformed payload may have changed y when it says
 * EPS_ERR_PAYLOAD. */
eps_status eps_topk_compact_add(float fraction, const uint8_t *payload, size_t len, uint32_t n, float scale, float *y);

/* IEEE CRC-32 (zlib's crc32), continued from crc (0 to start). */
uint32_t eps_crc32(uint32_t crc, const uint8_t *data, size_t len);

/* A verified frame: its header, and its tensor records still in the caller's bytes. */
typedef struct {
    eps_kind kind;
    eps_codec codec;
    uint64_t base_version;
    uint64_t seq;
    uint32_t samples;
    uint32_t steps;
    char device[EPS_MAX_NAME + 1];
    uint16_t count;           /* tensors */
    const uint8_t *records;   /* the first record; a compact commit's one payload */
    size_t records_len;       /* bytes of all records; of that payload */
    int compact;              /* a compact commit (flags 0x01): the model's values in one payload, no records */
} eps_frame;

/* One tensor record: name, shape, and its payload (not decoded). */
typedef struct {
    char name[EPS_MAX_NAME + 1];
    uint8_t ndim;
    uint32_t dims[EPS_MAX_NDIM];
    uint64_t elements;
    const uint8_t *payload;
    uint32_t length;
} eps_tensor;

/* Verify a frame: size, magic, version, kind, flags, codec, CRC, every length, names (ASCII,
 * unique), dimensions, no trailing bytes; max_elements bounds the values all tensors declare
 * together (0: 2^28). Nothing is decoded or allocated. */
eps_status eps_frame_parse(const uint8_t *data, size_t len, uint64_t max_elements, eps_frame *frame);

/* The tensor record at *cursor (start at 0) of a parsed frame; advances *cursor. Returns 0 when
 * there is none left, 1 otherwise. */
int eps_frame_next(const eps_frame *frame, size_t *cursor, eps_tensor *tensor);

/* A frame read as its bytes arrive (a link that hands a message over piece by piece): the same
 * checks as eps_frame_parse, CRC-32 computed incrementally, every length checked against the
 * bytes the message still holds before anything is read into place; each tensor's payload goes
 * where the caller says once its record is known, so no copy of the whole frame is needed.
 *
 *   eps_frame_stream_begin(&s, len, max_elements);
 *   loop: at = eps_frame_stream_room(&s, &cap); read up to cap bytes into at; ev = eps_frame_stream_wrote(&s, n);
 *         EPS_STREAM_HEADER: s.head is read; EPS_STREAM_TENSOR: s.tensor is read, set s.dest (NULL: read past);
 *         EPS_STREAM_DONE: all bytes in and the CRC matched; EPS_STREAM_FAILED: s.error says why.
 * After DONE or FAILED the rest of the message (if any) is read past. Names are checked as
 * eps_frame_parse does, but their being unique is the caller's to check (it places each one). */
typedef enum { EPS_STREAM_MORE, EPS_STREAM_HEADER, EPS_STREAM_TENSOR, EPS_STREAM_DONE, EPS_STREAM_FAILED } eps_stream_event;

typedef struct {
    eps_frame head;     /* the header (records NULL: they are not kept) */
    eps_tensor tensor;  /* the record being read (payload NULL) */
    uint8_t *dest;      /* where its payload goes: the caller's, set on EPS_STREAM_TENSOR; NULL: read past */
    eps_status error;
    int done;           /* all bytes in and the CRC matched */
    /* the reader */
    uint8_t piece[1 + EPS_MAX_NAME + 1 + 4 * EPS_MAX_NDIM + 4]; /* a header or record field being collected */
    size_t len, got, want, have, payload_left;
    uint8_t *at;        /* where room pointed */
    uint64_t limit, total;
    uint32_t crc;
    int phase;
    uint16_t index;
} eps_frame_stream;

void eps_frame_stream_begin(eps_frame_stream *s, size_t len, uint64_t max_elements);
uint8_t *eps_frame_stream_room(eps_frame_stream *s, size_t *cap);
eps_stream_event eps_frame_stream_wrote(eps_frame_stream *s, size_t n);

/* Writes a frame into a caller's buffer: begin, one call per tensor, end. The first error
 * sticks and is what end returns. */
typedef struct {
    uint8_t *buf;
    size_t cap;
    size_t len;
    uint16_t count;
    eps_codec codec;
    eps_status error;
} eps_writer;

void eps_writer_begin(eps_writer *w, uint8_t *buf, size_t cap, eps_kind kind, eps_codec codec, uint64_t base_version,
                      uint64_t seq, uint32_t samples, uint32_t steps, const char *device);
void eps_writer_tensor(eps_writer *w, const char *name, uint8_t ndim, const uint32_t *dims, const float *values,
                       uint64_t *rng);
/* A compact commit's body in place of tensor records (after begin, before end): the count of the
 * model's tensors, then the compact top-k payload of its n values in the model's order (top-k
 * only); *payload and *payload_len get where the payload is. */
void eps_writer_compact_topk(eps_writer *w, uint16_t tensors, const float *values, uint32_t n, const uint8_t **payload,
                             size_t *payload_len);
/* Appends the tensor count's fix-up and the CRC; *len gets the frame's size. */
eps_status eps_writer_end(eps_writer *w, size_t *len);

/* ---- the reference trainer (docs/PROTOCOL.md §6): a ReLU MLP, SGD on the job's loss ---- */

/* The losses of learning/losses.py (the Control's "loss"): softmax cross-entropy over >= 2 outputs
 * (labels 0..classes-1), binary cross-entropy on one logit (labels 0, 1), mean squared and mean
 * absolute error of one predicted value (real targets). */
typedef enum { EPS_LOSS_CROSS_ENTROPY, EPS_LOSS_BCE, EPS_LOSS_MSE, EPS_LOSS_MAE } eps_loss;

/* The loss called name ("cross_entropy", "bce", "mse", "mae"; len bytes); 0 if it is none of them. */
int eps_loss_from_name(const char *name, size_t len, eps_loss *loss);

#define EPS_MAX_LAYERS 8u

/* An MLP's shape: layer sizes[0] (features) .. sizes[layers] (classes). Its parameters are one
 * float array in the model's order: dense0.w (sizes[0] x sizes[1], row-major), dense0.b
 * (sizes[1]), dense1.w, dense1.b, ... */
typedef struct {
    uint32_t layers;
    uint32_t sizes[EPS_MAX_LAYERS + 1];
} eps_mlp;

/* The shape of the MLP whose parameters a frame holds (tensors dense{i}.w (in, out) and
 * dense{i}.b (out), i = 0, 1, ..., in any order, each once); EPS_ERR_NAME if the tensors are not one. */
eps_status eps_mlp_from_frame(const eps_frame *frame, eps_mlp *mlp);

/* The same, a tensor record at a time (a frame read as its bytes arrive): begin, add each, end. */
typedef struct {
    uint32_t in[EPS_MAX_LAYERS], out[EPS_MAX_LAYERS], bias[EPS_MAX_LAYERS], seen;
    int bad;
    char first[EPS_MAX_NAME + 1]; /* the first tensor's name (for messages) */
} eps_mlp_shape;

void eps_mlp_shape_begin(eps_mlp_shape *shape);
void eps_mlp_shape_add(eps_mlp_shape *shape, const eps_tensor *tensor);
eps_status eps_mlp_shape_end(const eps_mlp_shape *shape, eps_mlp *mlp);

/* Floats of the parameters; floats of scratch one step on a batch needs. Sizes computed from a
 * frame's shapes saturate at SIZE_MAX instead of wrapping (a 32-bit size_t included), so a model
 * no memory could hold is refused by any "does it fit" check. */
size_t eps_mlp_params(const eps_mlp *mlp);
size_t eps_mlp_scratch(const eps_mlp *mlp, uint32_t batch);

/* The offset (in floats) of dense{layer}.w in the parameters, and of dense{layer}.b. */
size_t eps_mlp_weight_at(const eps_mlp *mlp, uint32_t layer);
size_t eps_mlp_bias_at(const eps_mlp *mlp, uint32_t layer);

/* One SGD step in place on a batch x (batch x features, row-major) with labels or targets y: params
 * -= lr * the gradient of the batch's mean loss. Returns that loss, or a negative value if the model's
 * outputs do not fit the loss, or a label is not a class of it (nothing is changed then). */
float eps_mlp_step(const eps_mlp *mlp, float *params, const float *x, const float *y, uint32_t batch, float lr,
                   eps_loss loss, float *scratch);

/* ---- the device (docs/PROTOCOL.md §6): a state machine that talks through a port ---- */

/* What the device core needs from its platform. Every function gets ctx. The MQTT client behind
 * publish/subscribe must keep a persistent session and QoS 1 (PROTOCOL.md §2); publish copies
 * the payload (or sends it before returning). */
typedef struct {
    void *ctx;
    /* Publish at QoS 1 (retained if retain); 0 when accepted. */
    int (*publish)(void *ctx, const char *topic, const uint8_t *payload, size_t len, int retain);
    int (*subscribe)(void *ctx, const char *topic);
    int (*unsubscribe)(void *ctx, const char *topic);
    /* Seconds from any fixed point (a monotonic clock): times local steps for step_s. */
    double (*clock)(void *ctx);
    /* 64 random bits: the incarnation, the batches, the stochastic codecs. */
    uint64_t (*entropy)(void *ctx);
    /* Training sample index (0 .. samples - 1): its features into x (the model's count) and its
     * label (a class number) or target value into *y; 0 if it cannot be had (the step is skipped).
     * Data may live in flash, a file, or a sensor's ring buffer. */
    int (*sample)(void *ctx, uint32_t index, float *x, float *y);
    /* Optional (NULL: nothing is said). Every message refused and every problem met, with its
     * status and a one-line reason ("Control: lr not a number in (0, 100]"); status EPS_OK for
     * news that is not a problem (a commit sent again). Called from within the device's calls. */
    void (*log)(void *ctx, eps_status status, const char *reason);
    /* Optional (NULL: never). Nonzero while the transport still reads the bytes of the last payload
     * publish took (a client that writes a commit from where it lies, and sends it again after a
     * reconnect until its PUBACK): no new commit is built over them meanwhile. */
    int (*sending)(void *ctx);
} eps_port;

/* A Control message (PROTOCOL.md §3). */
typedef struct {
    uint64_t run, incarnation, seq_base;
    uint32_t max_uncommitted_steps, push_every, batch_size;
    float lr;
    eps_loss loss; /* cross_entropy when the Control names none (protocol 1.1) */
    eps_codec codec, pull_codec;
    int wait_for_params, one_commit_per_version;
    int64_t staleness_bound; /* -1: none */
} eps_control;

/* The bytes of arena a device needs for an MLP, batches of up to max_batch samples and commits in
 * codec (a residual is kept only for biased commit codecs; every pull codec needs the same): what
 * to reserve before flashing. */
size_t eps_device_arena_size(const eps_mlp *mlp, uint32_t max_batch, eps_codec codec);

/* The receive buffer a port needs when parameter snapshots stream into the arena
 * (eps_device_stream_*): the largest other message it takes whole, a delta in pull_codec or a
 * JSON message (Control, Barrier, Notice: at most EPS_MESSAGE_MAX bytes). */
#define EPS_MESSAGE_MAX 1024u
size_t eps_device_receive_size(const eps_mlp *mlp, eps_codec pull_codec);

#define EPS_TOPIC_MAX 160u
#define EPS_REASON_MAX 120u
#define EPS_RESEND_S 30.0 /* a commit the device waits on goes out again after this long without news */
#define EPS_RETRY_MAX_S 30.0 /* a publish or subscribe the port refused is tried again: 1 s, doubling to this */

/* One device. All of its memory is this struct and the arena given to eps_device_init; the
 * fields are the state of PROTOCOL.md §6, for reading (tests, logs), not for writing. */
typedef struct {
    eps_port port;
    char device[EPS_MAX_NAME + 1];
    char t_status[EPS_TOPIC_MAX], t_grad[EPS_TOPIC_MAX], t_params[EPS_TOPIC_MAX], t_delta[EPS_TOPIC_MAX],
        t_ctrl[EPS_TOPIC_MAX], t_barrier[EPS_TOPIC_MAX], t_notice[EPS_TOPIC_MAX];
    uint32_t samples;
    uint8_t *arena;
    size_t arena_size;
    uint64_t incarnation;
    int has_control, has_run, has_replica, has_local, has_model, has_sent, params_subscribed;
    eps_control control;
    uint64_t run, replica_run;
    int64_t server_version, committed_on;
    eps_mlp mlp;
    float *replica, *local, *anchor, *residual, *work, *batch_x; /* residual: NULL when not needed */
    float *batch_y;
    uint8_t *frame; /* the newest commit, kept until the next one: a refused one is carried from it */
    size_t frame_cap, frame_len;
    uint32_t steps, step_samples, since_commit, sent_steps, sent_samples, max_batch;
    uint64_t seq, sent_seq, slowest_clock, rng;
    int64_t sent_base;
    int waiting, gap, resync, finished, trained, residual_held, params_ignored;
    int diverged; /* local training met a non-finite loss (the job's lr too high): the device stops */
    float last_loss, step_s, mean_step_s;
    uint32_t timed_steps;
    double busy_s, idle_s, untimed_s;
    eps_status error; /* the last problem met (a model too large for the arena, a frame refused) */
    char reason[EPS_REASON_MAX]; /* ... and its reason, as the log hook got it */
    /* Why this device cannot take part in the job as it stands (a model, loss or codec it lacks, a
     * model too large for its arena): EPS_OK when it can. Said in its status ("error", PROTOCOL.md
     * §3); cleared when a Control or a model it can take arrives. */
    eps_status unable;
    char unable_reason[EPS_REASON_MAX];
    int unable_by_control;
    /* Delivery: a commit built but refused by the port's publish (not sent: retried, never counted
     * as sent), a status or subscriptions to send again, when, and the resend of §6. */
    int unpublished, status_pending, subscriptions_pending;
    uint64_t pending_seq;
    int64_t pending_base;
    uint32_t pending_steps, pending_samples;
    double retry_at, retry_s, resend_s, progress_at;
    int64_t progress_version;
    uint64_t progress_seq;
    uint32_t resends, port_failures;
    /* A parameter frame being read (eps_device_stream_*, or a whole one): straight into the replica. */
    eps_frame_stream in;
    eps_mlp_shape in_shape;
    uint32_t in_placed; /* bit 2i: dense{i}.w is in place, 2i + 1: dense{i}.b */
    int in_ordered;     /* its tensors came in the arena's order (dense0.w, dense0.b, dense1.w, ...) */
    int ordered;        /* the adopted snapshot's did: top-k commits go compact, in that order (protocol 1.9) */
    int in_mode, in_again;
    eps_status in_status;
    char backend[16]; /* the status's "backend": "c"; a port may name its build ([A-Za-z0-9_.-], e.g. "firmware-m4") */
} eps_device;

/* Set up a device of job with id device holding samples training samples, its memory in arena
 * (arena_size bytes, for the largest model and batch it will meet; see eps_device_arena_size).
 * The incarnation is drawn from the port's entropy. EPS_ERR_NAME for a bad job or device id. */
eps_status eps_device_init(eps_device *d, const eps_port *port, const char *job, const char *device, uint32_t samples,
                           void *arena, size_t arena_size, uint32_t max_batch);

/* After every (re)connect: subscribe, and publish the online status (retained). What the port
 * refuses is tried again by eps_device_tick. */
void eps_device_connected(eps_device *d);

/* An inbound message. EPS_OK if it was taken or had nothing for this device (another run's,
 * an older version); otherwise the problem, said to the port's log hook with its reason, and the
 * message is dropped whole: a Control, Barrier or Notice with a field out of its range (NaN, Inf,
 * an integer beyond its bound) changes nothing. payload NULL: a message of len bytes the port's
 * receive buffer could not hold was read past (a delta missed: the device reads the snapshot). */
eps_status eps_device_message(eps_device *d, const char *topic, const uint8_t *payload, size_t len);

/* A parameter frame read as its bytes arrive, for a port whose MQTT client hands a message over
 * piece by piece (edgeps_mqtt.h's eps_mqtt_stream): no buffer of the frame's size is needed, its
 * values land in the arena's replica (docs/EMBEDDED.md, "Receiving"). begin: 1 if the device takes
 * the message on topic (len payload bytes) this way (a snapshot on params), 0 to have it whole
 * through eps_device_message. room: where the next bytes go, at most *cap of them; wrote: n bytes
 * were read there. end: the message is all in (complete 1; its refusal, if any, as
 * eps_device_message's), or the link broke first (0: the broker sends it again). */
int eps_device_stream_begin(eps_device *d, const char *topic, size_t len);
uint8_t *eps_device_stream_room(eps_device *d, size_t *cap);
void eps_device_stream_wrote(eps_device *d, size_t n);
eps_status eps_device_stream_end(eps_device *d, int complete);

/* The port calls this every loop with its clock (the same seconds as port.clock): it tries again
 * what the port refused (a commit, the status, the subscriptions; 1 s, doubling to
 * EPS_RETRY_MAX_S), and sends the newest commit again, the same bytes, while the device waits on
 * it (bsp's parameters, acbsp's next version, ssp's staleness bound) and neither a new version nor
 * a new commit came for d->resend_s seconds (EPS_RESEND_S; a port may set it after init), then
 * every resend_s again (PROTOCOL.md §6, "Resending"). Returns the port's failure if a retry failed. */
eps_status eps_device_tick(eps_device *d, double now);

/* Whether eps_device_step may run now. */
int eps_device_ready(const eps_device *d);

/* One local step (none when the device holds max_uncommitted_steps), then the commit when due.
 * Returns 1 if it trained. */
int eps_device_step(eps_device *d);

/* The status message (state "online" or "offline") into out; its length, 0 if cap is too small.
 * The will is the offline one. */
size_t eps_device_status(const eps_device *d, const char *state, char *out, size_t cap);

/* Before a clean disconnect: publish the offline status (a clean disconnect fires no will). */
void eps_device_leave(eps_device *d);

#ifdef __cplusplus
}
#endif
#endif /* EDGEPS_H */
