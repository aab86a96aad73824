// The fused CPU kernel of the factorised attention core (gsa_core.py states the algorithm and
// the letters). One query at a time, its logits, both softmaxes and the value sums live in a
// small per-thread workspace, never as tensors; the backward recomputes them per query.
//
// Per query i (of batch-head z), with q (G, d), its neighbours' keys and values (J, M, d):
//   c[j,m,g]  = q[g] . k[j,m] + gl[m,g]                    content + group logits
//   pi[j,m,g] = softmax_m c[j,:,g],  lse[j,g] = logsumexp_m c[j,:,g]
//   W[j,g]    = sum_m pi[j,m,g] keep[j,m,g] v[j,m]          (keep: the dropout mask)
//   t[k,j,g]  = lse[j,g] + q[g,:e] . rho[k or g, off(i,j)]  (-inf where j is outside)
//   beta      = softmax_j t[k,:,g]
//   out[v]    = sum_(j,g) beta[v,j,g] W[j,g]   (sum form; K = 1: the same row for every v)
//   out[g]    = sum_j beta[0,j,g] W[j,g]       (single form)
// Backward, with go = dL/dout at the query:
//   dbeta[k,j,g] = go[k] . W[j,g],  dW[j,g] = sum_k beta[k,j,g] go[k]
//   dt   = beta (dbeta - sum_j beta dbeta),     dlse[j,g] = sum_k dt[k,j,g]
//   drho[k,off] += sum_g dt[k,j,g] q[g,:e],     dq[g,:e] += sum_(k,j) dt[k,j,g] rho[k,off]
//   dpi  = keep (v[j,m] . dW[j,g]),             dv[j,m] += sum_g pi keep dW[j,g]
//   dc   = pi (dpi - sum_m pi dpi + dlse),      dgl[m,g] += sum_j dc[j,m,g]
//   dq[g] += sum_(j,m) dc[j,m,g] k[j,m],        dk[j,m] += sum_g dc[j,m,g] q[g]
// The forward runs in parallel over (z, i); the backward over z, which owns its rows of dk
// and dv; drho is summed per thread, then over threads in order (deterministic for a thread
// count). Inner loops run over a contiguous axis (g, or channels) for the vectoriser.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// exp(x) for x <= 0 (shifted logits), 0 below the underflow limit and for -inf: range
// reduction x = n ln2 + r, |r| <= ln2 / 2, and a Taylor polynomial accurate to the type's
// rounding. Branch-free, so that loops over it vectorise.
inline float exp_shifted(float x) {
  const float lo = -87.0f;
  const float xc = x < lo ? lo : (x > 0.0f ? 0.0f : x);
  const float n = std::floor(xc * 1.4426950408889634f + 0.5f);
  const float r = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < lo ? 0.0f : p * scale;
}

inline double exp_shifted(double x) {
  const double lo = -708.0;
  const double xc = x < lo ? lo : (x > 0.0 ? 0.0 : x);
  const double n = std::floor(xc * 1.4426950408889634 + 0.5);
  const double r = (xc - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
  double p = 1.0 / 6227020800.0;  // 1/13!
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  const int64_t bits = (static_cast<int64_t>(n) + 1023) << 52;
  double scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < lo ? 0.0 : p * scale;
}

// The dropout hash of gsa_core.keep_mask.
inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

template <typename T>
struct Problem {
  const T *q, *k, *v, *gl, *rho;  // gl, rho: null when absent
  const int64_t *offsets, *nb;    // offsets: null when local (offset j)
  const bool* valid;              // null when every neighbour is inside
  int64_t Z, L, Lkv, G, M, J, d, e, V, K, D;
  bool single;
  uint32_t threshold, s0, s1;  // dropout: keep iff hash mod 2^15 >= threshold

  T keep(uint64_t flat) const {
    uint32_t x = hash32(static_cast<uint32_t>(flat) ^ s0);
    x = hash32(x ^ s1 ^ static_cast<uint32_t>(flat >> 32));
    return (x & 0x7FFFu) >= threshold ? T(1) : T(0);
  }
  int64_t offset(int64_t i, int64_t j) const { return offsets ? offsets[i * J + j] : j; }
  bool inside(int64_t i, int64_t j) const { return !valid || valid[i * J + j]; }
};

// One query's forward quantities, reused from query to query.
template <typename T>
struct Work {
  std::vector<T> qT, pi, keep, lse, w, beta, stat;
  explicit Work(const Problem<T>& p)
      : qT(p.d * p.G),
        pi(p.J * p.M * p.G),
        keep(p.threshold ? p.J * p.M * p.G : 0),
        lse(p.J * p.G),
        w(p.J * p.G * p.d),
        beta(p.K * p.J * p.G),
        stat(2 * p.G) {}
};

// pi, keep, W and beta of query (z, i) into wk.
template <typename T>
void forward_query(const Problem<T>& p, int64_t z, int64_t i, Work<T>& wk) {
  const int64_t G = p.G, M = p.M, J = p.J, d = p.d, e = p.e;
  const T* q = p.q + (z * p.L + i) * G * d;  // (G, d)
  const T* kz = p.k + z * p.Lkv * M * d;
  const T* vz = p.v + z * p.Lkv * M * d;
  const T* gl = p.gl ? p.gl + (z * p.L + i) * M * G : nullptr;  // (M, G)
  const int64_t* nb = p.nb + i * J;
  T* qT = wk.qT.data();  // (d, G)
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < d; ++c) qT[c * G + g] = q[g * d + c];
  T* top = wk.stat.data();
  T* sum = top + G;

  for (int64_t j = 0; j < J; ++j) {
    const T* kj = kz + nb[j] * M * d;
    T* cj = wk.pi.data() + j * M * G;  // (M, G): logits, then pi
    for (int64_t m = 0; m < M; ++m) {
      T* row = cj + m * G;
      for (int64_t g = 0; g < G; ++g) row[g] = gl ? gl[m * G + g] : T(0);
      for (int64_t c = 0; c < d; ++c) {
        const T a = kj[m * d + c];
        const T* qc = qT + c * G;
        for (int64_t g = 0; g < G; ++g) row[g] += a * qc[g];
      }
    }
    for (int64_t g = 0; g < G; ++g) top[g] = cj[g], sum[g] = 0;
    for (int64_t m = 1; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) top[g] = std::max(top[g], cj[m * G + g]);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const T x = exp_shifted(cj[m * G + g] - top[g]);
        cj[m * G + g] = x;
        sum[g] += x;
      }
    for (int64_t g = 0; g < G; ++g) wk.lse[j * G + g] = top[g] + std::log(sum[g]);
    for (int64_t g = 0; g < G; ++g) sum[g] = T(1) / sum[g];
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) cj[m * G + g] *= sum[g];

    // W[j, g] = sum_m pi keep v[j, m]
    const T* vj = vz + nb[j] * M * d;
    T* wj = wk.w.data() + j * G * d;  // (G, d)
    std::fill(wj, wj + G * d, T(0));
    T* kp = p.threshold ? wk.keep.data() + j * M * G : nullptr;
    const uint64_t flat = static_cast<uint64_t>(((z * p.L + i) * J + j) * M * G);
    for (int64_t m = 0; m < M; ++m) {
      const T* vm = vj + m * d;
      for (int64_t g = 0; g < G; ++g) {
        T a = cj[m * G + g];
        if (kp) a *= (kp[m * G + g] = p.keep(flat + m * G + g));
        T* wg = wj + g * d;
        for (int64_t c = 0; c < d; ++c) wg[c] += a * vm[c];
      }
    }
  }

  // outer logits t (K, J, G) = lse + spatial term, -inf outside; softmax over j
  const T inf = std::numeric_limits<T>::infinity();
  for (int64_t k = 0; k < p.K; ++k) {
    T* tk = wk.beta.data() + k * J * G;
    for (int64_t j = 0; j < J; ++j) {
      T* row = tk + j * G;
      if (!p.inside(i, j)) {
        for (int64_t g = 0; g < G; ++g) row[g] = -inf;
        continue;
      }
      const T* l = wk.lse.data() + j * G;
      for (int64_t g = 0; g < G; ++g) row[g] = l[g];
      if (!e) continue;
      const int64_t off = p.offset(i, j);
      if (p.single) {  // v = g: each g its own table row
        for (int64_t g = 0; g < G; ++g) {
          const T* r = p.rho + (g * p.D + off) * e;
          T s = 0;
          for (int64_t c = 0; c < e; ++c) s += q[g * d + c] * r[c];
          row[g] += s;
        }
      } else {
        const T* r = p.rho + (k * p.D + off) * e;
        for (int64_t c = 0; c < e; ++c) {
          const T a = r[c];
          const T* qc = qT + c * G;
          for (int64_t g = 0; g < G; ++g) row[g] += a * qc[g];
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) top[g] = -inf, sum[g] = 0;
    for (int64_t j = 0; j < J; ++j)
      for (int64_t g = 0; g < G; ++g) top[g] = std::max(top[g], tk[j * G + g]);
    for (int64_t j = 0; j < J; ++j)
      for (int64_t g = 0; g < G; ++g) {
        const T x = exp_shifted(tk[j * G + g] - top[g]);
        tk[j * G + g] = x;
        sum[g] += x;
      }
    for (int64_t g = 0; g < G; ++g) sum[g] = T(1) / sum[g];
    for (int64_t j = 0; j < J; ++j)
      for (int64_t g = 0; g < G; ++g) tk[j * G + g] *= sum[g];
  }
}

// out (V, d) of the query whose forward quantities are in wk.
template <typename T>
void output_query(const Problem<T>& p, const Work<T>& wk, T* out) {
  const int64_t G = p.G, J = p.J, d = p.d;
  std::fill(out, out + p.V * d, T(0));
  for (int64_t k = 0; k < (p.single ? G : p.K); ++k) {
    T* o = out + k * d;
    for (int64_t j = 0; j < J; ++j)
      for (int64_t g = p.single ? k : 0; g < (p.single ? k + 1 : G); ++g) {
        const T b = wk.beta[(p.single ? j * G : (k * J + j) * G) + g];
        const T* wg = wk.w.data() + (j * G + g) * d;
        for (int64_t c = 0; c < d; ++c) o[c] += b * wg[c];
      }
  }
  if (!p.single && p.K == 1)  // no spatial term: every v has the same weights
    for (int64_t v = 1; v < p.V; ++v) std::copy(out, out + d, out + v * d);
}

template <typename T>
Problem<T> problem(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& gl,
                   const OptTensor& rho, const OptTensor& offsets, const Tensor& nb,
                   const OptTensor& valid, bool single, int64_t n, int64_t threshold,
                   int64_t seed) {
  Problem<T> p{};
  p.q = q.data_ptr<T>();
  p.k = k.data_ptr<T>();
  p.v = v.data_ptr<T>();
  p.gl = gl ? gl->data_ptr<T>() : nullptr;
  p.rho = rho ? rho->data_ptr<T>() : nullptr;
  p.offsets = offsets ? offsets->data_ptr<int64_t>() : nullptr;
  p.nb = nb.data_ptr<int64_t>();
  p.valid = valid ? valid->data_ptr<bool>() : nullptr;
  p.Z = q.size(0), p.L = q.size(1), p.G = q.size(2), p.d = q.size(3);
  p.Lkv = k.size(1), p.M = k.size(2), p.J = nb.size(1);
  p.e = rho ? rho->size(2) : 0;
  p.D = rho ? rho->size(1) : 0;
  p.V = n;
  p.single = single;
  p.K = (single || !p.e) ? 1 : n;
  p.threshold = static_cast<uint32_t>(threshold);
  p.s0 = static_cast<uint32_t>(static_cast<uint64_t>(seed));
  p.s1 = static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32);
  return p;
}

void check(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& gl,
           const OptTensor& rho, const OptTensor& offsets, const Tensor& nb,
           const OptTensor& valid, bool single, int64_t n) {
  for (const Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->dim() == 4,
                "q, k, v must be contiguous 4-d CPU tensors");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "q, k, v must share a dtype");
  }
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3),
              "k and v must be (Z, Lkv, M, d) with q's Z and d");
  TORCH_CHECK(nb.scalar_type() == at::kLong && nb.is_contiguous() && nb.dim() == 2 &&
                  nb.size(0) == q.size(1),
              "neighbour must be contiguous int64 (L, J)");
  if (gl) TORCH_CHECK(gl->is_contiguous() && gl->scalar_type() == q.scalar_type() &&
                          gl->sizes() == at::IntArrayRef({q.size(0), q.size(1), k.size(2), q.size(2)}),
                      "group logits must be contiguous (Z, L, M, G)");
  if (rho) {
    TORCH_CHECK(rho->is_contiguous() && rho->scalar_type() == q.scalar_type() &&
                    rho->dim() == 3 && rho->size(0) == n && rho->size(2) <= q.size(3),
                "rho must be contiguous (V, D, e) with e <= d");
    TORCH_CHECK(offsets || rho->size(1) >= nb.size(1), "local rho needs J rows");
  }
  if (offsets) TORCH_CHECK(offsets->scalar_type() == at::kLong && offsets->is_contiguous() &&
                               offsets->sizes() == nb.sizes(),
                           "offsets must be contiguous int64 (L, J)");
  if (valid) TORCH_CHECK(valid->scalar_type() == at::kBool && valid->is_contiguous() &&
                             valid->sizes() == nb.sizes(),
                         "valid must be contiguous bool (L, J)");
  TORCH_CHECK(!single || q.size(2) == n, "the single form needs G = V");
}

// Queries per task: enough work per task that the threads' start-up does not dominate.
int64_t grain(int64_t work_per_query) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, work_per_query));
}

Tensor forward(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& gl,
               const OptTensor& rho, const OptTensor& offsets, const Tensor& nb,
               const OptTensor& valid, bool single, int64_t n, int64_t threshold,
               int64_t seed) {
  check(q, k, v, gl, rho, offsets, nb, valid, single, n);
  Tensor out = at::empty({q.size(0), q.size(1), n, q.size(3)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gsa_forward", [&] {
    const auto p = problem<scalar_t>(q, k, v, gl, rho, offsets, nb, valid, single, n,
                                     threshold, seed);
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t work = p.J * p.G * (2 * p.M * p.d + p.K * (p.e + p.d));
    at::parallel_for(0, p.Z * p.L, grain(work), [&](int64_t begin, int64_t end) {
      Work<scalar_t> wk(p);
      for (int64_t zi = begin; zi < end; ++zi) {
        forward_query(p, zi / p.L, zi % p.L, wk);
        output_query(p, wk, o + zi * p.V * p.d);
      }
    });
  });
  return out;
}

template <typename T>
struct Grads {
  T *dq, *dk, *dv, *dgl, *drho;  // dgl, drho: null when absent; drho: this thread's sum
};

// Gradients of query (z, i) given go (V, d); wk holds its forward quantities.
template <typename T>
void backward_query(const Problem<T>& p, int64_t z, int64_t i, const T* go, Work<T>& wk,
                    std::vector<T>& buf, const Grads<T>& gr) {
  const int64_t G = p.G, M = p.M, J = p.J, d = p.d, e = p.e, K = p.K;
  const T* q = p.q + (z * p.L + i) * G * d;
  const T* qT = wk.qT.data();
  const int64_t* nb = p.nb + i * J;
  // buf: dt (K, J, G) | dW (J, G, d) | dqT (d, G) | go1 (d) | dpi (M, G) | dlse (J, G) | acc (G)
  buf.resize(K * J * G + J * G * d + d * G + d + M * G + J * G + G);
  T* dt = buf.data();
  T* dw = dt + K * J * G;
  T* dqT = dw + J * G * d;
  T* go1 = dqT + d * G;
  T* dpi = go1 + d;
  T* dlse = dpi + M * G;
  T* acc = dlse + J * G;
  std::fill(dw, dw + J * G * d, T(0));
  std::fill(dqT, dqT + d * G, T(0));

  // dbeta and dW
  if (p.single) {
    for (int64_t j = 0; j < J; ++j)
      for (int64_t g = 0; g < G; ++g) {
        const T* wg = wk.w.data() + (j * G + g) * d;
        const T* gg = go + g * d;
        const T b = wk.beta[j * G + g];
        T s = 0;
        for (int64_t c = 0; c < d; ++c) s += gg[c] * wg[c];
        dt[j * G + g] = s;
        T* dwg = dw + (j * G + g) * d;
        for (int64_t c = 0; c < d; ++c) dwg[c] = b * gg[c];
      }
  } else {
    if (K == 1) {  // every v had the same weights: their gradients add up
      std::fill(go1, go1 + d, T(0));
      for (int64_t v = 0; v < p.V; ++v)
        for (int64_t c = 0; c < d; ++c) go1[c] += go[v * d + c];
    }
    for (int64_t k = 0; k < K; ++k) {
      const T* gk = K == 1 ? go1 : go + k * d;
      for (int64_t j = 0; j < J; ++j)
        for (int64_t g = 0; g < G; ++g) {
          const T* wg = wk.w.data() + (j * G + g) * d;
          const T b = wk.beta[(k * J + j) * G + g];
          T s = 0;
          for (int64_t c = 0; c < d; ++c) s += gk[c] * wg[c];
          dt[(k * J + j) * G + g] = s;
          T* dwg = dw + (j * G + g) * d;
          for (int64_t c = 0; c < d; ++c) dwg[c] += b * gk[c];
        }
    }
  }
  // softmax over j: dt = beta (dbeta - sum_j beta dbeta); dlse = sum_k dt
  std::fill(dlse, dlse + J * G, T(0));
  for (int64_t k = 0; k < K; ++k) {
    const T* bk = wk.beta.data() + k * J * G;
    T* tk = dt + k * J * G;
    std::fill(acc, acc + G, T(0));
    for (int64_t j = 0; j < J; ++j)
      for (int64_t g = 0; g < G; ++g) acc[g] += bk[j * G + g] * tk[j * G + g];
    for (int64_t j = 0; j < J; ++j)
      for (int64_t g = 0; g < G; ++g) {
        tk[j * G + g] = bk[j * G + g] * (tk[j * G + g] - acc[g]);
        dlse[j * G + g] += tk[j * G + g];
      }
  }
  // spatial term
  if (e) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < J; ++j) {
        if (!p.inside(i, j)) continue;
        const int64_t off = p.offset(i, j);
        const T* tr = dt + (k * J + j) * G;
        if (p.single) {
          for (int64_t g = 0; g < G; ++g) {
            const T* r = p.rho + (g * p.D + off) * e;
            T* dr = gr.drho + (g * p.D + off) * e;
            const T a = tr[g];
            for (int64_t c = 0; c < e; ++c) {
              dqT[c * G + g] += a * r[c];
              dr[c] += a * q[g * d + c];
            }
          }
        } else {
          const T* r = p.rho + (k * p.D + off) * e;
          T* dr = gr.drho + (k * p.D + off) * e;
          for (int64_t c = 0; c < e; ++c) {
            const T a = r[c];
            const T* qc = qT + c * G;
            T* dqc = dqT + c * G;
            T s = 0;
            for (int64_t g = 0; g < G; ++g) {
              dqc[g] += a * tr[g];
              s += tr[g] * qc[g];
            }
            dr[c] += s;
          }
        }
      }
  }
  // inner softmax and the gathered keys and values
  const T* kz = p.k + z * p.Lkv * M * d;
  const T* vz = p.v + z * p.Lkv * M * d;
  T* dkz = gr.dk + z * p.Lkv * M * d;
  T* dvz = gr.dv + z * p.Lkv * M * d;
  T* dgl = gr.dgl ? gr.dgl + (z * p.L + i) * M * G : nullptr;
  if (dgl) std::fill(dgl, dgl + M * G, T(0));
  for (int64_t j = 0; j < J; ++j) {
    if (!p.inside(i, j)) continue;  // beta = 0: no gradient reaches it
    const T* pj = wk.pi.data() + j * M * G;
    const T* kp = p.threshold ? wk.keep.data() + j * M * G : nullptr;
    const T* dwj = dw + j * G * d;
    const T* kj = kz + nb[j] * M * d;
    const T* vj = vz + nb[j] * M * d;
    T* dkj = dkz + nb[j] * M * d;
    T* dvj = dvz + nb[j] * M * d;
    for (int64_t m = 0; m < M; ++m) {
      const T* vm = vj + m * d;
      T* dvm = dvj + m * d;
      for (int64_t g = 0; g < G; ++g) {
        const T* dwg = dwj + g * d;
        T s = 0;
        for (int64_t c = 0; c < d; ++c) s += vm[c] * dwg[c];
        const T kg = kp ? kp[m * G + g] : T(1);
        dpi[m * G + g] = s * kg;
        const T a = pj[m * G + g] * kg;
        for (int64_t c = 0; c < d; ++c) dvm[c] += a * dwg[c];
      }
    }
    std::fill(acc, acc + G, T(0));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) acc[g] += pj[m * G + g] * dpi[m * G + g];
    for (int64_t g = 0; g < G; ++g) acc[g] -= dlse[j * G + g];
    for (int64_t m = 0; m < M; ++m) {  // dpi becomes dc
      T* dc = dpi + m * G;
      for (int64_t g = 0; g < G; ++g) dc[g] = pj[m * G + g] * (dc[g] - acc[g]);
      if (dgl)
        for (int64_t g = 0; g < G; ++g) dgl[m * G + g] += dc[g];
      const T* km = kj + m * d;
      T* dkm = dkj + m * d;
      for (int64_t c = 0; c < d; ++c) {
        const T a = km[c];
        const T* qc = qT + c * G;
        T* dqc = dqT + c * G;
        T s = 0;
        for (int64_t g = 0; g < G; ++g) {
          dqc[g] += dc[g] * a;
          s += dc[g] * qc[g];
        }
        dkm[c] += s;
      }
    }
  }
  T* dq = gr.dq + (z * p.L + i) * G * d;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < d; ++c) dq[g * d + c] = dqT[c * G + g];
}

std::vector<Tensor> backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                             const Tensor& v, const OptTensor& gl, const OptTensor& rho,
                             const OptTensor& offsets, const Tensor& nb, const OptTensor& valid,
                             bool single, int64_t n, int64_t threshold, int64_t seed) {
  check(q, k, v, gl, rho, offsets, nb, valid, single, n);
  TORCH_CHECK(grad_out.is_contiguous() && grad_out.sizes() ==
                  at::IntArrayRef({q.size(0), q.size(1), n, q.size(3)}),
              "grad_out must be contiguous (Z, L, V, d)");
  Tensor dq = at::empty_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  Tensor dgl = gl ? at::empty_like(*gl) : Tensor();
  const int64_t threads = at::get_num_threads();
  Tensor drho_parts = rho ? at::zeros({threads, rho->size(0), rho->size(1), rho->size(2)},
                                      q.options())
                          : Tensor();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gsa_backward", [&] {
    const auto p = problem<scalar_t>(q, k, v, gl, rho, offsets, nb, valid, single, n,
                                     threshold, seed);
    const scalar_t* go = grad_out.data_ptr<scalar_t>();
    const int64_t rho_size = rho ? rho->numel() : 0;
    at::parallel_for(0, p.Z, 1, [&](int64_t begin, int64_t end) {
      Work<scalar_t> wk(p);
      std::vector<scalar_t> buf;
      Grads<scalar_t> gr{dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                         dv.data_ptr<scalar_t>(), gl ? dgl.data_ptr<scalar_t>() : nullptr,
                         rho ? drho_parts.data_ptr<scalar_t>() +
                                   at::get_thread_num() * rho_size
                             : nullptr};
      for (int64_t z = begin; z < end; ++z)
        for (int64_t i = 0; i < p.L; ++i) {
          forward_query(p, z, i, wk);
          backward_query(p, z, i, go + (z * p.L + i) * p.V * p.d, wk, buf, gr);
        }
    });
  });
  Tensor drho = rho ? drho_parts.sum(0) : Tensor();
  return {dq, dk, dv, dgl, drho};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "fused factorised attention, forward (see gsa_core.py)");
  m.def("backward", &backward, "fused factorised attention, backward (recomputes per query)");
}
