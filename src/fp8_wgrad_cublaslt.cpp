// The weight gradient's FP8 GEMM (d = x·yᵀ over the tokens from the transposed copies, both
// operands 1x128 along them) on
// cuBLASLt's blockwise-scaled GEMM, the alternative backend of ops::gemm_fp8_xyt. Our CUTLASS
// weight-gradient kernel runs at ~0.90x of cuBLASLt there (docs/status.md: the per-column B scales
// make each K block's promotion an outer product the mainloop does not overlap), while the weight
// gradient has no epilogue to fuse. Chosen by ops::set_fp8_wgrad_backend or CODA_FP8_WGRAD.
//
// The problem in cuBLASLt's column-major terms: D (M x N, row-major, row stride ldd) is Dᵀ
// (N x M, column-major, ld ldd) = op(A)·op(B) with A = Y's codes (stored N rows of K: K x N
// column-major, transposed: TRANSA = T) and B = X's codes (K x M column-major, TRANSB = N): the
// "TN" layout FP8 tensor-core GEMMs take. VEC128_32F scales are one fp32 per 128 elements along K,
// outer index fastest with a leading dimension of exactly the outer extent: ours when the scales'
// row stride equals the operand's rows (the casts and epilogues write them so).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "coda/common/check.hpp"
#include "coda/ops.hpp"
#include "ops_internal.hpp"

namespace coda::ops::detail {
namespace {

// The largest power of two up to 256 that divides the address: the heuristic's alignment hint.
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

// One problem's cuBLASLt objects (descriptor, layouts, the algorithm the heuristic chose), kept
// per shape, device and alignment: building them and asking the heuristic costs tens of
// microseconds of host time per call otherwise. The scale pointers change with every call and are
// set on the descriptor under the lock. A failure at any step leaves `why_not` (the plan is then
// never used again: gemm_fp8_xyt falls back to ours, or with cublaslt-only raises it).
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, cd = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::string why_not;  // empty: usable
};
using PlanKey = std::tuple<int, int, int, int, int64_t, int64_t, int64_t, bool, uint32_t, uint32_t,
                           uint32_t>;

struct State {
  std::mutex mutex;
  std::map<int, cublasLtHandle_t> handles;  // per device (nullptr: cublasLtCreate failed)
  std::map<PlanKey, Plan> plans;
};
State& state() {
  static State* s = new State;  // never destroyed: handles outlive static destruction order
  return *s;
}

std::string failed(const char* what, cublasStatus_t status) {
  return std::string(what) + " failed with cuBLAS status " + std::to_string(int(status));
}

cublasLtHandle_t handle_for(State& s, int device) {
  auto it = s.handles.find(device);
  if (it != s.handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  if (cublasLtCreate(&h) != CUBLAS_STATUS_SUCCESS) h = nullptr;
  s.handles.emplace(device, h);
  return h;
}

// Each step in order; the first that fails names itself in plan.why_not.
void build_plan(Plan& plan, cublasLtHandle_t h, const kernel::GemmProblem& p, int64_t ldd,
                bool accumulate, const void* d) {
  auto ok = [&](cublasStatus_t status, const char* what) {
    if (status == CUBLAS_STATUS_SUCCESS) return true;
    plan.why_not = failed(what, status);
    return false;
  };
  const cudaDataType_t out = accumulate ? CUDA_R_32F : CUDA_R_16BF;
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  if (!ok(cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate") ||
      !ok(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
          "TRANSA") ||
      !ok(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
          "TRANSB") ||
      !ok(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode,
                                         sizeof(mode)),
          "A_SCALE_MODE (VEC128_32F)") ||
      !ok(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode,
                                         sizeof(mode)),
          "B_SCALE_MODE (VEC128_32F)") ||
      // The heuristic checks the scale pointers are set: this call's, replaced before each use.
      !ok(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                         &p.scale_b, sizeof(p.scale_b)),
          "A_SCALE_POINTER") ||
      !ok(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                         &p.scale_a, sizeof(p.scale_a)),
          "B_SCALE_POINTER") ||
      !ok(cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_8F_E4M3, p.k, p.n, p.ldb), "layout of y") ||
      !ok(cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_8F_E4M3, p.k, p.m, p.lda), "layout of x") ||
      !ok(cublasLtMatrixLayoutCreate(&plan.cd, out, p.n, p.m, ldd), "layout of d"))
    return;
  cublasLtMatmulPreference_t pref = nullptr;
  if (!ok(cublasLtMatmulPreferenceCreate(&pref), "MatmulPreferenceCreate")) return;
  // No workspace: the op path allocates nothing (CUDA graph capture, no host syncs), and the
  // weight-gradient GEMMs are large enough that split-K / stream-K variants do not pay.
  const uint64_t workspace = 0;
  const uint32_t al_a = alignment(p.b), al_b = alignment(p.a), al_d = alignment(d);
  const struct {
    cublasLtMatmulPreferenceAttributes_t attr;
    const void* value;
    size_t size;
    const char* name;
  } prefs[] = {
      {CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace), "MAX_WORKSPACE"},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a), "MIN_ALIGNMENT_A"},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b), "MIN_ALIGNMENT_B"},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof(al_d), "MIN_ALIGNMENT_C"},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d), "MIN_ALIGNMENT_D"}};
  bool set = true;
  for (const auto& a : prefs)
    set = set && ok(cublasLtMatmulPreferenceSetAttribute(pref, a.attr, a.value, a.size), a.name);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (set && ok(cublasLtMatmulAlgoGetHeuristic(h, plan.op, plan.a, plan.b, plan.cd, plan.cd, pref,
                                               1, &result, &found),
                "MatmulAlgoGetHeuristic")) {
    if (found > 0)
      plan.algo = result.algo;
    else
      plan.why_not = accumulate ? "cuBLASLt has no algorithm for it with an fp32 D (accumulate)"
                                : "cuBLASLt has no algorithm for it";
  }
  cublasLtMatmulPreferenceDestroy(pref);
}

}  // namespace

const char* gemm_fp8_xyt_cublaslt(const kernel::GemmProblem& p, void* d, int64_t ldd,
                                  bool accumulate, cudaStream_t stream) {
  // cuBLASLt reads VEC128 scales with the operand's rows as their leading dimension.
  if (p.ld_scale_a != p.m || p.ld_scale_b != p.n)
    return "its VEC128 scales need a row stride of exactly the operand's rows";
  int device = 0;
  const cudaError_t e = cudaGetDevice(&device);
  CODA_CHECK(e == cudaSuccess, "coda::ops::gemm_fp8_xyt (cuBLASLt): cudaGetDevice failed: ",
             cudaGetErrorString(e));
  State& s = state();
  const std::lock_guard<std::mutex> lock(s.mutex);
  const cublasLtHandle_t h = handle_for(s, device);
  if (h == nullptr) return "cublasLtCreate failed on this device";
  const PlanKey key{device, p.m, p.n, p.k, p.lda, p.ldb, ldd, accumulate, alignment(p.a),
                    alignment(p.b), alignment(d)};
  auto [it, made] = s.plans.try_emplace(key);
  Plan& plan = it->second;
  if (made) build_plan(plan, h, p, ldd, accumulate, d);
  if (!plan.why_not.empty()) return plan.why_not.c_str();
  // The descriptor is shared by the calls of one plan: set and used under the lock.
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  cublasStatus_t st = cublasLtMatmulDescSetAttribute(
      plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p.scale_b, sizeof(p.scale_b));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                        &p.scale_a, sizeof(p.scale_a));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmul(h, plan.op, &alpha, p.b, plan.a, p.a, plan.b, &beta, d, plan.cd, d,
                        plan.cd, &plan.algo, nullptr, 0, stream);
  if (st != CUBLAS_STATUS_SUCCESS) {  // nothing launched: this plan is not used again
    plan.why_not = failed("cublasLtMatmul", st);
    return plan.why_not.c_str();
  }
  return nullptr;
}

}  // namespace coda::ops::detail

namespace coda::ops {
namespace {
int backend_from_environment() {
  const char* v = std::getenv("CODA_FP8_WGRAD");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "cublaslt") == 0)
    return int(Fp8WgradBackend::kCublasLt);
  if (std::strcmp(v, "cutlass") == 0) return int(Fp8WgradBackend::kCutlass);
  CODA_CHECK(std::strcmp(v, "cublaslt-only") == 0,
             "CODA_FP8_WGRAD must be 'cutlass', 'cublaslt' or 'cublaslt-only', got '", v, "'");
  return int(Fp8WgradBackend::kCublasLtOnly);
}
detail::ProcessSetting g_backend(backend_from_environment);
}  // namespace

Fp8WgradBackend fp8_wgrad_backend() { return Fp8WgradBackend(g_backend.get()); }
void set_fp8_wgrad_backend(Fp8WgradBackend backend) { g_backend.set(int(backend)); }
}  // namespace coda::ops
