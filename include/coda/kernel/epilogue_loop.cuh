#pragma once
// OneSyncStoreLoop<Stock>: CUTLASS's sm90 TMA warp-specialized epilogue collective (Stock) with
// our own consumer loop. The producer side (C loaded by TMA, StagesC subtiles ahead), the shared
// storage, the pipelines and the visitor tree are the stock ones; only store() differs.
//
// Per epilogue subtile the stock loop runs two proxy fences and two warpgroup barriers: a fence
// after reading C from shared memory (before releasing its buffer to the producer), then fence,
// barrier, TMA store issue, a wait for an older store's reads and a second barrier. The profile of
// B2 (run 55) put about half of its epilogue on that sequence, a quarter on the fences alone. This
// loop runs one fence and one barrier per subtile:
//   - C of subtile i+1 is read into registers at the top of subtile i, so its shared-memory latency
//     hides behind subtile i's math, and the fence that publishes subtile i's stores also orders
//     that read before C's buffer is released;
//   - the issuing warp waits for the reads of the store that used the next subtile's buffer
//     (StagesD - 2 groups may stay pending) before the one barrier, so the barrier both publishes
//     subtile i's shared-memory writes and hands the next buffer to every thread. The stock loop
//     waits for the same store right after issuing the current one, a subtile earlier.
// Scope: a source C and a destination D, no shared-memory reuse between them, row-major C and D,
// an epilogue subtile no larger than one MMA tile (pingpong 128x128 with 64x32 subtiles), no
// register-to-register copy. The static_asserts hold the collective to that.

#include <cutlass/epilogue/collective/collective_builder.hpp>

namespace coda::kernel {

template <class Stock>
struct OneSyncStoreLoop;

template <int StagesC, int StagesD, int FragmentSize, bool ReuseSmemC, bool DelayTmaStore,
          class CtaTile, class EpiTile, class ElementC, class StrideC, class ElementD,
          class StrideD, class Callbacks, class CopyOpG2S, class SmemAtomC, class CopyOpS2R,
          class CopyOpS2G, class SmemAtomD, class CopyOpR2S, class CopyAtomC, class CopyOpR2R>
struct OneSyncStoreLoop<cutlass::epilogue::collective::CollectiveEpilogue<
    cutlass::epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC,
                                              DelayTmaStore>,
    CtaTile, EpiTile, ElementC, StrideC, ElementD, StrideD, Callbacks, CopyOpG2S, SmemAtomC,
    CopyOpS2R, CopyOpS2G, SmemAtomD, CopyOpR2S, CopyAtomC, CopyOpR2R>>
    : cutlass::epilogue::collective::CollectiveEpilogue<
          cutlass::epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC,
                                                    DelayTmaStore>,
          CtaTile, EpiTile, ElementC, StrideC, ElementD, StrideD, Callbacks, CopyOpG2S, SmemAtomC,
          CopyOpS2R, CopyOpS2G, SmemAtomD, CopyOpR2S, CopyAtomC, CopyOpR2R> {
  using Stock = cutlass::epilogue::collective::CollectiveEpilogue<
      cutlass::epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC,
                                                DelayTmaStore>,
      CtaTile, EpiTile, ElementC, StrideC, ElementD, StrideD, Callbacks, CopyOpG2S, SmemAtomC,
      CopyOpS2R, CopyOpS2G, SmemAtomD, CopyOpR2S, CopyAtomC, CopyOpR2R>;
  using typename Stock::LoadPipeline;
  using typename Stock::LoadPipelineState;
  using typename Stock::Params;
  using typename Stock::StorePipeline;
  using typename Stock::StorePipelineState;
  using typename Stock::TensorStorage;

  static_assert(!std::is_void_v<ElementC> && !std::is_void_v<ElementD>,
                "the loop reads a source C and writes a destination D");
  static_assert(!ReuseSmemC && !DelayTmaStore && std::is_void_v<CopyOpR2R>,
                "the loop implements the plain C / D buffer arrangement only");
  static_assert(StagesD >= 2, "the next subtile's store buffer must differ from this one's");
  static_assert(!cutlass::epilogue::collective::detail::is_m_major<StrideC>() &&
                    !cutlass::epilogue::collective::detail::is_m_major<StrideD>(),
                "C and D are row-major");
  // The same shared-memory arrangement as the stock collective (its layouts are private there).
  using SmemLayoutC = decltype(cute::tile_to_shape(
      SmemAtomC{},
      cute::make_shape(cute::size<0>(EpiTile{}), cute::size<1>(EpiTile{}), cute::Int<StagesC>{}),
      cute::Step<cute::_1, cute::_2, cute::_3>{}));
  using SmemLayoutD = decltype(cute::tile_to_shape(
      SmemAtomD{},
      cute::make_shape(cute::size<0>(EpiTile{}), cute::size<1>(EpiTile{}), cute::Int<StagesD>{}),
      cute::Step<cute::_1, cute::_2, cute::_3>{}));

  CUTLASS_HOST_DEVICE OneSyncStoreLoop(Params const& p, TensorStorage& s)
      : Stock(p, s), params(p), callbacks(p.thread, s.thread) {}

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine,
            class AccLayout, class TiledMma>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadPipelineState load_state,
                            StorePipeline, StorePipelineState store_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK,
                            TileCoordMNKL tile_coord_mnkl,
                            cute::Tensor<AccEngine, AccLayout> accumulators, TiledMma tiled_mma,
                            int thread_idx, TensorStorage& shared_tensors, int subtile_idx = -1) {
    using namespace cute;
    using ElementAcc = typename AccEngine::value_type;
    using ElementCompute = float;
    using ElementSmemD = ElementD;
    static_assert(std::is_same_v<ElementAcc, float>, "fp32 accumulators");

    auto [M, N, K, L] = problem_shape_mnkl;
    auto [m_coord, n_coord, k_coord, l_coord] = tile_coord_mnkl;

    // Destination tile by subtile, and the shared-memory rings of C and D.
    Tensor mD = params.tma_store_d.get_tma_tensor(make_shape(M, N, L));
    Tensor gD = local_tile(mD, take<0, 2>(CtaTile{}), make_coord(m_coord, n_coord, l_coord));
    Tensor gD_epi = flat_divide(gD, EpiTile{});  // (EPI_M_SIZE, EPI_N_SIZE, EPI_M, EPI_N)
    Tensor sC = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(shared_tensors.collective.smem_C.begin()), SmemLayoutC{}));
    Tensor sD = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(shared_tensors.collective.smem_D.begin()), SmemLayoutD{}));

    // Thread partitions: accumulators -> D's shared memory, C's shared memory -> registers.
    TiledCopy copy_c_atom = make_tiled_copy_C_atom(CopyAtomC{}, tiled_mma);
    TiledCopy r2s = make_tiled_copy_S(Copy_Atom<CopyOpR2S, ElementSmemD>{}, copy_c_atom);
    ThrCopy thr_r2s = r2s.get_slice(thread_idx);
    Tensor tRS_rAcc = thr_r2s.retile_S(accumulators);  // ((R2S,V),MMA_M,MMA_N)
    Tensor tRS_sD = thr_r2s.partition_D(sD);            // (R2S,R2S_M,R2S_N,PIPE_D)
    Layout frag_layout = make_layout(take<0, 3>(shape(thr_r2s.partition_S(sD))));
    Tensor tRS_rD = make_tensor<ElementSmemD>(frag_layout);
    Tensor tRS_rCompute = make_tensor<ElementCompute>(frag_layout);
    Tensor tRS_rAcc_frg = recast<cutlass::Array<ElementAcc, FragmentSize>>(tRS_rAcc);
    Tensor tRS_rD_frg = recast<cutlass::Array<ElementSmemD, FragmentSize>>(tRS_rD);
    Tensor tRS_rCompute_frg = recast<cutlass::Array<ElementCompute, FragmentSize>>(tRS_rCompute);

    TiledCopy s2r = make_tiled_copy_S(Copy_Atom<CopyOpS2R, ElementC>{}, copy_c_atom);
    ThrCopy thr_s2r = s2r.get_slice(thread_idx);
    Tensor tSR_sC = thr_s2r.partition_S(sC);  // (S2R,S2R_M,S2R_N,PIPE_C)
    // C as the visitor tree sees it (tRS_rC), and the next subtile's C read ahead (tRS_rC_next).
    Tensor tRS_rC = make_tensor<ElementC>(frag_layout);
    Tensor tRS_rC_next = make_tensor<ElementC>(frag_layout);
    Tensor tSR_rC_next = thr_s2r.retile_D(tRS_rC_next);

    ThrCopy blk_s2g = params.tma_store_d.get_slice(Int<0>{});
    Tensor bSG_sD = blk_s2g.partition_S(sD);      // (S2G,S2G_M,S2G_N,PIPE_D)
    Tensor bSG_gD = blk_s2g.partition_D(gD_epi);  // (S2G,S2G_M,S2G_N,EPI_M,EPI_N)

    // Coordinates and residues for the visitor tree (what the stock collective hands it).
    Tensor mD_crd = make_identity_tensor(make_shape(M, N));
    Tensor cD_mn = local_tile(mD_crd, take<0, 2>(CtaTile{}), make_coord(m_coord, n_coord));
    Tensor tRS_cD_mn = thr_r2s.partition_S(flat_divide(cD_mn, EpiTile{}));
    Tensor cD = make_coord_tensor(cD_mn.layout());
    Tensor tRS_cD = make_coord_tensor(tRS_cD_mn.layout());
    auto residue_cD = make_coord(M, N) - cD_mn(_0{});
    auto residue_tRS_cD = make_coord(M, N) - tRS_cD_mn(_0{});

    constexpr int kMmaTileM = size<0>(CtaTile{}) / decltype(size<1>(tRS_rAcc))::value;
    constexpr int kMmaTileN = size<1>(CtaTile{}) / decltype(size<2>(tRS_rAcc))::value;
    constexpr int kEpiTileM = size<0>(EpiTile{});
    constexpr int kEpiTileN = size<1>(EpiTile{});
    static_assert(kEpiTileM == kMmaTileM && kMmaTileN % kEpiTileN == 0,
                  "an epilogue subtile is a column slice of one MMA tile");
    constexpr int kEpiM = decltype(size<2>(gD_epi))::value;
    constexpr int kEpiN = decltype(size<3>(gD_epi))::value;

    TiledCopy copy_ref = make_tiled_copy_S(Copy_Atom<CopyOpR2S, ElementSmemD>{}, copy_c_atom);
    auto cst_args = cutlass::epilogue::fusion::detail::ConsumerStoreArgs(
        problem_shape_mnkl, CtaTile{}, tile_coord_mnkl, tiled_mma, EpiTile{}, copy_ref, cD,
        residue_cD, tRS_cD, residue_tRS_cD, tRS_rC, thread_idx);
    auto cst = callbacks.template get_consumer_store_callbacks<true>(cst_args);
    // Both hold for every tree this loop serves (its source C is a real operand); the stock
    // collective also allows producer loads without C, which this loop does not read ahead.
    const bool load_c = callbacks.is_producer_load_needed() && callbacks.is_C_load_needed();

    auto barrier = [] {
      cutlass::arch::NamedBarrier::sync(size(TiledMma{}),
                                        cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
    };
    const bool issuer = thread_idx / cutlass::NumThreadsPerWarp == 0;

    cst.begin();
    if (cst.begin_sync_needed()) barrier();

    // C of the first subtile. wait_state runs one subtile ahead of the one being computed
    // (c_state); load_state is the next buffer to release.
    LoadPipelineState wait_state = load_state;
    LoadPipelineState c_state = load_state;
    if (load_c) {
      load_pipeline.consumer_wait(wait_state);
      copy(s2r, tSR_sC(_, _, _, wait_state.index()), tSR_rC_next);
      ++wait_state;
    }

    CUTLASS_PRAGMA_UNROLL
    for (int epi_n = 0; epi_n < kEpiN; ++epi_n) {
      CUTLASS_PRAGMA_UNROLL
      for (int epi_m = 0; epi_m < kEpiM; ++epi_m) {
        const bool first = epi_m == 0 && epi_n == 0;
        const bool last = epi_m == kEpiM - 1 && epi_n == kEpiN - 1;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tRS_rC); ++i) tRS_rC(i) = tRS_rC_next(i);
        if (load_c && !last) {
          load_pipeline.consumer_wait(wait_state);
          copy(s2r, tSR_sC(_, _, _, wait_state.index()), tSR_rC_next);
          ++wait_state;
        }

        cst.begin_loop(epi_m, epi_n);
        cst.previsit(epi_m, epi_n, c_state.count(), load_c);
        ++c_state;
        {
          Tensor acc_mn = tRS_rAcc_frg(_, epi_m, (epi_n * kEpiTileN) / kMmaTileN);
          const int v0 = (epi_n % (kMmaTileN / kEpiTileN)) * size(tRS_rCompute_frg);
          CUTLASS_PRAGMA_UNROLL
          for (int v = 0; v < size(tRS_rCompute_frg); ++v)
            tRS_rCompute_frg(v) = cst.visit(acc_mn(v0 + v), v, epi_m, epi_n);
        }
        cst.reduce(sD(_, _, store_state.index()), barrier, epi_m, epi_n, last, tRS_rCompute_frg);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tRS_rD_frg); ++i)
          tRS_rD_frg(i) =
              cutlass::NumericArrayConverter<ElementSmemD, ElementCompute, FragmentSize>{}(
                  tRS_rCompute_frg(i));
        copy(r2s, tRS_rD, tRS_sD(_, _, _, store_state.index()));
        cst.postreduce(epi_m, epi_n, store_state.count(), true);

        // One fence: this subtile's shared-memory writes become visible to TMA, and the reads of
        // C (this subtile's at the first, the next one's at every subtile) are ordered before
        // their buffers go back to the producer.
        cutlass::arch::fence_view_async_shared();
        if (load_c) {
          if (first) {
            load_pipeline.consumer_release(load_state);
            ++load_state;
          }
          if (!last) {
            load_pipeline.consumer_release(load_state);
            ++load_state;
          }
        }
        // The next subtile's buffer was last read by the store StagesD - 1 subtiles back.
        if (issuer && !last) cute::tma_store_wait<StagesD - 2>();
        barrier();
        if (issuer) {
          copy(params.tma_store_d, bSG_sD(_, _, _, store_state.index()),
               bSG_gD(_, _, _, epi_m, epi_n));
        }
        cst.tma_store(epi_m, epi_n, store_state.count(), issuer);
        if (issuer) cute::tma_store_arrive();
        ++store_state;
        cst.end_loop(epi_m, epi_n);
      }
    }
    cst.end();
    // subtile_idx selects one subtile in CUTLASS's stream-K reduction path; the persistent
    // schedulers this library uses never pass it.
    (void)subtile_idx;
    return cute::make_tuple(load_state, store_state);
  }

 private:
  Params const& params;
  Callbacks callbacks;
};

}  // namespace coda::kernel
