/* The reference trainer of docs/PROTOCOL.md §6 (learning/model.py in Python): a ReLU MLP with
 * any loss of learning/losses.py, one SGD step at a time, in float32, in place. Each layer's weights are
 * updated right after the error is carried back through them, so no gradient buffer is needed. */
#include <math.h>
#include <string.h>

#include "edgeps.h"
#include "size.h"

/* "dense{i}.w" or "dense{i}.b": the layer i and the kind ('w' or 'b'); 0 if the name is neither. */
static int dense_name(const char *name, uint32_t *layer, char *kind) {
    if (strncmp(name, "dense", 5) != 0) return 0;
    uint32_t i = 0;
    const char *p = name + 5;
    if (*p < '0' || *p > '9' || (p[0] == '0' && p[1] != '.')) return 0;
    for (; *p >= '0' && *p <= '9'; p++) {
        i = i * 10 + (uint32_t)(*p - '0');
        if (i >= EPS_MAX_LAYERS) return 0;
    }
    if (p[0] != '.' || (p[1] != 'w' && p[1] != 'b') || p[2] != '\0') return 0;
    *layer = i;
    *kind = p[1];
    return 1;
}

void eps_mlp_shape_begin(eps_mlp_shape *s) { memset(s, 0, sizeof *s); }

void eps_mlp_shape_add(eps_mlp_shape *s, const eps_tensor *t) {
    uint32_t i;
    char kind;
    if (s->seen == 0) memcpy(s->first, t->name, sizeof s->first);
    if (!dense_name(t->name, &i, &kind)) {
        s->bad = 1;
    } else if (kind == 'w') {
        if (t->ndim != 2 || t->dims[0] == 0 || t->dims[1] == 0 || s->in[i]) s->bad = 1;
        s->in[i] = t->dims[0];
        s->out[i] = t->dims[1];
    } else {
        if (t->ndim != 1 || t->dims[0] == 0 || s->bias[i]) s->bad = 1;
        s->bias[i] = t->dims[0];
    }
    s->seen++;
}

eps_status eps_mlp_shape_end(const eps_mlp_shape *s, eps_mlp *mlp) {
    memset(mlp, 0, sizeof *mlp); /* the sizes past the last layer too: shapes are compared whole */
    mlp->layers = s->seen / 2;
    if (s->bad || s->seen == 0 || s->seen % 2 || mlp->layers > EPS_MAX_LAYERS) return EPS_ERR_NAME;
    for (uint32_t i = 0; i < mlp->layers; i++) {
        if (s->in[i] == 0 || s->bias[i] != s->out[i] || (i > 0 && s->in[i] != s->out[i - 1])) return EPS_ERR_NAME;
        mlp->sizes[i] = s->in[i];
        mlp->sizes[i + 1] = s->out[i];
    }
    return EPS_OK;
}

eps_status eps_mlp_from_frame(const eps_frame *frame, eps_mlp *mlp) {
    eps_mlp_shape shape;
    eps_tensor t;
    size_t cursor = 0;
    eps_mlp_shape_begin(&shape);
    while (eps_frame_next(frame, &cursor, &t)) eps_mlp_shape_add(&shape, &t);
    return eps_mlp_shape_end(&shape, mlp);
}

size_t eps_mlp_weight_at(const eps_mlp *m, uint32_t layer) {
    size_t at = 0;
    for (uint32_t i = 0; i < layer; i++) at = eps_size_add(at, eps_size_mad(m->sizes[i], m->sizes[i + 1], m->sizes[i + 1]));
    return at;
}

size_t eps_mlp_bias_at(const eps_mlp *m, uint32_t layer) {
    return eps_size_add(eps_mlp_weight_at(m, layer), eps_size_mul(m->sizes[layer], m->sizes[layer + 1]));
}

size_t eps_mlp_params(const eps_mlp *m) { return eps_mlp_weight_at(m, m->layers); }

static size_t hidden_width(const eps_mlp *m) {
    size_t hidden = 0;
    for (uint32_t i = 1; i < m->layers; i++) hidden = eps_size_add(hidden, m->sizes[i]);
    return hidden;
}

static size_t widest(const eps_mlp *m) {
    size_t wide = 0;
    for (uint32_t i = 1; i <= m->layers; i++) wide = m->sizes[i] > wide ? m->sizes[i] : wide;
    return wide;
}

size_t eps_mlp_scratch(const eps_mlp *m, uint32_t batch) {
    return eps_size_mul(batch, eps_size_add(hidden_width(m), eps_size_mul(2, widest(m))));
}

int eps_loss_from_name(const char *name, size_t len, eps_loss *loss) {
    static const char *const names[] = {"cross_entropy", "bce", "mse", "mae"};
    for (int i = 0; i < 4; i++)
        if (strlen(names[i]) == len && memcmp(names[i], name, len) == 0) {
            *loss = (eps_loss)i;
            return 1;
        }
    return 0;
}

/* Whether y[0..batch) fits the loss on a model of `outputs` outputs. */
static int fits(eps_loss loss, const float *y, uint32_t batch, uint32_t outputs) {
    if (loss == EPS_LOSS_CROSS_ENTROPY ? outputs < 2 : outputs != 1) return 0;
    const float top = loss == EPS_LOSS_CROSS_ENTROPY ? (float)(outputs - 1) : 1.0f;
    for (uint32_t n = 0; n < batch; n++) {
        if (!isfinite(y[n])) return 0;
        if (loss <= EPS_LOSS_BCE && (y[n] < 0.0f || y[n] > top || y[n] != floorf(y[n]))) return 0;
    }
    return 1;
}

/* The batch's summed loss of outputs z (batch x outputs); z becomes d (mean loss) / d z. */
static float loss_and_delta(eps_loss loss, float *z, const float *y, uint32_t batch, uint32_t outputs) {
    float total = 0.0f;
    for (uint32_t n = 0; n < batch; n++) {
        float *row = z + (size_t)n * outputs;
        if (loss == EPS_LOSS_CROSS_ENTROPY) {
            const uint32_t label = (uint32_t)y[n];
            float top = row[0], sum = 0.0f;
            for (uint32_t c = 1; c < outputs; c++) top = row[c] > top ? row[c] : top;
            for (uint32_t c = 0; c < outputs; c++) sum += expf(row[c] - top);
            const float lse = logf(sum);
            total -= row[label] - top - lse;
            for (uint32_t c = 0; c < outputs; c++) row[c] = expf(row[c] - top - lse);
            row[label] -= 1.0f;
        } else if (loss == EPS_LOSS_BCE) { /* log(1 + e^-|z|) + max(z, 0) - z y; d/dz = sigmoid(z) - y */
            const float v = row[0];
            total += log1pf(expf(-fabsf(v))) + (v > 0.0f ? v : 0.0f) - v * y[n];
            row[0] = 0.5f * (1.0f + tanhf(0.5f * v)) - y[n];
        } else {
            const float error = row[0] - y[n];
            total += loss == EPS_LOSS_MSE ? error * error : fabsf(error);
            row[0] = loss == EPS_LOSS_MSE ? 2.0f * error : (float)((error > 0.0f) - (error < 0.0f));
        }
        for (uint32_t c = 0; c < outputs; c++) row[c] /= (float)batch;
    }
    return total;
}

float eps_mlp_step(const eps_mlp *m, float *params, const float *x, const float *y, uint32_t batch, float lr,
                   eps_loss loss_kind, float *scratch) {
    const uint32_t L = m->layers, classes = m->sizes[L];
    const float *act[EPS_MAX_LAYERS]; /* act[i]: the input of layer i (batch x sizes[i]) */
    float *d0 = scratch + (size_t)batch * hidden_width(m), *d1 = d0 + (size_t)batch * widest(m);
    if (!fits(loss_kind, y, batch, classes)) return -1.0f;
    act[0] = x;
    float *next = scratch;
    for (uint32_t i = 0; i < L; i++) { /* forward: h = act @ w + b, ReLU between layers; logits into d0 */
        const uint32_t fan_in = m->sizes[i], fan_out = m->sizes[i + 1];
        const float *w = params + eps_mlp_weight_at(m, i), *b = params + eps_mlp_bias_at(m, i);
        float *h = i + 1 < L ? next : d0;
        for (uint32_t n = 0; n < batch; n++) {
            float *row = h + (size_t)n * fan_out;
            const float *a = act[i] + (size_t)n * fan_in;
            for (uint32_t o = 0; o < fan_out; o++) row[o] = 0.0f;
            for (uint32_t k = 0; k < fan_in; k++) {
                const float v = a[k], *wk = w + (size_t)k * fan_out;
                if (v != 0.0f)
                    for (uint32_t o = 0; o < fan_out; o++) row[o] += v * wk[o];
            }
            for (uint32_t o = 0; o < fan_out; o++) {
                row[o] += b[o];
                if (i + 1 < L && row[o] < 0.0f) row[o] = 0.0f;
            }
        }
        if (i + 1 < L) {
            act[i + 1] = h;
            next = h + (size_t)batch * fan_out;
        }
    }
    const float loss = loss_and_delta(loss_kind, d0, y, batch, classes); /* d0 becomes d loss / d outputs */
    float *delta = d0, *spare = d1;
    for (uint32_t i = L; i-- > 0;) { /* backward: carry the error through w_i, then update w_i and b_i */
        const uint32_t fan_in = m->sizes[i], fan_out = m->sizes[i + 1];
        float *w = params + eps_mlp_weight_at(m, i), *b = params + eps_mlp_bias_at(m, i);
        const float *a = act[i];
        if (i > 0)
            for (uint32_t n = 0; n < batch; n++)
                for (uint32_t k = 0; k < fan_in; k++) {
                    float sum = 0.0f;
                    const float *wk = w + (size_t)k * fan_out, *dn = delta + (size_t)n * fan_out;
                    for (uint32_t o = 0; o < fan_out; o++) sum += dn[o] * wk[o];
                    spare[(size_t)n * fan_in + k] = a[(size_t)n * fan_in + k] > 0.0f ? sum : 0.0f;
                }
        for (uint32_t k = 0; k < fan_in; k++) {
            float *wk = w + (size_t)k * fan_out;
            for (uint32_t o = 0; o < fan_out; o++) {
                float g = 0.0f;
                for (uint32_t n = 0; n < batch; n++) g += a[(size_t)n * fan_in + k] * delta[(size_t)n * fan_out + o];
                wk[o] -= lr * g;
            }
        }
        for (uint32_t o = 0; o < fan_out; o++) {
            float g = 0.0f;
            for (uint32_t n = 0; n < batch; n++) g += delta[(size_t)n * fan_out + o];
            b[o] -= lr * g;
        }
        float *swap = delta;
        delta = spare;
        spare = swap;
    }
    return loss / (float)batch;
}
