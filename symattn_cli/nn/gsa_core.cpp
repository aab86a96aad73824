// The chunk loops of the factorised attention core (gsa_core.py) in C++.
//
// The same tensor operations in the same order as the Python loops of gsa_core.py (the
// docstrings there state the algorithm and the letters: Z, Lc, G, M, J, d, P, e, K, V; only
// the packing's copy into diagonal blocks is a plain loop here), so the two give the same
// numbers, bit for bit. A chunk makes about eighty small tensor calls each way;
// from Python every one of them takes the GIL, and the attention threads end up waiting on
// each other for it. Here a worker makes one call for all of its chunks, without the GIL.
//
// Built on first use by gsa_native.py. CPU tensors only, float32 or float64.

#include <ATen/CPUGeneratorImpl.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

constexpr int64_t kDropSteps = 1 << 15;  // gsa_core.DROP_STEPS

// The size thresholds of gsa_core.py, passed in on every call (plain_products changes them).
struct Tunables {
  int64_t packed_rows, gemm_sum_max, gemm_scale_max, scalar_bmm_size;
};

Tunables tunables_from(const std::vector<int64_t>& values) {
  TORCH_CHECK(values.size() == 4, "expected 4 tunables, got ", values.size());
  return {values[0], values[1], values[2], values[3]};
}

// Per-thread buffers that only grow (gsa_core._Scratch). Buffers asked for with zeros() keep
// their contents between chunks: they are keyed by their trailing shape too, so that a
// buffer whose off-diagonal zeros a packing relies on is only ever reused by the same packing.
// reuse=false (chunks kept for the backward) allocates afresh.
class Scratch {
 public:
  Scratch(const Tensor& like, bool reuse) : options_(like.options()), reuse_(reuse) {}

  Tensor empty(const std::string& name, at::IntArrayRef shape) { return get(name, shape, false); }
  Tensor zeros(const std::string& name, at::IntArrayRef shape) { return get(name, shape, true); }

 private:
  Tensor get(const std::string& name, at::IntArrayRef shape, bool zeros) {
    if (!reuse_) return zeros ? at::zeros(shape, options_) : at::empty(shape, options_);
    std::string key = name + "/" + std::string(c10::toString(options_.dtype().toScalarType()));
    if (zeros) {
      for (size_t i = 1; i < shape.size(); ++i) key += "," + std::to_string(shape[i]);
    }
    const int64_t n = c10::multiply_integers(shape);
    thread_local std::map<std::string, Tensor> buffers;
    Tensor& buffer = buffers[key];
    if (!buffer.defined() || buffer.numel() < n) {
      buffer = zeros ? at::zeros({n}, options_) : at::empty({n}, options_);
    }
    return buffer.narrow(0, 0, n).view(shape);
  }

  at::TensorOptions options_;
  bool reuse_;
};

// The ATen out= functions take the output by non-const reference; scratch views are values.
Tensor bmm_into(Tensor out, const Tensor& a, const Tensor& b) { return at::bmm_out(out, a, b); }
Tensor mm_into(Tensor out, const Tensor& a, const Tensor& b) { return at::mm_out(out, a, b); }
Tensor mul_into(Tensor out, const Tensor& a, const Tensor& b) { return at::mul_out(out, a, b); }

// (a * b, b): a stacked b x b identities (gsa_core._segments), cached per thread.
Tensor segments(int64_t a, int64_t b, const Tensor& like) {
  thread_local std::map<std::tuple<int64_t, int64_t, int>, Tensor> cache;
  const auto key = std::make_tuple(a, b, static_cast<int>(like.scalar_type()));
  auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  Tensor table = at::eye(b, like.options()).repeat({a, 1});
  cache.emplace(key, table);
  return table;
}

// x (R, a, b) contiguous -> its sum over a, (R, b) (gsa_core._segment_sum).
Tensor segment_sum(const Tensor& x, const Tunables& tun) {
  const int64_t r = x.size(0), a = x.size(1), b = x.size(2);
  if (!(1 < b && b <= tun.gemm_sum_max)) return x.sum(1);
  return at::mm(x.view({r, a * b}), segments(a, b, x));
}

// y (R, b) repeated over a new middle axis, (R, a, b) (gsa_core._segment_expand).
Tensor segment_expand(const Tensor& y, int64_t a, Scratch& scratch, const Tunables& tun) {
  const int64_t r = y.size(0), b = y.size(1);
  if (!(1 < b && b <= tun.gemm_scale_max)) return y.unsqueeze(1).expand({r, a, b});
  Tensor out = mm_into(scratch.empty("expand", {r, a * b}), y, segments(a, b, y).t());
  return out.view({r, a, b});
}

// In-place softmax of a contiguous (R, a, b) over its middle axis; returns the logsumexp
// (R, b), or nothing when, unshifted, a normaliser left the safe range (gsa_core._softmax_).
std::optional<Tensor> softmax_(Tensor x, bool shift, Scratch& scratch, const Tunables& tun) {
  Tensor top;
  if (shift) {
    top = at::amax(x, {1});  // (R, b)
    x.sub_(top.unsqueeze(1));
  }
  x.exp_();
  Tensor total = segment_sum(x, tun);  // (R, b)
  if (!shift) {
    double tiny, high;
    if (x.scalar_type() == at::kDouble) {
      tiny = std::numeric_limits<double>::min() / std::numeric_limits<double>::epsilon();
      high = std::numeric_limits<double>::max();
    } else {
      tiny = std::numeric_limits<float>::min() / std::numeric_limits<float>::epsilon();
      high = std::numeric_limits<float>::max();
    }
    auto [lowest, highest] = at::aminmax(total);
    // NaN fails both tests
    if (!(lowest.item<double>() >= tiny && highest.item<double>() <= high)) return std::nullopt;
  }
  x.mul_(segment_expand(total.reciprocal(), x.size(1), scratch, tun));
  Tensor lse = total.log_();
  return shift ? lse.add_(top) : lse;
}

// Keep mask (0 with probability p), drawn from seed as gsa_core._keep_mask draws it.
Tensor keep_mask(at::IntArrayRef shape, double p, int64_t seed, Scratch& scratch,
                 const Tensor& like) {
  const int64_t n = c10::multiply_integers(shape);
  Tensor bits = at::empty({(n + 3) / 4}, like.options().dtype(at::kLong));
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
  bits.random_(generator);  // [0, 2^63)
  Tensor u15 = bits.view(at::kShort).narrow(0, 0, n).view(shape).bitwise_and_(kDropSteps - 1);
  Tensor out = scratch.empty("keep", shape);
  return at::ge_out(out, u15, static_cast<int64_t>(std::llround(p * kDropSteps)));
}

// Writes src (groups * f, r, c), times mask where given, into the diagonal blocks of dst
// (groups, f, r, f, c). A plain loop: ATen's strided copy into the diagonal moves r * c
// elements four at a time and took three times as long.
template <typename T>
void pack_blocks(T* dst, const T* src, const T* mask, int64_t groups, int64_t f, int64_t r,
                 int64_t c) {
  const int64_t tile = r * c, row = f * c;
  for (int64_t group = 0; group < groups; ++group) {
    for (int64_t b = 0; b < f; ++b) {
      const int64_t from = (group * f + b) * tile;
      T* out = dst + group * f * tile * f + b * (r * row + c);  // block (b, b)
      for (int64_t i = 0; i < r; ++i) {
        for (int64_t k = 0; k < c; ++k) {
          const int64_t at = from + i * c + k;
          out[i * row + k] = mask ? src[at] * mask[at] : src[at];
        }
      }
    }
  }
}

// dst.index_add_(1, idx, src) for contiguous dst (Z, R, ...) and src (Z, I, ...): each row of
// dst takes its rows of src in the order of idx, as ATen's does (the same numbers), without
// ATen's per-index setup of a strided add.
void scatter_add_rows(Tensor& dst, const Tensor& idx, const Tensor& src) {
  if (!dst.is_contiguous() || !src.is_contiguous() || idx.scalar_type() != at::kLong) {
    dst.index_add_(1, idx, src);
    return;
  }
  const Tensor index = idx.contiguous();
  const int64_t z = dst.size(0), rows = dst.size(1), n = index.numel();
  const int64_t width = dst.numel() / std::max<int64_t>(z * rows, 1);
  const int64_t* at_row = index.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= at_row[i] && at_row[i] < rows, "row index ", at_row[i], " out of range");
  }
  AT_DISPATCH_FLOATING_TYPES(dst.scalar_type(), "scatter_add_rows", [&] {
    scalar_t* out = dst.data_ptr<scalar_t>();
    const scalar_t* in = src.const_data_ptr<scalar_t>();
    for (int64_t b = 0; b < z; ++b) {
      for (int64_t i = 0; i < n; ++i) {
        scalar_t* __restrict to = out + (b * rows + at_row[i]) * width;
        const scalar_t* __restrict from = in + (b * n + i) * width;
        for (int64_t w = 0; w < width; ++w) to[w] += from[w];
      }
    }
  });
}

// Tiny matrices packed into block-diagonal ones, times mask if defined (gsa_core._Packed).
struct Packed {
  Tensor a;
  int64_t f = 1;

  void pack(const Tensor& tiny, int64_t cols, Scratch& scratch, const Tunables& tun,
            const Tensor& mask) {
    a = tiny;
    f = 1;
    const int64_t n = tiny.size(0), r = tiny.size(1), c = tiny.size(2);
    const int64_t ff = std::max<int64_t>(1, tun.packed_rows / std::max(r, c));
    if (ff == 1 || n % ff || c * r * cols >= tun.scalar_bmm_size) {
      if (mask.defined()) a = mul_into(scratch.empty("kept", {n, r, c}), tiny, mask);
      return;
    }
    // pi and the dropout mask, as the chunk lays them out
    TORCH_CHECK(tiny.is_contiguous() && (!mask.defined() || mask.is_contiguous()),
                "packing takes contiguous matrices");
    Tensor blocks = scratch.zeros("blocks", {n / ff, ff, r, ff, c});
    AT_DISPATCH_FLOATING_TYPES(tiny.scalar_type(), "pack_blocks", [&] {
      pack_blocks<scalar_t>(blocks.data_ptr<scalar_t>(), tiny.const_data_ptr<scalar_t>(),
                            mask.defined() ? mask.const_data_ptr<scalar_t>() : nullptr, n / ff,
                            ff, r, c);
    });
    a = blocks.view({n / ff, ff * r, ff * c});
    f = ff;
  }

  // a @ b (or a^T @ b) into out (n, c or r, cols).
  Tensor bmm(const Tensor& b, const Tensor& out, bool transpose) const {
    const Tensor left = transpose ? a.transpose(1, 2) : a;
    if (f == 1) return bmm_into(out, left, b);
    const int64_t n = b.size(0);
    bmm_into(out.view({n / f, -1, out.size(2)}), left, b.reshape({n / f, f * b.size(1), -1}));
    return out;
  }
};

// s (P, K, J, G) from q_xy (Z, Lc, G, e) and rho (gsa_core._spatial_logits).
Tensor spatial_logits(const Tensor& q_xy, const Tensor& rho, bool single, int64_t lo,
                      int64_t hi, Scratch& scratch) {
  const int64_t z = q_xy.size(0), lc = q_xy.size(1), g = q_xy.size(2), e = q_xy.size(3);
  if (rho.dim() == 3) {  // local: one table for every query
    const int64_t v = rho.size(0), j = rho.size(1);
    if (!single) {  // one GEMM (PG, e) x (e, VJ) for the chunk
      const int64_t p = z * lc;
      const Tensor table = rho.reshape({v * j, e});  // (VJ, e)
      const Tensor q2 = q_xy.reshape({p * g, e});    // (PG, e)
      Tensor s = scratch.empty("t", {p, v * j, g});  // (P, VJ, G)
      if (g == 1) {
        mm_into(s.view({p, v * j}), q2, table.t());
      } else {  // the GEMM's (P, G, VJ), transposed
        Tensor pgv = mm_into(scratch.empty("expand", {p * g, v * j}), q2, table.t());
        s.copy_(pgv.view({p, g, v * j}).transpose(1, 2));
      }
      return s.view({p, v, j, g});  // (P, V, J, G)
    }
    Tensor s = at::einsum("zlge,gje->zljg", {q_xy, rho});  // (Z, Lc, J, G): v = g
    return s.reshape({z * lc, 1, j, g}).contiguous();      // (P, 1, J, G)
  }
  const Tensor r = rho.slice(1, lo, hi);  // (V, Lc, J, e): global, one table per query
  if (!single) {
    Tensor s = at::einsum("zlge,vlje->zlvjg", {q_xy, r});          // (Z, Lc, V, J, G)
    return s.reshape({z * lc, r.size(0), r.size(2), g}).contiguous();  // (P, V, J, G)
  }
  Tensor s = at::einsum("zlge,glje->zljg", {q_xy, r});  // (Z, Lc, J, G)
  return s.reshape({z * lc, 1, r.size(2), g}).contiguous();  // (P, 1, J, G)
}

// Backward of spatial_logits: returns dq_xy, accumulates into grad_rho.
Tensor spatial_grads(const Tensor& ds, const Tensor& q_xy, const Tensor& rho, bool single,
                     int64_t lo, int64_t hi, Tensor& grad_rho, Scratch& scratch) {
  const int64_t z = q_xy.size(0), lc = q_xy.size(1), g = q_xy.size(2), e = q_xy.size(3);
  if (rho.dim() == 3) {
    const int64_t v = rho.size(0), j = rho.size(1);
    if (!single) {  // two GEMMs over the chunk, with ds as (PG, VJ)
      const int64_t p = z * lc;
      const Tensor table = rho.reshape({v * j, e});  // (VJ, e)
      const Tensor q2 = q_xy.reshape({p * g, e});    // (PG, e)
      Tensor dsg;
      if (g == 1) {
        dsg = ds.reshape({p, v * j});
      } else {  // the softmaxes are done with the broadcast buffer
        dsg = scratch.empty("expand", {p, g, v * j});
        dsg.copy_(ds.view({p, v * j, g}).transpose(1, 2));
        dsg = dsg.view({p * g, v * j});
      }
      grad_rho.add_(at::mm(dsg.t(), q2).view({v, j, e}));
      return at::mm(dsg, table).view({z, lc, g, e});
    }
    const Tensor ds4 = ds.view({z, lc, -1, g});  // (Z, Lc, J, G)
    grad_rho.add_(at::einsum("zljg,zlge->gje", {ds4, q_xy}));
    return at::einsum("zljg,gje->zlge", {ds4, rho});
  }
  const Tensor r = rho.slice(1, lo, hi);  // (V, Lc, J, e)
  if (!single) {
    const Tensor ds5 = ds.view({z, lc, r.size(0), -1, g});  // (Z, Lc, V, J, G)
    grad_rho.slice(1, lo, hi).add_(at::einsum("zlvjg,zlge->vlje", {ds5, q_xy}));
    return at::einsum("zlvjg,vlje->zlge", {ds5, r});
  }
  const Tensor ds4 = ds.view({z, lc, -1, g});  // (Z, Lc, J, G)
  grad_rho.slice(1, lo, hi).add_(at::einsum("zljg,zlge->glje", {ds4, q_xy}));
  return at::einsum("zljg,glje->zlge", {ds4, r});
}

// The inputs shared by every chunk of one call.
struct Inputs {
  Tensor q, k, v;              // (Z, L, G, d), (Z, Lkv, M, d) twice
  OptTensor group_logits;      // (Z, L, M, G)
  OptTensor rho;               // (V, J, e) or (V, L, J, e)
  Tensor neighbour;            // (L, J)
  std::vector<OptTensor> hidden;  // per chunk: (Lc, J) offsets or nothing
  bool single;
  int64_t n;
  double drop;
  std::vector<int64_t> seeds;   // per chunk
  std::vector<int64_t> bounds;  // chunk i holds queries bounds[i] to bounds[i + 1]
  Tunables tun;
};

// The forward quantities of one chunk of queries (gsa_core._Chunk).
struct Chunk {
  Tensor q, k_nb, v_nb, keep, pi, w, beta;
  Packed packed;
  int64_t z, lc, g, m, j, d, p, e;
  int64_t lo, hi;

  // False when the unshifted softmaxes left the safe range: rebuild with shift.
  bool build(const Inputs& in, int64_t i, bool shift, Scratch& scratch) {
    lo = in.bounds[i];
    hi = in.bounds[i + 1];
    const Tensor q_rows = in.q.slice(1, lo, hi);  // (Z, Lc, G, d)
    const Tensor nb = in.neighbour.slice(0, lo, hi);
    z = q_rows.size(0), lc = q_rows.size(1), g = q_rows.size(2), d = q_rows.size(3);
    m = in.k.size(2), j = nb.size(1), p = z * lc;
    e = in.rho ? in.rho->size(-1) : 0;
    const Tensor idx = nb.reshape(-1);
    q = q_rows.reshape({p, g, d});  // (P, G, d)
    Tensor k_g = scratch.empty("k_nb", {z, lc * j, m, d});
    Tensor v_g = scratch.empty("v_nb", {z, lc * j, m, d});
    k_nb = at::index_select_out(k_g, in.k, 1, idx).view({p, j * m, d});  // (P, JM, d)
    v_nb = at::index_select_out(v_g, in.v, 1, idx).view({p, j * m, d});  // (P, JM, d)
    keep = in.drop > 0 ? keep_mask({p, j, m, g}, in.drop, in.seeds[i], scratch, in.q) : Tensor();
    Tensor c = bmm_into(scratch.empty("c", {p, j * m, g}), k_nb, q.transpose(1, 2));
    c = c.view({p, j, m, g});  // (P, J, M, G)
    if (in.group_logits) c.add_(in.group_logits->slice(1, lo, hi).reshape({p, 1, m, g}));
    Tensor lse, weighted;
    if (m == 1 && g == 1) {  // lifting: the inner softmax is over one element
      pi = Tensor();
      lse = c.view({p, j, 1});
      weighted = v_nb;  // (P, J, d)
      if (keep.defined()) {
        weighted = mul_into(scratch.empty("w", {p, j, d}), weighted, keep.view({p, j, 1}));
      }
    } else {
      auto normaliser = softmax_(c.view({p * j, m, g}), shift, scratch, in.tun);  // c is pi
      if (!normaliser) return false;
      lse = normaliser->view({p, j, g});
      pi = c;
      // (PJ, M, G) as they lie; W takes the transposed product. Dropout: times the mask.
      const Tensor mask = keep.defined() ? keep.view({p * j, m, g}) : Tensor();
      packed.pack(c.view({p * j, m, g}), d, scratch, in.tun, mask);
      weighted = packed.bmm(v_nb.view({p * j, m, d}), scratch.empty("w", {p * j, g, d}), true);
    }
    w = weighted.view({p, j * g, d});  // (P, JG, d)
    const OptTensor& hidden = in.hidden[i];
    if (hidden) {  // neighbours outside the image take no weight: -inf logits
      lse = (lse.view({z, lc, j, g}) + hidden->view({1, lc, j, 1})).view({p, j, g});
    }
    Tensor t;
    if (e) {
      t = spatial_logits(q_rows.narrow(3, 0, e), *in.rho, in.single, lo, hi, scratch);
      t.add_(lse.view({p, 1, j, g}));  // (P, K, J, G)
    } else {
      t = lse.reshape({p, 1, j, g}).clone();  // (P, 1, J, G)
    }
    if (!softmax_(t.view({-1, j, g}), shift, scratch, in.tun)) return false;
    beta = t;  // (P, K, J, G): outer softmax over j
    return true;
  }

  // (P, V, d)
  Tensor output(bool single, int64_t n) const {
    const int64_t kk = beta.size(1);
    if (single) {  // out[g] = sum_j beta[j, g] W[j, g]
      return (beta.view({p, j, g, 1}) * w.view({p, j, g, -1})).sum(1);  // (P, G, d)
    }
    Tensor out = at::bmm(beta.view({p, kk, j * g}), w);  // (P, K, d)
    return kk == n ? out : out.expand({p, n, -1});  // no spatial term: same for every v
  }

  // go (P, V, d) -> d_t (P, K, J, G), d_c (P, JM, G), d_vnb (P, JM, d).
  std::tuple<Tensor, Tensor, Tensor> backward(Tensor go, bool single, Scratch& scratch,
                                              const Tunables& tun) {
    const int64_t kk = beta.size(1);
    Tensor d_t, d_w;
    if (single) {
      const Tensor go5 = go.view({p, 1, 1, g, d});
      d_t = (w.view({p, 1, j, g, d}) * go5).sum(-1).mul_(beta);  // (P, 1, J, G): beta d_beta
      d_w = (beta.unsqueeze(-1) * go5).reshape({p, j * g, d});  // (P, JG, d)
    } else {
      if (kk == 1) go = go.sum(1, true);  // (P, 1, d): every v had the same weights
      d_t = bmm_into(scratch.empty("d_t", {p, kk, j * g}), go, w.transpose(1, 2));
      d_t = d_t.view({p, kk, j, g}).mul_(beta);  // (P, K, J, G): beta d_beta
      // (P, JG, d); d_t has used w
      d_w = bmm_into(scratch.empty("w", {p, j * g, d}), beta.view({p, kk, j * g}).transpose(1, 2),
                     go);
    }
    // softmax over j: d_t = beta * (d_beta - sum_j beta d_beta)
    const Tensor total =
        segment_expand(segment_sum(d_t.view({p * kk, j, g}), tun), j, scratch, tun);
    d_t.view({p * kk, j, g}).addcmul_(beta.view({p * kk, j, g}), total, -1.0);
    const Tensor d_lse = d_t.sum(1);  // (P, J, G)
    if (!pi.defined()) {  // lifting: pi = 1, d_c = d_lse
      const Tensor d_vnb = keep.defined() ? d_w * keep.view({p, j, 1}) : d_w;
      return {d_t, d_lse.view({p, j, 1}), d_vnb.view({p, j, d})};
    }
    d_w = d_w.view({p * j, g, d});  // (PJ, G, d)
    // (PJ, M, G); beta is done with
    Tensor d_pi = bmm_into(scratch.empty("t", {p * j, m, g}), v_nb.view({p * j, m, d}),
                           d_w.transpose(1, 2));
    // (PJ, M, d); d_pi has used v_nb
    Tensor d_vnb = packed.bmm(d_w, scratch.empty("v_nb", {p * j, m, d}), false);
    if (keep.defined()) d_pi.mul_(keep.view({p * j, m, g}));
    // softmax and logsumexp over m: d_c = pi * (d_pi - sum_m pi d_pi + d_lse)
    Tensor d_c = d_pi.mul_(pi.view({p * j, m, g}));  // (PJ, M, G): pi d_pi
    const Tensor corr = segment_sum(d_c, tun).sub_(d_lse.view({p * j, g}));  // (PJ, G)
    d_c.addcmul_(pi.view({p * j, m, g}), segment_expand(corr, m, scratch, tun), -1.0);
    return {d_t, d_c.view({p, j * m, g}), d_vnb.view({p, j * m, d})};
  }
};

void build_chunk(Chunk& chunk, const Inputs& in, int64_t i, bool shift, Scratch& scratch,
                 bool* shifted) {
  if (chunk.build(in, i, shift, scratch)) {
    if (shifted) *shifted = shift;
    return;
  }
  TORCH_CHECK(!shift, "the shifted softmax cannot fail");
  chunk.build(in, i, true, scratch);
  if (shifted) *shifted = true;
}

Inputs inputs_from(Tensor q, Tensor k, Tensor v, OptTensor group_logits, OptTensor rho,
                   Tensor neighbour, std::vector<OptTensor> hidden, bool single, int64_t n,
                   double drop, std::vector<int64_t> seeds, std::vector<int64_t> bounds,
                   const std::vector<int64_t>& tunables) {
  TORCH_CHECK(q.device().is_cpu(), "the C++ attention core runs on CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble,
              "the C++ attention core takes float32 or float64, got ", q.scalar_type());
  return {std::move(q), std::move(k), std::move(v), std::move(group_logits), std::move(rho),
          std::move(neighbour), std::move(hidden), single, n, drop, std::move(seeds),
          std::move(bounds), tunables_from(tunables)};
}

// Chunks kept from the forward for the backward (recompute=False), by chunk index.
struct KeptChunks {
  std::map<int64_t, Chunk> chunks;
};
using Kept = std::shared_ptr<KeptChunks>;

Chunk* find_kept(const std::vector<Kept>& kept, int64_t i) {
  for (const Kept& part : kept) {
    if (!part) continue;
    auto where = part->chunks.find(i);
    if (where != part->chunks.end()) return &where->second;
  }
  return nullptr;
}

// Forward of chunks ``indices`` into out (Z, L, V, d); returns, per chunk, whether its
// softmaxes needed the shift, and with ``keep`` the chunks for the backward (else None)
// (gsa_core.FactorisedAttention.forward's run).
std::tuple<std::vector<bool>, Kept> forward_chunks(
    Tensor q, Tensor k, Tensor v, OptTensor group_logits, OptTensor rho, Tensor neighbour,
    std::vector<OptTensor> hidden, bool single, int64_t n, double drop,
    std::vector<int64_t> seeds, std::vector<int64_t> bounds, const std::vector<int64_t>& indices,
    Tensor out, bool keep, const std::vector<int64_t>& tunables) {
  at::NoGradGuard no_grad;
  const Inputs in = inputs_from(std::move(q), std::move(k), std::move(v), std::move(group_logits),
                                std::move(rho), std::move(neighbour), std::move(hidden), single,
                                n, drop, std::move(seeds), std::move(bounds), tunables);
  Scratch scratch(in.q, !keep);
  Kept kept = keep ? std::make_shared<KeptChunks>() : nullptr;
  std::vector<bool> shifts;
  for (const int64_t i : indices) {
    Chunk chunk;
    bool shifted = false;
    build_chunk(chunk, in, i, false, scratch, &shifted);
    shifts.push_back(shifted);
    out.slice(1, chunk.lo, chunk.hi)
        .copy_(chunk.output(in.single, in.n).view({chunk.z, chunk.lc, in.n, chunk.d}));
    if (kept) kept->chunks.emplace(i, std::move(chunk));
  }
  return {shifts, kept};
}

// Backward of chunks ``indices`` (consecutive), as gsa_core.FactorisedAttention.backward's
// run: writes their rows of grad_q and grad_gl; returns the first key row of dk and dv, them
// (grad_k and grad_v themselves when the first chunk is among them, else a band of key rows
// to be added in) and this call's sum of d_rho. Chunks found in ``kept`` are used as they
// are, the others recomputed.
std::tuple<int64_t, Tensor, Tensor, OptTensor> backward_chunks(
    Tensor q, Tensor k, Tensor v, OptTensor group_logits, OptTensor rho, Tensor neighbour,
    std::vector<OptTensor> hidden, bool single, int64_t n, double drop,
    std::vector<int64_t> seeds, std::vector<int64_t> bounds, const std::vector<bool>& shifts,
    const std::vector<int64_t>& indices, const Tensor& grad_out, Tensor grad_q,
    OptTensor grad_gl, Tensor grad_k, Tensor grad_v, const std::vector<Kept>& kept,
    const std::vector<int64_t>& tunables) {
  at::NoGradGuard no_grad;
  const Inputs in = inputs_from(std::move(q), std::move(k), std::move(v), std::move(group_logits),
                                std::move(rho), std::move(neighbour), std::move(hidden), single,
                                n, drop, std::move(seeds), std::move(bounds), tunables);
  int64_t first = 0;
  Tensor dk = grad_k, dv = grad_v;
  if (!indices.empty() && indices.front() > 0) {
    const Tensor reached =
        in.neighbour.slice(0, in.bounds[indices.front()], in.bounds[indices.back() + 1]);
    first = reached.min().item<int64_t>();
    const int64_t last = reached.max().item<int64_t>() + 1;
    dk = at::zeros({in.k.size(0), last - first, in.k.size(2), in.k.size(3)}, in.k.options());
    dv = at::zeros_like(dk);
  }
  OptTensor grad_rho;
  if (in.rho) grad_rho = at::zeros_like(*in.rho);
  Scratch scratch(in.q, true);  // a kept chunk's own tensors are not in it
  for (const int64_t i : indices) {
    Chunk rebuilt;
    Chunk* found = find_kept(kept, i);
    if (!found) build_chunk(rebuilt, in, i, shifts[i], scratch, nullptr);
    Chunk& ch = found ? *found : rebuilt;
    const int64_t z = ch.z, lc = ch.lc, g = ch.g, m = ch.m, j = ch.j, d = ch.d, p = ch.p;
    auto [d_t, d_c, d_vnb] =
        ch.backward(grad_out.slice(1, ch.lo, ch.hi).reshape({p, in.n, d}), in.single, scratch,
                    in.tun);
    if (grad_gl) {
      grad_gl->slice(1, ch.lo, ch.hi).copy_(d_c.view({p, j, m, g}).sum(1).view({z, lc, m, g}));
    }
    Tensor dq = at::bmm(d_c.transpose(1, 2), ch.k_nb).view({z, lc, g, d});  // (Z, Lc, G, d)
    if (ch.e) {
      const Tensor q_xy = in.q.slice(1, ch.lo, ch.hi).narrow(3, 0, ch.e);
      dq.narrow(3, 0, ch.e)
          .add_(spatial_grads(d_t, q_xy, *in.rho, in.single, ch.lo, ch.hi, *grad_rho, scratch));
    }
    grad_q.slice(1, ch.lo, ch.hi).copy_(dq);
    // dq has used k_nb
    Tensor d_knb = bmm_into(scratch.empty("k_nb", {p, j * m, d}), d_c, ch.q);  // (P, JM, d)
    Tensor idx = in.neighbour.slice(0, ch.lo, ch.hi).reshape(-1);
    if (first) idx = idx - first;
    scatter_add_rows(dk, idx, d_knb.view({z, lc * j, m, d}));
    scatter_add_rows(dv, idx, d_vnb.view({z, lc * j, m, d}));
  }
  return {first, dk, dv, grad_rho};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "The chunk loops of symattn's factorised GSA attention core, without the GIL.";
  py::class_<KeptChunks, Kept>(module, "KeptChunks");
  module.def("forward_chunks", &forward_chunks, py::call_guard<py::gil_scoped_release>());
  module.def("backward_chunks", &backward_chunks, py::call_guard<py::gil_scoped_release>());
}
