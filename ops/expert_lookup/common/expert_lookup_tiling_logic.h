// ExpertLookup tiling: how the k-major stream of routed slots is cut into cores and tiles.
//
// Shared by op_host, op_kernel and the CPU kernel (which walks the same schedule).
//
// Input is the router's choice of G token groups (one per data-parallel rank), each
// flattened in k-major order ([G, k * T]: slot s = j * T + i for token i, choice j of
// a group), so a slot's position in its expert's capacity buffer is the number of
// earlier slots of the SAME GROUP with the same expert. Counting runs over the flat
// stream [G * k * T] with the key g * E + e (group g's slots are contiguous), so one
// histogram row of G * E counters per core gives per-group positions; a device that
// holds one group (G = 1, the sharded case) computes exactly its group's result.
// An id outside [0, E) is not counted and gets (dest_rank, buffer_row, position,
// keep) = (-1, -1, -1, 0.0) (InvalidSlot): nothing is read or written out of bounds.
// The work is three phases:
//   1. count:  each core histograms the keys of its chunk of slots and
//              writes the histogram to its row of a GM workspace [cores, G * E];
//   2. sync:   all cores wait (SyncAll on Ascend; phase boundary on CPU);
//   3. assign: each core starts every expert's counter at the sum of the earlier
//              cores' histograms and walks its chunk again in order, giving each
//              slot its position, destination rank, buffer row and keep flag.
// Chunks are multiples of 8 slots (32 bytes of int32) so every core's GM offset
// is block aligned; the last used core takes the tail. Within a core, the chunk
// is walked in UB tiles of `tile` slots; the last tile of a chunk is shorter.
// A slot's group is tracked by a cursor along the walk (GroupCursor): one division
// where a walk starts, none per slot (64-bit division is slow on the scalar unit).
#ifndef MSDS_EXPERT_LOOKUP_TILING_LOGIC_H
#define MSDS_EXPERT_LOOKUP_TILING_LOGIC_H

#include "msds_kernel_common.h"

namespace msds {
namespace expert_lookup {

constexpr int64_t kAlign = kBlockBytes / 4;  // int32 / float32 elements per block

struct ExpertLookupTiling {
  int64_t slots;             // G * T * k
  int64_t groups;            // G (token groups; slots of group g are [g * group_slots, (g + 1) * group_slots))
  int64_t group_slots;       // T * k
  int64_t num_experts;       // E (rows of the placement table)
  int64_t experts_per_rank;  // E_local
  int64_t capacity;          // per-expert buffer rows
  int64_t used_cores;
  int64_t chunk;             // slots per core (multiple of kAlign) ...
  int64_t last_chunk;        // ... except the last used core
  int64_t tile;              // slots per UB tile (multiple of kAlign)
  int64_t hist_stride;       // workspace row length: G * E rounded up to kAlign
  int64_t workspace_bytes;   // GM workspace for the per-core histograms
};

// UB bytes per slot of a tile: the ids in, and the four outputs (dest_rank, buffer_row,
// position as int32, keep as float32), one buffer each (the kernel does not double-buffer:
// the per-slot work is scalar and waits for each tile's ids anyway).
MSDS_INLINE int64_t BytesPerSlot() { return 4 + 4 * 4; }

// UB bytes that do not depend on the tile: the placement table [E, 2] and the
// running counters [G * E] plus one histogram row being summed, all int32.
MSDS_INLINE int64_t FixedUbBytes(int64_t num_experts, int64_t groups) {
  int64_t e = AlignUp(num_experts, kAlign);
  int64_t ge = AlignUp(groups * num_experts, kAlign);
  return (2 * e + ge + ge) * 4;
}

// `slots` is the whole stream (G * T * k) and must be a multiple of `groups`.
MSDS_INLINE int ComputeTiling(int64_t slots, int64_t groups, int64_t num_experts, int64_t experts_per_rank,
                              int64_t capacity, int64_t core_num, int64_t ub_bytes, ExpertLookupTiling* t) {
  if (slots < 0 || num_experts < 1 || groups < 1 || slots % groups != 0) return kErrBadShape;
  if (experts_per_rank < 1 || capacity < 0 || core_num < 1) return kErrBadConfig;
  t->slots = slots;
  t->groups = groups;
  t->group_slots = slots / groups;
  t->num_experts = num_experts;
  t->experts_per_rank = experts_per_rank;
  t->capacity = capacity;
  t->hist_stride = AlignUp(groups * num_experts, kAlign);
  t->chunk = AlignedChunks(slots, core_num, kAlign, &t->used_cores);
  t->last_chunk = t->used_cores > 0 ? slots - (t->used_cores - 1) * t->chunk : 0;
  t->workspace_bytes = t->used_cores * t->hist_stride * 4;
  int64_t budget = ub_bytes - kUbReserveBytes - FixedUbBytes(num_experts, groups);
  int64_t fit = AlignDown(budget > 0 ? budget / BytesPerSlot() : 0, kAlign);
  if (fit < kAlign) return kErrUbTooSmall;
  t->tile = slots > 0 ? Min64(fit, t->chunk) : fit;
  return kOk;
}

// Slots [*start, *start + *count) belong to core `core`.
MSDS_INLINE void CoreSlots(const ExpertLookupTiling& t, int64_t core, int64_t* start, int64_t* count) {
  if (core >= t.used_cores) {
    *start = t.slots;
    *count = 0;
    return;
  }
  *start = core * t.chunk;
  *count = core + 1 == t.used_cores ? t.last_chunk : t.chunk;
}

MSDS_INLINE int64_t Tiles(const ExpertLookupTiling& t, int64_t core_slots) { return CeilDiv(core_slots, t.tile); }

MSDS_INLINE int64_t TileSlots(const ExpertLookupTiling& t, int64_t core_slots, int64_t tile) {
  return Min64(t.tile, core_slots - tile * t.tile);
}

// The group of the slots of a walk in increasing slot order, as the first counter key of the
// group (group * E) and the first slot of the next group.
struct GroupCursor {
  int64_t key_base;
  int64_t next_group_slot;
};

// Cursor for a walk starting at flat slot s (the only division).
MSDS_INLINE GroupCursor StartGroups(const ExpertLookupTiling& t, int64_t s) {
  GroupCursor c;
  int64_t g = t.group_slots > 0 ? s / t.group_slots : 0;
  c.key_base = g * t.num_experts;
  c.next_group_slot = (g + 1) * t.group_slots;
  return c;
}

// Counter key of slot s with expert id e, or -1 when e is outside [0, E). Slots must be visited
// one by one in increasing order from the cursor's start (a group holds >= 1 slot, so s crosses
// at most one group boundary per step).
MSDS_INLINE int64_t NextKey(const ExpertLookupTiling& t, GroupCursor* c, int64_t s, int32_t e) {
  if (s >= c->next_group_slot) {
    c->key_base += t.num_experts;
    c->next_group_slot += t.group_slots;
  }
  if (e < 0 || e >= t.num_experts) return -1;
  return c->key_base + e;
}

// The outputs of a slot whose id is out of range.
MSDS_INLINE void InvalidSlot(int32_t* dest_rank, int32_t* buffer_row, int32_t* pos, float* keep) {
  *dest_rank = -1;
  *buffer_row = -1;
  *pos = -1;
  *keep = 0.0f;
}

// The per-slot rule, identical on every backend.
MSDS_INLINE void AssignSlot(int32_t rank, int32_t local_slot, int64_t position, const ExpertLookupTiling& t,
                            int32_t* dest_rank, int32_t* buffer_row, int32_t* pos, float* keep) {
  *dest_rank = rank;
  *buffer_row = static_cast<int32_t>(rank * t.experts_per_rank + local_slot);
  *pos = static_cast<int32_t>(position);
  *keep = position < t.capacity ? 1.0f : 0.0f;
}

}  // namespace expert_lookup
}  // namespace msds

#endif  // MSDS_EXPERT_LOOKUP_TILING_LOGIC_H
