// AMX tile registers on Linux, shared by the kernels that use them (decode_attention.cpp, linear_rows.cpp).
#pragma once

#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

// Linux lends the tile registers to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM = 0x1023 for
// XFEATURE_XTILEDATA = 18); asked once, false where refused (an old kernel, a hypervisor without AMX).
inline bool amx_permitted() {
    static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permitted;
}

struct TileConfig {  // what ldtilecfg reads: palette 1, then each tile's bytes per row and rows
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

}  // namespace
