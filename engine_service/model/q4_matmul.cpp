// float32 activations times 4-bit weights in GGUF's Q4_1 blocks, for CPUs with AVX2 and FMA:
// engine_service/model/q4_matmul.py builds this file at run time and says why it is there.
//
// A weight row of K inputs is K / 32 blocks; block b of row n holds 16 bytes, byte j carrying value
// j in its low nibble and value j + 16 in its high one (GGUF's order), and w = q * scale + low.
// Each block's 32 values are widened to float32 in registers, scaled and offset there (the float32
// model's dequantized weights, never written out) and multiplied by up to ROW_TILE rows of x; a
// weight row is read from memory once a call (from L1 for each further tile of rows), and the
// output rows are split between torch's threads.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t ROW_TILE = 8;  // rows of x a pass keeps in registers: 8 sums, 4 weight vectors, 1 load

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int R>
inline void row_tile(const float* x, int64_t k, int64_t blocks, const uint8_t* q, const float* scale,
                     const float* low, float* out, int64_t out_stride) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
    const __m128i lo = _mm_and_si128(raw, nibble);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
    const __m256 s = _mm256_set1_ps(scale[b]);
    const __m256 l = _mm256_set1_ps(low[b]);
    // the block's 32 weights, q * scale + low, as the float32 model's dequantized values
    const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), s, l);
    const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), s, l);
    const __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), s, l);
    const __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), s, l);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * k + b * BLOCK;
      if constexpr (R >= 4) {  // R chains of FMAs in flight hide each one's latency
        acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb), acc[r]);
        acc[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), acc[r]);
        acc[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), acc[r]);
        acc[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), acc[r]);
      } else {  // fewer: the block's sum apart, so a row's chain is one add a block, not four FMAs
        __m256 d = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));
        d = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), d);
        d = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), d);
        d = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), d);
        acc[r] = _mm256_add_ps(acc[r], d);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]);
}

using Tile = void (*)(const float*, int64_t, int64_t, const uint8_t*, const float*, const float*, float*,
                      int64_t);
constexpr Tile TILES[ROW_TILE + 1] = {nullptr,         row_tile<1>, row_tile<2>, row_tile<3>, row_tile<4>,
                                      row_tile<5>,     row_tile<6>, row_tile<7>, row_tile<8>};

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                     const at::Tensor& lows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q4_matmul: x must be (rows, K) float32, got ",
              x.sizes(), " ", x.scalar_type());
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0), blocks = k / BLOCK;
  TORCH_CHECK(k % BLOCK == 0, "q4_matmul: K must be a multiple of 32, got ", k);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.size(1) == k / 2 && q.is_contiguous(),
              "q4_matmul: weights must be contiguous (N, K / 2) uint8 for K = ", k, ", got ", q.sizes());
  TORCH_CHECK(scales.sizes() == lows.sizes() && scales.dim() == 2 && scales.size(0) == n &&
                  scales.size(1) == blocks && scales.scalar_type() == at::kFloat &&
                  lows.scalar_type() == at::kFloat && scales.is_contiguous() && lows.is_contiguous(),
              "q4_matmul: scales and lows must be contiguous (N, K / 32) float32, got ", scales.sizes(),
              " and ", lows.sizes());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const float* xp = xc.const_data_ptr<float>();
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const float* scp = scales.const_data_ptr<float>();
  const float* lp = lows.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  // grain: at least 16 output rows a thread, so a narrow projection is not split into slivers
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t r = 0; r < m; r += ROW_TILE) {
        const int64_t rows = std::min(ROW_TILE, m - r);
        TILES[rows](xp + r * k, k, blocks, qp + j * (k / 2), scp + j * blocks,
                    lp + j * blocks, op + r * n + j, n);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(engine_q4, m) {
  m.def("matmul(Tensor x, Tensor q, Tensor scales, Tensor lows) -> Tensor");
}

TORCH_LIBRARY_IMPL(engine_q4, CPU, m) {
  m.impl("matmul", &q4_matmul);
}
