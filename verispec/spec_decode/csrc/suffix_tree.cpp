// A depth-bounded suffix tree over token sequences, for suffix decoding (spec_decode/suffix.py).
//
// Every suffix of every sequence is inserted up to `depth` tokens, so the node a pattern P
// (|P| <= depth) ends in has count = the number of occurrences of P in the sequences held, and its
// children's counts are the occurrences of P followed by each token. Edges are compressed: a node
// holds the run of tokens from its parent, and no node has a single child with its own count (it
// would be merged). Each suffix that is still growing (the last `depth` starts of a sequence)
// always ends exactly at the end of a node, so appending a token moves each of them by one token:
// O(depth) work per appended token, whatever the sequences' lengths. Removing a sequence walks its
// suffixes back down (O(length x depth)). Nodes own their tokens, so a removed sequence leaves no
// references behind.
//
// Each tree takes its nodes, runs and hash tables from its own pool (std::pmr), which draws on
// malloc in large chunks: a node made per token never lands inside a hole that a step's freed
// [rows, vocabulary] tensor left in the C heap, so the engine's next step reuses that hole
// instead of growing the heap (host_memory.py keeps step-sized blocks in the heap).
//
// Built by spec_decode/suffix_tree.py with the local C++ compiler (portable code, no vector
// instructions), loaded as a Python extension module.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <memory_resource>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// A branching node's distribution keeps at most this many children (the most frequent), renormalised.
constexpr size_t kMaxBranches = 32;

struct Node;

// Gives a node back to the pool it came from.
struct NodeDeleter {
  std::pmr::memory_resource* pool;
  void operator()(Node* n) const;
};
using NodePtr = std::unique_ptr<Node, NodeDeleter>;

struct Node {
  explicit Node(std::pmr::memory_resource* pool) : tokens(pool), children(pool) {}
  int64_t count = 0;  // suffixes that pass through or end in this node
  Node* parent = nullptr;
  std::pmr::vector<int32_t> tokens;  // the run from the parent; tokens[0] keys it in parent->children
  std::pmr::unordered_map<int32_t, NodePtr> children;
};

void NodeDeleter::operator()(Node* n) const {
  n->~Node();
  pool->deallocate(n, sizeof(Node), alignof(Node));
}

NodePtr make_node(std::pmr::memory_resource* pool) {
  return NodePtr(new (pool->allocate(sizeof(Node), alignof(Node))) Node(pool), NodeDeleter{pool});
}

struct Sequence {
  explicit Sequence(std::pmr::memory_resource* pool) : tokens(pool), growing(pool) {}
  std::pmr::vector<int32_t> tokens;
  std::pmr::deque<Node*> growing;  // where each of the last `depth` suffixes ends, oldest first
};

// One draft: its tokens, at each position q (the distribution the token was drawn from, sparse),
// and the score used to choose between match lengths and trees (expected accepted tokens).
struct Draft {
  double score = 0.0;
  int match_len = 0;
  std::vector<int32_t> tokens;
  std::vector<std::vector<int32_t>> q_ids;
  std::vector<std::vector<double>> q_probs;
  // Per position, the chance the text continues with the branch's most frequent token (1 inside a
  // run): a function of the drafts before it only, so adaptive verification may rank by it.
  std::vector<double> confidence;
};

// U(0, 1) of a request's `draft` noise at a sequence position: sample/noise.py's RequestNoise.key
// (splitmix64 of the purpose's base mixed with the position's splitmix64, 63 bits) and uniform().
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

double uniform(uint64_t base, int64_t position) {
  const uint64_t key = splitmix64(base ^ splitmix64(static_cast<uint64_t>(position))) >> 1;
  return (static_cast<double>(key >> 11) + 0.5) / 4503599627370496.0;  // 2^52: exact, never 0 or 1
}

// Draws for a random request: its `draft` noise base and the position of its first draft.
struct Draws {
  uint64_t base;
  int64_t first_position;
};

struct Branch {
  int64_t count;
  int32_t token;
  Node* node;
};

class SuffixTree {
 public:
  explicit SuffixTree(int depth) : depth_(depth), root_(make_node(&pool_)) {
    if (depth < 1) throw std::invalid_argument("depth must be >= 1");
  }

  void extend(int64_t id, const std::vector<int32_t>& tokens) {
    Sequence& seq = seqs_.try_emplace(id, &pool_).first->second;
    for (int32_t t : tokens) append(seq, t);
  }

  void remove(int64_t id) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return;
    const std::pmr::vector<int32_t>& s = it->second.tokens;
    for (size_t start = 0; start < s.size(); ++start) remove_suffix(s, start);
    num_tokens_ -= static_cast<int64_t>(s.size());
    seqs_.erase(it);
  }

  // The best draft over match lengths 1..min(|context|, depth) (ties: the longer match). With a
  // noise base, each branching token is drawn from its branch's distribution; without, it is the
  // most frequent. The match length is chosen by the most-frequent path's score either way, so it
  // depends on the context alone, never on the draws.
  Draft speculate(const std::vector<int32_t>& context, int max_tokens, double factor, double offset,
                  double min_prob, std::optional<uint64_t> noise_base, int64_t first_position) const {
    // Every match length is scored without recording its draft (up to depth^2 tokens of
    // vectors); the chosen one is walked again and recorded.
    double best_score = 0.0;
    const Node* best_node = nullptr;
    size_t best_idx = 0;
    int best_m = 0;
    const size_t longest = std::min(context.size(), static_cast<size_t>(depth_));
    auto limit_of = [&](size_t m) {
      return std::max(0, std::min(max_tokens, static_cast<int>(m * factor + offset + 1e-6)));
    };
    for (size_t m = 1; m <= longest; ++m) {
      auto [node, idx] = match(context.data() + context.size() - m, m);
      if (node == nullptr) break;  // a longer suffix cannot occur either
      const double score = walk(node, idx, limit_of(m), min_prob, nullptr, nullptr);
      if (score > 0.0 && score >= best_score) {  // a score of 0: no token to draft
        best_score = score;
        best_m = static_cast<int>(m);
        best_node = node;
        best_idx = idx;
      }
    }
    Draft best;
    if (best_node == nullptr) return best;
    const Draws draws{noise_base.value_or(0), first_position};
    walk(best_node, best_idx, limit_of(best_m), min_prob, noise_base.has_value() ? &draws : nullptr, &best);
    best.score = best_score;  // the most frequent path's, for the draws' walk too
    best.match_len = best_m;
    return best;
  }

  // Occurrences of `pattern` (|pattern| <= depth) in the sequences held.
  int64_t count(const std::vector<int32_t>& pattern) const {
    if (pattern.empty()) return root_->count;
    auto [node, idx] = match(pattern.data(), pattern.size());
    return node == nullptr ? 0 : node->count;
  }

  // Bytes held, estimated from the containers' sizes (libstdc++'s node and bucket layouts).
  int64_t memory_bytes() const {
    int64_t total = 0;
    std::vector<const Node*> stack{root_.get()};
    while (!stack.empty()) {
      const Node* n = stack.back();
      stack.pop_back();
      total += sizeof(Node) + n->tokens.capacity() * sizeof(int32_t);
      total += n->children.bucket_count() * sizeof(void*) + n->children.size() * 32;
      for (const auto& kv : n->children) stack.push_back(kv.second.get());
    }
    for (const auto& [id, seq] : seqs_) {
      total += 64 + seq.tokens.capacity() * sizeof(int32_t) + seq.growing.size() * sizeof(Node*) + 512;
    }
    return total;
  }

  int64_t num_nodes() const { return num_nodes_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_sequences() const { return static_cast<int64_t>(seqs_.size()); }
  int depth() const { return depth_; }

  // The structure's invariants, for tests: "" when they hold, else the first broken one.
  std::string check() const {
    int64_t nodes = 0;
    std::vector<const Node*> stack{root_.get()};
    while (!stack.empty()) {
      const Node* n = stack.back();
      stack.pop_back();
      ++nodes;
      int64_t below = 0;
      for (const auto& [key, child] : n->children) {
        if (child->parent != n) return "a child's parent pointer is wrong";
        if (child->tokens.empty() || child->tokens[0] != key) return "a child is keyed by another token";
        if (child->count <= 0) return "a node with no suffix";
        if (n != root_.get() && child->count == n->count) return "a node that should have been merged";
        below += child->count;
        stack.push_back(child.get());
      }
      if (below > n->count) return "children count more suffixes than their parent";
    }
    if (nodes != num_nodes_) return "the node count is off";
    return "";
  }

 private:
  void append(Sequence& seq, int32_t t) {
    seq.tokens.push_back(t);
    ++num_tokens_;
    root_->count += 1;  // the suffix that starts at t
    seq.growing.push_back(root_.get());
    if (static_cast<int>(seq.growing.size()) > depth_) seq.growing.pop_front();  // reached the depth
    for (Node*& end : seq.growing) end = step(end, t);
  }

  // A suffix that ends at the end of `node` grows by `t`; returns the node it now ends in.
  Node* step(Node* node, int32_t t) {
    const bool root = node == root_.get();
    auto it = node->children.find(t);
    if (it == node->children.end()) {
      if (!root && node->count == 1) {  // a leaf no other suffix reaches: it grows in place
        node->tokens.push_back(t);
        return node;
      }
      NodePtr leaf = make_node(&pool_);
      leaf->count = 1;
      leaf->parent = node;
      leaf->tokens.push_back(t);
      Node* raw = leaf.get();
      node->children.emplace(t, std::move(leaf));
      ++num_nodes_;
      return raw;
    }
    Node* child = it->second.get();
    if (!root && node->count == child->count + 1) {
      // Only this suffix ends in `node` and every other one continues into `child`: growing it
      // would leave `node` a single-child node with its child's count, so `node` takes the token.
      if (child->tokens.size() == 1) {  // `child` takes node's place (other suffixes may end in it)
        child->tokens.insert(child->tokens.begin(), node->tokens.begin(), node->tokens.end());
        child->count += 1;
        Node* parent = node->parent;
        child->parent = parent;
        NodePtr keep = std::move(it->second);
        parent->children[child->tokens[0]] = std::move(keep);  // frees `node`
        --num_nodes_;
        return child;
      }
      node->tokens.push_back(t);
      child->tokens.erase(child->tokens.begin());
      NodePtr keep = std::move(it->second);
      node->children.erase(it);
      node->children.emplace(child->tokens[0], std::move(keep));
      return node;
    }
    if (child->tokens.size() == 1) {
      child->count += 1;
      return child;
    }
    // Split the child's run after its first token.
    NodePtr mid = make_node(&pool_);
    mid->count = child->count + 1;
    mid->parent = node;
    mid->tokens.push_back(t);
    child->tokens.erase(child->tokens.begin());
    child->parent = mid.get();
    Node* raw = mid.get();
    mid->children.emplace(child->tokens[0], std::move(it->second));
    it->second = std::move(mid);
    ++num_nodes_;
    return raw;
  }

  void remove_suffix(const std::pmr::vector<int32_t>& s, size_t start) {
    const size_t end = std::min(s.size(), start + static_cast<size_t>(depth_));
    Node* node = root_.get();
    node->count -= 1;
    size_t i = start;
    while (i < end) {
      auto it = node->children.find(s[i]);
      if (it == node->children.end()) return;  // cannot happen while the counts are consistent
      Node* child = it->second.get();
      child->count -= 1;
      if (child->count == 0) {  // nobody else reaches it, nor anything below it
        num_nodes_ -= subtree_size(child);
        node->children.erase(it);
        break;
      }
      i += child->tokens.size();
      node = child;
    }
    merge_into_child(node);
  }

  // A node no suffix ends in, with a single child: the child absorbs it (suffixes may end in the
  // child, never in the node, so the child is the one to keep).
  void merge_into_child(Node* node) {
    if (node == root_.get() || node->children.size() != 1) return;
    auto only = node->children.begin();
    if (only->second->count != node->count) return;
    Node* child = only->second.get();
    child->tokens.insert(child->tokens.begin(), node->tokens.begin(), node->tokens.end());
    Node* parent = node->parent;
    child->parent = parent;
    NodePtr keep = std::move(only->second);
    parent->children[child->tokens[0]] = std::move(keep);  // frees `node`
    --num_nodes_;
  }

  static int64_t subtree_size(const Node* n) {
    int64_t total = 1;
    for (const auto& kv : n->children) total += subtree_size(kv.second.get());
    return total;
  }

  // Where `pattern` ends: the node and how many of its tokens it used; {nullptr, 0} if absent.
  std::pair<const Node*, size_t> match(const int32_t* pattern, size_t n) const {
    const Node* node = root_.get();
    size_t idx = 0;
    for (size_t i = 0; i < n; ++i) {
      if (idx == node->tokens.size()) {
        auto it = node->children.find(pattern[i]);
        if (it == node->children.end()) return {nullptr, 0};
        node = it->second.get();
        idx = 0;
      }
      if (node->tokens[idx] != pattern[i]) return {nullptr, 0};
      ++idx;
    }
    return {node, idx};
  }

  // Follows the tree from a match: inside a run the next token is certain; at a branch the
  // continuation is the most frequent child (or a draw), while the path's probability (the chance
  // that every token so far continues the text, as the counts have it) times the branch's peak
  // stays >= min_prob. The stop test reads the peak, not the drawn token's probability, so
  // whether position j is drafted depends only on the drafts before it.
  // Returns the path's score (0: no token); `record`, where given, receives the draft itself.
  static double walk(const Node* node, size_t idx, int limit, double min_prob, const Draws* draws, Draft* record) {
    double score = 0.0;
    double prob = 1.0;
    std::vector<Branch> branches;
    for (int n = 0; n < limit; ++n) {
      if (idx < node->tokens.size()) {
        const int32_t tok = node->tokens[idx++];
        score += prob;
        if (record == nullptr) continue;
        record->tokens.push_back(tok);
        record->q_ids.push_back({tok});
        record->q_probs.push_back({1.0});
        record->confidence.push_back(1.0);
        continue;
      }
      if (node->children.empty()) break;
      branches.clear();
      for (const auto& [tok, child] : node->children) branches.push_back({child->count, tok, child.get()});
      const size_t keep = std::min(branches.size(), kMaxBranches);
      auto first = [](const Branch& a, const Branch& b) {
        return a.count != b.count ? a.count > b.count : a.token < b.token;
      };
      std::partial_sort(branches.begin(), branches.begin() + keep, branches.end(), first);
      branches.resize(keep);
      const double total = static_cast<double>(node->count);
      if (prob * branches[0].count / total < min_prob) break;
      int64_t kept = 0;
      for (const Branch& b : branches) kept += b.count;
      size_t pick = 0;
      if (draws != nullptr) {  // inverse CDF over the kept branches
        const double u = uniform(draws->base, draws->first_position + static_cast<int64_t>(n));
        const double target = u * static_cast<double>(kept);
        double cum = 0.0;
        for (pick = 0; pick + 1 < keep; ++pick) {
          cum += static_cast<double>(branches[pick].count);
          if (target < cum) break;
        }
      }
      prob *= static_cast<double>(branches[pick].count) / total;
      score += prob;
      if (record != nullptr) {
        std::vector<int32_t> ids;
        std::vector<double> probs;
        for (const Branch& b : branches) {
          ids.push_back(b.token);
          probs.push_back(static_cast<double>(b.count) / static_cast<double>(kept));
        }
        record->tokens.push_back(branches[pick].token);
        record->q_ids.push_back(std::move(ids));
        record->q_probs.push_back(std::move(probs));
        record->confidence.push_back(static_cast<double>(branches[0].count) / total);
      }
      node = branches[pick].node;
      idx = 1;
    }
    return score;
  }

  int depth_;
  // Declared first, so it outlives (is destroyed after) everything drawn from it.
  std::pmr::unsynchronized_pool_resource pool_;
  NodePtr root_;
  std::unordered_map<int64_t, Sequence> seqs_;
  int64_t num_nodes_ = 1;
  int64_t num_tokens_ = 0;
};

}  // namespace

PYBIND11_MODULE(verispec_suffix, m) {
  m.def("uniform", &uniform, py::arg("base"), py::arg("position"));
  py::class_<Draft>(m, "Draft")
      .def_readonly("score", &Draft::score)
      .def_readonly("match_len", &Draft::match_len)
      .def_readonly("tokens", &Draft::tokens)
      .def_readonly("q_ids", &Draft::q_ids)
      .def_readonly("q_probs", &Draft::q_probs)
      .def_readonly("confidence", &Draft::confidence);
  py::class_<SuffixTree>(m, "SuffixTree")
      .def(py::init<int>(), py::arg("depth"))
      .def("extend", &SuffixTree::extend, py::arg("seq"), py::arg("tokens"))
      .def("remove", &SuffixTree::remove, py::arg("seq"))
      .def("speculate", &SuffixTree::speculate, py::arg("context"), py::arg("max_tokens"), py::arg("factor"),
           py::arg("offset"), py::arg("min_prob"), py::arg("noise_base") = py::none(), py::arg("first_position") = 0)
      .def("count", &SuffixTree::count, py::arg("pattern"))
      .def("memory_bytes", &SuffixTree::memory_bytes)
      .def("check", &SuffixTree::check)
      .def_property_readonly("num_nodes", &SuffixTree::num_nodes)
      .def_property_readonly("num_tokens", &SuffixTree::num_tokens)
      .def_property_readonly("num_sequences", &SuffixTree::num_sequences)
      .def_property_readonly("depth", &SuffixTree::depth);
}
