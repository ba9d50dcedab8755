// Helpers shared by every operator's tiling logic, op_host, op_kernel and CPU kernel.
//
// Plain C++ with no CANN types: the same header compiles with g++ (CPU kernel,
// tests), the op_host tiling library and the Ascend C kernel compiler, where
// functions must carry __aicore__ to be callable from device code.
#ifndef MSDS_KERNEL_COMMON_H
#define MSDS_KERNEL_COMMON_H

#if defined(__CCE_AICORE__) || defined(__CCE_KT_TEST__)
#define MSDS_INLINE __aicore__ inline
#else
#include <cstdint>
#define MSDS_INLINE inline
#endif

namespace msds {

// Ascend vector units move and compute on 32-byte blocks: every UB buffer and
// every DataCopy length (except DataCopyPad's) is a multiple of this.
constexpr int64_t kBlockBytes = 32;
// UB bytes kept aside for scalars, reduce results and alignment slack.
constexpr int64_t kUbReserveBytes = 1024;
// Ascend 910B (Atlas 800T A2) defaults, used by the CPU kernels so that they walk
// the schedule the NPU will run: 48 vector cores (24 AI cores x 2 AIV), 192 KB UB.
constexpr int64_t kDefaultCoreNum = 48;
constexpr int64_t kDefaultUbBytes = 196352;

// Status codes returned by the tiling functions (0 = ok).
constexpr int kOk = 0;
constexpr int kErrBadShape = 1;
constexpr int kErrUbTooSmall = 2;
constexpr int kErrBadConfig = 3;

MSDS_INLINE int64_t CeilDiv(int64_t a, int64_t b) { return b == 0 ? 0 : (a + b - 1) / b; }
MSDS_INLINE int64_t AlignUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }
MSDS_INLINE int64_t AlignDown(int64_t a, int64_t b) { return b == 0 ? 0 : (a / b) * b; }
MSDS_INLINE int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }
MSDS_INLINE int64_t Max64(int64_t a, int64_t b) { return a > b ? a : b; }

// Split `total` items over at most `core_num` cores in chunks that are multiples
// of `align` items (so every core's GM start offset is 32-byte aligned); the last
// used core takes the tail. Returns the chunk; writes the number of used cores.
MSDS_INLINE int64_t AlignedChunks(int64_t total, int64_t core_num, int64_t align, int64_t* used_cores) {
  if (total <= 0 || core_num <= 0) {
    *used_cores = 0;
    return 0;
  }
  int64_t chunk = AlignUp(CeilDiv(total, core_num), align);
  *used_cores = CeilDiv(total, chunk);
  return chunk;
}

}  // namespace msds

#endif  // MSDS_KERNEL_COMMON_H
