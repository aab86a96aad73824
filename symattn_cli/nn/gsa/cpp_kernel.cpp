// The fused CPU kernel of the factorised attention core (core.py states the algorithm and
// the letters). Queries are taken a tile of T at a time (one vector register of lanes: 16
// floats or 8 doubles with AVX-512, 8 or 4 with AVX2), one query per lane: every step of the
// per-query algorithm below is then a vector operation across the tile, whatever the (small)
// sizes of J, M, G and d. A tile's logits, both softmaxes and the value sums live in a
// per-thread workspace laid out (..., T), never as tensors; the backward recomputes them per
// tile.
//
// Per query i (of batch-head z), with q (G, d), its neighbours' keys and values (J, M, d):
//   c[j,m,g]  = q[g] . k[j,m] + gl[m,g]                  content + group logits
//   mx[j,g]   = max_m c[j,:,g],  sm[j,g] = sum_m exp(c[j,m,g] - mx[j,g])
//   pi[j,m,g] = exp(c[j,m,g] - mx[j,g]) / sm[j,g]       (lse = mx + log sm)
//   W[j,g]    = sum_m pi[j,m,g] keep[j,m,g] v[j,m]        (keep: the dropout mask)
//   u[k,j,g]  = mx[j,g] + q[g,:e] . rho[k or g, off(i,j)] (-inf where j is outside)
//   beta      = sm exp(u - max_j u) / sum_j (...)         = softmax_j (u + log sm)
//   out[v]    = sum_(j,g) beta[v,j,g] W[j,g]   (sum form; K = 1: the same row for every v)
//   out[g]    = sum_j beta[0,j,g] W[j,g]       (single form)
// and the output is written times 1 / (1 - drop), the rescaling of attention dropout.
// Backward, with go = dL/dout at the query times 1 / (1 - drop):
//   dbeta[k,j,g] = go[k] . W[j,g],  dW[j,g] = sum_k beta[k,j,g] go[k]
//   dt   = beta (dbeta - sum_j beta dbeta),     dlse[j,g] = sum_k dt[k,j,g]
//   drho[k,off] += sum_g dt[k,j,g] q[g,:e],     dq[g,:e] += sum_(k,j) dt[k,j,g] rho[k,off]
//   dpi  = keep (v[j,m] . dW[j,g]),             dv[j,m] += sum_g pi keep dW[j,g]
//   dc   = pi (dpi - sum_m pi dpi + dlse),      dgl[m,g] += sum_j dc[j,m,g]
//   dq[g] += sum_(j,m) dc[j,m,g] k[j,m],        dk[j,m] += sum_g dc[j,m,g] q[g]
// A group term that depends on the output element, gl[v,m,g] (sum form), makes pi depend on
// v; the probabilities are then mixed over g before the values, so that the value work does
// not grow V-fold. c0 = q[g] . k[j,m] and E0 = exp(c0 - mx) are computed once per tile, and
// per v (group_row) exp(c_v - mx) = E0 F_v, F_v = exp(gl[v] - max_m gl[v]) (M, G): a
// product, not an exp, and never stored (each sum below multiplies its factors):
//   ev[j,m,g] = E0[j,m,g] F_v[m,g],  sm_v = sum_m ev,  pi_v = ev / sm_v
//   beta_v    = softmax_j (s[v,j,g] + mx + log sm_v)  (max_m gl[v] is the same for every j)
//   P_v[j,m]  = sum_g beta_v pi_v keep,               out[v] = sum_(j,m) P_v[j,m] v[j,m]
// Backward, with dP_v[j,m] = go[v] . v[j,m]:
//   dv[j,m]   = sum_v P_v[j,m] go[v],                 dbeta_v = sum_m pi_v keep dP_v
//   acc_v[g]  = sum_j beta_v dbeta_v,                 dt_v = beta_v (dbeta_v - acc_v)
//   dc_v      = pi_v (dpi_v - sum_m pi_v dpi_v + dt_v) = beta_v pi_v (keep dP_v - acc_v)
//   dgl[v,m,g] = sum_j dc_v,  DC = sum_v dc_v,  dq, dk from DC as above; rho from dt_v
// (dpi_v = keep beta_v dP_v). Where a product underflows where the exp of the sum would not
// (extreme logits), that v of the tile computes exp(c0 + gl[v] - max_m) itself.
// The group logits are gathered per tile, never stored: gl[v,m,g] = tq[g, gidx[v,g,m]] with
// tq[g,r] = q[g,d-c:] . emb[r] (G R c products per query instead of V M G c); the backward
// sums dgl into dtq by the same index, then dq[g,d-c:] += dtq[g] emb, d emb += dtq^T q.
// Both passes run in parallel over tiles, each thread a range of consecutive (z, tile) pairs.
// The backward adds dk and dv into z's rows where the thread holds all of z's tiles, else into
// a slab of its own; those slabs, d rho and d emb are summed per thread, then over threads in
// order (deterministic for a thread count).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// A vector of T lanes: 64 bytes with AVX-512 (T = 16 floats or 8 doubles), else 32 (8 or 4:
// one AVX2 register, two of ARM's NEON), with its same-width integer type; a build may set
// 32 or 64 (tests build the other width too). Wider than a register, the compiler splits
// every operation and moves many of the pieces through memory.
#ifndef SYMATTN_VECTOR_BYTES
#if defined(__AVX512F__)
#define SYMATTN_VECTOR_BYTES 64
#else
#define SYMATTN_VECTOR_BYTES 32
#endif
#endif
typedef float VecF __attribute__((vector_size(SYMATTN_VECTOR_BYTES)));
typedef double VecD __attribute__((vector_size(SYMATTN_VECTOR_BYTES)));
typedef int32_t VecI __attribute__((vector_size(SYMATTN_VECTOR_BYTES)));
typedef int64_t VecL __attribute__((vector_size(SYMATTN_VECTOR_BYTES)));
typedef uint32_t VecUF __attribute__((vector_size(SYMATTN_VECTOR_BYTES)));  // 32-bit words
typedef uint32_t VecUD __attribute__((vector_size(SYMATTN_VECTOR_BYTES / 2)));  // of T lanes

template <typename S>
struct Lanes;
template <>
struct Lanes<float> {
  using V = VecF;
  using I = VecI;
  using U = VecUF;
  static constexpr int bias = 127, mantissa = 23;
  static constexpr float low = -87.0f;          // exp below: subnormal or 0
  static constexpr float round = 12582912.0f;   // 1.5 * 2^23: adding it rounds to integers
  static constexpr int degree = 7;              // Taylor terms for float rounding
};
template <>
struct Lanes<double> {
  using V = VecD;
  using I = VecL;
  using U = VecUD;
  static constexpr int bias = 1023, mantissa = 52;
  static constexpr double low = -708.0;
  static constexpr double round = 6755399441055744.0;  // 1.5 * 2^52
  static constexpr int degree = 13;
};

// exp(x) lane by lane for x <= 0 (shifted logits); 0 below the underflow limit and for -inf.
// Range reduction x = n ln2 + r, |r| <= ln2 / 2, then a Taylor polynomial accurate to the
// type's rounding, and 2^n built in the exponent bits.
template <typename S>
typename Lanes<S>::V exp_shifted(typename Lanes<S>::V x) {
  using L = Lanes<S>;
  using V = typename L::V;
  using I = typename L::I;
  const V low = V{} + L::low;
  V xc = x < low ? low : x;
  xc = xc > 0 ? V{} : xc;
  const V n = (xc * S(1.4426950408889634) + L::round) - L::round;
  const V r = (xc - n * S(6.93147180369123816490e-01)) - n * S(1.90821492927058770002e-10);
  S coefficient = 1;
  for (int i = 2; i <= L::degree; ++i) coefficient /= i;
  V p = V{} + coefficient;
  for (int i = L::degree; i >= 1; --i) {  // Horner: sum_i r^i / i!, i = degree .. 0
    coefficient *= i;
    p = p * r + coefficient;
  }
  const I bits = (__builtin_convertvector(n, I) + L::bias) << L::mantissa;
  return x < low ? V{} : p * reinterpret_cast<const V&>(bits);
}

// out[m G] = exp(x[m G] - top) over the M key elements of one g (stride G), with top their
// maximum (the inner softmax's numerators); returns their sum. x and out may be one array.
template <typename S>
inline typename Lanes<S>::V exp_over_m(const typename Lanes<S>::V* x, typename Lanes<S>::V* out,
                                       int64_t M, int64_t G, typename Lanes<S>::V& top) {
  using V = typename Lanes<S>::V;
  top = x[0];
  for (int64_t m = 1; m < M; ++m) top = x[m * G] > top ? x[m * G] : top;
  V sum{};
  for (int64_t m = 0; m < M; ++m) sum += out[m * G] = exp_shifted<S>(x[m * G] - top);
  return sum;
}

// The dropout hash of common.keep_mask, on one number or on a vector of them lane by lane.
template <typename U>
inline U hash32(U x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// Unaligned loads and stores of T consecutive numbers.
template <typename V, typename S>
V loadu(const S* src) {
  V x;
  std::memcpy(&x, src, sizeof x);
  return x;
}
template <typename V, typename S>
void storeu(S* dst, const V& x) {
  std::memcpy(dst, &x, sizeof x);
}

template <typename S>
struct Problem {
  // Channels, then the group axis, then points: q (Z, d, G, L), k and v (Z, d, M, Lkv), the
  // layout of the layer's 1x1 maps (no copy between them and the kernel); the group
  // embedding emb (R, c) and the row each (v, g, m) reads, gidx (Vg, G, M) (Vg = V when the
  // group term depends on the output element (by_v), else 1); rho (V, D, e)
  const S *q, *k, *v, *emb, *rho;  // emb (with gidx), rho: null when absent
  const S* rho_t;  // with offsets: rho as (V, e, D), one row of D per table entry and channel
  const int64_t *gidx, *offsets, *nb;  // offsets: null when local (offset j)
  const bool* valid;                   // null when every neighbour is inside
  int64_t Z, L, Lkv, G, M, J, d, e, V, K, D, R, c;
  bool single, by_v;
  uint32_t threshold, s0, s1;  // dropout: keep iff hash mod 2^15 >= threshold
  S scale;  // 1 / (1 - drop), drop = threshold / 2^15: the output's and go's factor

  // The keep mask (1 or 0) at flat indices lo + hi 2^32, lane by lane (U: T lanes of
  // uint32_t).
  template <typename U>
  U keep(U lo, U hi) const {
    const U x = hash32<U>(hash32<U>(lo ^ s0) ^ s1 ^ hi);
    return (x & 0x7FFFu) >= threshold ? U{} + 1 : U{};
  }
  // The (..., L)-laid row of batch-head z, element g and channel c of a (Z, d, n, L) tensor
  // (q and dq: n = G; k, v and their gradients: n = M); a tile holds it at g d + c.
  int64_t row(int64_t z, int64_t g, int64_t c, int64_t n) const { return (z * d + c) * n + g; }
  int64_t rows() const { return by_v ? V : single ? 1 : K; }  // outer softmaxes per tile
  // Whether the spatial term is one table for every query and every g (local, sum form).
  bool spatial_table() const { return e && !offsets && !single; }
  // Entry a of a local (V, J, e) table within rho (V, D, e).
  int64_t local_row(int64_t a) const { return (a / (J * e)) * D * e + a % (J * e); }
};

// A tile of T queries of one batch-head and its workspace: arrays of lane vectors, one lane
// per query.
template <typename S>
struct Tile {
  using V = typename Lanes<S>::V;
  static constexpr int64_t T = sizeof(V) / sizeof(S);
  int64_t z = -1, n = 0;  // batch-head (-1 before the first load), lanes holding a query (the
                         // rest repeat the last)
  int64_t i[T];          // query of each lane
  Tensor memory;         // 64-byte aligned; the arrays below point into it
  // q (G, d); kg, vg (J, M, d); gl (M, G); pi, keep (J, M, G); mx, sm (J, G); w (J, G, d)
  // and the output rows (V, d) after it (backward: one neighbour's W (G, d));
  // beta (rows, J, G); r (e); pk (M, G): one neighbour's pi keep, or a d rho row (e);
  // rho_local (V, J, e): a local sum-form layer's table, broadcast to every lane; emb_lanes
  // (R, c): the group embedding, broadcast; tq (G, R): q[g, d-c:] . emb[r]
  V *q, *kg, *vg, *gl, *pi, *keep, *mx, *sm, *w, *beta, *r, *pk, *rho_local, *emb_lanes, *tq;
  // by_v: gl (V, M, G); c0 (J, M, G); pi holds exp(c0 - mx), e0k (J, M, G) its kept part;
  // for the current v: egl (M, G): exp(gl - max_m gl); the fallback's ev, evk (J, M, G):
  // exp(c0 + gl - max_m), its kept part, and mxv (J, G): its maxima; beta, a (J, G): beta
  // and beta / sm; acc (G);
  // u (J, G): the current v's outer logits less lse (formed once when every v shares them,
  // K = 1); pv (V, J, M): P
  V *c0, *e0k, *ev, *evk, *egl, *mxv, *a, *acc, *u, *pv;
  // outside (J): 0 on the lanes whose neighbour j is inside, -inf on the others
  V* outside;
  const V *e = nullptr, *ek = nullptr;  // by_v: the current v's E and E keep (group_row)
  // backward: go (V, d); dw (G, d): one neighbour's dW; dt (rows, J, G); dlse (J, G); dq
  // (G, d); dkg, dvg (M, d): one neighbour's dk and dv rows; dc (J, M, G) by_v, else one
  // neighbour's (M, G); dgl (M, G), by_v (V, M, G); by_v: dpv (V, J, M);
  // dtq (G, R); demb (R, c): this thread's d emb, lane by lane, over all its tiles
  V *go, *dw, *dt, *dlse, *dq, *dkg, *dvg, *dc, *dgl, *dpv, *dtq, *demb;

  Tile(const Problem<S>& p, bool backward) {
    const int64_t G = p.G, M = p.M, J = p.J, d = p.d, b = backward, bv = p.by_v;
    const int64_t gl_rows = bv ? p.V : 1, JMG = J * M * G;
    const int64_t sizes[] = {G * d, J * M * d, J * M * d, gl_rows * M * G, JMG,
                             p.threshold ? JMG : 0, J * G, J * G, b ? G * d : (J * G + p.V) * d,
                             (bv ? 1 : p.rows()) * J * G, std::max<int64_t>(p.e, 1),
                             std::max(M * G, p.e), p.spatial_table() ? p.V * J * p.e : 0,
                             p.R * p.c, G * p.R,
                             bv * JMG, bv && p.threshold ? JMG : 0, bv * JMG,
                             bv && p.threshold ? JMG : 0, bv * M * G,
                             bv * J * G, bv * J * G, bv * G, bv * J * G, bv * p.V * J * M,
                             b * p.V * d, b * G * d, b * p.rows() * J * G, b * J * G,
                             b * G * d, b * M * d, b * M * d, b * (bv ? JMG : M * G),
                             b * gl_rows * M * G, b * bv * p.V * J * M, b * G * p.R,
                             b * p.R * p.c, J};
    V** arrays[] = {&q, &kg, &vg, &gl, &pi, &keep, &mx, &sm, &w, &beta, &r, &pk, &rho_local,
                    &emb_lanes, &tq, &c0, &e0k, &ev, &evk, &egl, &mxv, &a, &acc, &u, &pv,
                    &go, &dw, &dt, &dlse, &dq, &dkg, &dvg, &dc, &dgl, &dpv, &dtq, &demb,
                    &outside};
    int64_t total = 0;
    for (int64_t size : sizes) total += size;
    memory = at::empty({total * T}, at::TensorOptions().dtype(c10::CppTypeToScalarType<S>::value));
    V* base = reinterpret_cast<V*>(memory.data_ptr<S>());
    for (size_t a = 0; a < sizeof sizes / sizeof sizes[0]; ++a) {
      *arrays[a] = base;
      base += sizes[a];
    }
    if (p.spatial_table())
      for (int64_t a = 0; a < p.V * J * p.e; ++a) rho_local[a] = V{} + p.rho[p.local_row(a)];
    for (int64_t a = 0; a < p.R * p.c; ++a) emb_lanes[a] = V{} + p.emb[a];
    if (backward) std::fill(demb, demb + p.R * p.c, V{});
  }

  // How the indices lanes read from one row of numbers lie: in one run, lane t at base + t (a
  // vector load), in two such runs (a tile across the end of an image row: two loads, one
  // blend), at one index (a broadcast), or anywhere. Keys lie in runs (neighbour j of
  // consecutive queries), and so do a global layer's table entries off(i, j) (the layer's
  // offset table is sorted so).
  enum Layout : uint8_t { kOneRun, kTwoRuns, kSame, kScattered };
  struct Runs {
    Layout layout = kScattered;
    int64_t first = 0, second = 0;  // where each run's load starts
    typename Lanes<S>::I lower{};  // two runs: all ones on run 0's lanes
  };
  // The runs of the lane indices index[t] (lanes past n repeat the last).
  static Runs runs(const int64_t* index, int64_t n) {
    Runs r;
    bool same = true;
    int64_t split = T;  // the first lane off run 0
    for (int64_t t = 0; t < T; ++t) {
      if (split == T && index[t] != index[0] + t) split = t;
      same &= index[t] == index[0];
    }
    // Two runs whose loads stay within the lanes' own indices: run 1's base lies above run
    // 0's.
    const int64_t base = split < T ? index[split] - split : index[0];
    bool two = n == T && split < T && base >= index[0];
    for (int64_t t = split; two && t < T; ++t) two = index[t] == base + t;
    r.layout = n == T && split == T ? kOneRun : two ? kTwoRuns : same ? kSame : kScattered;
    r.first = index[0], r.second = base;
    for (int64_t t = 0; t < T; ++t) r.lower[t] = t < split ? -1 : 0;
    return r;
  }
  // Lane t of row[index[t]], the indices laid out as r.
  static V read(const S* row, const Runs& r, const int64_t* index) {
    switch (r.layout) {
      case kOneRun:
        return loadu<V>(row + r.first);
      case kTwoRuns:
        return r.lower ? loadu<V>(row + r.first) : loadu<V>(row + r.second);
      case kSame:
        return V{} + row[index[0]];
      default:
        return lanes(row, index);
    }
  }
  // Adds lane t of x to row[index[t]], t < n (read's scatter).
  void add(S* row, const Runs& r, const V& x, const int64_t* index) const {
    switch (r.layout) {
      case kOneRun:
        storeu(row + r.first, loadu<V>(row + r.first) + x);
        break;
      case kTwoRuns: {  // each run adds 0 on the other's lanes
        const V zero{};
        storeu(row + r.first, loadu<V>(row + r.first) + (r.lower ? x : zero));
        storeu(row + r.second, loadu<V>(row + r.second) + (r.lower ? zero : x));
        break;
      }
      case kSame: {
        S sum = 0;
        if (n == T) {  // a tree of halves, not a chain of T dependent adds
          sum = halved<T / 2>(x)[0];
        } else {
          for (int64_t t = 0; t < n; ++t) sum += x[t];
        }
        row[index[0]] += sum;
        break;
      }
      default:
        for (int64_t t = 0; t < n; ++t) row[index[t]] += x[t];
    }
  }
  std::vector<Runs> keys;  // (J): neighbour j's points in the key axis
  std::vector<int64_t> key_index;  // (J, T)
  std::vector<Runs> entries;  // (J), with offsets: the table entries off(i, j) of the lanes
  std::vector<int64_t> entry_index;  // (J, T)

  // Lane t of src[index[t]].
  static V lanes(const S* src, const int64_t* index) {
    V x;
    for (int64_t t = 0; t < T; ++t) x[t] = src[index[t]];
    return x;
  }

  // Points [i0, i0 + T) of a (..., L)-laid row, lanes past n repeating the last.
  V row_at(const S* row) const { return n == T ? loadu<V>(row + i[0]) : lanes(row, i); }

  // Gathers the queries [i0, i0 + T) of batch-head z (clipped to L) and their neighbours. A
  // neighbour whose lanes read the same keys as in the tile before, of the same batch-head (every
  // neighbour of a global layer), keeps its gathered keys and values.
  void load(const Problem<S>& p, int64_t z_, int64_t i0) {
    const int64_t G = p.G, M = p.M, J = p.J, d = p.d, Lkv = p.Lkv;
    const bool same_head = z_ == z;
    z = z_;
    n = std::min<int64_t>(T, p.L - i0);
    for (int64_t t = 0; t < T; ++t) i[t] = i0 + std::min(t, n - 1);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < d; ++c) q[g * d + c] = row_at(p.q + p.row(z, g, c, G) * p.L);
    keys.resize(J);
    key_index.resize(J * T);
    if (p.offsets) {
      entries.resize(J);
      entry_index.resize(J * T);
    }
    for (int64_t j = 0; j < J; ++j) {
      int64_t* index = key_index.data() + j * T;
      bool same = same_head;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t key = p.nb[i[t] * J + j];
        same &= index[t] == key;
        index[t] = key;
      }
      keys[j] = runs(index, n);
      V out{};
      if (p.valid)
        for (int64_t t = 0; t < T; ++t)
          out[t] = p.valid[i[t] * J + j] ? S(0) : -std::numeric_limits<S>::infinity();
      outside[j] = out;
      if (p.offsets) {
        int64_t* entry = entry_index.data() + j * T;
        for (int64_t t = 0; t < T; ++t) entry[t] = p.offsets[i[t] * J + j];
        entries[j] = runs(entry, n);
      }
      if (same) continue;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t c = 0; c < d; ++c) {
          const int64_t at = p.row(z, m, c, M) * Lkv, mc = (j * M + m) * d + c;
          kg[mc] = read(p.k + at, keys[j], index), vg[mc] = read(p.v + at, keys[j], index);
        }
    }
  }

  // pi keep (M, G) of neighbour j: pi itself without dropout, else a product in pk.
  const V* kept(const Problem<S>& p, int64_t j) {
    const int64_t MG = p.M * p.G;
    if (!p.threshold) return pi + j * MG;
    for (int64_t mg = 0; mg < MG; ++mg) pk[mg] = pi[j * MG + mg] * keep[j * MG + mg];
    return pk;
  }

  // r (e) <- rho[row, off(i, j)] for every lane (one offset for all lanes when local).
  void gather_rho(const Problem<S>& p, int64_t row, int64_t j) {
    if (!p.offsets) {
      for (int64_t c = 0; c < p.e; ++c) r[c] = V{} + p.rho[(row * p.D + j) * p.e + c];
      return;
    }
    for (int64_t c = 0; c < p.e; ++c)  // from one row of D
      r[c] = read(p.rho_t + (row * p.e + c) * p.D, entries[j], entry_index.data() + j * T);
  }

  // Adds dr (e) to d rho[row, off(i, j)]: lane by lane into the local table's vectors, or
  // into d rho_t (V, e, D) at each lane's own entry.
  void scatter_rho(const Problem<S>& p, V* local, S* drho, int64_t row, int64_t j,
                   const V* dr) const {
    if (!p.offsets) {
      for (int64_t c = 0; c < p.e; ++c) local[(row * p.J + j) * p.e + c] += dr[c];
      return;
    }
    for (int64_t c = 0; c < p.e; ++c)
      add(drho + (row * p.e + c) * p.D, entries[j], dr[c], entry_index.data() + j * T);
  }

  // In each block of 2h lanes: the first h lanes hold a's block folded in half (a[l] +
  // a[l + h]), the last h lanes b's.
  template <int64_t h, size_t... l>
  static V fold(const V& a, const V& b, std::index_sequence<l...>) {
    return __builtin_shufflevector(a, b, (l % (2 * h) < h ? l : T + l - h)...) +
           __builtin_shufflevector(a, b, (l % (2 * h) < h ? l + h : T + l)...);
  }
  template <int64_t h>
  static V halved(const V& x) {  // every lane: the sum of x's lanes (x folded onto itself)
    const V y = fold<h>(x, x, std::make_index_sequence<T>{});
    if constexpr (h > 1) return halved<h / 2>(y);
    return y;
  }
  template <int64_t h>
  static void fold_pairs(V* x) {  // x[a] with x[a + h], a < h, then the next round
    for (int64_t a = 0; a < h; ++a) x[a] = fold<h>(x[a], x[a + h], std::make_index_sequence<T>{});
    if constexpr (h > 1) fold_pairs<h / 2>(x);
  }
  // Lane t: the sum of x[t]'s lanes, for T vectors x (log2 T rounds of folding pairs).
  static V lane_sums(const V* x) {
    V y[T / 2];
    for (int64_t a = 0; a < T / 2; ++a)
      y[a] = fold<T / 2>(x[a], x[a + T / 2], std::make_index_sequence<T>{});
    fold_pairs<T / 4>(y);
    return y[0];
  }

  // Adds neighbour j's dk and dv rows (dkg, dvg) to the tile's batch-head of the inputs'
  // gradients, dk and dv (d, M, Lkv); outside neighbours add 0 (beta = 0). Where every lane
  // has the same key (a global layer), T rows' lane sums are made at once.
  void scatter_kv(const Problem<S>& p, int64_t j, S* dk, S* dv) const {
    const int64_t* index = key_index.data() + j * T;
    const int64_t M = p.M, d = p.d, Md = M * d, Lkv = p.Lkv;
    int64_t a = 0, m = 0, c = 0;  // row a = m d + c of dkg and dvg, at (c M + m) Lkv in dk, dv
    const auto next = [&] {
      ++a;
      if (++c == d) c = 0, ++m;
    };
    while (keys[j].layout == kSame && n == T && a + T <= Md) {
      const V ksums = lane_sums(dkg + a), vsums = lane_sums(dvg + a);
      for (int64_t t = 0; t < T; ++t, next()) {
        const int64_t at = (c * M + m) * Lkv + index[0];
        dk[at] += ksums[t], dv[at] += vsums[t];
      }
    }
    for (; a < Md; next()) {
      const int64_t at = (c * M + m) * Lkv;
      add(dk + at, keys[j], dkg[a], index);
      add(dv + at, keys[j], dvg[a], index);
    }
  }

  // Stores x at the tile's points of a (..., L)-laid row, t < n.
  void store_row(S* row, const V& x) const {
    if (n == T) {
      storeu(row + i[0], x);
    } else {
      for (int64_t t = 0; t < n; ++t) row[i[t]] = x[t];
    }
  }
};

// out[a, b] = sum_k x[a, k] y[b, k] (+= with accumulate) for lane vectors, each operand given
// by its base and strides. Four b at a time: four independent sums share each load of x,
// instead of one chain of dependent multiply-adds; the b past the last four take four a at a
// time, sharing each load of y.
template <typename V>
struct Operand {
  const V* at;
  int64_t outer, inner;  // strides of its free index and of k
};
template <typename V>
void contract(V* out, int64_t out_a, int64_t out_b, Operand<V> x, Operand<V> y, int64_t na,
              int64_t nb, int64_t nk, bool accumulate) {
  constexpr int64_t kBlock = 256;  // k per pass: a pass's x and y rows stay in cache
  if (nk > kBlock) {
    for (int64_t k0 = 0; k0 < nk; k0 += kBlock)
      contract<V>(out, out_a, out_b, {x.at + k0 * x.inner, x.outer, x.inner},
                  {y.at + k0 * y.inner, y.outer, y.inner}, na, nb, std::min(kBlock, nk - k0),
                  accumulate || k0 > 0);
    return;
  }
  const auto put = [&](V* o, const V& s) { *o = accumulate ? *o + s : s; };
  const int64_t nb4 = nb - nb % 4;
  for (int64_t a = 0; a < na; ++a) {
    const V* xa = x.at + a * x.outer;
    V* oa = out + a * out_a;
    for (int64_t b = 0; b < nb4; b += 4) {
      const V* yb = y.at + b * y.outer;
      V s0{}, s1{}, s2{}, s3{};
      for (int64_t k = 0; k < nk; ++k) {
        const V xk = xa[k * x.inner];
        const V* yk = yb + k * y.inner;
        s0 += xk * yk[0];
        s1 += xk * yk[y.outer];
        s2 += xk * yk[2 * y.outer];
        s3 += xk * yk[3 * y.outer];
      }
      V* o = oa + b * out_b;
      put(o, s0), put(o + out_b, s1), put(o + 2 * out_b, s2), put(o + 3 * out_b, s3);
    }
  }
  for (int64_t b = nb4; b < nb; ++b) {
    const V* yb = y.at + b * y.outer;
    int64_t a = 0;
    for (; a + 4 <= na; a += 4) {
      const V* xa = x.at + a * x.outer;
      V s0{}, s1{}, s2{}, s3{};
      for (int64_t k = 0; k < nk; ++k) {
        const V yk = yb[k * y.inner];
        const V* xk = xa + k * x.inner;
        s0 += xk[0] * yk;
        s1 += xk[x.outer] * yk;
        s2 += xk[2 * x.outer] * yk;
        s3 += xk[3 * x.outer] * yk;
      }
      V* o = out + a * out_a + b * out_b;
      put(o, s0), put(o + out_a, s1), put(o + 2 * out_a, s2), put(o + 3 * out_a, s3);
    }
    for (; a < na; ++a) {
      const V* xa = x.at + a * x.outer;
      V s{};
      for (int64_t k = 0; k < nk; ++k) s += xa[k * x.inner] * yb[k * y.inner];
      put(out + a * out_a + b * out_b, s);
    }
  }
}

// u[j, g] = s[k, j, g] + base[j, g] (base: null for 0), -inf where j is outside: the logits of
// row k of the outer softmax, s = q[g, :e] . rho[k or g, off(i, j)].
template <typename S>
void outer_logits(const Problem<S>& p, Tile<S>& tl, int64_t k, typename Tile<S>::V* u,
                  const typename Tile<S>::V* base) {
  using V = typename Tile<S>::V;
  const int64_t G = p.G, J = p.J, d = p.d, e = p.e;
  if (p.spatial_table())  // u[j, g] = rho[k, j] . q[g, :e], then base and outside added
    contract<V>(u, G, 1, {tl.rho_local + k * J * e, e, 1}, {tl.q, d, 1}, J, G, e, false);
  for (int64_t j = 0; j < J; ++j) {
    const V outside = tl.outside[j];
    if (p.spatial_table()) {
      for (int64_t g = 0; g < G; ++g) u[j * G + g] += (base ? base[j * G + g] : V{}) + outside;
      continue;
    }
    if (e && !p.single) tl.gather_rho(p, k, j);
    for (int64_t g = 0; g < G; ++g) {
      V x = (base ? base[j * G + g] : V{}) + outside;
      if (e) {
        if (p.single) tl.gather_rho(p, g, j);  // v = g: its own table row
        for (int64_t c = 0; c < e; ++c) x += tl.q[g * d + c] * tl.r[c];
      }
      u[j * G + g] = x;
    }
  }
}

// b[j, g] <- sm exp(b - max_j b) / sum_j (...) = softmax_j(b + log sm), in place; with a,
// also a[j, g] = b / sm (no division).
template <typename S>
void outer_softmax(int64_t J, int64_t G, typename Tile<S>::V* b, const typename Tile<S>::V* sm,
                   typename Tile<S>::V* a = nullptr) {
  using V = typename Tile<S>::V;
  const S inf = std::numeric_limits<S>::infinity();
  for (int64_t g = 0; g < G; ++g) {
    V top = V{} - inf;
    for (int64_t j = 0; j < J; ++j) top = b[j * G + g] > top ? b[j * G + g] : top;
    V sum{};
    for (int64_t j = 0; j < J; ++j) {
      const V x = exp_shifted<S>(b[j * G + g] - top);
      if (a) a[j * G + g] = x;
      sum += b[j * G + g] = sm[j * G + g] * x;
    }
    const V inv = 1 / sum;
    for (int64_t j = 0; j < J; ++j) {
      b[j * G + g] *= inv;
      if (a) a[j * G + g] *= inv;
    }
  }
}

// gl, pi, keep, mx, sm, W and beta of a loaded tile; by_v: c0, pi = exp(c0 - mx), keep and,
// when every v has the same outer logits, u: the parts every v shares (group_row completes
// them per v, forming its own u where the spatial term differs by v, while it is in cache). In
// the backward (go loaded), W is not kept: each neighbour's W[j] gives dbeta[k, j, g] =
// go[k] . W[j, g] at once, into dt.
template <typename S, int64_t FG, int64_t FM>
void forward_tile(const Problem<S>& p, Tile<S>& tl, bool backward = false) {
  using V = typename Tile<S>::V;
  constexpr int64_t T = Tile<S>::T;
  const int64_t G = FG ? FG : p.G, M = FM ? FM : p.M, J = p.J, d = p.d;
  if (p.emb) {  // gl[v, m, g] = tq[g, gidx[v, g, m]],  tq[g, r] = q[g, d-c:] . emb[r]
    const int64_t R = p.R;
    contract<V>(tl.tq, R, 1, {tl.q + d - p.c, d, 1}, {tl.emb_lanes, p.c, 1}, G, R, p.c, false);
    for (int64_t vg = 0; vg < (p.by_v ? p.V : 1) * G; ++vg)
      for (int64_t m = 0; m < M; ++m)
        tl.gl[((vg / G) * M + m) * G + vg % G] = tl.tq[(vg % G) * R + p.gidx[vg * M + m]];
  }
  for (int64_t j = 0; j < J; ++j) {
    V* pj = tl.pi + j * M * G;  // (M, G): logits, then pi
    const V* kj = tl.kg + j * M * d;
    // c[m, g] = gl[m, g] + k[j, m] . q[g];  by_v: c0 = k[j, m] . q[g], kept in c0
    if (p.by_v) {
      V* cj = tl.c0 + j * M * G;
      contract<V>(cj, G, 1, {kj, d, 1}, {tl.q, d, 1}, M, G, d, false);
      std::copy(cj, cj + M * G, pj);
    } else {
      if (p.emb) std::copy(tl.gl, tl.gl + M * G, pj);
      contract<V>(pj, G, 1, {kj, d, 1}, {tl.q, d, 1}, M, G, d, p.emb);
    }
    if (M == 1) {  // one key element (a lifting layer): pi = 1, mx = c, sm = 1
      for (int64_t g = 0; g < G; ++g) {
        tl.mx[j * G + g] = pj[g];
        tl.sm[j * G + g] = pj[g] = V{} + 1;
      }
    } else {
      for (int64_t g = 0; g < G; ++g) {  // softmax over m (by_v: its numerators only)
        V top;
        const V sum = exp_over_m<S>(pj + g, pj + g, M, G, top);
        tl.mx[j * G + g] = top;
        tl.sm[j * G + g] = sum;
        if (p.by_v) continue;
        const V inv = 1 / sum;
        for (int64_t m = 0; m < M; ++m) pj[m * G + g] *= inv;
      }
    }
    V* kp = p.threshold ? tl.keep + j * M * G : nullptr;
    if (kp) {  // the mask at flat index (((z L + i) J + j) M + m) G + g, all lanes at once
      using U = typename Lanes<S>::U;
      U lo, hi;
      for (int64_t t = 0; t < T; ++t) {
        const uint64_t flat = static_cast<uint64_t>(((tl.z * p.L + tl.i[t]) * J + j) * M * G);
        lo[t] = static_cast<uint32_t>(flat), hi[t] = static_cast<uint32_t>(flat >> 32);
      }
      for (int64_t mg = 0; mg < M * G; ++mg) {
        const U lo_mg = lo + static_cast<uint32_t>(mg);
        const U carry = lo_mg < lo ? U{} + 1 : U{};  // mg < 2^32: at most one carry
        kp[mg] = __builtin_convertvector(p.keep(lo_mg, hi + carry), V);
      }
      if (p.by_v)  // E0 keep, which every v scales by its group term
        for (int64_t mg = 0; mg < M * G; ++mg) tl.e0k[j * M * G + mg] = pj[mg] * kp[mg];
    }
    // W[j, g] = sum_m pi keep[j, m, g] v[j, m]
    if (p.by_v) continue;
    V* wj = backward ? tl.w : tl.w + j * G * d;
    contract<V>(wj, d, 1, {tl.kept(p, j), 1, G}, {tl.vg + j * M * d, 1, d}, G, d, M, false);
    if (backward && p.single) {  // dbeta[j, g] = go[g] . W[j, g]
      for (int64_t g = 0; g < G; ++g) {
        V sum{};
        for (int64_t c = 0; c < d; ++c) sum += tl.go[g * d + c] * wj[g * d + c];
        tl.dt[j * G + g] = sum;
      }
    } else if (backward) {  // dbeta[k, j, g] = go[k] . W[j, g]
      contract<V>(tl.dt + j * G, J * G, 1, {tl.go, d, 1}, {wj, d, 1}, p.rows(), G, d, false);
    }
  }
  if (p.by_v) {  // u = s[0] (outside: -inf) when every v shares it; else group_row forms s[v]
    if (p.K == 1) outer_logits(p, tl, 0, tl.u, nullptr);
    return;
  }
  // outer logits u (rows, J, G) = s + mx, then beta = softmax_j(u + log sm)
  for (int64_t k = 0; k < p.rows(); ++k) {
    V* bk = tl.beta + k * J * G;
    outer_logits(p, tl, k, bk, tl.mx);
    outer_softmax<S>(J, G, bk, tl.sm);
  }
}

// by_v, output element v: sm, beta and a = beta / sm (J, G), and P[v] (J, M), with the
// factors of exp(c_v - mx) = E[j, m, g] F[m, g] left in tl.e, tl.ek (E keep) and tl.egl (F).
// Usually E = E0 = exp(c0 - mx) and F = exp(gl[v] - max_m gl[v]), shared by every v: the
// entries of the product are never stored; the shift max_m gl[v] does not depend on j, so it
// cancels in the softmax over j. Where a product could have lost its largest term to
// underflow (sm below M exp(low / 2) on some lane), this v takes E = exp(c - max_m c) itself
// (into tl.ev, tl.evk) and F = 1. With dp = dP[v] (J, M) (the backward), the same pass over
// E keep F also gives sm dbeta[j, g] = sum_m E keep F dP (dbeta = sum_m pi keep dP), into
// dbeta (J, G).
template <typename S, int64_t FG, int64_t FM>
void group_row(const Problem<S>& p, Tile<S>& tl, int64_t v,
               const typename Tile<S>::V* dp = nullptr, typename Tile<S>::V* dbeta = nullptr) {
  using V = typename Tile<S>::V;
  constexpr int64_t T = Tile<S>::T;
  const int64_t G = FG ? FG : p.G, M = FM ? FM : p.M, J = p.J, MG = M * G;
  const S inf = std::numeric_limits<S>::infinity();
  const V* glv = tl.gl + v * MG;
  V* f = tl.egl;
  for (int64_t g = 0; g < G; ++g) {
    V top;
    exp_over_m<S>(glv + g, f + g, M, G, top);
  }
  tl.e = tl.pi, tl.ek = p.threshold ? tl.e0k : tl.pi;
  // sm[j, g] = sum_m E F
  V least = V{} + inf;
  for (int64_t j = 0; j < J; ++j) {
    const V* ej = tl.e + j * MG;
    for (int64_t g = 0; g < G; ++g) {
      V sum = ej[g] * f[g];
      for (int64_t m = 1; m < M; ++m) sum += ej[m * G + g] * f[m * G + g];
      tl.sm[j * G + g] = sum;
      least = sum < least ? sum : least;
    }
  }
  const V* shift = tl.mx;
  const S tiny = M * std::exp(Lanes<S>::low / 2);
  bool exact = true;
  for (int64_t t = 0; t < T; ++t) exact &= least[t] >= tiny;
  if (!exact) {
    for (int64_t j = 0; j < J; ++j) {
      const V* cj = tl.c0 + j * MG;
      V* evj = tl.ev + j * MG;
      for (int64_t mg = 0; mg < MG; ++mg) evj[mg] = cj[mg] + glv[mg];
      for (int64_t g = 0; g < G; ++g)
        tl.sm[j * G + g] = exp_over_m<S>(evj + g, evj + g, M, G, tl.mxv[j * G + g]);
    }
    shift = tl.mxv;
    std::fill(f, f + MG, V{} + 1);
    tl.e = tl.ek = tl.ev;
    if (p.threshold) {
      for (int64_t a = 0; a < J * MG; ++a) tl.evk[a] = tl.ev[a] * tl.keep[a];
      tl.ek = tl.evk;
    }
  }
  // beta = softmax_j(s[v] + shift + log sm)
  if (p.K > 1) outer_logits(p, tl, v, tl.u, nullptr);
  const V* uv = tl.u;
  for (int64_t jg = 0; jg < J * G; ++jg) tl.beta[jg] = uv[jg] + shift[jg];
  outer_softmax<S>(J, G, tl.beta, tl.sm, tl.a);
  // P[v, j, m] = sum_g beta pi keep = sum_g a E keep F
  V* pv = tl.pv + v * J * M;
  for (int64_t j = 0; j < J; ++j) {
    const V* aj = tl.a + j * G;
    if (dp) std::fill(dbeta + j * G, dbeta + (j + 1) * G, V{});
    for (int64_t m = 0; m < M; ++m) {
      const V *ek = tl.ek + (j * M + m) * G, *fm = f + m * G;
      V sum{};
      if (dp) {
        const V x = dp[j * M + m];
        V* dbj = dbeta + j * G;
        for (int64_t g = 0; g < G; ++g) {
          const V w = ek[g] * fm[g];
          sum += aj[g] * w;
          dbj[g] += x * w;
        }
      } else {
        for (int64_t g = 0; g < G; ++g) sum += aj[g] * ek[g] * fm[g];
      }
      pv[j * M + m] = sum;
    }
  }
}

// out (Z, d, V, L) at the tile's queries.
template <typename S, int64_t FG, int64_t FM>
void output_tile(const Problem<S>& p, Tile<S>& tl, S* out) {
  using V = typename Tile<S>::V;
  const int64_t G = FG ? FG : p.G, J = p.J, d = p.d;
  const int64_t rows = p.single ? G : p.rows();  // distinct output rows
  V* o = tl.w + J * G * d;  // (rows, d), in the workspace after W
  if (p.by_v) {  // out[v] = sum_(j,m) P[v, j, m] val[j, m]
    for (int64_t v = 0; v < p.V; ++v) group_row<S, FG, FM>(p, tl, v);
    const int64_t JM = J * (FM ? FM : p.M);
    contract<V>(o, d, 1, {tl.pv, JM, 1}, {tl.vg, 1, d}, rows, d, JM, false);
  } else if (p.single) {  // out[g] = sum_j beta[j, g] W[j, g]
    for (int64_t g = 0; g < G; ++g)
      contract<V>(o + g * d, 0, 1, {tl.beta + g, 0, G}, {tl.w + g * d, 1, G * d}, 1, d, J, false);
  } else {  // out[k] = sum_(j,g) beta[k, j, g] W[j, g]
    contract<V>(o, d, 1, {tl.beta, J * G, 1}, {tl.w, 1, d}, rows, d, J * G, false);
  }
  for (int64_t k = 0; k < rows; ++k)
    for (int64_t c = 0; c < d; ++c) {
      if (rows == p.V) {
        tl.store_row(out + ((tl.z * d + c) * p.V + k) * p.L, o[k * d + c] * p.scale);
      } else {  // no spatial term: every v has the same weights
        for (int64_t v = 0; v < p.V; ++v)
          tl.store_row(out + ((tl.z * d + c) * p.V + v) * p.L, o[k * d + c] * p.scale);
      }
    }
}

template <typename S>
struct Grads {
  S *dq, *dk, *dv, *drho;  // dk, dv: the tile's batch-head; drho: null when absent, this
                           // thread's sum
};

// tl.go (V, d): go (Z, d, V, L) at the tile's queries times the dropout's rescaling; 0 on lanes
// without a query of their own. Where every v had the same weights (one row, sum form), their
// gradients add up in row 0.
template <typename S>
void load_go(const Problem<S>& p, Tile<S>& tl, const S* go) {
  using V = typename Tile<S>::V;
  const int64_t d = p.d;
  V valid_lane{};
  for (int64_t t = 0; t < tl.n; ++t) valid_lane[t] = p.scale;
  for (int64_t v = 0; v < p.V; ++v)
    for (int64_t c = 0; c < d; ++c)
      tl.go[v * d + c] = tl.row_at(go + ((tl.z * d + c) * p.V + v) * p.L) * valid_lane;
  if (!p.single && p.rows() == 1) {
    for (int64_t v = 1; v < p.V; ++v)
      for (int64_t c = 0; c < d; ++c) tl.go[c] += tl.go[v * d + c];
  }
}

// Gradients of a tile whose go is loaded and whose forward quantities are computed (with
// dbeta in dt where not by_v). dq (Z, d, G, L) is laid out as q, dk and dv (d, M, Lkv) as the
// tile's batch-head of k and v; drho_local (V, J, e) collects a local layer's d rho lane by
// lane, tl.demb the group embedding's.
template <typename S, int64_t FG, int64_t FM>
void backward_tile(const Problem<S>& p, Tile<S>& tl, const Grads<S>& gr,
                   typename Tile<S>::V* drho_local) {
  using V = typename Tile<S>::V;
  const int64_t G = FG ? FG : p.G, M = FM ? FM : p.M, J = p.J, d = p.d, e = p.e;
  const int64_t rows = p.rows();
  std::fill(tl.dq, tl.dq + G * d, V{});
  if (p.by_v) {
    const int64_t MG = M * G, JM = J * M;
    // dP[v, j, m] = go[v] . val[j, m]
    contract<V>(tl.dpv, JM, 1, {tl.go, d, 1}, {tl.vg, d, 1}, p.V, JM, d, false);
    std::fill(tl.dc, tl.dc + J * MG, V{});
    for (int64_t v = 0; v < p.V; ++v) {
      const V *f = tl.egl, *dp = tl.dpv + v * JM;
      V* dtv = tl.dt + v * J * G;
      group_row<S, FG, FM>(p, tl, v, dp, dtv);  // and sm dbeta, into dt
      // acc[g] = sum_j beta dbeta = sum_j a (sm dbeta);  dt = beta (dbeta - acc)
      for (int64_t g = 0; g < G; ++g) {
        V sum{};
        for (int64_t j = 0; j < J; ++j) sum += tl.a[j * G + g] * dtv[j * G + g];
        tl.acc[g] = sum;
        for (int64_t j = 0; j < J; ++j)
          dtv[j * G + g] = tl.a[j * G + g] * dtv[j * G + g] - tl.beta[j * G + g] * sum;
      }
      // dc = pi (dpi - sum_m pi dpi + dt) = beta pi (keep dP - acc) = a F (E keep dP - E acc);
      // dgl[v] = sum_j dc;  DC = sum_v dc
      V* dglv = tl.dgl + v * MG;
      std::fill(dglv, dglv + MG, V{});
      for (int64_t j = 0; j < J; ++j)
        for (int64_t m = 0; m < M; ++m) {
          const V x = dp[j * M + m];
          const int64_t at = (j * M + m) * G;
          const V *ek = tl.ek + at, *en = tl.e + at, *fm = f + m * G, *aj = tl.a + j * G;
          for (int64_t g = 0; g < G; ++g) {
            const V y = aj[g] * fm[g] * (ek[g] * x - en[g] * tl.acc[g]);
            tl.dc[at + g] += y;
            dglv[m * G + g] += y;
          }
        }
    }
    // dv[j, m] = sum_v P[v, j, m] go[v];  dk[j, m] = sum_g DC[j, m, g] q[g];
    // dq[g] += sum_m DC[j, m, g] k[j, m]
    for (int64_t j = 0; j < J; ++j) {
      const V* dc = tl.dc + j * MG;
      contract<V>(tl.dvg, d, 1, {tl.pv + j * M, 1, JM}, {tl.go, 1, d}, M, d, p.V, false);
      contract<V>(tl.dkg, d, 1, {dc, G, 1}, {tl.q, 1, d}, M, d, G, false);
      contract<V>(tl.dq, d, 1, {dc, 1, G}, {tl.kg + j * M * d, 1, d}, G, d, M, true);
      tl.scatter_kv(p, j, gr.dk, gr.dv);
    }
  }
  // softmax over j: dt = beta (dbeta - sum_j beta dbeta); dlse = sum_k dt
  std::fill(tl.dlse, tl.dlse + J * G, V{});
  for (int64_t k = 0; k < rows && !p.by_v; ++k)
    for (int64_t g = 0; g < G; ++g) {
      const V* bk = tl.beta + k * J * G;
      V* dtk = tl.dt + k * J * G;
      V acc{};
      for (int64_t j = 0; j < J; ++j) acc += bk[j * G + g] * dtk[j * G + g];
      for (int64_t j = 0; j < J; ++j) {
        dtk[j * G + g] = bk[j * G + g] * (dtk[j * G + g] - acc);
        tl.dlse[j * G + g] += dtk[j * G + g];
      }
    }
  // the spatial term: dq[g, :e] = sum_(k,j) dt[k,j,g] rho[k or g, off]; d rho
  if (p.spatial_table()) {  // one table: two contractions over (k, j) and g
    contract<V>(tl.dq, d, 1, {tl.dt, 1, G}, {tl.rho_local, 1, e}, G, e, rows * J, true);
    contract<V>(drho_local, e, 1, {tl.dt, G, 1}, {tl.q, 1, d}, rows * J, e, G, true);
  } else if (e) {  // a table row per lane (global) or per g (single)
    V* dr = tl.pk;  // (e): this (k, j)'s d rho, summed over g when the row is shared
    for (int64_t k = 0; k < rows; ++k)
      for (int64_t j = 0; j < J; ++j) {
        if (!p.single) tl.gather_rho(p, k, j), std::fill(dr, dr + e, V{});
        for (int64_t g = 0; g < G; ++g) {
          if (p.single) tl.gather_rho(p, g, j), std::fill(dr, dr + e, V{});
          const V x = tl.dt[(k * J + j) * G + g];
          for (int64_t c = 0; c < e; ++c) {
            tl.dq[g * d + c] += x * tl.r[c];
            dr[c] += x * tl.q[g * d + c];  // 0 on lanes past n: go is 0 there
          }
          if (p.single || g == G - 1)
            tl.scatter_rho(p, drho_local, gr.drho, p.single ? g : k, j, dr);
        }
      }
  }
  // the inner softmax, the keys and the values
  if (p.emb && !p.by_v) std::fill(tl.dgl, tl.dgl + M * G, V{});
  for (int64_t j = 0; j < J && !p.by_v; ++j) {
    const V* pj = tl.pi + j * M * G;
    const V* kj = tl.kg + j * M * d;
    V *dwj = tl.dw, *dc = tl.dc;
    // dW[j, g] = sum_k beta[k, j, g] go[k] (single: beta[j, g] go[g])
    if (p.single) {
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < d; ++c) dwj[g * d + c] = tl.beta[j * G + g] * tl.go[g * d + c];
    } else {
      contract<V>(dwj, d, 1, {tl.beta + j * G, 1, J * G}, {tl.go, 1, d}, G, d, rows, false);
    }
    // dpi[m, g] = keep (v[j, m] . dW[j, g]), into dc;  dv[j, m] = sum_g pi keep dW[j, g]
    contract<V>(dc, G, 1, {tl.vg + j * M * d, d, 1}, {dwj, d, 1}, M, G, d, false);
    if (p.threshold)
      for (int64_t mg = 0; mg < M * G; ++mg) dc[mg] *= tl.keep[j * M * G + mg];
    contract<V>(tl.dvg, d, 1, {tl.kept(p, j), G, 1}, {dwj, 1, d}, M, d, G, false);
    for (int64_t g = 0; g < G; ++g) {  // dc = pi (dpi - sum_m pi dpi + dlse)
      V acc = -tl.dlse[j * G + g];
      for (int64_t m = 0; m < M; ++m) acc += pj[m * G + g] * dc[m * G + g];
      for (int64_t m = 0; m < M; ++m) dc[m * G + g] = pj[m * G + g] * (dc[m * G + g] - acc);
    }
    if (p.emb)
      for (int64_t mg = 0; mg < M * G; ++mg) tl.dgl[mg] += dc[mg];
    // dk[j, m] = sum_g dc[m, g] q[g];  dq[g] += sum_m dc[m, g] k[j, m]
    contract<V>(tl.dkg, d, 1, {dc, G, 1}, {tl.q, 1, d}, M, d, G, false);
    contract<V>(tl.dq, d, 1, {dc, 1, G}, {kj, 1, d}, G, d, M, true);
    tl.scatter_kv(p, j, gr.dk, gr.dv);
  }

  // the group term: dtq[g, gidx[v, g, m]] += dgl[v, m, g], then dq[g, d-c:] += dtq[g] emb
  // and d emb[r] += sum_g dtq[g, r] q[g, d-c:] (0 on lanes past n: go is 0 there)
  if (p.emb) {
    const int64_t R = p.R, c = p.c;
    std::fill(tl.dtq, tl.dtq + G * R, V{});
    for (int64_t vg = 0; vg < (p.by_v ? p.V : 1) * G; ++vg)
      for (int64_t m = 0; m < M; ++m)
        tl.dtq[(vg % G) * R + p.gidx[vg * M + m]] += tl.dgl[((vg / G) * M + m) * G + vg % G];
    contract<V>(tl.dq + d - c, d, 1, {tl.dtq, R, 1}, {tl.emb_lanes, 1, c}, G, c, R, true);
    contract<V>(tl.demb, c, 1, {tl.dtq, 1, R}, {tl.q + d - c, 1, d}, R, c, G, true);
  }
  // dq at the tile's queries (dk and dv went to the neighbours above)
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < d; ++c)
      tl.store_row(gr.dq + p.row(tl.z, g, c, G) * p.L, tl.dq[g * d + c]);
}

template <typename S>
Problem<S> problem(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& emb,
                   const OptTensor& gidx, const OptTensor& rho, const OptTensor& offsets,
                   const Tensor& nb, const OptTensor& valid, bool single, int64_t n,
                   int64_t threshold, int64_t seed, const Tensor& rho_t) {
  Problem<S> p{};
  p.q = q.data_ptr<S>();
  p.k = k.data_ptr<S>();
  p.v = v.data_ptr<S>();
  p.emb = emb ? emb->data_ptr<S>() : nullptr;
  p.gidx = emb ? gidx->data_ptr<int64_t>() : nullptr;
  p.R = emb ? emb->size(0) : 0;
  p.c = emb ? emb->size(1) : 0;
  p.rho = rho ? rho->data_ptr<S>() : nullptr;
  p.rho_t = rho_t.defined() ? rho_t.data_ptr<S>() : nullptr;
  p.offsets = offsets ? offsets->data_ptr<int64_t>() : nullptr;
  p.nb = nb.data_ptr<int64_t>();
  p.valid = valid ? valid->data_ptr<bool>() : nullptr;
  p.Z = q.size(0), p.d = q.size(1), p.G = q.size(2), p.L = q.size(3);
  p.M = k.size(2), p.Lkv = k.size(3), p.J = nb.size(1);
  p.e = rho ? rho->size(2) : 0;
  p.D = rho ? rho->size(1) : 0;
  p.V = n;
  p.single = single;
  p.by_v = emb && gidx->size(0) > 1;
  p.K = (single || !p.e) ? 1 : n;
  p.threshold = static_cast<uint32_t>(threshold);
  p.scale = static_cast<S>(1.0 / (1.0 - static_cast<double>(threshold) / 32768.0));
  p.s0 = static_cast<uint32_t>(static_cast<uint64_t>(seed));
  p.s1 = static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32);
  return p;
}

void check(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& emb,
           const OptTensor& gidx, const OptTensor& rho, const OptTensor& offsets, const Tensor& nb,
           const OptTensor& valid, bool single, int64_t n) {
  for (const Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->dim() == 4,
                "q, k, v must be contiguous 4-d CPU tensors");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "q, k, v must share a dtype");
  }
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(1) == q.size(1),
              "k and v must be (Z, d, M, Lkv) with q's Z and d");
  TORCH_CHECK(nb.scalar_type() == at::kLong && nb.is_contiguous() && nb.dim() == 2 &&
                  nb.size(0) == q.size(3),
              "neighbour must be contiguous int64 (L, J)");
  TORCH_CHECK(emb.has_value() == gidx.has_value(), "the group embedding needs its index");
  if (emb) {
    TORCH_CHECK(emb->is_contiguous() && emb->scalar_type() == q.scalar_type() &&
                    emb->dim() == 2 && emb->size(1) <= q.size(1) && emb->size(0) > 0,
                "the group embedding must be contiguous (R, c) with c <= d");
    TORCH_CHECK(gidx->scalar_type() == at::kLong && gidx->is_contiguous() && gidx->dim() == 3 &&
                    (gidx->size(0) == 1 || gidx->size(0) == n) && gidx->size(1) == q.size(2) &&
                    gidx->size(2) == k.size(2),
                "the group index must be contiguous int64 (1 or V, G, M)");
    const int64_t *first = gidx->data_ptr<int64_t>(), *last = first + gidx->numel();
    TORCH_CHECK(std::all_of(first, last, [&](int64_t r) { return r >= 0 && r < emb->size(0); }),
                "the group index must be in [0, R)");
    TORCH_CHECK(!(single && gidx->size(0) > 1), "the single form takes a group index (1, G, M)");
  }
  if (rho) {
    TORCH_CHECK(rho->is_contiguous() && rho->scalar_type() == q.scalar_type() &&
                    rho->dim() == 3 && rho->size(0) == n && rho->size(2) <= q.size(1),
                "rho must be contiguous (V, D, e) with e <= d");
    TORCH_CHECK(offsets || rho->size(1) >= nb.size(1), "local rho needs J rows");
  }
  if (offsets)
    TORCH_CHECK(offsets->scalar_type() == at::kLong && offsets->is_contiguous() &&
                    offsets->sizes() == nb.sizes(),
                "offsets must be contiguous int64 (L, J)");
  if (valid)
    TORCH_CHECK(valid->scalar_type() == at::kBool && valid->is_contiguous() &&
                    valid->sizes() == nb.sizes(),
                "valid must be contiguous bool (L, J)");
  TORCH_CHECK(!single || q.size(2) == n, "the single form needs G = V");
}

// rho (V, D, e) as (V, e, D) where offsets index it: the lanes' entries of one channel then lie
// in one row of D.
Tensor transposed_table(const OptTensor& rho, const OptTensor& offsets) {
  return rho && offsets ? rho->transpose(1, 2).contiguous() : Tensor();
}

// f(FG, FM): the sizes G and M of the group axes as compile-time constants where they are
// those of a lifting layer (1) or of the rotMNIST nets' group layers (R4: 4; R8 and R4 with
// mirrors: 8), so that the per-tile loops over them unroll; else 0: the tile functions read G
// and M from the problem.
template <typename F>
void with_sizes(int64_t G, int64_t M, F&& f) {
  using std::integral_constant;
  if (G == 1 && M == 1) return f(integral_constant<int64_t, 1>{}, integral_constant<int64_t, 1>{});
  if (G == 4 && M == 4) return f(integral_constant<int64_t, 4>{}, integral_constant<int64_t, 4>{});
  if (G == 8 && M == 8) return f(integral_constant<int64_t, 8>{}, integral_constant<int64_t, 8>{});
  f(integral_constant<int64_t, 0>{}, integral_constant<int64_t, 0>{});
}

// out (Z, d, V, L) from q (Z, d, G, L), k, v (Z, d, M, Lkv), emb (R, c) and gidx (1 or V,
// G, M) or None, rho (V, D, e) or None, offsets (L, J) or None, neighbour (L, J), valid (L,
// J) or None.
Tensor forward(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& emb,
               const OptTensor& gidx,
               const OptTensor& rho, const OptTensor& offsets, const Tensor& nb,
               const OptTensor& valid, bool single, int64_t n, int64_t threshold,
               int64_t seed) {
  check(q, k, v, emb, gidx, rho, offsets, nb, valid, single, n);
  Tensor out = at::empty({q.size(0), q.size(1), n, q.size(3)}, q.options());
  const Tensor rho_t = transposed_table(rho, offsets);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gsa_forward", [&] {
    using S = scalar_t;
    constexpr int64_t T = Tile<S>::T;
    const auto p = problem<S>(q, k, v, emb, gidx, rho, offsets, nb, valid, single, n, threshold,
                              seed, rho_t);
    const int64_t tiles = (p.L + T - 1) / T;
    S* o = out.data_ptr<S>();
    with_sizes(p.G, p.M, [&](auto fg, auto fm) {
      constexpr int64_t FG = decltype(fg)::value, FM = decltype(fm)::value;
      at::parallel_for(0, p.Z * tiles, 1, [&](int64_t begin, int64_t end) {
        Tile<S> tl(p, false);
        for (int64_t zt = begin; zt < end; ++zt) {
          tl.load(p, zt / tiles, (zt % tiles) * T);
          forward_tile<S, FG, FM>(p, tl);
          output_tile<S, FG, FM>(p, tl, o);
        }
      });
    });
  });
  return out;
}

// dq, dk, dv, demb, drho (each laid out as its input; undefined when absent) from grad_out
// (Z, d, V, L) and the forward's inputs.
std::vector<Tensor> backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                             const Tensor& v, const OptTensor& emb, const OptTensor& gidx,
                             const OptTensor& rho,
                             const OptTensor& offsets, const Tensor& nb, const OptTensor& valid,
                             bool single, int64_t n, int64_t threshold, int64_t seed) {
  check(q, k, v, emb, gidx, rho, offsets, nb, valid, single, n);
  TORCH_CHECK(grad_out.is_contiguous() &&
                  grad_out.sizes() == at::IntArrayRef({q.size(0), q.size(1), n, q.size(3)}),
              "grad_out must be contiguous (Z, d, V, L)");
  // dk and dv are zeroed batch-head by batch-head below, each by the thread that adds into it
  Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  if (q.size(3) == 0) dk.zero_(), dv.zero_();  // no tile: nothing below writes them
  const int64_t threads = at::get_num_threads();
  Tensor demb_parts = emb ? at::zeros({threads, emb->size(0), emb->size(1)}, q.options())
                          : Tensor();
  const Tensor rho_t = transposed_table(rho, offsets);
  // laid out as the table the kernel reads: rho_t (V, e, D) with offsets, else rho (V, D, e)
  const Tensor table = rho_t.defined() ? rho_t : rho ? *rho : Tensor();
  Tensor drho_parts = rho ? at::zeros({threads, table.size(0), table.size(1), table.size(2)},
                                      q.options())
                          : Tensor();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gsa_backward", [&] {
    using S = scalar_t;
    using V = typename Tile<S>::V;
    constexpr int64_t T = Tile<S>::T;
    const auto p = problem<S>(q, k, v, emb, gidx, rho, offsets, nb, valid, single, n, threshold,
                              seed, rho_t);
    const S* go = grad_out.data_ptr<S>();
    const int64_t rho_size = rho ? rho->numel() : 0, tiles = (p.L + T - 1) / T;
    const int64_t slab = p.d * p.M * p.Lkv;  // one batch-head of dk or dv
    // The threads take consecutive tiles. A batch-head whose tiles two threads share gets its
    // dk and dv from each in a slab of that thread's own (at most two: its range's first and
    // last batch-heads), zeroed on first use and added after the threads in their order.
    std::vector<int64_t> shared_z(2 * threads, -1);
    Tensor shared = at::empty({threads, 2, 2, slab}, q.options());
    with_sizes(p.G, p.M, [&](auto fg, auto fm) {
      constexpr int64_t FG = decltype(fg)::value, FM = decltype(fm)::value;
      at::parallel_for(0, p.Z * tiles, 1, [&](int64_t begin, int64_t end) {
        Tile<S> tl(p, true);
        const int64_t thread = at::get_thread_num();
        S* drho = rho ? drho_parts.data_ptr<S>() + thread * rho_size : nullptr;
        std::vector<V> drho_local(rho && !offsets ? p.V * p.J * p.e : 0);  // zeros
        for (int64_t zt = begin; zt < end; ++zt) {
          const int64_t z = zt / tiles;
          Grads<S> gr{dq.data_ptr<S>(), dk.data_ptr<S>() + z * slab, dv.data_ptr<S>() + z * slab,
                      drho};
          if (z * tiles < begin || (z + 1) * tiles > end) {  // shared with another thread
            const int64_t side = z * tiles < begin ? 0 : 1;
            S* own = shared.data_ptr<S>() + (thread * 2 + side) * 2 * slab;
            if (shared_z[2 * thread + side] != z) std::fill(own, own + 2 * slab, S(0));
            shared_z[2 * thread + side] = z;
            gr.dk = own, gr.dv = own + slab;
          } else if (zt == z * tiles) {  // z's first tile: its rows, while they are in cache
            std::fill(gr.dk, gr.dk + slab, S(0));
            std::fill(gr.dv, gr.dv + slab, S(0));
          }
          tl.load(p, z, (zt % tiles) * T);
          load_go(p, tl, go);
          forward_tile<S, FG, FM>(p, tl, true);
          backward_tile<S, FG, FM>(p, tl, gr, drho_local.data());
        }
        for (size_t a = 0; a < drho_local.size(); ++a)
          for (int64_t t = 0; t < T; ++t) drho[p.local_row(a)] += drho_local[a][t];
        if (emb) {
          S* demb = demb_parts.data_ptr<S>() + thread * p.R * p.c;
          for (int64_t a = 0; a < p.R * p.c; ++a)
            for (int64_t t = 0; t < T; ++t) demb[a] += tl.demb[a][t];
        }
      });
    });
    // a shared batch-head's rows: its first slab, then the others added in order
    std::vector<char> started(p.Z, 0);
    for (int64_t a = 0; a < 2 * threads; ++a) {
      const int64_t z = shared_z[a];
      if (z < 0) continue;
      const S* own = shared.data_ptr<S>() + a * 2 * slab;
      S *dkz = dk.data_ptr<S>() + z * slab, *dvz = dv.data_ptr<S>() + z * slab;
      if (started[z]) {
        for (int64_t x = 0; x < slab; ++x) dkz[x] += own[x], dvz[x] += own[slab + x];
      } else {
        std::copy(own, own + slab, dkz), std::copy(own + slab, own + 2 * slab, dvz);
      }
      started[z] = 1;
    }
  });
  Tensor drho = rho ? drho_parts.sum(0) : Tensor();
  if (offsets && rho) drho = drho.transpose(1, 2).contiguous();
  Tensor demb = emb ? demb_parts.sum(0) : Tensor();
  return {dq, dk, dv, demb, drho};
}

// How many threads the kernels' at::parallel_for spreads work over: torch's thread count
// when the extension is built with OpenMP, 1 without (the range then runs on the caller).
int64_t parallel_threads() {
  std::vector<char> ran(at::get_num_threads(), 0);
  at::parallel_for(0, 64 * static_cast<int64_t>(ran.size()), 1, [&](int64_t, int64_t) {
    ran[at::get_thread_num()] = 1;
  });
  int64_t count = 0;
  for (char r : ran) count += r;
  return count;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Neither touches a Python object: other Python threads run meanwhile.
  const auto free = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("forward", &forward, "fused factorised attention, forward (see core.py)", free);
  m.def("backward", &backward, "fused factorised attention, backward (recomputes per query)",
        free);
  m.attr("rescales_dropout") = true;  // writes out times 1 / (1 - drop) itself
  m.attr("vector_bytes") = SYMATTN_VECTOR_BYTES;  // a tile: this many bytes of queries
  m.def("parallel_threads", &parallel_threads, "threads that at::parallel_for runs here");
}
