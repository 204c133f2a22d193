#pragma once
// Benchmark plumbing: CUDA-event timing with L2 flushes, median of repeats, the JSON results file.
// Method (docs/math.md §7): warm up, time each repeat with events after flushing the 60 MB L2,
// report the median; random inputs only; every timed result is checked before its time is reported.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "coda/kernel/args.hpp"
#include "coda/kernel/cuda_check.hpp"

namespace coda::bench {

class Timer {
 public:
  explicit Timer(size_t flush_bytes = size_t(256) << 20) : flush_bytes_(flush_bytes) {
    CODA_CUDA_CHECK(cudaMalloc(&flush_, flush_bytes_));
    CODA_CUDA_CHECK(cudaEventCreate(&start_));
    CODA_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~Timer() {
    cudaFree(flush_);
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  // Median milliseconds of `reps` timed calls after `warmup` untimed ones; the L2 is flushed before
  // every call (outside the timed region).
  double median_ms(const std::function<void(cudaStream_t)>& fn, int warmup = 3, int reps = 15,
                   cudaStream_t stream = nullptr) {
    for (int i = 0; i < warmup; ++i) fn(stream);
    std::vector<float> t(reps);
    for (int i = 0; i < reps; ++i) t[i] = once(fn, i, stream);
    std::sort(t.begin(), t.end());
    return t[reps / 2];
  }

  // Two candidates timed alternately (A, B, A, B, ...) so both see the same clock and thermal
  // state: on the H200 the same kernel's time drifted by up to ~20% between runs minutes apart,
  // which made back-to-back medians of different kernels incomparable. Returns {median A, median
  // B}.
  std::pair<double, double> median_ms_interleaved(const std::function<void(cudaStream_t)>& a,
                                                  const std::function<void(cudaStream_t)>& b,
                                                  int warmup = 3, int reps = 21,
                                                  cudaStream_t stream = nullptr) {
    const std::vector<double> m = median_ms_interleaved(
        std::vector<std::function<void(cudaStream_t)>>{a, b}, warmup, reps, stream);
    return {m[0], m[1]};
  }

  // Any number of candidates timed round-robin (A, B, C, A, B, C, ...), each median in order.
  std::vector<double> median_ms_interleaved(
      const std::vector<std::function<void(cudaStream_t)>>& fns, int warmup = 3, int reps = 21,
      cudaStream_t stream = nullptr) {
    for (int i = 0; i < warmup; ++i)
      for (const auto& f : fns) f(stream);
    std::vector<std::vector<float>> t(fns.size(), std::vector<float>(reps));
    for (int i = 0; i < reps; ++i)
      for (size_t j = 0; j < fns.size(); ++j) t[j][i] = once(fns[j], i, stream);
    std::vector<double> med;
    for (auto& v : t) {
      std::sort(v.begin(), v.end());
      med.push_back(v[reps / 2]);
    }
    return med;
  }

  // Sustained load, as a training loop runs kernels: each candidate runs back to back for about
  // `batch_ms` (no L2 flush, no idle gap between runs), the candidates alternating batch by batch
  // over `rounds` (the order reversed every other round). Returns each candidate's median ms per
  // run. At the H200's 700 W limit a kernel's clock follows its energy per unit of work, which
  // single flushed runs after an idle gap hide.
  std::vector<double> median_ms_sustained(
      const std::vector<std::function<void(cudaStream_t)>>& fns, double batch_ms = 120.0,
      int rounds = 5, cudaStream_t stream = nullptr) {
    rounds = std::max(rounds, 1);
    std::vector<int> runs(fns.size(), 1);
    auto batch = [&](size_t j) {  // ms per run over runs[j] back-to-back runs
      CODA_CUDA_CHECK(cudaEventRecord(start_, stream));
      for (int r = 0; r < runs[j]; ++r) fns[j](stream);
      CODA_CUDA_CHECK(cudaEventRecord(stop_, stream));
      CODA_CUDA_CHECK(cudaEventSynchronize(stop_));
      float ms = 0;
      CODA_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      return ms / runs[j];
    };
    for (size_t j = 0; j < fns.size(); ++j) {  // calibrate: runs per batch from a warm run
      fns[j](stream);
      runs[j] = std::max(3, int(batch_ms / std::max(batch(j), 1e-3f)));
    }
    for (size_t j = 0; j < fns.size(); ++j) batch(j);  // one untimed batch each: reach the limit
    std::vector<std::vector<float>> t(fns.size());
    for (int r = 0; r < rounds; ++r)
      for (size_t i = 0; i < fns.size(); ++i) {
        const size_t j = r % 2 == 0 ? i : fns.size() - 1 - i;
        t[j].push_back(batch(j));
      }
    std::vector<double> med;
    for (auto& v : t) {
      std::sort(v.begin(), v.end());
      med.push_back(v[v.size() / 2]);
    }
    return med;
  }

 private:
  float once(const std::function<void(cudaStream_t)>& fn, int i, cudaStream_t stream) {
    CODA_CUDA_CHECK(cudaMemsetAsync(flush_, i & 0xff, flush_bytes_, stream));
    CODA_CUDA_CHECK(cudaEventRecord(start_, stream));
    fn(stream);
    CODA_CUDA_CHECK(cudaEventRecord(stop_, stream));
    CODA_CUDA_CHECK(cudaEventSynchronize(stop_));
    float ms = 0;
    CODA_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return ms;
  }
  size_t flush_bytes_;
  void* flush_ = nullptr;
  cudaEvent_t start_{}, stop_{};
};

// A flat JSON object writer: enough for rows of numbers and strings.
class JsonRow {
 public:
  JsonRow& set(const std::string& k, const std::string& v) {
    std::string esc;
    for (char c : v) esc += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
    fields_.push_back("\"" + k + "\": \"" + esc + "\"");
    return *this;
  }
  JsonRow& set(const std::string& k, double v) {
    std::ostringstream o;
    o.precision(6);
    if (v != v)
      o << "null";
    else
      o << v;
    fields_.push_back("\"" + k + "\": " + o.str());
    return *this;
  }
  std::string str() const {
    std::string s = "{";
    for (size_t i = 0; i < fields_.size(); ++i) s += (i ? ", " : "") + fields_[i];
    return s + "}";
  }

 private:
  std::vector<std::string> fields_;
};

inline std::string device_description() {
  cudaDeviceProp p{};
  CODA_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  std::ostringstream o;
  o << p.name << ", " << p.multiProcessorCount << " SMs, CUDA runtime " << rt / 1000 << "."
    << (rt % 1000) / 10 << ", driver " << drv / 1000 << "." << (drv % 1000) / 10;
  return o.str();
}

inline void write_results(const std::string& path, const JsonRow& header,
                          const std::vector<JsonRow>& rows) {
  std::ofstream f(path);
  CODA_CHECK(f.good(), "cannot write results file ", path);
  std::string h = header.str();
  h.pop_back();
  f << h << ", \"rows\": [\n";
  for (size_t i = 0; i < rows.size(); ++i)
    f << "  " << rows[i].str() << (i + 1 < rows.size() ? ",\n" : "\n");
  f << "]}\n";
}

// --key value / --flag parsing.
inline std::map<std::string, std::string> parse_args(int argc, char** argv) {
  std::map<std::string, std::string> a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0) continue;
    k = k.substr(2);
    if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0)
      a[k] = argv[++i];
    else
      a[k] = "1";
  }
  return a;
}

// A tile order's raster as the benches' rows write it: M, N, or H (the scheduler's heuristic).
inline const char* raster_name(kernel::Raster r) {
  return r == kernel::Raster::kAlongM ? "M" : r == kernel::Raster::kAlongN ? "N" : "H";
}

}  // namespace coda::bench
