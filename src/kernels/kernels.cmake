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
  "Plain:Coop128x128x64_1x1:XWt"
  # forward programs (F1 was also swept on pingpong 128x192, B2 and B1 on pingpong 128x128 with
  # cluster 2x1 in runs 37 and 42, and dropped; F2 on pingpong 128x192, its choice below
  # 2I = 32768 until run 47, dropped after it: docs/performance-notes-early.md)
  "ResidualRmsnormPartial:Ping128x128x64_1x2:XWt"
  "ResidualRmsnormPartial:Coop128x256x64_2x1:XWt"
  "ResidualRmsnormPartial:Coop256x128x64_1x2:XWt"
  "RmsnormSwiglu:Ping128x128x64_1x2:XWt"
  "RmsnormSwiglu:Coop128x256x64_2x1:XWt"
  "RmsnormRope:Ping128x128x64_1x2:XWt"
  "RmsnormRope:Coop128x256x64_2x1:XWt"
  "RmsnormRope:Coop256x128x64_1x2:XWt"
  "RmsnormLse:Coop128x256x64_2x1:XWt"
  "RmsnormLse:Ping128x192x64_2x1:XWt"
  "RmsnormLseLogits:Coop128x256x64_2x1:XWt"
  # the LM head's three-GEMM path (F4 storing logits): pingpong 128x192 at K > 2048 (run 37)
  "RmsnormLseLogits:Ping128x192x64_2x1:XWt"
  # backward programs and the transposed operand layouts the backward pass needs
  "RmsnormBackward:Ping128x128x64_1x2:XW"
  "RmsnormBackward:Coop256x128x64_1x2:XW"  # B1 gate/up (K >= 16384), run 27
  "RmsnormCrossEntropyBackward:Ping128x128x64_1x2:XWt"
  "SwigluBackward:Ping128x128x64_1x2:XW"
  "Plain:Ping128x128x64_1x2:XW"
  "Plain:Coop256x128x64_1x2:XW"  # data-gradient GEMMs at N, K >= 4096, run 27
  "Plain:Coop128x256x64_2x1:XtY"
  # weight gradients whose 128x256 tile grid leaves most of a last wave idle (1B dW QKV: 192 tiles
  # on 132 SMs, 0.77x cuBLAS in run 29); heuristic.cpp plain_xty_config
  "Plain:Ping128x128x64_1x2:XtY"
  # tests: the fragment pairing every pairwise epilogue relies on, per schedule
  "PairLayoutProbe:Ping128x128x64_1x2:XWt"
  "PairLayoutProbe:Coop128x256x64_2x1:XWt"
)

# The fusion header each program's translation units include (include/coda/kernel/fusions/).
set(CODA_FUSION_HEADER_Plain plain.cuh)
set(CODA_FUSION_HEADER_ResidualRmsnormPartial residual_rmsnorm.cuh)
set(CODA_FUSION_HEADER_RmsnormSwiglu rmsnorm_swiglu.cuh)
set(CODA_FUSION_HEADER_RmsnormRope rmsnorm_rope.cuh)
set(CODA_FUSION_HEADER_RmsnormLse rmsnorm_lse.cuh)
set(CODA_FUSION_HEADER_RmsnormLseLogits rmsnorm_lse.cuh)
set(CODA_FUSION_HEADER_PairLayoutProbe pair_layout_probe.cuh)
set(CODA_FUSION_HEADER_RmsnormBackward rmsnorm_backward.cuh)
set(CODA_FUSION_HEADER_RmsnormCrossEntropyBackward rmsnorm_ce_backward.cuh)
set(CODA_FUSION_HEADER_SwigluBackward swiglu_backward.cuh)
