// minisgl::decode_attn for CPUs with AVX2 and FMA but no AVX-512 BF16 (kernels/cpu/csrc/decode_attn.cpp is the AVX-512
// build, and says what the op computes and why it exists): the same algorithm in 8-lane vectors. A row's result
// depends on its own query, keys and length alone: each (row, KV head) runs on one thread over exactly its keys in
// one order, whatever the rows beside it, the thread count or the slots' padding. Scores, softmax and the weighted
// sum are fp32.
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../decode_attn.h"

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // exact
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {  // to nearest even, as ATen rounds (NaN aside: none reach here)
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)), x), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// Lanes summed in one fixed order.
inline float reduce_add(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor series to r^7, times 2^n built in the
// exponent bits (x is clamped at -87, where 2^n is still a normal float: exp(-87) ~ 1.6e-38 stands for 0).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2's high bits: n * it is exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
}

using minisgl::kMaxGroup;
using Args = minisgl::AttnArgs;

// One (row b, KV head h): its G query heads of NV x 8 dims each (query and output Q, cache C).
template <typename Q, typename C, int NV>
void one(const Args& a, const Q* q, const C* k, const C* v, Q* out, int64_t b, int64_t h, std::vector<float>& sc) {
  constexpr int D = NV * 8;
  const int64_t first = minisgl::first_key(a, b);  // past a sliding window's start
  const int64_t G = a.G, L = a.lens[b] - first;
  const int64_t* slots = a.slots + b * a.Lmax + first;
  const int64_t head0 = (b * a.Hkv + h) * G;
  sc.resize(G * L);
  for (int64_t j = 0; j < L; ++j) {  // scores (the query reloaded per key: 16 heads x 32 vectors do not fit)
    const C* kp = k + (slots[j] * a.Hkv + h) * D;
    for (int64_t g = 0; g < G; ++g) {
      const Q* qp = q + (head0 + g) * D;
      __m256 acc = _mm256_mul_ps(load8(qp), load8(kp));
      for (int i = 1; i < NV; ++i) acc = _mm256_fmadd_ps(load8(qp + i * 8), load8(kp + i * 8), acc);
      sc[g * L + j] = reduce_add(acc) * a.scale;
    }
  }
  float sum[kMaxGroup];
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t g = 0; g < G; ++g) {  // softmax's weights, unnormalised
    float* s = sc.data() + g * L;
    float m = s[0];
    for (int64_t j = 1; j < L; ++j) m = s[j] > m ? s[j] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; j += 8) {
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(L - j)), lane);
      const __m256 keep = _mm256_castsi256_ps(mask);
      const __m256 p = _mm256_and_ps(keep, exp_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(s + j, mask), mv)));
      _mm256_maskstore_ps(s + j, mask, p);
      total = _mm256_add_ps(total, p);
    }
    // a sink joins the denominator only: exp(sink - m) beside the keys' weights
    sum[g] = reduce_add(total) + (a.sinks != nullptr ? std::exp(a.sinks[h * G + g] - m) : 0.0f);
  }
  for (int64_t g = 0; g < G; ++g) {  // the weighted sum of the values, a query head at a time
    __m256 acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; ++j) {
      const C* vp = v + (slots[j] * a.Hkv + h) * D;
      const __m256 w = _mm256_set1_ps(sc[g * L + j]);
      for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(w, load8(vp + i * 8), acc[i]);
    }
    const __m256 total = _mm256_set1_ps(sum[g]);
    for (int i = 0; i < NV; ++i) store8(out + (head0 + g) * D + i * 8, _mm256_div_ps(acc[i], total));
  }
}

template <typename Q, typename C, int NV>
struct Kernel {  // one() as decode_attn_op takes it
  static constexpr auto fn = &one<Q, C, NV>;
};

at::Tensor decode_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                       const at::Tensor& lens, double scale, int64_t window,
                       const std::optional<at::Tensor>& sinks) {
  return minisgl::decode_attn_op<8, Kernel>(q, k, v, slots, lens, scale, window, sinks);
}

}  // namespace

TORCH_LIBRARY_IMPL(minisgl, CPU, m) { m.impl("decode_attn", decode_attn); }
