// bfloat16 activations times 4-bit weights in GGUF's Q4_1 groups on AMX tiles, for calls of more
// rows than the int16 kernel serves (decode steps of 9-32 rows, short prompts, small mixed steps),
// on CPUs with AMX-BF16: engine_service/model/q4_matmul.py builds this file at run time and says why
// it is there.
//
// It reads the int16 kernel's copies (q4_int16.cpp, q4_matmul.pack_int16), whose layout is already
// AMX's: within a tile of 16 output rows, the 64 bytes for inputs k..k+7, shifted by 4 n and masked,
// give 32 16-bit lanes, lane 2 l + p holding row l's value k + 2 n + p; that is one row of an AMX
// B tile (16 pairs of inputs x 16 output rows) once each lane is widened to bfloat16. So a group of
// 32 inputs of a tile (256 bytes) becomes one B tile of 1 KB: w = q * scale + low in float32 (a
// product, then a sum, compiled unfused: the loader's own arithmetic), rounded to bfloat16, the
// same values as the model's bfloat16 weights where they come from a Q4_1 file. Each thread takes
// panels of 32 output rows, widens 8 groups of a panel at a time (16 KB, in L1) and multiplies
// every 32 rows of x by them with `tdpbf16ps` (two A tiles, two B tiles, four C tiles), summing in
// float32; the output is rounded to bfloat16. A call reads the 4-bit copies (a quarter of the
// bfloat16 weights' bytes) and no bfloat16 weight. Widening is half a call's time (SmolLM2's
// layers at 8 rows, 2 threads, Xeon 207: 8.3 of 16.6 ms), and it does not overlap the tile
// products; docs/decode-speed.md, "An AMX int4 kernel", has the figures.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t GROUP = 32;  // inputs a group: its scale, its low; one B tile's pairs of inputs
constexpr int64_t TILE = 16;   // output rows a tile holds
constexpr int64_t ROWS = 32;   // rows of x a pass: two A tiles, four C tiles
constexpr int64_t B_TILE = TILE * GROUP;  // bfloat16 values of a widened B tile (1 KB)
constexpr int64_t SPAN = 8;  // groups widened at a time: a panel's 16 B tiles, 16 KB, stay in L1

constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;  // Linux: ask for an extended state component
constexpr long XFEATURE_XTILEDATA = 18;       // the AMX tiles' data

struct TileConfig {  // palette 1's 64-byte configuration
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool amx_permitted() {  // once a process: Linux hands the tiles' state to a process that asks
  static const bool permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return permitted;
}

void configure_tiles() {  // every tile 16 rows of 64 bytes: C 16 x 16 float32, A 16 x 32 and B 16 x 32 bfloat16
  TileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// the groups of one tile of 16 output rows, widened: `groups` B tiles of 1 KB into dst
void widen_tile(const uint8_t* q, const at::Half* scale, const at::Half* low, int64_t groups, uint16_t* dst) {
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  // lanes 2 l, 2 l + 1 take row l's scale and low: rows 0..7 in the lower 16 lanes, 8..15 in the upper
  const __m512i lower = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i upper = _mm512_add_epi32(lower, _mm512_set1_epi32(8));
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g * TILE)));
    const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + g * TILE)));
    const __m512 s0 = _mm512_permutexvar_ps(lower, s), s1 = _mm512_permutexvar_ps(upper, s);
    const __m512 lo0 = _mm512_permutexvar_ps(lower, lo), lo1 = _mm512_permutexvar_ps(upper, lo);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(q + (g * 4 + c) * 64);
      for (int n = 0; n < 4; ++n) {
        const __m512i w = _mm512_and_si512(_mm512_srli_epi16(v, 4 * n), nibble);
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)));
        const __m512 f0 = _mm512_add_ps(_mm512_mul_ps(w0, s0), lo0);
        const __m512 f1 = _mm512_add_ps(_mm512_mul_ps(w1, s1), lo1);
        // B tile row c * 4 + n: inputs k + 2 n, k + 2 n + 1 (k = 8 c) of the 16 rows, rounded to nearest even
        _mm512_storeu_si512(dst + g * B_TILE + (c * 4 + n) * 32, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
      }
    }
  }
}

// C tile (16 x 16 float32 in `c`) -> rows of out (bfloat16), `rows` of them
inline void store_rows(const float* c, int64_t rows, at::BFloat16* out, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * stride), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + r * 16)));
}

at::Tensor q4_amx_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& lows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "q4_amx_matmul: x must be (rows, K) bfloat16, got ", x.sizes(), " ", x.scalar_type());
  const int64_t m = x.size(0), k = x.size(1), groups = k / GROUP;
  TORCH_CHECK(k % GROUP == 0, "q4_amx_matmul: K must be a multiple of 32, got ", k);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kByte && q.size(1) == k / 8 && q.size(2) == 64 &&
                  q.is_contiguous(),
              "q4_amx_matmul: weights must be contiguous (N / 16, K / 8, 64) uint8 for K = ", k, ", got ",
              q.sizes(), " ", q.scalar_type());
  const int64_t tiles = q.size(0), n = tiles * TILE;
  TORCH_CHECK(scales.sizes() == lows.sizes() && scales.dim() == 3 && scales.size(0) == tiles &&
                  scales.size(1) == groups && scales.size(2) == TILE && scales.scalar_type() == at::kHalf &&
                  lows.scalar_type() == at::kHalf && scales.is_contiguous() && lows.is_contiguous(),
              "q4_amx_matmul: scales and lows must be contiguous (N / 16, K / 32, 16) float16, got ",
              scales.sizes(), " ", scales.scalar_type(), " and ", lows.sizes(), " ", lows.scalar_type());
  TORCH_CHECK(amx_permitted(), "q4_amx_matmul: Linux refused this process the AMX tiles (arch_prctl ARCH_REQ_XCOMP_PERM)");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  // x's rows in whole passes of 32, the rows past m zero (a tile load reads 16 rows)
  const int64_t padded = (m + ROWS - 1) / ROWS * ROWS;
  at::Tensor xs = x.contiguous();
  if (padded != m) xs = at::constant_pad_nd(xs, {0, 0, 0, padded - m});
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xs.const_data_ptr<at::BFloat16>());
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const at::Half* scp = scales.const_data_ptr<at::Half>();
  const at::Half* lp = lows.const_data_ptr<at::Half>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t panels = (tiles + 1) / 2;  // two tiles of output rows a panel, the last maybe one
  const int64_t passes = padded / ROWS;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t widened[2 * SPAN * B_TILE];  // a panel's B tiles for SPAN groups: 16 KB, in L1
    thread_local std::vector<float> sums;  // the passes' C tiles between spans, where there are several passes
    if (passes > 1 && sums.size() < static_cast<size_t>(passes * 4 * TILE * TILE)) sums.resize(passes * 4 * TILE * TILE);
    alignas(64) float c[4][TILE * TILE];
    configure_tiles();
    for (int64_t p = begin; p < end; ++p) {
      const int64_t t0 = 2 * p, pair = std::min<int64_t>(2, tiles - t0);
      const uint16_t* b0 = widened;
      const uint16_t* b1 = widened + (pair == 2 ? SPAN * B_TILE : 0);  // a lone tile: its product twice, one kept
      for (int64_t g0 = 0; g0 < groups; g0 += SPAN) {
        const int64_t span = std::min<int64_t>(SPAN, groups - g0);
        for (int64_t t = 0; t < pair; ++t)
          widen_tile(qp + (t0 + t) * (k / 8) * 64 + g0 * 256, scp + ((t0 + t) * groups + g0) * TILE,
                     lp + ((t0 + t) * groups + g0) * TILE, span, widened + t * SPAN * B_TILE);
        for (int64_t r = 0; r < passes; ++r) {
          // one pass keeps its C tiles in the tiles from span to span; several store and reload theirs
          float* kept = passes > 1 ? sums.data() + r * 4 * TILE * TILE : nullptr;
          if (g0 == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          } else if (kept != nullptr) {
            _tile_loadd(0, kept, 64);
            _tile_loadd(1, kept + TILE * TILE, 64);
            _tile_loadd(2, kept + 2 * TILE * TILE, 64);
            _tile_loadd(3, kept + 3 * TILE * TILE, 64);
          }
          const uint16_t* a = xp + r * ROWS * k + g0 * GROUP;
          for (int64_t g = 0; g < span; ++g) {
            _tile_loadd(4, a + g * GROUP, k * 2);
            _tile_loadd(5, a + TILE * k + g * GROUP, k * 2);
            _tile_loadd(6, b0 + g * B_TILE, 64);
            _tile_loadd(7, b1 + g * B_TILE, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          const bool last = g0 + span == groups;
          if (kept != nullptr && !last) {
            _tile_stored(0, kept, 64);
            _tile_stored(1, kept + TILE * TILE, 64);
            _tile_stored(2, kept + 2 * TILE * TILE, 64);
            _tile_stored(3, kept + 3 * TILE * TILE, 64);
          }
          if (last) {
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
            const int64_t row = r * ROWS;
            const int64_t top = std::clamp<int64_t>(m - row, 0, TILE), bottom = std::clamp<int64_t>(m - row - TILE, 0, TILE);
            at::BFloat16* o = op + row * n + t0 * TILE;
            store_rows(c[0], top, o, n);
            store_rows(c[2], bottom, o + TILE * n, n);
            if (pair == 2) {
              store_rows(c[1], top, o + TILE, n);
              store_rows(c[3], bottom, o + TILE * n + TILE, n);
            }
          }
        }
      }
    }
    _tile_release();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(engine_q4_amx, m) {
  m.def("matmul(Tensor x, Tensor q, Tensor scales, Tensor lows) -> Tensor");
}

TORCH_LIBRARY_IMPL(engine_q4_amx, CPU, m) {
  m.impl("matmul", &q4_amx_matmul);
}
