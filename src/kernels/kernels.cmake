# The one list of compiled GEMM kernels: "program:config:operands" (names from
# include/coda/kernel/args.hpp without the k prefix). Each entry becomes one translation unit
# (a CUTLASS sm90 instantiation costs ~110 s and ~4 GB on a 2-core machine: keep this list short).
# -DCODA_KERNELS="plain:Coop128x256x64_2x1:XWt;..." builds a subset.
set(CODA_ALL_KERNELS
  # plain GEMM: the configurations the heuristic chooses among (BENCHMARKS.md)
  "Plain:Coop128x256x64_2x1:XWt"
  "Plain:Coop256x128x64_1x2:XWt"
  "Plain:Ping128x128x64_1x2:XWt"
  "Plain:Ping128x128x64_2x1:XWt"
  "Plain:Ping128x192x64_2x1:XWt"
  # forward programs
  "ResidualRmsnormPartial:Ping128x128x64_1x2:XWt"
  "ResidualRmsnormPartial:Coop128x256x64_2x1:XWt"
  "RmsnormSwiglu:Ping128x128x64_1x2:XWt"
  "RmsnormSwiglu:Coop128x256x64_2x1:XWt"
  "RmsnormRope:Ping128x128x64_1x2:XWt"
  "RmsnormRope:Coop128x256x64_2x1:XWt"
  "RmsnormLse:Coop128x256x64_2x1:XWt"
  "RmsnormLseLogits:Coop128x256x64_2x1:XWt"
  # tests: the fragment pairing every pairwise epilogue relies on, per schedule
  "PairLayoutProbe:Ping128x128x64_1x2:XWt"
  "PairLayoutProbe:Coop128x256x64_2x1:XWt"
)
