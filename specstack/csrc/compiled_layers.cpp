// A Llama-family decoder layer's compiled kernels chained in C, one call per layer instead of some
// thirty Python and torch calls (specstack/compiled_layers.py).
//
// Every operation is a call to the kernel the lean decoder (specstack/decoder.py) already calls for it,
// with the same arguments: the residual add fused with the RMSNorm and the rotation
// (csrc/decoder_ops.cpp), the few-row products (csrc/linear_rows.cpp, whichever entry reads the
// product's stored weight), the attention of a few tokens over the cache (csrc/decode_attention.cpp).
// Python hands their addresses over once (ctypes), so this file holds none of their arithmetic and
// only moves rows between them: the new keys and values into the KV store, the queries into the
// attention kernel's layout and its output back. A forward through here therefore gives the lean
// decoder's bits. The MLP's activation is torch's: either the caller applies it between two calls
// (specstack_layer_step: a layer's call begins with the previous layer's down product and ends with this
// layer's gate and up products), or, in bfloat16, a table holds its output for each of the 65,536 bf16
// inputs as torch's kernel computed it, which the caller checked against that kernel on rows of the layer's
// width (specstack_tabled_act), and the whole forward is one call (specstack_forward). float32, or bfloat16
// (rows, weights, norms and cache; the attention kernel's queries widened to float32 and its output rounded to
// bfloat16 to nearest even, as the lean decoder's .float() and .to(bfloat16) do).

#include <stdint.h>
#include <string.h>

#include "bf16.h"

namespace {

// d numbers of a row of the model's dtype as float32 (a query into the attention kernel's layout).
inline void row_to_float(const char *row, bool bf16, int d, float *out) {
    if (!bf16) {
        memcpy(out, row, sizeof(float) * d);
        return;
    }
    for (int c = 0; c < d; ++c) out[c] = bf16_to_float(((const uint16_t *)row)[c]);
}

// d float32 numbers as a row of the model's dtype (the attention kernel's output into o's input).
inline void row_from_float(const float *row, bool bf16, int d, char *out) {
    if (!bf16) {
        memcpy(out, row, sizeof(float) * d);
        return;
    }
    for (int c = 0; c < d; ++c) ((uint16_t *)out)[c] = float_to_bf16(row[c]);
}

// a * b rounded to bfloat16 as torch's bf16 multiply on the CPU rounds it: the float32 product (exact: two bf16
// numbers' product has at most 16 significant bits) to nearest even, a NaN as 0xFFFF.
inline uint16_t bf16_product(uint16_t a, uint16_t b) {
    const float product = bf16_to_float(a) * bf16_to_float(b);
    return product != product ? (uint16_t)0xFFFF : float_to_bf16(product);
}

typedef int (*linear_fn)(const void *w, const void *x, const void *bias, void *y, int n, int64_t out, int64_t in, int threads);
typedef int (*norm_fn)(void *hidden, const void *delta, const void *weight, void *normed, int rows, int width, float eps, int bf16);
typedef int (*rotate_fn)(void *x, const void *cos, const void *sin, int rows, int heads, int dim, int64_t stride, int bf16);
typedef int (*attend_fn)(const float *q, const void *k, const void *v, int64_t k_head_stride, int64_t v_head_stride, int hkv, int rows,
                         int t, int d, int64_t n, const uint8_t *sees, float scale, float *out, int threads, int kv_bf16, int amx, int dp,
                         uint32_t *columns, int64_t columns_head_stride, int64_t *columns_upto);  // specstack_decode_attention_columns

// The row of query head `head`, token i, in the attention kernel's layout [kv_heads, group * t, d]: head
// h * group + g is row g * t + i of KV head h.
inline int64_t kernel_row(int head, int i, int group, int t) { return (int64_t)(head / group) * group * t + (int64_t)(head % group) * t + i; }

}  // namespace

extern "C" {

// One product y = W x + b: the kernel entry that reads the weight as stored, and what it reads.
struct Product {
    linear_fn entry;
    const void *weight;  // the weight [out, in] in the model's dtype, or its blocks in the entry's format
    const void *bias;    // [out] or null
    int64_t out, in;
};

// One layer: its four products (q/k/v and gate/up fused, as the lean decoder fuses them) and its norms.
struct Layer {
    Product qkv, o, gate_up, down;
    const void *input_norm, *post_norm;  // [hidden]
    float input_eps, post_eps, scale;     // the norms' epsilons, the attention's scaling
    const uint16_t *act_table;            // [65536] bf16: the activation of each bf16 input (specstack_forward), or null
};

// The model: the kernels, the shapes, the layers and the final norm.
struct Model {
    norm_fn add_norm;
    rotate_fn rotate;
    attend_fn attend;
    const Layer *layers;
    int count, heads, kv_heads, head_dim, hidden, inner;
    const void *final_norm;
    float final_eps;
    int bf16;  // rows, weights, norms and cache in bfloat16; 0: float32
};

// One forward of t tokens: its rows (in the model's dtype but for the attention kernel's float32 query
// and output), the KV store it writes, its scratch.
struct Step {
    int t, threads;
    int64_t cached;  // slots in the store before this forward: the new keys go to cached ... cached + t - 1
    void *hidden;    // [t, hidden] the residual stream, updated in place
    void *normed;    // [t, hidden] a norm's output (after the last layer: the decoder's output)
    void *delta;     // [t, hidden] a product's output added to the residual stream
    void *qkv;       // [t, heads + 2 kv_heads, head_dim]
    float *query;    // [kv_heads, group * t, head_dim] the attention kernel's layout: row g * t + i, head g of the group, token i
    float *attended; // [kv_heads, group * t, head_dim] its output
    void *merged;    // [t, heads * head_dim] the same, token by token: o's input
    void *gate_up;   // [t, 2 inner]: the activation's input (gate) and up
    void *act;       // [t, inner] the previous layer's activation times up (down's input)
    const void *cos, *sin;  // [t, head_dim]
    const uint8_t *sees;    // [t, t] among the new tokens, or null for a chain
    void *keys, *values, *written;  // the store's [layers, kv_heads, capacity, head_dim] buffers; written null where it keeps none
    int64_t capacity;
    uint32_t *columns;      // the store's keys by groups [layers, kv_heads, capacity / 16, words, 16] (KVStore.key_columns), or null
    int64_t columns_layer_stride, columns_head_stride;  // in words
    int64_t *columns_upto;  // [layers] how many leading slots of each layer the groups hold current
    void *queries;   // [layers, heads, head_dim] the query log of a gathering level below, or null
    int query_row;   // the row whose queries it logs
    int amx, dp;     // the attention kernel's paths for a bfloat16 cache, as the lean decoder chooses them
};

// Layer `layer` of the forward (0 <= layer <= count): the previous layer's down product and residual add
// (none before the first), the norm (the final norm at layer == count, which ends the forward), then
// q/k/v, rotation, the store's writes, attention, o, the residual add and norm, gate and up. Returns
// 0, or the failing kernel's status (nonzero).
int specstack_layer_step(const Model *m, const Step *s, int layer) {
    const int t = s->t, d = m->head_dim, hq = m->heads, hkv = m->kv_heads, group = hq / hkv, width = hq + 2 * hkv;
    const bool bf16 = m->bf16 != 0;
    const size_t elem = bf16 ? 2 : 4, row_bytes = elem * d;
    int status = 0;
    const void *delta = nullptr;
    if (layer > 0) {
        const Product &down = m->layers[layer - 1].down;
        if ((status = down.entry(down.weight, s->act, down.bias, s->delta, t, down.out, down.in, s->threads))) return status;
        delta = s->delta;
    }
    if (layer == m->count) return m->add_norm(s->hidden, delta, m->final_norm, s->normed, t, m->hidden, m->final_eps, bf16);
    const Layer &l = m->layers[layer];
    if ((status = m->add_norm(s->hidden, delta, l.input_norm, s->normed, t, m->hidden, l.input_eps, bf16))) return status;
    if ((status = l.qkv.entry(l.qkv.weight, s->normed, l.qkv.bias, s->qkv, t, l.qkv.out, l.qkv.in, s->threads))) return status;
    if ((status = m->rotate(s->qkv, s->cos, s->sin, t, hq + hkv, d, (int64_t)width * d, bf16))) return status;

    const int64_t head_stride = s->capacity * d, layer_stride = hkv * head_stride;  // in numbers
    char *keys = (char *)s->keys + layer * layer_stride * elem, *values = (char *)s->values + layer * layer_stride * elem;
    const char *qkv = (const char *)s->qkv;
    for (int i = 0; i < t; ++i) {
        const char *token = qkv + (int64_t)i * width * row_bytes;  // [width, d]
        for (int h = 0; h < hkv; ++h) {
            const int64_t slot = (h * head_stride + (s->cached + i) * d) * elem;
            memcpy(keys + slot, token + (hq + h) * row_bytes, row_bytes);
            memcpy(values + slot, token + (hq + hkv + h) * row_bytes, row_bytes);
            if (s->written) memcpy((char *)s->written + layer * layer_stride * elem + slot, token + (hq + h) * row_bytes, row_bytes);
        }
        for (int head = 0; head < hq; ++head) row_to_float(token + head * row_bytes, bf16, d, s->query + kernel_row(head, i, group, t) * d);
    }
    if (s->queries) memcpy((char *)s->queries + (int64_t)layer * hq * row_bytes, qkv + (int64_t)s->query_row * width * row_bytes, row_bytes * hq);

    if ((status = m->attend(s->query, keys, values, head_stride, head_stride, hkv, group * t, t, d, s->cached + t, s->sees, l.scale,
                            s->attended, s->threads, bf16, s->amx, s->dp, s->columns ? s->columns + layer * s->columns_layer_stride : nullptr,
                            s->columns_head_stride, s->columns ? s->columns_upto + layer : nullptr)))
        return status;
    for (int head = 0; head < hq; ++head)  // back to token by token, heads side by side
        for (int i = 0; i < t; ++i)
            row_from_float(s->attended + kernel_row(head, i, group, t) * d, bf16, d, (char *)s->merged + ((int64_t)i * hq + head) * row_bytes);
    if ((status = l.o.entry(l.o.weight, s->merged, l.o.bias, s->delta, t, l.o.out, l.o.in, s->threads))) return status;
    if ((status = m->add_norm(s->hidden, s->delta, l.post_norm, s->normed, t, m->hidden, l.post_eps, bf16))) return status;
    return l.gate_up.entry(l.gate_up.weight, s->normed, l.gate_up.bias, s->gate_up, t, l.gate_up.out, l.gate_up.in, s->threads);
}

// act[i] = table[gate[i]] * up[i] for t rows of gate_up [t, 2 inner] (gate the first inner numbers of a row, up the
// rest), act [t, inner], bfloat16: the activation read from its table, the product rounded as torch's bf16 multiply.
// Rows are shared among `threads` threads where there are several (a verify's, which the other thread had waited out).
void specstack_tabled_act(const uint16_t *table, const uint16_t *gate_up, uint16_t *act, int t, int inner, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (t > 1 && threads > 1)
    for (int i = 0; i < t; ++i) {
        const uint16_t *gate = gate_up + (int64_t)i * 2 * inner, *up = gate + inner;
        uint16_t *out = act + (int64_t)i * inner;
        for (int c = 0; c < inner; ++c) out[c] = bf16_product(table[gate[c]], up[c]);
    }
}

// A whole bfloat16 forward in one call, where every layer's activation has a table: each layer's step
// (specstack_layer_step), its activation times up into s->act, and the final norm. Returns 0, or the failing
// kernel's status (nonzero); -1 where a layer has no table or the model is not bfloat16.
int specstack_forward(const Model *m, const Step *s) {
    if (!m->bf16) return -1;
    for (int layer = 0; layer < m->count; ++layer)
        if (!m->layers[layer].act_table) return -1;
    for (int layer = 0; layer <= m->count; ++layer) {
        if (const int status = specstack_layer_step(m, s, layer)) return status;
        if (layer < m->count) specstack_tabled_act(m->layers[layer].act_table, (const uint16_t *)s->gate_up, (uint16_t *)s->act, s->t, m->inner, s->threads);
    }
    return 0;
}

}  // extern "C"
