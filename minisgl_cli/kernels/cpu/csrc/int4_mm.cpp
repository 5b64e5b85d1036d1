// minisgl::int4_mm, the int4 decode GEMM of the CPU default mode (kernels/cpu/int4.py says when it runs).
//
// y[r, n] = sum over groups g of 32 inputs: scale[n, g] * (x[r, g] . q[n, g]) + min[n, g] * sum(x[r, g]),
// the Q4_1 form w = scale * q + min with q in 0..15. The dot x . q runs on AVX512-BF16 pair dot products: q is
// exact in bf16 and x is bf16 already, so each product is exact; a group's dot starts from zero, and every row
// goes through the same instructions in the same order whatever the rows beside it (the decode step's batch
// invariance). A weight vector is unpacked once for up to 12 rows: ATen's _weight_int4pack_mm_for_cpu unpacks
// and scales it again for every 4 rows, so its 16-row product costs ~4x its one row.
//
// Layouts (cpu_int4.pack): q [N / 16, K / 2, 16] bytes, lane i of a block holding the inputs 2j (low nibble) and
// 2j + 1 (high) of its output channel i; scale and min [N / 16, K / 32, 2, 16] fp16 (GGUF's own Q4_1 precision).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <vector>

#include "vec.h"

namespace {

using minisgl::to_bf16;

constexpr int kGroup = 32;  // inputs per scale: 16 pairs

struct Args {
  const uint32_t* x;  // [M, K / 2] bf16 pairs
  const float* xsum;  // [M, K / 32]
  const uint8_t* q;
  const at::Half* sm;
  at::BFloat16* out;  // [M, N]
  int64_t K, N;
};

// Rows r0 .. r0 + R - 1, the C blocks of 16 channels from block b0.
template <int R, int C>
void tile(const Args& a, int64_t r0, int64_t b0) {
  // bf16 of 0..15, twice: vpermw reads an index's low 5 bits, and a pair's low word holds both nibbles
  const __m512i lut = _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0,
                                       0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0, 0x4170, 0x4160, 0x4150, 0x4140,
                                       0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040,
                                       0x4000, 0x3f80, 0);
  const int64_t K2 = a.K / 2, G = a.K / kGroup;
  const uint32_t* x = a.x + r0 * K2;
  const float* xs = a.xsum + r0 * G;
  __m512 acc[R * C];
#pragma GCC unroll 64
  for (int i = 0; i < R * C; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 dot[R * C];
#pragma GCC unroll 64
    for (int i = 0; i < R * C; ++i) dot[i] = _mm512_setzero_ps();
    for (int64_t j = g * (kGroup / 2); j < (g + 1) * (kGroup / 2); ++j) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const uint8_t* qb = a.q + ((b0 + c) * K2 + j) * 16;
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)));
        // low word: index b (its low nibble picks the value), high word: b >> 4
        const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), lut);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
          dot[r * C + c] = _mm512_dpbf16_ps(dot[r * C + c], w, (__m512bh)_mm512_set1_epi32(x[r * K2 + j]));
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const at::Half* sm = a.sm + ((b0 + c) * G + g) * 32;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm)));
      const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + 16)));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        acc[r * C + c] = _mm512_fmadd_ps(scale, dot[r * C + c], acc[r * C + c]);
        acc[r * C + c] = _mm512_fmadd_ps(low, _mm512_set1_ps(xs[r * G + g]), acc[r * C + c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.out + (r0 + r) * a.N + (b0 + c) * 16), to_bf16(acc[r * C + c]));
}

// R rows over blocks [b0, b1): C blocks at a time where R leaves registers for them, then one at a time.
template <int R>
void rows(const Args& a, int64_t r0, int64_t b0, int64_t b1) {
  constexpr int C = R >= 8 ? 1 : R >= 4 ? 2 : 4;
  for (; b0 + C <= b1; b0 += C) tile<R, C>(a, r0, b0);
  for (; b0 < b1; ++b0) tile<R, 1>(a, r0, b0);
}

constexpr int64_t kMaxRows = 12;  // rows a weight vector serves at once (the registers' limit)

// Rows [0, M) over blocks [b0, b1), in as few equal runs as kMaxRows allows.
void all_rows(const Args& a, int64_t M, int64_t b0, int64_t b1) {
  const int64_t runs = (M + kMaxRows - 1) / kMaxRows;
  for (int64_t i = 0, r0 = 0; i < runs; ++i) {
    const int64_t n = (M - r0) / (runs - i);
    switch (n) {
      case 1: rows<1>(a, r0, b0, b1); break;
      case 2: rows<2>(a, r0, b0, b1); break;
      case 3: rows<3>(a, r0, b0, b1); break;
      case 4: rows<4>(a, r0, b0, b1); break;
      case 5: rows<5>(a, r0, b0, b1); break;
      case 6: rows<6>(a, r0, b0, b1); break;
      case 7: rows<7>(a, r0, b0, b1); break;
      case 8: rows<8>(a, r0, b0, b1); break;
      case 9: rows<9>(a, r0, b0, b1); break;
      case 10: rows<10>(a, r0, b0, b1); break;
      case 11: rows<11>(a, r0, b0, b1); break;
      default: rows<12>(a, r0, b0, b1); break;
    }
    r0 += n;
  }
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "int4_mm: x [M, K] bf16");
  const int64_t M = x.size(0), K = x.size(1), NB = q.size(0);
  TORCH_CHECK(K % kGroup == 0 && q.dim() == 3 && q.size(1) * 2 == K && q.size(2) == 16 && q.is_contiguous() &&
                  q.scalar_type() == at::kByte,
              "int4_mm: q [N / 16, K / 2, 16] uint8");
  TORCH_CHECK(sm.scalar_type() == at::kHalf && sm.is_contiguous() && sm.numel() == NB * (K / kGroup) * 32,
              "int4_mm: scale and min [N / 16, K / 32, 2, 16] fp16");
  at::Tensor out = at::empty({M, NB * 16}, x.options());
  const int64_t G = K / kGroup;
  std::vector<float> xsum(M * G);  // each row's group sums, in order (the same whatever the other rows)
  const auto* xb = x.const_data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0;
      for (int k = 0; k < kGroup; ++k) s += static_cast<float>(xb[r * K + g * kGroup + k]);
      xsum[r * G + g] = s;
    }
  const Args a{reinterpret_cast<const uint32_t*>(xb), xsum.data(), q.const_data_ptr<uint8_t>(),
               sm.const_data_ptr<at::Half>(), out.data_ptr<at::BFloat16>(), K, NB * 16};
  // each thread its own run of output channels, all rows: every weight is read from memory once
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) { all_rows(a, M, b0, b1); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(minisgl, CPU, m) { m.impl("int4_mm", int4_mm); }
