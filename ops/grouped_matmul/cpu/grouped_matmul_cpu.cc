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
// GroupedSwigluCpu:           x [M, H], wg [E, I, H], wu [E, I, H], wd [E, H, I], group_list [E]
//                             -> y [M, H], gate [M, I], up [M, I]: every expert's SwiGLU MLP on its rows,
//                             y_e = (silu(x_e wg_e^T) * (x_e wu_e^T)) wd_e^T; gate and up are kept for the gradient
// GroupedSwigluGradCpu:       dy [M, H], x, wg, wu, wd, gate, up, group_list
//                             -> dx [M, H], dwg [E, I, H], dwu [E, I, H], dwd [E, H, I]
// All float32. Each GEMM is oneDNN's dnnl_sgemm (row-major), taken from the libdnnl.so.3 that MindSpore's
// CPU backend has already loaded (mindspore/lib/libdnnl.so.3); without it a plain loop computes the same
// sums. Work is handed out as tasks to at most hardware_concurrency threads: blocks of an expert's rows, or of a
// weight gradient's output rows, so no two threads write the same output.
#include <dlfcn.h>

#include <atomic>

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

// C[m, n] = op(A) op(B) + beta C (beta 0 or 1), row-major, op = transpose when the flag is 'T'.
void Gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float* c, int64_t ldc, float beta = 0.0f) {
  static const SgemmFn sgemm = FindSgemm();
  if (m <= 0 || n <= 0) return;
  if (sgemm != nullptr && sgemm(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc) == 0) return;
  for (int64_t i = 0; i < m; ++i) {
    if (beta == 0.0f) {
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = 0.0f;
    }
    for (int64_t p = 0; p < k; ++p) {
      float av = ta == 'T' ? a[p * lda + i] : a[i * lda + p];
      if (av == 0.0f) continue;
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] += av * (tb == 'T' ? b[j * ldb + p] : b[p * ldb + j]);
    }
  }
}

// fn(task) for task in [0, tasks), handed out one at a time to at most hardware_concurrency threads: on cores
// shared with other processes a thread that falls behind takes fewer tasks instead of holding up an even split.
template <typename F>
void ForTasks(int64_t tasks, F fn) {
  int64_t hw = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  int64_t threads = std::min<int64_t>({hw, 16, tasks});
  if (threads <= 1) {
    for (int64_t t = 0; t < tasks; ++t) fn(t);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) fn(t);
  };
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < threads; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

// Rows per GEMM task: large enough that the weight block each sgemm call packs is reused over many rows.
constexpr int64_t kRowBlock = 256;
// Output rows of a weight gradient per task.
constexpr int64_t kGradBlock = 128;
// Elements per task of an elementwise pass.
constexpr int64_t kElementBlock = 1 << 15;

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

// The weight gradient dw_e = dy_e^T x_e for every expert (dy [M, N], x [M, K] -> dw [E, N, K]); one task per
// expert and block of N.
void WeightGrad(const float* dy, const float* x, const std::vector<int64_t>& offsets, int64_t experts, int64_t n,
                int64_t k, float* dw) {
  int64_t blocks = (n + kGradBlock - 1) / kGradBlock;
  ForTasks(experts * blocks, [&](int64_t task) {
    int64_t e = task / blocks, n0 = task % blocks * kGradBlock, n1 = std::min(n, n0 + kGradBlock);
    float* out = dw + e * n * k + n0 * k;
    int64_t r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) {
      std::fill(out, out + (n1 - n0) * k, 0.0f);
      return;
    }
    Gemm('T', 'N', n1 - n0, k, rows, dy + r0 * n + n0, n, x + r0 * k, k, out, k);
  });
}

// y = x_e w_e^T (transpose_w: w [E, out, in]) or x_e w_e (w [E, in, out]) on every expert's rows, x [M, in] ->
// y [M, out] (+ y when beta is 1); one task per block of an expert's rows; padding rows -> 0 (beta 0).
void Rows(const float* x, const float* w, const std::vector<int64_t>& offsets, int64_t experts, int64_t rows,
          int64_t in, int64_t out, bool transpose_w, float* y, float beta = 0.0f) {
  std::vector<int64_t> starts, experts_of;  // the tasks: [starts[t], next block or the expert's end)
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += kRowBlock) {
      starts.push_back(r);
      experts_of.push_back(e);
    }
  }
  ForTasks(static_cast<int64_t>(starts.size()), [&](int64_t t) {
    int64_t e = experts_of[t], lo = starts[t], hi = std::min(offsets[e + 1], lo + kRowBlock);
    const float* we = w + e * in * out;
    Gemm('N', transpose_w ? 'T' : 'N', hi - lo, out, in, x + lo * in, in, we, transpose_w ? in : out, y + lo * out,
         out, beta);
  });
  if (beta == 0.0f) std::fill(y + offsets[experts] * out, y + rows * out, 0.0f);
}

// fn(i) for i in [0, n), in blocks over the threads.
template <typename F>
void Elementwise(int64_t n, F fn) {
  ForTasks((n + kElementBlock - 1) / kElementBlock, [&](int64_t t) {
    for (int64_t i = t * kElementBlock, end = std::min(n, i + kElementBlock); i < end; ++i) fn(i);
  });
}

inline float Sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// Nt (transpose_w): x [M, K], w [E, N, K] -> y [M, N]; Nn: x [M, N], w [E, N, K] -> y [M, K].
int RowsEntry(const char* name, bool transpose_w, int nparam, void** params, int* ndims, int64_t** shapes,
              const char** dtypes) {
  std::string err = Check(nparam, ndims, shapes, dtypes, 0, 1);
  std::vector<int64_t> offsets;
  int64_t experts = 0, rows = 0, in = 0, out = 0;
  if (err.empty()) {
    experts = shapes[2][0];
    rows = shapes[0][0];
    in = transpose_w ? shapes[1][2] : shapes[1][1];
    out = transpose_w ? shapes[1][1] : shapes[1][2];
    if (shapes[0][1] != in) err = "x's last axis does not match the weight";
  }
  if (err.empty()) err = Offsets(static_cast<const int32_t*>(params[2]), experts, rows, &offsets);
  if (!err.empty()) return MsdsFail(std::string(name) + ": " + err);
  Rows(static_cast<const float*>(params[0]), static_cast<const float*>(params[1]), offsets, experts, rows, in, out,
       transpose_w, static_cast<float*>(params[3]));
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
  WeightGrad(static_cast<const float*>(params[0]), static_cast<const float*>(params[1]), offsets, experts,
             shapes[0][1], shapes[1][1], static_cast<float*>(params[3]));
  return 0;
}

namespace {

// Checks of the SwiGLU entries: every data input float32 and group_list int32 [E] at `gl`; x [M, H], wg / wu
// [E, I, H], wd [E, H, I]. Fills M, H, I, E and the row offsets.
std::string SwigluShapes(int nparam, int expected, int gl, int* ndims, int64_t** shapes, const char** dtypes, int xi,
                         int64_t* m, int64_t* h, int64_t* i, int64_t* e, std::vector<int64_t>* offsets,
                         void** params) {
  if (nparam != expected) return "wrong number of inputs and outputs";
  for (int p = 0; p < nparam; ++p) {
    bool want_int = p == gl;
    DType dt = msds::cpu::ParseDType(dtypes[p]);
    if (want_int ? dt != DType::kInt32 : dt != DType::kFloat32) return "data must be float32, group_list int32";
  }
  if (ndims[xi] != 2 || ndims[xi + 1] != 3 || ndims[xi + 2] != 3 || ndims[xi + 3] != 3 || ndims[gl] != 1) {
    return "expected x [M, H], wg / wu [E, I, H], wd [E, H, I], group_list [E]";
  }
  *m = shapes[xi][0];
  *h = shapes[xi][1];
  *e = shapes[xi + 1][0];
  *i = shapes[xi + 1][1];
  for (int w = 1; w <= 2; ++w) {
    if (shapes[xi + w][0] != *e || shapes[xi + w][1] != *i || shapes[xi + w][2] != *h) return "wg / wu must be [E, I, H]";
  }
  if (shapes[xi + 3][0] != *e || shapes[xi + 3][1] != *h || shapes[xi + 3][2] != *i) return "wd must be [E, H, I]";
  if (shapes[gl][0] != *e) return "group_list must be [E]";
  return Offsets(static_cast<const int32_t*>(params[gl]), *e, *m, offsets);
}

}  // namespace

extern "C" int GroupedSwigluCpu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                void* stream, void* extra) {
  int64_t m = 0, h = 0, i = 0, e = 0;
  std::vector<int64_t> offsets;
  std::string err = SwigluShapes(nparam, 8, 4, ndims, shapes, dtypes, 0, &m, &h, &i, &e, &offsets, params);
  if (!err.empty()) return MsdsFail("GroupedSwiglu: " + err);
  const float* x = static_cast<const float*>(params[0]);
  float* y = static_cast<float*>(params[5]);
  float* gate = static_cast<float*>(params[6]);
  float* up = static_cast<float*>(params[7]);
  Rows(x, static_cast<const float*>(params[1]), offsets, e, m, h, i, true, gate);
  Rows(x, static_cast<const float*>(params[2]), offsets, e, m, h, i, true, up);
  std::vector<float> act(static_cast<size_t>(m * i));
  float* a = act.data();
  Elementwise(m * i, [&](int64_t p) { a[p] = gate[p] * Sigmoid(gate[p]) * up[p]; });
  Rows(act.data(), static_cast<const float*>(params[3]), offsets, e, m, i, h, true, y);
  return 0;
}

extern "C" int GroupedSwigluGradCpu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                    void* stream, void* extra) {
  // inputs: dy, x, wg, wu, wd, gate, up, group_list; outputs: dx, dwg, dwu, dwd
  int64_t m = 0, h = 0, i = 0, e = 0;
  std::vector<int64_t> offsets;
  std::string err = SwigluShapes(nparam, 12, 7, ndims, shapes, dtypes, 1, &m, &h, &i, &e, &offsets, params);
  if (!err.empty()) return MsdsFail("GroupedSwigluGrad: " + err);
  const float* dy = static_cast<const float*>(params[0]);
  const float* x = static_cast<const float*>(params[1]);
  const float* wg = static_cast<const float*>(params[2]);
  const float* wu = static_cast<const float*>(params[3]);
  const float* wd = static_cast<const float*>(params[4]);
  const float* gate = static_cast<const float*>(params[5]);
  const float* up = static_cast<const float*>(params[6]);
  float* dx = static_cast<float*>(params[8]);
  size_t mi = static_cast<size_t>(m * i);
  std::vector<float> act(mi), da(mi), dgate(mi), dup(mi);
  float* a = act.data();
  Elementwise(m * i, [&](int64_t p) { a[p] = gate[p] * Sigmoid(gate[p]) * up[p]; });
  WeightGrad(dy, act.data(), offsets, e, h, i, static_cast<float*>(params[11]));  // dwd_e = dy_e^T act_e
  Rows(dy, wd, offsets, e, m, h, i, false, da.data());                           // da_e = dy_e wd_e
  float *d_act = da.data(), *d_gate = dgate.data(), *d_up = dup.data();
  Elementwise(m * i, [&](int64_t p) {
    float s = Sigmoid(gate[p]);
    d_up[p] = d_act[p] * gate[p] * s;
    d_gate[p] = d_act[p] * up[p] * s * (1.0f + gate[p] * (1.0f - s));  // d silu(g) / dg = s (1 + g (1 - s))
  });
  WeightGrad(dgate.data(), x, offsets, e, i, h, static_cast<float*>(params[9]));
  WeightGrad(dup.data(), x, offsets, e, i, h, static_cast<float*>(params[10]));
  Rows(dgate.data(), wg, offsets, e, m, i, h, false, dx);
  Rows(dup.data(), wu, offsets, e, m, i, h, false, dx, 1.0f);
  return 0;
}
