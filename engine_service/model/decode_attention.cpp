// Attention of decoding rows, one query token a row: row r's G query heads that share a KV head
// against that head's keys and values at the row's positions 0..lengths[r]-1, read in place from
// the KV cache. What scaled_dot_product_attention computes with the decode mask (a prefix of each
// row), without its machinery: torch's CPU flash kernel runs two small matrix products and the
// softmax's buffers for every (row, KV head), whose fixed cost is most of the call at one query
// token (SmolLM2 in bfloat16, 8 rows at 200 positions, 2 threads, Xeon 207: 260-277 us a layer,
// this kernel 97; docs/decode-speed.md, "Decode attention in the engine's kernel").
//
// One task a (row, KV head): its G queries, scaled, held in float32 vectors; the keys in blocks of
// BLOCK positions: each key widened to float32 once and dotted with the G queries, then the block's
// softmax in float32 (online: a running maximum and sum, the accumulators rescaled when the maximum
// moves), then each value widened once and added into the G accumulators with its weights. The
// output is rounded to the query's dtype once, at the end. Four keys are scored at a time, their
// four horizontal sums in one set of shuffles. While a block's keys are scored its values are
// fetched, and while its values are added the next block's keys (8 rows at 200 / 1,000 positions:
// 101-112 / 486-512 us against 145-147 / 663-669 without, microbenchmark, layers cycled).
// Compiled at start-up for AVX2 with FMA, through ATen's 8-lane vectors: on the Xeon 207,
// AVX-512's 16 lanes were no faster (8 rows at 200 / 1,000 positions: 96 / 530 us against 97 /
// 444, microbenchmark; 141 / 674 against 102 / 466 before the four-key sums), and every CPU class
// the engine meets has AVX2. A second build adds AVX-512 BF16 (`attend_bf16` below, bfloat16
// only): its keys are dotted in bfloat16 pairs, not widened. SmolLM2's heads, 2 threads, the
// cache's 30 layers cycled, AMD EPYC of the Zen 4 class, us a layer, the AVX2 build before the
// vectorized softmax / after it / the AVX-512 BF16 build: 1 row at 200 positions 11.6 / 10.4 / 8.3,
// at 1,000 45.7 / 39.1 / 28.0; 8 rows at 340 136.7 / 127.1 / 98.0; 32 rows at 300 471.3 / 439.3 /
// 341.9.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;

constexpr int64_t MAX_GROUP = 16;  // query heads a KV head: the per-task arrays' bound
constexpr int64_t BLOCK = 64;      // keys scored before their softmax

template <typename T>
inline fVec load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return fVec::loadu(p);
  } else {  // bfloat16: its bits are a float32's upper half
    return fVec(_mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16)));
  }
}

inline float sum_lanes(const fVec& s) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline float max_lanes(const fVec& s) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// {sum of a's lanes, b's, c's, d's} into out[0..3]: four horizontal sums for the shuffles of one.
// Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same of c and d, then [a, b, c, d]; then
// the two lanes added
inline void sum_lanes4(const fVec& a, const fVec& b, const fVec& c, const fVec& d, float* out) {
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  const __m256 lanes = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1)));
}

// One block's softmax in place, online: `row`'s n scores become exp(score - the running maximum
// with them), the running sum takes them in; returns the factor a head's accumulators are rescaled
// by, the old maximum's exp against the new one (0 at the first block)
inline float softmax_block(float* row, int64_t n, float& running_max, float& running_sum) {
  constexpr int W = fVec::size();
  int64_t j = 0;
  fVec vmax(-std::numeric_limits<float>::infinity());
  for (; j + W <= n; j += W) vmax = at::vec::maximum(vmax, fVec::loadu(row + j));
  float block_max = std::max(running_max, max_lanes(vmax));
  for (; j < n; ++j) block_max = std::max(block_max, row[j]);
  const float rescale = std::exp(running_max - block_max);
  running_max = block_max;
  fVec vsum(0.f);
  for (j = 0; j + W <= n; j += W) {
    const fVec e = (fVec::loadu(row + j) - fVec(block_max)).exp_u20();
    e.store(row + j);
    vsum = vsum + e;
  }
  float sum = sum_lanes(vsum);
  for (; j < n; ++j) {
    row[j] = std::exp(row[j] - block_max);
    sum += row[j];
  }
  running_sum = running_sum * rescale + sum;
  return rescale;
}

// One (row, KV head): `q` its G queries (G x D, contiguous), `k`/`v` its first key and value, a
// position every `k_stride`/`v_stride` elements, `length` positions; `out` G x D.
template <typename T, int D>
void attend(const T* q, const T* k, const T* v, T* out, int64_t g, int64_t length, int64_t k_stride,
            int64_t v_stride, float scale) {
  constexpr int W = fVec::size();
  constexpr int N = D / W;  // vectors a head
  float scores[MAX_GROUP][BLOCK];
  fVec queries[MAX_GROUP][N], acc[MAX_GROUP][N];
  float running_max[MAX_GROUP], running_sum[MAX_GROUP];
  for (int64_t h = 0; h < g; ++h) {
    for (int i = 0; i < N; ++i) {
      queries[h][i] = load_float(q + h * D + i * W) * fVec(scale);
      acc[h][i] = fVec(0.f);
    }
    running_max[h] = -std::numeric_limits<float>::infinity();
    running_sum[h] = 0.f;
  }
  for (int64_t start = 0; start < length; start += BLOCK) {
    const int64_t n = std::min(BLOCK, length - start);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {  // four keys at a time: their sums in one set of shuffles
      const T* key = k + (start + j) * k_stride;
      for (int key_i = 0; key_i < 4; ++key_i) {  // this block's values, for the pass after the softmax
        const char* value = reinterpret_cast<const char*>(v + (start + j + key_i) * v_stride);
        for (int line = 0; line < D * int(sizeof(T)); line += 64) _mm_prefetch(value + line, _MM_HINT_T0);
      }
      fVec kv[4][N];
      for (int key_i = 0; key_i < 4; ++key_i) {
        for (int i = 0; i < N; ++i) kv[key_i][i] = load_float(key + key_i * k_stride + i * W);
      }
      for (int64_t h = 0; h < g; ++h) {
        fVec s[4];
        for (int key_i = 0; key_i < 4; ++key_i) {
          s[key_i] = queries[h][0] * kv[key_i][0];
          for (int i = 1; i < N; ++i) s[key_i] = at::vec::fmadd(queries[h][i], kv[key_i][i], s[key_i]);
        }
        sum_lanes4(s[0], s[1], s[2], s[3], scores[h] + j);
      }
    }
    for (; j < n; ++j) {
      const T* key = k + (start + j) * k_stride;
      fVec kv[N];
      for (int i = 0; i < N; ++i) kv[i] = load_float(key + i * W);
      for (int64_t h = 0; h < g; ++h) {
        fVec s = queries[h][0] * kv[0];
        for (int i = 1; i < N; ++i) s = at::vec::fmadd(queries[h][i], kv[i], s);
        scores[h][j] = sum_lanes(s);
      }
    }
    for (int64_t h = 0; h < g; ++h) {
      const float rescale = softmax_block(scores[h], n, running_max[h], running_sum[h]);
      for (int i = 0; i < N; ++i) acc[h][i] = acc[h][i] * fVec(rescale);
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* value = v + (start + j) * v_stride;
      if (start + BLOCK + j < length) {  // the next block's keys
        const char* next = reinterpret_cast<const char*>(k + (start + BLOCK + j) * k_stride);
        for (int line = 0; line < D * int(sizeof(T)); line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
      }
      fVec vv[N];
      for (int i = 0; i < N; ++i) vv[i] = load_float(value + i * W);
      for (int64_t h = 0; h < g; ++h) {
        const fVec p(scores[h][j]);
        for (int i = 0; i < N; ++i) acc[h][i] = at::vec::fmadd(p, vv[i], acc[h][i]);
      }
    }
  }
  for (int64_t h = 0; h < g; ++h) {
    const fVec inverse(1.f / running_sum[h]);
    float result[D];
    for (int i = 0; i < N; ++i) (acc[h][i] * inverse).store(result + i * W);
    for (int d = 0; d < D; ++d) out[h * D + d] = static_cast<T>(result[d]);
  }
}

#ifdef __AVX512BF16__
// The AVX-512 BF16 build's bfloat16 path (decode_attention.py's `avx512_bf16` kernel): the same
// task, blocks and online softmax, with each key dotted with a query in bfloat16 pairs by
// `vdpbf16ps` (products exact, sums in float32) instead of widened first, and each value widened
// to 16 float32 lanes. The scale is applied to the four scores of four keys at once, after the dot
// products. (Values in bfloat16 pairs too, the weights rounded to bfloat16 as torch's flash kernel
// does, were no faster here and less exact.)
inline __m512 widen16(const at::BFloat16* p) {  // 16 bfloat16 values to float32, exactly
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline __m256 fold(__m512 t) {  // 16 lanes to 8: the halves added
  return _mm256_add_ps(_mm512_castps512_ps256(t), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
}

template <int D>
void attend_bf16(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v, at::BFloat16* out,
                 int64_t g, int64_t length, int64_t k_stride, int64_t v_stride, float scale) {
  constexpr int NB = D / 32;  // 512-bit vectors of a head in bfloat16
  constexpr int NF = D / 16;  // and in float32
  alignas(64) float scores[MAX_GROUP][BLOCK];
  __m512bh queries[MAX_GROUP][NB];
  __m512 acc[MAX_GROUP][NF];
  float running_max[MAX_GROUP], running_sum[MAX_GROUP];
  for (int64_t h = 0; h < g; ++h) {
    for (int i = 0; i < NB; ++i) queries[h][i] = (__m512bh)_mm512_loadu_si512(q + h * D + i * 32);
    for (int i = 0; i < NF; ++i) acc[h][i] = _mm512_setzero_ps();
    running_max[h] = -std::numeric_limits<float>::infinity();
    running_sum[h] = 0.f;
  }
  const __m128 scale4 = _mm_set1_ps(scale);
  for (int64_t start = 0; start < length; start += BLOCK) {
    const int64_t n = std::min(BLOCK, length - start);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {  // four keys at a time: their sums in one set of shuffles
      const at::BFloat16* key = k + (start + j) * k_stride;
      for (int key_i = 0; key_i < 4; ++key_i) {  // this block's values, for the pass after the softmax
        const char* value = reinterpret_cast<const char*>(v + (start + j + key_i) * v_stride);
        for (int line = 0; line < D * 2; line += 64) _mm_prefetch(value + line, _MM_HINT_T0);
      }
      __m512bh keys[4][NB];
      for (int key_i = 0; key_i < 4; ++key_i) {
        for (int i = 0; i < NB; ++i) keys[key_i][i] = (__m512bh)_mm512_loadu_si512(key + key_i * k_stride + i * 32);
      }
      for (int64_t h = 0; h < g; ++h) {
        fVec s[4];
        for (int key_i = 0; key_i < 4; ++key_i) {
          __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), queries[h][0], keys[key_i][0]);
          for (int i = 1; i < NB; ++i) t = _mm512_dpbf16_ps(t, queries[h][i], keys[key_i][i]);
          s[key_i] = fVec(fold(t));
        }
        sum_lanes4(s[0], s[1], s[2], s[3], scores[h] + j);
        _mm_storeu_ps(scores[h] + j, _mm_mul_ps(_mm_loadu_ps(scores[h] + j), scale4));
      }
    }
    for (; j < n; ++j) {
      const at::BFloat16* key = k + (start + j) * k_stride;
      __m512bh keys[NB];
      for (int i = 0; i < NB; ++i) keys[i] = (__m512bh)_mm512_loadu_si512(key + i * 32);
      for (int64_t h = 0; h < g; ++h) {
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), queries[h][0], keys[0]);
        for (int i = 1; i < NB; ++i) t = _mm512_dpbf16_ps(t, queries[h][i], keys[i]);
        scores[h][j] = _mm512_reduce_add_ps(t) * scale;
      }
    }
    for (int64_t h = 0; h < g; ++h) {
      const __m512 rescale = _mm512_set1_ps(softmax_block(scores[h], n, running_max[h], running_sum[h]));
      for (int i = 0; i < NF; ++i) acc[h][i] = _mm512_mul_ps(acc[h][i], rescale);
    }
    for (int64_t j = 0; j < n; ++j) {
      const at::BFloat16* value = v + (start + j) * v_stride;
      if (start + BLOCK + j < length) {  // the next block's keys
        const char* next = reinterpret_cast<const char*>(k + (start + BLOCK + j) * k_stride);
        for (int line = 0; line < D * 2; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
      }
      __m512 values[NF];
      for (int i = 0; i < NF; ++i) values[i] = widen16(value + i * 16);
      for (int64_t h = 0; h < g; ++h) {
        const __m512 p = _mm512_set1_ps(scores[h][j]);
        for (int i = 0; i < NF; ++i) acc[h][i] = _mm512_fmadd_ps(p, values[i], acc[h][i]);
      }
    }
  }
  for (int64_t h = 0; h < g; ++h) {  // rounded to nearest even, as static_cast<BFloat16> rounds
    const __m512 inverse = _mm512_set1_ps(1.f / running_sum[h]);
    for (int i = 0; i < NF; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + h * D + i * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[h][i], inverse)));
    }
  }
}
#endif

template <typename T>
using Attend = void (*)(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t, int64_t, float);

template <typename T>
Attend<T> pick(int64_t d) {
  return d == 64 ? attend<T, 64> : attend<T, 128>;
}

#ifdef __AVX512BF16__
template <>
Attend<at::BFloat16> pick<at::BFloat16>(int64_t d) {
  return d == 64 ? attend_bf16<64> : attend_bf16<128>;
}
#endif

// q (B, KV, G, D); k, v one layer's cache (R >= B, KV, positions, D), its last dimension
// contiguous; lengths (B,) int64, each 1..positions. Returns (B, KV, G, D) in q's dtype.
at::Tensor decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lengths,
                  double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode attention: q, k and v must be 4-D, got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t b = q.size(0), heads = q.size(1), g = q.size(2), d = q.size(3);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) >= b && k.size(1) == heads && k.size(3) == d,
              "decode attention: k and v ", k.sizes(), " and ", v.sizes(), " do not fit q ", q.sizes());
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode attention: k and v need contiguous heads");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "decode attention: q, k and v must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "decode attention: float32 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(d == 64 || d == 128, "decode attention: head size 64 or 128, got ", d);
  TORCH_CHECK(g >= 1 && g <= MAX_GROUP, "decode attention: 1..", MAX_GROUP, " query heads a KV head, got ", g);
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == b && lengths.scalar_type() == at::kLong,
              "decode attention: lengths must be (", b, ",) int64, got ", lengths.sizes(), " ", lengths.scalar_type());
  auto lens = lengths.contiguous();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(len[r] >= 1 && len[r] <= k.size(2), "decode attention: row ", r, " attends ", len[r],
                " positions, outside 1..", k.size(2));
  }
  auto queries = q.contiguous();
  auto out = at::empty_like(queries);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    const scalar_t* qp = queries.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const auto run = pick<scalar_t>(d);
    at::parallel_for(0, b * heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t r = t / heads, h = t % heads;
        run(qp + t * g * d, kp + r * k.stride(0) + h * k.stride(1), vp + r * v.stride(0) + h * v.stride(1),
            op + t * g * d, g, len[r], k.stride(2), v.stride(2), static_cast<float>(scale));
      }
    });
  });
  return out;
}

}  // namespace

// The library's namespace: engine_attention, or the build's own (-DENGINE_ATTENTION_LIBRARY=...), so
// that both builds can load into one process; a macro argument expanded before TORCH_LIBRARY pastes it
#ifndef ENGINE_ATTENTION_LIBRARY
#define ENGINE_ATTENTION_LIBRARY engine_attention
#endif
#define DEFINE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define IMPLEMENT_LIBRARY(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)

DEFINE_LIBRARY(ENGINE_ATTENTION_LIBRARY, m) {
  m.def("decode(Tensor q, Tensor k, Tensor v, Tensor lengths, float scale) -> Tensor");
}

IMPLEMENT_LIBRARY(ENGINE_ATTENTION_LIBRARY, m) { m.impl("decode", &decode); }
