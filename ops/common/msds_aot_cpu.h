// Helpers for the CPU kernels (MindSpore ops.Custom(func_type="aot") entry points).
//
// An aot kernel receives every input then every output as a void* with its
// shape and dtype name; it returns 0 on success. On failure our kernels also
// print a one-line message to stderr and keep it in MsdsLastError() (for a
// debugger or a ctypes caller; the package reads the stderr line).
#ifndef MSDS_AOT_CPU_H
#define MSDS_AOT_CPU_H

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace msds {
namespace cpu {

enum class DType { kFloat32, kFloat16, kBFloat16, kInt32, kInt64, kOther };

inline DType ParseDType(const char* name) {
  if (std::strcmp(name, "float32") == 0 || std::strcmp(name, "float") == 0) return DType::kFloat32;
  if (std::strcmp(name, "float16") == 0) return DType::kFloat16;
  if (std::strcmp(name, "bfloat16") == 0) return DType::kBFloat16;
  if (std::strcmp(name, "int32") == 0 || std::strcmp(name, "int") == 0) return DType::kInt32;
  if (std::strcmp(name, "int64") == 0) return DType::kInt64;
  return DType::kOther;
}

inline int64_t NumElements(int ndim, const int64_t* shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

// IEEE binary16 -> float32 (exact).
inline float HalfToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int shift = 0;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        ++shift;
      }
      mant &= 0x3FFu;
      bits = sign | static_cast<uint32_t>(127 - 15 - shift + 1) << 23 | mant << 13;
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | mant << 13;  // inf / nan
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// bfloat16 -> float32 (exact: bfloat16 is the top half of a float32).
inline float BFloat16ToFloat(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Reads element i of a float32 / float16 / bfloat16 buffer as float32.
inline float LoadAsFloat(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(data)[i]);
    default:
      return static_cast<const float*>(data)[i];
  }
}

// Runs fn(core) for core in [0, cores). The virtual cores of a schedule are
// independent, so large problems spread them over a few host threads.
template <typename F>
void ForEachCore(int64_t cores, int64_t work, F fn) {
  const int64_t kMinWorkPerThread = 1 << 15;
  int64_t hw = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  int64_t threads = std::min<int64_t>({hw, cores, std::max<int64_t>(1, work / kMinWorkPerThread), 16});
  if (threads <= 1) {
    for (int64_t c = 0; c < cores; ++c) fn(c);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int64_t w = 0; w < threads; ++w) {
    pool.emplace_back([=, &fn]() {
      for (int64_t c = w; c < cores; c += threads) fn(c);
    });
  }
  for (auto& th : pool) th.join();
}

}  // namespace cpu
}  // namespace msds

// One last-error slot per loaded kernel library (kernels may run on any thread).
#define MSDS_DEFINE_LAST_ERROR()                                                  \
  static std::string msds_last_error;                                             \
  extern "C" const char* MsdsLastError() { return msds_last_error.c_str(); }      \
  static int MsdsFail(const std::string& message) {                               \
    msds_last_error = message;                                                    \
    std::fprintf(stderr, "ms_deepseek kernel error: %s\n", message.c_str());      \
    return 1;                                                                     \
  }

#endif  // MSDS_AOT_CPU_H
