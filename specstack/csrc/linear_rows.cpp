// A few input rows through a linear layer on the CPU, float32 or bfloat16: y_j = W x_j + b
// (specstack/packed_linear.py).
//
// A forward of a few tokens reads every weight once and does two flops per weight and token, so up
// to a handful of tokens it is bound by how fast the weights stream from memory. Each thread takes its
// own blocks of ROWS output rows, streams those weight rows from memory once, eight columns at a
// time, and reuses them from L1 for every input row. While it computes one block it asks for the next
// block's weights (software prefetch), so the stream from memory overlaps the arithmetic: measured on
// the 2-core Intel host, the target's 211 matrices took 1.08x (one row) to 1.2x (four rows) less time
// in fp32, and 1.3x (one row) to 1.8x (four rows) less in bf16.
//
// fp32 takes the input rows three at a time (then a pair or a single row): twelve sums in flight, where
// pairs had eight, which is just what two FMA units of four cycles' latency need and so left them idle
// whenever a load was late. Each pass over the block asks for its share of the next block's lines,
// rather than the first pass for all of them, so the stream goes on while later passes compute from
// L1. On the 2-core AMD Zen 3 host (AVX2) the two changes took the target's 211 matrices 1.07x faster
// at 3 rows, 1.18x at 6, 1.16x at 8 and 1.15x at 16 (docs/benchmarks.md, "Up to sixteen fp32 rows on
// AVX2"). Every output is one dot product summed in one fixed order, whatever the number of input rows
// or threads: a token's outputs are the same bits alone or in a verify of several. Built by
// specstack/native.py; plain C++ with GCC vector types, no torch headers.
//
// bfloat16 takes AVX-512's bf16 dot products (vdpbf16ps: pairs of bf16 products summed into float32
// lanes), so the weights stream at half the bytes and are never widened; each output is summed in
// float32 in one fixed order and rounded once to bf16 (to nearest even), bias included. Where the
// compiler targets no such instructions (specstack_linear_rows_bf16_dots() says 0), bf16 rows and weights
// are widened to float32 and take the fp32 kernel's sums, then are rounded the same way (the section
// "bfloat16 products widened to float32"); the *_widened entries do so in every build, for CPUs whose
// vdpbf16ps does fewer multiply-adds a second than their FMAs (specstack/bf16_products.py chooses).
//
// Weights stored as GGUF's Q4_1 blocks (a model shipped that way): each 32 weights of a row are four-bit
// codes q with a float16 scale d and offset m, w = d * q + m. The bf16 entry widens each block in
// registers to the very bf16 numbers the model holds (d * q + m in float32, then rounded to nearest even,
// as the GGUF reader and torch's cast do) and takes the same dot products in the same order as the bf16
// kernel, so its outputs are the same bits while it reads 0.75 bytes a weight instead of 2. The fp32
// entries do the same from Q4_1, Q8_0 (w = d * q, 8-bit codes) or bf16 numbers (the section "float32
// products from weights stored narrower"): 0.75, 1.125 or 2 bytes a weight instead of 4.
//
// On a CPU with AMX tiles, wider bf16 products (up to 32 rows, from either kind of weight) run on the tiles
// (the section "Up to 32 rows on AMX tiles" below); specstack_linear_rows_tiles_supported() says where.

#include <stdint.h>
#include <string.h>

#include <memory>

#include <omp.h>

#include "bf16.h"
#include "scratch.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__)
#if defined(__AMX_BF16__)
#define SPECSTACK_AMX 1  // and AMX tiles: wider products on them
#include "amx_tiles.h"
#endif
#endif

namespace {

typedef float v8 __attribute__((vector_size(32), aligned(4)));  // 8 floats, loads need no alignment
// The float32 sums' vector: as wide as the machine has (16 floats with AVX-512, else 8). Each sum's lane l adds the
// columns l, l + LANES, l + 2 LANES, ... in order, and the lanes are summed by hsum at the end, so this width is part
// of every fp32 product's order (the same on one machine for any number of rows, threads or stored format). On the
// 2-core Intel host without bf16 dot products (AVX-512F) 16 lanes took half the instructions of 8 to widen a Q4_1
// block (a table of its sixteen values, then two permutes) and to sum it (docs/benchmarks.md, "The fp32 sums sixteen
// lanes wide on AVX-512").
#if defined(__AVX512F__)
constexpr int LANES = 16;
#else
constexpr int LANES = 8;
#endif
constexpr int PER_BLOCK = 32 / LANES;  // vectors in a stored block of 32 weights
typedef float vf __attribute__((vector_size(4 * LANES), aligned(4)));
typedef uint32_t vfu __attribute__((vector_size(4 * LANES), aligned(4)));

constexpr int ROWS = 4;  // weight rows streamed side by side
constexpr int MAX_FUSED_ROWS = 6;  // fp32 input rows over narrower weights widened in registers; more take a group widened into L1
// Whether a group widened into L1 goes to its input rows four at a time (sixteen sums in flight, 21 of the 32 AVX-512
// registers) rather than three: on the 2-core Intel host without bf16 dot products, bf16 target forwards of 7-16
// tokens over 512 slots 1.07-1.16x faster in two runs (docs/benchmarks.md, "Seven rows or more four at a time"). The
// same sums in the same order. Rows streamed from memory keep threes: fours there took 0.77-1.15x their time.
constexpr bool WIDENED_FOURS = LANES == 16;
constexpr int MAX_Q4_FUSED_ROWS = 6;  // bf16 input rows over Q4_1 weights with each block of a group's four rows widened once for them all
constexpr int MAX_Q4_PAIR_ROWS = 12;  // more input rows take the group's weight rows two at a time, passes of at most this many input rows
constexpr int MAX_Q4_ROWS = 16;  // bf16 input rows over Q4_1 weights
constexpr int MAX_BF16_ROWS = 16;  // bf16 input rows taken (four at a time over each block)

// Ask for the cache line at column c of the ROWS weight rows after w0's block (each row `in` elements
// long). Past the last block this names addresses beyond the weights, which a prefetch never faults on.
template <typename T>
inline void prefetch_next_block(const T *w0, int64_t in, int64_t c) {
    const T *next = w0 + ROWS * in + c;
    for (int i = 0; i < ROWS; ++i) __builtin_prefetch(next + i * in, 0, 3);  // read, keep in every level (prefetcht0 on x86)
}

inline float hsum(v8 x) { return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7])); }
inline vf loadf(const float *p) { return *(const vf *)p; }
#if defined(__AVX512F__)
inline float hsum(vf x) {  // the two halves added lane by lane, then as eight
    return hsum(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
}
inline vf load_tail(const float *p) { return (vf)_mm512_maskz_loadu_ps(0x00FF, p); }  // 8 floats, the upper lanes zero

// out[k] = hsum(x[k]) for sixteen vectors at once, the same numbers: each vector's halves added lane by lane, then hsum's
// tree ((f0 + f4) + (f1 + f5)) + ((f2 + f6) + (f3 + f7)), each level one shuffle pair and one add across the vectors
// instead of one vector's lanes at a time (a quarter of the instructions). Products of seven to sixteen rows spent
// 15-22% of their time in hsum (a scratch build without it).
inline void hsums16(const vf x[16], float out[16]) {
    vf f[8], g[4], h[2];
    for (int k = 0; k < 8; ++k)  // lanes 0-7: x[k]'s halves added; 8-15: x[k + 8]'s
        f[k] = __builtin_shufflevector(x[k], x[k + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(x[k], x[k + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int m = 0; m < 4; ++m)  // f_l + f_{l+4}: four lanes a sum, of f[2m]'s and f[2m + 1]'s halves in turn
        g[m] = __builtin_shufflevector(f[2 * m], f[2 * m + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(f[2 * m], f[2 * m + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int n = 0; n < 2; ++n)  // (f0 + f4) + (f1 + f5) and (f2 + f6) + (f3 + f7): two lanes a sum
        h[n] = __builtin_shufflevector(g[2 * n], g[2 * n + 1], 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
               __builtin_shufflevector(g[2 * n], g[2 * n + 1], 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
    const vf sums = __builtin_shufflevector(h[0], h[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
                    __builtin_shufflevector(h[0], h[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    // lane q: the sum of x[k] for k = 0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15
    *(vf *)out = __builtin_shufflevector(sums, sums, 0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
}
#endif

// out[k] = hsum(x[k]) for k < count (at most 24): sixteen at a time where vectors are sixteen wide.
inline void hsums(const vf *x, int count, float *out) {
    int k = 0;
#if defined(__AVX512F__)
    for (; k + 8 <= count; k += 16) {  // a short last sixteen repeats its first vector
        vf chunk[16];
        float sums[16];
        for (int i = 0; i < 16; ++i) chunk[i] = x[k + i < count ? k + i : k];
        hsums16(chunk, sums);
        for (int i = 0; i < 16 && k + i < count; ++i) out[k + i] = sums[i];
    }
#endif
    for (; k < count; ++k) out[k] = hsum(x[k]);
}

// y[j, r .. r+3] = w_{r .. r+3} . x_j for input rows j0 .. j0+J-1, J of them at once (twelve sums in
// flight for three rows: enough to keep both FMA units busy), each summed over the columns in order. w0
// points at weight row r; where `prefetch`, each pass asks for its share of the next block's lines.
template <int J>
void four_outputs_of(const float *w0, bool prefetch, const float *x, int j0, int pass, int passes, int64_t in, int64_t out, int64_t r, float *y) {
    vf a[J][ROWS];
    for (int j = 0; j < J; ++j)
        for (int i = 0; i < ROWS; ++i) a[j][i] = vf{};
    int64_t c = 0;
    for (; c + LANES <= in; c += LANES) {
        if (prefetch && c % 16 == 0 && (c / 16) % passes == pass) prefetch_next_block(w0, in, c);  // this pass's share of the next block's lines
        vf p[J];
        for (int j = 0; j < J; ++j) p[j] = loadf(x + (j0 + j) * in + c);
        for (int i = 0; i < ROWS; ++i) {
            const vf k = loadf(w0 + i * in + c);
            for (int j = 0; j < J; ++j) a[j][i] += k * p[j];
        }
    }
#if defined(__AVX512F__)
    if (c < in) {  // eight columns left: into the lower lanes
        vf p[J];
        for (int j = 0; j < J; ++j) p[j] = load_tail(x + (j0 + j) * in + c);
        for (int i = 0; i < ROWS; ++i) {
            const vf k = load_tail(w0 + i * in + c);
            for (int j = 0; j < J; ++j) a[j][i] += k * p[j];
        }
    }
#endif
    float sums[J * ROWS];
    hsums(&a[0][0], J * ROWS, sums);
    for (int j = 0; j < J; ++j)
        for (int i = 0; i < ROWS; ++i) y[(j0 + j) * out + r + i] = sums[j * ROWS + i];
}

// y[j, r .. r+3] for the n input rows: threes, then a pair or a single row left over; where `fours`, passes of four
// rows first, as many as leave the rest to threes and at most one pair (4 + 3 for seven rows, 4 + 3 + 2 for nine).
void four_outputs(const float *w0, bool prefetch, const float *x, int n, int64_t in, int64_t out, int64_t r, float *y, bool fours = false) {
    const int four_passes = fours && n >= 4 ? (n % 4 == 1 || n % 4 == 2 ? n / 4 - 1 : n / 4) : 0;
    const int passes = four_passes + (n - 4 * four_passes + 2) / 3;
    int j = 0, pass = 0;
    for (; pass < four_passes; j += 4, ++pass) four_outputs_of<4>(w0, prefetch, x, j, pass, passes, in, out, r, y);
    for (; j + 3 <= n; j += 3, ++pass) four_outputs_of<3>(w0, prefetch, x, j, pass, passes, in, out, r, y);
    if (n - j == 2) four_outputs_of<2>(w0, prefetch, x, j, pass, passes, in, out, r, y);
    if (n - j == 1) four_outputs_of<1>(w0, prefetch, x, j, pass, passes, in, out, r, y);
}

// y[j, r] = w_r . x_j for one output row (the last, short block; wr points at it), summed in the same order.
void one_output(const float *wr, const float *x, int n, int64_t in, int64_t out, int64_t r, float *y) {
    for (int j = 0; j < n; ++j) {
        vf a{};
        int64_t c = 0;
        for (; c + LANES <= in; c += LANES) a += loadf(wr + c) * loadf(x + j * in + c);
#if defined(__AVX512F__)
        if (c < in) a += load_tail(wr + c) * load_tail(x + j * in + c);  // eight columns left, as four_outputs_of
#endif
        y[j * out + r] = hsum(a);
    }
}

// y[j, first .. last-1] += bias (where there is one) for the n input rows.
inline void add_bias(const float *bias, float *y, int n, int64_t out, int64_t first, int64_t last) {
    if (bias)
        for (int j = 0; j < n; ++j)
            for (int64_t r = first; r < last; ++r) y[j * out + r] += bias[r];
}

// ---- float32 products from weights stored narrower ------------------------------------------------------
//
// A model whose float32 weights are exactly the numbers of a narrower format (GGUF's Q4_1 and Q8_0 blocks,
// or bf16) can be read in that format and widened in registers: the same float32 weights, the same
// products in the same order as four_outputs_of, so the same bits, from fewer bytes. Each format says how
// many bytes a block of 32 weights of a row takes and widens one into q[0 .. 3].
//
// Stored weights (specstack/weight_formats.py writes them) lie in groups of ROWS rows, the last group holding
// what is left, each group block-major: block b of the group's row i at (b * rows + i) * BLOCK_BYTES from the
// group's start, which is its first row times the bytes of a row. The ROWS rows a thread streams side by side
// are so one stream from memory, not four rows' codes and scales apart: on the AMD Zen 4 host the bf16 target's
// one-token forward over 512 cached slots took 1.55x less time than from rows stored one after another, the bf16
// draft's 1.82x (docs/benchmarks.md, "Weight rows stored four at a time").

// Each format widens a block with widen_as(block, q, value), every weight passed through `value` (the identity for the
// fp32 product; a rounding to bf16 for AsBF16, below); widen is widen_as with the identity.
template <class Format>
struct Plain {
    static inline void widen(const uint8_t *block, vf q[PER_BLOCK]) { Format::widen_as(block, q, [](vf v) { return v; }); }
};

// GGUF's Q4_1 as this file reads it: a block is 16 code bytes (byte i holds q_i in its low nibble and q_{i+16}
// in its high), then its scale and offset (d, m) as float32, exact copies of GGUF's float16 numbers.
// w = d * q + m: the product is exact (an 11-bit scale times a 4-bit code), so one rounding, as the GGUF
// reader's (d * q) + m.
struct Q4_1 : Plain<Q4_1> {
    static constexpr int64_t BLOCK_BYTES = 24;
    static constexpr bool ROW_AFTER_ROW = false;  // grouped (above)
    // The block's 32 weights into q[0 .. PER_BLOCK-1]; with AVX-512 `value` takes the block's sixteen values once,
    // before each weight is picked from them (the same numbers as passing each weight).
    template <class Value>
    static inline void widen_as(const uint8_t *block, vf q[PER_BLOCK], Value value) {
        const uint8_t *codes = block;
        const float d = ((const float *)(block + 16))[0], m = ((const float *)(block + 16))[1];
#if defined(__AVX512F__)
        // the sixteen values as a table, each weight picked from it by its code (vpermps reads an index's low four
        // bits: a zero-extended code byte q_i + 16 q_{i+16} picks q_i's value, and shifted right by four q_{i+16}'s)
        const __m512 ramp = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512 table = (__m512)value((vf)_mm512_fmadd_ps(ramp, _mm512_set1_ps(d), _mm512_set1_ps(m)));
        const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
        q[0] = (vf)_mm512_permutexvar_ps(index, table), q[1] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(index, 4), table);
#elif defined(__AVX2__)
        const __m128i bytes = _mm_loadu_si128((const __m128i *)codes);
        const __m256i lo = _mm256_cvtepu8_epi32(bytes), hi = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes));  // bytes 0-7, 8-15
        const __m256i low_nibble = _mm256_set1_epi32(15);
        q[0] = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(lo, low_nibble)), q[1] = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(hi, low_nibble));
        q[2] = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), q[3] = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4));
        for (int k = 0; k < PER_BLOCK; ++k) q[k] = value(q[k] * d + m);
#else
        for (int i = 0; i < 16; ++i) q[i / 8][i % 8] = (float)(codes[i] & 15), q[2 + i / 8][i % 8] = (float)(codes[i] >> 4);
        for (int k = 0; k < PER_BLOCK; ++k) q[k] = value(q[k] * d + m);
#endif
    }
};

// GGUF's Q8_0 as this file reads it: a block is 32 signed code bytes, then its scale d as float32 (an exact
// copy of GGUF's float16). w = d * q, exact (an 11-bit scale times an 8-bit code).
struct Q8_0 : Plain<Q8_0> {
    static constexpr int64_t BLOCK_BYTES = 36;
    static constexpr bool ROW_AFTER_ROW = false;
    template <class Value>
    static inline void widen_as(const uint8_t *block, vf q[PER_BLOCK], Value value) {
        const int8_t *codes = (const int8_t *)block;
        const float d = *(const float *)(block + 32);
#if defined(__AVX512F__)
        for (int k = 0; k < PER_BLOCK; ++k) q[k] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16 * k))));
#elif defined(__AVX2__)
        for (int k = 0; k < PER_BLOCK; ++k) q[k] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8 * k))));
#else
        for (int i = 0; i < 32; ++i) q[i / 8][i % 8] = (float)codes[i];
#endif
        for (int k = 0; k < PER_BLOCK; ++k) q[k] = value(q[k] * d);
    }
};

// bf16 numbers (the upper halves of float32s): widening is exact.
struct BF16 : Plain<BF16> {
    static constexpr int64_t BLOCK_BYTES = 64;
    static constexpr bool ROW_AFTER_ROW = false;
    template <class Value>
    static inline void widen_as(const uint8_t *block, vf q[PER_BLOCK], Value) {  // bf16 numbers: a rounding to bf16 keeps them
        const uint16_t *h = (const uint16_t *)block;
#if defined(__AVX512F__)
        for (int k = 0; k < PER_BLOCK; ++k)
            q[k] = (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + 16 * k))), 16);
#elif defined(__AVX2__)
        for (int k = 0; k < PER_BLOCK; ++k)
            q[k] = (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + 8 * k))), 16);
#else
        for (int i = 0; i < 32; ++i) {
            const uint32_t bits = (uint32_t)h[i] << 16;
            memcpy(&q[i / 8][i % 8], &bits, 4);
        }
#endif
    }
};

// A bf16 weight as it lies, [out, in] row after row (the bf16 product where there are no bf16 dot products).
struct BF16Rows : BF16 {
    static constexpr bool ROW_AFTER_ROW = true;
};

template <class Format>
inline int64_t row_bytes_of(int64_t in) { return in / 32 * Format::BLOCK_BYTES; }

// Block b of row i of the group of `rows` rows that starts at `group` (rows of `in` weights); in a format laid out
// row after row (BF16Rows), b blocks into the row.
template <class Format>
inline const uint8_t *block_of(const uint8_t *group, int64_t rows, int64_t i, int64_t b, int64_t in) {
    if (Format::ROW_AFTER_ROW) return group + i * row_bytes_of<Format>(in) + b * Format::BLOCK_BYTES;
    return group + (b * rows + i) * Format::BLOCK_BYTES;
}

// Where stored row r lies: the start of its group, the group's rows, and r's place in it.
struct GroupRow {
    const uint8_t *group;
    int64_t rows, i;
};
template <class Format>
inline GroupRow group_row(const uint8_t *w, int64_t out, int64_t in, int64_t r) {
    const int64_t first = r / ROWS * ROWS;
    return {w + first * row_bytes_of<Format>(in), out - first < ROWS ? out - first : ROWS, r - first};
}

// Ask for the lines of the next group (`next`, of `rows` rows) that lie where this group's block b does, so
// that by the last block the whole next group has been asked for.
template <class Format>
inline void ask_next(const uint8_t *next, int64_t rows, int64_t b) {
    const int64_t step = rows * Format::BLOCK_BYTES;
    for (int64_t line = (b * step + 63) / 64 * 64; line < (b + 1) * step; line += 64) __builtin_prefetch(next + line, 0, 3);
}

// y[j, r .. r+3] = w_{r .. r+3} . x_j for J (one to six) input rows, each block widened in registers and
// used at once: the same products in the same order as four_outputs_of, without writing the weights out.
// Asks for the next group's rows (`next`) as it goes.
template <class Format, int J>
void widened_four_outputs(const uint8_t *rows, const uint8_t *next, const float *x, int64_t in, int64_t out, int64_t r, float *y) {
    vf a[J][ROWS];
    for (int j = 0; j < J; ++j)
        for (int i = 0; i < ROWS; ++i) a[j][i] = vf{};
    for (int64_t b = 0; b < in / 32; ++b) {
        ask_next<Format>(next, ROWS, b);
        for (int i = 0; i < ROWS; ++i) {
            vf w[PER_BLOCK];
            Format::widen(block_of<Format>(rows, ROWS, i, b, in), w);
            for (int k = 0; k < PER_BLOCK; ++k)
                for (int j = 0; j < J; ++j) a[j][i] += w[k] * loadf(x + j * in + 32 * b + LANES * k);
        }
    }
    float sums[J * ROWS];
    hsums(&a[0][0], J * ROWS, sums);
    for (int j = 0; j < J; ++j)
        for (int i = 0; i < ROWS; ++i) y[j * out + r + i] = sums[j * ROWS + i];
}

// widened_four_outputs for n <= MAX_FUSED_ROWS input rows.
template <class Format>
void widened_rows(const uint8_t *rows, const uint8_t *next, const float *x, int n, int64_t in, int64_t out, int64_t r, float *y) {
    typedef void (*Rows)(const uint8_t *, const uint8_t *, const float *, int64_t, int64_t, int64_t, float *);
    static const Rows fused[] = {widened_four_outputs<Format, 1>, widened_four_outputs<Format, 2>, widened_four_outputs<Format, 3>,
                                 widened_four_outputs<Format, 4>, widened_four_outputs<Format, 5>, widened_four_outputs<Format, 6>};
    fused[n - 1](rows, next, x, in, out, r, y);
}

// The float32 weights of the group of `count` rows (at most ROWS) at `rows` into w [count, in], asking for the
// next group (`next`) as it goes.
template <class Format>
void widen_rows(const uint8_t *rows, const uint8_t *next, int64_t in, int64_t count, float *w) {
    for (int64_t b = 0; b < in / 32; ++b) {
        ask_next<Format>(next, count, b);
        for (int64_t i = 0; i < count; ++i) {
            vf q[PER_BLOCK];
            Format::widen(block_of<Format>(rows, count, i, b, in), q);
            for (int k = 0; k < PER_BLOCK; ++k) *(vf *)(w + i * in + 32 * b + LANES * k) = q[k];
        }
    }
}

// y [n, out] = x [n, in] W^T + bias, W [out, in] stored as Format: a few rows widen each block in
// registers; more rows take a group of ROWS weight rows widened into L1 (this thread's `scratch`).
template <class Format>
int widened_linear(const uint8_t *w, const float *x, const float *bias, float *y, int n, int64_t out, int64_t in, int threads) {
    if (in < 32 || in % 32 != 0 || out < 1 || n < 1 || threads < 1) return -1;
    const int64_t groups = (out + ROWS - 1) / ROWS, row_bytes = row_bytes_of<Format>(in);
#pragma omp parallel num_threads(threads)
    {
        float *widened = nullptr;  // this thread's scratch (scratch.h), taken when first needed
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t first = g * ROWS, last = first + ROWS < out ? first + ROWS : out;
            const uint8_t *rows = w + first * row_bytes, *next = w + last * row_bytes;
            if (last - first == ROWS && n <= MAX_FUSED_ROWS) {
                widened_rows<Format>(rows, next, x, n, in, out, first, y);
            } else {
                if (!widened) widened = thread_scratch<1>(ROWS * in);
                widen_rows<Format>(rows, next, in, last - first, widened);
                if (last - first == ROWS)
                    four_outputs(widened, false, x, n, in, out, first, y, WIDENED_FOURS);
                else
                    for (int64_t r = first; r < last; ++r) one_output(widened + (r - first) * in, x, n, in, out, r, y);
            }
            add_bias(bias, y, n, out, first, last);
        }
    }
    return 0;
}

// ---- bfloat16 products widened to float32 (CPUs without AVX-512's bf16 dot products, or slow ones) -------
//
// Without vdpbf16ps (the AMD Zen 3 host: AVX2) bf16 is a storage format here, and so it is where vdpbf16ps does
// fewer multiply-adds a second than FMAs (the Intel host with bf16 dot products; specstack/bf16_products.py chooses
// at load, the *_widened entries below). The input rows and the
// weights are widened to float32 (exactly: a bf16 is the upper half of a float), their products summed as
// the fp32 kernel sums them (widened_linear: the same order for any number of rows), the bias added, and
// each output rounded once to bf16 (to nearest even), as bf16_outputs rounds. Q4_1 blocks widen to the
// bf16 numbers the model holds (d * q + m in float32, then rounded to nearest even, as the GGUF reader and
// torch's cast make them), so reading them gives the same bits as reading the bf16 weight, from 0.75 bytes
// a weight instead of 2. vdpbf16ps sums in another order, so bf16 outputs differ between the two kinds of
// CPU by rounding; on one CPU they are the same bits alone or in a verify.

constexpr int MAX_WIDENED_BF16_ROWS = 16;  // bf16 rows taken this way (packed_linear.py: MAX_WIDENED_BF16_ROWS)

inline vf round_to_bf16(vf x) {  // each lane to the nearest bf16 (ties to even), as a float32 with a zero lower half
#if defined(__AVX512F__)
    // bits + 0x8000 where the bf16's last bit is odd, else bits + 0x7FFF: a test into a mask and a masked add in place of
    // a shift, an and and an add (the shift ran on the port the multiply-adds take)
    const __m512i bits = (__m512i)x;
    const __mmask16 odd = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x10000));
    const __m512i up = _mm512_mask_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd, bits, _mm512_set1_epi32(0x8000));
    return (vf)_mm512_and_si512(up, _mm512_set1_epi32((int)0xFFFF0000u));
#else
    const vfu bits = (vfu)x;
    return (vf)((bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u);
#endif
}

// A stored format's blocks as the bf16 numbers they stand for (its float32 weights rounded to nearest even, as the
// GGUF reader's float32 weights and torch's cast make them), widened to float32.
template <class Format>
struct AsBF16 {
    static constexpr int64_t BLOCK_BYTES = Format::BLOCK_BYTES;
    static constexpr bool ROW_AFTER_ROW = Format::ROW_AFTER_ROW;
    static inline void widen(const uint8_t *block, vf q[PER_BLOCK]) { Format::widen_as(block, q, round_to_bf16); }
};

// y [n, out] bf16 = x [n, in] bf16 W^T + bias (bf16 or null), W stored as Format (widening to bf16 numbers):
// the rows and the bias widened once, the fp32 product, each output rounded once.
template <class Format>
int widened_bf16_linear(const uint8_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads) {
    if (in < 32 || in % 32 != 0 || out < 1 || n < 1 || n > MAX_WIDENED_BF16_ROWS || threads < 1) return -1;
    float *xf = thread_scratch<0>((size_t)n * in + (size_t)out + (size_t)n * out);  // the calling thread's (scratch.h)
    if (!xf) return -1;
    float *bf = xf + (size_t)n * in, *yf = bf + out;  // [n, in], [out], [n, out]
    for (int64_t i = 0; i < (int64_t)n * in; ++i) xf[i] = bf16_to_float(x[i]);
    if (bias)
        for (int64_t r = 0; r < out; ++r) bf[r] = bf16_to_float(bias[r]);
    if (widened_linear<Format>(w, xf, bias ? bf : nullptr, yf, n, out, in, threads) != 0) return -1;
    for (int64_t i = 0; i < (int64_t)n * out; ++i) y[i] = float_to_bf16(yf[i]);
    return 0;
}

#if defined(__AVX512BF16__)
// Whether a bf16 entry takes n rows through [out, in] on `threads` threads: in a multiple of 32, 1 to `most` rows.
inline bool bf16_shape_taken(int n, int64_t out, int64_t in, int threads, int most) {
    return in >= 32 && in % 32 == 0 && out >= 1 && n >= 1 && n <= most && threads >= 1;
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

// One Q4_1 block as the 32 bf16 weights it stands for, in order: the sixteen values d * q + m (q = 0..15)
// in float32 (a product, then a sum: two roundings, as the GGUF reader's (d * q) + m), rounded to bf16,
// then each weight picked from them by its code. vpermw reads five bits of each index, so the table holds
// the sixteen values twice and a zero-extended code byte (q_i + 16 q_{i+16}) picks q_i's value as it is.
inline __m512i q4_1_bf16(const uint8_t *codes, const float *dm) {
    const __m512 ramp = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 values = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(dm[0]), ramp), _mm512_set1_ps(dm[1]));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(values, values);  // words 0-15 and 16-31: the block's bf16 values
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)codes));  // word i: q_i + 16 q_{i+16}
    const __m512i index = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);  // then q_{16..31}
    return _mm512_permutexvar_epi16(index, table);
}

// One Q8_0 block as the 32 bf16 weights it stands for, in order: d * q in float32 (exact: an 11-bit scale times an
// 8-bit code), rounded to bf16 (to nearest even, as torch's cast of the GGUF reader's float32 weight).
inline __m512i q8_0_bf16(const int8_t *codes, float d) {
    const __m512 scale = _mm512_set1_ps(d);
    const __m512 low = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes))), scale);  // q_0 .. q_15
    const __m512 high = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16)))), scale);
    return (__m512i)_mm512_cvtne2ps_pbh(high, low);
}

// The stored formats the bf16 entries widen in registers: a block as its 32 bf16 weights.
template <class Format>
struct Bf16Blocks;
template <>
struct Bf16Blocks<Q4_1> {
    static constexpr int64_t BLOCK_BYTES = Q4_1::BLOCK_BYTES;  // 16 code bytes, then (d, m) as float32
    static constexpr bool ROW_AFTER_ROW = false;
    static inline __m512i bf16(const uint8_t *block) { return q4_1_bf16(block, (const float *)(block + 16)); }
};
template <>
struct Bf16Blocks<Q8_0> {
    static constexpr int64_t BLOCK_BYTES = Q8_0::BLOCK_BYTES;  // 32 code bytes, then d as float32
    static constexpr bool ROW_AFTER_ROW = false;
    static inline __m512i bf16(const uint8_t *block) { return q8_0_bf16((const int8_t *)block, *(const float *)(block + 32)); }
};

// sums[j * ROWS + i0 + i] = w_{r+i0+i} . x_j for R of the group's ROWS weight rows from i0 (R = ROWS: all of them) and
// the N input rows, each stored block widened once for them all; every sum takes the same dot products in the same
// order as bf16_four_outputs. The part from row 0 asks for the next group's lines.
template <int N, int R, class Blocks>
void narrow_outputs(const uint8_t *w, const uint16_t *x, int64_t in, int64_t r, int part, float *sums) {
    const int i0 = R == ROWS ? 0 : part;  // a constant where the part is the whole group, as the compiler should see
    const int64_t row_bytes = row_bytes_of<Blocks>(in);
    const uint8_t *w0 = w + r * row_bytes, *next = w0 + ROWS * row_bytes;  // this group and the next
    __m512 a[N][R];
    for (int j = 0; j < N; ++j)
        for (int i = 0; i < R; ++i) a[j][i] = _mm512_setzero_ps();
    for (int64_t c = 0, block = 0; c < in; c += 32, ++block) {
        if (i0 == 0) ask_next<Blocks>(next, ROWS, block);
        __m512i k[R];
        for (int i = 0; i < R; ++i) k[i] = Blocks::bf16(block_of<Blocks>(w0, ROWS, i0 + i, block, in));
        for (int j = 0; j < N; ++j) {
            const __m512bh xj = (__m512bh)_mm512_loadu_si512(x + j * in + c);
            for (int i = 0; i < R; ++i) a[j][i] = _mm512_dpbf16_ps(a[j][i], xj, (__m512bh)k[i]);
        }
    }
    for (int j = 0; j < N; ++j)
        for (int i = 0; i < R; ++i) sums[j * ROWS + i0 + i] = _mm512_reduce_add_ps(a[j][i]);
}

// The same for one output row (of the last, short group).
template <class Blocks>
float narrow_one_output(GroupRow row, const uint16_t *xj, int64_t in) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t c = 0, block = 0; c < in; c += 32, ++block)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(xj + c), (__m512bh)Blocks::bf16(block_of<Blocks>(row.group, row.rows, row.i, block, in)));
    return _mm512_reduce_add_ps(a);
}

// n <= MAX_Q4_FUSED_ROWS input rows through all four rows of a group.
template <class Blocks>
void narrow_rows(const uint8_t *w, const uint16_t *x, int n, int64_t in, int64_t r, float *sums) {
    typedef void (*Rows)(const uint8_t *, const uint16_t *, int64_t, int64_t, int, float *);
    static const Rows rows[] = {narrow_outputs<1, ROWS, Blocks>, narrow_outputs<2, ROWS, Blocks>, narrow_outputs<3, ROWS, Blocks>,
                                narrow_outputs<4, ROWS, Blocks>, narrow_outputs<5, ROWS, Blocks>, narrow_outputs<6, ROWS, Blocks>};
    rows[n - 1](w, x, in, r, 0, sums);
}

// n <= MAX_Q4_PAIR_ROWS input rows through the group's rows i0 and i0 + 1.
template <class Blocks>
void narrow_pair_rows(const uint8_t *w, const uint16_t *x, int n, int64_t in, int64_t r, int i0, float *sums) {
    typedef void (*Rows)(const uint8_t *, const uint16_t *, int64_t, int64_t, int, float *);
    static const Rows rows[] = {narrow_outputs<1, 2, Blocks>, narrow_outputs<2, 2, Blocks>,  narrow_outputs<3, 2, Blocks>,
                                narrow_outputs<4, 2, Blocks>, narrow_outputs<5, 2, Blocks>,  narrow_outputs<6, 2, Blocks>,
                                narrow_outputs<7, 2, Blocks>, narrow_outputs<8, 2, Blocks>,  narrow_outputs<9, 2, Blocks>,
                                narrow_outputs<10, 2, Blocks>, narrow_outputs<11, 2, Blocks>, narrow_outputs<12, 2, Blocks>};
    rows[n - 1](w, x, in, r, i0, sums);
}

// The n input rows in passes of at most `most`, as even as they go: pass(first input row, input rows).
template <class Pass>
void in_passes(int n, int most, Pass pass) {
    const int passes = (n + most - 1) / most;
    for (int p = 0, j = 0; p < passes; ++p) {
        const int m = (n - j + passes - p - 1) / (passes - p);
        pass(j, m);
        j += m;
    }
}

// y [n, out] bf16 = the sums of each group of ROWS output rows, plus the bias, rounded once (to nearest
// even): four(first, sums) fills sums[j * ROWS + i] for output rows first .. first+3, one(r, j) gives the
// sum of a last, short group's row r for input row j. Groups are shared among the threads.
template <int MAX_N, class Four, class One>
void bf16_outputs(const uint16_t *bias, uint16_t *y, int n, int64_t out, int threads, Four four, One one) {
    const int64_t blocks = (out + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = b * ROWS, last = first + ROWS < out ? first + ROWS : out;
        float sums[MAX_N * ROWS];
        if (last - first == ROWS)
            four(first, sums);
        else
            for (int64_t r = first; r < last; ++r)
                for (int j = 0; j < n; ++j) sums[j * ROWS + (r - first)] = one(r, j);
        for (int j = 0; j < n; ++j)
            for (int64_t r = first; r < last; ++r)
                y[j * out + r] = float_to_bf16(sums[j * ROWS + (r - first)] + (bias ? bf16_to_float(bias[r]) : 0.0f));
    }
}

// The bf16 product with W stored as Blocks: each stored block widened in registers to the bf16 numbers the model
// holds, then the same dot products in the same order as specstack_linear_rows_bf16 over those bf16 weights.
// Up to MAX_Q4_FUSED_ROWS input rows take a group's four weight rows in one pass (24 sums in registers). More take
// them two at a time, in passes of at most MAX_Q4_PAIR_ROWS input rows: a block is widened once for up to twelve
// input rows, where passes of six over all four rows widened it again each pass (from L1 after the first). Every
// sum the same dot products in the same order either way. On the AMD Zen 4 host the bf16 target's forwards over
// 7,500 cached keys took 1.04-1.07x less time at 7 and 8 tokens so, and the same at 12 and 16 (docs/benchmarks.md,
// "A wide verify's prefetches spread over its passes, and Q4_1 rows two at a time"). Against oneDNN's packed kernel over the bf16 weights and the
// lean decoder's Python, passes of six had taken the forwards of 7 / 8 / 12 / 16 tokens 1.24-1.32x / 1.16-1.30x /
// 1.10-1.18x / 1.02-1.03x less time (Q4_1 layers, over 1,024 and 7,500 cached keys); widening each group once into
// L1 and taking bf16_four_outputs over it measured 0.93-0.99x of those passes.
template <class Blocks>
int narrow_bf16_linear(const uint8_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads) {
    if (!bf16_shape_taken(n, out, in, threads, MAX_Q4_ROWS)) return -1;
    bf16_outputs<MAX_Q4_ROWS>(
        bias, y, n, out, threads,
        [&](int64_t first, float *sums) {
            if (n <= MAX_Q4_FUSED_ROWS) return narrow_rows<Blocks>(w, x, n, in, first, sums);
            for (int i0 = 0; i0 < ROWS; i0 += 2)
                in_passes(n, MAX_Q4_PAIR_ROWS, [&](int j, int m) { narrow_pair_rows<Blocks>(w, x + j * in, m, in, first, i0, sums + j * ROWS); });
        },
        [&](int64_t r, int j) { return narrow_one_output<Blocks>(group_row<Blocks>(w, out, in, r), x + j * in, in); });
    return 0;
}
#endif

#ifdef SPECSTACK_AMX
// ---- Up to 32 rows on AMX tiles ------------------------------------------------------------------------
//
// With more rows the dot products above stop being cheap next to the stream of weights (each Q4_1 block
// is widened once, then takes one vdpbf16ps per row), and oneDNN's product reads the bf16 weights. Here
// each group of sixteen output rows is one A tile per 32 columns (its weights as they lie, or its Q4_1 or
// Q8_0 blocks widened tile by tile into a small room in L1), the input rows are B tiles (their column pairs
// interleaved once per call), and tdpbf16ps sums 16 x 16 dot products of 32 columns at a time into float32
// tiles. A thread takes two groups side by side, so two chains of tile products (four from seventeen rows)
// overlap. Each output is its row's sum over the column chunks in order, whatever the number of rows, so a
// token's outputs are the same bits in any product of 1-32 rows on the tiles, from the bf16 weights or from
// the blocks that widen to them (packed_linear.py sends TILES_FROM rows and more).
//
// Widened tile by tile, the blocks of a work item are read across its 32 rows at once (eight streams of
// grouped rows), each asked for one item ahead. Against widening each group's rows whole into a panel (18-48
// KB, which the tile loads then read from L2), the bf16 target's forwards of 6, 8 and 16 tokens took 1.29x /
// 1.28x / 1.17x less time over 512 slots and 1.12x / 1.12x / 1.02x over 7,500 on the AMX host (docs/benchmarks.md,
// "Tiles widened one at a time").
// The LM head widens its Q8_0 blocks the same way instead of reading the bf16 embedding in place.

constexpr int TILE = 16;           // output rows of a group; input rows of a B tile
constexpr int PAIRS = 32;          // bf16 numbers in a 64-byte tile row
constexpr int MAX_TILE_ROWS = 32;  // two B tiles: the rows of one pass of tile_outputs
constexpr int MAX_TILE_PASS_ROWS = 64;  // rows the tile entries take, in passes of MAX_TILE_ROWS (tile_passes)

inline __mmask16 first_lanes(int count) { return count >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1); }  // lanes 0 .. count-1
inline __m512i lane_times(int step) { return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(step)); }  // lane i: i * step

// All eight tiles, 16 rows of 64 bytes: 0-1 A (the two groups' weights), 2-3 B (input rows 0-15, 16-31),
// 4-5 C of the first group (those rows' sums), 6-7 C of the second.
void configure_linear_tiles() {
    TileConfig config;
    for (int i = 0; i < 8; ++i) config.colsb[i] = 64, config.rows[i] = TILE;
    _tile_loadconfig(&config);
}

// xv[h][s][pair][row] = the 32-bit pair x[16 h + row][32 s + 2 pair .. + 1], zero past the n rows: the input
// rows as B operands (column pairs interleaved), one tile per half and 32 columns.
void interleave_rows(const uint16_t *x, int n, int64_t in, uint32_t *xv) {
    const int64_t steps = in / PAIRS, words = in / 2, halves = (n + TILE - 1) / TILE;
    const __m512i rows = lane_times((int)words);  // lane r: row r's first word
    for (int64_t h = 0; h < halves; ++h) {
        const __mmask16 present = first_lanes(n - (int)h * TILE);
        const uint32_t *base = (const uint32_t *)x + h * TILE * words;
        for (int64_t s = 0; s < steps; ++s)
            for (int pair = 0; pair < TILE; ++pair) {
                const __m512i at = _mm512_add_epi32(rows, _mm512_set1_epi32((int)(s * TILE + pair)));
                _mm512_store_si512(xv + ((h * steps + s) * TILE + pair) * TILE, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, at, base, 4));
            }
    }
}

// Where one A tile lies: sixteen weight rows of 32 columns, `stride` bytes apart.
struct Tile {
    const uint16_t *rows;
    int64_t stride;
};

// y[j, o0 .. o0 + count) = the C tile column j of c[half][o][row], plus the bias, rounded to nearest even.
void store_group(const float *c, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t o0, int count) {
    const __m512i column = lane_times(TILE);  // lane o: output o's row of the C tile
    const __mmask16 present = first_lanes(count);
    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(present, bias + o0)), 16))
                          : _mm512_setzero_ps();  // [16 outputs] float32
    for (int j = 0; j < n; ++j) {
        const __m512 sums = _mm512_i32gather_ps(column, c + (j / TILE) * TILE * TILE + j % TILE, 4);  // [16 outputs]
        _mm256_mask_storeu_epi16(y + j * out + o0, present, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums, b)));
    }
}

// y [n, out] bf16 from n <= 32 rows: work items of two groups of sixteen outputs shared among the threads, bias
// added, rounded once. source.tile(first, count, s, room) gives the A tile of column chunk s of the `count` outputs from
// `first` (fewer than 16 only in a short last group): where it lies, or widened or copied into `room` [16][32] bf16. A
// short group's A rows past `count` are left as they are: each A row makes only its own C row, and store_group stores
// the first `count`. The next chunk's A tiles are made before this chunk's tile loads, into the other of two rooms, so
// that their stores have landed when the tiles load them and the widening overlaps the tile products.
template <class Source>
void tile_outputs(const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads, const Source &source) {
    const int64_t steps = in / PAIRS, items = (out + 2 * TILE - 1) / (2 * TILE);
    const int halves = (n + TILE - 1) / TILE;
    uint32_t *xv = (uint32_t *)aligned_alloc(64, (size_t)halves * steps * TILE * TILE * 4);
    interleave_rows(x, n, in, xv);
#pragma omp parallel num_threads(threads)
    {
        configure_linear_tiles();
        alignas(64) uint16_t rooms[2][2][TILE * PAIRS];  // [chunk parity][group]
        alignas(64) float c[2][2][TILE * TILE];
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t first = item * 2 * TILE;
            int count[2];
            for (int g = 0; g < 2; ++g) {
                const int64_t left = out - first - g * TILE;
                count[g] = (int)(left < 0 ? 0 : left < TILE ? left : TILE);
            }
            const bool two = count[1] > 0;
            auto tiles = [&](int64_t s, Tile *a) {
                for (int g = 0; g < 1 + two; ++g) a[g] = source.tile(first + g * TILE, count[g], s, rooms[s % 2][g]);
            };
            Tile a[2][2];  // [chunk parity][group]
            tiles(0, a[0]);
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int64_t s = 0; s < steps; ++s) {
                if (s + 1 < steps) tiles(s + 1, a[(s + 1) % 2]);  // before this chunk's tile loads: its stores have landed by then
                const Tile *t = a[s % 2];
                const uint32_t *b = xv + s * TILE * TILE;
                _tile_loadd(2, b, 64);
                if (halves > 1) _tile_loadd(3, b + steps * TILE * TILE, 64);
                _tile_loadd(0, t[0].rows, t[0].stride);
                if (two) _tile_loadd(1, t[1].rows, t[1].stride);
                _tile_dpbf16ps(4, 0, 2);
                if (two) _tile_dpbf16ps(6, 1, 2);
                if (halves > 1) {
                    _tile_dpbf16ps(5, 0, 3);
                    if (two) _tile_dpbf16ps(7, 1, 3);
                }
            }
            _tile_stored(4, &c[0][0][0], 64);
            _tile_stored(5, &c[0][1][0], 64);
            _tile_stored(6, &c[1][0][0], 64);
            _tile_stored(7, &c[1][1][0], 64);
            for (int g = 0; g < 2 && count[g] > 0; ++g) store_group(&c[g][0][0], bias, y, n, out, first + g * TILE, count[g]);
        }
        _tile_release();
    }
    free(xv);
}

// tile_outputs over n <= MAX_TILE_PASS_ROWS rows, in passes of MAX_TILE_ROWS: each pass reads the whole weight again,
// and each row's outputs are the bits one pass of any row count gives it.
template <class Source>
void tile_passes(const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads, const Source &source) {
    for (int first = 0; first < n; first += MAX_TILE_ROWS)
        tile_outputs(x + first * in, bias, y + first * out, n - first < MAX_TILE_ROWS ? n - first : MAX_TILE_ROWS, out, in, threads, source);
}

// A weight stored as Format's blocks (grouped: weight_formats.py) as A tiles: chunk s of each of the sixteen rows widened
// to bf16 into the room, asking as it goes for the same chunk of the rows one work item on (two groups of sixteen).
template <class Format>
struct StoredTiles {
    const uint8_t *w;
    int64_t out, in;
    Tile tile(int64_t first, int count, int64_t s, uint16_t *room) const {
        const int64_t row_bytes = row_bytes_of<Format>(in), step = ROWS * Format::BLOCK_BYTES;  // a whole group's block s
        const uint8_t *end = w + out * row_bytes;
        // Four whole groups: block s of each is `step` bytes in a row. Their constant counts took whole forwards 1.03-1.04x
        // less time than one loop over the groups for any count (2026-11-30, fifth session's review).
        if (count == TILE) {
            for (int g = 0; g < TILE / ROWS; ++g) {
                const uint8_t *blocks = w + (first + g * ROWS) * row_bytes + s * step, *ahead = blocks + 2 * TILE * row_bytes;
                for (int64_t line = 0; line < step && ahead + line < end; line += 64) __builtin_prefetch(ahead + line, 0, 3);
                for (int i = 0; i < ROWS; ++i) _mm512_store_si512(room + (g * ROWS + i) * PAIRS, Bf16Blocks<Format>::bf16(blocks + i * Format::BLOCK_BYTES));
            }
            return Tile{room, 64};
        }
        for (int o = 0; o < count; ++o) {
            const GroupRow row = group_row<Format>(w, out, in, first + o);
            if (row.i == 0)  // the group's block s, one item on
                for (const uint8_t *at = block_of<Format>(row.group, row.rows, 0, s, in) + 2 * TILE * row_bytes,
                                   *last = at + row.rows * Format::BLOCK_BYTES;
                     at < last && at < end; at += 64)
                    __builtin_prefetch(at, 0, 3);
            _mm512_store_si512(room + o * PAIRS, Bf16Blocks<Format>::bf16(block_of<Format>(row.group, row.rows, row.i, s, in)));
        }
        return Tile{room, 64};
    }
};

#endif

// The bf16 product on AMX tiles with W stored as Format's blocks; -1 where it does not take it (or there are no tiles).
template <class Format>
int stored_tiles(const uint8_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads) {
#ifdef SPECSTACK_AMX
    if (!bf16_shape_taken(n, out, in, threads, MAX_TILE_PASS_ROWS) || !amx_permitted()) return -1;
    tile_passes(x, bias, y, n, out, in, threads, StoredTiles<Format>{w, out, in});
    return 0;
#else
    (void)w, (void)x, (void)bias, (void)y, (void)n, (void)out, (void)in, (void)threads;
    return -1;
#endif
}

// The bf16 product with W stored as Format: widened in registers to bf16 and taken with bf16 dot products where
// there are any, else widened to float32 (the section "bfloat16 products widened to float32").
template <class Format>
int stored_bf16_linear(const uint8_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads) {
#if defined(__AVX512BF16__)
    return narrow_bf16_linear<Bf16Blocks<Format>>(w, x, bias, y, n, out, in, threads);
#else
    return widened_bf16_linear<AsBF16<Format>>(w, x, bias, y, n, out, in, threads);
#endif
}

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
            four_outputs(w + first * in, true, x, n, in, out, first, y);
        else
            for (int64_t r = first; r < last; ++r) one_output(w + r * in, x, n, in, out, r, y);
        add_bias(bias, y, n, out, first, last);
    }
    return 0;
}

// The float32 product with W stored narrower: w [out, in / 32 * BLOCK_BYTES] (Q4_1, Q8_0 blocks or bf16 bit
// patterns, the rows grouped as specstack/weight_formats.py writes them), x [n, in], bias [out] or null, y [n, out]:
// the same bits as specstack_linear_rows_f32 over the float32 weights they stand for, from 0.75, 1.125 or
// 2 bytes a weight instead of 4. Returns 0, or -1 for shapes they do not take (in not a multiple of 32).
int specstack_linear_rows_q4_1_f32(const uint8_t *w, const float *x, const float *bias, float *y, int n, int64_t out, int64_t in, int threads) {
    return widened_linear<Q4_1>(w, x, bias, y, n, out, in, threads);
}

int specstack_linear_rows_q8_0_f32(const uint8_t *w, const float *x, const float *bias, float *y, int n, int64_t out, int64_t in, int threads) {
    return widened_linear<Q8_0>(w, x, bias, y, n, out, in, threads);
}

int specstack_linear_rows_bf16_f32(const uint8_t *w, const float *x, const float *bias, float *y, int n, int64_t out, int64_t in, int threads) {
    return widened_linear<BF16>(w, x, bias, y, n, out, in, threads);
}

// 1 where the kernel was compiled for AVX-512 (sixteen-float sums), 0 for narrower vectors: what a build is, reported
// (RowsKernel.avx512); the row limits do not depend on it (packed_linear.py, MAX_STREAMED_ROWS).
int specstack_linear_rows_avx512() {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

// 1 where bf16 products take AVX-512's bf16 dot products (vdpbf16ps), 0 where they are widened to float32
// (specstack_linear_rows_bf16 and _q4_1_bf16 run either way).
int specstack_linear_rows_bf16_dots() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

// The same in bfloat16 (uint16_t bit patterns): w [out, in], x [n, in] with n <= MAX_BF16_ROWS (widened:
// MAX_WIDENED_BF16_ROWS), bias [out] or null, y [n, out]. Returns 0, or -1 for shapes it does not take (in not
// a multiple of 32, more rows).
int specstack_linear_rows_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads) {
#if defined(__AVX512BF16__)
    if (!bf16_shape_taken(n, out, in, threads, MAX_BF16_ROWS)) return -1;
    bf16_outputs<MAX_BF16_ROWS>(
        bias, y, n, out, threads,
        [&](int64_t first, float *sums) {
            for (int j = 0; j < n; j += 4) bf16_four_outputs(w, x + j * in, n - j < 4 ? n - j : 4, in, first, sums + j * ROWS, j == 0);
        },
        [&](int64_t r, int j) { return bf16_one_output(w + r * in, x + j * in, in); });
    return 0;
#else
    return widened_bf16_linear<BF16Rows>((const uint8_t *)w, x, bias, y, n, out, in, threads);
#endif
}

// The bf16 product with W stored as Q4_1 blocks: w [out, in / 32 * 24] (row_bytes_of<Q4_1>), x [n, in] bf16
// with n <= MAX_Q4_ROWS, bias [out] bf16 or null, y [n, out] bf16: the same bits as
// specstack_linear_rows_bf16 over the bf16 weights the blocks stand for. Returns 0, or -1 for shapes it
// does not take (in not a multiple of 32, more than MAX_Q4_ROWS rows; widened: MAX_WIDENED_BF16_ROWS).
int specstack_linear_rows_q4_1_bf16(const uint8_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads) {
    return stored_bf16_linear<Q4_1>(w, x, bias, y, n, out, in, threads);
}

// The same with W stored as Q8_0 blocks, w [out, in / 32 * 36] (row_bytes_of<Q8_0>): a tied LM head over a Q8_0
// embedding reads 1.125 bytes a weight instead of 2.
int specstack_linear_rows_q8_0_bf16(const uint8_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads) {
    return stored_bf16_linear<Q8_0>(w, x, bias, y, n, out, in, threads);
}

// The three bf16 products above widened to float32 in every build (the section "bfloat16 products widened to
// float32"), up to MAX_WIDENED_BF16_ROWS rows: what a CPU whose bf16 dot products are slower than its FMAs takes
// (specstack/bf16_products.py); without bf16 dot products the entries above are these.
int specstack_linear_rows_bf16_widened(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads) {
    return widened_bf16_linear<BF16Rows>((const uint8_t *)w, x, bias, y, n, out, in, threads);
}

int specstack_linear_rows_q4_1_bf16_widened(const uint8_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads) {
    return widened_bf16_linear<AsBF16<Q4_1>>(w, x, bias, y, n, out, in, threads);
}

int specstack_linear_rows_q8_0_bf16_widened(const uint8_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads) {
    return widened_bf16_linear<AsBF16<Q8_0>>(w, x, bias, y, n, out, in, threads);
}

// 1 where the tile entries below run: built for AMX, and Linux lends this process the tiles.
int specstack_linear_rows_tiles_supported() {
#ifdef SPECSTACK_AMX
    return amx_permitted() ? 1 : 0;
#else
    return 0;
#endif
}

// The bf16 product on AMX tiles (packed_linear.py sends TILES_FROM rows and more): w [out, in] bf16,
// x [n, in] with n <= MAX_TILE_PASS_ROWS, bias [out] or null, y [n, out]. Returns 0, or -1 for what it does
// not take (in not a multiple of 32, more than MAX_TILE_PASS_ROWS rows, no AMX here).
int specstack_linear_rows_bf16_tiles(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads) {
#ifdef SPECSTACK_AMX
    if (!bf16_shape_taken(n, out, in, threads, MAX_TILE_PASS_ROWS) || !amx_permitted()) return -1;
    struct Rows {  // the weight's rows, in place where sixteen of them make a group; a short group's copied
        const uint16_t *w;
        int64_t in;
        Tile tile(int64_t first, int count, int64_t s, uint16_t *room) const {
            if (count == TILE) return Tile{w + first * in + s * PAIRS, in * 2};
            for (int o = 0; o < count; ++o) memcpy(room + o * PAIRS, w + (first + o) * in + s * PAIRS, 64);
            return Tile{room, 64};
        }
    };
    tile_passes(x, bias, y, n, out, in, threads, Rows{w, in});
    return 0;
#else
    (void)w, (void)x, (void)bias, (void)y, (void)n, (void)out, (void)in, (void)threads;
    return -1;
#endif
}

// The same with W stored as Q4_1 blocks (w [out, in / 32 * 24]) or Q8_0 blocks (w [out, in / 32 * 36]), each tile's
// blocks widened to the bf16 weights they stand for (StoredTiles): the same bits as specstack_linear_rows_bf16_tiles
// over those weights.
int specstack_linear_rows_q4_1_bf16_tiles(const uint8_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads) {
    return stored_tiles<Q4_1>(w, x, bias, y, n, out, in, threads);
}

int specstack_linear_rows_q8_0_bf16_tiles(const uint8_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int n, int64_t out, int64_t in, int threads) {
    return stored_tiles<Q8_0>(w, x, bias, y, n, out, in, threads);
}

}  // extern "C"
