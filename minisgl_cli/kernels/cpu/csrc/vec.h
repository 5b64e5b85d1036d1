// AVX-512 helpers shared by minisgl's CPU kernels: bf16 <-> fp32 as ATen converts.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace minisgl {

// fp32 -> bf16 as ATen rounds (vec::cvtfp32_bf16): to nearest even on the bits, NaN to 0xffff.
inline __m256i to_bf16(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)), x), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0xffff), r);
  return _mm512_cvtepi32_epi16(r);
}

// 16 bf16 -> fp32 (exact).
inline __m512 from_bf16(const void* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

}  // namespace minisgl
