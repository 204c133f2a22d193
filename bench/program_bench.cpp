// Each fused program (forward F1-F4, backward B1-B2) vs our plain GEMM of the same shape,
// operand layout and configuration (the epilogue's cost), at the LLaMA-3 shapes of docs/math.md
// §7, and F3 with and without QK-norm at Qwen3's QKV projections. Every fused output is
// spot-checked against an fp64 host computation at random positions before its time is reported.
//
//   coda_program_bench [--quick] [--json results.json] [--commit sha] [--command "..."]
//                      [--only MODEL:OP] [--op OP] [--m M] [--config NAME] [--swizzle S]
//                      [--raster M|N] [--unchecked] [--sweep-sustained]
//
// --sweep-sustained: per case, every compiled configuration of the program (each spot-checked
// first, at the heuristic's tile order) under the scheduler orders the GPU tests run and check
// (swizzle 1, 8 along M, 8 along N, 4 along M) and the heuristic's own, plus our plain GEMM as
// the op layer would run it, all timed two ways in one process: single runs after an L2 flush,
// round-robin (docs/math.md §7), and under sustained load (Timer::median_ms_sustained:
// back-to-back batches, alternating). Rows carry "mode": "sweep"; "*" marks the heuristic's pick
// (its configuration and order, without --swizzle / --raster).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "coda/kernel/args.hpp"
#include "coda/kernel/aux_kernels.hpp"
#include "coda/kernel/runtime.hpp"
#include "coda/ops.hpp"
#include "coda/programs/rope.hpp"
#include "support/harness.hpp"
#include "support/shapes.hpp"

namespace {

using namespace coda;
using kernel::bf16;
using kernel::Config;
using kernel::Program;

struct Case {
  std::string model, op;
  Program program;
  int m, n, k;
  int heads = 0, kv_heads = 0, head_dim = 0;  // F3 and F3q only
  kernel::Operands operands = kernel::Operands::kXWt;
};

constexpr int kLmHeadChunk = 2048;

std::vector<Case> cases(bool quick) {
  std::vector<Case> out;
  for (int m : bench::kTokenCounts) {
    for (const auto& md : bench::kLlama3Models) {
      out.push_back({md.name, "out_proj+F1", Program::kResidualRmsnormPartial, m, md.hidden,
                     md.q_heads * md.head_dim});
      out.push_back({md.name, "gate_up+F2", Program::kRmsnormSwiglu, m, 2 * md.ffn, md.hidden});
      out.push_back(
          {md.name, "down_proj+F1", Program::kResidualRmsnormPartial, m, md.hidden, md.ffn});
      out.push_back({md.name, "qkv+F3", Program::kRmsnormRope, m, md.qkv_width(), md.hidden,
                     md.q_heads, md.kv_heads, md.head_dim});
      out.push_back(
          {md.name, "lm_head+F4", Program::kRmsnormLse, m, bench::kLlama3Vocab, md.hidden});
      // The LM head's three-GEMM path runs per chunk of 2048 tokens (the default 1 GiB budget at
      // V = 128256; block::lm_head_loss_grad): F4 storing the logits, and B1 with
      // K = the vocabulary; once per model, at the chunk's M.
      if (m == bench::kTokenCounts[0])
        out.push_back({md.name, "lm_head+F4logits", Program::kRmsnormLseLogits, kLmHeadChunk,
                       bench::kLlama3Vocab, md.hidden});
      // Backward: da = dx_out · W_down (B2, N = I pairs); g = dz · W (B1) for gate/up and QKV.
      const auto xw = kernel::Operands::kXW;
      out.push_back({md.name, "down_bwd+B2", Program::kSwigluBackward, m, md.ffn, md.hidden, 0, 0,
                     0, xw});
      out.push_back({md.name, "gate_up_bwd+B1", Program::kRmsnormBackward, m, md.hidden,
                     2 * md.ffn, 0, 0, 0, xw});
      out.push_back({md.name, "qkv_bwd+B1", Program::kRmsnormBackward, m, md.hidden,
                     md.qkv_width(), 0, 0, 0, xw});
      if (m == bench::kTokenCounts[0])
        out.push_back({md.name, "lm_head_bwd+B1", Program::kRmsnormBackward, kLmHeadChunk,
                       md.hidden, bench::kLlama3Vocab, 0, 0, 0, xw});
    }
    for (const auto& md : bench::kQwen3Models)
      for (Program p : {Program::kRmsnormRope, Program::kRmsnormQkNormRope})
        out.push_back({md.name, p == Program::kRmsnormRope ? "qkv+F3" : "qkv+F3q", p, m,
                       md.qkv_width(), md.hidden, md.q_heads, md.kv_heads, md.head_dim});
    if (quick) break;
  }
  return out;
}

float bf(const bf16& v) { return __bfloat162float(v); }

template <class T>
std::vector<T> download(const T* p, size_t offset, size_t n) {
  std::vector<T> h(n);
  CODA_CUDA_CHECK(cudaMemcpy(h.data(), p + offset, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// (A·Wᵀ)[m, n] with W (N, K); or (A·W)[m, n] with W (K, N) when n_cols (= N) is given.
double dot_row(const bf16* a, const bf16* w, int m, int n, int k, int n_cols = 0) {
  const auto ar = download(a, size_t(m) * k, k);
  std::vector<bf16> wr(k);
  if (n_cols) {  // column n of a (K, N) row-major W: one strided copy
    CODA_CUDA_CHECK(cudaMemcpy2D(wr.data(), sizeof(bf16), w + n, size_t(n_cols) * sizeof(bf16),
                                 sizeof(bf16), k, cudaMemcpyDeviceToHost));
  } else {
    wr = download(w, size_t(n) * k, k);
  }
  double s = 0;
  for (int i = 0; i < k; ++i) s += double(bf(ar[i])) * double(bf(wr[i]));
  return s;
}

struct Candidate {
  const char* config;
  kernel::SchedulerOptions order;
  bool chosen;  // the heuristic's configuration and order
  std::function<void(cudaStream_t)> run;
};

// The tile orders the sweep times: those the GPU tests cover, and the heuristic's own.
std::vector<kernel::SchedulerOptions> sweep_orders(const kernel::SchedulerOptions& heuristic) {
  std::vector<kernel::SchedulerOptions> v = {heuristic};
  for (kernel::SchedulerOptions o : {kernel::SchedulerOptions{1, kernel::Raster::kAlongM},
                                     kernel::SchedulerOptions{8, kernel::Raster::kAlongM},
                                     kernel::SchedulerOptions{8, kernel::Raster::kAlongN},
                                     kernel::SchedulerOptions{4, kernel::Raster::kAlongM}})
    if (o.swizzle != heuristic.swizzle || o.raster != heuristic.raster) v.push_back(o);
  return v;
}

// |got − want| within bf16 output rounding plus fp32-accumulation slack.
bool close(double got, double want) { return std::abs(got - want) <= 1e-2 * std::abs(want) + 2e-2; }

}  // namespace

int main(int argc, char** argv) {
  auto args = bench::parse_args(argc, argv);
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("coda_program_bench: no CUDA device; nothing to measure\n");
    return 0;
  }
  bench::Timer timer;
  std::vector<bench::JsonRow> rows;
  bench::JsonRow header;
  header.set("benchmark", "fused_program_vs_plain_gemm")
      .set("device", bench::device_description())
      .set("commit", args.count("commit") ? args["commit"] : "unknown")
      .set("command", args.count("command") ? args["command"] : "coda_program_bench");
  std::printf("%-11s %-13s %6s %6s %6s | %-22s %8s %8s %7s | check\n", "model", "op", "M", "N", "K",
              "config", "plain", "fused", "ratio");
  uint64_t seed = 1;
  // --only MODEL:OP, --op OP, --m M, --config NAME select cases; --swizzle, --raster override (e.g. to profile one under ncu).
  const std::string only = args.count("only") ? args["only"] : "";
  const std::string only_op = args.count("op") ? args["op"] : "";  // --op A,B: every model
  const int only_m = args.count("m") ? std::stoi(args["m"]) : 0;
  const std::string only_config = args.count("config") ? args["config"] : "";
  for (const Case& c : cases(args.count("quick"))) {
    if (!only.empty() && c.model + ":" + c.op != only) continue;
    if (!only_op.empty() && ("," + only_op + ",").find("," + c.op + ",") == std::string::npos)
      continue;
    if (only_m && c.m != only_m) continue;
    const size_t na = size_t(c.m) * c.k, nw = size_t(c.n) * c.k, nd = size_t(c.m) * c.n;
    const bool xw = c.operands == kernel::Operands::kXW;
    bf16 *a, *w, *d, *res = nullptr, *h = nullptr, *gamma = nullptr, *x = nullptr;
    float *r = nullptr, *part = nullptr, *part2 = nullptr, *tl = nullptr, *zdz = nullptr;
    uint32_t *zpair = nullptr, *dzpair = nullptr;
    int32_t* pos = nullptr;
    int64_t* tgt = nullptr;
    uint32_t *fhi = nullptr, *flo = nullptr;
    bf16 *qk_pre = nullptr, *qk_gamma = nullptr;  // F3q: (M, normed); q then k γ (2 · head_dim)
    const int normed = (c.heads + c.kv_heads) * c.head_dim;
    CODA_CUDA_CHECK(cudaMalloc(&a, na * 2));
    CODA_CUDA_CHECK(cudaMalloc(&w, nw * 2));
    CODA_CUDA_CHECK(cudaMalloc(&d, nd * 2));
    kernel::fill_uniform_bf16(a, na, seed++, -1.f, 1.f, nullptr);
    kernel::fill_uniform_bf16(w, nw, seed++, -1.f / std::sqrt(float(c.k)),
                              1.f / std::sqrt(float(c.k)), nullptr);
    std::vector<float> r_host(c.m);
    for (int i = 0; i < c.m; ++i) r_host[i] = 0.5f + float((i * 7919) % 1000) / 1000.f;
    CODA_CUDA_CHECK(cudaMalloc(&r, c.m * 4));
    CODA_CUDA_CHECK(cudaMemcpy(r, r_host.data(), c.m * 4, cudaMemcpyHostToDevice));
    // Partials are sized for the largest tile count any config uses (tiles >= 128 per side),
    // per row (rows padded, one column per N-tile) or per column (B1's dγ).
    const size_t part_elems = std::max(size_t((c.m + 255) / 256 * 256) * ((c.n + 127) / 128),
                                       size_t((c.n + 255) / 256 * 256) * ((c.m + 127) / 128));
    std::vector<float> zdz_host(c.m);
    for (int i = 0; i < c.m; ++i) zdz_host[i] = 0.05f * float((i * 31) % 7 - 3);
    CODA_CUDA_CHECK(cudaMalloc(&part, part_elems * 4));
    CODA_CUDA_CHECK(cudaMalloc(&part2, part_elems * 4));
    std::vector<programs::RopeFrequency> table;
    std::vector<int32_t> pos_host(c.m);
    std::vector<int64_t> tgt_host(c.m);
    for (int i = 0; i < c.m; ++i) pos_host[i] = i % 8192, tgt_host[i] = (int64_t(i) * 104729) % c.n;

    kernel::PlainArgs plain;
    kernel::ResidualRmsnormPartialArgs f1;
    kernel::RmsnormSwigluArgs f2;
    kernel::RmsnormRopeArgs f3;
    kernel::RmsnormQkNormRopeArgs f3q;
    kernel::RmsnormLseArgs f4;
    kernel::SwigluBackwardArgs b2;
    kernel::RmsnormBackwardArgs b1;
    const void* fargs = nullptr;
    if (c.program == Program::kResidualRmsnormPartial) {
      CODA_CUDA_CHECK(cudaMalloc(&res, nd * 2));
      CODA_CUDA_CHECK(cudaMalloc(&h, nd * 2));
      CODA_CUDA_CHECK(cudaMalloc(&gamma, c.n * 2));
      kernel::fill_uniform_bf16(res, nd, seed++, -1.f, 1.f, nullptr);
      kernel::fill_uniform_bf16(gamma, c.n, seed++, 0.5f, 1.5f, nullptr);
      f1 = {gamma, h, c.n, part};
      fargs = &f1;
    } else if (c.program == Program::kRmsnormSwiglu) {
      CODA_CUDA_CHECK(cudaMalloc(&h, nd));  // (M, N/2) bf16
      f2 = {r, h, c.n / 2};
      fargs = &f2;
    } else if (c.program == Program::kRmsnormRope || c.program == Program::kRmsnormQkNormRope) {
      table = programs::rope_column_table(
          {c.heads, c.kv_heads, c.head_dim},
          programs::rope_inv_freq(c.head_dim, 500000.0, {.enabled = true}));
      std::vector<uint32_t> hi, lo;
      ops::split_rope_table(table, hi, lo);
      CODA_CUDA_CHECK(cudaMalloc(&pos, c.m * 4));
      CODA_CUDA_CHECK(cudaMalloc(&fhi, c.n * 4));
      CODA_CUDA_CHECK(cudaMalloc(&flo, c.n * 4));
      CODA_CUDA_CHECK(cudaMemcpy(pos, pos_host.data(), c.m * 4, cudaMemcpyHostToDevice));
      CODA_CUDA_CHECK(cudaMemcpy(fhi, hi.data(), c.n * 4, cudaMemcpyHostToDevice));
      CODA_CUDA_CHECK(cudaMemcpy(flo, lo.data(), c.n * 4, cudaMemcpyHostToDevice));
      f3 = {r, nullptr, pos, fhi, flo};  // no Q/K/V bias
      fargs = &f3;
      if (c.program == Program::kRmsnormQkNormRope) {  // qkv goes to d, as F3's D
        CODA_CUDA_CHECK(cudaMalloc(&qk_pre, size_t(c.m) * normed * 2));
        CODA_CUDA_CHECK(cudaMalloc(&qk_gamma, size_t(2) * c.head_dim * 2));
        kernel::fill_uniform_bf16(qk_gamma, 2 * c.head_dim, seed++, 0.5f, 1.5f, nullptr);
        f3q.r = r;
        f3q.q_gamma = qk_gamma;
        f3q.k_gamma = qk_gamma + c.head_dim;
        f3q.pos = pos;
        f3q.freq_hi = fhi;
        f3q.freq_lo = flo;
        f3q.qkv = d;
        f3q.ld_qkv = c.n;
        f3q.qk_pre = qk_pre;
        f3q.ld_qk_pre = normed;
        f3q.head_dim = c.head_dim;
        f3q.q_width = c.heads * c.head_dim;
        f3q.normed_width = normed;
        f3q.eps = 1e-6f;
        fargs = &f3q;
      }
    } else if (c.program == Program::kSwigluBackward) {  // z, dz: (M, N) bf16 pairs
      CODA_CUDA_CHECK(cudaMalloc(&zpair, nd * 4));
      CODA_CUDA_CHECK(cudaMalloc(&dzpair, nd * 4));
      kernel::fill_uniform_bf16(reinterpret_cast<bf16*>(zpair), 2 * nd, seed++, -3.f, 3.f,
                                nullptr);
      b2 = {zpair, c.n, dzpair, c.n, part};
      fargs = &b2;
    } else if (c.program == Program::kRmsnormBackward) {
      CODA_CUDA_CHECK(cudaMalloc(&res, nd * 2));
      CODA_CUDA_CHECK(cudaMalloc(&x, nd * 2));
      CODA_CUDA_CHECK(cudaMalloc(&h, nd * 2));
      CODA_CUDA_CHECK(cudaMalloc(&gamma, c.n * 2));
      CODA_CUDA_CHECK(cudaMalloc(&zdz, c.m * 4));
      kernel::fill_uniform_bf16(res, nd, seed++, -1.f, 1.f, nullptr);
      kernel::fill_uniform_bf16(x, nd, seed++, -2.f, 2.f, nullptr);
      kernel::fill_uniform_bf16(gamma, c.n, seed++, 0.5f, 1.5f, nullptr);
      CODA_CUDA_CHECK(cudaMemcpy(zdz, zdz_host.data(), c.m * 4, cudaMemcpyHostToDevice));
      b1 = {x, c.n, r, gamma, zdz, h, c.n, part};
      fargs = &b1;
    } else {
      CODA_CUDA_CHECK(cudaMalloc(&tgt, c.m * 8));
      CODA_CUDA_CHECK(cudaMalloc(&tl, c.m * 4));
      CODA_CUDA_CHECK(cudaMemcpy(tgt, tgt_host.data(), c.m * 8, cudaMemcpyHostToDevice));
      f4 = {r, tgt, part, part2, tl};
      fargs = &f4;
    }
    // W is (N, K) for X·Wᵀ and (K, N) for X·W.
    const int ldw = xw ? c.n : c.k;
    const kernel::GemmProblem prob{
        c.m, c.n, c.k, a, c.k, w, ldw, res, c.n, c.program == Program::kRmsnormLse ? nullptr : d,
        c.n};
    const kernel::GemmProblem plain_prob{c.m, c.n, c.k, a, c.k, w, ldw, nullptr, 0, d, c.n};

    auto case_row = [&c] {  // the fields every results row of this case starts with
      return bench::JsonRow()
          .set("model", c.model)
          .set("op", c.op)
          .set("program", kernel::program_name(c.program))
          .set("m", c.m)
          .set("n", c.n)
          .set("k", c.k);
    };
    const bool sweep = args.count("sweep-sustained");
    const kernel::KernelChoice chosen = kernel::select_kernel(c.program, c.operands, {c.m, c.n, c.k});
    std::vector<Candidate> candidates;
    for (int ci = 0; ci < int(Config::kCount); ++ci) {
      const Config cfg = Config(ci);
      const auto fused_fn = kernel::find_kernel(c.program, cfg, c.operands);
      if (!fused_fn) continue;
      if (!only_config.empty() && only_config != kernel::config_name(cfg)) continue;
      // The plain GEMM on the same configuration; where that is not compiled (a candidate
      // compiled for one program only), the plain GEMM the op layer would run for this shape.
      const kernel::KernelChoice plain_choice =
          kernel::find_kernel(Program::kPlain, cfg, c.operands)
              ? kernel::KernelChoice{cfg, {}}
              : kernel::select_kernel(Program::kPlain, c.operands, {c.m, c.n, c.k});
      const auto plain_fn = kernel::find_kernel(Program::kPlain, plain_choice.config, c.operands);
      if (!plain_fn) continue;
      // The scheduler options the op layer would use for this program and shape.
      kernel::SchedulerOptions so =
          kernel::select_kernel(c.program, c.operands, {c.m, c.n, c.k}).scheduler;
      kernel::SchedulerOptions plain_so = plain_choice.config == cfg ? so : plain_choice.scheduler;
      // --swizzle N / --raster M|N override them (both timed kernels), to explore.
      for (kernel::SchedulerOptions* o : {&so, &plain_so}) {
        if (args.count("swizzle")) o->swizzle = std::stoi(args["swizzle"]);
        if (args.count("raster"))
          o->raster = args["raster"] == "N" ? kernel::Raster::kAlongN : kernel::Raster::kAlongM;
      }
      // Spot check of the fused result.
      CODA_CUDA_CHECK(cudaMemset(d, 0xff, nd * 2));
      if (tl) CODA_CUDA_CHECK(cudaMemset(tl, 0xff, c.m * 4));
      CODA_CUDA_CHECK(fused_fn(prob, fargs, so, nullptr));
      CODA_CUDA_CHECK(cudaDeviceSynchronize());
      bool ok = true;
      int checked = 0;
      // --unchecked: an ablation build (a part of the epilogue compiled out) computes wrong
      // results by design; it is timed without the spot check and its rows say "unchecked".
      const bool unchecked = args.count("unchecked");
      for (int s = 0; s < 24 && ok && !unchecked; ++s) {
        const int mi = int((uint64_t(s) * 2654435761u + 17) % c.m);
        const int ni = int((uint64_t(s) * 40503u + 3) % c.n) & ~1;
        if (c.program == Program::kResidualRmsnormPartial) {
          const double x =
              dot_row(a, w, mi, ni, c.k) + bf(download(res, size_t(mi) * c.n + ni, 1)[0]);
          const double got_x = bf(download(d, size_t(mi) * c.n + ni, 1)[0]);
          const double got_h = bf(download(h, size_t(mi) * c.n + ni, 1)[0]);
          const double g = bf(download(gamma, ni, 1)[0]);
          ok = close(got_x, x) && close(got_h, x * g);
        } else if (c.program == Program::kRmsnormSwiglu) {
          const double zg = r_host[mi] * dot_row(a, w, mi, ni, c.k);
          const double zu = r_host[mi] * dot_row(a, w, mi, ni + 1, c.k);
          const double got_z = bf(download(d, size_t(mi) * c.n + ni, 1)[0]);
          const double got_a = bf(download(h, size_t(mi) * (c.n / 2) + ni / 2, 1)[0]);
          ok = close(got_z, zg) && close(got_a, zg / (1 + std::exp(-zg)) * zu);
        } else if (c.program == Program::kRmsnormRope) {
          const double x0 = r_host[mi] * dot_row(a, w, mi, ni, c.k);
          const double x1 = r_host[mi] * dot_row(a, w, mi, ni + 1, c.k);
          double cs, sn;
          programs::rope_cos_sin<double>(pos_host[mi], table[ni], cs, sn);
          const auto got = download(d, size_t(mi) * c.n + ni, 2);
          ok = close(bf(got[0]), x0 * cs - x1 * sn) && close(bf(got[1]), x0 * sn + x1 * cs);
        } else if (c.program == Program::kRmsnormQkNormRope) {
          // The whole head of (mi, ni): u, its norm, γ, the rotation of the pair at ni.
          const int hd = c.head_dim, h0 = ni / hd * hd, j = ni - h0;
          std::vector<double> u(hd);
          double ss = 0;
          for (int t = 0; t < hd; ++t) {
            u[t] = r_host[mi] * dot_row(a, w, mi, h0 + t, c.k);
            ss += u[t] * u[t];
          }
          const auto got = download(d, size_t(mi) * c.n + ni, 2);
          if (ni >= normed) {
            ok = close(bf(got[0]), u[j]) && close(bf(got[1]), u[j + 1]);
          } else {
            const auto g = download(qk_gamma, ni < c.heads * hd ? j : hd + j, 2);
            const double sc = 1 / std::sqrt(ss / hd + 1e-6);
            const double x0 = bf(g[0]) * u[j] * sc, x1 = bf(g[1]) * u[j + 1] * sc;
            double cs, sn;
            programs::rope_cos_sin<double>(pos_host[mi], table[ni], cs, sn);
            ok = close(bf(got[0]), x0 * cs - x1 * sn) && close(bf(got[1]), x0 * sn + x1 * cs) &&
                 close(bf(download(qk_pre, size_t(mi) * normed + ni, 1)[0]), u[j]);
          }
        } else if (c.program == Program::kSwigluBackward) {
          const double da = dot_row(a, w, mi, ni, c.k, c.n);
          const auto zz = download(reinterpret_cast<const bf16*>(zpair), size_t(mi) * 2 * c.n + 2 * ni, 2);
          const auto dz = download(reinterpret_cast<const bf16*>(dzpair), size_t(mi) * 2 * c.n + 2 * ni, 2);
          const double g = bf(zz[0]), u = bf(zz[1]), sg = 1 / (1 + std::exp(-g));
          const double got_a = bf(download(d, size_t(mi) * c.n + ni, 1)[0]);
          ok = close(got_a, g * sg * u) && close(bf(dz[1]), da * g * sg) &&
               close(bf(dz[0]), da * u * sg * (1 + g * (1 - sg)));
        } else if (c.program == Program::kRmsnormBackward) {
          const double g = dot_row(a, w, mi, ni, c.k, c.n);
          const size_t at = size_t(mi) * c.n + ni;
          const double dres = bf(download(res, at, 1)[0]), xv = bf(download(x, at, 1)[0]);
          const double ga = bf(download(gamma, ni, 1)[0]), rr = r_host[mi], zz = zdz_host[mi];
          ok = close(bf(download(d, at, 1)[0]), dres + rr * (g * ga - xv * rr * zz)) &&
               close(bf(download(h, at, 1)[0]), xv * rr * ga);
        } else if (c.program == Program::kRmsnormLseLogits && s >= 1) {  // a stored logit
          ok = close(bf(download(d, size_t(mi) * c.n + ni, 1)[0]),
                     r_host[mi] * dot_row(a, w, mi, ni, c.k));
        } else if (s < 1) {  // one whole row of the LM head: lse from the partials, target logit
          std::vector<double> logit(c.n);
          const auto ar = download(a, size_t(mi) * c.k, c.k);
          const auto wall = download(w, 0, nw);
          double mx = -INFINITY, se = 0;
          for (int j = 0; j < c.n; ++j) {
            double t = 0;
            for (int i = 0; i < c.k; ++i)
              t += double(bf(ar[i])) * double(bf(wall[size_t(j) * c.k + i]));
            logit[j] = t * r_host[mi];
            mx = std::max(mx, logit[j]);
          }
          for (double v : logit) se += std::exp(v - mx);
          const auto tile = kernel::tile_shape(cfg);
          const int64_t pad = (c.m + tile.m - 1) / tile.m * tile.m,
                        tiles = (c.n + tile.n - 1) / tile.n;
          const auto gm = download(part, 0, size_t(pad * tiles)),
                     gs = download(part2, 0, size_t(pad * tiles));
          double gmx = -INFINITY, gse = 0;
          for (int64_t t = 0; t < tiles; ++t) gmx = std::max(gmx, double(gm[mi + pad * t]));
          for (int64_t t = 0; t < tiles; ++t)
            gse += gs[mi + pad * t] * std::exp(gm[mi + pad * t] - gmx);
          const double got_tl = download(tl, mi, 1)[0];
          ok = std::abs((gmx + std::log(gse)) - (mx + std::log(se))) < 1e-3 &&
               std::abs(got_tl - logit[tgt_host[mi]]) < 1e-3 * (1 + std::abs(logit[tgt_host[mi]]));
        }
        ++checked;
      }
      if (sweep) {
        if (ok) {
          for (const kernel::SchedulerOptions& o : sweep_orders(so))
            candidates.push_back({kernel::config_name(cfg), o, cfg == chosen.config &&
                                  o.swizzle == chosen.scheduler.swizzle &&
                                  o.raster == chosen.scheduler.raster,
                                  [&, fused_fn, o](cudaStream_t st) {
                                    CODA_CUDA_CHECK(fused_fn(prob, fargs, o, st));
                                  }});
        } else {
          std::printf("%-11s %-13s %6d %6d %6d | %-22s spot check FAILED: left out of the sweep\n",
                      c.model.c_str(), c.op.c_str(), c.m, c.n, c.k, kernel::config_name(cfg));
        }
        continue;
      }
      double t_plain = NAN, t_fused = NAN;
      if (ok) {
        std::tie(t_plain, t_fused) = timer.median_ms_interleaved(
            [&](cudaStream_t st) { CODA_CUDA_CHECK(plain_fn(plain_prob, &plain, plain_so, st)); },
            [&](cudaStream_t st) { CODA_CUDA_CHECK(fused_fn(prob, fargs, so, st)); });
      }
      std::printf("%-11s %-13s %6d %6d %6d | %-22s %8.3f %8.3f %7.3f | %s (%d samples)%s%s\n",
                  c.model.c_str(), c.op.c_str(), c.m, c.n, c.k, kernel::config_name(cfg), t_plain,
                  t_fused, t_fused / t_plain, unchecked ? "unchecked" : ok ? "ok" : "FAIL", checked,
                  plain_choice.config == cfg ? "" : "; plain on ",
                  plain_choice.config == cfg ? "" : kernel::config_name(plain_choice.config));
      std::fflush(stdout);
      rows.push_back(case_row()
                         .set("config", kernel::config_name(cfg))
                         .set("plain_config", kernel::config_name(plain_choice.config))
                         .set("swizzle", so.swizzle)
                         .set("raster", bench::raster_name(so.raster))
                         .set("check", unchecked ? "unchecked" : ok ? "ok" : "FAIL")
                         .set("plain_ms", t_plain)
                         .set("fused_ms", t_fused)
                         .set("fused_over_plain", t_fused / t_plain));
      if (args.count("json")) bench::write_results(args["json"], header, rows);
    }
    if (sweep && !candidates.empty()) {
      // Our plain GEMM of the shape, as the op layer runs it, as the reference.
      const kernel::KernelChoice pc = kernel::select_kernel(Program::kPlain, c.operands, {c.m, c.n, c.k});
      const auto plain_fn = kernel::find_kernel(Program::kPlain, pc.config, c.operands);
      kernel::PlainArgs plain_args;
      std::vector<std::function<void(cudaStream_t)>> fns;
      for (const Candidate& cd : candidates) fns.push_back(cd.run);
      if (plain_fn)
        fns.push_back([&](cudaStream_t st) {
          CODA_CUDA_CHECK(plain_fn(plain_prob, &plain_args, pc.scheduler, st));
        });
      const std::vector<double> flushed = timer.median_ms_interleaved(fns, 2, 11);
      const std::vector<double> sustained = timer.median_ms_sustained(fns);
      const double ref_f = plain_fn ? flushed.back() : NAN, ref_s = plain_fn ? sustained.back() : NAN;
      std::printf("%-11s %-13s %6d %6d %6d | sweep: flushed / sustained ms (ratio to plain %s %d:%s "
                  "%.3f / %.3f ms)\n", c.model.c_str(), c.op.c_str(), c.m, c.n, c.k,
                  kernel::config_name(pc.config), pc.scheduler.swizzle,
                  bench::raster_name(pc.scheduler.raster), ref_f, ref_s);
      for (size_t j = 0; j < candidates.size(); ++j) {
        const Candidate& cd = candidates[j];
        std::printf("    %c %-22s %d:%s  %8.3f %8.3f   %6.3f %6.3f\n", cd.chosen ? '*' : ' ',
                    cd.config, cd.order.swizzle, bench::raster_name(cd.order.raster), flushed[j],
                    sustained[j], flushed[j] / ref_f, sustained[j] / ref_s);
        rows.push_back(case_row()
                           .set("mode", "sweep")
                           .set("config", cd.config)
                           .set("swizzle", cd.order.swizzle)
                           .set("raster", bench::raster_name(cd.order.raster))
                           .set("heuristic_pick", cd.chosen ? 1.0 : 0.0)
                           .set("flushed_ms", flushed[j])
                           .set("sustained_ms", sustained[j])
                           .set("plain_config", kernel::config_name(pc.config))
                           .set("plain_flushed_ms", ref_f)
                           .set("plain_sustained_ms", ref_s));
      }
      std::fflush(stdout);
      if (args.count("json")) bench::write_results(args["json"], header, rows);
    }
    for (void* p : {(void*)a,     (void*)w,     (void*)d,      (void*)res,    (void*)h,
                    (void*)gamma, (void*)r,     (void*)part,   (void*)part2,  (void*)tl,
                    (void*)pos,   (void*)tgt,   (void*)fhi,    (void*)flo,    (void*)x,
                    (void*)zdz,   (void*)zpair, (void*)dzpair, (void*)qk_pre, (void*)qk_gamma})
      if (p) cudaFree(p);
  }
  return 0;
}
