// A few input rows through a linear layer on the CPU, float32 or bfloat16: y_j = W x_j + b
// (specstack/packed_linear.py).
//
// A forward of a few tokens reads every weight once and does two flops per weight and token, so up
// to a handful of tokens it is bound by how fast the weights stream from memory. Each thread takes its
// own blocks of ROWS output rows, streams those weight rows from memory once, eight columns at a
// time, and reuses them from L1 for every input row (two input rows at a time, then an odd last
// one). While it computes one block it asks for the next block's weights (software prefetch), so the
// stream from memory overlaps the arithmetic: measured on the 2-core Intel host, the target's 211
// matrices took 1.08x (one row) to 1.2x (four rows) less time in fp32, and 1.3x (one row) to 1.8x
// (four rows) less in bf16. Every output is one dot product summed in one fixed order, whatever the number of input rows
// or threads: a token's outputs are the same bits alone or in a verify of several. Built by
// specstack/native.py; plain C++ with GCC vector types, no torch headers.
//
// bfloat16 takes AVX-512's bf16 dot products (vdpbf16ps: pairs of bf16 products summed into float32
// lanes), so the weights stream at half the bytes and are never widened; each output is summed in
// float32 in one fixed order and rounded once to bf16 (to nearest even), bias included. Where the
// compiler targets no such instructions, specstack_linear_rows_bf16_supported() says 0.

#include <stdint.h>
#include <string.h>

#include <omp.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

typedef float v8 __attribute__((vector_size(32), aligned(4)));  // 8 floats, loads need no alignment

constexpr int ROWS = 4;  // weight rows streamed side by side
constexpr int MAX_BF16_ROWS = 16;  // bf16 input rows taken (four at a time over each block); packed_linear.py sends up to six

inline v8 load8(const float *p) { return *(const v8 *)p; }
// Ask for the cache line at column c of the ROWS weight rows after w0's block (each row `in` elements
// long). Past the last block this names addresses beyond the weights, which a prefetch never faults on.
template <typename T>
inline void prefetch_next_block(const T *w0, int64_t in, int64_t c) {
    const T *next = w0 + ROWS * in + c;
    for (int i = 0; i < ROWS; ++i) __builtin_prefetch(next + i * in, 0, 3);  // read, keep in every level (prefetcht0 on x86)
}

inline float hsum(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

// y[j, r .. r+3] = w_{r .. r+3} . x_j for the n input rows: pairs of input rows, then an odd last one.
void four_outputs(const float *w, const float *x, int n, int64_t in, int64_t out, int64_t r, float *y) {
    const float *w0 = w + r * in, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
    int j = 0;
    for (; j + 2 <= n; j += 2) {
        const float *x0 = x + j * in, *x1 = x0 + in;
        v8 a0{}, a1{}, a2{}, a3{}, b0{}, b1{}, b2{}, b3{};
        for (int64_t c = 0; c < in; c += 8) {
            if (j == 0 && c % 16 == 0) prefetch_next_block(w0, in, c);  // once per 64-byte line, on the first pass
            const v8 k0 = load8(w0 + c), k1 = load8(w1 + c), k2 = load8(w2 + c), k3 = load8(w3 + c);
            const v8 p = load8(x0 + c), q = load8(x1 + c);
            a0 += k0 * p, a1 += k1 * p, a2 += k2 * p, a3 += k3 * p;
            b0 += k0 * q, b1 += k1 * q, b2 += k2 * q, b3 += k3 * q;
        }
        float *y0 = y + j * out + r, *y1 = y0 + out;
        y0[0] = hsum(a0), y0[1] = hsum(a1), y0[2] = hsum(a2), y0[3] = hsum(a3);
        y1[0] = hsum(b0), y1[1] = hsum(b1), y1[2] = hsum(b2), y1[3] = hsum(b3);
    }
    if (j < n) {
        const float *x0 = x + j * in;
        v8 a0{}, a1{}, a2{}, a3{};
        for (int64_t c = 0; c < in; c += 8) {
            if (j == 0 && c % 16 == 0) prefetch_next_block(w0, in, c);  // a single row: its only pass
            const v8 p = load8(x0 + c);
            a0 += load8(w0 + c) * p, a1 += load8(w1 + c) * p, a2 += load8(w2 + c) * p, a3 += load8(w3 + c) * p;
        }
        float *y0 = y + j * out + r;
        y0[0] = hsum(a0), y0[1] = hsum(a1), y0[2] = hsum(a2), y0[3] = hsum(a3);
    }
}

// y[j, r] = w_r . x_j for one output row (the last, short block), summed in the same order.
void one_output(const float *w, const float *x, int n, int64_t in, int64_t out, int64_t r, float *y) {
    for (int j = 0; j < n; ++j) {
        v8 a{};
        for (int64_t c = 0; c < in; c += 8) a += load8(w + r * in + c) * load8(x + j * in + c);
        y[j * out + r] = hsum(a);
    }
}

#if defined(__AVX512BF16__)
inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (no NaNs reach here from finite weights)
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

inline __m512 dot32(__m512 acc, const uint16_t *a, const uint16_t *b) {  // acc lanes += pairs of 32 bf16 products
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
}

// sums[j * ROWS + i] = w_{r+i} . x_j for j < n <= 4, 32 columns at a time; the first group of rows over
// a block asks for the next block (`prefetch`), the others find this one in L1.
void bf16_four_outputs(const uint16_t *w, const uint16_t *x, int n, int64_t in, int64_t r, float *sums, bool prefetch) {
    const uint16_t *w0 = w + r * in, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
    __m512 a[4][ROWS];
    for (int j = 0; j < 4; ++j)
        for (int i = 0; i < ROWS; ++i) a[j][i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < in; c += 32) {  // 32 bf16 columns: one 64-byte line of each weight row
        if (prefetch) prefetch_next_block(w0, in, c);
        for (int j = 0; j < n; ++j) {  // n is 1 to 4: the compiler keeps a[][] in registers
            const uint16_t *xj = x + j * in + c;
            a[j][0] = dot32(a[j][0], xj, w0 + c), a[j][1] = dot32(a[j][1], xj, w1 + c);
            a[j][2] = dot32(a[j][2], xj, w2 + c), a[j][3] = dot32(a[j][3], xj, w3 + c);
        }
    }
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < ROWS; ++i) sums[j * ROWS + i] = _mm512_reduce_add_ps(a[j][i]);
}

// The same for one output row (the last, short block), summed in the same order.
float bf16_one_output(const uint16_t *wr, const uint16_t *xj, int64_t in) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t c = 0; c < in; c += 32) a = dot32(a, xj + c, wr + c);
    return _mm512_reduce_add_ps(a);
}
#endif

}  // namespace

extern "C" {

// w [out, in] row-major, x [n, in] row-major, bias [out] or null, y [n, out]. Returns 0, or -1 for
// shapes it does not take (in not a multiple of 8; the caller falls back).
int specstack_linear_rows_f32(const float *w, const float *x, const float *bias, float *y, int n, int64_t out, int64_t in, int threads) {
    if (in < 8 || in % 8 != 0 || out < 1 || n < 1 || threads < 1) return -1;
    const int64_t blocks = (out + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = b * ROWS, last = first + ROWS < out ? first + ROWS : out;
        if (last - first == ROWS)
            four_outputs(w, x, n, in, out, first, y);
        else
            for (int64_t r = first; r < last; ++r) one_output(w, x, n, in, out, r, y);
        if (bias)
            for (int j = 0; j < n; ++j)
                for (int64_t r = first; r < last; ++r) y[j * out + r] += bias[r];
    }
    return 0;
}

int specstack_linear_rows_bf16_supported() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

// The same in bfloat16 (uint16_t bit patterns): w [out, in], x [n, in] with n <= MAX_BF16_ROWS, bias [out]
// or null, y [n, out]. Returns 0, or -1 for shapes it does not take (in not a multiple of 32, more than
// MAX_BF16_ROWS rows, or a build without AVX-512 bf16 instructions).
int specstack_linear_rows_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads) {
#if defined(__AVX512BF16__)
    if (in < 32 || in % 32 != 0 || out < 1 || n < 1 || n > MAX_BF16_ROWS || threads < 1) return -1;
    const int64_t blocks = (out + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = b * ROWS, last = first + ROWS < out ? first + ROWS : out;
        float sums[MAX_BF16_ROWS * ROWS];
        if (last - first == ROWS)
            for (int j = 0; j < n; j += 4) bf16_four_outputs(w, x + j * in, n - j < 4 ? n - j : 4, in, first, sums + j * ROWS, j == 0);
        else
            for (int64_t r = first; r < last; ++r)
                for (int j = 0; j < n; ++j) sums[j * ROWS + (r - first)] = bf16_one_output(w + r * in, x + j * in, in);
        for (int j = 0; j < n; ++j)
            for (int64_t r = first; r < last; ++r)
                y[j * out + r] = float_to_bf16(sums[j * ROWS + (r - first)] + (bias ? bf16_to_float(bias[r]) : 0.0f));
    }
    return 0;
#else
    (void)w, (void)x, (void)bias, (void)y, (void)n, (void)out, (void)in, (void)threads;
    return -1;
#endif
}

}  // extern "C"
