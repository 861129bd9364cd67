// The decode-attention kernel (specstack/csrc/decode_attention.cpp) called in a loop from C++, without Python
// between the calls, so that a profile or a timing sees only the kernel: 30 layers' calls over a bf16 cache of
// N keys shaped as the embedded target's (3 KV heads, 3 query heads each, heads of 64), T new tokens, random
// keys, values and queries; prints the best of `repeats` passes and the nanoseconds per 512-bit dot product the
// kernel's arithmetic needs (4 per query row and cached key), per thread. With `layers` 1 the one layer's cache
// is read again by every call (N = 1,000: 768 KB, within a Zen 4 core's L2); with 30, each call reads its own.
//
//   g++ -O3 -march=native -fopenmp -std=c++17 -Ispecstack/csrc examples/attention_driver.cpp \
//       specstack/csrc/decode_attention.cpp -o /tmp/attention_driver
//   /tmp/attention_driver T N threads layers repeats      # e.g. 5 1000 1 1 300
//   perf record /tmp/attention_driver 5 1000 1 1 3000     # a profile of the kernel alone
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bf16.h"  // float_to_bf16: the kernels' own rounding

extern "C" int specstack_decode_attention(const float *q, const void *k, const void *v, int64_t k_head_stride, int64_t v_head_stride,
                                          int hkv, int rows, int t, int d, int64_t n, const uint8_t *sees, float scale, float *out,
                                          int threads, int kv_bf16, int amx, int dp);

static double now() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static float uniform() { return rand() / (float)RAND_MAX - 0.5f; }

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s T N threads layers repeats\n", argv[0]);
        return 2;
    }
    const int t = atoi(argv[1]), threads = atoi(argv[3]), layers = atoi(argv[4]), repeats = atoi(argv[5]);
    const int64_t keys = atol(argv[2]);
    const int hkv = 3, group = 3, d = 64, rows = group * t, model_layers = 30;
    if (t < 1 || keys < 1 || threads < 1 || layers < 1 || repeats < 1) {
        fprintf(stderr, "T, N, threads, layers and repeats must be positive\n");
        return 2;
    }
    const int64_t n = keys + t;                   // the cached keys and the new tokens' own
    const size_t per_layer = (size_t)hkv * n * d;  // [hkv, n, d] bf16 each for keys and values
    uint16_t *k = (uint16_t *)malloc(2 * per_layer * layers), *v = (uint16_t *)malloc(2 * per_layer * layers);
    float *q = (float *)malloc(sizeof(float) * hkv * rows * d), *out = (float *)malloc(sizeof(float) * hkv * rows * d);
    srand(1);
    for (size_t i = 0; i < per_layer * layers; ++i) k[i] = float_to_bf16(4 * uniform()), v[i] = float_to_bf16(uniform());
    for (int i = 0; i < hkv * rows * d; ++i) {  // queries hold bf16 numbers, as the kernel's bf16 path expects
        const uint32_t bits = (uint32_t)float_to_bf16(4 * uniform()) << 16;
        memcpy(q + i, &bits, 4);
    }
    double best = INFINITY;
    for (int r = 0; r < repeats; ++r) {
        const double began = now();
        for (int layer = 0; layer < model_layers; ++layer) {
            const size_t at = (size_t)(layer % layers) * per_layer;
            if (specstack_decode_attention(q, k + at, v + at, n * d, n * d, hkv, rows, t, d, n, nullptr, 0.125f, out, threads, 1, 0, 1) != 0) {
                fprintf(stderr, "the kernel refused this shape\n");
                return 1;
            }
        }
        const double seconds = now() - began;
        best = seconds < best ? seconds : best;
    }
    const double products = 4.0 * rows * keys * hkv * model_layers;
    printf("T=%d N=%lld threads=%d layers=%d: %.3f ms (%d layers); %.3f ns per dot product per thread; out[0]=%g\n", t, (long long)keys,
           threads, layers, 1e3 * best, model_layers, 1e9 * best * threads / products, out[0]);
    return 0;
}
