/* The tensor frame (docs/PROTOCOL.md §4): CRC-32, a bounds-checked reader, a writer. */
#include <string.h>

#include "edgeps.h"
#include "wire.h"

const char *eps_status_name(eps_status status) {
    switch (status) {
    case EPS_OK: return "ok";
    case EPS_ERR_SHORT: return "truncated";
    case EPS_ERR_MAGIC: return "bad magic";
    case EPS_ERR_VERSION: return "unknown format version";
    case EPS_ERR_KIND: return "unknown frame kind";
    case EPS_ERR_FLAGS: return "reserved flags set";
    case EPS_ERR_CODEC: return "unsupported codec";
    case EPS_ERR_ARG: return "bad codec argument";
    case EPS_ERR_CRC: return "CRC-32 mismatch";
    case EPS_ERR_NAME: return "bad or repeated name";
    case EPS_ERR_NDIM: return "too many dimensions";
    case EPS_ERR_TENSORS: return "too many tensors or values";
    case EPS_ERR_TRAILING: return "trailing bytes";
    case EPS_ERR_PAYLOAD: return "payload does not fit its codec";
    case EPS_ERR_SPACE: return "buffer too small";
    case EPS_ERR_VALUE: return "value not encodable";
    }
    return "unknown status";
}

uint32_t eps_crc32(uint32_t crc, const uint8_t *data, size_t len) {
    crc = ~crc;
    for (size_t i = 0; i < len; i++) {
        crc ^= data[i];
        for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
    return ~crc;
}

/* A cursor over bytes that refuses to read past their end. */
typedef struct {
    const uint8_t *p;
    size_t len, pos;
} reader;

static const uint8_t *take(reader *r, size_t n) {
    if (n > r->len - r->pos) return NULL;
    const uint8_t *at = r->p + r->pos;
    r->pos += n;
    return at;
}

/* A length-prefixed ASCII name (1..64 bytes; device ids may be empty) into out. */
static eps_status read_name(reader *r, char out[EPS_MAX_NAME + 1], int may_be_empty, int tensor_name) {
    const uint8_t *n = take(r, 1);
    if (n == NULL) return EPS_ERR_SHORT;
    if (*n > EPS_MAX_NAME || (*n == 0 && !may_be_empty)) return EPS_ERR_NAME;
    const uint8_t *s = take(r, *n);
    if (s == NULL) return EPS_ERR_SHORT;
    for (unsigned i = 0; i < *n; i++) {
        uint8_t c = s[i];
        int ok = c < 0x80;
        if (tensor_name) /* [A-Za-z0-9_.:/-] */
            ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
                 c == '.' || c == ':' || c == '/' || c == '-';
        if (!ok) return EPS_ERR_NAME;
        out[i] = (char)c;
    }
    out[*n] = '\0';
    return EPS_OK;
}

/* One tensor record at r; its payload length is checked against the bytes left, not its codec. */
static eps_status read_record(reader *r, eps_tensor *t) {
    eps_status st = read_name(r, t->name, 0, 1);
    if (st != EPS_OK) return st;
    const uint8_t *nd = take(r, 1);
    if (nd == NULL) return EPS_ERR_SHORT;
    if (*nd > EPS_MAX_NDIM) return EPS_ERR_NDIM;
    t->ndim = *nd;
    t->elements = 1;
    for (unsigned d = 0; d < t->ndim; d++) {
        const uint8_t *dim = take(r, 4);
        if (dim == NULL) return EPS_ERR_SHORT;
        t->dims[d] = eps_get_u32(dim);
        /* a product above 2^32 is refused by the caller's bound long before it could overflow */
        t->elements = t->elements > UINT32_MAX ? t->elements : t->elements * t->dims[d];
    }
    const uint8_t *len = take(r, 4);
    if (len == NULL) return EPS_ERR_SHORT;
    t->length = eps_get_u32(len);
    t->payload = take(r, t->length);
    return t->payload == NULL ? EPS_ERR_SHORT : EPS_OK;
}

eps_status eps_frame_parse(const uint8_t *data, size_t len, uint64_t max_elements, eps_frame *f) {
    if (len < EPS_HEADER_BYTES + 4) return EPS_ERR_SHORT;
    if (memcmp(data, "EPSF", 4) != 0) return EPS_ERR_MAGIC;
    if (eps_crc32(0, data, len - 4) != eps_get_u32(data + len - 4)) return EPS_ERR_CRC;
    if (data[4] != EPS_FORMAT_VERSION) return EPS_ERR_VERSION;
    if (data[5] < EPS_COMMIT || data[5] > EPS_DELTA) return EPS_ERR_KIND;
    if (data[7] != 0) return EPS_ERR_FLAGS;
    f->kind = (eps_kind)data[5];
    if (data[6] > EPS_TOPK) return EPS_ERR_CODEC;
    f->codec.id = (eps_codec_id)data[6];
    f->codec.arg = eps_get_f32(data + 8);
    eps_status st = eps_codec_check(f->codec);
    if (st != EPS_OK) return st;
    f->base_version = eps_get_u64(data + 12);
    f->seq = eps_get_u64(data + 20);
    f->samples = eps_get_u32(data + 28);
    f->steps = eps_get_u32(data + 32);
    reader r = {data, len - 4, EPS_HEADER_BYTES};
    if ((st = read_name(&r, f->device, 1, 0)) != EPS_OK) return st;
    const uint8_t *count = take(&r, 2);
    if (count == NULL) return EPS_ERR_SHORT;
    f->count = eps_get_u16(count);
    if (f->count > EPS_MAX_TENSORS) return EPS_ERR_TENSORS;
    f->records = data + r.pos;
    uint64_t limit = max_elements ? max_elements : (uint64_t)1 << 28, total = 0;
    for (unsigned i = 0; i < f->count; i++) {
        eps_tensor t;
        if ((st = read_record(&r, &t)) != EPS_OK) return st;
        total += t.elements;
        if (t.elements > limit || total > limit) return EPS_ERR_TENSORS;
        reader back = {f->records, (size_t)(data + r.pos - f->records), 0}; /* names are unique */
        for (unsigned j = 0; j < i; j++) {
            eps_tensor before;
            if (read_record(&back, &before) != EPS_OK || strcmp(before.name, t.name) == 0) return EPS_ERR_NAME;
        }
    }
    if (r.pos != r.len) return EPS_ERR_TRAILING;
    f->records_len = (size_t)(data + r.pos - f->records);
    return EPS_OK;
}

int eps_frame_next(const eps_frame *f, size_t *cursor, eps_tensor *t) {
    if (*cursor >= f->records_len) return 0;
    reader r = {f->records, f->records_len, *cursor};
    if (read_record(&r, t) != EPS_OK) return 0; /* cannot happen after eps_frame_parse */
    *cursor = r.pos;
    return 1;
}

static uint8_t *room(eps_writer *w, size_t n) {
    if (w->error != EPS_OK) return NULL;
    if (n > w->cap - w->len) {
        w->error = EPS_ERR_SPACE;
        return NULL;
    }
    uint8_t *at = w->buf + w->len;
    w->len += n;
    return at;
}

static void put_name(eps_writer *w, const char *name) {
    size_t n = strlen(name);
    uint8_t *p;
    if (n > EPS_MAX_NAME) {
        w->error = w->error == EPS_OK ? EPS_ERR_NAME : w->error;
        return;
    }
    if ((p = room(w, 1 + n)) == NULL) return;
    p[0] = (uint8_t)n;
    memcpy(p + 1, name, n);
}

void eps_writer_begin(eps_writer *w, uint8_t *buf, size_t cap, eps_kind kind, eps_codec codec, uint64_t base_version,
                      uint64_t seq, uint32_t samples, uint32_t steps, const char *device) {
    w->buf = buf;
    w->cap = cap;
    w->len = 0;
    w->count = 0;
    w->codec = codec;
    w->error = eps_codec_check(codec);
    uint8_t *h = room(w, EPS_HEADER_BYTES);
    if (h == NULL) return;
    memcpy(h, "EPSF", 4);
    h[4] = EPS_FORMAT_VERSION;
    h[5] = (uint8_t)kind;
    h[6] = (uint8_t)codec.id;
    h[7] = 0;
    eps_put_f32(h + 8, codec.arg);
    eps_put_u64(h + 12, base_version);
    eps_put_u64(h + 20, seq);
    eps_put_u32(h + 28, samples);
    eps_put_u32(h + 32, steps);
    put_name(w, device);
    room(w, 2); /* the tensor count, written by eps_writer_end */
}

void eps_writer_tensor(eps_writer *w, const char *name, uint8_t ndim, const uint32_t *dims, const float *values,
                       uint64_t *rng) {
    uint8_t *p;
    uint64_t n = 1;
    if (w->error != EPS_OK) return;
    if (ndim > EPS_MAX_NDIM || w->count >= EPS_MAX_TENSORS) {
        w->error = ndim > EPS_MAX_NDIM ? EPS_ERR_NDIM : EPS_ERR_TENSORS;
        return;
    }
    put_name(w, name);
    if ((p = room(w, 1 + 4u * ndim)) == NULL) return;
    p[0] = ndim;
    for (unsigned d = 0; d < ndim; d++) {
        eps_put_u32(p + 1 + 4 * d, dims[d]);
        n *= dims[d];
    }
    if (n > UINT32_MAX) {
        w->error = EPS_ERR_TENSORS;
        return;
    }
    uint8_t *length = room(w, 4);
    if (length == NULL) return;
    size_t written = 0;
    eps_status st = eps_codec_encode(w->codec, values, (uint32_t)n, w->buf + w->len, w->cap - w->len, &written, rng);
    if (st != EPS_OK) {
        w->error = st;
        return;
    }
    eps_put_u32(length, (uint32_t)written);
    w->len += written;
    w->count++;
}

eps_status eps_writer_end(eps_writer *w, size_t *len) {
    uint8_t *crc = room(w, 4);
    if (crc == NULL) return w->error;
    size_t device = w->buf[EPS_HEADER_BYTES];
    eps_put_u16(w->buf + EPS_HEADER_BYTES + 1 + device, w->count);
    eps_put_u32(crc, eps_crc32(0, w->buf, w->len - 4));
    *len = w->len;
    return EPS_OK;
}
