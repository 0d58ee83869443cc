// A decoder layer's small operators in one call each, for a bfloat16 model's steps outside the
// compiled one (layer_ops.py says where they serve and what they save): each replaces a run of
// torch's operators, each with its dispatch and, at a prompt's rows, its float32 buffer.
//
// - rms_norm: Hugging Face's RMSNorm (llama.RMSNorm): each row widened to float32, scaled by
//   1 / sqrt(mean of its squares + eps), rounded to bfloat16, multiplied by the bfloat16 weight and
//   rounded again (the composite: seven operators). The bits are the composite's but for the sum of
//   squares, summed here in another order (8 float32 lanes, then across them), so a row's scale can
//   differ in its last bit and a value's rounding with it: none of SmolLM2's rows of 1 to 32
//   differed in the tests, a few in 2,000 (tests/test_layer_ops.py bounds it).
// - rope: the rotary embedding of a step's queries and keys, the same bits as llama.apply_rope's
//   four operators (two products, a roll, a sum).
// - write_kv: a step's new keys and values of d rows into one layer's cache at their slots
//   (kv_cache.KVCache.write_decode: two index_copy_ and the copies that lay the rows out for them).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using fVec = at::vec::Vectorized<float>;
using bVec = at::vec::Vectorized<at::BFloat16>;  // 2 W values
constexpr int W = fVec::size();

inline fVec widen(const at::BFloat16* p) {  // W bfloat16 values to float32, exactly: the upper halves
  return fVec(_mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16)));
}

inline float sum_lanes(const fVec& s) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// rows [begin, end) of x (n values each) into out; h: a float32 row of scratch
void norm_rows(const at::BFloat16* x, const at::BFloat16* weight, at::BFloat16* out, int64_t begin, int64_t end,
               int64_t n, float eps, float* h) {
  for (int64_t r = begin; r < end; ++r) {
    const at::BFloat16* row = x + r * n;
    fVec squares(0.f);
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const fVec v = widen(row + i);
      v.store(h + i);
      squares = at::vec::fmadd(v, v, squares);
    }
    float sum = sum_lanes(squares);
    for (; i < n; ++i) {
      h[i] = static_cast<float>(row[i]);
      sum += h[i] * h[i];
    }
    const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);  // torch's rsqrt: 1 / sqrt
    at::BFloat16* o = out + r * n;
    // both roundings to nearest even, as the composite's casts (ATen's conversions, NaN kept)
    const fVec s(scale);
    int64_t j = 0;
    for (; j + 2 * W <= n; j += 2 * W) {
      const auto [y0, y1] = at::vec::convert_bfloat16_float(
          at::vec::convert_float_bfloat16(fVec::loadu(h + j) * s, fVec::loadu(h + j + W) * s));
      const auto [w0, w1] = at::vec::convert_bfloat16_float(bVec::loadu(weight + j));
      at::vec::convert_float_bfloat16(w0 * y0, w1 * y1).store(o + j);
    }
    for (; j < n; ++j) {
      o[j] = static_cast<at::BFloat16>(static_cast<float>(weight[j]) *
                                       static_cast<float>(static_cast<at::BFloat16>(h[j] * scale)));
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "rms_norm: x and weight must be bfloat16, got ", x.scalar_type(), " and ", weight.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: weight must be (", x.dim() ? x.size(-1) : 0, ",) for x ", x.sizes(), ", got ",
              weight.sizes());
  TORCH_CHECK(eps >= 0, "rms_norm: eps must be >= 0, got ", eps);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t n = x.size(-1), rows = n ? xc.numel() / n : 0;
  if (rows == 0) return out;
  const at::BFloat16* xp = xc.const_data_ptr<at::BFloat16>();
  const at::BFloat16* wp = wc.const_data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  // a decode step's few rows in the calling thread; a prompt's spread over the threads
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / n), [&](int64_t begin, int64_t end) {
    std::vector<float> h(n);
    norm_rows(xp, wp, op, begin, end, n, static_cast<float>(eps), h.data());
  });
  return out;
}


// Rotary embedding of the step's queries and keys together (llama.apply_rope: x * cos +
// roll(x, D / 2) * signed_sin, three products and sums each rounded to bfloat16 as torch's operators
// round them, so the same bits). x (B, T, H, D), any strides but contiguous heads (the q and k heads of
// the qkv projection's output); cos, signed_sin (1, T, 1, D) contiguous rows. Returns (B, T, H, D)
// contiguous.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
                  signed_sin.scalar_type() == at::kBFloat16,
              "rope: x, cos and signed_sin must be bfloat16, got ", x.scalar_type(), ", ", cos.scalar_type(),
              " and ", signed_sin.scalar_type());
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "rope: x must be (B, T, H, D) with contiguous heads, got ", x.sizes());
  const int64_t b = x.size(0), t = x.size(1), heads = x.size(2), d = x.size(3);
  TORCH_CHECK(d % 2 == 0, "rope: the head size must be even, got ", d);
  TORCH_CHECK(cos.sizes() == signed_sin.sizes() && cos.numel() == t * d && cos.size(-1) == d,
              "rope: cos and signed_sin must be (1, ", t, ", 1, ", d, "), got ", cos.sizes(), " and ",
              signed_sin.sizes());
  const at::Tensor cc = cos.contiguous(), sc = signed_sin.contiguous();
  at::Tensor out = at::empty({b, t, heads, d}, x.options());
  const at::BFloat16* xp = x.const_data_ptr<at::BFloat16>();
  const at::BFloat16* cp = cc.const_data_ptr<at::BFloat16>();
  const at::BFloat16* sp = sc.const_data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t half = d / 2, sb = x.stride(0), st = x.stride(1), sh = x.stride(2);
  at::parallel_for(0, b * t, std::max<int64_t>(1, 16384 / (heads * d)), [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t i = bt / t, j = bt % t;
      const at::BFloat16* c = cp + j * d;
      const at::BFloat16* s = sp + j * d;
      for (int64_t h = 0; h < heads; ++h) {
        const at::BFloat16* row = xp + i * sb + j * st + h * sh;
        at::BFloat16* o = op + ((i * t + j) * heads + h) * d;
        int64_t e = 0;
        if (half % (2 * W) == 0) {  // whole vectors in each half: the rolled row is the other half
          for (; e < d; e += 2 * W) {
            const int64_t rolled = e < half ? e + half : e - half;
            const auto [x0, x1] = at::vec::convert_bfloat16_float(bVec::loadu(row + e));
            const auto [r0, r1] = at::vec::convert_bfloat16_float(bVec::loadu(row + rolled));
            const auto [c0, c1] = at::vec::convert_bfloat16_float(bVec::loadu(c + e));
            const auto [s0, s1] = at::vec::convert_bfloat16_float(bVec::loadu(s + e));
            const auto [a0, a1] = at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(x0 * c0, x1 * c1));
            const auto [q0, q1] = at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(r0 * s0, r1 * s1));
            at::vec::convert_float_bfloat16(a0 + q0, a1 + q1).store(o + e);
          }
        }
        for (; e < d; ++e) {
          const float a = static_cast<float>(static_cast<at::BFloat16>(static_cast<float>(row[e]) *
                                                                       static_cast<float>(c[e])));
          const float q = static_cast<float>(static_cast<at::BFloat16>(
              static_cast<float>(row[(e + half) % d]) * static_cast<float>(s[e])));
          o[e] = static_cast<at::BFloat16>(a + q);
        }
      }
    }
  });
  return out;
}

// k, v (KV, d, D), any strides but contiguous heads; slots (d * KV,) int64, row i's head h at
// slots[i * KV + h], an index into a layer's cache seen as (rows x KV x positions, D) vectors
void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "write_kv: k and v must be (KV, d, D) alike, got ", k.sizes(),
              " and ", v.sizes());
  const int64_t heads = k.size(0), d = k.size(1), dim = k.size(2);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(-1) == dim,
              "write_kv: the caches must be contiguous, alike, with heads of ", dim, " values, got ", k_cache.sizes(),
              " and ", v_cache.sizes());
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv: keys, values and caches must share a dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "write_kv: k and v need contiguous heads");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == d * heads && slots.scalar_type() == at::kLong,
              "write_kv: slots must be (", d * heads, ",) int64, got ", slots.sizes(), " ", slots.scalar_type());
  const at::Tensor sc = slots.contiguous();
  const int64_t* sp = sc.const_data_ptr<int64_t>();
  const int64_t vectors = k_cache.numel() / std::max<int64_t>(dim, 1);
  for (int64_t i = 0; i < d * heads; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < vectors, "write_kv: slot ", sp[i], " is outside the cache's 0..", vectors - 1);
  }
  const int64_t bytes = dim * k.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.const_data_ptr());
  const char* vp = static_cast<const char*>(v.const_data_ptr());
  const int64_t es = k.element_size();
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t slot = sp[i * heads + h];
      std::memcpy(kc + slot * bytes, kp + (h * k.stride(0) + i * k.stride(1)) * es, bytes);
      std::memcpy(vc + slot * bytes, vp + (h * v.stride(0) + i * v.stride(1)) * es, bytes);
    }
  }
}

}  // namespace

TORCH_LIBRARY(engine_layer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(engine_layer, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope", &rope);
  m.impl("write_kv", &write_kv);
}
