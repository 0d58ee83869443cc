// Attention of a prompt chunk, causal at its positions: the chunk's C tokens at positions
// start..start+C-1 in one KV cache row, token i against that row's keys and values 0..start+i, read
// in place; the keys and values given are the row's through the chunk's last position, so their
// length says where the chunk starts (no int of it: a TorchScript trace of a step keeps it as the
// narrowed cache's size, where an int would be baked in). What scaled_dot_product_attention
// computes for a chunk (is_causal from position 0, the chunk mask past it) without its costs on a
// CPU that dots bfloat16 pairs: torch's CPU flash kernel widens bfloat16 to float32 and multiplies
// at float32's rate (its float32 and bfloat16 calls took the same 38-39 ms for SmolLM2's heads over
// 2,000 tokens, 2 threads, AMD EPYC of the Zen 4 class), and past position 0 it computes the whole
// masked block (no causal skip) or two calls merged (llama.attend_after_prefix). Here both products
// run in `vdpbf16ps` (bfloat16 pairs, float32 sums): 17.6 ms against 38.9 over 2,000 tokens from 0,
// 6.3 against 15.0 for 512 tokens at 1,152 (docs/decode-speed.md, "A prompt chunk's attention in
// the engine's kernel").
//
// One task a (query head, block of QB tokens): the tokens' queries as bfloat16 pairs; the keys in
// blocks of KB positions, each block scored for 4 tokens x 64 keys at a time (16 accumulators, one
// `vdpbf16ps` a pair of a query's values and 16 keys), scaled, masked past each token's position,
// then its softmax online in float32 (a running maximum and sum, the accumulators rescaled when the
// maximum moves), the weights rounded to bfloat16 pairs of adjacent keys, and the values added in
// with them (one `vdpbf16ps` a pair of keys and 16 values). Each token's result depends on its own
// query and the key blocks at fixed positions only (0, KB, 2 KB, ...), not on which tokens share
// its task: a chunk cut into parts gives the whole chunk's bits (the layer-sliced prefill's parts).
// Keys and values are first laid out for those products, once a call: per KV head, the keys 16 at
// a time by pairs of their values ([pair][16 keys]), and the values of each two keys interleaved
// ([value][2 keys]), with zeros past the last position. The tasks go to the threads costliest first, round-robin
// (a causal chunk's last blocks attend the most keys).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;  // 8 lanes (this build's ATen vectors are AVX2's)

constexpr int64_t QB = 32;  // tokens a task (a multiple of 4)
constexpr int64_t KB = 64;  // keys a block (a multiple of 16, at most 64: the scoring's 4 x 16)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float max_lanes(const fVec& s) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline float sum_lanes(const fVec& s) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// One task: `rows` tokens (<= QB) from `q` (a token every `q_row` elements), the first at position
// `first`; `keys`/`values` its KV head's laid-out keys and values; `out` a token every `out_row`.
template <int D>
void attend_block(const uint16_t* q, int64_t q_row, const uint32_t* keys, const uint32_t* values, uint16_t* out,
                  int64_t out_row, int64_t rows, int64_t first, float scale) {
  constexpr int NP = D / 2;   // bfloat16 pairs a head
  constexpr int NC = D / 16;  // float32 vectors a head
  constexpr int RP = D == 64 ? 4 : 2;  // tokens a pass of the values' products (RP x NC accumulators)
  alignas(64) float scores[QB][KB];
  alignas(64) uint32_t weights[QB][KB / 2];  // bfloat16 pairs of adjacent keys
  alignas(64) float acc[QB][D];
  uint32_t queries[QB][NP];
  float running_max[QB], running_sum[QB];
  std::memset(queries, 0, sizeof(queries));
  std::memset(weights, 0, sizeof(weights));
  std::memset(acc, 0, sizeof(acc));
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(queries[r], q + r * q_row, D * sizeof(uint16_t));
    running_max[r] = NEG_INF;
    running_sum[r] = 0.f;
  }
  const __m512 scale16 = _mm512_set1_ps(scale);
  const int64_t attended = first + rows;  // the last token attends keys 0..attended-1
  for (int64_t kb = 0; kb < attended; kb += KB) {
    const int64_t n = std::min(KB, attended - kb);
    const int64_t groups = (n + 15) / 16;  // of 16 keys; the laid-out keys are zero past the last
    const uint32_t* block = keys + kb * NP;
    for (int64_t r = 0; r < rows; r += 4) {  // scores: 4 tokens x 4 groups a pass
      __m512 s[4][4];
      for (int i = 0; i < 4; ++i)
        for (int g = 0; g < 4; ++g) s[i][g] = _mm512_setzero_ps();
      for (int p = 0; p < NP; ++p) {
        __m512i k[4];
        for (int g = 0; g < 4; ++g)
          if (g < groups) k[g] = _mm512_loadu_si512(block + (g * NP + p) * 16);
        for (int i = 0; i < 4; ++i) {
          const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(queries[r + i][p]));
          for (int g = 0; g < 4; ++g)
            if (g < groups) s[i][g] = _mm512_dpbf16_ps(s[i][g], x, (__m512bh)k[g]);
        }
      }
      for (int i = 0; i < 4; ++i)
        for (int g = 0; g < 4; ++g)
          if (g < groups) _mm512_store_ps(scores[r + i] + g * 16, _mm512_mul_ps(s[i][g], scale16));
    }
    for (int64_t r = 0; r < rows; ++r) {  // each token's softmax over the keys it attends
      const int64_t seen = std::min(n, first + r - kb + 1);
      float* row = scores[r];
      if (seen <= 0) {  // a token before this block's first key: no weight
        std::memset(weights[r], 0, sizeof(weights[r]));
        continue;
      }
      for (int64_t j = seen; j < groups * 16; ++j) row[j] = NEG_INF;
      fVec vmax(NEG_INF);
      int64_t j = 0;
      for (; j + 8 <= seen; j += 8) vmax = at::vec::maximum(vmax, fVec::loadu(row + j));
      float block_max = std::max(running_max[r], max_lanes(vmax));
      for (; j < seen; ++j) block_max = std::max(block_max, row[j]);
      const float rescale = std::exp(running_max[r] - block_max);
      running_max[r] = block_max;
      fVec vsum(0.f);
      for (j = 0; j < groups * 16; j += 8) {  // a masked key's -inf gives 0, as in torch's flash kernel
        const fVec e = (fVec::loadu(row + j) - fVec(block_max)).exp_u20();
        e.store(row + j);
        vsum = vsum + e;
      }
      running_sum[r] = running_sum[r] * rescale + sum_lanes(vsum);
      const __m512 factor = _mm512_set1_ps(rescale);
      for (int c = 0; c < NC; ++c) {
        _mm512_store_ps(acc[r] + c * 16, _mm512_mul_ps(_mm512_load_ps(acc[r] + c * 16), factor));
      }
      for (int64_t g = 0; g < groups; ++g) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(weights[r] + g * 8),
                           (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row + g * 16)));
      }
    }
    const uint32_t* pairs = values + (kb / 2) * D;
    const int64_t npairs = groups * 8;
    for (int64_t r = 0; r < rows; r += RP) {  // the values: RP tokens a pass
      __m512 a[RP][NC];
      for (int i = 0; i < RP; ++i)
        for (int c = 0; c < NC; ++c) a[i][c] = _mm512_load_ps(acc[r + i] + c * 16);
      for (int64_t j = 0; j < npairs; ++j) {
        __m512i v[NC];
        for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_si512(pairs + j * D + c * 16);
        for (int i = 0; i < RP; ++i) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[r + i][j]));
          for (int c = 0; c < NC; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], w, (__m512bh)v[c]);
        }
      }
      for (int i = 0; i < RP; ++i)
        for (int c = 0; c < NC; ++c) _mm512_store_ps(acc[r + i] + c * 16, a[i][c]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // rounded to nearest even, as static_cast<BFloat16> rounds
    const __m512 inverse = _mm512_set1_ps(1.f / running_sum[r]);
    for (int c = 0; c < NC; ++c) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_row + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc[r] + c * 16), inverse)));
    }
  }
}

// Keys and values 0..attended-1 of KV head h laid out for the products (zeros past them), 16
// positions at a time: `keys` [pair][16 positions], `values` [pair of positions][value][2].
void lay_out(const uint16_t* k, int64_t k_pos, const uint16_t* v, int64_t v_pos, uint32_t* keys, uint32_t* values,
             int64_t d, int64_t group, int64_t attended) {
  const int64_t np = d / 2;
  uint32_t* kd = keys + group * 16 * np;
  uint32_t* vd = values + group * 8 * d;
  for (int64_t key = 0; key < 16; ++key) {
    const int64_t pos = group * 16 + key;
    const auto* src = reinterpret_cast<const uint32_t*>(k + pos * k_pos);
    for (int64_t p = 0; p < np; ++p) kd[p * 16 + key] = pos < attended ? src[p] : 0u;
  }
  for (int64_t pair = 0; pair < 8; ++pair) {
    const int64_t p0 = group * 16 + 2 * pair, p1 = p0 + 1;
    const uint16_t* a = v + p0 * v_pos;
    const uint16_t* b = v + p1 * v_pos;
    for (int64_t x = 0; x < d; ++x) {
      vd[pair * d + x] = (p0 < attended ? uint32_t(a[x]) : 0u) | ((p1 < attended ? uint32_t(b[x]) : 0u) << 16);
    }
  }
}

// q (H, C, D), k and v (KV, start + C, D), bfloat16, each last dimension contiguous: the chunk
// starts at k's length less C. Returns (C, H * D): token i's heads, as the output projection takes them.
at::Tensor chunk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prompt attention: q, k and v must be 3-D, got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t heads = q.size(0), c = q.size(1), d = q.size(2), kv = k.size(0);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "prompt attention: bfloat16 q, k and v, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(d == 64 || d == 128, "prompt attention: head size 64 or 128, got ", d);
  TORCH_CHECK(kv >= 1 && heads % kv == 0 && k.sizes() == v.sizes() && k.size(2) == d,
              "prompt attention: k and v ", k.sizes(), " and ", v.sizes(), " do not fit q ", q.sizes());
  TORCH_CHECK(c >= 1 && c <= k.size(1), "prompt attention: a chunk of ", c, " tokens against ", k.size(1),
              " positions of k and v (its own and those before it)");
  const int64_t start = k.size(1) - c;
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "prompt attention: q, k and v need contiguous heads");
  const int64_t attended = start + c, padded = (attended + KB - 1) / KB * KB, np = d / 2;
  auto keys = at::empty({kv, padded * np}, q.options().dtype(at::kInt));
  auto values = at::empty({kv, padded * np}, q.options().dtype(at::kInt));
  auto* kl = reinterpret_cast<uint32_t*>(keys.data_ptr<int>());
  auto* vl = reinterpret_cast<uint32_t*>(values.data_ptr<int>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const int64_t groups = padded / 16;
  at::parallel_for(0, kv * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / groups;
      lay_out(kp + h * k.stride(0), k.stride(1), vp + h * v.stride(0), v.stride(1), kl + h * padded * np,
              vl + h * padded * np, d, t % groups, attended);
    }
  });
  auto out = at::empty({c, heads * d}, q.options());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const int64_t blocks = (c + QB - 1) / QB, tasks = heads * blocks, group = heads / kv;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  const auto run = d == 64 ? attend_block<64> : attend_block<128>;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t thread = begin; thread < end; ++thread) {
      for (int64_t t = thread; t < tasks; t += threads) {  // the last blocks (most keys) first
        const int64_t block = blocks - 1 - t / heads, h = t % heads, r0 = block * QB;
        run(qp + h * q.stride(0) + r0 * q.stride(1), q.stride(1), kl + (h / group) * padded * np,
            vl + (h / group) * padded * np, op + r0 * heads * d + h * d, heads * d, std::min(QB, c - r0), start + r0,
            static_cast<float>(scale));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(engine_prompt_attention, m) {
  m.def("chunk(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(engine_prompt_attention, CPU, m) { m.impl("chunk", &chunk); }
