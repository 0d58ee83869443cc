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
// the engine meets has AVX2.
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
      float* row = scores[h];
      const float block_max = std::max(running_max[h], *std::max_element(row, row + n));
      const float rescale = std::exp(running_max[h] - block_max);  // 0 at the first block
      running_max[h] = block_max;
      int64_t j = 0;
      for (; j + W <= n; j += W) (fVec::loadu(row + j) - fVec(block_max)).exp_u20().store(row + j);
      for (; j < n; ++j) row[j] = std::exp(row[j] - block_max);
      float sum = 0.f;
      for (j = 0; j < n; ++j) sum += row[j];
      running_sum[h] = running_sum[h] * rescale + sum;
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
    const auto run = d == 64 ? attend<scalar_t, 64> : attend<scalar_t, 128>;
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

TORCH_LIBRARY(engine_attention, m) {
  m.def("decode(Tensor q, Tensor k, Tensor v, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(engine_attention, CPU, m) { m.impl("decode", &decode); }
