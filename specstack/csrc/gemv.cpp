// One input row through a linear layer on the CPU, float32: y = W x + b (specstack/packed_linear.py).
//
// A one-token forward reads every weight once and does two flops per weight, so it is bound by how
// fast the weights stream from memory. Each thread takes its own blocks of ROWS output rows and
// streams those weight rows once, eight columns at a time, against the input row (which stays in L1);
// every output is one dot product summed in one fixed order, whatever the number of threads. Built by
// specstack/native.py; plain C++ with GCC vector types, no torch headers.

#include <stdint.h>

#include <omp.h>

namespace {

typedef float v8 __attribute__((vector_size(32), aligned(4)));  // 8 floats, loads need no alignment

constexpr int ROWS = 4;  // weight rows streamed side by side: four independent sums in flight

inline v8 load8(const float *p) { return *(const v8 *)p; }
inline float hsum(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

// y[r] = w_r . x for the rows [first, last) of w, ROWS at a time, then one at a time.
void rows_times(const float *w, const float *x, int64_t in, int64_t first, int64_t last, float *y) {
    int64_t r = first;
    for (; r + ROWS <= last; r += ROWS) {
        const float *w0 = w + r * in, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
        v8 a0{}, a1{}, a2{}, a3{};
        for (int64_t c = 0; c < in; c += 8) {
            const v8 xc = load8(x + c);
            a0 += load8(w0 + c) * xc, a1 += load8(w1 + c) * xc, a2 += load8(w2 + c) * xc, a3 += load8(w3 + c) * xc;
        }
        y[r] = hsum(a0), y[r + 1] = hsum(a1), y[r + 2] = hsum(a2), y[r + 3] = hsum(a3);
    }
    for (; r < last; ++r) {
        v8 a{};
        for (int64_t c = 0; c < in; c += 8) a += load8(w + r * in + c) * load8(x + c);
        y[r] = hsum(a);
    }
}

}  // namespace

extern "C" {

// w [out, in] row-major, x [in], bias [out] or null, y [out]. Returns 0, or -1 for shapes it does
// not take (in not a multiple of 8; the caller falls back).
int specstack_gemv_f32(const float *w, const float *x, const float *bias, float *y, int64_t out, int64_t in, int threads) {
    if (in < 8 || in % 8 != 0 || out < 1 || threads < 1) return -1;
    const int64_t blocks = (out + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = b * ROWS, last = first + ROWS < out ? first + ROWS : out;
        rows_times(w, x, in, first, last, y);
        if (bias)
            for (int64_t r = first; r < last; ++r) y[r] += bias[r];
    }
    return 0;
}

}  // extern "C"
