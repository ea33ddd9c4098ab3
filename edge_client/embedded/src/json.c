/* A small JSON reader for the server's flat messages (Control, Barrier, Notice): the members of
 * one top-level object, one at a time; nested values are skipped, so unknown fields of any shape
 * are tolerated (docs/PROTOCOL.md: devices ignore fields they do not know). Numbers are read by
 * the SDK's own parser (no strtod, whose newlib version allocates): JSON's grammar exactly, so
 * "NaN", "-nan" and "Infinity" are not numbers, and a value is range-checked before any cast. No
 * allocation. */
#include <float.h>
#include <string.h>

#include "edgeps.h"
#include "json.h"

static void skip_space(eps_json *j) {
    while (j->pos < j->len && (j->p[j->pos] == ' ' || j->p[j->pos] == '\t' || j->p[j->pos] == '\n' ||
                               j->p[j->pos] == '\r'))
        j->pos++;
}

static int peek(eps_json *j) {
    skip_space(j);
    return j->pos < j->len ? j->p[j->pos] : -1;
}

/* A string at pos (after its quote); its raw span, escapes kept. 0 if unterminated. */
static int string_span(eps_json *j, size_t *start, size_t *end) {
    *start = ++j->pos;
    while (j->pos < j->len) {
        char c = j->p[j->pos];
        if (c == '\\') j->pos += 2;
        else if (c == '"') {
            *end = j->pos++;
            return 1;
        } else if ((unsigned char)c < 0x20) return 0;
        else j->pos++;
    }
    return 0;
}

/* The length of the JSON number at p (-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?), 0 if none. */
static size_t number_span(const char *p, size_t len) {
    size_t i = 0, digits;
    if (i < len && p[i] == '-') i++;
    if (i < len && p[i] == '0') i++;
    else if (i < len && p[i] >= '1' && p[i] <= '9')
        while (i < len && p[i] >= '0' && p[i] <= '9') i++;
    else return 0;
    if (i < len && p[i] == '.') {
        for (digits = 0, i++; i < len && p[i] >= '0' && p[i] <= '9'; i++) digits++;
        if (digits == 0) return 0;
    }
    if (i < len && (p[i] == 'e' || p[i] == 'E')) {
        i++;
        if (i < len && (p[i] == '+' || p[i] == '-')) i++;
        for (digits = 0; i < len && p[i] >= '0' && p[i] <= '9'; i++) digits++;
        if (digits == 0) return 0;
    }
    return i;
}

/* Powers of ten that are exact in binary64 (10^0 .. 10^22). */
static const double EXACT[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* m * 10^e for e beyond the exact powers: by 10^22 steps (a few units in the last place). */
static double scaled(double m, int e) {
    for (; e > 22; e -= 22) m *= 1e22; /* |e| <= 420: a bounded loop; an overflow stays infinite */
    for (; e < -22; e += 22) m /= 1e22;
    return e >= 0 ? m * EXACT[e] : m / EXACT[-e];
}

int eps_parse_number(const char *p, size_t len, double *out) {
    uint64_t mantissa = 0;
    long exponent = 0, e = 0;
    int negative = 0, exp_negative = 0, digits = 0;
    size_t i = 0;
    if (len == 0 || number_span(p, len) != len) return 0;
    if (p[i] == '-') negative = 1, i++;
    for (; i < len && p[i] >= '0' && p[i] <= '9'; i++) /* 19 significant digits fit; the rest scale */
        if (digits < 19) mantissa = mantissa * 10 + (uint64_t)(p[i] - '0'), digits += mantissa != 0;
        else exponent++;
    if (i < len && p[i] == '.')
        for (i++; i < len && p[i] >= '0' && p[i] <= '9'; i++)
            if (digits < 19) mantissa = mantissa * 10 + (uint64_t)(p[i] - '0'), digits += mantissa != 0, exponent--;
    if (i < len) { /* the exponent, bounded: 1e-99999 is 0, 1e99999 infinite */
        i++;
        if (p[i] == '+' || p[i] == '-') exp_negative = p[i++] == '-';
        for (; i < len; i++) e = e < 100000 ? e * 10 + (p[i] - '0') : e;
        exponent += exp_negative ? -e : e;
    }
    if (mantissa != 0 && exponent > 400) return 0; /* far beyond binary64 */
    double v = mantissa == 0 || exponent < -400 ? 0.0 : scaled((double)mantissa, (int)exponent);
    if (!(v <= DBL_MAX)) return 0; /* overflowed: not a finite number */
    *out = negative ? -v : v;
    return 1;
}

/* Skip one value of any kind; 0 if it is not valid JSON (depth bounded). */
static int skip_value(eps_json *j, int depth) {
    size_t a, b;
    int c = peek(j);
    if (depth > 16) return 0;
    if (c == '"') return string_span(j, &a, &b);
    if (c == '{' || c == '[') {
        int close = c == '{' ? '}' : ']';
        j->pos++;
        if (peek(j) == close) {
            j->pos++;
            return 1;
        }
        for (;;) {
            if (c == '{') {
                if (peek(j) != '"' || !string_span(j, &a, &b) || peek(j) != ':') return 0;
                j->pos++;
            }
            if (!skip_value(j, depth + 1)) return 0;
            int next = peek(j);
            j->pos++;
            if (next == close) return 1;
            if (next != ',') return 0;
        }
    }
    static const char *const words[] = {"true", "false", "null"};
    for (size_t i = 0; i < 3; i++) {
        size_t n = strlen(words[i]);
        if (j->len - j->pos >= n && memcmp(j->p + j->pos, words[i], n) == 0) {
            j->pos += n;
            return 1;
        }
    }
    size_t n = number_span(j->p + j->pos, j->len - j->pos);
    j->pos += n;
    return n > 0;
}

int eps_json_begin(eps_json *j, const char *text, size_t len) {
    j->p = text;
    j->len = len;
    j->pos = 0;
    j->first = 1;
    if (peek(j) != '{') return 0;
    j->pos++;
    return 1;
}

int eps_json_member(eps_json *j, eps_json_value *v) {
    int c = peek(j);
    if (c == '}') return 0;
    if (!j->first) {
        if (c != ',') return -1;
        j->pos++;
        c = peek(j);
    }
    j->first = 0;
    size_t a, b;
    if (c != '"' || !string_span(j, &a, &b) || peek(j) != ':') return -1;
    j->pos++;
    v->key = j->p + a;
    v->key_len = b - a;
    c = peek(j);
    v->start = j->p + j->pos;
    if (c == '"') {
        if (!string_span(j, &a, &b)) return -1;
        v->type = EPS_JSON_STRING;
        v->start = j->p + a;
        v->len = b - a;
        return 1;
    }
    size_t from = j->pos;
    if (!skip_value(j, 0)) return -1;
    v->len = j->pos - from;
    v->type = c == '{' || c == '[' ? EPS_JSON_NESTED
              : c == 't' || c == 'f' ? EPS_JSON_BOOL
              : c == 'n' ? EPS_JSON_NULL
                         : EPS_JSON_NUMBER;
    return 1;
}

int eps_json_is(const eps_json_value *v, const char *key) {
    return strlen(key) == v->key_len && memcmp(v->key, key, v->key_len) == 0;
}

int eps_json_string(const eps_json_value *v, char *out, size_t cap) {
    if (v->type != EPS_JSON_STRING || v->len >= cap || memchr(v->start, '\\', v->len) != NULL) return 0;
    memcpy(out, v->start, v->len);
    out[v->len] = '\0';
    return 1;
}

int eps_json_number(const eps_json_value *v, double *out) {
    return v->type == EPS_JSON_NUMBER && eps_parse_number(v->start, v->len, out);
}

int eps_json_uint(const eps_json_value *v, uint64_t *out) {
    uint64_t n = 0; /* digits only (no sign, fraction or exponent), at most 2^53 - 1: 16 digits */
    if (v->type != EPS_JSON_NUMBER || v->len == 0 || v->len > 16 || (v->start[0] == '0' && v->len > 1)) return 0;
    for (size_t i = 0; i < v->len; i++) {
        if (v->start[i] < '0' || v->start[i] > '9') return 0;
        n = n * 10 + (uint64_t)(v->start[i] - '0');
    }
    if (n > 9007199254740991u) return 0;
    *out = n;
    return 1;
}

int eps_json_bool(const eps_json_value *v, int *out) {
    if (v->type != EPS_JSON_BOOL) return 0;
    *out = v->len == 4 && memcmp(v->start, "true", 4) == 0;
    return *out || (v->len == 5 && memcmp(v->start, "false", 5) == 0);
}
