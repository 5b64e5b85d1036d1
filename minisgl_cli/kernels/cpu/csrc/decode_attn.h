// minisgl::decode_attn's arguments and dtypes, checked and dispatched alike by each ISA's build of the kernel
// (decode_attn.cpp: AVX-512 BF16; avx2/decode_attn.cpp: AVX2 and FMA).
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <optional>
#include <type_traits>
#include <vector>

namespace minisgl {

constexpr int kMaxGroup = 16;  // query heads a KV head serves

struct AttnArgs {
  int64_t Hkv, G, Lmax;
  float scale;
  const int64_t* slots;
  const int64_t* lens;
  int64_t window;       // a sliding window: a row attends to its last `window` keys; 0: all
  const float* sinks;   // [H] a logit per query head in the softmax's denominator only (gpt-oss), or null
};

// A row's first key under the window.
inline int64_t first_key(const AttnArgs& a, int64_t b) {
  return a.window > 0 && a.lens[b] > a.window ? a.lens[b] - a.window : 0;
}

// Every (row, KV head) of the batch through `one` (a build's kernel for it), spread over the threads: each on one
// thread, so its result never depends on which thread or what else runs.
template <typename Q, typename C, auto one>
void run_rows(const AttnArgs& a, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out) {
  const Q* qp = q.const_data_ptr<Q>();
  const C* kp = k.const_data_ptr<C>();
  const C* vp = v.const_data_ptr<C>();
  Q* op = out.data_ptr<Q>();
  at::parallel_for(0, q.size(0) * a.Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) one(a, qp, kp, vp, op, t / a.Hkv, t % a.Hkv, scores);
  });
}

// Checks the op's arguments, then runs by_dim(args, (Q*)0, (C*)0, q, k, v, out) for the query's and the cache's
// element types Q and C: bf16 / bf16, fp32 / bf16 or fp32 / fp32.
template <typename ByDim>
at::Tensor decode_attn_checked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                               const at::Tensor& lens, double scale, int64_t window,
                               const std::optional<at::Tensor>& sinks, ByDim by_dim) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.is_contiguous() && k.is_contiguous() &&
                  v.is_contiguous(), "decode_attn: q [B, H, D], k and v [slots, Hkv, D], contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == q.size(2) && q.size(1) % k.size(1) == 0 &&
                  q.size(1) / k.size(1) <= kMaxGroup, "decode_attn: q, k and v shapes disagree");
  const auto qt = q.scalar_type(), ct = k.scalar_type();
  TORCH_CHECK(ct == v.scalar_type() && (qt == ct || qt == at::kFloat) && (ct == at::kBFloat16 || ct == at::kFloat),
              "decode_attn: a bf16 or fp32 cache, the query in its dtype or fp32");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == q.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous() && lens.dim() == 1 && lens.size(0) == q.size(0) &&
                  lens.scalar_type() == at::kLong && lens.is_contiguous(),
              "decode_attn: slots [B, L] and lens [B] int64");
  TORCH_CHECK(window >= 0, "decode_attn: window >= 0");
  TORCH_CHECK(!sinks || (sinks->dim() == 1 && sinks->size(0) == q.size(1) && sinks->scalar_type() == at::kFloat &&
                         sinks->is_contiguous()), "decode_attn: sinks [H] fp32");
  const int64_t* lp = lens.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= slots.size(1), "decode_attn: a row's length is outside 1..", slots.size(1));
  at::Tensor out = at::empty_like(q);
  const AttnArgs a{k.size(1), q.size(1) / k.size(1), slots.size(1), static_cast<float>(scale),
                   slots.const_data_ptr<int64_t>(), lp, window, sinks ? sinks->const_data_ptr<float>() : nullptr};
  if (qt == at::kBFloat16)
    by_dim(a, static_cast<at::BFloat16*>(nullptr), static_cast<at::BFloat16*>(nullptr), q, k, v, out);
  else if (ct == at::kBFloat16)
    by_dim(a, static_cast<float*>(nullptr), static_cast<at::BFloat16*>(nullptr), q, k, v, out);
  else
    by_dim(a, static_cast<float*>(nullptr), static_cast<float*>(nullptr), q, k, v, out);
  return out;
}

// The op for a build whose kernel for one (row, KV head) is `Kernel<Q, C, NV>::fn`, NV vectors of `Lanes` floats a
// head: head dims 32, 64, 96, 128 and 256.
template <int Lanes, template <typename, typename, int> class Kernel>
at::Tensor decode_attn_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                          const at::Tensor& lens, double scale, int64_t window,
                          const std::optional<at::Tensor>& sinks) {
  const auto by_dim = [](const AttnArgs& a, auto* qt, auto* ct, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, at::Tensor& out) {
    using Q = std::remove_pointer_t<decltype(qt)>;
    using C = std::remove_pointer_t<decltype(ct)>;
    switch (q.size(2)) {
      case 32: return run_rows<Q, C, Kernel<Q, C, 32 / Lanes>::fn>(a, q, k, v, out);
      case 64: return run_rows<Q, C, Kernel<Q, C, 64 / Lanes>::fn>(a, q, k, v, out);
      case 96: return run_rows<Q, C, Kernel<Q, C, 96 / Lanes>::fn>(a, q, k, v, out);
      case 128: return run_rows<Q, C, Kernel<Q, C, 128 / Lanes>::fn>(a, q, k, v, out);
      case 256: return run_rows<Q, C, Kernel<Q, C, 256 / Lanes>::fn>(a, q, k, v, out);
      default: TORCH_CHECK(false, "decode_attn: head_dim 32, 64, 96, 128 or 256, got ", q.size(2));
    }
  };
  return decode_attn_checked(q, k, v, slots, lens, scale, window, sinks, by_dim);
}

}  // namespace minisgl
