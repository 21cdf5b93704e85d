// Paged attention for the CPU: writes a step's keys and values into the paged cache, then attends
// every row of the step (decode, verify and prefill-chunk rows alike) straight from the cache
// blocks, causally, with no gather and no mask.
//
// Layout: the key cache is [blocks, kv_heads, head_dim, block_size] (each block's keys
// transposed), so a vector of lanes holds consecutive keys' products and a query row's scores
// build up one head element after another, with no horizontal sums. The value cache is the usual
// [blocks, block_size, kv_heads, head_dim].
//
// Work items are (sequence, kv head, tile of query rows), and every number a query row produces
// depends only on that row, its keys and the head size: no loop looks at how many rows, heads or
// sequences share the step. A verify row therefore computes bit for bit as the same row decoded
// alone or inside a prefill chunk of any length, in every dtype: speculative output equals plain
// output whatever the scheduler's chunking.
//
// A sliding-window layer's row also masks the keys further back than its window (parts wholly
// behind it are skipped), and a soft-capped model's scores pass through cap * tanh(score / cap)
// before the softmax (Gemma 2): both depend on the row's own position only.
#include "attention_tiles.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
void write_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const int64_t* slots) {
  const int64_t kv_heads = v_cache.size(2), head = v_cache.size(3), block_size = v_cache.size(1);
  const T *ks = k.data_ptr<T>(), *vs = v.data_ptr<T>();
  T *kd = k_cache.data_ptr<T>(), *vd = v_cache.data_ptr<T>();
  for (int64_t t = 0; t < k.size(0); ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const T* kr = ks + t * k.stride(0) + h * k.stride(1);
      T* kt = kd + ((block * kv_heads + h) * head) * block_size + offset;
      for (int64_t d = 0; d < head; ++d) kt[d * block_size] = kr[d];
      std::copy_n(vs + t * v.stride(0) + h * v.stride(1), head, vd + (slots[t] * kv_heads + h) * head);
    }
  }
}

// The work of one item; buffers are the thread's own.
struct Buffers {
  std::vector<float> q, scores, acc, mx, sum;
  std::vector<int64_t> visible;
};

// A row's keys are attended in parts of kPartKeys at fixed positions (keys 0-255, 256-511,
// ...), each part's softmax partials (max, sum, weighted values) combined in part order. The parts
// depend only on the row's own context, so a row computes alike in any step; and a long context's
// parts are items of their own, so one decode row keeps both cores busy. A row whose context fits
// one part computes exactly as a single softmax (its combine multiplies by exp(0) = 1).
constexpr int64_t kPartKeys = 256;

template <typename T>
struct Step {
  const T *q, *k_cache, *v_cache;
  T* out;
  const int64_t* seq;    // [S, 3]: first row, query rows, context length
  const int64_t* table;  // [S, table_width]
  int64_t table_width, heads, head, kv_heads, per_kv, block_size, padded, part;
  int64_t q_row, q_head, out_row, out_head;  // strides
  float scale;
  int64_t window;  // a sliding layer's: row i also sees no key before position pos_i + 1 - window (0: none)
  float softcap;   // scores -> softcap * tanh(scores / softcap) (0: none)

  // The first key of [k0, k0 + part) that row i (position pos) sees, as an offset into the part.
  int64_t first_seen(int64_t pos, int64_t k0) const {
    return window > 0 ? std::clamp<int64_t>(pos + 1 - window - k0, 0, part) : 0;
  }

  // Row r's scores [0, n) of the part with the keys before `lo` masked and the rest soft-capped; its
  // softmax weights in place (its max in mx, its sum returned). Seeing no key: weights 0, max -inf.
  float weights(float* sc, int64_t lo, int64_t n, float& mx) const {
    if (lo >= n) {
      std::fill(sc, sc + n, 0.f);
      mx = -std::numeric_limits<float>::infinity();
      return 0.f;
    }
    if (softcap > 0.f)
      for (int64_t j = lo; j < n; ++j) sc[j] = softcap * std::tanh(sc[j] / softcap);
    std::fill(sc, sc + lo, -std::numeric_limits<float>::infinity());
    return softmax_weights(sc, n, mx);
  }

  // Query vectors r = i * per_kv + p: row i (of rows [i0, i1) of the sequence), head p of this
  // kv head, against keys [k0, k0 + part) (k0 a multiple of the block size). Row i sees keys
  // [0, ctx - nq + i]: causal within the step. Leaves in `buf` each vector's max score, its sum
  // of exp(score - max) and its unnormalized weighted values (-inf, 0 and 0 where it sees none).
  // long: scores, softmax and weighted values share the buffers and the vectors' key counts.
  void partial(int64_t s, int64_t kvh, int64_t i0, int64_t i1, int64_t k0, Buffers& buf) const {
    const int64_t first = seq[3 * s], nq = seq[3 * s + 1], ctx = seq[3 * s + 2];
    const int64_t* blocks = table + s * table_width + k0 / block_size;
    const int64_t r_count = (i1 - i0) * per_kv;
    buf.visible.resize(r_count);
    buf.mx.resize(r_count);
    buf.sum.resize(r_count);
    for (int64_t r = 0; r < r_count; ++r)
      buf.visible[r] = std::clamp<int64_t>(ctx - nq + i0 + r / per_kv + 1 - k0, 0, part);
    // A part wholly behind every row's window adds nothing: its entries are (-inf, 0, zeros)
    // whether computed or not, so it is skipped.
    if (window > 0 && first_seen(ctx - nq + i0, k0) >= part) {  // the tile's first row sees the least
      std::fill(buf.mx.begin(), buf.mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(buf.sum.begin(), buf.sum.end(), 0.f);
      buf.acc.assign(r_count * padded, 0.f);
      return;
    }
    const int64_t stride = std::max<int64_t>(1, (buf.visible[r_count - 1] + block_size - 1) / block_size) * block_size;
    buf.q.assign(r_count * padded, 0.f);
    for (int64_t r = 0; r < r_count; ++r) {
      const T* src = q + (first + i0 + r / per_kv) * q_row + (kvh * per_kv + r % per_kv) * q_head;
      std::transform(src, src + head, buf.q.data() + r * padded, [](T x) { return static_cast<float>(x); });
    }
    buf.scores.resize(r_count * stride);
    for (int64_t r0 = 0; r0 < r_count; r0 += kRows) {
      const int64_t count = std::min(kRows, r_count - r0);
      const int64_t last = (buf.visible[r0 + count - 1] + block_size - 1) / block_size;  // blocks this group sees
      const float* qr = buf.q.data() + r0 * padded;
      for (int64_t b = 0; b < last; b += 4) {
        const T* keys_t[4];
        for (int64_t x = 0; x < 4 && b + x < last; ++x)
          keys_t[x] = k_cache + (blocks[b + x] * kv_heads + kvh) * head * block_size;
        float* o = buf.scores.data() + r0 * stride + b * block_size;
        switch (std::min<int64_t>(4, last - b)) {
          case 4: score_rows<4>(count, qr, padded, keys_t, head, block_size, scale, o, stride); break;
          case 3: score_rows<3>(count, qr, padded, keys_t, head, block_size, scale, o, stride); break;
          case 2: score_rows<2>(count, qr, padded, keys_t, head, block_size, scale, o, stride); break;
          default: score_rows<1>(count, qr, padded, keys_t, head, block_size, scale, o, stride); break;
        }
      }
    }
    for (int64_t r = 0; r < r_count; ++r) {
      if (buf.visible[r] == 0) {
        buf.mx[r] = -std::numeric_limits<float>::infinity(), buf.sum[r] = 0.f;
      } else {
        const int64_t lo = first_seen(ctx - nq + i0 + r / per_kv, k0);
        buf.sum[r] = weights(buf.scores.data() + r * stride, lo, buf.visible[r], buf.mx[r]);
      }
    }
    // The weighted values, kRows rows at a time (sharing the value loads).
    buf.acc.resize(r_count * padded);
    const T* values = v_cache + kvh * head;
    for (int64_t r0 = 0; r0 < r_count; r0 += kRows) {
      const float* w[kRows];
      float* a[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        w[r] = buf.scores.data() + (r0 + r) * stride;
        a[r] = buf.acc.data() + (r0 + r) * padded;
      }
      const int64_t* n = buf.visible.data() + r0;
      switch (std::min(kRows, r_count - r0)) {
        case 4: weigh_all<4>(w, n, values, blocks, block_size, kv_heads * head, padded, a); break;
        case 3: weigh_all<3>(w, n, values, blocks, block_size, kv_heads * head, padded, a); break;
        case 2: weigh_all<2>(w, n, values, blocks, block_size, kv_heads * head, padded, a); break;
        default: weigh_all<1>(w, n, values, blocks, block_size, kv_heads * head, padded, a); break;
      }
    }
  }

  // Row i's output for head h from its parts' entries [padded weighted values, max, sum], in part
  // order: a part weighs exp(its max - the row's max). With one part the weight is exp(0) = 1 and
  // the output is that part's values over its sum, a plain softmax.
  void combine(const float* const* entries, int64_t reach, int64_t first_row, int64_t h, float* acc) const {
    float mx = -std::numeric_limits<float>::infinity(), total = 0.f;
    for (int64_t p = 0; p < reach; ++p) mx = std::max(mx, entries[p][padded]);
    std::fill(acc, acc + padded, 0.f);
    for (int64_t p = 0; p < reach; ++p) {
      const float w = std::exp(entries[p][padded] - mx);
      total = std::fma(w, entries[p][padded + 1], total);
      for (int64_t d = 0; d < padded; d += Vec::size())
        at::vec::fmadd(Vec(w), Vec::loadu(entries[p] + d), Vec::loadu(acc + d)).store(acc + d);
    }
    const Vec inv(1.f / total);
    for (int64_t d = 0; d < padded; d += Vec::size()) (Vec::loadu(acc + d) * inv).store(acc + d);
    store_float(acc, out + first_row * out_row + h * out_head, head);
  }

  // Parts [p0, p1) of rows [i0, i1)'s keys, each vector's entry stored at entry(r, p).
  template <typename Entry>
  void parts(int64_t s, int64_t kvh, int64_t i0, int64_t i1, int64_t p0, int64_t p1, Buffers& buf,
             Entry entry) const {
    for (int64_t p = p0; p < p1; ++p) {
      partial(s, kvh, i0, i1, p * part, buf);
      for (int64_t r = 0; r < (i1 - i0) * per_kv; ++r) {
        float* e = entry(r, p);
        std::copy_n(buf.acc.data() + r * padded, padded, e);
        e[padded] = buf.mx[r], e[padded + 1] = buf.sum[r];
      }
    }
  }

  int64_t parts_seen(int64_t s, int64_t i) const {  // the parts row i of sequence s reaches
    const int64_t nq = seq[3 * s + 1], ctx = seq[3 * s + 2];
    return (ctx - nq + i + 1 + part - 1) / part;
  }

  // The outputs of rows [i0, i1) from their parts' entries, laid out [part][vector][width] at `base`.
  void combine_tile(int64_t s, int64_t kvh, int64_t i0, int64_t i1, const float* base, int64_t most_parts) const {
    const int64_t width = padded + 2, r_count = (i1 - i0) * per_kv;
    std::vector<const float*> entries(most_parts);
    std::vector<float> acc(padded);
    for (int64_t r = 0; r < r_count; ++r) {
      const int64_t i = i0 + r / per_kv, reach = parts_seen(s, i);
      for (int64_t p = 0; p < reach; ++p) entries[p] = base + (p * r_count + r) * width;
      combine(entries.data(), reach, seq[3 * s] + i, kvh * per_kv + r % per_kv, acc.data());
    }
  }

  // Every part of a tile in this thread, then its rows' outputs.
  void attend_tile(int64_t s, int64_t kvh, int64_t i0, int64_t i1, Buffers& buf, std::vector<float>& own) const {
    const int64_t width = padded + 2, r_count = (i1 - i0) * per_kv, n_parts = parts_seen(s, i1 - 1);
    own.resize(n_parts * r_count * width);
    parts(s, kvh, i0, i1, 0, n_parts, buf, [&](int64_t r, int64_t p) { return own.data() + (p * r_count + r) * width; });
    combine_tile(s, kvh, i0, i1, own.data(), n_parts);
  }
};

// long: both ways of splitting the work stay in one function: split into two, GCC inlined the
// tiles differently and six rows over 700 keys took 25 % longer on one thread (measured).
template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& seqs,
                const at::Tensor& tables, double scale, int64_t window, double softcap, at::Tensor& out) {
  const int64_t heads = q.size(1), head = q.size(2), kv_heads = v_cache.size(2), block_size = v_cache.size(1);
  const int64_t part = std::max<int64_t>(1, kPartKeys / block_size) * block_size;
  const Step<T> step{q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), out.data_ptr<T>(),
                     seqs.data_ptr<int64_t>(), tables.data_ptr<int64_t>(), tables.size(1), heads, head, kv_heads,
                     heads / kv_heads, block_size, (head + Vec::size() - 1) / Vec::size() * Vec::size(), part,
                     q.stride(0), q.stride(1), out.stride(0), out.stride(1), static_cast<float>(scale),
                     window, static_cast<float>(softcap)};
  // Tiles: (sequence, kv head, first of kTile query rows), listed up front.
  std::vector<std::array<int64_t, 3>> tiles;
  int64_t work = 0, most_parts = 1;
  for (int64_t s = 0; s < seqs.size(0); ++s) {
    const int64_t nq = step.seq[3 * s + 1];
    work += nq * step.seq[3 * s + 2];
    most_parts = std::max(most_parts, step.parts_seen(s, nq - 1));
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
      for (int64_t i0 = 0; i0 < nq; i0 += kTile) tiles.push_back({s, kvh, i0});
  }
  // Small steps stay on one thread: waking the other costs more than it saves.
  const int64_t threads = work * heads * head < (1 << 18) ? 1 : at::get_num_threads();
  const int64_t n_tiles = static_cast<int64_t>(tiles.size());
  const int64_t width = step.padded + 2;
  if (threads == 1 || most_parts == 1 || n_tiles >= 2 * threads) {  // a thread takes whole tiles
    at::parallel_for(0, n_tiles, threads == 1 ? n_tiles : 1, [&](int64_t begin, int64_t end) {
      Buffers buf;
      std::vector<float> own;
      for (int64_t x = begin; x < end; ++x) {
        const auto [s, kvh, i0] = tiles[x];
        step.attend_tile(s, kvh, i0, std::min(i0 + kTile, step.seq[3 * s + 1]), buf, own);
      }
    });
    return;
  }
  // Few tiles (decode and verify steps): each part of a tile is an item, so long contexts keep
  // every thread busy; the entries meet in one buffer and are combined after. Same arithmetic.
  std::vector<int64_t> offset(n_tiles + 1, 0);
  std::vector<std::array<int64_t, 2>> items;  // (tile, part)
  for (int64_t x = 0; x < n_tiles; ++x) {
    const auto [s, kvh, i0] = tiles[x];
    const int64_t i1 = std::min(i0 + kTile, step.seq[3 * s + 1]), n_parts = step.parts_seen(s, i1 - 1);
    offset[x + 1] = offset[x] + n_parts * (i1 - i0) * step.per_kv * width;
    for (int64_t p = 0; p < n_parts; ++p) items.push_back({x, p});
  }
  std::vector<float> entries_of(offset[n_tiles]);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Buffers buf;
    for (int64_t y = begin; y < end; ++y) {
      const auto [x, p] = items[y];
      const auto [s, kvh, i0] = tiles[x];
      const int64_t i1 = std::min(i0 + kTile, step.seq[3 * s + 1]), r_count = (i1 - i0) * step.per_kv;
      float* base = entries_of.data() + offset[x];
      step.parts(s, kvh, i0, i1, p, p + 1, buf,
                 [&](int64_t r, int64_t part_of) { return base + (part_of * r_count + r) * width; });
    }
  });
  at::parallel_for(0, n_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      const auto [s, kvh, i0] = tiles[x];
      step.combine_tile(s, kvh, i0, std::min(i0 + kTile, step.seq[3 * s + 1]), entries_of.data() + offset[x], most_parts);
    }
  });
}

// k, v: this step's [T, KV, D] rows, written to `slots`; then the rows named by `seqs` attend.
void paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& seqs,
                  const at::Tensor& tables, double scale, int64_t window, double softcap, at::Tensor out) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_attention: window and softcap must be >= 0");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  TORCH_CHECK(k_cache.size(1) == v_cache.size(2) && k_cache.size(2) == v_cache.size(3) &&
                  k_cache.size(3) == v_cache.size(1),
              "paged_attention: the key cache must be [blocks, kv_heads, head_dim, block_size]");
  TORCH_CHECK(v_cache.size(1) % Vec::size() == 0 && v_cache.size(3) % Vec::size() == 0,
              "paged_attention: block size and head size must be multiples of ", Vec::size());
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "paged_attention: the head dimension must be contiguous");
  TORCH_CHECK(slots.is_contiguous() && seqs.is_contiguous() && tables.is_contiguous(),
              "paged_attention: metadata must be contiguous");
  // The kernel reads and writes through these indices without bounds checks of its own: a bad
  // one must raise here, not corrupt memory.
  const int64_t num_blocks = v_cache.size(0), rows = q.size(0), width = tables.size(1);
  TORCH_CHECK(k.size(0) == rows && v.size(0) == rows && slots.size(0) == rows && out.size(0) == rows,
              "paged_attention: q, k, v, slots and out must have the same rows");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < num_blocks * v_cache.size(1), "paged_attention: slot out of range");
  const int64_t* tb = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(tb[i] >= 0 && tb[i] < num_blocks, "paged_attention: block id out of range");
  const int64_t* sq = seqs.data_ptr<int64_t>();
  for (int64_t s = 0; s < seqs.size(0); ++s) {
    const int64_t first = sq[3 * s], nq = sq[3 * s + 1], ctx = sq[3 * s + 2];
    TORCH_CHECK(first >= 0 && nq >= 1 && first + nq <= rows && nq <= ctx && ctx <= width * v_cache.size(1),
                "paged_attention: sequence ", s, " does not fit the step or its block table");
  }
  auto run = [&](auto zero) {
    using T = decltype(zero);
    write_cache<T>(k, v, k_cache, v_cache, slots.data_ptr<int64_t>());
    if (seqs.size(0) > 0) attend_all<T>(q, k_cache, v_cache, seqs, tables, scale, window, softcap, out);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(0.f); break;
    case at::kBFloat16: run(at::BFloat16(0.f)); break;
    case at::kHalf: run(at::Half(0.f)); break;
    default: TORCH_CHECK(false, "paged_attention: float32, bfloat16 or float16 only, got ", q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(verispec_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "Tensor seqs, Tensor tables, float scale, int window, float softcap, Tensor(c!) out) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
