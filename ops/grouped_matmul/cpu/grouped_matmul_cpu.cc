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
// GroupedSwigluCpu:           tokens [N, H], order [S], wg [E, I, H], wu [E, I, H], wd [E, H, I], group_list [E],
//                             weight [N, k] -> out [N, H], gate [S, I], up [S, I], y [S, H]: every expert's SwiGLU
//                             MLP on its rows, the rows sorted by expert being tokens[order[p] / k] (k = S / N; order
//                             a permutation of the slots s = token * k + choice), y_e = (silu(x_e wg_e^T) *
//                             (x_e wu_e^T)) wd_e^T, and out[n] = sum_j weight[n, j] * y[slot n * k + j] (the routing
//                             weights' combine); gate, up and y (sorted order) are kept for the gradient
// GroupedSwigluGradCpu:       dout [N, H], tokens, order, wg, wu, wd, gate, up, y, group_list, weight
//                             -> dtokens [N, H], dwg [E, I, H], dwu [E, I, H], dwd [E, H, I], dweight [N, k]
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
// rows: the rows of the whole call; below kParallelRows the caller's thread runs every task, since a thread
// started per call (and, on shared cores, its wait to be scheduled) costs more than the work it would take.
constexpr int64_t kParallelRows = 64;
template <typename F>
void ForTasks(int64_t tasks, int64_t rows, F fn) {
  int64_t hw = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  int64_t threads = rows < kParallelRows ? 1 : std::min<int64_t>({hw, 16, tasks});
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
  ForTasks(experts * blocks, offsets[experts], [&](int64_t task) {
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
  ForTasks(static_cast<int64_t>(starts.size()), offsets[experts], [&](int64_t t) {
    int64_t e = experts_of[t], lo = starts[t], hi = std::min(offsets[e + 1], lo + kRowBlock);
    const float* we = w + e * in * out;
    Gemm('N', transpose_w ? 'T' : 'N', hi - lo, out, in, x + lo * in, in, we, transpose_w ? in : out, y + lo * out,
         out, beta);
  });
  if (beta == 0.0f) std::fill(y + offsets[experts] * out, y + rows * out, 0.0f);
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

// The SwiGLU entries' shapes: tokens [N, H], order int32 [S] (S = N * k), wg / wu [E, I, H], wd [E, H, I],
// group_list int32 [E]; `first` is the index of tokens among the parameters (after dy in the gradient), `gl`
// the index of group_list (after gate and up in the gradient).
struct Swiglu {
  int64_t n = 0, s = 0, k = 0, h = 0, i = 0, e = 0;
  std::vector<int64_t> offsets;
  const float *tokens = nullptr, *wg = nullptr, *wu = nullptr, *wd = nullptr;
  const int32_t* order = nullptr;
};

std::string ReadSwiglu(int nparam, int expected, int first, int gl, void** params, int* ndims, int64_t** shapes,
                       const char** dtypes, Swiglu* g) {
  if (nparam != expected) return "wrong number of inputs and outputs";
  int order_idx = first + 1;
  for (int p = 0; p < nparam; ++p) {
    bool want_int = p == order_idx || p == gl;
    DType dt = msds::cpu::ParseDType(dtypes[p]);
    if (want_int ? dt != DType::kInt32 : dt != DType::kFloat32) return "data must be float32, order and group_list int32";
  }
  if (ndims[first] != 2 || ndims[order_idx] != 1 || ndims[first + 2] != 3 || ndims[first + 3] != 3 ||
      ndims[first + 4] != 3 || ndims[gl] != 1) {
    return "expected tokens [N, H], order [S], wg / wu [E, I, H], wd [E, H, I], group_list [E]";
  }
  g->n = shapes[first][0];
  g->h = shapes[first][1];
  g->s = shapes[order_idx][0];
  g->e = shapes[first + 2][0];
  g->i = shapes[first + 2][1];
  if (g->n <= 0 || g->s % g->n) return "order's length must be a multiple of the tokens";
  g->k = g->s / g->n;
  for (int w = 2; w <= 3; ++w) {
    if (shapes[first + w][0] != g->e || shapes[first + w][1] != g->i || shapes[first + w][2] != g->h) {
      return "wg / wu must be [E, I, H]";
    }
  }
  if (shapes[first + 4][0] != g->e || shapes[first + 4][1] != g->h || shapes[first + 4][2] != g->i) {
    return "wd must be [E, H, I]";
  }
  if (shapes[gl][0] != g->e) return "group_list must be [E]";
  g->tokens = static_cast<const float*>(params[first]);
  g->order = static_cast<const int32_t*>(params[order_idx]);
  g->wg = static_cast<const float*>(params[first + 2]);
  g->wu = static_cast<const float*>(params[first + 3]);
  g->wd = static_cast<const float*>(params[first + 4]);
  for (int64_t p = 0; p < g->s; ++p) {
    if (g->order[p] < 0 || g->order[p] >= g->s) return "order holds a slot outside [0, S)";
  }
  return Offsets(static_cast<const int32_t*>(params[gl]), g->e, g->s, &g->offsets);
}

// Rows [lo, hi) of the sorted order gathered from the tokens: xb[p - lo] = tokens[order[p] / k].
void GatherRows(const Swiglu& g, int64_t lo, int64_t hi, float* xb) {
  for (int64_t p = lo; p < hi; ++p) {
    const float* src = g.tokens + static_cast<int64_t>(g.order[p] / g.k) * g.h;
    std::copy(src, src + g.h, xb + (p - lo) * g.h);
  }
}

// The experts in descending order of their row counts: handed out first, the largest tasks do not end last.
std::vector<int64_t> LargestFirst(const std::vector<int64_t>& offsets, int64_t experts) {
  std::vector<int64_t> ids(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) ids[e] = e;
  std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) {
    return offsets[a + 1] - offsets[a] > offsets[b + 1] - offsets[b];
  });
  return ids;
}

}  // namespace

// The routing weight of each sorted row's slot: [N, k] float32, checked after ReadSwiglu.
std::string CheckWeight(int idx, int* ndims, int64_t** shapes, const Swiglu& g) {
  if (ndims[idx] != 2 || shapes[idx][0] != g.n || shapes[idx][1] != g.k) return "weight must be [N, k]";
  return "";
}

// Every expert's SwiGLU on its rows and the combine. Inputs: tokens [N, H], order [S] (the slot s = token * k +
// choice at each sorted position), wg, wu, wd, group_list, weight [N, k]; outputs: out [N, H], gate [S, I], up
// [S, I] and y [S, H] in sorted order (kept for the gradient). One task per block of an expert's rows runs the
// gather, the three products and the SwiGLU on that block while it is in cache; then each token sums its k rows.
extern "C" int GroupedSwigluCpu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                void* stream, void* extra) {
  Swiglu g;
  std::string err = ReadSwiglu(nparam, 11, 0, 5, params, ndims, shapes, dtypes, &g);
  if (err.empty()) err = CheckWeight(6, ndims, shapes, g);
  if (!err.empty()) return MsdsFail("GroupedSwiglu: " + err);
  const float* weight = static_cast<const float*>(params[6]);
  float* out = static_cast<float*>(params[7]);
  float* gate = static_cast<float*>(params[8]);
  float* up = static_cast<float*>(params[9]);
  float* ys = static_cast<float*>(params[10]);
  int64_t m = g.s, h = g.h, i = g.i;
  const std::vector<int64_t>& offsets = g.offsets;
  std::vector<int64_t> starts, experts_of;  // the tasks: [starts[t], next block or the expert's end)
  for (int64_t e : LargestFirst(offsets, g.e)) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += kRowBlock) {
      starts.push_back(r);
      experts_of.push_back(e);
    }
  }
  ForTasks(static_cast<int64_t>(starts.size()), offsets[g.e], [&](int64_t t) {
    int64_t e = experts_of[t], lo = starts[t], hi = std::min(offsets[e + 1], lo + kRowBlock), rows = hi - lo;
    std::vector<float> xb(static_cast<size_t>(rows * h)), act(static_cast<size_t>(rows * i));
    GatherRows(g, lo, hi, xb.data());
    float *gb = gate + lo * i, *ub = up + lo * i;
    Gemm('N', 'T', rows, i, h, xb.data(), h, g.wg + e * i * h, h, gb, i);
    Gemm('N', 'T', rows, i, h, xb.data(), h, g.wu + e * i * h, h, ub, i);
    for (int64_t p = 0; p < rows * i; ++p) act[p] = gb[p] * Sigmoid(gb[p]) * ub[p];
    Gemm('N', 'T', rows, h, i, act.data(), i, g.wd + e * h * i, i, ys + lo * h, h);
  });
  int64_t used = offsets[g.e];  // rows past the experts' counts: zero gate, up and output
  std::fill(gate + used * i, gate + m * i, 0.0f);
  std::fill(up + used * i, up + m * i, 0.0f);
  std::fill(ys + used * h, ys + m * h, 0.0f);
  std::vector<int64_t> position(static_cast<size_t>(m));  // the sorted position of each slot
  for (int64_t p = 0; p < m; ++p) position[g.order[p]] = p;
  ForTasks((g.n + 31) / 32, g.s, [&](int64_t t) {  // out[n] = sum_j weight[n, j] * y[its slot j]
    for (int64_t n = t * 32, end = std::min(g.n, n + 32); n < end; ++n) {
      float* row = out + n * h;
      std::fill(row, row + h, 0.0f);
      for (int64_t j = 0; j < g.k; ++j) {
        const float* src = ys + position[n * g.k + j] * h;
        float w = weight[n * g.k + j];
        for (int64_t c = 0; c < h; ++c) row[c] += w * src[c];
      }
    }
  });
  return 0;
}

// Its gradient. Inputs: dout [N, H], tokens, order, wg, wu, wd, gate, up, y, group_list, weight; outputs: dtokens
// [N, H] (each token's k rows summed), dwg [E, I, H], dwu [E, I, H], dwd [E, H, I], dweight [N, k]. One task per
// expert (its weight gradients sum over all its rows, so no two tasks write one output): gather its rows and their
// output gradient (weight * dout of the token), recompute the SwiGLU, the three weight gradients and its rows'
// input gradient; then each token sums its k rows and takes its routing weights' gradient dout . y.
extern "C" int GroupedSwigluGradCpu(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                                    void* stream, void* extra) {
  Swiglu g;
  std::string err = ReadSwiglu(nparam, 16, 1, 9, params, ndims, shapes, dtypes, &g);
  if (err.empty()) err = CheckWeight(10, ndims, shapes, g);
  if (err.empty() && (ndims[0] != 2 || shapes[0][0] != g.n || shapes[0][1] != g.h)) err = "dout must be [N, H]";
  if (!err.empty()) return MsdsFail("GroupedSwigluGrad: " + err);
  const float* dout = static_cast<const float*>(params[0]);
  const float* gate = static_cast<const float*>(params[6]);
  const float* up = static_cast<const float*>(params[7]);
  const float* ys = static_cast<const float*>(params[8]);
  const float* weight = static_cast<const float*>(params[10]);
  float* dtokens = static_cast<float*>(params[11]);
  float* dwg = static_cast<float*>(params[12]);
  float* dwu = static_cast<float*>(params[13]);
  float* dwd = static_cast<float*>(params[14]);
  float* dweight = static_cast<float*>(params[15]);
  int64_t m = g.s, h = g.h, i = g.i, k = g.k;
  const std::vector<int64_t>& offsets = g.offsets;
  std::vector<float> dx(static_cast<size_t>(m * h), 0.0f);  // the rows' input gradient, sorted order
  std::vector<int64_t> experts = LargestFirst(offsets, g.e);
  ForTasks(g.e, offsets[g.e], [&](int64_t t) {
    int64_t e = experts[t], r0 = offsets[e], rows = offsets[e + 1] - r0;
    float *dwg_e = dwg + e * i * h, *dwu_e = dwu + e * i * h, *dwd_e = dwd + e * h * i;
    if (rows == 0) {
      std::fill(dwg_e, dwg_e + i * h, 0.0f);
      std::fill(dwu_e, dwu_e + i * h, 0.0f);
      std::fill(dwd_e, dwd_e + h * i, 0.0f);
      return;
    }
    std::vector<float> xb(static_cast<size_t>(rows * h)), dyb(static_cast<size_t>(rows * h));
    std::vector<float> act(static_cast<size_t>(rows * i)), da(static_cast<size_t>(rows * i));
    GatherRows(g, r0, r0 + rows, xb.data());
    for (int64_t p = 0; p < rows; ++p) {  // dy of the row = its routing weight * dout of its token
      int64_t slot = g.order[r0 + p];
      const float* src = dout + slot / k * h;
      float w = weight[slot];
      float* dst = dyb.data() + p * h;
      for (int64_t c = 0; c < h; ++c) dst[c] = w * src[c];
    }
    const float *gb = gate + r0 * i, *ub = up + r0 * i;
    for (int64_t p = 0; p < rows * i; ++p) act[p] = gb[p] * Sigmoid(gb[p]) * ub[p];
    Gemm('T', 'N', h, i, rows, dyb.data(), h, act.data(), i, dwd_e, i);            // dwd_e = dy_e^T act_e
    Gemm('N', 'N', rows, i, h, dyb.data(), h, g.wd + e * h * i, i, da.data(), i);  // da_e = dy_e wd_e
    float *d_gate = da.data(), *d_up = act.data();  // in place: act and da are read no more after this pass
    for (int64_t p = 0; p < rows * i; ++p) {
      float s = Sigmoid(gb[p]), d = da[p];
      d_up[p] = d * gb[p] * s;
      d_gate[p] = d * ub[p] * s * (1.0f + gb[p] * (1.0f - s));  // d silu(g) / dg = s (1 + g (1 - s))
    }
    Gemm('T', 'N', i, h, rows, d_gate, i, xb.data(), h, dwg_e, h);  // dwg_e = dgate_e^T x_e
    Gemm('T', 'N', i, h, rows, d_up, i, xb.data(), h, dwu_e, h);    // dwu_e = dup_e^T x_e
    float* dxb = dx.data() + r0 * h;
    Gemm('N', 'N', rows, h, i, d_gate, i, g.wg + e * i * h, h, dxb, h);
    Gemm('N', 'N', rows, h, i, d_up, i, g.wu + e * i * h, h, dxb, h, 1.0f);
  });
  std::vector<int64_t> position(static_cast<size_t>(m));  // the sorted position of each slot
  for (int64_t p = 0; p < m; ++p) position[g.order[p]] = p;
  const float* dxs = dx.data();
  ForTasks((g.n + 31) / 32, g.s, [&](int64_t t) {  // per token: its k rows summed, its routing weights' gradient
    for (int64_t n = t * 32, end = std::min(g.n, n + 32); n < end; ++n) {
      float* row = dtokens + n * h;
      const float* dn = dout + n * h;
      std::fill(row, row + h, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        int64_t p = position[n * k + j];
        const float *src = dxs + p * h, *y = ys + p * h;
        float dot = 0.0f;
        for (int64_t c = 0; c < h; ++c) {
          row[c] += src[c];
          dot += dn[c] * y[c];
        }
        dweight[n * k + j] = dot;
      }
    }
  });
  return 0;
}
