// How fast one core of this CPU does bf16 products two ways (specstack/bf16_products.py): AVX-512's bf16 dot
// product (vdpbf16ps: 32 bf16 products summed in pairs into 16 float32 lanes, 64 flops) against the float32 FMA
// (vfmadd231ps: 16 lanes, 32 flops) that the widening paths run on numbers widened from bf16.
//
// Each loop runs twelve independent chains of one instruction, unrolled, so that none waits on its own latency and
// the time is the instruction's throughput. An empty asm statement hands the loop a fresh operand every iteration,
// so that the compiler cannot fold it. Built by specstack/native.py with the kernels' flags; plain C++ with Intel
// intrinsics, no torch headers.

#include <time.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

double now() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

double dot_products(long iterations) {
#define START(i) __m512 a##i = _mm512_set1_ps(i);
    CHAINS(START)
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = x;  // pairs of bf16 ones
    const double began = now();
    for (long n = 0; n < iterations; ++n) {
#define STEP(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
        CHAINS(STEP)
        __asm__ volatile("" : "+v"(x));
    }
    const double seconds = now() - began;
#define SUM(i) +_mm512_reduce_add_ps(a##i)
    volatile float keep = 0.0f CHAINS(SUM);
    (void)keep;
    return seconds;
}

double fmas(long iterations) {
    CHAINS(START)
    __m512 x = _mm512_set1_ps(1.0f), y = x;
    const double began = now();
    for (long n = 0; n < iterations; ++n) {
#define FMA(i) a##i = _mm512_fmadd_ps(x, y, a##i);
        CHAINS(FMA)
        __asm__ volatile("" : "+v"(x));
    }
    const double seconds = now() - began;
    volatile float keep = 0.0f CHAINS(SUM);
    (void)keep;
    return seconds;
}

}  // namespace
#endif

extern "C" {

// Seconds one core takes for 12 * iterations vdpbf16ps (*dot_seconds) and as many 512-bit FMAs (*fma_seconds), each
// the best of `repeats` runs alternated. Returns 0, or -1 where the build has no bf16 dot products (nothing to time).
int specstack_product_rates(long iterations, int repeats, double *dot_seconds, double *fma_seconds) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (iterations < 1 || repeats < 1) return -1;
    *dot_seconds = *fma_seconds = 1e300;
    for (int r = 0; r < repeats; ++r) {
        const double dot = dot_products(iterations), fma = fmas(iterations);
        *dot_seconds = dot < *dot_seconds ? dot : *dot_seconds;
        *fma_seconds = fma < *fma_seconds ? fma : *fma_seconds;
    }
    return 0;
#else
    (void)iterations, (void)repeats, (void)dot_seconds, (void)fma_seconds;
    return -1;
#endif
}

}  // extern "C"
