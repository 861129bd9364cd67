// Copying chosen entries of a KV cache into the leading slots of a store (specstack/gather_ops.py): a retrieval
// view's out of the full cache, or a store's own per-head survivors of an eviction, moved to its front in place.
//
// Keys and values are [groups, rows, width] buffers (a group: one layer's KV head), of any element type:
// a row is row_bytes bytes. For each group g, the source rows at slots[g, 0..count) go to the destination's
// rows 0..count of the same group, in that order. Consecutive slots (a retrieval chunk) are copied as one
// block, and the copy lands in place: torch's row gather wrote a temporary that was then copied again
// into the view's strided leading rows, twice the bytes and a fresh buffer each time.
//
// The caller checks every slot lies in [0, source_rows); the groups are split over the threads. Source and destination
// may be the same buffers when each group's slots ascend: row i then comes from slots[i] >= i, which no earlier run
// has written over (runs go in order, and a run overlapping its own source is moved with memmove).

#include <cstdint>
#include <cstring>

namespace {

void gather_group(const char *source, char *dest, const int64_t *slots, int64_t count, int64_t row_bytes) {
    for (int64_t i = 0; i < count;) {
        int64_t end = i + 1;
        while (end < count && slots[end] == slots[end - 1] + 1) ++end;  // a run of consecutive slots
        std::memmove(dest + i * row_bytes, source + slots[i] * row_bytes, (end - i) * row_bytes);
        i = end;
    }
}

}  // namespace

extern "C" {

// slots: [groups, count] int64, contiguous. Sources hold source_rows rows a group, destinations dest_rows.
int specstack_gather_rows(const char *source_keys, const char *source_values, char *dest_keys, char *dest_values,
                          const int64_t *slots, int64_t groups, int64_t count, int64_t source_rows, int64_t dest_rows,
                          int64_t row_bytes, int threads) {
    if (count > dest_rows || groups < 0 || count < 0 || row_bytes <= 0) return 1;
    const int64_t source_group = source_rows * row_bytes, dest_group = dest_rows * row_bytes;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < 2 * groups; ++task) {  // keys and values of each group: 2 * groups tasks
        int64_t g = task % groups;
        const char *source = (task < groups ? source_keys : source_values) + g * source_group;
        char *dest = (task < groups ? dest_keys : dest_values) + g * dest_group;
        gather_group(source, dest, slots + g * count, count, row_bytes);
    }
    return 0;
}

}  // extern "C"
