// How fast two threads read the embedded target's 30 layers of bf16 keys and values (3 KV heads, heads of 64) in
// the patterns the decode-attention kernel could read them, summing and nothing else; prints the best of `repeats`.
// Modes: 0, sixteen keys' lines beside their values' lines; 1, sixteen keys, then their sixteen values (the register
// path's order); 2, keys and values interleaved in one array (one stream); 3, a thread's keys, then its values.
//
//   g++ -O3 -march=native -fopenmp examples/read_patterns.cpp -o /tmp/read_patterns
//   for m in 0 1 2 3; do /tmp/read_patterns 7500 $m 9; done     # N keys, mode, repeats
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s N mode repeats (mode 0-3)\n", argv[0]);
        return 2;
    }
    const long n = atol(argv[1]); const int mode = atoi(argv[2]), reps = atoi(argv[3]);
    const long per = 3 * n * 128;  // bytes of keys of one layer
    char *k = (char *)aligned_alloc(64, per * 30), *v = (char *)aligned_alloc(64, per * 30), *kv = (char *)aligned_alloc(64, 2 * per * 30);
    memset(k, 1, per * 30); memset(v, 2, per * 30); memset(kv, 3, 2 * per * 30);
    double best = 1e9; float sink = 0;
    for (int r = 0; r < reps; ++r) {
        double t0 = now();
        for (int layer = 0; layer < 30; ++layer) {
#pragma omp parallel num_threads(2) reduction(+ : sink)
            {
                int tid = omp_get_thread_num();
                __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
                for (int h = 0; h < 3; ++h) {
                    long b0 = tid * n / 2, b1 = (tid + 1) * n / 2;
                    const char *kh = k + layer * per + h * n * 128, *vh = v + layer * per + h * n * 128, *kvh = kv + 2 * (layer * per + h * n * 128);
                    if (mode == 0) {  // each line of 16 keys beside the same line of their values
                        for (long b = b0; b < b1; b += 16)
                            for (int i = 0; i < 16 * 128; i += 64) acc = _mm512_add_ps(acc, _mm512_load_ps(kh + b * 128 + i)), acc2 = _mm512_add_ps(acc2, _mm512_load_ps(vh + b * 128 + i));
                    } else if (mode == 1) {  // 16 keys, then their 16 values
                        for (long b = b0; b < b1; b += 16) {
                            for (int i = 0; i < 16 * 128; i += 64) acc = _mm512_add_ps(acc, _mm512_load_ps(kh + b * 128 + i));
                            for (int i = 0; i < 16 * 128; i += 64) acc2 = _mm512_add_ps(acc2, _mm512_load_ps(vh + b * 128 + i));
                        }
                    } else if (mode == 2) {  // interleaved layout: one stream
                        for (long b = b0 * 256; b < b1 * 256; b += 64) acc = _mm512_add_ps(acc, _mm512_load_ps(kvh + b));
                    } else {  // keys only then values only
                        for (long b = b0 * 128; b < b1 * 128; b += 64) acc = _mm512_add_ps(acc, _mm512_load_ps(kh + b));
                        for (long b = b0 * 128; b < b1 * 128; b += 64) acc2 = _mm512_add_ps(acc2, _mm512_load_ps(vh + b));
                    }
                }
                sink += _mm512_reduce_add_ps(_mm512_add_ps(acc, acc2));
            }
        }
        double t = now() - t0; if (t < best) best = t;
    }
    printf("mode %d: %.2f ms, %.1f GB/s (%g)\n", mode, best * 1e3, 2.0 * per * 30 / best / 1e9, sink);
}
