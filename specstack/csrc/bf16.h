// bfloat16 numbers as the kernels read and write them, shared by compiled_layers.cpp, decode_attention.cpp and
// linear_rows.cpp (decoder_ops.cpp keeps its own, which also carries NaNs through as torch does).
#pragma once

#include <stdint.h>
#include <string.h>

namespace {

inline float bf16_to_float(uint16_t h) {  // exact: a bf16 is the upper half of a float
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {  // to nearest even, as torch's cast (for the finite numbers the kernels make)
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

}  // namespace
