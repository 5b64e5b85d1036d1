// minisgl::decode_attn, the CPU decode attention over the paged KV cache (attention/torch_backend.py says when it
// runs).
//
// out[b, h] = softmax(scale * q[b, h] . K_b) V_b over the first lens[b] keys of row b (its last `window` of them where
// window > 0; with `sinks`, exp(sinks[h]) joins the softmax's denominator only: gpt-oss), at the pool slots
// slots[b, :lens[b]] of k and v [slots, Hkv, D]: no gathered copy of the keys. A row's result depends on its own
// query, keys and length alone. Each (row, KV head) runs on one thread over exactly its keys in one order, whatever
// the rows beside it, the thread count or the slots' padding; torch's SDPA, given the keys gathered and padded to
// the batch's longest row, rounds a row by that padded length, so a request's decode rounded otherwise beside a
// longer one, and a verify step's rows otherwise than decode steps' (scheduler/speculative.py). Scores, softmax and
// the weighted sum are fp32 (a 16-bit cache's products exact); the query heads of a KV head (GQA) share its loads.
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "decode_attn.h"

#include "vec.h"

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) { return minisgl::from_bf16(p); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), minisgl::to_bf16(v));
}

// exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor series to r^7 (error < 1e-8 of it),
// times 2^n by scalef (which underflows to 0 in order).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2's high bits: n * it is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

using minisgl::kMaxGroup;
using Args = minisgl::AttnArgs;

// One (row b, KV head h): its G query heads of NV x 16 dims each (query and output Q, cache C).
template <typename Q, typename C, int NV>
void one(const Args& a, const Q* q, const C* k, const C* v, Q* out, int64_t b, int64_t h, std::vector<float>& sc) {
  constexpr int D = NV * 16;
  const int64_t first = minisgl::first_key(a, b);  // past a sliding window's start
  const int64_t G = a.G, L = a.lens[b] - first;
  const int64_t* slots = a.slots + b * a.Lmax + first;
  const int64_t head0 = (b * a.Hkv + h) * G;  // the first of its query heads in q / out [B, H, D]
  __m512 qv[kMaxGroup][NV];
  for (int64_t g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) qv[g][i] = load16(q + (head0 + g) * D + i * 16);
  sc.resize(G * L);
  for (int64_t j = 0; j < L; ++j) {  // scores
    const C* kp = k + (slots[j] * a.Hkv + h) * D;
    __m512 kv[NV];
    for (int i = 0; i < NV; ++i) kv[i] = load16(kp + i * 16);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(qv[g][i], kv[i], acc);
      sc[g * L + j] = _mm512_reduce_add_ps(acc) * a.scale;
    }
  }
  float sum[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {  // softmax's weights, unnormalised
    float* s = sc.data() + g * L;
    float m = s[0];
    for (int64_t j = 1; j < L; ++j) m = s[j] > m ? s[j] : m;
    const __m512 mv = _mm512_set1_ps(m);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; j += 16) {
      const __mmask16 lanes = L - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (L - j)) - 1);
      const __m512 p = _mm512_maskz_mov_ps(lanes, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + j), mv)));
      _mm512_mask_storeu_ps(s + j, lanes, p);
      total = _mm512_add_ps(total, p);
    }
    // a sink joins the denominator only: exp(sink - m) beside the keys' weights
    sum[g] = _mm512_reduce_add_ps(total) + (a.sinks != nullptr ? std::exp(a.sinks[h * G + g] - m) : 0.0f);
  }
  __m512 acc[kMaxGroup][NV];
  for (int64_t g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {  // the weighted sum of the values
    const C* vp = v + (slots[j] * a.Hkv + h) * D;
    __m512 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load16(vp + i * 16);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(sc[g * L + j]);
      for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_fmadd_ps(w, vv[i], acc[g][i]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m512 total = _mm512_set1_ps(sum[g]);
    for (int i = 0; i < NV; ++i) store16(out + (head0 + g) * D + i * 16, _mm512_div_ps(acc[g][i], total));
  }
}

template <typename Q, typename C, int NV>
struct Kernel {  // one() as decode_attn_op takes it
  static constexpr auto fn = &one<Q, C, NV>;
};

at::Tensor decode_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                       const at::Tensor& lens, double scale, int64_t window,
                       const std::optional<at::Tensor>& sinks) {
  return minisgl::decode_attn_op<16, Kernel>(q, k, v, slots, lens, scale, window, sinks);
}

}  // namespace

TORCH_LIBRARY_IMPL(minisgl, CPU, m) { m.impl("decode_attn", decode_attn); }
