// A kernel call's scratch memory, kept by the calling thread for its next call (decode_attention.cpp,
// linear_rows.cpp). Allocated anew each call it went to malloc, whose large requests cost page faults and zeroed
// pages, or, once a process had run a generation, a search through a fragmented heap: on the 2-core Intel host a
// bf16 target's two-token forward over 7,500 slots took 26.4 ms after a short generation against 23.6 ms before one,
// 6% of it in _int_malloc (docs/benchmarks.md, "Scratch kept by the calling thread").
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <new>

namespace {

// At least `floats` floats for the calling thread, from a 64-byte boundary, kept until a larger request; null where
// memory ran out. Tag tells a file's buffers apart, so that two can be live in one call.
template <int Tag>
inline float *thread_scratch(size_t floats) {
    thread_local std::unique_ptr<float[]> room;
    thread_local size_t held = 0;
    if (held < floats + 16) {
        room.reset(new (std::nothrow) float[floats + 16]);
        held = room ? floats + 16 : 0;
        if (!room) return nullptr;
    }
    return (float *)(((uintptr_t)room.get() + 63) & ~(uintptr_t)63);
}

}  // namespace
