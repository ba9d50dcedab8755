// GroupedMatmul CPU kernel: ops.Custom(func_type="aot") entry points (CPU only; on Ascend the MoE uses
// MindSpore's own GroupedMatmulV4, see ms_deepseek/ops/api.py GroupedMatmul).
//
// Rows of x are sorted by expert; group_list int32 [E] holds each expert's row count (counts, not a
// cumulative sum), and rows past sum(group_list) are padding: their outputs are 0.
//
// GroupedMatmulNtCpu:         x [M, K], w [E, N, K], group_list [E] -> y [M, N],  y_e = x_e w_e^T
// GroupedMatmulNnCpu:         x [M, N], w [E, N, K], group_list [E] -> y [M, K],  y_e = x_e w_e
//                             (the input gradient of Nt: dx_e = dy_e w_e)
// GroupedMatmulWeightGradCpu: dy [M, N], x [M, K], group_list [E] -> dw [E, N, K], dw_e = dy_e^T x_e
//                             (an expert with no rows gets dw_e = 0)
// All float32. Each GEMM is oneDNN's dnnl_sgemm (row-major), taken from the libdnnl.so.3 that MindSpore's
// CPU backend has already loaded (mindspore/lib/libdnnl.so.3); without it a plain loop computes the same
// sums. Work is split over at most hardware_concurrency threads: Nt / Nn by row ranges, the weight gradient
// by ranges of N, so no two threads write the same output.
#include <dlfcn.h>

#include "msds_aot_cpu.h"

using msds::cpu::DType;

MSDS_DEFINE_LAST_ERROR()

namespace {

using SgemmFn = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                        float, float*, int64_t);

SgemmFn FindSgemm() {
  void* handle = dlopen("libdnnl.so.3", RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return nullptr;
  return reinterpret_cast<SgemmFn>(dlsym(handle, "dnnl_sgemm"));
}

// C[m, n] = op(A) op(B) (beta 0), row-major, op = transpose when the flag is 'T'.
void Gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float* c, int64_t ldc) {
  static const SgemmFn sgemm = FindSgemm();
  if (m <= 0 || n <= 0) return;
  if (sgemm != nullptr && sgemm(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc) == 0) return;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = 0.0f;
    for (int64_t p = 0; p < k; ++p) {
      float av = ta == 'T' ? a[p * lda + i] : a[i * lda + p];
      if (av == 0.0f) continue;
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] += av * (tb == 'T' ? b[j * ldb + p] : b[p * ldb + j]);
    }
  }
}

int64_t Threads(int64_t work) {
  int64_t hw = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max<int64_t>(1, std::min<int64_t>({hw, 16, work}));
}

// fn(t) for t in [0, threads) on that many threads.
template <typename F>
void Parallel(int64_t threads, F fn) {
  if (threads <= 1) {
    fn(0);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back([t, &fn]() { fn(t); });
  fn(0);
  for (auto& th : pool) th.join();
}

// Row offsets [E + 1] of the experts, or an error message.
std::string Offsets(const int32_t* counts, int64_t experts, int64_t rows, std::vector<int64_t>* offsets) {
  offsets->assign(static_cast<size_t>(experts + 1), 0);
  for (int64_t e = 0; e < experts; ++e) {
    if (counts[e] < 0) return "group_list holds a negative count";
    (*offsets)[e + 1] = (*offsets)[e] + counts[e];
  }
  if ((*offsets)[experts] > rows) return "group_list sums to more rows than x holds";
  return "";
}

struct Args {
  const float* x;
  const float* w;
  float* y;
  std::vector<int64_t> offsets;
  int64_t experts, rows, n, k;
};

// Shared checks of the three entries: 3 inputs + 1 output, float32 data, int32 group_list [E].
std::string Check(int nparam, int* ndims, int64_t** shapes, const char** dtypes, int x_idx, int w_idx) {
  if (nparam != 4) return "expected 3 inputs and 1 output";
  if (msds::cpu::ParseDType(dtypes[0]) != DType::kFloat32 || msds::cpu::ParseDType(dtypes[1]) != DType::kFloat32) {
    return "inputs must be float32";
  }
  if (msds::cpu::ParseDType(dtypes[2]) != DType::kInt32 || ndims[2] != 1) return "group_list must be int32 [E]";
  if (ndims[x_idx] != 2) return "the row input must be 2-D [M, *]";
  if (w_idx >= 0 && (ndims[w_idx] != 3 || shapes[w_idx][0] != shapes[2][0])) {
    return "the weight must be [E, *, *] with E = len(group_list)";
  }
  return "";
}

// y[r, :] for the rows [r0, r1): expert blocks intersected with the range; padding rows -> 0.
void RowRange(const Args& a, bool transpose_w, int64_t r0, int64_t r1) {
  int64_t in = transpose_w ? a.k : a.n, out = transpose_w ? a.n : a.k;
  for (int64_t e = 0; e < a.experts; ++e) {
    int64_t lo = std::max(r0, a.offsets[e]), hi = std::min(r1, a.offsets[e + 1]);
    if (lo >= hi) continue;
    const float* we = a.w + e * a.n * a.k;
    Gemm('N', transpose_w ? 'T' : 'N', hi - lo, out, in, a.x + lo * in, in, we, a.k, a.y + lo * out, out);
  }
  int64_t pad0 = std::max(r0, a.offsets[a.experts]);
  for (int64_t r = pad0; r < r1; ++r) std::fill(a.y + r * out, a.y + (r + 1) * out, 0.0f);
}

int RowsEntry(const char* name, bool transpose_w, int nparam, void** params, int* ndims, int64_t** shapes,
              const char** dtypes) {
  std::string err = Check(nparam, ndims, shapes, dtypes, 0, 1);
  Args a;
  a.experts = nparam == 4 ? shapes[2][0] : 0;
  if (err.empty()) {
    a.rows = shapes[0][0];
    a.n = shapes[1][1];
    a.k = shapes[1][2];
    if (shapes[0][1] != (transpose_w ? a.k : a.n)) err = "x's last axis does not match the weight";
  }
  if (err.empty()) err = Offsets(static_cast<const int32_t*>(params[2]), a.experts, a.rows, &a.offsets);
  if (!err.empty()) return MsdsFail(std::string(name) + ": " + err);
  a.x = static_cast<const float*>(params[0]);
  a.w = static_cast<const float*>(params[1]);
  a.y = static_cast<float*>(params[3]);
  int64_t threads = Threads(a.rows / 64);
  Parallel(threads, [&](int64_t t) { RowRange(a, transpose_w, a.rows * t / threads, a.rows * (t + 1) / threads); });
  return 0;
}

}  // namespace

extern "C" int GroupedMatmulNtCpu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                  void* stream, void* extra) {
  return RowsEntry("GroupedMatmulNt", true, nparam, params, ndims, shapes, dtypes);
}

extern "C" int GroupedMatmulNnCpu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                  void* stream, void* extra) {
  return RowsEntry("GroupedMatmulNn", false, nparam, params, ndims, shapes, dtypes);
}

extern "C" int GroupedMatmulWeightGradCpu(int nparam, void** params, int* ndims, int64_t** shapes,
                                          const char** dtypes, void* stream, void* extra) {
  std::string err = Check(nparam, ndims, shapes, dtypes, 0, -1);
  if (err.empty() && (ndims[1] != 2 || shapes[1][0] != shapes[0][0])) err = "dy and x must be [M, N] and [M, K]";
  std::vector<int64_t> offsets;
  int64_t experts = nparam == 4 ? shapes[2][0] : 0;
  if (err.empty()) err = Offsets(static_cast<const int32_t*>(params[2]), experts, shapes[0][0], &offsets);
  if (!err.empty()) return MsdsFail("GroupedMatmulWeightGrad: " + err);
  const float* dy = static_cast<const float*>(params[0]);
  const float* x = static_cast<const float*>(params[1]);
  float* dw = static_cast<float*>(params[3]);
  int64_t n = shapes[0][1], k = shapes[1][1];
  int64_t threads = Threads(n / 16);
  Parallel(threads, [&](int64_t t) {
    int64_t n0 = n * t / threads, n1 = n * (t + 1) / threads;
    for (int64_t e = 0; e < experts; ++e) {
      float* out = dw + e * n * k + n0 * k;
      int64_t r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
      if (rows == 0) {
        std::fill(out, out + (n1 - n0) * k, 0.0f);
        continue;
      }
      Gemm('T', 'N', n1 - n0, k, rows, dy + r0 * n + n0, n, x + r0 * k, k, out, k);
    }
  });
  return 0;
}
