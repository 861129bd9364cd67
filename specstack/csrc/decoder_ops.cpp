// The small operations of a Llama-family decoder layer, one call each instead of transformers' chains
// of tensor operations (specstack/decoder_ops.py): the residual add fused with the RMSNorm after it,
// and the rotary embedding of a layer's queries and keys in place.
//
// Each follows transformers' arithmetic and its roundings: bf16 tensors are computed in float32 and
// rounded to bf16 (to nearest, ties to even) wherever transformers' bf16 operations round, so the
// residual add and the rotation give transformers' bits; the norm's mean of squares is summed in
// another order, so the norm may differ in a float32 last place.
// Every row is computed on its own, the same way whatever the number of rows. Floating-point
// contraction is off (GCC contracts a * b + c into one fused rounding by default in C++): a * b + c
// is two roundings, as in torch's elementwise kernels.

#pragma GCC optimize("fp-contract=off")

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float x;
    std::memcpy(&x, &bits, 4);
    return x;
}

inline uint16_t to_bf16(float x) {  // round to nearest even, NaN kept a NaN (torch's c10::BFloat16)
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if (std::isnan(x)) return 0x7fc0;
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

inline float round_bf16(float x) { return from_bf16(to_bf16(x)); }

// Element i of a row as float32, and storing one: p is a row of float32 (bf16 == 0) or bfloat16.
inline float get(const void *p, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

inline void put(void *p, int64_t i, float x, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = to_bf16(x);
    else ((float *)p)[i] = x;
}

// add_rms_norm (below) in one dtype. Each row's squares are summed front to back; the sums of up to SUM_ROWS rows
// advance side by side, so that their additions overlap instead of each waiting on the last (a verify's rows took as
// long each as a step's one). The add and the scaling are element by element, in loops the compiler can vectorize.
constexpr int SUM_ROWS = 16;

template <int BF16>
void add_rms_norm_as(void *hidden, const void *delta, const void *weight, void *normed, int rows, int width, float eps) {
    const int64_t count = (int64_t)rows * width;
    if (delta)
        for (int64_t i = 0; i < count; ++i) {
            float h = get(hidden, i, BF16) + get(delta, i, BF16);
            put(hidden, i, BF16 ? round_bf16(h) : h, BF16);
        }
    for (int r0 = 0; r0 < rows; r0 += SUM_ROWS) {
        const int m = rows - r0 < SUM_ROWS ? rows - r0 : SUM_ROWS;
        float sums[SUM_ROWS] = {};
        for (int i = 0; i < width; ++i)
            for (int r = 0; r < m; ++r) {
                const float h = get(hidden, (int64_t)(r0 + r) * width + i, BF16);
                sums[r] += h * h;
            }
        for (int r = 0; r < m; ++r) {
            const int64_t base = (int64_t)(r0 + r) * width;
            const float scale = 1.0f / std::sqrt(sums[r] / (float)width + eps);
            for (int i = 0; i < width; ++i) {
                float y = get(hidden, base + i, BF16) * scale;
                if (BF16) y = round_bf16(y);
                put(normed, base + i, get(weight, i, BF16) * y, BF16);
            }
        }
    }
}

}  // namespace

extern "C" {

// For each of rows rows of width: hidden += delta (when delta is not null; one rounding, as torch's add),
// then normed = weight * dtype(h * rsqrt(mean(h^2) + eps)) with h the row in float32 (LlamaRMSNorm).
int add_rms_norm(void *hidden, const void *delta, const void *weight, void *normed, int rows, int width, float eps, int bf16) {
    if (bf16)
        add_rms_norm_as<1>(hidden, delta, weight, normed, rows, width, eps);
    else
        add_rms_norm_as<0>(hidden, delta, weight, normed, rows, width, eps);
    return 0;
}

// x = x * cos + rotate_half(x) * sin in place for the first heads heads (of dim each) of each of rows rows
// of x (row stride stride elements); cos and sin hold one row of dim per token (transformers' rotary
// embedding, rotate_half(x) = (-x2, x1) for x = (x1, x2)).
int rotate(void *x, const void *cos, const void *sin, int rows, int heads, int dim, int64_t stride, int bf16) {
    int half = dim / 2;
    float pair[512];
    if (dim > 512) return 1;
    for (int r = 0; r < rows; ++r) {
        for (int h = 0; h < heads; ++h) {
            int64_t base = (int64_t)r * stride + (int64_t)h * dim;
            for (int i = 0; i < dim; ++i) pair[i] = get(x, base + i, bf16);
            for (int i = 0; i < dim; ++i) {
                float c = get(cos, (int64_t)r * dim + i, bf16), s = get(sin, (int64_t)r * dim + i, bf16);
                float other = i < half ? -pair[i + half] : pair[i - half];
                float a = pair[i] * c, b = other * s;
                if (bf16) a = round_bf16(a), b = round_bf16(b);
                put(x, base + i, a + b, bf16);
            }
        }
    }
    return 0;
}

}  // extern "C"
