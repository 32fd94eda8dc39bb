// y (M, N) fp32 = (x (M, K) fp32 @ q (N, K) int8^T) * s (N,): the int8-weight decode product.
// AVX2+FMA: 8 int8 weights -> 8 fp32 (one sign-extend, one convert), four output rows at a time
// so each x load feeds four FMAs, two activation rows per pass over the weight block. Threads
// (at::parallel_for) split N. See ember/kernels/cpu.py.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256 load8(const int8_t* p) {  // 8 int8 -> 8 fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// rows [n0, n0 + NR) of q against MR rows of x; writes y[m * N + n] = dot * s[n]
template <int MR, int NR>
static void tile(const float* x, const int8_t* q, const float* s, float* y, int64_t K, int64_t N, int64_t n0) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 w[NR];
    for (int j = 0; j < NR; ++j) w[j] = load8(q + (n0 + j) * K + k);
    for (int m = 0; m < MR; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int j = 0; j < NR; ++j) acc[m][j] = _mm256_fmadd_ps(xv, w[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) {
      float d = hsum(acc[m][j]);
      for (int64_t t = k; t < K; ++t) d += x[m * K + t] * float(q[(n0 + j) * K + t]);
      y[m * N + n0 + j] = d * s[n0 + j];
    }
}

template <int MR>
static void rows(const float* x, const int8_t* q, const float* s, float* y, int64_t K, int64_t N, int64_t b, int64_t e) {
  int64_t n = b;
  for (; n + 4 <= e; n += 4) tile<MR, 4>(x, q, s, y, K, N, n);
  for (; n < e; ++n) tile<MR, 1>(x, q, s, y, K, N, n);
}

at::Tensor int8_linear(const at::Tensor& x_, const at::Tensor& q_, const at::Tensor& s_) {
  TORCH_CHECK(x_.dim() == 2 && q_.dim() == 2 && x_.size(1) == q_.size(1), "int8_linear: x (M, K), q (N, K)");
  TORCH_CHECK(q_.scalar_type() == at::kChar && s_.numel() == q_.size(0), "int8_linear: q int8 (N, K), s (N,)");
  auto x = x_.to(at::kFloat).contiguous();
  auto q = q_.contiguous();
  auto s = s_.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // about 64K multiply-adds per task: whole blocks of four rows
  const int64_t grain = std::max<int64_t>(4, (65536 / std::max<int64_t>(K * M, 1)) / 4 * 4);
  at::parallel_for(0, (N + 3) / 4, grain / 4, [&](int64_t b, int64_t e) {
    b *= 4;
    e = std::min(e * 4, N);
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) rows<2>(xp + m * K, qp, sp, yp + m * N, K, N, b, e);
    if (m < M) rows<1>(xp + m * K, qp, sp, yp + m * N, K, N, b, e);
  });
  return y;
}

TORCH_LIBRARY(ember_cpu, m) { m.def("int8_linear(Tensor x, Tensor q, Tensor s) -> Tensor"); }
TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) { m.impl("int8_linear", &int8_linear); }
