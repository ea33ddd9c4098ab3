/* The SDK's small JSON reader (src/json.c). Internal. */
#ifndef EDGEPS_JSON_H
#define EDGEPS_JSON_H

#include <stddef.h>
#include <stdint.h>

typedef enum { EPS_JSON_STRING, EPS_JSON_NUMBER, EPS_JSON_BOOL, EPS_JSON_NULL, EPS_JSON_NESTED } eps_json_type;

typedef struct {
    const char *p;
    size_t len, pos;
    int first;
} eps_json;

/* One member of an object: its key, and its value's text (a string's without its quotes). */
typedef struct {
    const char *key;
    size_t key_len;
    eps_json_type type;
    const char *start;
    size_t len;
} eps_json_value;

/* Start reading the object in text; 0 if it does not start with '{'. */
int eps_json_begin(eps_json *j, const char *text, size_t len);
/* The next member: 1, 0 at the object's end, -1 if the text is not valid JSON. */
int eps_json_member(eps_json *j, eps_json_value *v);
int eps_json_is(const eps_json_value *v, const char *key);
/* A string without escapes into out (cap bytes, terminated); 0 otherwise. */
int eps_json_string(const eps_json_value *v, char *out, size_t cap);
/* A JSON number (its grammar exactly: no NaN, Infinity, hex or leading '+'), finite in binary64
 * (within a few units in the last place; exact for up to 15 digits and powers of ten to 22); 0
 * otherwise. No strtod: the SDK's own parser, which allocates nothing. */
int eps_parse_number(const char *text, size_t len, double *out);
int eps_json_number(const eps_json_value *v, double *out);
/* An integer 0 .. 2^53 - 1 written as digits only; 0 for anything else (a fraction, an exponent,
 * a sign, a larger value). */
int eps_json_uint(const eps_json_value *v, uint64_t *out);
int eps_json_bool(const eps_json_value *v, int *out);

#endif /* EDGEPS_JSON_H */
