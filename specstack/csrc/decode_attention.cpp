// Attention of a few new tokens over a long KV cache on the CPU, float32 or bfloat16 keys and values
// (specstack/decode_attention.py); queries, arithmetic and output in float32.
//
// Flash-decoding (Dao et al., 2023) for the query rows of one KV head: the cached keys are split into
// ranges, one per work item, so that every thread streams its own part of the cache; within a range,
// blocks of BLOCK keys are scored, exponentiated and folded into the rows' running maxima, sums and
// weighted values (the online softmax). The ranges are then merged by their maxima, and the new tokens'
// own keys (the last T of the n keys, under a T x T mask) are folded in at the merge:
//     out_r = (sum_s e^{m_s - M} acc_s + sum_i e^{x_i - M} v_i) / (sum_s e^{m_s - M} l_s + sum_i e^{x_i - M}).
// On the widening paths the ranges are spans of SPAN keys fixed from key 0, the own keys inside them under the mask (a
// token tree's node over its own path), so that every token of a chain or tree verify gets the one-token step's sums
// ("Sums that do not depend on the token's place").
// Rows are the query heads of a group folded into the query length: row r = g * T + t is head g of
// the group and token t.
//
// Each block is scored by taking each key row against each query row (dot products along D, summed across lanes),
// six rows at a time, then threes, pairs and a row, and its values weighed by the same groups of rows.
// A bfloat16 block is widened to float32 as it is read (exact: a bf16 is the top half of a float), so
// the cache is read at half the bytes, straight into the registers of the products, six query rows at a time and
// then threes (a group of three heads), so each key and value is widened once per six or three rows and nothing is
// stored between reading and using it.
// (With AVX2, a block of 25 rows or more used to be scored as a small GEMM over its keys transposed, summed along the
// columns in order, so a verify of nine tokens or more rounded otherwise than the step. On the 2-core AMD host with
// AVX2 of 2026-12-01, attention of 9-16 tokens over 7,500 keys, in cache on one thread, took 0.83-0.98x the GEMM's
// time without it in fp32 and 0.90-1.29x in bf16, and a GEMM summed as the few-row path sums took 1.13-1.34x the few-row
// path's in fp32 and 0.90-1.22x in bf16 (docs/benchmarks.md, "AVX2's wide verifies on the few-row path"): it is gone.)
// (AMD Zen 3, AVX2, from memory, against widening each block into scratch and reading it back for pairs
// of rows: bf16 attention 1.25x faster at one token and 1.68x at two over 7,500 keys, 1.31x and 1.43x
// over 32,000; examples/attention_bounds.py --source.)
// With AVX-512 and heads a multiple of 32 wide, six rows or more (a verify) take a third way, the column path
// (below, "Keys sixteen at a time, column by column"): the keys of a group of sixteen laid out by 32-bit words, a key
// a lane, so a vector of products belongs to sixteen keys and no sum runs across lanes; the KV store keeps its keys
// laid out so (KVStore.key_columns), each group laid out once by the kernel that first reads it. Both paths sum a
// key-row by the same tree, so a row's scores are the same bits on either.
//
// On a CPU with AMX (Intel's tile registers and their bf16 products), a bfloat16 cache takes the tiles
// instead, for any number of rows: sixteen keys by sixteen query rows are scored per tile product
// straight from the keys as stored (S^T = K Q^T, the queries laid out once per call), the online softmax
// runs down the keys with sixteen rows to a vector (a group of a few rows: row by row), and the weights,
// transposed and rounded to bf16,
// multiply the values laid out by key pairs (O = P V). Scores, sums and output stay float32; the
// weights' rounding is the only one the widening path does not make (as in SDPA's bf16 kernels).
// Three query rows or fewer (a one-token step of a model with groups of three or fewer) can take
// AVX-512's bf16 dot products in registers instead, on any CPU that has them (attend_range_dp), the
// weights rounded as on the tiles; where there are no tiles, so do up to fifteen rows (a verify of up to five
// tokens), six at a time, and more rows take the same dot products a block laid out once for all rows
// (attend_range_dp_rows). Both read their keys transposed sixteen at a time, the column path's layout, from the KV
// store's copy by groups where it is passed, and keep the groups they lay out there. Whether a call takes the dot products is the caller's `dp` (specstack/bf16_products.py
// chooses per machine: where FMAs do more multiply-adds a second than vdpbf16ps, a bf16 cache is widened).
// Compiled at first use by specstack/decode_attention.py; plain C++ with GCC vector types (and Intel
// intrinsics for the AMX path), no torch headers. Not built with -ffast-math: the -infinities of the
// merge must stay.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include <omp.h>

#include "bf16.h"
#include "scratch.h"
#if defined(__AVX2__)
#include <immintrin.h>  // one conversion instruction to widen eight bf16 numbers (load8_bf16)
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SPECSTACK_DP 1  // compiled for a CPU with AVX-512's bf16 dot products and conversions
#if defined(__AMX_BF16__)
#define SPECSTACK_AMX 1  // and with AMX tiles
#include "amx_tiles.h"
#endif
#endif

namespace {

typedef float v8 __attribute__((vector_size(32), aligned(4)));  // 8 floats, loads need no alignment
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));  // 8 bfloat16 bit patterns
#ifdef __AVX512F__
constexpr int W = 16;  // floats in the widest vector
#else
constexpr int W = 8;
#endif
typedef float vw __attribute__((vector_size(4 * W), aligned(4)));
typedef int32_t vwi __attribute__((vector_size(4 * W), aligned(4)));

constexpr int BLOCK = 64;       // keys scored at once: 16 KB of fp32 keys with D = 64
constexpr int MAX_ROWS = 192;   // query rows per KV head (G * T): 64 tokens of three query heads a KV head, on the tiles
constexpr int MAX_DIM = 256;    // head dimension
// Whether each work item asks for its next block of keys and values while it computes the current one:
// on the Intel host (AVX-512) the one-token case over 32,000 keys took 1.21x less time with it; on the AMD
// Zen 3 host (AVX2) 1.09x more (1.09-1.12x at one and two tokens over 7,500 and 32,000 keys; no change from
// three on), where the hardware prefetcher does better alone (docs/benchmarks.md). On the AMD Zen 4 host
// (AVX-512, no AMX) the few-row path did better without it too (float32, from memory: 1.05-1.16x at one token
// and 1.32-1.34x at two, over 7,500 and 32,000 keys), and a GEMM path since removed with it (1.03-1.05x at four and
// eight tokens). So it is asked for only where the kernel is built
// for AMX, which the Intel host has (the widening paths; the dot-product path spreads its asks, DP_AHEAD).
#ifdef SPECSTACK_AMX
constexpr bool PREFETCH_NEXT_BLOCK = true;
#else
constexpr bool PREFETCH_NEXT_BLOCK = false;
#endif
// Whether the few-row path asks for the next block's keys while it computes this block's softmax (half of them, a
// share a row) and weighted values (the other half, a line or two a value row), so that the key stream goes on
// while no keys are read. Measured on the 2-core Intel host without bf16 dot products (AVX-512F), two threads from
// memory over 7,500 keys: bf16 1.21x less time at one token, 1.17x at two, 1.14x at three, 1.10-1.11x at four and
// five; float32 1.08x / 1.18x / 1.14x at one / two / three (docs/benchmarks.md, "The next block's keys asked for ..."). Asked for
// all at once before the values, the same keys gave 1.09x at one token; asked for while this block's keys are scored
// (a lead of one to four blocks), they made it slower. Not measured on the AMD hosts, so only on AVX-512 builds
// where no bf16 dot products were chosen (the entry's dp: on the Intel host with them, the widening paths ask too).
#if defined(__AVX512F__)
constexpr bool ASK_NEXT_KEYS = true;
#else
constexpr bool ASK_NEXT_KEYS = false;
#endif
constexpr float LOWEST = -87.33f;  // exp(LOWEST) is the smallest normal float; below it exp8 would lose its exponent

inline v8 load8(const float *p) { return *(const v8 *)p; }
inline void store8(float *p, v8 x) { *(v8 *)p = x; }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }
#ifdef __AVX2__  // GCC compiles the conversion below to two 128-bit conversions and an insert
inline v8 load8_bf16(const uint16_t *p) { return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16); }
#else
inline v8 load8_bf16(const uint16_t *p) { return (v8)(__builtin_convertvector(*(const v8h *)p, v8i) << 16); }
#endif
inline vw loadw(const float *p) { return *(const vw *)p; }
inline void storew(float *p, vw x) { *(vw *)p = x; }
inline float hsum(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }

// e^x for x <= 0, lane by lane, in any GCC vector of floats V with VI its int32 twin (Cephes' expf:
// x = n ln2 + r, a degree-7 polynomial in r, 2^n by the exponent bits).
template <typename V, typename VI>
inline V expv(V x) {
    const V zero{};
    x = x < zero + LOWEST ? zero + LOWEST : x;
    const V shifted = x * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23 + round(x / ln2)
    const V n = shifted - 12582912.0f;
    const V r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    V y = zero + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    const VI exponent = ((VI)shifted - 0x4B400000 + 127) << 23;  // the integer n sits in the low bits
    return y * (V)exponent;
}

inline v8 exp8(v8 x) { return expv<v8, v8i>(x); }

// Lane i of the result: the sum of the lanes of x_i (a transposing tree of in-lane shuffles).
inline v8 sums8(v8 x0, v8 x1, v8 x2, v8 x3, v8 x4, v8 x5, v8 x6, v8 x7) {
    const v8 t01 = __builtin_shufflevector(x0, x1, 0, 8, 1, 9, 4, 12, 5, 13) + __builtin_shufflevector(x0, x1, 2, 10, 3, 11, 6, 14, 7, 15);
    const v8 t23 = __builtin_shufflevector(x2, x3, 0, 8, 1, 9, 4, 12, 5, 13) + __builtin_shufflevector(x2, x3, 2, 10, 3, 11, 6, 14, 7, 15);
    const v8 t45 = __builtin_shufflevector(x4, x5, 0, 8, 1, 9, 4, 12, 5, 13) + __builtin_shufflevector(x4, x5, 2, 10, 3, 11, 6, 14, 7, 15);
    const v8 t67 = __builtin_shufflevector(x6, x7, 0, 8, 1, 9, 4, 12, 5, 13) + __builtin_shufflevector(x6, x7, 2, 10, 3, 11, 6, 14, 7, 15);
    const v8 u0 = __builtin_shufflevector(t01, t23, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(t01, t23, 2, 3, 10, 11, 6, 7, 14, 15);
    const v8 u1 = __builtin_shufflevector(t45, t67, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(t45, t67, 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// Eight numbers of a cached row as float32: float32 read as is, bfloat16 widened as it is read (exact: a
// bf16 is the top half of a float), so the few-row path reads a bf16 cache at half the bytes and stores
// nothing between reading it and using it.
inline v8 row8(const float *p) { return load8(p); }
inline v8 row8(const uint16_t *p) { return load8_bf16(p); }

// Rows asked for from memory ahead of their use: the rows of values a block will weigh, while its keys are scored,
// so that the key and value streams run side by side instead of in turns of a block each (and, ASK_NEXT_KEYS, the
// next block's keys while this block's softmax and values are computed: NextKeys). On the AMD Zen 3 host (AVX2),
// two threads streaming the 30 layers' keys and values of 7,500 slots read 1.1-1.3x faster so (a scratch
// benchmark), and the one- and two-token cases took 1.07-1.35x less time (examples/attention_bounds.py
// --source). Where whole blocks are asked for ahead (PREFETCH_NEXT_BLOCK), it is not used.
struct Ahead {
    const char *rows = nullptr;  // the first row; null: nothing to ask for
    int64_t row_bytes = 0;
    inline void ask(int j, int n) const {
        if (!rows) return;
        for (int i = j; i < j + n; ++i)
            for (int64_t c = 0; c < row_bytes; c += 64) __builtin_prefetch(rows + i * row_bytes + c, 0, 3);
    }
};

// A key's score takes the widest vectors the machine has (vw) along the head's dimension, then folds them to eight
// lanes (lane l plus lane l + 8 with AVX-512), adds the last d % W columns eight at a time, and sums the eight lanes
// by sums8's fixed tree (a block's last one to three keys as a four padded with zero keys): every path below folds and
// sums alike, so a row's scores are the same bits on any of them (docs/benchmarks.md, "The fp32 sums sixteen lanes wide
// on AVX-512").
inline vw roww(const float *p) { return loadw(p); }
#if defined(__AVX512F__)
inline vw splatw(float x) { return (vw)_mm512_set1_ps(x); }
// sixteen bf16 numbers widened by one permute (word i to the upper half of lane i, zeros below) rather than a zero
// extension and a shift, which ran on the port the multiply-adds take: the same numbers, and attention over 7,500 bf16
// keys 1.02-1.09x faster at one to five tokens from memory (docs/benchmarks.md, "bf16 widened by one permute")
inline vw roww(const uint16_t *p) {
#if defined(__AVX512BW__)
    const __m512i to_upper = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
    return (vw)_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, to_upper, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)));
#else
    return (vw)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#endif
}
inline v8 fold(vw x) { return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15); }
#else
inline vw splatw(float x) { return splat(x); }
inline vw roww(const uint16_t *p) { return load8_bf16(p); }
inline v8 fold(vw x) { return x; }
#endif

// The columns of a head's dimension that the wide vectors take; the rest (d % W of them) go eight at a time.
inline int wide_columns(int d) { return d - d % W; }

// a[r][i] = the products q_r . k_i summed in the widest vectors along the head's first wide_columns(d) columns, for
// R query rows and the N keys from kj. Each key is read (and widened) once for the R rows.
template <int R, int N, typename T>
inline void block_products(const float *const q[R], int d, const T *kj, vw a[R][N]) {
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < N; ++i) a[r][i] = vw{};
    for (int c = 0; c < wide_columns(d); c += W)
        for (int i = 0; i < N; ++i) {
            const vw key = roww(kj + i * d + c);
            for (int r = 0; r < R; ++r) a[r][i] += loadw(q[r] + c) * key;
        }
}

// f[r][i] = the folded sums of q_r . k_i for R query rows and the N keys from kj: wide vectors along the head, the
// fold, then its last columns eight at a time.
template <int R, int N, typename T>
inline void block_sums(const float *const q[R], int d, const T *kj, v8 f[R][N]) {
    vw a[R][N];
    block_products<R, N>(q, d, kj, a);
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < N; ++i) f[r][i] = fold(a[r][i]);
    for (int c = wide_columns(d); c < d; c += 8)
        for (int i = 0; i < N; ++i) {
            const v8 key = row8(kj + i * d + c);
            for (int r = 0; r < R; ++r) f[r][i] += load8(q[r] + c) * key;
        }
}

#if defined(__AVX512F__)
// Lanes 0-7: fold(x); lanes 8-15: fold(y).
inline vw fold2(vw x, vw y) {
    return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

// sums8 in both halves: lane 8h + i is the sum of half h of x[i], by sums8's tree.
inline vw sums8x2(const vw x[8]) {
    auto pairs = [](vw a, vw b) {
        return __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
               __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
    };
    auto quads = [](vw a, vw b) {
        return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    };
    const vw u0 = quads(pairs(x[0], x[1]), pairs(x[2], x[3])), u1 = quads(pairs(x[4], x[5]), pairs(x[6], x[7]));
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
#endif

// Lanes Lane .. Lane + Count - 1 of x to p, in one store (Count 2, 4 or 8).
template <int Count, int Lane, typename V>
inline void put(float *p, V x) {
    typedef float part __attribute__((vector_size(4 * Count), aligned(4)));
    if constexpr (Count == 2) *(part *)p = __builtin_shufflevector(x, x, Lane, Lane + 1);
    else if constexpr (Count == 4) *(part *)p = __builtin_shufflevector(x, x, Lane, Lane + 1, Lane + 2, Lane + 3);
    else *(part *)p = __builtin_shufflevector(x, x, Lane, Lane + 1, Lane + 2, Lane + 3, Lane + 4, Lane + 5, Lane + 6, Lane + 7);
}

// s[r][i] = q_r . k_i for R query rows and the N keys from kj (R * N key-rows, four to twelve, a multiple of four),
// every key-row folded and summed by the same tree (fold, then sums8's), however the rows and keys are grouped, so a
// row's scores are the same bits on every path. Key-row m = r * N + i. With AVX-512 and heads a multiple of sixteen
// wide, two key-rows fold into one vector side by side and sums8's tree runs in both halves of eight such vectors at
// once (sums8x2): sixteen sums for the shuffles and adds of eight, key-rows in fours to lanes 0-3, 8-11 and 4-7.
// Else the folded key-rows go through sums8 eight at a time (a last four repeated), in lanes m % 8.
template <int R, int N, typename T, int... Piece>
__attribute__((always_inline)) inline void group_scores(const float *const q[R], int d, const T *kj, float *const s[R], std::integer_sequence<int, Piece...>) {
    constexpr int M = R * N, P = N < 4 ? N : 4;  // key-rows; the lanes one store takes (a row's, or four of them)
    static_assert(M % 4 == 0 && M <= 12, "key-rows in fours, at most three fours");
#if defined(__AVX512F__)
    if (wide_columns(d) == d) {
        vw a[R][N];
        block_products<R, N>(q, d, kj, a);
        auto kr = [&](int m) { return a[m / N][m % N]; };
        vw x[8];
        for (int i = 0; i < 4; ++i) x[i] = fold2(kr(i), kr(M > 4 ? 4 + i : i)), x[4 + i] = M > 8 ? fold2(kr(8 + i), kr(8 + i)) : x[i];
        const vw sums = sums8x2(x);
        constexpr int lane[3] = {0, 8, 4};  // of each four's first key-row
        (put<P, lane[Piece * P / 4] + Piece * P % 4>(s[Piece * P / N] + Piece * P % N, sums), ...);
        return;
    }
#endif
    v8 f[R][N];
    block_sums<R, N>(q, d, kj, f);
    v8 sums[2];
    for (int m0 = 0; m0 < M; m0 += 8) {
        auto at = [&](int m) { const int k = m < M ? m : m - 4; return f[k / N][k % N]; };
        sums[m0 / 8] = sums8(at(m0), at(m0 + 1), at(m0 + 2), at(m0 + 3), at(m0 + 4), at(m0 + 5), at(m0 + 6), at(m0 + 7));
    }
    (put<P, Piece * P % 8>(s[Piece * P / N] + Piece * P % N, sums[Piece * P / 8]), ...);
}

template <int R, int N, typename T>
__attribute__((always_inline)) inline void group_scores(const float *const q[R], int d, const T *kj, float *const s[R]) {
    group_scores<R, N>(q, d, kj, s, std::make_integer_sequence<int, R * N / (N < 4 ? N : 4)>{});
}

// s[r * BLOCK + j] = q_r . k_j for keys j < len (q already scaled) of one row, eight keys at a time, then four, then the
// last one to three as a four padded with zero keys, so that every key-row is summed by the same tree on every path.
template <typename T>
void row_scores(const float *qr, int d, const T *k, int len, float *sr, Ahead ahead = {}) {
    const float *q[1] = {qr};
    int j = 0;
    for (; j + 8 <= len; j += 8) {
        ahead.ask(j, 8);
        float *const s[1] = {sr + j};
        group_scores<1, 8>(q, d, k + (int64_t)j * d, s);
    }
    ahead.ask(j, len - j);
    if (j + 4 <= len) {
        float *const s[1] = {sr + j};
        group_scores<1, 4>(q, d, k + (int64_t)j * d, s);
        j += 4;
    }
    if (j < len) {  // the last one to three keys as a four padded with zero keys: every key-row summed by one tree
        T padded[4 * MAX_DIM] = {};
        memcpy(padded, k + (int64_t)j * d, sizeof(T) * (len - j) * d);
        float sums[4];
        float *const s[1] = {sums};
        group_scores<1, 4>(q, d, padded, s);
        for (int i = 0; i < len - j; ++i) sr[j + i] = sums[i];
    }
}

// The same for two rows at once, four keys at a time: each key read once for both.
template <typename T>
void pair_scores(const float *q0, const float *q1, int d, const T *k, int len, float *s0, float *s1, Ahead ahead = {}) {
    const float *q[2] = {q0, q1};
    int j = 0;
    for (; j + 4 <= len; j += 4) {
        ahead.ask(j, 4);
        float *const s[2] = {s0 + j, s1 + j};
        group_scores<2, 4>(q, d, k + (int64_t)j * d, s);
    }
    ahead.ask(j, len - j);
    if (j < len) row_scores(q0, d, k + (int64_t)j * d, len - j, s0 + j), row_scores(q1, d, k + (int64_t)j * d, len - j, s1 + j);
}

// The same for three rows at once (a one-token step of a model with groups of three), four keys at a
// time: twelve sums in registers, each key read once for the three.
template <typename T>
void triple_scores(const float *q0, const float *q1, const float *q2, int d, const T *k, int len, float *s0, float *s1, float *s2, Ahead ahead = {}) {
    const float *q[3] = {q0, q1, q2};
    int j = 0;
    for (; j + 4 <= len; j += 4) {
        ahead.ask(j, 4);
        float *const s[3] = {s0 + j, s1 + j, s2 + j};
        group_scores<3, 4>(q, d, k + (int64_t)j * d, s);
    }
    ahead.ask(j, len - j);
    if (j < len) {
        const T *rest = k + (int64_t)j * d;
        row_scores(q0, d, rest, len - j, s0 + j), row_scores(q1, d, rest, len - j, s1 + j), row_scores(q2, d, rest, len - j, s2 + j);
    }
}

// The same for six rows at once (a two-token verify of a model with groups of three), two keys at a
// time: twelve sums in registers, each key widened once for the six. The block's last len % 4 keys are
// summed as the other paths sum them (row_scores), so every path gives the same bits. q [6, d], s [6, BLOCK].
template <typename T>
void six_scores(const float *q, int d, const T *k, int len, float *s, Ahead ahead = {}) {
    const float *rows[6] = {q, q + d, q + 2 * d, q + 3 * d, q + 4 * d, q + 5 * d};
    const int grouped = len - len % 4;  // keys in pairs here; the rest as row_scores sums them (a padded four)
    for (int j = 0; j < grouped; j += 2) {
        if (j % 4 == 0) ahead.ask(j, 4);
        float *const out[6] = {s + j, s + BLOCK + j, s + 2 * BLOCK + j, s + 3 * BLOCK + j, s + 4 * BLOCK + j, s + 5 * BLOCK + j};
        group_scores<6, 2>(rows, d, k + (int64_t)j * d, out);
    }
    ahead.ask(grouped, len - grouped);
    if (grouped < len)
        for (int r = 0; r < 6; ++r) row_scores(q + r * d, d, k + (int64_t)grouped * d, len - grouped, s + r * BLOCK + grouped);
}

// The weighted values below take the widest vectors the machine has too: each output column sums its p_j v_j over
// the keys in order, whatever the width, so the width changes only the speed.
// acc = acc * keep + sum_j p[j] v_j for one row, 64 columns at a time in registers.
template <typename T>
void row_values(const float *p, float keep, int d, const T *v, int len, float *acc, Ahead ahead = {}) {
    constexpr int N = 64 / W;  // vectors in 64 columns
    int c0 = 0;
    for (; c0 + 64 <= d; c0 += 64) {
        vw a[N];
        for (int i = 0; i < N; ++i) a[i] = loadw(acc + c0 + W * i) * splatw(keep);
        for (int j = 0; j < len; ++j) {
            if (c0 == 0) ahead.ask(j, 1);
            const vw w = splatw(p[j]);
            const T *vj = v + (int64_t)j * d + c0;
            for (int i = 0; i < N; ++i) a[i] += w * roww(vj + W * i);
        }
        for (int i = 0; i < N; ++i) storew(acc + c0 + W * i, a[i]);
    }
    for (; c0 < d; c0 += 8) {  // a head dimension that is not a multiple of 64
        v8 a = load8(acc + c0) * splat(keep);
        for (int j = 0; j < len; ++j) {
            if (c0 == 0) ahead.ask(j, 1);
            a += splat(p[j]) * row8(v + (int64_t)j * d + c0);
        }
        store8(acc + c0, a);
    }
}

// The same for two rows at once, four vectors of columns at a time: each value read once for both.
template <typename T>
void pair_values(const float *p0, const float *p1, float keep0, float keep1, int d, const T *v, int len, float *acc0, float *acc1, Ahead ahead = {}) {
    if (d % (4 * W) != 0) {
        row_values(p0, keep0, d, v, len, acc0, ahead), row_values(p1, keep1, d, v, len, acc1);
        return;
    }
    for (int c0 = 0; c0 < d; c0 += 4 * W) {
        vw a[4], b[4];
        for (int i = 0; i < 4; ++i) a[i] = loadw(acc0 + c0 + W * i) * splatw(keep0), b[i] = loadw(acc1 + c0 + W * i) * splatw(keep1);
        for (int j = 0; j < len; ++j) {
            if (c0 == 0) ahead.ask(j, 1);
            const vw w0 = splatw(p0[j]), w1 = splatw(p1[j]);
            const T *vj = v + (int64_t)j * d + c0;
            for (int i = 0; i < 4; ++i) {
                const vw x = roww(vj + W * i);
                a[i] += w0 * x, b[i] += w1 * x;
            }
        }
        for (int i = 0; i < 4; ++i) storew(acc0 + c0 + W * i, a[i]), storew(acc1 + c0 + W * i, b[i]);
    }
}

// The same for three rows at once, four vectors of columns at a time: twelve sums in registers, each value
// read once for the three.
template <typename T>
void triple_values(const float *const p[3], const float keep[3], int d, const T *v, int len, float *const acc[3], Ahead ahead = {}) {
    if (d % (4 * W) != 0) {
        for (int r = 0; r < 3; ++r, ahead = {}) row_values(p[r], keep[r], d, v, len, acc[r], ahead);
        return;
    }
    for (int c0 = 0; c0 < d; c0 += 4 * W) {
        vw a[4], b[4], e[4];
        for (int i = 0; i < 4; ++i) {
            a[i] = loadw(acc[0] + c0 + W * i) * splatw(keep[0]), b[i] = loadw(acc[1] + c0 + W * i) * splatw(keep[1]);
            e[i] = loadw(acc[2] + c0 + W * i) * splatw(keep[2]);
        }
        for (int j = 0; j < len; ++j) {
            if (c0 == 0) ahead.ask(j, 1);
            const vw w0 = splatw(p[0][j]), w1 = splatw(p[1][j]), w2 = splatw(p[2][j]);
            const T *vj = v + (int64_t)j * d + c0;
            for (int i = 0; i < 4; ++i) {
                const vw x = roww(vj + W * i);
                a[i] += w0 * x, b[i] += w1 * x, e[i] += w2 * x;
            }
        }
        for (int i = 0; i < 4; ++i) storew(acc[0] + c0 + W * i, a[i]), storew(acc[1] + c0 + W * i, b[i]), storew(acc[2] + c0 + W * i, e[i]);
    }
}

// The same for six rows at once, two vectors of columns at a time: twelve sums in registers, each value widened
// once for the six. p [6, BLOCK], keep [6], acc [6, d].
template <typename T>
void six_values(const float *p, const float *keep, int d, const T *v, int len, float *acc, Ahead ahead = {}) {
    if (d % (2 * W) != 0) {
        for (int r = 0; r < 6; ++r, ahead = {}) row_values(p + r * BLOCK, keep[r], d, v, len, acc + r * d, ahead);
        return;
    }
    for (int c0 = 0; c0 < d; c0 += 2 * W) {
        vw a[6], b[6];
        for (int r = 0; r < 6; ++r) a[r] = loadw(acc + r * d + c0) * splatw(keep[r]), b[r] = loadw(acc + r * d + c0 + W) * splatw(keep[r]);
        for (int j = 0; j < len; ++j) {
            if (c0 == 0) ahead.ask(j, 1);
            const T *vj = v + (int64_t)j * d + c0;
            const vw x = roww(vj), y = roww(vj + W);
            for (int r = 0; r < 6; ++r) {
                const vw w = splatw(p[r * BLOCK + j]);
                a[r] += w * x, b[r] += w * y;
            }
        }
        for (int r = 0; r < 6; ++r) storew(acc + r * d + c0, a[r]), storew(acc + r * d + c0 + W, b[r]);
    }
}

// out[0, count) = the count numbers at rows as float32 (count a multiple of 8; bfloat16 widened, exactly).
void widen(const void *rows, bool bf16, int64_t count, float *out) {
    for (int64_t i = 0; i < count; i += 8) store8(out + i, bf16 ? load8_bf16((const uint16_t *)rows + i) : load8((const float *)rows + i));
}

// How many threes of the rows the sixes leave the few-row path takes before its pairs and an odd last row:
// a bfloat16 block is widened as it is read, so each key and value read for three rows instead of two saves
// a third of the widening (the header's figures: 1.25x at one token over 7,500 keys); float32 rows keep
// pairs (threes were slower). Where four rows are left, two pairs take them.
template <typename T>
inline int triples(int rows) { return std::is_same<T, float>::value ? 0 : rows % 3 == 1 && rows >= 4 ? (rows - 4) / 3 : rows / 3; }

// Scores of all rows from a block stored as T (float32, or bfloat16 widened as it is read).
template <typename T>
void block_scores(const float *q, int rows, int d, const T *k, int len, float *s, Ahead ahead) {
    int r = 0;
    for (; r + 6 <= rows; r += 6, ahead = {}) six_scores(q + r * d, d, k, len, s + r * BLOCK, ahead);
    for (const int end = r + 3 * triples<T>(rows - r); r < end; r += 3, ahead = {})
        triple_scores(q + r * d, q + (r + 1) * d, q + (r + 2) * d, d, k, len, s + r * BLOCK, s + (r + 1) * BLOCK, s + (r + 2) * BLOCK, ahead);
    for (; r + 2 <= rows; r += 2, ahead = {}) pair_scores(q + r * d, q + (r + 1) * d, d, k, len, s + r * BLOCK, s + (r + 1) * BLOCK, ahead);
    if (r < rows) row_scores(q + r * d, d, k, len, s + r * BLOCK, ahead);
}

// acc_r = acc_r * keep_r + sum_j p[r * BLOCK + j] v_j for all rows, split as block_scores splits them; the first
// group of rows asks for `ahead`'s rows, one a value.
template <typename T>
void accumulate_values(const float *p, const float *keep, int rows, int d, const T *v, int len, float *acc, Ahead ahead) {
    int r = 0;
    for (; r + 6 <= rows; r += 6, ahead = {}) six_values(p + r * BLOCK, keep + r, d, v, len, acc + r * d, ahead);
    for (const int end = r + 3 * triples<T>(rows - r); r < end; r += 3, ahead = {}) {
        const float *ps[3] = {p + r * BLOCK, p + (r + 1) * BLOCK, p + (r + 2) * BLOCK};
        float *accs[3] = {acc + r * d, acc + (r + 1) * d, acc + (r + 2) * d};
        triple_values(ps, keep + r, d, v, len, accs, ahead);
    }
    for (; r + 2 <= rows; r += 2, ahead = {}) pair_values(p + r * BLOCK, p + (r + 1) * BLOCK, keep[r], keep[r + 1], d, v, len, acc + r * d, acc + (r + 1) * d, ahead);
    if (r < rows) row_values(p + r * BLOCK, keep[r], d, v, len, acc + r * d, ahead);
}

constexpr int GROUP = 16;  // keys of a group: one vector of floats

// The store's copy of one head's keys laid out by groups of GROUP keys (the column path, below; null: none), and how
// many leading keys it holds current (a multiple of GROUP).
struct Columns {
    uint32_t *groups = nullptr;  // group g at groups + g * words * GROUP
    int64_t upto = 0;
};

#if defined(__AVX512F__)
// ---- Keys sixteen at a time, column by column (AVX-512) ----------------------------------------------
//
// Where vectors hold sixteen floats and heads are a multiple of 32 wide, every block's scores are taken from its keys
// laid out sixteen at a time by columns: a group of sixteen keys is `words` vectors, vector w holding 32-bit word w of
// each key (a float32 column, or two bfloat16 columns: 2w in its low half, 2w + 1 in its high half), one key a lane.
// Then a vector of products is sixteen keys' and the dot products need no sums across lanes, which on the few-row path
// (every key-row's products summed across sixteen lanes by shuffles, two key-rows folded to a vector) took about as
// many instructions as the multiply-adds. Each key-row is summed exactly as the few-row path sums it (lanewise_scores),
// so every path gives the same bits.
//
// The groups come from the KV store's copy of its keys in this layout (KVStore.columns), which the kernel fills as it
// reads: a group of keys below the store's mark (`upto`) is read from there; any other is laid out here from the keys
// as stored (sixteen by sixteen transposes in registers) and, when all sixteen are cached, copied into the store's
// copy, so that each group of a cache is laid out once. Without a store, every group is laid out as it is read.

// 32-bit words of a key: its float32 columns, or pairs of its bfloat16 columns.
inline int key_words(int d, bool bf16) { return bf16 ? d / 2 : d; }

// From this many query rows a KV head on the column path: fewer rows (a one-token step of a model with groups of three)
// keep the few-row path, whose key stream from memory the column path did not match there (attention over 7,500
// bf16 keys from memory 1.03-1.04x slower at one token, 1.27x faster at four; docs/benchmarks.md, "Keys by columns").
constexpr int COLUMN_ROWS = 6;

// Whether heads of width d (whole vectors of words, a group's words a multiple of sixteen) and `rows` query rows take
// the column path.
inline bool column_path(int d, int rows) { return d % 32 == 0 && rows >= COLUMN_ROWS; }

// 16 x 16 floats transposed in registers: r[i] becomes column i.
__attribute__((always_inline)) inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {  // r[i + c] lane L: column 4L + c of rows i .. i+3
        const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]), c = _mm512_castps_pd(t[i + 2]), e = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c)), r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e)), r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
    }
    for (int i = 0; i < 4; ++i) {  // gather lane L of rows i, i+4, i+8, i+12 into column 4L + i
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88), t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88), t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88), r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88), r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
    }
}


// out[w * GROUP + i] = word w of key i, for the `count` keys (at most GROUP) of k (rows of d numbers of T), and zeros for
// keys count .. GROUP - 1: sixteen words of sixteen keys at a time, transposed in registers.
template <typename T>
void lay_out_group(const T *k, int d, int count, uint32_t *out) {
    const int words = key_words(d, sizeof(T) == 2);
    for (int w0 = 0; w0 < words; w0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = i < count ? _mm512_loadu_ps((const float *)(k + (int64_t)i * d) + w0) : _mm512_setzero_ps();
        transpose16(r);  // r[i]: word w0 + i of the sixteen keys
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps((float *)out + (w0 + i) * GROUP, r[i]);
    }
}

// Column c of a group's keys as sixteen floats: a float32 word as it is; a bfloat16 pair's low half (c even) or high
// half (c odd) moved into the upper half of the lane, zeros below (exact).
template <typename T, int C>
inline vw group_column(const uint32_t *group, int base) {
    if constexpr (sizeof(T) == 4) return loadw((const float *)group + (base + C) * GROUP);
    const __m512i x = _mm512_loadu_si512(group + (base + C) / 2 * GROUP);
    if constexpr (C % 2 == 0) return (vw)_mm512_slli_epi32(x, 16);
    return (vw)_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u));
}

// f[r] = lanes L and L + 8 of row r's products with the group's sixteen keys, summed as block_products sums a lane
// (columns L, L + 16, ... in order) and added as fold adds them. D: the head's width where it is known when compiled.
template <int R, int D, typename T, int L>
__attribute__((always_inline)) inline void folded_lanes(const float *q, int d, const uint32_t *group, vw f[R]) {
    if constexpr (D > 0) d = D;
    vw a[R], b[R];
    for (int r = 0; r < R; ++r) a[r] = vw{}, b[r] = vw{};
#pragma GCC unroll 16
    for (int c = 0; c < d; c += W) {
        const vw x = group_column<T, L>(group, c), y = group_column<T, L + 8>(group, c);
        for (int r = 0; r < R; ++r) a[r] += splatw(q[r * d + c + L]) * x, b[r] += splatw(q[r * d + c + L + 8]) * y;
    }
    for (int r = 0; r < R; ++r) f[r] = a[r] + b[r];
}

// s[r * BLOCK + i] = q_r . k_i for R query rows and the group's sixteen keys, each summed as group_scores sums a
// key-row: lane l of the products, lanes l and l + 8 added, then sums8x2's tree ((F0 + F2) + (F1 + F3)) + ((F4 + F6) +
// (F5 + F7)). Sixteen key-rows take fifteen adds here, not the shuffles and adds of summing across lanes. The group's
// sixteen value rows are asked for four at a time as the products go (`ahead`): attention over 7,500 and 32,000 bf16
// keys from memory 1.03-1.11x faster at 2-16 tokens than asking for all sixteen before them.
template <int R, int D, typename T>
__attribute__((always_inline)) inline void lanewise_scores(const float *q, int d, const uint32_t *group, float *s, Ahead ahead = {}) {
    vw f[R], g[R], t0[R], t1[R];
    ahead.ask(0, 4);
    folded_lanes<R, D, T, 0>(q, d, group, f), folded_lanes<R, D, T, 2>(q, d, group, g);
    for (int r = 0; r < R; ++r) t0[r] = f[r] + g[r];
    ahead.ask(4, 4);
    folded_lanes<R, D, T, 1>(q, d, group, f), folded_lanes<R, D, T, 3>(q, d, group, g);
    for (int r = 0; r < R; ++r) t0[r] += f[r] + g[r];
    ahead.ask(8, 4);
    folded_lanes<R, D, T, 4>(q, d, group, f), folded_lanes<R, D, T, 6>(q, d, group, g);
    for (int r = 0; r < R; ++r) t1[r] = f[r] + g[r];
    ahead.ask(12, 4);
    folded_lanes<R, D, T, 5>(q, d, group, f), folded_lanes<R, D, T, 7>(q, d, group, g);
    for (int r = 0; r < R; ++r) t1[r] += f[r] + g[r], storew(s + r * BLOCK, t0[r] + t1[r]);
}

// s[r * BLOCK + i] for all rows (six or more) and the group's keys: six rows at a time, the first six asking for the
// group's value rows (`ahead`), then the rest.
template <int D, typename T>
void group_rows(const float *q, int rows, int d, const uint32_t *group, float *s, Ahead ahead) {
    int r = 0;
    for (; r + 6 <= rows; r += 6, ahead = {}) lanewise_scores<6, D, T>(q + r * d, d, group, s + r * BLOCK, ahead);
    switch (rows - r) {
        case 5: lanewise_scores<5, D, T>(q + r * d, d, group, s + r * BLOCK); break;
        case 4: lanewise_scores<4, D, T>(q + r * d, d, group, s + r * BLOCK); break;
        case 3: lanewise_scores<3, D, T>(q + r * d, d, group, s + r * BLOCK); break;
        case 2: lanewise_scores<2, D, T>(q + r * d, d, group, s + r * BLOCK); break;
        case 1: lanewise_scores<1, D, T>(q + r * d, d, group, s + r * BLOCK); break;
    }
}

// Scores of all rows for the block of len keys from key `at` (a multiple of GROUP) of k: each group read from the
// store's copy where it holds it, else laid out into `room` (and copied into the store's copy when all sixteen are
// cached keys). The block's value rows are asked for as their keys are scored (`ahead`).
template <typename T>
void column_scores(const float *q, int rows, int d, const T *k, int64_t at, int len, Columns columns, uint32_t *room, float *s, Ahead ahead) {
    const int words = key_words(d, sizeof(T) == 2);
    for (int j = 0; j < len; j += GROUP) {
        const int count = len - j < GROUP ? len - j : GROUP;
        const int64_t g = (at + j) / GROUP;
        const Ahead group_ahead = count == GROUP && ahead.rows ? Ahead{ahead.rows + j * ahead.row_bytes, ahead.row_bytes} : Ahead{};
        if (count < GROUP) ahead.ask(j, count);  // a short last group's values at once
        const uint32_t *group = room;
        if (columns.groups && at + j + GROUP <= columns.upto) {
            group = columns.groups + g * words * GROUP;
        } else {
            lay_out_group(k + (at + j) * d, d, count, room);
            if (columns.groups && count == GROUP) memcpy(columns.groups + g * words * GROUP, room, sizeof(uint32_t) * words * GROUP);
        }
        if (d == 64) group_rows<64, T>(q, rows, d, group, s + j, group_ahead);
        else group_rows<0, T>(q, rows, d, group, s + j, group_ahead);
    }
}
#endif

// Whether `rows` query rows over heads of width d read a store's keys by groups (the column path: AVX-512 only).
inline bool reads_columns(int d, int rows) {
#if defined(__AVX512F__)
    return column_path(d, rows);
#else
    (void)d, (void)rows;
    return false;
#endif
}

// s[r * BLOCK + j] = q_r . k_j for the block's len keys (rows of d, float32 or bfloat16).
void score_block(const float *q, int rows, int d, const void *k, bool bf16, int len, float *s, Ahead ahead) {
    if (bf16) block_scores(q, rows, d, (const uint16_t *)k, len, s, ahead);
    else block_scores(q, rows, d, (const float *)k, len, s, ahead);
}

// acc_r = acc_r * keep_r + sum_j p[r * BLOCK + j] v_j over the block's len values, asking for `ahead`'s rows, one a value.
void accumulate_block(const float *p, const float *keep, int rows, int d, const void *v, bool bf16, int len, float *acc, Ahead ahead) {
    if (bf16) accumulate_values(p, keep, rows, d, (const uint16_t *)v, len, acc, ahead);
    else accumulate_values(p, keep, rows, d, (const float *)v, len, acc, ahead);
}

// The next block's keys (`keys`, `bytes` of them; null: none) asked for while this block's softmax and values are
// computed: the first half a share for each of the rows' softmax, the other half over the values, a share a value row
// (ASK_NEXT_KEYS).
struct NextKeys {
    Ahead softmax, values;  // rows of `softmax`: the rows' shares (whole lines); of `values`: the values'
};
inline NextKeys next_keys(const char *keys, int64_t bytes, int rows) {
    if (!keys) return {};
    const int64_t half = bytes / 2, share = (half / 64 + rows - 1) / rows * 64;
    return {Ahead{keys, share}, Ahead{keys + half, (bytes - half) / BLOCK}};
}

// The largest of x's lanes. With AVX-512 a tree of vector maxima (four shuffles and four maxima) rather than fifteen
// scalar comparisons in a chain: the same number (lanes that compare equal are the same number but for the sign of a
// zero, which no exponential or comparison below tells apart).
inline float max_lanes(vw x) {
#if defined(__AVX512F__)
    return _mm512_reduce_max_ps((__m512)x);
#else
    float top = x[0];
    for (int i = 1; i < W; ++i) top = x[i] > top ? x[i] : top;
    return top;
#endif
}

// One block's online softmax for all rows: s [rows, BLOCK] holds the block's scores (len of them; the rest become
// -inf), each row's running maximum m and sum l move to the block's, rescale gets e^{m_old - m_new} (0 on the first
// block), and the scores become their weights e^{x - m_new}, summed eight at a time in order whatever W. Each step
// runs for all rows before the next, so that the rows' chains of dependent operations (a maximum, expf) run side by
// side instead of one row's after another's: attention over 7,500 bf16 keys 1.09-1.10x faster at 8 and 16 tokens
// (docs/benchmarks.md, "The softmax a step at a time for all rows"). Row r asks for `ahead`'s row r.
void softmax_block(float *s, int rows, int len, float *m, float *l, float *rescale, Ahead ahead) {
    float top[MAX_ROWS];
    for (int r = 0; r < rows; ++r) {
        ahead.ask(r, 1);
        float *sr = s + r * BLOCK;
        for (int j = len; j < BLOCK; ++j) sr[j] = -INFINITY;  // padding of the last block
        vw most = splatw(m[r]);
        for (int j = 0; j < BLOCK; j += W) most = loadw(sr + j) > most ? loadw(sr + j) : most;
        top[r] = max_lanes(most);
    }
    for (int r = 0; r < rows; ++r) rescale[r] = top[r] == -INFINITY ? 0.0f : expf(m[r] - top[r]);  // 0 on the first block (m = -inf), and while a row sees no key
    for (int r = 0; r < rows; ++r) {
        float *sr = s + r * BLOCK;
        v8 sum{};
        for (int j = 0; j < BLOCK; j += W) {
            const vw x = loadw(sr + j);
            const vw p = x == splatw(-INFINITY) ? splatw(0.0f) : expv<vw, vwi>(x - splatw(top[r]));  // padding weighs nothing
            storew(sr + j, p);
            for (int h = 0; h < W; h += 8) sum += load8(sr + j + h);
        }
        l[r] = l[r] * rescale[r] + hsum(sum);
        m[r] = top[r];
    }
}

// Floats of scratch one work item needs: its scores, and room for a block of keys and one of values as float32 (a group
// of keys laid out by columns; the dot-product paths' layouts).
inline size_t scratch_floats(int d) { return (size_t)MAX_ROWS * BLOCK + 2 * (size_t)BLOCK * d; }

// Where the keys of block b (BLOCK keys from key b, a multiple of GROUP) are read from: the store's copy by groups where
// it holds the whole block (column path), else the keys as stored.
inline const char *block_keys(const void *k, bool bf16, int d, int rows, Columns columns, int64_t b) {
#if defined(__AVX512F__)
    if (column_path(d, rows) && columns.groups && b + BLOCK <= columns.upto) return (const char *)(columns.groups + b / GROUP * key_words(d, bf16) * GROUP);
#else
    (void)columns;
#endif
    return (const char *)k + b * d * (bf16 ? 2 : 4);
}

// The block's scores: by groups of keys laid out by columns where the head is wide enough (column path), else by
// score_block. k points at the head's first key; the block is len keys from key b.
inline void block_scores_at(const float *q, int rows, int d, const void *k, bool bf16, int64_t b, int len, Columns columns, float *room, float *s, Ahead ahead) {
#if defined(__AVX512F__)
    if (column_path(d, rows)) {
        if (bf16) column_scores(q, rows, d, (const uint16_t *)k, b, len, columns, (uint32_t *)room, s, ahead);
        else column_scores(q, rows, d, (const float *)k, b, len, columns, (uint32_t *)room, s, ahead);
        return;
    }
#endif
    score_block(q, rows, d, (const char *)k + b * d * (bf16 ? 2 : 4), bf16, len, s, ahead);
}

// A chain's own keys in a span (the span path, below): keys from `past` on are the t new tokens', and row r (token
// r % t) sees own key i <= its token. (A tree's own keys never reach the shared spans: fold_path.)
struct Own {
    int64_t past;
    int t;
};
constexpr Own NO_OWN_KEYS{INT64_MAX, 1};  // a range without the new tokens' keys: fold_range never masks it

// Each row's scores of the own keys it does not see, among a block's len keys from key b, become -inf: as if the keys
// were not there (they weigh exactly nothing, and a block or range a row sees nothing of leaves its sums as they were).
void mask_own(float *s, int rows, Own own, int64_t b, int len) {
    for (int r = 0; r < rows; ++r)
        for (int64_t j = std::max(b, own.past + r % own.t + 1); j < b + len; ++j) s[r * BLOCK + (j - b)] = -INFINITY;
}

// Keys [begin, end) of one KV head folded into the running maxima m, sums l and weighted values acc its rows hold already.
// k and v point at the head's first key and value; bf16 says how they are stored; columns: the store's copy of the
// head's keys by groups (the column path), if it keeps one; ask_next: whether to ask for the next block's keys (ASK_NEXT_KEYS),
// up to key ask_until (the end of the caller's run of spans); own: the new tokens' keys, where the range holds them.
void fold_range(const float *q, int rows, int d, const void *k, const void *v, bool bf16, int64_t begin, int64_t end,
                float *scratch, float *m, float *l, float *acc, Columns columns, bool ask_next, int64_t ask_until, Own own) {
    const size_t elem = bf16 ? 2 : 4;
    float *s = scratch, *room = s + MAX_ROWS * BLOCK;  // room: a group of keys laid out by columns
    float rescale[MAX_ROWS];
    for (int64_t b = begin; b < end; b += BLOCK) {
        const int len = (int)(end - b < BLOCK ? end - b : BLOCK);
        if (PREFETCH_NEXT_BLOCK && b + BLOCK < ask_until) {  // the next block on its way from memory while this one is computed
            const char *next_k = block_keys(k, bf16, d, rows, columns, b + BLOCK), *next_v = (const char *)v + (b + BLOCK) * d * elem;
            for (size_t i = 0; i < (size_t)BLOCK * d * elem; i += 64) __builtin_prefetch(next_k + i, 0, 3), __builtin_prefetch(next_v + i, 0, 3);
        }
        const Ahead ahead{PREFETCH_NEXT_BLOCK ? nullptr : (const char *)v + b * d * elem, (int64_t)d * (int64_t)elem};  // else the values' rows ahead
        const bool asks_next = ask_next && !PREFETCH_NEXT_BLOCK && b + BLOCK < ask_until;
        const NextKeys next = next_keys(asks_next ? block_keys(k, bf16, d, rows, columns, b + BLOCK) : nullptr, (int64_t)BLOCK * d * elem, rows);
        block_scores_at(q, rows, d, k, bf16, b, len, columns, room, s, ahead);
        if (b + len > own.past) mask_own(s, rows, own, b, len);
        softmax_block(s, rows, len, m, l, rescale, next.softmax);
        accumulate_block(s, rescale, rows, d, (const char *)v + b * d * elem, bf16, len, acc, next.values);
    }
}

// Rows that have seen nothing yet: maxima -inf, sums and weighted values zero.
void start_rows(int rows, int d, float *m, float *l, float *acc) {
    for (int r = 0; r < rows; ++r) m[r] = -INFINITY, l[r] = 0.0f;
    for (int i = 0; i < rows * d; ++i) acc[i] = 0.0f;
}

// One work item: keys [begin, end) of one KV head into fresh running maxima, sums and weighted values (fold_range).
void attend_range(const float *q, int rows, int d, const void *k, const void *v, bool bf16, int64_t begin, int64_t end,
                  float *scratch, float *m, float *l, float *acc, Columns columns, bool ask_next, int64_t ask_until, Own own) {
    start_rows(rows, d, m, l, acc);
    fold_range(q, rows, d, k, v, bf16, begin, end, scratch, m, l, acc, columns, ask_next, ask_until, own);
}

// Row r of one KV head: merge the ranges' partials, in range order, and fold in the new tokens' own keys under the mask
// where the ranges leave them out (k_own null: the ranges hold them).
void merge_row(const float *qr, int r, int t, int d, int splits, const float *k_own, const float *v_own, const uint8_t *sees,
               const float *m, const float *l, const float *acc, int rows, float *out) {
    const int token = r % t;
    float own[MAX_ROWS];
    float top = -INFINITY;
    for (int i = 0; i < (k_own ? t : 0); ++i) {
        const bool visible = sees ? sees[token * t + i] != 0 : i <= token;
        if (!visible) { own[i] = -INFINITY; continue; }
        v8 a{};
        for (int c = 0; c < d; c += 8) a += load8(qr + c) * load8(k_own + (int64_t)i * d + c);
        own[i] = hsum(a);
        top = own[i] > top ? own[i] : top;
    }
    for (int s = 0; s < splits; ++s) top = m[s * rows + r] > top ? m[s * rows + r] : top;
    float total = 0.0f;
    for (int c = 0; c < d; ++c) out[c] = 0.0f;
    for (int s = 0; s < splits; ++s) {
        if (m[s * rows + r] == -INFINITY) continue;  // an empty range
        const float w = expf(m[s * rows + r] - top);
        total += w * l[s * rows + r];
        const float *as = acc + ((int64_t)s * rows + r) * d;
        for (int c = 0; c < d; ++c) out[c] += w * as[c];
    }
    for (int i = 0; i < (k_own ? t : 0); ++i) {
        if (own[i] == -INFINITY) continue;
        const float w = expf(own[i] - top);
        total += w;
        for (int c = 0; c < d; ++c) out[c] += w * v_own[(int64_t)i * d + c];
    }
    for (int c = 0; c < d; ++c) out[c] /= total;
}

int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }

// ---- Sums that do not depend on the token's place in a forward (the widening paths) ---------------------------
//
// A verify of t tokens and the one-token step at each of their positions should give each token the same bits, so that
// a bf16 (or fp32) stack writes exactly what autoregressive decoding writes, not just up to rounding. The linear layers
// and the decoder's other operations already give a row the same bits at any row count (csrc/linear_rows.cpp); the
// attention did not, since its ranges were cut where the threads' shares fell (which move with the cache's length) and
// the new tokens' own keys were folded in at the merge. So the widening paths cut every head's keys, the new tokens'
// included, into spans of SPAN keys from key 0, fold each span's blocks into its own maxima, sums and weighted values,
// and merge a row's spans in span order. A row's own keys it does not see (a later token of the verify) score -inf
// (mask_own): a block's weights then are the step's with zeros after its last key, and a span the row sees nothing
// of is skipped at the merge, so token i of a chain gets exactly the step's sums at its position, however the threads
// share the spans. Each thread takes a run of spans of about equal keys and asks for the next block across the spans
// of a head, as across the blocks of a range. Spans of 512 and 1,024 keys took 8-token verifies over 32,000 keys
// 1.04-1.06x less time (fewer partial sums written and merged) but forwards over 512 slots (the retrieval level's)
// 1.02-1.08x more (a head's one or two spans share poorly between threads): docs/benchmarks.md, "Spans fixed from key 0".
constexpr int64_t SPAN = 256;

// The first span of thread `th`'s run: the first whose first key, counting every head's keys in turn, is at or after
// th / threads of all keys (spans run head by head).
inline int64_t first_span(int th, int threads, int hkv, int64_t n, int64_t per_head) {
    const int64_t target = (int64_t)hkv * n * th / threads, h = target / n, sp = (target % n + SPAN - 1) / SPAN;
    return th == threads ? hkv * per_head : h * per_head + std::min(sp, per_head);
}

// A token tree's own keys (sees passed): a token sees the cached keys and its path (its ancestors among the new tokens, then
// itself), which the one-token step at its position holds as keys past, past + 1, ... But the tree's other nodes lie
// between them here, so the blocks holding them would be cut otherwise than the step's. So where a verify passes `sees`,
// the spans are folded for every row only up to the block where the new tokens' keys begin (`from`), and from there each
// token's keys are gathered as its step holds them (the cached keys of that block, then its path) and folded for its rows
// alone (fold_path): every token of a tree verify gets the step's sums at its position, as a chain's tokens do.

// Floats of one thread's room for fold_path: a token's query rows and partials, its gathered keys and values, fold scratch.
// Each part starts on a 64-byte line.
inline size_t lines(size_t floats) { return (floats + 15) / 16 * 16; }
inline size_t path_floats(int g, int t, int d) { return lines((size_t)g * (2 * d + 2)) + 2 * lines((size_t)(BLOCK + t) * d) + scratch_floats(d); }

// Token u's rows of one KV head (rows u, u + t, ... of its rows = g * t; q their scaled queries) folded over the token's
// keys as its step holds them: keys [from, past) as cached, then own key i wherever sees[u * t + i], in order. m, l and
// acc are the head's partials [span][rows], where the span holding `from` is folded up to it (fresh if it begins there).
void fold_path(const float *q, int rows, int t, int u, int d, const char *k, const char *v, bool bf16, int64_t past, int64_t from,
               const uint8_t *sees, float *room, float *m, float *l, float *acc) {
    const size_t row_bytes = (size_t)d * (bf16 ? 2 : 4);
    const int g = rows / t;
    float *qu = room, *mu = qu + (size_t)g * d, *lu = mu + g, *au = lu + g;
    char *keys = (char *)(room + lines((size_t)g * (2 * d + 2))), *values = keys + lines((size_t)(BLOCK + t) * d) * 4;  // [keys, d] each, as stored
    float *scratch = (float *)(values + lines((size_t)(BLOCK + t) * d) * 4);
    int64_t count = past - from;  // the token's keys from `from` on
    memcpy(keys, k + from * row_bytes, count * row_bytes), memcpy(values, v + from * row_bytes, count * row_bytes);
    for (int i = 0; i < t; ++i) {
        if (!sees[u * t + i]) continue;
        memcpy(keys + count * row_bytes, k + (past + i) * row_bytes, row_bytes), memcpy(values + count * row_bytes, v + (past + i) * row_bytes, row_bytes);
        ++count;
    }
    for (int j = 0; j < g; ++j) memcpy(qu + (size_t)j * d, q + (size_t)(j * t + u) * d, sizeof(float) * d);
    for (int64_t at = from / SPAN * SPAN; at < from + count; at += SPAN) {  // the token's spans from the one holding `from`
        const int64_t span = at / SPAN, lo = std::max(from, at), hi = std::min(from + count, at + SPAN);
        float *ms = m + span * rows, *ls = l + span * rows, *as = acc + span * rows * d;
        if (lo == at) {
            start_rows(g, d, mu, lu, au);
        } else {  // the span's keys before `from`, folded for every row
            for (int j = 0; j < g; ++j)
                mu[j] = ms[j * t + u], lu[j] = ls[j * t + u], memcpy(au + (size_t)j * d, as + (size_t)(j * t + u) * d, sizeof(float) * d);
        }
        // the gathered keys counted from `from`, a multiple of BLOCK: the blocks fall where the step's do
        fold_range(qu, g, d, keys, values, bf16, lo - from, hi - from, scratch, mu, lu, au, Columns{}, false, 0, NO_OWN_KEYS);
        for (int j = 0; j < g; ++j)
            ms[j * t + u] = mu[j], ls[j * t + u] = lu[j], memcpy(as + (size_t)(j * t + u) * d, au + (size_t)j * d, sizeof(float) * d);
    }
}

// specstack_decode_attention_columns' work on the widening paths, spans as above: q [hkv, rows, d] (rows = G * t),
// every head's n keys and values (the last t the new tokens'), sees [t, t] for a tree (null: a chain), the store's copy
// of the keys by groups where passed.
int attend_by_spans(const float *q, const void *k, const void *v, int64_t k_head_stride, int64_t v_head_stride, int hkv, int rows, int t,
                    int d, int64_t n, const uint8_t *sees, float scale, float *out, int threads, bool bf16, bool ask_next, uint32_t *columns,
                    int64_t columns_head_stride, int64_t *columns_upto) {
    const size_t elem = bf16 ? 2 : 4;
    const int64_t past = n - t, per_head = (n + SPAN - 1) / SPAN, spans = hkv * per_head;
    const int64_t from = sees ? past - past % BLOCK : n;  // where the rows stop sharing their blocks (a tree's paths: fold_path)
    const int64_t upto = columns ? std::min(*columns_upto, past - past % GROUP) : 0;
    const size_t room = lines(std::max(scratch_floats(d), sees ? path_floats(rows / t, t, d) : 0));  // each thread's
    // one buffer a call, the calling thread's (scratch.h): scaled queries, each span's partials, each thread's room
    float *scaled = thread_scratch<0>((size_t)hkv * rows * d + (size_t)spans * rows * (d + 2) + (size_t)threads * room);
    if (!scaled) return -1;
    float *m = scaled + (size_t)hkv * rows * d, *l = m + (size_t)spans * rows, *acc = l + (size_t)spans * rows;
    float *scratch = acc + (size_t)spans * rows * d;
    for (int64_t i = 0; i < (int64_t)hkv * rows * d; ++i) scaled[i] = q[i] * scale;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int th = 0; th < threads; ++th) {
        const int64_t first = first_span(th, threads, hkv, n, per_head), last = first_span(th + 1, threads, hkv, n, per_head);
        for (int64_t i = first; i < last; ++i) {
            const int h = (int)(i / per_head);
            const int64_t begin = i % per_head * SPAN, end = std::min(std::min(n, begin + SPAN), from);
            const int64_t run_end = last >= (h + 1) * per_head ? n : (last - h * per_head) * SPAN;  // where this thread's run of the head ends
            const Columns head_columns = columns ? Columns{columns + h * columns_head_stride, upto} : Columns{};
            attend_range(scaled + (int64_t)h * rows * d, rows, d, (const char *)k + h * k_head_stride * elem, (const char *)v + h * v_head_stride * elem,
                         bf16, begin, std::max(begin, end), scratch + (size_t)th * room, m + i * rows, l + i * rows, acc + i * rows * d, head_columns,
                         ask_next, run_end, Own{past, t});  // a tree's: none before `from`
        }
    }
    if (sees) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int hu = 0; hu < hkv * t; ++hu) {
            const int h = hu / t;
            fold_path(scaled + (int64_t)h * rows * d, rows, t, hu % t, d, (const char *)k + h * k_head_stride * elem,
                      (const char *)v + h * v_head_stride * elem, bf16, past, from, sees, scratch + (size_t)omp_get_thread_num() * room,
                      m + (int64_t)h * per_head * rows, l + (int64_t)h * per_head * rows, acc + (int64_t)h * per_head * rows * d);
        }
    }
    // every whole group of the cached keys the spans read was read, or laid out and kept (a tree's: those before `from`)
    if (columns) *columns_upto = std::max(upto, std::min(from, past - past % GROUP));
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int hr = 0; hr < hkv * rows; ++hr) {
        const int h = hr / rows, r = hr % rows;
        const int64_t first = (int64_t)h * per_head;
        merge_row(nullptr, r, t, d, (int)per_head, nullptr, nullptr, sees, m + first * rows, l + first * rows, acc + first * rows * d, rows,
                  out + (int64_t)hr * d);
    }
    return 0;
}

#ifdef SPECSTACK_DP
// ---- bfloat16 caches in 512-bit vectors: the dot-product path and the AMX path -----------------------

typedef float v16 __attribute__((vector_size(64), aligned(4)));  // one 512-bit register of floats
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

constexpr int TILE = 16;        // keys of a score tile, query rows of a group, columns of an output tile
constexpr int PAIRS = 32;       // bf16 numbers in a 64-byte tile row
constexpr int AMX_BLOCK = 64;   // keys per block: four score tiles
constexpr int FEW_ROWS = 6;     // groups of up to this many rows take the softmax row by row: attention over
                                // 7,500 and 32,000 keys 1.15x faster at 3 rows, 1.05x at 6, 0.89x at 12

inline v16 load16(const float *p) { return *(const v16 *)p; }
inline void store16(float *p, v16 x) { *(v16 *)p = x; }

// e^x for the softmax weights of the bf16 paths below, which are rounded to bf16 next: 2^f for f = x log2(e) - n in
// [-1/2, 1/2] by its Taylor polynomial of degree 6 (its relative error at most 1.6e-7, against the rounding's 2^-9 =
// 2e-3), scaled by 2^n (vscalefps). Ten instructions against expv's sixteen. A lane of x at -infinity comes out NaN: the
// dot-product paths' masks zero their padding lanes, and the tiles' scores are finite.
inline v16 exp_for_weights(v16 x) {
    const __m512 y = _mm512_mul_ps((__m512)x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return (v16)_mm512_scalef_ps(p, n);
}

// ---- Six rows or fewer: AVX-512's bf16 dot products, no tiles --------------------------------------
//
// A one-token step gives each KV head three query rows, and a 16 x 16 tile product then wastes 13 of
// its rows, and the softmax gathers each row's scores back out of the tile. Here the weights and
// outputs stay in registers: sixteen keys at a time are transposed into 32-bit words (a word is a
// pair of dimensions, a lane a key), so each query row scores them with d / 2 bf16 dot products
// (vdpbf16ps, whose products are exact and summed in float32), the online softmax runs on that vector
// of sixteen scores, and the weights, rounded to bf16 as on the tiles, weigh the values by key pairs
// (two keys' values interleaved, one dot product per sixteen columns per row). On the AMD Zen 4 host six
// rows here took 1.35x (7,500 keys) and 1.41x (32,000) less time than the block-by-block path below.
// The weights' e^x is the tiles' (exp_for_weights, ten instructions) rather than the float32-accurate expv
// (sixteen): on the AMD Zen 4 host whole bf16 forwards over 7,500 slots took 1.01-1.07x less time at four to
// sixteen tokens (1.03-1.09x over 32,000) and as much at one to three, and the logits stayed as near float32's on three texts
// (docs/benchmarks.md, "The dot products' weights by the tiles' exponential").
//
// A row's weights are taken against a reference score that moves up only when a block's scores rise more
// than RESCALE_ABOVE over it (FlashAttention-4's conditional rescaling), not against the running maximum:
// the common block then needs no horizontal maximum, no rescale of the sums and no exp of it, only a
// comparison, and its weight sums stay a vector (one lane a key) until the range ends. The weights are
// at most e^RESCALE_ABOVE, and the sums add them as rounded to bf16, as they weigh the values. On the
// AMD Zen 4 host, against rescaling at every block's maximum, one and two tokens over 7,500 and 32,000
// keys took 1.01-1.20x less time from memory, which mostly bounds them (the softmax had been half the
// path's time at two tokens with the cache in the last-level cache).
//
// Up to DP_GROUPED_ROWS rows (a verify of up to five tokens with groups of three) take this path in groups
// of at most six rows, each group in turn over a chunk of DP_CHUNK keys, which the later groups then read
// from the core's cache: 1.21-1.39x less time than the block-by-block path at nine to fifteen rows, over
// 7,500 and 32,000 keys. At eighteen rows the two measured alike (0.87-1.15x across runs); from 21 on, that
// path's one layout for all rows does better (1.0x at 21 rows, 1.22x at 24, 1.31-1.44x at 36-48). A group's
// state (reference, weight sums, weighted values) goes to memory and back between chunks exactly, and each
// row's arithmetic is its own, so a row's sums over a range of cached keys are the same bits at any number
// of rows: the first token of a verify of up to five tokens gets a one-token step's output.

// vpermt2w indices that interleave two rows of 32 bf16 numbers, a and b, by pairs: a0 b0 a1 b1 ... a15 b15
// (pairs_low) and a16 b16 ... a31 b31 (pairs_high), so that a dot product's word j holds both rows' column j.
inline __m512i pairs_low() {
    return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
}
inline __m512i pairs_high() { return _mm512_add_epi16(pairs_low(), _mm512_set1_epi16(16)); }

// qw[r * d / 2 + w] = row r's dimensions 2w and 2w+1 as one word of two bf16 numbers, for rows of d (exact: q holds
// bf16 numbers), so that one broadcast word multiplies a pair of dimensions in a dot product.
inline void query_words(const float *q, int rows, int d, uint32_t *qw) {
    for (int r = 0; r < rows; ++r)
        for (int w = 0; w < d / 2; ++w)
            qw[r * d / 2 + w] = (uint32_t)float_to_bf16(q[r * d + 2 * w]) | (uint32_t)float_to_bf16(q[r * d + 2 * w + 1]) << 16;
}

constexpr int DP_ROWS = 6;  // rows a group: weighted values and weight sums of six rows in registers
constexpr int DP_GROUPED_ROWS = 15;  // rows up to which a bfloat16 cache can take this path where there are no AMX tiles
constexpr int DP_ROWS_BESIDE_TILES = 3;  // and where there are: more rows take the tiles (measured on the Intel host)
constexpr int DP_CHUNK = 1024;  // keys each group takes in turn (256 KB of keys and values with d = 64; 512-2,048 measured alike)
// How far a row's scores may rise above its reference before the reference moves up to the block's maximum and the
// sums so far are rescaled: the weights stay at most e^8 (about 3,000), far inside float32's and bf16's range.
constexpr float RESCALE_ABOVE = 8.0f;
// Each block asks for the one DP_AHEAD ahead in shares, into L2: the keys' lines beside the key loads, the
// values' lines beside the weighted values, so that the requests go out as evenly as the block's own loads. Only the
// first group of rows over a chunk asks (the later groups find the chunk in L2). On the AMD Zen 4 host, against the
// hardware prefetcher alone, attention from memory (30 layers, two threads) took 7.0-7.8 -> 4.8-6.2 ms at one token
// and 8.4-8.6 -> 6.0-6.8 at two over 7,500 keys, 29.4-32.4 -> 20.3-25.7 at one token over 32,000, 1.05-1.17x less
// at three to five tokens; 3 to 6 blocks ahead did less well, asking into L1 worse (docs/benchmarks.md, "The
// register path's prefetches spread over its block"). On the AMX host of 2026-11-30, against asking for the whole
// block four ahead into L1 at its start (what AMX builds did until then), one token over 2,048, 16,000 and 32,000 keys
// took 1.03-1.07x less time and over 7,500 as much (docs/benchmarks.md, "Tiles from six rows, and the one-token
// attention's asks spread on the AMX host too"); 1, 3 and 4 blocks ahead measured alike.
constexpr int DP_AHEAD = 2;

// Keys [begin, end) of one KV head for ROWS <= DP_ROWS rows (their queries as bf16 words, qw [ROWS, d / 2]), d = 16 * D16
// (D16 a multiple of 2): each row's reference score ref[r], weight sums sums[r * 16 ..] (a lane a key) and weighted
// values acc[r * d ..] move on from where they are (fresh: from nothing; a row's reference -inf, its sums and values zero).
// Where `ask`, each block asks for the one DP_AHEAD ahead. A block of sixteen keys below the store's mark is read from
// its copy by groups (`columns`, the column path's layout: the transposed words themselves); any other is transposed
// here and, when all sixteen are cached keys, kept there (begin a multiple of TILE).
template <int ROWS, int D16>
void attend_range_dp(const uint32_t *qw, float scale, const uint16_t *k, const uint16_t *v, int64_t begin, int64_t end,
                     float *ref, float *sums, float *acc, bool fresh, bool ask, Columns columns) {
    constexpr int d = 16 * D16, WORDS = d / 2;
    constexpr int BLOCK_LINES = TILE * d * 2 / 64;  // cache lines of a block's keys (and as many of its values)
    const __m512i low = pairs_low(), high = pairs_high();
    __m512 o[ROWS][D16], sum[ROWS];
    float top[ROWS];
    for (int r = 0; r < ROWS; ++r) {
        top[r] = fresh ? -INFINITY : ref[r], sum[r] = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + 16 * r);
        for (int c = 0; c < D16; ++c) o[r][c] = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * d + 16 * c);
    }
    for (int64_t b = begin; b < end; b += TILE) {
        const int len = (int)(end - b < TILE ? end - b : TILE);
        const bool spread = ask && b + (DP_AHEAD + 1) * TILE <= end;  // the block DP_AHEAD ahead is whole
        float *group = columns.groups ? (float *)columns.groups + b / TILE * WORDS * TILE : nullptr;  // its place in the store's copy
        const bool kept = group && b + TILE <= columns.upto, keep = group && !kept && len == TILE;
        const char *k_ahead = group && b + (DP_AHEAD + 1) * TILE <= columns.upto ? (const char *)(group + DP_AHEAD * WORDS * TILE)
                                                                                : (const char *)(k + (b + DP_AHEAD * TILE) * d);
        const char *v_ahead = (const char *)(v + (b + DP_AHEAD * TILE) * d);
        __m512 s[ROWS], s2[ROWS];  // two sums a row: even and odd words (shorter chains of dependent products)
        for (int r = 0; r < ROWS; ++r) s[r] = s2[r] = _mm512_setzero_ps();
        for (int c = 0; c < WORDS; c += TILE) {  // words c .. c+15 of the sixteen keys, transposed: lane i is key i
            if (spread)  // this share of the keys ahead (a group's words are as many bytes as its keys)
                for (int line = BLOCK_LINES * c / WORDS; line < BLOCK_LINES * (c + TILE) / WORDS; ++line) _mm_prefetch(k_ahead + 64 * line, _MM_HINT_T1);
            __m512 t[TILE];
            if (kept) {
                for (int w = 0; w < TILE; ++w) t[w] = _mm512_loadu_ps(group + (c + w) * TILE);
            } else {
                for (int i = 0; i < TILE; ++i) t[i] = i < len ? _mm512_loadu_ps(k + (b + i) * d + 2 * c) : _mm512_setzero_ps();
                transpose16(t);
                if (keep)
                    for (int w = 0; w < TILE; ++w) _mm512_storeu_ps(group + (c + w) * TILE, t[w]);
            }
            for (int w = 0; w < TILE; w += 2)
                for (int r = 0; r < ROWS; ++r) {
                    s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)t[w], (__m512bh)_mm512_set1_epi32((int)qw[r * WORDS + c + w]));
                    s2[r] = _mm512_dpbf16_ps(s2[r], (__m512bh)t[w + 1], (__m512bh)_mm512_set1_epi32((int)qw[r * WORDS + c + w + 1]));
                }
        }
        const __mmask16 valid = (__mmask16)(len == TILE ? 0xFFFF : (1u << len) - 1);
        alignas(32) uint32_t weights[ROWS][TILE / 2];  // the block's weights of each row as bf16 pairs: word j holds keys 2j, 2j+1
        for (int r = 0; r < ROWS; ++r) {
            const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, _mm512_add_ps(s[r], s2[r]), _mm512_set1_ps(scale));  // [16]
            if (__builtin_expect(_mm512_cmp_ps_mask(x, _mm512_set1_ps(top[r] + RESCALE_ABOVE), _CMP_GT_OQ) != 0, 0)) {
                const float next = _mm512_reduce_max_ps(x), rescale = expf(top[r] - next);  // 0 on the first block (top = -inf)
                sum[r] = _mm512_mul_ps(sum[r], _mm512_set1_ps(rescale));
                for (int c = 0; c < D16; ++c) o[r][c] = _mm512_mul_ps(o[r][c], _mm512_set1_ps(rescale));
                top[r] = next;
            }
            const __m512 w = _mm512_maskz_mov_ps(valid, (__m512)exp_for_weights((v16)x - top[r]));  // keys past len weigh nothing
            const __m256bh rounded = _mm512_cvtneps_pbh(w);  // [16] bf16
            sum[r] = _mm512_add_ps(sum[r], _mm512_cvtpbh_ps(rounded));  // the weights as they weigh the values
            _mm256_store_si256((__m256i *)weights[r], (__m256i)rounded);
        }
        for (int j = 0; j < len; j += 2) {  // keys j, j+1 (a missing second key: zero values)
            if (spread)  // this share of the values ahead
                for (int line = BLOCK_LINES * j / TILE; line < BLOCK_LINES * (j + 2) / TILE; ++line) _mm_prefetch(v_ahead + 64 * line, _MM_HINT_T1);
            const uint16_t *va = v + (b + j) * d, *vb = va + d;
            for (int c = 0; c < D16; c += 2) {  // columns 16c .. 16c+31
                const __m512i a = _mm512_loadu_si512(va + 16 * c), e = j + 1 < len ? _mm512_loadu_si512(vb + 16 * c) : _mm512_setzero_si512();
                const __m512i lo = _mm512_permutex2var_epi16(a, low, e), hi = _mm512_permutex2var_epi16(a, high, e);
                for (int r = 0; r < ROWS; ++r) {
                    const __m512i pair = _mm512_set1_epi32((int)weights[r][j / 2]);  // broadcast from L1: no shuffle
                    o[r][c] = _mm512_dpbf16_ps(o[r][c], (__m512bh)lo, (__m512bh)pair);
                    o[r][c + 1] = _mm512_dpbf16_ps(o[r][c + 1], (__m512bh)hi, (__m512bh)pair);
                }
            }
        }
    }
    for (int r = 0; r < ROWS; ++r) {
        ref[r] = top[r];
        _mm512_storeu_ps(sums + 16 * r, sum[r]);
        for (int c = 0; c < D16; ++c) _mm512_storeu_ps(acc + r * d + 16 * c, o[r][c]);
    }
}

// Whether a work item of rows query rows with heads of d can take attend_range_dp, beside AMX tiles or not.
inline bool dp_fits(int rows, int d, bool tiles) { return rows <= (tiles ? DP_ROWS_BESIDE_TILES : DP_GROUPED_ROWS) && (d == 64 || d == 128); }

// attend_range_dp for rows <= DP_ROWS rows and heads of d (64 or 128).
void attend_range_dp_any(const uint32_t *qw, int rows, int d, float scale, const uint16_t *k, const uint16_t *v, int64_t begin, int64_t end,
                         float *ref, float *sums, float *acc, bool fresh, bool ask, Columns columns) {
    typedef void (*Range)(const uint32_t *, float, const uint16_t *, const uint16_t *, int64_t, int64_t, float *, float *, float *, bool, bool, Columns);
    static const Range ranges[2][DP_ROWS] = {{attend_range_dp<1, 4>, attend_range_dp<2, 4>, attend_range_dp<3, 4>, attend_range_dp<4, 4>, attend_range_dp<5, 4>, attend_range_dp<6, 4>},
                                             {attend_range_dp<1, 8>, attend_range_dp<2, 8>, attend_range_dp<3, 8>, attend_range_dp<4, 8>, attend_range_dp<5, 8>, attend_range_dp<6, 8>}};
    ranges[d == 128][rows - 1](qw, scale, k, v, begin, end, ref, sums, acc, fresh, ask, columns);
}

// One work item on the register path (dp_fits): keys [begin, end) of one KV head into running maxima m (the rows'
// references), sums l and weighted values acc, as attend_range does. The rows go in groups of at most DP_ROWS, as even
// as can be, each group in turn over each chunk of DP_CHUNK keys (the first asking for the blocks ahead, which the
// later groups then read from L2); sums is scratch of 16 floats a row. The first group of rows lays out the chunk's keys
// where the store's copy (`columns`) does not hold them yet, and the later ones read them from there.
void attend_range_dp_groups(const float *q, int rows, int d, float scale, const uint16_t *k, const uint16_t *v, int64_t begin, int64_t end,
                            float *sums, float *m, float *l, float *acc, Columns columns) {
    const int groups = (rows + DP_ROWS - 1) / DP_ROWS;
    uint32_t qw[DP_GROUPED_ROWS * MAX_DIM / 2];  // each row's dimension pairs as bf16 words, made once for every chunk
    query_words(q, rows, d, qw);
    for (int64_t c = begin; c < end || c == begin; c += DP_CHUNK) {
        const int64_t chunk_end = end - c < DP_CHUNK ? end : c + DP_CHUNK;
        for (int g = 0, first = 0; g < groups; first = rows * ++g / groups) {
            const int count = rows * (g + 1) / groups - first;
            const Columns read = g == 0 || !columns.groups ? columns : Columns{columns.groups, std::max(columns.upto, chunk_end - chunk_end % TILE)};
            attend_range_dp_any(qw + first * d / 2, count, d, scale, k, v, c, chunk_end, m + first, sums + 16 * first, acc + first * d, c == begin,
                                g == 0, read);
        }
    }
    for (int r = 0; r < rows; ++r) l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(sums + 16 * r));
}

// ---- More rows: the same dot products, the outputs in memory ----------------------------------------
//
// A verify gives each KV head G x T rows, more than the register path holds. Here a block of 64 keys is
// laid out once for all its rows, its keys transposed into words (a vector of sixteen keys per pair of
// dimensions) and its values interleaved by key pairs, as the register path lays out sixteen; then four rows
// at a time (two with heads of 128) score the block (sixteen sums in flight), run the online softmax over its
// 64 scores, and add the weighted values into their outputs, which are loaded and stored once a block. The
// roundings are the register path's: q's bf16 numbers exact, the products exact and summed in float32, the
// weights rounded to bf16 and summed so; the bits differ from it where the sums are added in another order.
// A vdpbf16ps does 32 multiply-adds where an FMA does 16 (8 on AVX2's widths), so on the AMD Zen 4 host
// (AVX-512 bf16, no AMX) attention over 32,000 keys took 1.5-1.7x less time at 3-16 tokens than widening the
// block to float32 for the GEMM path (since removed), 1.13x at two (docs/benchmarks.md, "bf16 verifies in dot products").

constexpr int DP_ROWS_BLOCK = 64;  // keys a block: four vectors of sixteen
// How many blocks ahead a work item asks for keys and values, a share of the block's lines before each pass of G rows,
// so that a wide verify's memory stream runs beside its products instead of stopping them in bursts. On the AMD Zen 4
// host, against asking for the whole next block at its start, attention from memory (30 layers, two threads) took
// 20.0 -> 15.7-16.1 ms at 8 tokens and 32.2 -> 28.5-28.6 at 16 over 7,500 keys (with the cache in the last-level
// cache: 14.5 and 27.1), 83.7 -> 65.6 at 8 tokens and 138 -> 117 at 16 over 32,000; one block ahead 1.01-1.08x more
// at 8 tokens than two, four blocks as two (docs/benchmarks.md, "A wide verify's prefetches spread over its passes").
constexpr int DP_ROWS_AHEAD = 2;

// The block's keys [0, len) transposed into words by groups of sixteen, kt [4, d / 2, 16] (word w of key 16u + i at
// (u * d / 2 + w) * 16 + i: four groups as the store's copy by groups holds them); keys past len are zeros.
template <int D16>
void dp_rows_keys(const uint16_t *k, int len, float *kt) {
    constexpr int d = 16 * D16, WORDS = d / 2;
    for (int u = 0; u < 4; ++u)
        for (int c = 0; c < WORDS; c += TILE) {
            __m512 t[TILE];
            for (int i = 0; i < TILE; ++i) t[i] = 16 * u + i < len ? _mm512_loadu_ps(k + (16 * u + i) * d + 2 * c) : _mm512_setzero_ps();
            transpose16(t);
            for (int w = 0; w < TILE; ++w) _mm512_storeu_ps(kt + (u * WORDS + c + w) * 16, t[w]);
        }
}

// The block's values [0, len) interleaved by key pairs, vi [DP_ROWS_BLOCK / 2, D16, 32] bf16 (pair p's columns
// 16c .. 16c+15 as a0 b0 a1 b1 ...); values past len are zeros.
template <int D16>
void dp_rows_values(const uint16_t *v, int len, uint16_t *vi) {
    constexpr int d = 16 * D16;
    const __m512i low = pairs_low(), high = pairs_high();
    for (int j = 0; j < DP_ROWS_BLOCK; j += 2) {
        const uint16_t *va = v + j * d, *vb = va + d;
        uint16_t *out = vi + (j / 2) * D16 * 32;
        for (int c = 0; c < D16; c += 2) {
            const __m512i a = j < len ? _mm512_loadu_si512(va + 16 * c) : _mm512_setzero_si512();
            const __m512i e = j + 1 < len ? _mm512_loadu_si512(vb + 16 * c) : _mm512_setzero_si512();
            _mm512_storeu_si512(out + 32 * c, _mm512_permutex2var_epi16(a, low, e));
            _mm512_storeu_si512(out + 32 * (c + 1), _mm512_permutex2var_epi16(a, high, e));
        }
    }
}

// The 32 bf16 numbers of x as float32, the first sixteen added to the last sixteen.
inline __m512 widen_halves(__m512bh x) {
    return _mm512_add_ps(_mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256((__m512i)x)), _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64((__m512i)x, 1)));
}

// G rows (their queries as bf16 words, qw [G, d / 2]) through one laid-out block of len keys: scores, the online
// softmax (running maxima top and sums sum), and the weighted values added into acc [G, d].
template <int G, int D16>
void dp_rows(const uint32_t *qw, float scale, const float *kt, const uint16_t *vi, int len, float *top, float *sum, float *acc) {
    constexpr int d = 16 * D16, WORDS = d / 2;
    __m512 s[G][4];
    for (int r = 0; r < G; ++r)
        for (int u = 0; u < 4; ++u) s[r][u] = _mm512_setzero_ps();
    for (int w = 0; w < WORDS; ++w) {
        __m512 x[4];
        for (int u = 0; u < 4; ++u) x[u] = _mm512_loadu_ps(kt + (u * WORDS + w) * 16);
        for (int r = 0; r < G; ++r) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qw[r * WORDS + w]);
            for (int u = 0; u < 4; ++u) s[r][u] = _mm512_dpbf16_ps(s[r][u], (__m512bh)x[u], qb);
        }
    }
    alignas(64) uint32_t weights[G][DP_ROWS_BLOCK / 2];  // row r's weights as bf16 pairs: word p holds keys 2p, 2p+1
    float rescale[G];
    __mmask16 valid[4];  // the block's keys in each vector of sixteen (past len: padding, weighing nothing)
    for (int u = 0; u < 4; ++u) valid[u] = (__mmask16)((1u << (len - 16 * u < 0 ? 0 : len - 16 * u > 16 ? 16 : len - 16 * u)) - 1);
    for (int r = 0; r < G; ++r) {  // the register path's conditional rescaling, a block of 64 at a time
        __m512 x[4];
        for (int u = 0; u < 4; ++u) x[u] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid[u], s[r][u], _mm512_set1_ps(scale));
        const __m512 bound = _mm512_set1_ps(top[r] + RESCALE_ABOVE);
        rescale[r] = 1.0f;
        if (__builtin_expect((_mm512_cmp_ps_mask(x[0], bound, _CMP_GT_OQ) | _mm512_cmp_ps_mask(x[1], bound, _CMP_GT_OQ) |
                              _mm512_cmp_ps_mask(x[2], bound, _CMP_GT_OQ) | _mm512_cmp_ps_mask(x[3], bound, _CMP_GT_OQ)) != 0, 0)) {
            const float next = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
            rescale[r] = expf(top[r] - next);  // 0 on the first block (top = -inf)
            sum[r] *= rescale[r], top[r] = next;
        }
        __m512 w[4];
        for (int u = 0; u < 4; ++u) w[u] = _mm512_maskz_mov_ps(valid[u], (__m512)exp_for_weights((v16)x[u] - top[r]));
        const __m512bh first = _mm512_cvtne2ps_pbh(w[1], w[0]), second = _mm512_cvtne2ps_pbh(w[3], w[2]);  // keys 0-31, 32-63 as bf16
        _mm512_store_si512(weights[r], (__m512i)first);
        _mm512_store_si512(weights[r] + 16, (__m512i)second);
        sum[r] += _mm512_reduce_add_ps(_mm512_add_ps(widen_halves(first), widen_halves(second)));  // the weights as they weigh the values
    }
    __m512 o[G][D16];
    for (int r = 0; r < G; ++r)
        for (int c = 0; c < D16; ++c) o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + 16 * c), _mm512_set1_ps(rescale[r]));
    for (int p = 0; p < (len + 1) / 2; ++p)
        for (int c = 0; c < D16; ++c) {
            const __m512bh x = (__m512bh)_mm512_loadu_si512(vi + (p * D16 + c) * 32);
            for (int r = 0; r < G; ++r) o[r][c] = _mm512_dpbf16_ps(o[r][c], x, (__m512bh)_mm512_set1_epi32((int)weights[r][p]));
        }
    for (int r = 0; r < G; ++r)
        for (int c = 0; c < D16; ++c) _mm512_storeu_ps(acc + r * d + 16 * c, o[r][c]);
}

// One work item as attend_range_dp, for any number of rows, d = 16 * D16. scratch holds the laid-out block (kt: d / 2 * 64
// floats; vi: as many) and the queries as words (rows * d / 2): at most 3 * 64 * d / 2 floats, within scratch_floats(d).
// A block's keys come from the store's copy by groups where it holds all four of its groups (`columns`, below its
// mark); else they are laid out here and its whole groups kept there (begin a multiple of TILE).
template <int D16>
void attend_range_dp_rows(const float *q, int rows, float scale, const uint16_t *k, const uint16_t *v, int64_t begin, int64_t end,
                          float *scratch, float *m, float *l, float *acc, Columns columns) {
    constexpr int d = 16 * D16, WORDS = d / 2, G = D16 == 4 ? 4 : 2;  // G rows a pass: G * D16 outputs and 4G sums in registers
    float *kt = scratch;
    uint16_t *vi = (uint16_t *)(kt + WORDS * 64);
    uint32_t *qw = (uint32_t *)(vi + DP_ROWS_BLOCK / 2 * D16 * 32);
    query_words(q, rows, d, qw);
    for (int r = 0; r < rows; ++r) m[r] = -INFINITY, l[r] = 0.0f;
    for (int i = 0; i < rows * d; ++i) acc[i] = 0.0f;
    constexpr int LINES = DP_ROWS_BLOCK * d * 2 / 64;  // cache lines of a block's keys (and as many of its values)
    const int passes = rows / G;                          // passes of G rows a block (none: the loop below never asks)
    for (int64_t b = begin; b < end; b += DP_ROWS_BLOCK) {
        const int len = (int)(end - b < DP_ROWS_BLOCK ? end - b : DP_ROWS_BLOCK);
        const int64_t ahead = b + DP_ROWS_AHEAD * DP_ROWS_BLOCK;  // the block asked for while this one is computed
        float *groups = columns.groups ? (float *)columns.groups + b / TILE * WORDS * TILE : nullptr;  // the block's place in the store's copy
        const float *keys = groups;
        if (!groups || b + DP_ROWS_BLOCK > columns.upto) {
            dp_rows_keys<D16>(k + b * d, len, kt);
            if (groups) memcpy(groups, kt, sizeof(float) * (len / TILE) * WORDS * TILE);  // its whole groups kept
            keys = kt;
        }
        dp_rows_values<D16>(v + b * d, len, vi);
        const char *keys_ahead = groups && ahead + DP_ROWS_BLOCK <= columns.upto ? (const char *)(groups + DP_ROWS_AHEAD * DP_ROWS_BLOCK / TILE * WORDS * TILE)
                                                                                 : (const char *)(k + ahead * d);  // as many bytes either way
        int r = 0;
        for (int pass = 0; r + G <= rows; r += G, ++pass) {
            if (ahead < end)  // this pass's share of the block ahead, keys and values, into L2
                for (int line = LINES * pass / passes; line < LINES * (pass + 1) / passes; ++line) {
                    _mm_prefetch(keys_ahead + 64 * line, _MM_HINT_T1);
                    _mm_prefetch((const char *)(v + ahead * d) + 64 * line, _MM_HINT_T1);
                }
            dp_rows<G, D16>(qw + r * WORDS, scale, keys, vi, len, m + r, l + r, acc + r * d);
        }
        switch (rows - r) {
            case 3: dp_rows<3, D16>(qw + r * WORDS, scale, keys, vi, len, m + r, l + r, acc + r * d); break;
            case 2: dp_rows<2, D16>(qw + r * WORDS, scale, keys, vi, len, m + r, l + r, acc + r * d); break;
            case 1: dp_rows<1, D16>(qw + r * WORDS, scale, keys, vi, len, m + r, l + r, acc + r * d); break;
            default: break;
        }
    }
}

// attend_range_dp_rows for heads of 64 or 128.
void attend_range_dp_rows_any(const float *q, int rows, int d, float scale, const uint16_t *k, const uint16_t *v, int64_t begin, int64_t end,
                              float *scratch, float *m, float *l, float *acc, Columns columns) {
    if (d == 64) attend_range_dp_rows<4>(q, rows, scale, k, v, begin, end, scratch, m, l, acc, columns);
    else attend_range_dp_rows<8>(q, rows, scale, k, v, begin, end, scratch, m, l, acc, columns);
}

#ifdef SPECSTACK_AMX

// Tiles 0-7 (per thread), each 16 rows of 64 bytes. The scores: 0-1 two score tiles side by side, 2-5 keys, 6-7
// queries; the outputs: 0-3 four output tiles side by side, 4-5 values in turn, 6-7 weights. Tiles are not
// renamed, so a product that reuses the last one's accumulator or source tile waits for it to finish: with one
// accumulator and one tile for each operand (as until 2026-11-30, sixth session) whole forwards of 2-16 tokens over
// 7,500 slots took 1.01-1.04x more time (docs/benchmarks.md, "The AMX attention asks").
void configure_tiles() {
    TileConfig config;
    for (int i = 0; i < 8; ++i) config.colsb[i] = 64, config.rows[i] = TILE;
    _tile_loadconfig(&config);
}

// qv[g][s][pair][2 * row + i] = q[16 g + row][32 s + 2 pair + i], zero past the rows: each group of
// sixteen query rows as the B operand of K x Q^T (its dimension pairs interleaved).
void interleave_queries(const float *q, int rows, int d, uint16_t *qv) {
    const int groups = (rows + TILE - 1) / TILE, steps = d / PAIRS;
    for (int g = 0; g < groups; ++g)
        for (int s = 0; s < steps; ++s)
            for (int pair = 0; pair < TILE; ++pair)
                for (int row = 0; row < TILE; ++row)
                    for (int i = 0; i < 2; ++i) {
                        const int r = g * TILE + row;
                        const float x = r < rows ? q[(int64_t)r * d + s * PAIRS + 2 * pair + i] : 0.0f;
                        qv[(((int64_t)g * steps + s) * TILE + pair) * PAIRS + 2 * row + i] = float_to_bf16(x);  // exact: q holds bf16 numbers
                    }
}

// Bytes [from, from + bytes) of the next block's keys and of its values asked for into L2, a line at a time: the
// AMX path's reads a block ahead, spread over this block's work (attend_range_amx says where).
inline void ask_ahead(const char *keys_ahead, const char *values_ahead, int64_t from, int64_t bytes) {
    for (int64_t at = from; at < from + bytes; at += 64) _mm_prefetch(keys_ahead + at, _MM_HINT_T1), _mm_prefetch(values_ahead + at, _MM_HINT_T1);
}

// vv[s][tile][pair][2 * col + i] = v[32 s + 2 pair + i][16 tile + col]: a block's 64 values (rows of d)
// as the B operand of P x V (key pairs interleaved), two output tiles per 32 columns. Where keys_ahead is not
// null (the next block's keys, and values_ahead its values), each step asks for the lines it reads, a block on,
// into L2.
void interleave_values(const uint16_t *v, int d, uint16_t *vv, const char *keys_ahead, const char *values_ahead) {
    const __m512i low = pairs_low(), high = pairs_high();
    const int tiles = d / TILE;
    for (int j = 0; j < AMX_BLOCK; j += 2) {
        const int s = j / PAIRS, pair = j % PAIRS / 2;
        for (int c = 0; c < d; c += PAIRS) {
            if (keys_ahead) {
                const int64_t at = 2 * ((int64_t)j * d + c);  // bytes: keys (values) j and j + 1, columns c .. c+31
                ask_ahead(keys_ahead, values_ahead, at, 64), ask_ahead(keys_ahead, values_ahead, at + 2 * d, 64);
            }
            const __m512i a = _mm512_loadu_si512(v + (int64_t)j * d + c), b = _mm512_loadu_si512(v + (int64_t)(j + 1) * d + c);
            uint16_t *out = vv + ((int64_t)(s * tiles + c / TILE) * TILE + pair) * PAIRS;
            _mm512_storeu_si512(out, _mm512_permutex2var_epi16(a, low, b));
            _mm512_storeu_si512(out + TILE * PAIRS, _mm512_permutex2var_epi16(a, high, b));
        }
    }
}

// st[j][row] = k_j . q_row for the block's 64 keys (rows of d bf16) and one group's interleaved queries:
// sixteen keys' 32-column chunk in tiles 2-5, a chunk of the queries in tile 6 or 7, two score tiles (0, 1)
// side by side.
void group_scores(const uint16_t *k, const uint16_t *qv, int d, float *st) {
    const int64_t next = (int64_t)TILE * d;  // the next sixteen keys
    for (int t = 0; t < AMX_BLOCK / TILE; t += 2) {
        _tile_zero(0);
        _tile_zero(1);
        for (int s = 0; s < d / PAIRS; s += 2) {  // columns 32s .. 32s+63 (only 32s .. 32s+31 where d / 32 is odd and this is the last)
            const uint16_t *ks = k + t * next + s * PAIRS, *qs = qv + (int64_t)s * TILE * PAIRS;
            const bool two = s + 1 < d / PAIRS;
            _tile_loadd(2, ks, d * 2);
            _tile_loadd(3, ks + next, d * 2);
            _tile_loadd(6, qs, 64);
            _tile_dpbf16ps(0, 2, 6);
            _tile_dpbf16ps(1, 3, 6);
            if (two) {
                _tile_loadd(4, ks + PAIRS, d * 2);
                _tile_loadd(5, ks + next + PAIRS, d * 2);
                _tile_loadd(7, qs + TILE * PAIRS, 64);
                _tile_dpbf16ps(0, 4, 7);
                _tile_dpbf16ps(1, 5, 7);
            }
        }
        _tile_stored(0, st + t * TILE * TILE, 64);
        _tile_stored(1, st + (t + 1) * TILE * TILE, 64);
    }
}

// The online softmax of one group down the block's len keys: st [64][16] scores in, weights out (zero
// past len); the group's running maxima m and sums l (count rows) move on; returns each row's rescale.
v16 group_softmax(float *st, int len, float scale, int count, float *m, float *l) {
    v16 top = v16{} - INFINITY;
    for (int r = 0; r < count; ++r) top[r] = m[r];
    const v16 before = top;
    v16 tops[4] = {top, top, top, top};  // four chains of maxima, not one dependent chain of 64
    for (int j = 0; j < len; ++j) {
        const v16 x = load16(st + j * TILE) * scale;
        tops[j % 4] = x > tops[j % 4] ? x : tops[j % 4];
    }
    tops[0] = tops[0] > tops[1] ? tops[0] : tops[1], tops[2] = tops[2] > tops[3] ? tops[2] : tops[3];
    top = tops[0] > tops[2] ? tops[0] : tops[2];
    const v16 rescale = expv<v16, v16i>(before - top);  // 0 on the first block (m = -inf)
    v16 sum{};
    for (int j = 0; j < AMX_BLOCK; ++j) {  // the scaled score recomputed, the same bits: no pass storing it
        const v16 w = j < len ? exp_for_weights(load16(st + j * TILE) * scale - top) : v16{};
        store16(st + j * TILE, w);
        sum += w;
    }
    for (int r = 0; r < count; ++r) l[r] = l[r] * rescale[r] + sum[r], m[r] = top[r];
    return rescale;
}

// The same where every row's scores stay within RESCALE_ABOVE of its reference m (the register path's
// conditional rescaling): one pass, the weights against m, no maximum, a rescale of 1; the sums l move on.
// Returns false, st then spoilt, where a row's score rose past that (and on a row's first block, m = -inf):
// the caller scores the block again and takes group_softmax, which moves the references up to the maxima.
// Where keys_ahead is not null (the next block's 64 keys, and values_ahead its values, rows of d bf16: d / 32
// cache lines a row), step j asks for key j's and value j's lines into L2: the next block's reads spread over
// this block's arithmetic.
bool group_softmax_held(float *st, int len, float scale, int count, const float *m, float *l, const char *keys_ahead,
                        const char *values_ahead, int d) {
    v16 ref{};  // rows past count: a finite reference (their zero queries score 0; their outputs are not read)
    for (int r = 0; r < count; ++r) ref[r] = m[r];
    const v16 limit = ref + RESCALE_ABOVE;  // -inf on a first block: every score is over it
    v16i over{};
    v16 sum{};
    for (int j = 0; j < len; ++j) {
        if (keys_ahead) ask_ahead(keys_ahead, values_ahead, 2 * (int64_t)d * j, 2 * d);  // key j's and value j's lines, a block on
        const v16 x = load16(st + j * TILE) * scale, w = exp_for_weights(x - ref);
        over |= x > limit;
        store16(st + j * TILE, w);
        sum += w;
    }
    if (_mm512_test_epi32_mask((__m512i)over, (__m512i)over) != 0) return false;
    for (int j = len; j < AMX_BLOCK; ++j) store16(st + j * TILE, v16{});  // keys past len weigh nothing
    for (int r = 0; r < count; ++r) l[r] += sum[r];
    return true;
}

// p[s][row][key] = st[32 s + key][row] rounded to bf16: the weights as the A operand of P x V.
void weights_by_rows(const float *st, uint16_t *p) {
    for (int c = 0; c < AMX_BLOCK; c += PAIRS) {
        __m512 low[16], high[16];
        for (int i = 0; i < TILE; ++i) low[i] = _mm512_loadu_ps(st + (c + i) * TILE), high[i] = _mm512_loadu_ps(st + (c + TILE + i) * TILE);
        transpose16(low), transpose16(high);
        for (int r = 0; r < TILE; ++r)  // keys c .. c+15 in the low half, c+16 .. c+31 in the high
            _mm512_storeu_si512(p + ((int64_t)(c / PAIRS) * TILE + r) * PAIRS, (__m512i)_mm512_cvtne2ps_pbh(high[r], low[r]));
    }
}

// The same softmax for a group of at most FEW_ROWS rows, row by row: each row's 64 scores gathered from
// its column of st, exponentiated as four vectors (not sixteen rows' worth down the keys), and written
// straight into the weights as the A operand of P x V (p[s][row][key], bf16; rows past count are not
// written: their outputs are not read). Returns each row's rescale.
v16 few_rows_softmax(const float *st, int len, float scale, int count, float *m, float *l, uint16_t *p) {
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(TILE));
    v16 rescale{};
    for (int r = 0; r < count; ++r) {
        __m512 s[4];  // keys 16c .. 16c+15 of row r; -inf past len
        for (int c = 0; c < 4; ++c) {
            const int valid = len - TILE * c;
            const __mmask16 mask = (__mmask16)(valid >= TILE ? 0xFFFF : valid <= 0 ? 0 : (1u << valid) - 1);
            s[c] = _mm512_mask_i32gather_ps(_mm512_set1_ps(-INFINITY), mask, column, st + TILE * c * TILE + r, 4) * scale;
        }
        const float top = fmaxf(m[r], _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3]))));
        v16 sum{};
        for (int c = 0; c < 4; ++c) {
            const v16 x = (v16)s[c], w = expv<v16, v16i>(x - top);
            s[c] = (__m512)(x == -INFINITY ? v16{} : w);  // padded keys weigh nothing
            sum += (v16)s[c];
        }
        rescale[r] = expf(m[r] - top);  // 0 on the first block (m = -inf)
        l[r] = l[r] * rescale[r] + _mm512_reduce_add_ps((__m512)sum), m[r] = top;
        _mm512_storeu_si512(p + r * PAIRS, (__m512i)_mm512_cvtne2ps_pbh(s[1], s[0]));            // keys 0-31
        _mm512_storeu_si512(p + (TILE + r) * PAIRS, (__m512i)_mm512_cvtne2ps_pbh(s[3], s[2]));   // keys 32-63
    }
    return rescale;
}

// o[row][0, d) = sum over the block's keys of p[row][key] v_key, float32: up to four output tiles side by side,
// the weights of keys 0-31 in tile 6 and of keys 32-63 in tile 7.
void group_values(const uint16_t *p, const uint16_t *vv, int d, float *o) {
    const int tiles = d / TILE;  // even: d is a multiple of 32
    _tile_loadd(6, p, 64);
    _tile_loadd(7, p + TILE * PAIRS, 64);
    for (int t = 0; t < tiles; t += 4) {
        const uint16_t *low = vv + (int64_t)t * TILE * PAIRS, *high = vv + (int64_t)(tiles + t) * TILE * PAIRS;  // keys 0-31, 32-63
        const bool four = t + 4 <= tiles;
        _tile_loadd(0, o + t * TILE, d * 4);
        _tile_loadd(1, o + (t + 1) * TILE, d * 4);
        _tile_loadd(4, low, 64);
        _tile_dpbf16ps(0, 6, 4);
        _tile_loadd(5, low + TILE * PAIRS, 64);
        _tile_dpbf16ps(1, 6, 5);
        if (four) {
            _tile_loadd(2, o + (t + 2) * TILE, d * 4);
            _tile_loadd(3, o + (t + 3) * TILE, d * 4);
            _tile_loadd(4, low + 2 * TILE * PAIRS, 64);
            _tile_dpbf16ps(2, 6, 4);
            _tile_loadd(5, low + 3 * TILE * PAIRS, 64);
            _tile_dpbf16ps(3, 6, 5);
        }
        _tile_loadd(4, high, 64);
        _tile_dpbf16ps(0, 7, 4);
        _tile_loadd(5, high + TILE * PAIRS, 64);
        _tile_dpbf16ps(1, 7, 5);
        _tile_stored(0, o + t * TILE, d * 4);
        _tile_stored(1, o + (t + 1) * TILE, d * 4);
        if (four) {
            _tile_loadd(4, high + 2 * TILE * PAIRS, 64);
            _tile_dpbf16ps(2, 7, 4);
            _tile_loadd(5, high + 3 * TILE * PAIRS, 64);
            _tile_dpbf16ps(3, 7, 5);
            _tile_stored(2, o + (t + 2) * TILE, d * 4);
            _tile_stored(3, o + (t + 3) * TILE, d * 4);
        }
    }
}

// Floats of scratch one AMX work item needs: a group's scores and weights, the block's interleaved
// values, every group's weighted values, a short last block zero-padded, every group's interleaved queries.
inline size_t amx_scratch_floats(int d) {
    return (size_t)AMX_BLOCK * TILE + (size_t)TILE * AMX_BLOCK / 2 + (size_t)AMX_BLOCK * d / 2 + (size_t)MAX_ROWS * d
           + (size_t)AMX_BLOCK * d + (size_t)MAX_ROWS * d / 2;
}

// One work item on AMX tiles: keys [begin, end) of one KV head (bfloat16, rows of d, d a multiple of 32)
// into references m (running maxima, or the held references of group_softmax_held), sums l and weighted values
// acc, as attend_range does. q [rows, d] holds the unscaled queries (bf16 numbers); scores are scaled in float32.
// The weighted values accumulate on the tiles (loaded and stored a block at a time), rescaled in memory only
// where a row's reference moved: since 2026-11-30 (sixth session), with the held references and exp_for_weights,
// whole forwards of 8 / 16 tokens over 7,500 slots took 1.01-1.03 / 1.06-1.07x less time (over 32,000: 1.06 / 1.12x)
// than with every group's maximum taken, its weighted values added in vectors and the float32-accurate expv
// (docs/benchmarks.md, "The AMX attention asks").
void attend_range_amx(const float *q, int rows, int d, float scale, const uint16_t *k, const uint16_t *v, int64_t begin, int64_t end,
                      float *scratch, float *m, float *l, float *acc) {
    float *st = scratch;                                    // [64 keys][16 rows]
    uint16_t *p = (uint16_t *)(st + AMX_BLOCK * TILE);      // [2][16 rows][32 keys]
    uint16_t *vv = p + TILE * AMX_BLOCK;                    // [2][d / 16][16 pairs][32]
    float *o = (float *)(vv + AMX_BLOCK * d);               // [groups * 16 rows][d]: the weighted values, whole groups
    uint16_t *padded = (uint16_t *)(o + MAX_ROWS * d);      // [64][d] keys, then [64][d] values
    uint16_t *qv = padded + 2 * AMX_BLOCK * d;              // [groups][d / 32][16 pairs][32]
    const int groups = (rows + TILE - 1) / TILE;
    interleave_queries(q, rows, d, qv);
    configure_tiles();
    for (int r = 0; r < rows; ++r) m[r] = -INFINITY, l[r] = 0.0f;
    memset(o, 0, sizeof(float) * groups * TILE * d);
    for (int64_t b = begin; b < end; b += AMX_BLOCK) {
        const int len = (int)(end - b < AMX_BLOCK ? end - b : AMX_BLOCK);
        const uint16_t *kb = k + b * d, *vb = v + b * d;
        if (len < AMX_BLOCK) {  // a short last block, zero-padded: zero values weigh nothing, padded scores are dropped
            memset(padded, 0, sizeof(uint16_t) * 2 * AMX_BLOCK * d);
            memcpy(padded, kb, sizeof(uint16_t) * len * d), memcpy(padded + AMX_BLOCK * d, vb, sizeof(uint16_t) * len * d);
            kb = padded, vb = padded + AMX_BLOCK * d;
        }
        // The next block asked for into L2 as this one is worked on: in the first group's held softmax, spread over its
        // 64 steps, or where that group takes the row-by-row softmax, as the values are laid out. Against no asks, whole
        // forwards of 2 / 4 / 6 / 8 / 16 tokens over 7,500 slots took 1.05 / 1.09 / 1.11 / 1.07 / 1.06x less time; asking
        // as the values are laid out at every width, 1.03-1.04x more than in the softmax from 4 tokens; asking for a whole
        // block (1, 2 or 4 ahead) at its start, no less or 1.03-1.1x more (docs/benchmarks.md, "The AMX attention asks").
        const bool next_whole = b + 2 * AMX_BLOCK <= end;
        const char *keys_ahead = next_whole ? (const char *)(k + (b + AMX_BLOCK) * d) : nullptr;
        const char *values_ahead = next_whole ? (const char *)(v + (b + AMX_BLOCK) * d) : nullptr;
        const bool few_first = rows <= FEW_ROWS;  // one group, its softmax row by row (FEW_ROWS < TILE)
        interleave_values(vb, d, vv, few_first ? keys_ahead : nullptr, values_ahead);
        for (int g = 0; g < groups; ++g) {
            const int first = g * TILE, count = rows - first < TILE ? rows - first : TILE;
            const uint16_t *qg = qv + (int64_t)g * d * TILE;
            float *og = o + (int64_t)first * d;
            group_scores(kb, qg, d, st);
            v16 rescale = v16{} + 1.0f;
            if (count <= FEW_ROWS) {
                rescale = few_rows_softmax(st, len, scale, count, m + first, l + first, p);
            } else {
                const char *ka = g == 0 ? keys_ahead : nullptr;
                if (!group_softmax_held(st, len, scale, count, m + first, l + first, ka, values_ahead, d)) {
                    group_scores(kb, qg, d, st);  // spoilt: scored again, the references moved up
                    rescale = group_softmax(st, len, scale, count, m + first, l + first);
                }
                weights_by_rows(st, p);
            }
            for (int r = 0; r < count; ++r)
                if (rescale[r] != 1.0f)
                    for (int c = 0; c < d; c += TILE) store16(og + r * d + c, load16(og + r * d + c) * rescale[r]);
            group_values(p, vv, d, og);
        }
    }
    memcpy(acc, o, sizeof(float) * rows * d);
    _tile_release();
}
#endif  // SPECSTACK_AMX
#endif  // SPECSTACK_DP

}  // namespace

extern "C" {

int specstack_max_rows() { return MAX_ROWS; }
int specstack_max_dim() { return MAX_DIM; }

// 1 where `rows` query rows a KV head over a cache (bfloat16 where kv_bf16 is nonzero) with heads of width d read a store's
// keys by groups where they are passed: specstack_decode_attention_columns' `columns` [hkv, ceil(capacity / 16),
// key_words, 16] 32-bit words (key_words: d, or d / 2 for bfloat16). The widening paths' column path does (six rows or
// more), and a bfloat16 cache taking the bf16 dot products (dp nonzero, built) does at any number of rows, with heads of
// 64 or 128 (beside AMX tiles, the rows the tiles take read the keys as stored and leave the copy as it is).
int specstack_column_keys(int kv_bf16, int d, int rows, int dp) {
#if defined(__AVX512F__)
#ifdef SPECSTACK_DP
    if (kv_bf16 && dp) return d == 64 || d == 128 ? 1 : 0;  // the dot products read the groups at any number of rows
#else
    (void)dp;
#endif
    return column_path(d, rows) ? 1 : 0;
#else
    (void)kv_bf16, (void)d, (void)rows, (void)dp;
    return 0;
#endif
}

// 1 where a bfloat16 cache can take bf16 dot products (in registers up to fifteen query rows, three beside AMX tiles,
// else block by block).
int specstack_dp_bf16() {
#ifdef SPECSTACK_DP
    return 1;
#else
    return 0;
#endif
}

// 1 where a bfloat16 cache can take the AMX path: compiled for a CPU with AMX and the tiles lent by Linux.
int specstack_amx_bf16() {
#ifdef SPECSTACK_AMX
    return amx_permitted() ? 1 : 0;
#else
    return 0;
#endif
}

// q [hkv, rows, d] contiguous (rows = G * t); keys and values of head h at k + h * k_head_stride elements,
// rows of d, n of them, the last t the new tokens' own; float32, or bfloat16 where kv_bf16 is nonzero.
// sees [t, t] (token i sees own key j) or null for a chain. out [hkv, rows, d] float32. A bfloat16 cache
// takes bf16 dot products in registers where dp is nonzero, specstack_dp_bf16() says 1, rows <= 15 (3 where it
// takes tiles) and d is 64 or 128; else the AMX path where amx is nonzero, specstack_amx_bf16() says 1 and d is a multiple of 32
// (q then holds bf16 numbers); else bf16 dot products for any rows where dp is nonzero, specstack_dp_bf16()
// says 1 and d is 64 or 128 (q holds bf16 numbers); else it is widened. Returns 0, or -1 for shapes it does not take (the
// caller falls back).
int specstack_decode_attention_columns(const float *q, const void *k, const void *v, int64_t k_head_stride, int64_t v_head_stride,
                                       int hkv, int rows, int t, int d, int64_t n, const uint8_t *sees, float scale,
                                       float *out, int threads, int kv_bf16, int amx, int dp, uint32_t *columns,
                                       int64_t columns_head_stride, int64_t *columns_upto) {
    if (rows < 1 || rows > MAX_ROWS || t < 1 || rows % t != 0 || d % 8 != 0 || d > MAX_DIM || n < t || hkv < 1 || threads < 1) return -1;
    const bool bf16 = kv_bf16 != 0;
    const size_t elem = bf16 ? 2 : 4;
    const int64_t past = n - t;
    // as many ranges per head as make the work items a multiple of the threads, none under one block
    int splits = threads / gcd(hkv, threads);
    while (splits > 1 && past / splits < BLOCK) --splits;
    const int items = hkv * splits;
    auto range_start = [&](int s) { const int64_t at = past * s / splits; return s == splits ? past : at - at % GROUP; };  // groups stay whole
#ifdef SPECSTACK_AMX
    const bool tiles = bf16 && amx != 0 && d % PAIRS == 0 && amx_permitted();
#else
    const bool tiles = false;
    (void)amx;
#endif
#ifdef SPECSTACK_DP
    const bool registers = bf16 && dp != 0 && dp_fits(rows, d, tiles);
    const bool dot_rows = bf16 && dp != 0 && !registers && (d == 64 || d == 128);  // attend_range_dp_rows where there are no tiles
#else
    const bool registers = false, dot_rows = false;
    (void)dp;
#endif
    if (!registers && !tiles && !dot_rows)  // the widening paths
        return attend_by_spans(q, k, v, k_head_stride, v_head_stride, hkv, rows, t, d, n, sees, scale, out, threads, bf16, ASK_NEXT_KEYS && dp == 0,
                               reads_columns(d, rows) ? columns : nullptr, columns_head_stride, columns_upto);
#ifdef SPECSTACK_AMX
    const size_t item_floats = registers ? 16 * (size_t)rows : tiles ? amx_scratch_floats(d) : scratch_floats(d);  // the register path: its weight sums
#else
    const size_t item_floats = registers ? 16 * (size_t)rows : scratch_floats(d);
#endif
    // below: the bf16 dot products and the AMX tiles, over the cached keys in ranges cut at the threads' shares, the new
    // tokens' own keys folded in at the merge (their verifies round otherwise than their steps). The dot products read
    // and keep the store's copy of the keys by groups (`columns`) where it is passed; the tiles read the keys as stored.
    const bool lays_out = columns && (registers || (dot_rows && !tiles));
    const int64_t upto = lays_out ? std::min(*columns_upto, past - past % GROUP) : 0;
    const size_t own = (size_t)hkv * t * d;  // the new tokens' own keys (and values), as float32
    // one buffer a call, the calling thread's (scratch.h): scaled queries, each item's partials and scratch, the own keys and values
    float *scaled = thread_scratch<0>((size_t)hkv * rows * d + (size_t)items * (rows * (d + 2) + item_floats) + 2 * own);
    if (!scaled) return -1;
    float *m = scaled + (size_t)hkv * rows * d, *l = m + (size_t)items * rows, *acc = l + (size_t)items * rows;
    float *scratch = acc + (size_t)items * rows * d, *k_own = scratch + (size_t)items * item_floats, *v_own = k_own + own;
    for (int64_t i = 0; i < (int64_t)hkv * rows * d; ++i) scaled[i] = q[i] * scale;
    for (int h = 0; h < hkv; ++h) {
        widen((const char *)k + (h * k_head_stride + past * d) * elem, bf16, (int64_t)t * d, k_own + (size_t)h * t * d);
        widen((const char *)v + (h * v_head_stride + past * d) * elem, bf16, (int64_t)t * d, v_own + (size_t)h * t * d);
    }

#pragma omp parallel for num_threads(threads) schedule(static)
    for (int item = 0; item < items; ++item) {
        const int h = item / splits, s = item % splits;
        const int64_t begin = range_start(s), end = range_start(s + 1);
        float *item_m = m + (int64_t)item * rows, *item_l = l + (int64_t)item * rows, *item_acc = acc + (int64_t)item * rows * d;
        const Columns head_columns = lays_out ? Columns{columns + h * columns_head_stride, upto} : Columns{};
        (void)head_columns;  // a build without the dot products
#ifdef SPECSTACK_DP
        if (registers) {
            attend_range_dp_groups(q + (int64_t)h * rows * d, rows, d, scale, (const uint16_t *)k + h * k_head_stride,
                                   (const uint16_t *)v + h * v_head_stride, begin, end, scratch + (size_t)item * item_floats, item_m, item_l, item_acc,
                                   head_columns);
            continue;
        }
#endif
#ifdef SPECSTACK_AMX
        if (tiles) {
            attend_range_amx(q + (int64_t)h * rows * d, rows, d, scale, (const uint16_t *)k + h * k_head_stride, (const uint16_t *)v + h * v_head_stride,
                             begin, end, scratch + (size_t)item * item_floats, item_m, item_l, item_acc);
            continue;
        }
#endif
#ifdef SPECSTACK_DP
        if (dot_rows) {
            attend_range_dp_rows_any(q + (int64_t)h * rows * d, rows, d, scale, (const uint16_t *)k + h * k_head_stride,
                                     (const uint16_t *)v + h * v_head_stride, begin, end, scratch + (size_t)item * item_floats, item_m, item_l, item_acc,
                                     head_columns);
            continue;
        }
#endif
        (void)h, (void)begin, (void)end, (void)item_m, (void)item_l, (void)item_acc;  // a build with neither: every call takes the spans
    }
    if (lays_out) *columns_upto = std::max(upto, past - past % GROUP);  // every whole group of the cached keys was read there, or laid out and kept
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int hr = 0; hr < hkv * rows; ++hr) {
        const int h = hr / rows, r = hr % rows;
        const int64_t first = (int64_t)h * splits;
        merge_row(scaled + (int64_t)hr * d, r, t, d, splits, k_own + h * t * d, v_own + h * t * d, sees,
                  m + first * rows, l + first * rows, acc + first * rows * d, rows, out + (int64_t)hr * d);
    }
    return 0;
}

// The same without a store's copy of the keys by groups: the column path lays out every group as it reads it.
int specstack_decode_attention(const float *q, const void *k, const void *v, int64_t k_head_stride, int64_t v_head_stride,
                               int hkv, int rows, int t, int d, int64_t n, const uint8_t *sees, float scale,
                               float *out, int threads, int kv_bf16, int amx, int dp) {
    return specstack_decode_attention_columns(q, k, v, k_head_stride, v_head_stride, hkv, rows, t, d, n, sees, scale, out, threads, kv_bf16,
                                              amx, dp, nullptr, 0, nullptr);
}

}  // extern "C"
