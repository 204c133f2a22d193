// Our plain GEMM (fixed mainloop, empty epilogue) vs cuBLAS on the GEMM shapes of docs/math.md §7,
// side by side in one process. --sweep times every compiled configuration and scheduler option
// (swizzle x raster) per shape; otherwise the heuristic's pick. Each of our outputs is compared
// with cuBLAS's before any time is reported. --operands picks the layout: XWt (the forward
// projections, default), XW (the backward's data gradients, D = dY·W, M = tokens) or XtY (the
// weight gradients, D = Xᵀ·Y, K = tokens).
//
//   coda_gemm_bench [--operands XWt|XW|XtY] [--sweep] [--sustained] [--quick] [--model NAME]
//                   [--json results.json] [--command "..."] [--commit sha]
//
// --sustained: per shape, also every compiled configuration (each checked against cuBLAS) at the
// heuristic's tile order and at swizzle 8 along N / M and 1 along M, and cuBLAS, timed under
// sustained load (Timer::median_ms_sustained: back-to-back batches, alternating), as a training
// loop runs them at the H200's power limit; rows with "kind": "sustained".

#include <cublasLt.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "coda/kernel/args.hpp"
#include "coda/kernel/aux_kernels.hpp"
#include "coda/kernel/runtime.hpp"
#include "support/harness.hpp"
#include "support/shapes.hpp"

namespace {

using namespace coda;
using kernel::bf16;

#define CUBLAS_CHECK(expr)                                                                  \
  do {                                                                                      \
    const cublasStatus_t s_ = (expr);                                                       \
    CODA_CHECK(s_ == CUBLAS_STATUS_SUCCESS, #expr, " failed with cuBLAS status ", int(s_)); \
  } while (0)

struct Shape {
  std::string model, op;
  int m, n, k;
};

using kernel::Operands;

std::vector<Shape> shapes(bool quick, Operands o) {
  std::vector<Shape> out;
  for (int m : bench::kTokenCounts) {
    for (const auto& md : bench::kLlama3Models) {
      const int q = md.q_heads * md.head_dim;
      if (o == Operands::kXWt) {
        out.push_back({md.name, "out_proj", m, md.hidden, q});
        out.push_back({md.name, "gate_up", m, 2 * md.ffn, md.hidden});
        out.push_back({md.name, "down_proj", m, md.hidden, md.ffn});
        out.push_back({md.name, "qkv", m, md.qkv_width(), md.hidden});
        out.push_back({md.name, "lm_head", m, bench::kLlama3Vocab, md.hidden});
      } else if (o == Operands::kXW) {  // each projection's data gradient dY·W
        out.push_back({md.name, "d_out_proj", m, q, md.hidden});
        out.push_back({md.name, "d_gate_up", m, md.hidden, 2 * md.ffn});
        out.push_back({md.name, "d_down_proj", m, md.ffn, md.hidden});
        out.push_back({md.name, "d_qkv", m, md.hidden, md.qkv_width()});
      } else {  // each projection's weight gradient dYᵀ·X: the weight's (rows, columns), K = m
        out.push_back({md.name, "dW_out_proj", md.hidden, q, m});
        out.push_back({md.name, "dW_gate_up", 2 * md.ffn, md.hidden, m});
        out.push_back({md.name, "dW_down_proj", md.hidden, md.ffn, m});
        out.push_back({md.name, "dW_qkv", md.qkv_width(), md.hidden, m});
      }
    }
    if (quick) break;
  }
  if (o == Operands::kXWt) out.push_back({"square", "8192^3", 8192, 8192, 8192});
  return out;
}

class Cublas {
 public:
  Cublas() {
    CUBLAS_CHECK(cublasLtCreate(&lt_));
    CODA_CUDA_CHECK(cudaMalloc(&ws_, kWorkspace));
  }
  ~Cublas() {
    cudaFree(ws_);
    cublasLtDestroy(lt_);
  }
  // D (M, N) row-major is column-major D^T (N, M) = op(A) · op(B) to cuBLAS, with A the weight
  // side (W or Y) and B the X side, as torch calls it; cuBLASLt's top heuristic, 32 MiB workspace:
  //   XWt: X (M, K) · W (N, K)ᵀ       -> op_T(W as K x N) · (X as K x M)
  //   XW:  X (M, K) · W (K, N)        -> (W as N x K) · (X as K x M)
  //   XtY: X (K, M)ᵀ · Y (K, N)       -> (Y as N x K) · op_T(X as M x K)
  void gemm(Operands o, const bf16* x, const bf16* w, bf16* d, int m, int n, int k,
            cudaStream_t s) {
    Plan& p = plan(o, m, n, k);
    const float alpha = 1.f, beta = 0.f;
    CUBLAS_CHECK(cublasLtMatmul(lt_, p.op, &alpha, w, p.a, x, p.b, &beta, d, p.c, d, p.c, &p.algo,
                                ws_, kWorkspace, s));
  }

 private:
  static constexpr size_t kWorkspace = size_t(32) << 20;
  struct Plan {
    Operands o = Operands::kXWt;
    int m = 0, n = 0, k = 0;
    cublasLtMatmulDesc_t op{};
    cublasLtMatrixLayout_t a{}, b{}, c{};
    cublasLtMatmulAlgo_t algo{};
  };
  Plan& plan(Operands o, int m, int n, int k) {
    for (Plan& p : plans_)
      if (p.o == o && p.m == m && p.n == n && p.k == k) return p;
    Plan p;
    p.o = o, p.m = m, p.n = n, p.k = k;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = o == Operands::kXWt ? CUBLAS_OP_T : CUBLAS_OP_N,
                            tb = o == Operands::kXtY ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    if (o == Operands::kXWt)
      CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, k, n, k));
    else
      CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, n, k, n));
    if (o == Operands::kXtY)
      CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, m, k, m));
    else
      CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k, m, k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, n, m, n));
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspace, sizeof(kWorkspace)));
    cublasLtMatmulHeuristicResult_t r{};
    int found = 0;
    CUBLAS_CHECK(
        cublasLtMatmulAlgoGetHeuristic(lt_, p.op, p.a, p.b, p.c, p.c, pref, 1, &r, &found));
    CODA_CHECK(found > 0, "cuBLASLt found no algorithm for ", m, "x", n, "x", k);
    p.algo = r.algo;
    cublasLtMatmulPreferenceDestroy(pref);
    plans_.push_back(p);
    return plans_.back();
  }
  cublasLtHandle_t lt_{};
  void* ws_ = nullptr;
  std::vector<Plan> plans_;
};

const char* gpu_missing() {
  static std::string why;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return (why = "no CUDA device").c_str();
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  if (p.major != 9) return (why = std::string(p.name) + " is not a Hopper (sm_90) GPU").c_str();
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  auto args = bench::parse_args(argc, argv);
  if (const char* why = gpu_missing()) {
    std::printf("coda_gemm_bench: %s; nothing to measure\n", why);
    return 0;
  }
  const bool sweep = args.count("sweep"), quick = args.count("quick");
  bench::Timer timer;
  Cublas cublas;
  std::vector<bench::JsonRow> rows;
  float* diff = nullptr;
  CODA_CUDA_CHECK(cudaMalloc(&diff, 2 * sizeof(float)));

  const std::string ops_name = args.count("operands") ? args["operands"] : "XWt";
  const Operands ops = ops_name == "XWt"   ? Operands::kXWt
                       : ops_name == "XW"  ? Operands::kXW
                       : ops_name == "XtY" ? Operands::kXtY
                                           : throw std::invalid_argument(
                                                 "coda_gemm_bench: --operands must be XWt, XW or "
                                                 "XtY, got " +
                                                 ops_name);
  const std::string only_model = args.count("model") ? args["model"] : "";
  std::vector<kernel::Config> configs;
  for (int c = 0; c < int(kernel::Config::kCount); ++c)
    if (kernel::find_kernel(kernel::Program::kPlain, kernel::Config(c), ops))
      configs.push_back(kernel::Config(c));
  std::vector<kernel::SchedulerOptions> scheds;
  for (int sw : {1, 2, 4, 8})
    for (auto ra : {kernel::Raster::kAlongM, kernel::Raster::kAlongN}) scheds.push_back({sw, ra});

  std::printf("%-11s %-9s %6s %6s %6s | %8s %7s | %8s %7s %6s | %s\n", "model", "op", "M", "N", "K",
              "cuBLAS", "TF/s", "ours", "TF/s", "ratio", "config");
  double log_sum = 0, worst = 1e9;
  int counted = 0;
  auto write_json = [&](double geo, double worst_ratio, int n) {
    bench::JsonRow header;
    header.set("benchmark", "plain_gemm_vs_cublas")
        .set("device", bench::device_description())
        .set("commit", args.count("commit") ? args["commit"] : "unknown")
        .set("command", args.count("command") ? args["command"] : "coda_gemm_bench")
        .set("operands", ops_name)
        .set("geomean_ratio", geo)
        .set("worst_ratio", worst_ratio)
        .set("shapes", n);
    bench::write_results(args["json"], header, rows);
  };
  for (const Shape& s : shapes(quick, ops)) {
    if (!only_model.empty() && s.model != only_model) continue;
    const size_t na = size_t(s.m) * s.k, nw = size_t(s.n) * s.k, nd = size_t(s.m) * s.n;
    bf16 *x, *w, *d_ref, *d;
    CODA_CUDA_CHECK(cudaMalloc(&x, na * 2));
    CODA_CUDA_CHECK(cudaMalloc(&w, nw * 2));
    CODA_CUDA_CHECK(cudaMalloc(&d_ref, nd * 2));
    CODA_CUDA_CHECK(cudaMalloc(&d, nd * 2));
    kernel::fill_uniform_bf16(x, na, 11 + s.m, -1.f, 1.f, nullptr);
    kernel::fill_uniform_bf16(w, nw, 12 + s.n, -1.f, 1.f, nullptr);
    const double flop = 2.0 * s.m * s.n * s.k;
    const double t_cublas =
        timer.median_ms([&](cudaStream_t st) { cublas.gemm(ops, x, w, d_ref, s.m, s.n, s.k, st); });
    // Leading dimensions: X (M, K) or, for XtY, (K, M); W (N, K), or (K, N) for XW and XtY.
    const int64_t ldx = ops == Operands::kXtY ? s.m : s.k, ldw = ops == Operands::kXWt ? s.k : s.n;
    const kernel::GemmProblem prob{s.m, s.n, s.k, x, ldx, w, ldw, nullptr, 0, d, s.n};
    kernel::PlainArgs plain;

    auto time_ours = [&](kernel::Config c, kernel::SchedulerOptions so, int reps = 15) -> double {
      const kernel::LaunchFn fn = kernel::find_kernel(kernel::Program::kPlain, c, ops);
      CODA_CUDA_CHECK(cudaMemset(d, 0xff, nd * 2));
      CODA_CUDA_CHECK(fn(prob, &plain, so, nullptr));
      kernel::max_abs_diff_bf16(d, d_ref, nd, diff, nullptr);
      float h[2];
      CODA_CUDA_CHECK(cudaMemcpy(h, diff, sizeof(h), cudaMemcpyDeviceToHost));
      // bf16 outputs of two fp32-accumulated GEMMs differ by a few output ulps at most.
      if (!(h[0] <= 0.02f * h[1])) {
        std::printf("FAIL %s %s %s: max|ours - cuBLAS| = %g (max|cuBLAS| = %g)\n", s.model.c_str(),
                    s.op.c_str(), kernel::config_name(c), h[0], h[1]);
        return NAN;
      }
      return timer.median_ms([&](cudaStream_t st) { CODA_CUDA_CHECK(fn(prob, &plain, so, st)); }, 2,
                             reps);
    };

    const kernel::KernelChoice pick =
        kernel::select_kernel(kernel::Program::kPlain, ops, {s.m, s.n, s.k});
    kernel::Config best_c = pick.config;
    kernel::SchedulerOptions best_s = pick.scheduler;
    double best = NAN, t_pick = NAN;  // sweep: the fastest, and the heuristic's pick
    struct Swept {
      double ms;
      kernel::Config c;
      kernel::SchedulerOptions so;
    };
    std::vector<Swept> swept;
    auto is_pick = [&](kernel::Config c, kernel::SchedulerOptions so) {
      return c == pick.config && so.swizzle == pick.scheduler.swizzle &&
             so.raster == pick.scheduler.raster;
    };
    // One timed option of this shape, as a results row.
    auto option_row = [&](const char* kind, kernel::Config c, kernel::SchedulerOptions so,
                          double ms, double cublas_ms) {
      return bench::JsonRow()
          .set("kind", kind)
          .set("model", s.model)
          .set("op", s.op)
          .set("operands", ops_name)
          .set("m", s.m)
          .set("n", s.n)
          .set("k", s.k)
          .set("config", kernel::config_name(c))
          .set("swizzle", so.swizzle)
          .set("raster", bench::raster_name(so.raster))
          .set("ms", ms)
          .set("cublas_ms", cublas_ms);
    };
    if (sweep) {
      for (kernel::Config c : configs)
        for (const auto& so : scheds) {
          const double t = time_ours(c, so, 7);
          rows.push_back(option_row("sweep", c, so, t, t_cublas));
          if (t == t) swept.push_back({t, c, so});
          if (t == t && !(t >= best)) best = t, best_c = c, best_s = so;
          if (is_pick(c, so)) t_pick = t;
        }
    }
    // The reported row: the chosen configuration timed interleaved with cuBLAS.
    const double t_check = time_ours(best_c, best_s, 3);  // correctness check (NaN on FAIL)
    double t_cublas2 = NAN, t_ours2 = NAN;
    if (t_check == t_check) {
      const kernel::LaunchFn fn = kernel::find_kernel(kernel::Program::kPlain, best_c, ops);
      std::tie(t_cublas2, t_ours2) = timer.median_ms_interleaved(
          [&](cudaStream_t st) { cublas.gemm(ops, x, w, d_ref, s.m, s.n, s.k, st); },
          [&](cudaStream_t st) { CODA_CUDA_CHECK(fn(prob, &plain, best_s, st)); });
    }
    const double ratio = t_cublas2 / t_ours2;
    std::printf("%-11s %-9s %6d %6d %6d | %8.3f %7.1f | %8.3f %7.1f %6.3f | %s sw%d %s\n",
                s.model.c_str(), s.op.c_str(), s.m, s.n, s.k, t_cublas2, flop / t_cublas2 / 1e9,
                t_ours2, flop / t_ours2 / 1e9, ratio, kernel::config_name(best_c), best_s.swizzle,
                bench::raster_name(best_s.raster));
    if (sweep)
      std::printf("%-11s %-9s   heuristic %s sw%d %s: %.3f ms in the sweep, %.3f x the fastest\n",
                  s.model.c_str(), s.op.c_str(), kernel::config_name(pick.config),
                  pick.scheduler.swizzle, bench::raster_name(pick.scheduler.raster), t_pick,
                  t_pick / best);
    if (sweep && !swept.empty() && t_check == t_check) {
      // One sequential pass of 7 repeats per option drifts with the clock: the heuristic's pick
      // and the sweep's three fastest options are timed again, round-robin with cuBLAS.
      std::sort(swept.begin(), swept.end(),
                [](const Swept& a, const Swept& b) { return a.ms < b.ms; });
      std::vector<Swept> finalists{{t_pick, pick.config, pick.scheduler}};
      for (const Swept& cand : swept) {
        if (finalists.size() == 4) break;
        if (!is_pick(cand.c, cand.so)) finalists.push_back(cand);
      }
      std::vector<std::function<void(cudaStream_t)>> fns{
          [&](cudaStream_t st) { cublas.gemm(ops, x, w, d_ref, s.m, s.n, s.k, st); }};
      for (const Swept& f : finalists) {
        const kernel::LaunchFn fn = kernel::find_kernel(kernel::Program::kPlain, f.c, ops);
        const kernel::SchedulerOptions so = f.so;
        fns.push_back([&prob, &plain, fn, so](cudaStream_t st) {
          CODA_CUDA_CHECK(fn(prob, &plain, so, st));
        });
      }
      const std::vector<double> med = timer.median_ms_interleaved(fns, 2, 15);
      for (size_t j = 0; j < finalists.size(); ++j) {
        const Swept& f = finalists[j];
        const char* ra = bench::raster_name(f.so.raster);
        std::printf(
            "%-11s %-9s   round-robin %s %s sw%d %s: %.3f ms, %.3f x the pick, cuBLAS %.3f\n",
            s.model.c_str(), s.op.c_str(), j == 0 ? "pick" : "cand", kernel::config_name(f.c),
            f.so.swizzle, ra, med[j + 1], med[j + 1] / med[1], med[0]);
        rows.push_back(option_row("round_robin", f.c, f.so, med[j + 1], med[0])
                           .set("heuristic_pick", j == 0 ? 1.0 : 0.0));
      }
    }
    if (args.count("sustained") && t_check == t_check) {
      struct Option {
        kernel::Config c;
        kernel::SchedulerOptions so;
      };
      std::vector<Option> options;
      for (kernel::Config c : configs)
        for (kernel::SchedulerOptions so :
             {pick.scheduler, kernel::SchedulerOptions{8, kernel::Raster::kAlongN},
              kernel::SchedulerOptions{8, kernel::Raster::kAlongM},
              kernel::SchedulerOptions{1, kernel::Raster::kAlongM}}) {
          bool seen = false;
          for (const Option& o : options)
            seen |= o.c == c && o.so.swizzle == so.swizzle && o.so.raster == so.raster;
          if (seen) continue;
          const double checked = time_ours(c, so, 1);  // NaN where the output check fails
          if (checked == checked) options.push_back({c, so});
        }
      std::vector<std::function<void(cudaStream_t)>> fns{
          [&](cudaStream_t st) { cublas.gemm(ops, x, w, d_ref, s.m, s.n, s.k, st); }};
      for (const Option& o : options) {
        const kernel::LaunchFn fn = kernel::find_kernel(kernel::Program::kPlain, o.c, ops);
        fns.push_back([&prob, &plain, fn, so = o.so](cudaStream_t st) {
          CODA_CUDA_CHECK(fn(prob, &plain, so, st));
        });
      }
      const std::vector<double> flushed = timer.median_ms_interleaved(fns, 2, 11);
      const std::vector<double> sustained = timer.median_ms_sustained(fns);
      std::printf("%-11s %-9s   sustained: cuBLAS flushed %.3f sustained %.3f ms\n",
                  s.model.c_str(), s.op.c_str(), flushed[0], sustained[0]);
      for (size_t j = 0; j < options.size(); ++j) {
        const Option& o = options[j];
        std::printf("%-11s %-9s   %c %-22s sw%d %s: flushed %.3f (%.3f x cuBLAS) sustained %.3f "
                    "(%.3f x cuBLAS)\n",
                    s.model.c_str(), s.op.c_str(), is_pick(o.c, o.so) ? '*' : ' ',
                    kernel::config_name(o.c), o.so.swizzle, bench::raster_name(o.so.raster),
                    flushed[j + 1], flushed[j + 1] / flushed[0], sustained[j + 1],
                    sustained[j + 1] / sustained[0]);
        rows.push_back(option_row("sustained", o.c, o.so, sustained[j + 1], sustained[0])
                           .set("flushed_ms", flushed[j + 1])
                           .set("cublas_flushed_ms", flushed[0])
                           .set("heuristic_pick", is_pick(o.c, o.so) ? 1.0 : 0.0));
      }
    }
    std::fflush(stdout);
    rows.push_back(option_row("best", best_c, best_s, t_ours2, t_cublas2)
                       .set("heuristic_config", kernel::config_name(pick.config))
                       .set("heuristic_swizzle", pick.scheduler.swizzle)
                       .set("heuristic_raster", bench::raster_name(pick.scheduler.raster))
                       .set("heuristic_sweep_ms", t_pick)
                       .set("tflops", flop / t_ours2 / 1e9)
                       .set("cublas_tflops", flop / t_cublas2 / 1e9)
                       .set("ratio_vs_cublas", ratio));
    if (ratio == ratio) {
      log_sum += std::log(ratio);
      worst = std::min(worst, ratio);
      ++counted;
    }
    cudaFree(x);
    cudaFree(w);
    cudaFree(d_ref);
    cudaFree(d);
    if (args.count("json"))
      write_json(std::exp(log_sum / counted), worst, counted);  // survives a kill
  }
  const double geo = counted ? std::exp(log_sum / counted) : NAN;
  std::printf("\nplain GEMM vs cuBLAS over %d shapes: geometric mean %.3f, worst %.3f\n", counted,
              geo, worst);
  if (args.count("json")) write_json(geo, worst, counted);
  cudaFree(diff);
  return 0;
}
