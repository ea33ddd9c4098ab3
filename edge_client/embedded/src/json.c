/* A small JSON reader for the server's flat messages (Control, Barrier, Notice): the members of
 * one top-level object, one at a time; nested values are skipped, so unknown fields of any shape
 * are tolerated (docs/PROTOCOL.md: devices ignore fields they do not know). No allocation. */
#include <stdlib.h>
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
    size_t start = j->pos; /* a number, true, false or null */
    while (j->pos < j->len && j->p[j->pos] != '\0' && strchr("+-.0123456789eEtruefalsn", j->p[j->pos]) != NULL)
        j->pos++;
    return j->pos > start;
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
    char text[40];
    char *end = NULL;
    if (v->type != EPS_JSON_NUMBER || v->len >= sizeof text) return 0;
    memcpy(text, v->start, v->len);
    text[v->len] = '\0';
    *out = strtod(text, &end);
    return end == text + v->len;
}

int eps_json_uint(const eps_json_value *v, uint64_t *out) {
    double d;
    if (!eps_json_number(v, &d) || d < 0 || d > 9007199254740991.0 || d != (double)(uint64_t)d) return 0;
    *out = (uint64_t)d;
    return 1;
}

int eps_json_bool(const eps_json_value *v, int *out) {
    if (v->type != EPS_JSON_BOOL) return 0;
    *out = v->len == 4 && memcmp(v->start, "true", 4) == 0;
    return *out || (v->len == 5 && memcmp(v->start, "false", 5) == 0);
}
