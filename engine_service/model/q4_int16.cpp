// bfloat16 activations times 4-bit weights in GGUF's Q4_1 groups, as integer dot products, for
// CPUs with AVX-512 VNNI and BF16: engine_service/model/q4_matmul.py builds this file at run time,
// twice (the int16 kernel, and with -DQ4_ACTIVATION_BITS=8 the int8 one), and says why it is there.
//
// The weights are laid out for the dot-product instructions (q4_matmul.pack_int16): output rows in
// tiles of 16 and, within a tile, 64 bytes for each 8 inputs k..k+7: 16-bit word 2 l + p holds row
// l's values k + 2 n + p in its nibbles n = 0..3; each group's scale s and low, the 16 rows' side by
// side, in float16, as GGUF's Q4_1 stores them (so a Q4_1 file's are kept exactly, in the bytes
// torch's kernel reads for its bfloat16 ones). x is quantized for the call per group of 32 inputs,
// so a group's sum is
//   sum_i (q_i s + low) (xq_i d) = d (s sum_i q_i xq_i + low sum_i xq_i),
// the first term from the integer dot products, the second from the group's sum of xq; the sums
// over groups are float32, the output rounded to bfloat16.
// - 16 bits (d = max |x| / 32767: far finer than bfloat16's own 8 bits): a 64-byte load gives,
//   after a shift and a mask each, four vectors of 16 rows x 2 inputs, and `vpdpwssd` multiplies
//   each by 2 inputs of x broadcast to the 16 rows, summing in 32 bits (15 x 32767 x 32 < 2^31).
// - 8 bits (d = max |x| / 127: llama.cpp's Q8_1, what it multiplies Q4_1 by): the same bytes' low
//   nibbles hold row l's values k, k+4, k+1, k+5 and their high nibbles k+2, k+6, k+3, k+7, so a
//   mask, and a shift and a mask, give two vectors of 16 rows x 4 inputs as unsigned bytes, and
//   `vpdpbusd` multiplies each by 4 inputs of x (signed bytes, stored in that order) broadcast to
//   the 16 rows, summing in 32 bits (15 x 127 x 32 < 2^31): half the instructions for the same
//   128 values.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#ifndef Q4_ACTIVATION_BITS
#define Q4_ACTIVATION_BITS 16
#endif

namespace {

#if Q4_ACTIVATION_BITS == 8
using Act = int8_t;  // x's quantized values
constexpr float ACT_MAX = 127.0f;
constexpr const char* NAME = "q4_int8_matmul";
#else
using Act = int16_t;
constexpr float ACT_MAX = 32767.0f;
constexpr const char* NAME = "q4_int16_matmul";
#endif
constexpr int64_t GROUP = 32;  // inputs a group: its scale, its low
constexpr int64_t TILE = 16;   // output rows a vector holds
constexpr int ROW_TILE = 4;    // rows of x a pass: 8 int sums, 4 float sums, 4 weight vectors
// groups of a tile's values (256 bytes each) fetched ahead: a one-row call streams its bytes, and
// the CPU's own prefetch leaves it at about 11 GB/s. SmolLM2's 120 layer projections from memory,
// 2 threads, Xeon of family 6 model 207, ms at 1 / 8 rows, none, then 4, 8, 16, 32 groups ahead:
// 5.36 / 8.50, 4.61 / 7.37, 4.09 / 7.02, 4.01 / 6.84, 4.10 / 6.89
constexpr int64_t PREFETCH = 16;

inline __m512 half_to_f32(const at::Half* x) {  // 16 float16 values, widened exactly
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

inline __m512 bf16_to_f32(const uint16_t* x) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}

// a row of x (K bfloat16) -> xq (K values; at 8 bits each 8 in the order 0 4 1 5 2 6 3 7), d (K / 32:
// the groups' scales) and dsum (d * sum of xq)
inline void quantize_row(const uint16_t* x, int64_t k, Act* xq, float* d, float* dsum) {
  for (int64_t g = 0; g < k / GROUP; ++g) {
    const __m512 a = bf16_to_f32(x + g * GROUP), b = bf16_to_f32(x + g * GROUP + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inv = _mm512_set1_ps(amax > 0 ? ACT_MAX / amax : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));  // to nearest, |qa| <= ACT_MAX
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    if constexpr (sizeof(Act) == 1) {
      const __m128i order = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * GROUP), _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(qa), order));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * GROUP + 16), _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(qb), order));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * GROUP), _mm512_cvtsepi32_epi16(qa));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * GROUP + 16), _mm512_cvtsepi32_epi16(qb));
    }
    d[g] = amax / ACT_MAX;
    dsum[g] = d[g] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  }
}

inline __m512i broadcast(const Act* p) {  // 4 bytes of x (2 inputs at 16 bits, 4 at 8), to the 16 rows
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// R rows of x against one tile of 16 output rows: out[r * out_stride + l]
template <int R>
inline void tile_rows(const Act* xq, const float* d, const float* dsum, int64_t k, const uint8_t* q,
                      const at::Half* scale, const at::Half* low, at::BFloat16* out, int64_t out_stride) {
  const int64_t groups = k / GROUP;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // two chains of dot products a row, so one row's latency is not one long chain
    __m512i even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_si512();
    // (past the tile's end it reaches the next tile's, which this thread takes next; a prefetch never faults)
    for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(q + (g + PREFETCH) * 256 + c * 64), _MM_HINT_T0);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(q + (g * 4 + c) * 64);
      if constexpr (sizeof(Act) == 1) {
        // unsigned bytes: the low nibbles hold inputs 0 4 1 5 of a row, the high ones 2 6 3 7
        const __m512i low4 = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
        const __m512i high4 = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
        for (int r = 0; r < R; ++r) {
          const Act* x = xq + r * k + g * GROUP + c * 8;
          even[r] = _mm512_dpbusd_epi32(even[r], low4, broadcast(x));
          odd[r] = _mm512_dpbusd_epi32(odd[r], high4, broadcast(x + 4));
        }
      } else {
        const __m512i nibble = _mm512_set1_epi16(0x0F);
        const __m512i w0 = _mm512_and_si512(v, nibble);
        const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        const __m512i w2 = _mm512_and_si512(_mm512_srli_epi16(v, 8), nibble);
        const __m512i w3 = _mm512_srli_epi16(v, 12);
        for (int r = 0; r < R; ++r) {
          const Act* x = xq + r * k + g * GROUP + c * 8;
          even[r] = _mm512_dpwssd_epi32(even[r], w0, broadcast(x));
          odd[r] = _mm512_dpwssd_epi32(odd[r], w1, broadcast(x + 2));
          even[r] = _mm512_dpwssd_epi32(even[r], w2, broadcast(x + 4));
          odd[r] = _mm512_dpwssd_epi32(odd[r], w3, broadcast(x + 6));
        }
      }
    }
    const __m512 s = half_to_f32(scale + g * TILE), lo = half_to_f32(low + g * TILE);
    for (int r = 0; r < R; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even[r], odd[r]));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_set1_ps(d[r * groups + g])), s, acc[r]);
      acc[r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(dsum[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)  // rounded to nearest even
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride), (__m256i)_mm512_cvtneps_pbh(acc[r]));
}

using Tile = void (*)(const Act*, const float*, const float*, int64_t, const uint8_t*, const at::Half*,
                      const at::Half*, at::BFloat16*, int64_t);
constexpr Tile TILES[ROW_TILE + 1] = {nullptr, tile_rows<1>, tile_rows<2>, tile_rows<3>, tile_rows<4>};

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                           const at::Tensor& lows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              NAME, ": x must be (rows, K) bfloat16, got ", x.sizes(), " ", x.scalar_type());
  const int64_t m = x.size(0), k = x.size(1), groups = k / GROUP;
  TORCH_CHECK(k % GROUP == 0, NAME, ": K must be a multiple of 32, got ", k);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kByte && q.size(1) == k / 8 && q.size(2) == 64 &&
                  q.is_contiguous(),
              NAME, ": weights must be contiguous (N / 16, K / 8, 64) uint8 for K = ", k, ", got ",
              q.sizes(), " ", q.scalar_type());
  const int64_t tiles = q.size(0), n = tiles * TILE;
  TORCH_CHECK(scales.sizes() == lows.sizes() && scales.dim() == 3 && scales.size(0) == tiles &&
                  scales.size(1) == groups && scales.size(2) == TILE && scales.scalar_type() == at::kHalf &&
                  lows.scalar_type() == at::kHalf && scales.is_contiguous() && lows.is_contiguous(),
              NAME, ": scales and lows must be contiguous (N / 16, K / 32, 16) float16, got ",
              scales.sizes(), " ", scales.scalar_type(), " and ", lows.sizes(), " ", lows.scalar_type());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  // x quantized once a call into the calling thread's buffer: its values, then each group's d and
  // dsum (no tensors: a one-row step makes 120 calls, and each allocation costs)
  thread_local std::vector<Act> buffer;
  constexpr int64_t line = 64 / sizeof(Act);  // values a 64-byte line
  const int64_t values = (m * k + line - 1) / line * line;  // the floats 64-byte aligned after them
  const size_t need = values + (2 * m * groups + 16) * sizeof(float) / sizeof(Act);
  if (buffer.size() < need) buffer.resize(need);
  Act* xqp = buffer.data();
  float* dp = reinterpret_cast<float*>(xqp + values);
  float* dsp = dp + m * groups;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.const_data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < m; ++r) quantize_row(xp + r * k, k, xqp + r * k, dp + r * groups, dsp + r * groups);
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const at::Half* scp = scales.const_data_ptr<at::Half>();
  const at::Half* lp = lows.const_data_ptr<at::Half>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  // grain: at least 2 tiles (32 output rows) a thread
  at::parallel_for(0, tiles, 2, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r = 0; r < m; r += ROW_TILE) {
        const int64_t rows = std::min<int64_t>(ROW_TILE, m - r);
        TILES[rows](xqp + r * k, dp + r * groups, dsp + r * groups, k, qp + t * (k / 8) * 64,
                    scp + t * groups * TILE, lp + t * groups * TILE, op + r * n + t * TILE, n);
      }
    }
  });
  return out;
}

}  // namespace

#if Q4_ACTIVATION_BITS == 8
TORCH_LIBRARY(engine_q4_int8, m) {
  m.def("matmul(Tensor x, Tensor q, Tensor scales, Tensor lows) -> Tensor");
}

TORCH_LIBRARY_IMPL(engine_q4_int8, CPU, m) {
  m.impl("matmul", &q4_matmul);
}
#else
TORCH_LIBRARY(engine_q4_int16, m) {
  m.def("matmul(Tensor x, Tensor q, Tensor scales, Tensor lows) -> Tensor");
}

TORCH_LIBRARY_IMPL(engine_q4_int16, CPU, m) {
  m.impl("matmul", &q4_matmul);
}
#endif
