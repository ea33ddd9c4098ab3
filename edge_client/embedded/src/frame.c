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
    case EPS_ERR_FIELD: return "bad message field";
    case EPS_ERR_MODEL: return "model not supported";
    case EPS_ERR_PORT: return "port refused";
    }
    return "unknown status";
}

#ifndef EPS_CRC32_HOOK
/* The CRC-32 of each byte value (reflected polynomial 0xEDB88320): one lookup a byte, 1 KiB of flash. */
static const uint32_t CRC_TABLE[256] = {
    0x00000000u, 0x77073096u, 0xee0e612cu, 0x990951bau, 0x076dc419u, 0x706af48fu,
    0xe963a535u, 0x9e6495a3u, 0x0edb8832u, 0x79dcb8a4u, 0xe0d5e91eu, 0x97d2d988u,
    0x09b64c2bu, 0x7eb17cbdu, 0xe7b82d07u, 0x90bf1d91u, 0x1db71064u, 0x6ab020f2u,
    0xf3b97148u, 0x84be41deu, 0x1adad47du, 0x6ddde4ebu, 0xf4d4b551u, 0x83d385c7u,
    0x136c9856u, 0x646ba8c0u, 0xfd62f97au, 0x8a65c9ecu, 0x14015c4fu, 0x63066cd9u,
    0xfa0f3d63u, 0x8d080df5u, 0x3b6e20c8u, 0x4c69105eu, 0xd56041e4u, 0xa2677172u,
    0x3c03e4d1u, 0x4b04d447u, 0xd20d85fdu, 0xa50ab56bu, 0x35b5a8fau, 0x42b2986cu,
    0xdbbbc9d6u, 0xacbcf940u, 0x32d86ce3u, 0x45df5c75u, 0xdcd60dcfu, 0xabd13d59u,
    0x26d930acu, 0x51de003au, 0xc8d75180u, 0xbfd06116u, 0x21b4f4b5u, 0x56b3c423u,
    0xcfba9599u, 0xb8bda50fu, 0x2802b89eu, 0x5f058808u, 0xc60cd9b2u, 0xb10be924u,
    0x2f6f7c87u, 0x58684c11u, 0xc1611dabu, 0xb6662d3du, 0x76dc4190u, 0x01db7106u,
    0x98d220bcu, 0xefd5102au, 0x71b18589u, 0x06b6b51fu, 0x9fbfe4a5u, 0xe8b8d433u,
    0x7807c9a2u, 0x0f00f934u, 0x9609a88eu, 0xe10e9818u, 0x7f6a0dbbu, 0x086d3d2du,
    0x91646c97u, 0xe6635c01u, 0x6b6b51f4u, 0x1c6c6162u, 0x856530d8u, 0xf262004eu,
    0x6c0695edu, 0x1b01a57bu, 0x8208f4c1u, 0xf50fc457u, 0x65b0d9c6u, 0x12b7e950u,
    0x8bbeb8eau, 0xfcb9887cu, 0x62dd1ddfu, 0x15da2d49u, 0x8cd37cf3u, 0xfbd44c65u,
    0x4db26158u, 0x3ab551ceu, 0xa3bc0074u, 0xd4bb30e2u, 0x4adfa541u, 0x3dd895d7u,
    0xa4d1c46du, 0xd3d6f4fbu, 0x4369e96au, 0x346ed9fcu, 0xad678846u, 0xda60b8d0u,
    0x44042d73u, 0x33031de5u, 0xaa0a4c5fu, 0xdd0d7cc9u, 0x5005713cu, 0x270241aau,
    0xbe0b1010u, 0xc90c2086u, 0x5768b525u, 0x206f85b3u, 0xb966d409u, 0xce61e49fu,
    0x5edef90eu, 0x29d9c998u, 0xb0d09822u, 0xc7d7a8b4u, 0x59b33d17u, 0x2eb40d81u,
    0xb7bd5c3bu, 0xc0ba6cadu, 0xedb88320u, 0x9abfb3b6u, 0x03b6e20cu, 0x74b1d29au,
    0xead54739u, 0x9dd277afu, 0x04db2615u, 0x73dc1683u, 0xe3630b12u, 0x94643b84u,
    0x0d6d6a3eu, 0x7a6a5aa8u, 0xe40ecf0bu, 0x9309ff9du, 0x0a00ae27u, 0x7d079eb1u,
    0xf00f9344u, 0x8708a3d2u, 0x1e01f268u, 0x6906c2feu, 0xf762575du, 0x806567cbu,
    0x196c3671u, 0x6e6b06e7u, 0xfed41b76u, 0x89d32be0u, 0x10da7a5au, 0x67dd4accu,
    0xf9b9df6fu, 0x8ebeeff9u, 0x17b7be43u, 0x60b08ed5u, 0xd6d6a3e8u, 0xa1d1937eu,
    0x38d8c2c4u, 0x4fdff252u, 0xd1bb67f1u, 0xa6bc5767u, 0x3fb506ddu, 0x48b2364bu,
    0xd80d2bdau, 0xaf0a1b4cu, 0x36034af6u, 0x41047a60u, 0xdf60efc3u, 0xa867df55u,
    0x316e8eefu, 0x4669be79u, 0xcb61b38cu, 0xbc66831au, 0x256fd2a0u, 0x5268e236u,
    0xcc0c7795u, 0xbb0b4703u, 0x220216b9u, 0x5505262fu, 0xc5ba3bbeu, 0xb2bd0b28u,
    0x2bb45a92u, 0x5cb36a04u, 0xc2d7ffa7u, 0xb5d0cf31u, 0x2cd99e8bu, 0x5bdeae1du,
    0x9b64c2b0u, 0xec63f226u, 0x756aa39cu, 0x026d930au, 0x9c0906a9u, 0xeb0e363fu,
    0x72076785u, 0x05005713u, 0x95bf4a82u, 0xe2b87a14u, 0x7bb12baeu, 0x0cb61b38u,
    0x92d28e9bu, 0xe5d5be0du, 0x7cdcefb7u, 0x0bdbdf21u, 0x86d3d2d4u, 0xf1d4e242u,
    0x68ddb3f8u, 0x1fda836eu, 0x81be16cdu, 0xf6b9265bu, 0x6fb077e1u, 0x18b74777u,
    0x88085ae6u, 0xff0f6a70u, 0x66063bcau, 0x11010b5cu, 0x8f659effu, 0xf862ae69u,
    0x616bffd3u, 0x166ccf45u, 0xa00ae278u, 0xd70dd2eeu, 0x4e048354u, 0x3903b3c2u,
    0xa7672661u, 0xd06016f7u, 0x4969474du, 0x3e6e77dbu, 0xaed16a4au, 0xd9d65adcu,
    0x40df0b66u, 0x37d83bf0u, 0xa9bcae53u, 0xdebb9ec5u, 0x47b2cf7fu, 0x30b5ffe9u,
    0xbdbdf21cu, 0xcabac28au, 0x53b39330u, 0x24b4a3a6u, 0xbad03605u, 0xcdd70693u,
    0x54de5729u, 0x23d967bfu, 0xb3667a2eu, 0xc4614ab8u, 0x5d681b02u, 0x2a6f2b94u,
    0xb40bbe37u, 0xc30c8ea1u, 0x5a05df1bu, 0x2d02ef8du,
};

#endif

uint32_t eps_crc32(uint32_t crc, const uint8_t *data, size_t len) {
#ifdef EPS_CRC32_HOOK /* a hardware CRC unit: the port defines EPS_CRC32_HOOK(crc, data, len) */
    return EPS_CRC32_HOOK(crc, data, len);
#else
    crc = ~crc;
    for (size_t i = 0; i < len; i++) crc = CRC_TABLE[(crc ^ data[i]) & 0xffu] ^ (crc >> 8);
    return ~crc;
#endif
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

/* n bytes of a name into out (terminated): ASCII; a tensor's [A-Za-z0-9_.:/-]. */
static eps_status copy_name(const uint8_t *s, size_t n, char out[EPS_MAX_NAME + 1], int tensor_name) {
    for (size_t i = 0; i < n; i++) {
        uint8_t c = s[i];
        int ok = c < 0x80;
        if (tensor_name)
            ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
                 c == '.' || c == ':' || c == '/' || c == '-';
        if (!ok) return EPS_ERR_NAME;
        out[i] = (char)c;
    }
    out[n] = '\0';
    return EPS_OK;
}

/* A length-prefixed ASCII name (1..64 bytes; device ids may be empty) into out. */
static eps_status read_name(reader *r, char out[EPS_MAX_NAME + 1], int may_be_empty, int tensor_name) {
    const uint8_t *n = take(r, 1);
    if (n == NULL) return EPS_ERR_SHORT;
    if (*n > EPS_MAX_NAME || (*n == 0 && !may_be_empty)) return EPS_ERR_NAME;
    const uint8_t *s = take(r, *n);
    if (s == NULL) return EPS_ERR_SHORT;
    return copy_name(s, *n, out, tensor_name);
}

/* A record's dimensions (ndim of them at p) and payload length (after them) into t. */
static void read_dims(const uint8_t *p, eps_tensor *t) {
    t->elements = 1;
    for (unsigned d = 0; d < t->ndim; d++) {
        t->dims[d] = eps_get_u32(p + 4 * d);
        /* a product above 2^32 is refused by the caller's bound long before it could overflow */
        t->elements = t->elements > UINT32_MAX ? t->elements : t->elements * t->dims[d];
    }
    t->length = eps_get_u32(p + 4 * t->ndim);
}

/* The fixed header (EPS_HEADER_BYTES at data) into f. */
static eps_status read_header(const uint8_t *data, eps_frame *f) {
    if (memcmp(data, "EPSF", 4) != 0) return EPS_ERR_MAGIC;
    if (data[4] != EPS_FORMAT_VERSION) return EPS_ERR_VERSION;
    if (data[5] < EPS_COMMIT || data[5] > EPS_DELTA) return EPS_ERR_KIND;
    if (data[7] != 0 && !(data[7] == EPS_FLAG_COMPACT && data[5] == EPS_COMMIT)) return EPS_ERR_FLAGS;
    f->kind = (eps_kind)data[5];
    f->compact = data[7] == EPS_FLAG_COMPACT;
    if (data[6] > EPS_TOPK) return EPS_ERR_CODEC;
    f->codec.id = (eps_codec_id)data[6];
    f->codec.arg = eps_get_f32(data + 8);
    f->base_version = eps_get_u64(data + 12);
    f->seq = eps_get_u64(data + 20);
    f->samples = eps_get_u32(data + 28);
    f->steps = eps_get_u32(data + 32);
    return eps_codec_check(f->codec);
}

/* One tensor record at r; its payload length is checked against the bytes left, not its codec. */
static eps_status read_record(reader *r, eps_tensor *t) {
    eps_status st = read_name(r, t->name, 0, 1);
    if (st != EPS_OK) return st;
    const uint8_t *nd = take(r, 1);
    if (nd == NULL) return EPS_ERR_SHORT;
    if (*nd > EPS_MAX_NDIM) return EPS_ERR_NDIM;
    t->ndim = *nd;
    const uint8_t *dims = take(r, 4u * t->ndim + 4);
    if (dims == NULL) return EPS_ERR_SHORT;
    read_dims(dims, t);
    t->payload = take(r, t->length);
    return t->payload == NULL ? EPS_ERR_SHORT : EPS_OK;
}

eps_status eps_frame_parse(const uint8_t *data, size_t len, uint64_t max_elements, eps_frame *f) {
    if (len < EPS_HEADER_BYTES + 4) return EPS_ERR_SHORT;
    if (memcmp(data, "EPSF", 4) != 0) return EPS_ERR_MAGIC;
    if (eps_crc32(0, data, len - 4) != eps_get_u32(data + len - 4)) return EPS_ERR_CRC;
    eps_status st = read_header(data, f);
    if (st != EPS_OK) return st;
    reader r = {data, len - 4, EPS_HEADER_BYTES};
    if ((st = read_name(&r, f->device, 1, 0)) != EPS_OK) return st;
    const uint8_t *count = take(&r, 2);
    if (count == NULL) return EPS_ERR_SHORT;
    f->count = eps_get_u16(count);
    if (f->count > EPS_MAX_TENSORS) return EPS_ERR_TENSORS;
    f->records = data + r.pos;
    if (f->compact) { /* one payload, of the receiver's model: its length as an LEB128 varint of 1..4 bytes */
        size_t length = 0;
        for (unsigned shift = 0;; shift += 7) {
            const uint8_t *b = take(&r, 1);
            if (b == NULL) return EPS_ERR_SHORT;
            length |= (size_t)(*b & 0x7f) << shift;
            if (*b < 0x80) break;
            if (shift == 21) return EPS_ERR_PAYLOAD;
        }
        f->records = take(&r, length);
        if (f->records == NULL) return EPS_ERR_SHORT;
        if (r.pos != r.len) return EPS_ERR_TRAILING;
        f->records_len = length;
        return EPS_OK;
    }
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
    if (f->compact || *cursor >= f->records_len) return 0; /* a compact commit has no records */
    reader r = {f->records, f->records_len, *cursor};
    if (read_record(&r, t) != EPS_OK) return 0; /* cannot happen after eps_frame_parse */
    *cursor = r.pos;
    return 1;
}

/* ---- a frame read as its bytes arrive ---- */

enum { S_HEADER, S_ID, S_NAME_LEN, S_NAME, S_DIMS, S_PAYLOAD, S_CRC, S_END };

/* Collect the next `want` bytes in piece; SHORT if the message has not that many before its CRC. */
static int expect(eps_frame_stream *s, int phase, size_t want) {
    size_t left = s->len - s->got - (phase == S_CRC ? 0 : 4);
    if (s->len - s->got < 4 || want > left) {
        s->error = EPS_ERR_SHORT;
        s->phase = S_END;
        return 0;
    }
    s->phase = phase;
    s->want = want;
    s->have = 0;
    return 1;
}

static eps_stream_event fail(eps_frame_stream *s, eps_status st) {
    s->error = st;
    s->phase = S_END;
    return EPS_STREAM_FAILED;
}

/* The next record, or the CRC after the last one. */
static eps_stream_event next_record(eps_frame_stream *s, eps_stream_event event) {
    if (s->index < s->head.count) return expect(s, S_NAME_LEN, 1) ? event : EPS_STREAM_FAILED;
    if (s->len - s->got != 4) return fail(s, s->len - s->got < 4 ? EPS_ERR_SHORT : EPS_ERR_TRAILING);
    expect(s, S_CRC, 4);
    return event;
}

void eps_frame_stream_begin(eps_frame_stream *s, size_t len, uint64_t max_elements) {
    memset(s, 0, sizeof *s);
    s->len = len;
    s->limit = max_elements ? max_elements : (uint64_t)1 << 28;
    if (len < EPS_HEADER_BYTES + 4) fail(s, EPS_ERR_SHORT);
    else expect(s, S_HEADER, EPS_HEADER_BYTES + 1);
}

uint8_t *eps_frame_stream_room(eps_frame_stream *s, size_t *cap) {
    if (s->phase == S_PAYLOAD && s->dest != NULL) {
        s->at = s->dest + (s->tensor.length - s->payload_left);
        *cap = s->payload_left;
    } else if (s->phase == S_PAYLOAD || s->phase == S_END) { /* read past, a piece at a time */
        size_t left = s->phase == S_PAYLOAD ? s->payload_left : s->len - s->got;
        s->at = s->piece;
        *cap = left < sizeof s->piece ? left : sizeof s->piece;
    } else {
        s->at = s->piece + s->have;
        *cap = s->want - s->have;
    }
    if (*cap == 0) *cap = 1; /* bytes past the message's end: read into piece, and refused */
    return s->at;
}

eps_stream_event eps_frame_stream_wrote(eps_frame_stream *s, size_t n) {
    if (s->phase != S_CRC && s->phase != S_END) s->crc = eps_crc32(s->crc, s->at, n);
    s->got += n;
    if (s->got > s->len) return fail(s, EPS_ERR_TRAILING);
    if (s->phase == S_END) return EPS_STREAM_MORE;
    if (s->phase == S_PAYLOAD) {
        s->payload_left -= n;
        if (s->payload_left) return EPS_STREAM_MORE;
        s->index++;
        return next_record(s, EPS_STREAM_MORE);
    }
    s->have += n;
    if (s->have < s->want) return EPS_STREAM_MORE;
    const uint8_t *p = s->piece;
    eps_status st;
    switch (s->phase) {
    case S_HEADER:
        if ((st = read_header(p, &s->head)) != EPS_OK) return fail(s, st);
        if (s->head.compact) return fail(s, EPS_ERR_FLAGS); /* read as it arrives: parameters, never a commit */
        if (p[EPS_HEADER_BYTES] > EPS_MAX_NAME) return fail(s, EPS_ERR_NAME);
        return expect(s, S_ID, p[EPS_HEADER_BYTES] + 2u) ? EPS_STREAM_MORE : EPS_STREAM_FAILED;
    case S_ID:
        if ((st = copy_name(p, s->want - 2, s->head.device, 0)) != EPS_OK) return fail(s, st);
        s->head.count = eps_get_u16(p + s->want - 2);
        if (s->head.count > EPS_MAX_TENSORS) return fail(s, EPS_ERR_TENSORS);
        return next_record(s, EPS_STREAM_HEADER);
    case S_NAME_LEN:
        if (p[0] == 0 || p[0] > EPS_MAX_NAME) return fail(s, EPS_ERR_NAME);
        return expect(s, S_NAME, p[0] + 1u) ? EPS_STREAM_MORE : EPS_STREAM_FAILED;
    case S_NAME:
        if ((st = copy_name(p, s->want - 1, s->tensor.name, 1)) != EPS_OK) return fail(s, st);
        if (p[s->want - 1] > EPS_MAX_NDIM) return fail(s, EPS_ERR_NDIM);
        s->tensor.ndim = p[s->want - 1];
        return expect(s, S_DIMS, 4u * s->tensor.ndim + 4) ? EPS_STREAM_MORE : EPS_STREAM_FAILED;
    case S_DIMS:
        read_dims(p, &s->tensor);
        s->tensor.payload = NULL;
        s->total += s->tensor.elements;
        if (s->tensor.elements > s->limit || s->total > s->limit) return fail(s, EPS_ERR_TENSORS);
        if (s->tensor.length > s->len - s->got - 4) return fail(s, EPS_ERR_SHORT);
        s->dest = NULL;
        s->phase = S_PAYLOAD;
        s->payload_left = s->tensor.length;
        if (s->payload_left) return EPS_STREAM_TENSOR;
        s->index++; /* an empty payload: its record is said, then the next one read */
        return next_record(s, EPS_STREAM_TENSOR);
    case S_CRC:
        s->phase = S_END;
        if (eps_get_u32(p) != s->crc) return fail(s, EPS_ERR_CRC);
        s->done = 1;
        return EPS_STREAM_DONE;
    }
    return fail(s, EPS_ERR_SHORT);
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

void eps_writer_compact_topk(eps_writer *w, uint16_t tensors, const float *values, uint32_t n, const uint8_t **payload,
                             size_t *payload_len) {
    if (w->error != EPS_OK) return;
    if (w->codec.id != EPS_TOPK || w->count != 0) {
        w->error = EPS_ERR_CODEC;
        return;
    }
    uint8_t *at = room(w, 0);
    if (at == NULL) return;
    size_t written = 0, gap = 4; /* the payload is encoded after 4 bytes kept for its length, then moved up */
    eps_status st = w->cap - w->len < gap ? EPS_ERR_SPACE
                                          : eps_topk_encode_compact(w->codec.arg, values, n, at + gap,
                                                                    w->cap - w->len - gap, &written);
    if (st == EPS_OK && written >= (size_t)1 << 28) st = EPS_ERR_SPACE;
    if (st != EPS_OK) {
        w->error = st;
        return;
    }
    size_t varint = 0;
    for (size_t v = written; v >= 0x80; v >>= 7) at[varint++] = (uint8_t)(v | 0x80);
    at[varint] = (uint8_t)(written >> (7 * varint));
    varint++;
    for (size_t i = 0; i < written; i++) at[varint + i] = at[gap + i]; /* moved down: forward is safe */
    w->buf[7] = EPS_FLAG_COMPACT;
    w->len += varint + written;
    w->count = tensors;
    *payload = at + varint;
    *payload_len = written;
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
