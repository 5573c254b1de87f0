// Op schemas for the standalone Marlin MoE build of `python -m harness kernels`.
//
// vLLM defines these schemas in csrc/moe/torch_bindings.cpp and
// csrc/torch_bindings.cpp, which pull in every other op of _moe_C / _C. The
// standalone library only carries the Marlin MoE GEMM and the GPTQ
// repack (and the capability query the series adds), so it defines just those
// here. The namespace comes from the
// command line (-DHARNESS_OPS_NAMESPACE=<ns>); ops.cu and
// gptq_marlin_repack.cu register their CUDA implementations under the same
// namespace through -D_moe_C=<ns> and -D_C=<ns>. The schema strings must stay
// identical to vLLM's so that callers can pass the same arguments.
//
// They differ between releases: vLLM 0.33.0 has 8-bit activations (an
// `a_scales` argument of the GEMM and `is_a_8bit` of the repack), which 0.34.0
// removed. harness/kernels.py reads the tree's ops.cu and
// gptq_marlin_repack.cu and defines HARNESS_GEMM_A_SCALES and
// HARNESS_REPACK_IS_A_8BIT for a tree that has them.

#include <torch/csrc/stable/library.h>

#ifndef HARNESS_OPS_NAMESPACE
  #error "define HARNESS_OPS_NAMESPACE to the torch op namespace to register"
#endif

// One level of indirection so that the namespace macro is expanded before
// STABLE_TORCH_LIBRARY pastes it into identifiers.
#define HARNESS_STABLE_LIBRARY(ns, m) STABLE_TORCH_LIBRARY(ns, m)

HARNESS_STABLE_LIBRARY(HARNESS_OPS_NAMESPACE, m) {
  m.def(
      "moe_wna16_marlin_gemm(Tensor! a, Tensor? c_or_none,"
      "Tensor! b_q_weight, Tensor? b_bias_or_none,"
      "Tensor! b_scales, "
#ifdef HARNESS_GEMM_A_SCALES
      "Tensor? a_scales, "
#endif
      "Tensor? global_scale, Tensor? b_zeros_or_none,"
      "Tensor! workspace,"
      "Tensor sorted_token_ids,"
      "Tensor! expert_ids, Tensor! num_tokens_past_padded,"
      "Tensor! topk_weights, int moe_block_size, int top_k, "
      "bool mul_topk_weights, int b_type_id,"
      "int size_m, int size_n, int size_k, bool use_atomic_add,"
      "bool use_fp32_reduce, bool is_zp_float,"
      "int thread_k, int thread_n, int blocks_per_sm) -> Tensor");
  m.def(
      "gptq_marlin_repack(Tensor b_q_weight, "
      "SymInt size_k, SymInt size_n, int num_bits"
#ifdef HARNESS_REPACK_IS_A_8BIT
      ", bool is_a_8bit"
#endif
      ") -> Tensor");
  // Added by the series' commit 0006; ops.cu implements it from that commit on.
  // Defined for every revision so a base build loads too (schema only there).
  m.def(
      "marlin_moe_supports_64bit_expert_offsets(int a_type_id, int b_type_id,"
      " int c_type_id, int s_type_id) -> bool");
}
