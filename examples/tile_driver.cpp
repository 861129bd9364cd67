// The few-row linear kernel's bf16 products over Q4_1 blocks (specstack/csrc/linear_rows.cpp) called in a loop from
// C++, without Python between the calls: the streaming entry (widened to float32, what rows below TILES_FROM take on
// the AMX host) and the AMX tiles' entry, on one random 1536 x 576 matrix (the target's gate or up: 663 KB of blocks,
// within a core's L2), so that the time is the kernels' arithmetic and data movement, not the weights' stream from
// memory. Prints the best of five passes of 500 calls and the nanoseconds per block of 32 weights of a row, per thread
// (docs/benchmarks.md, "Tiles widened one at a time").
//
//   g++ -O3 -march=native -fopenmp -std=c++17 -Ispecstack/csrc examples/tile_driver.cpp specstack/csrc/linear_rows.cpp \
//       -o /tmp/tile_driver
//   /tmp/tile_driver 1      # threads
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <vector>

extern "C" {
int specstack_linear_rows_q4_1_bf16_widened(const uint8_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads);
int specstack_linear_rows_q4_1_bf16_tiles(const uint8_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads);
}

typedef int (*Entry)(const uint8_t *, const uint16_t *, const uint16_t *, uint16_t *, int, int64_t, int64_t, int);

static double now() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 1;
    const int64_t out = 1536, in = 576, blocks = out * in / 32;
    std::vector<uint8_t> w(blocks * 24);  // each block: 16 code bytes, then (d, m) as float32 (weight_formats.py)
    srand(1);
    for (auto &byte : w) byte = (uint8_t)rand();
    for (int64_t b = 0; b < blocks; ++b) {
        float *dm = (float *)(w.data() + b * 24 + 16);
        dm[0] = 0.001f * (1 + rand() % 32), dm[1] = -0.01f * (rand() % 8);
    }
    std::vector<uint16_t> x(32 * in, 0x3f80), y(32 * out);  // rows of ones (bf16 1.0)
    const struct { const char *name; Entry entry; } ways[] = {{"streaming", specstack_linear_rows_q4_1_bf16_widened},
                                                             {"tiles", specstack_linear_rows_q4_1_bf16_tiles}};
    for (int n : {1, 4, 6, 8, 16}) {
        for (const auto &way : ways) {
            if (way.entry(w.data(), x.data(), nullptr, y.data(), n, out, in, threads) != 0) {
                printf("%2d rows %-9s: not taken here\n", n, way.name);
                continue;
            }
            double best = 1e9;
            for (int pass = 0; pass < 5; ++pass) {
                const double began = now();
                for (int call = 0; call < 500; ++call) way.entry(w.data(), x.data(), nullptr, y.data(), n, out, in, threads);
                best = (now() - began) / 500 < best ? (now() - began) / 500 : best;
            }
            printf("%2d rows %-9s: %6.1f us a product, %.2f ns a block of a row per thread\n", n, way.name, best * 1e6, best * 1e9 / blocks * threads);
        }
    }
}
