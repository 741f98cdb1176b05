// The index's write side: storing chains of pages, moving holdings between tiers and
// dropping them (see chains.py for what each event means), over the node and holder
// columns that nodes.py and holders.py own as numpy arrays.
//
// The columns live in Python (numpy arrays, grown there and attached here again after
// each growth); what has no column lives here: the free list, the count of node ids
// handed out, the holders beyond a node's inline columns, and each worker's page id ->
// node map (PageMap). Every node id taken from a column, a map or a caller is checked
// against the columns' length before use; what the wire names (page ids, tiers) is
// checked before it reaches a column.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "chain_keys.hpp"
#include "key_table.hpp"
#include "walk.hpp"

namespace kvmesh {

constexpr int kInline = 4;       // inline holder columns per node
constexpr int kExtra = kInline;  // the "column" of a holding kept beside the columns
constexpr int kNoColumn = -1;
constexpr int kMaxTiers = 8;
constexpr int64_t kMaxPage = INT32_MAX;  // page ids travel as int32 in match replies

// The columns, writable, `capacity` nodes each (the holder ones kInline per node).
struct TrieColumns {
  char* tokens;
  int32_t* parent;  // node ids are int32: the capacity stays below 2**31
  int32_t* first_child;
  int32_t* next_sibling;
  int32_t* prev_sibling;
  int64_t* key;
  int32_t* depth;
  int64_t* last_access;
  uint8_t* chained;
  int16_t* count;       // holders of each node, inline and beyond
  int16_t* slot;        // [node * kInline + column]: the holder's slot, or -1
  int32_t* page;
  int64_t* generation;
  uint8_t* tier;
  std::size_t capacity = 0;
  std::size_t page_bytes = 0;
};

struct Holding {
  int16_t slot;
  int32_t page;
  int64_t generation;
  uint8_t tier;
};

// One worker's page id -> node map: dense below kDenseLimit, a hash map above.
class PageMap {
 public:
  static constexpr int64_t kDenseLimit = int64_t{1} << 22;

  std::size_t size() const { return size_; }

  int64_t get(int64_t page) const {
    check(page);
    if (page < kDenseLimit) {
      auto at = static_cast<std::size_t>(page);
      return at < dense_.size() ? dense_[at] : kNone;
    }
    auto found = sparse_.find(page);
    return found == sparse_.end() ? kNone : found->second;
  }

  void set(int64_t page, int64_t node) {
    check(page);
    if (page >= kDenseLimit) {
      size_ += sparse_.emplace(page, static_cast<int32_t>(node)).second;
      sparse_[page] = static_cast<int32_t>(node);
      return;
    }
    auto at = static_cast<std::size_t>(page);
    if (at >= dense_.size()) {
      std::size_t grown = std::max({at + 1, dense_.size() + dense_.size() / 2, std::size_t{64}});
      dense_.resize(std::min(grown, static_cast<std::size_t>(kDenseLimit)), -1);
    }
    size_ += dense_[at] == -1;
    dense_[at] = static_cast<int32_t>(node);
  }

  int64_t pop(int64_t page) {
    int64_t node = get(page);
    if (node == kNone) return kNone;
    --size_;
    if (page < kDenseLimit)
      dense_[static_cast<std::size_t>(page)] = -1;
    else
      sparse_.erase(page);
    return node;
  }

  // (page, node) pairs: the dense ones by page, then the sparse ones by page.
  std::vector<std::pair<int64_t, int64_t>> items() const {
    std::vector<std::pair<int64_t, int64_t>> out;
    out.reserve(size_);
    for (std::size_t page = 0; page < dense_.size(); ++page)
      if (dense_[page] != -1) out.emplace_back(static_cast<int64_t>(page), dense_[page]);
    std::size_t dense = out.size();
    for (auto [page, node] : sparse_) out.emplace_back(page, node);
    std::sort(out.begin() + static_cast<std::ptrdiff_t>(dense), out.end());
    return out;
  }

  void clear() {
    std::vector<int32_t>().swap(dense_);
    std::unordered_map<int64_t, int32_t>().swap(sparse_);
    size_ = 0;
  }

  std::size_t nbytes() const {
    return dense_.capacity() * sizeof(int32_t) + sparse_.size() * 32;
  }

 private:
  static void check(int64_t page) {
    if (page < 0 || page > kMaxPage) throw std::out_of_range("a page id must be in [0, 2**31)");
  }

  std::vector<int32_t> dense_;
  std::unordered_map<int64_t, int32_t> sparse_;
  std::size_t size_ = 0;
};

// One holder's span of a match: its leading run of the matched pages, as the wire's
// little-endian bytes (int32 page ids, int64 generations, one tier index a page).
struct Span {
  int slot = -1;
  std::size_t held = 0;
  std::string pages, generations, tiers;
};

// What one write did to a worker's pages per tier, and what it found.
struct Tally {
  int64_t tier_delta[kMaxTiers] = {};  // pages the worker holds in each tier: the change
  int64_t removed[kMaxTiers] = {};     // holdings removed by the event's reason, by tier
  int64_t demoted = 0;                 // holdings moved by a demotion
  int64_t unknown = 0;                 // page ids named that the worker did not hold
};

// A page of a worker's that another worker has stored since (see Trie::take_notices).
struct Notice {
  int32_t page;
  int64_t generation;
};

// The notices waiting for one worker, oldest first: a ring that grows up to its limit and
// then overwrites its oldest, so a busy store allocates nothing once it is full.
class NoticeRing {
 public:
  std::size_t size() const { return size_; }
  std::size_t capacity() const { return buf_.capacity(); }
  bool empty() const { return size_ == 0; }

  // Append; false when the oldest was overwritten to make room (`limit` > 0).
  bool push(Notice notice, std::size_t limit) {
    if (size_ < buf_.size()) {
      std::size_t at = head_ + size_;
      buf_[at < buf_.size() ? at : at - buf_.size()] = notice;
      ++size_;
      return true;
    }
    if (buf_.size() < limit) {  // full but below the limit: grow, oldest first again
      std::rotate(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(head_), buf_.end());
      head_ = 0;
      buf_.push_back(notice);
      ++size_;
      return true;
    }
    buf_[head_] = notice;  // at the limit: the oldest goes
    if (++head_ == buf_.size()) head_ = 0;
    return false;
  }

  Notice pop() {
    Notice notice = buf_[head_];
    if (++head_ == buf_.size()) head_ = 0;
    --size_;
    return notice;
  }

  void clear() {
    head_ = size_ = 0;
    buf_.clear();
    buf_.shrink_to_fit();
  }

 private:
  std::vector<Notice> buf_;
  std::size_t head_ = 0;
  std::size_t size_ = 0;
};

class Trie {
 public:
  Trie(KeyTable& table, ChainKeys& keys, int tiers)
      : table_(table), keys_(keys), tiers_(tiers), walker_(view_, table, keys) {
    if (tiers <= 0 || tiers > kMaxTiers) throw std::invalid_argument("tiers must be in [1, 8]");
  }

  // Rebind the columns (after they grew); node ids handed out stay below the capacity.
  void attach(const TrieColumns& columns) {
    if (columns.capacity < allocated_) throw std::invalid_argument("the columns shrank");
    if (columns.capacity > static_cast<std::size_t>(INT32_MAX))
      throw std::invalid_argument("node ids are int32: at most 2**31 - 1 nodes");
    c_ = columns;
    view_ = NodeColumns{c_.tokens, c_.parent, c_.first_child, c_.chained,
                        c_.key,    c_.capacity, c_.page_bytes};
  }

  Walker& walker() { return walker_; }
  std::size_t allocated() const { return allocated_; }
  std::size_t num_pages() const { return num_pages_; }
  std::size_t max_depth() const { return max_depth_; }
  const std::vector<int32_t>& free_nodes() const { return free_; }
  const std::unordered_map<int32_t, std::vector<Holding>>& extra() const { return extra_; }
  // Node ids that can be handed out without the columns growing.
  std::size_t room() const { return c_.capacity - allocated_ + free_.size(); }

  // Roots the writes since the last call emptied (no children left); the caller
  // releases those still empty.
  std::vector<int64_t> take_emptied_roots() { return std::exchange(emptied_roots_, {}); }

  int64_t new_root(int64_t key) {
    int64_t node = allocate();
    c_.key[node] = key;
    c_.depth[node] = 0;
    c_.parent[node] = kNone;
    return node;
  }

  void release_root(int64_t node) {
    need(node);
    if (c_.parent[node] != kNone || c_.first_child[node] != kNone || c_.count[node] != 0)
      throw std::logic_error("only an empty root can be released");
    reset(node);
  }

  // The column of `slot`'s holding of `node` (kExtra: beside the columns); kNoColumn.
  int column_of(int64_t node, int slot) const {
    need(node);
    if (c_.count[node] == 0) return kNoColumn;
    const int16_t* slots = c_.slot + node * kInline;
    for (int column = 0; column < kInline; ++column)
      if (slots[column] == slot) return column;
    auto found = extra_.find(static_cast<int32_t>(node));
    if (found != extra_.end())
      for (const Holding& holding : found->second)
        if (holding.slot == slot) return kExtra;
    return kNoColumn;
  }

  // `slot`'s holding of `node`; false when it holds none.
  bool holding(int64_t node, int slot, Holding* out) const {
    int column = column_of(node, slot);
    if (column == kNoColumn) return false;
    if (column < kExtra) {
      std::size_t at = static_cast<std::size_t>(node) * kInline + column;
      *out = Holding{static_cast<int16_t>(slot), c_.page[at], c_.generation[at], c_.tier[at]};
      return true;
    }
    for (const Holding& holding : extra_.at(static_cast<int32_t>(node)))
      if (holding.slot == slot) *out = holding;
    return true;
  }

  // Hang a chain of `count` pages (packed tokens `data`) below `parent` for the worker in
  // `slot`; false: a page id of the chain is the worker's id of a node on its own path
  // (the pages before it stay stored). The caller has made room for `count` nodes. With
  // `notify`, a node the worker newly holds that others hold already gives each of them a
  // notice: another worker has the newest copy.
  bool store(PageMap& map, int slot, int64_t parent, const char* data, std::size_t bytes,
             const int64_t* pages, const int64_t* generations, std::size_t count, int tier,
             int64_t clock, Tally& tally, bool notify = false) {
    need(parent);
    check_tier(tier);
    if (bytes != count * c_.page_bytes) throw std::invalid_argument("tokens for another count");
    if (room() < count) throw std::length_error("no room for the chain's nodes");
    keys_scratch_.resize(count);
    keys_.chain(c_.key[parent], static_cast<std::size_t>(c_.depth[parent]), data, bytes,
                keys_scratch_.data());
    int column = column_of(parent, slot);  // roots have no holders: kNoColumn
    for (std::size_t i = 0; i < count; ++i) {
      const char* tokens = data + i * c_.page_bytes;
      int64_t key = keys_scratch_[i];
      int64_t node = walker_.child(parent, key, tokens);
      int64_t old = map.get(pages[i]);
      if (old != kNone && old != node) {
        // The worker reused the page id: what it held there (and beneath) is gone.
        if (is_ancestor_or_self(old, parent)) return false;
        drop_subtree(map, slot, old, nullptr, tally);
        node = walker_.child(parent, key, tokens);
      }
      if (node == kNone) node = new_node(parent, key, tokens);
      int16_t holders = c_.count[node];
      column = hold(map, slot, node, pages[i], generations[i], tier, column, tally);
      if (notify && holders > 0 && c_.count[node] > holders) superseded(node, slot);
      c_.last_access[node] = clock;
      parent = node;
    }
    return true;
  }

  // The notices waiting for the worker in `slot` that still hold (it holds that page id at
  // that generation, and someone else holds the page too), at most `limit`, each once, in
  // the order they came; appended to `pages` and `generations`.
  void take_notices(const PageMap& map, int slot, std::size_t limit, std::vector<int64_t>& pages,
                    std::vector<int64_t>& generations) {
    if (slot < 0 || static_cast<std::size_t>(slot) >= notices_.size()) return;
    NoticeRing& waiting = notices_[static_cast<std::size_t>(slot)];
    std::size_t first = pages.size();
    while (!waiting.empty() && pages.size() - first < limit) {
      Notice notice = waiting.pop();
      int64_t node = map.get(notice.page);
      Holding held;
      if (node == kNone || c_.count[node] < 2 || !holding(node, slot, &held) ||
          held.page != notice.page || held.generation != notice.generation)
        continue;
      if (std::find(pages.begin() + static_cast<std::ptrdiff_t>(first), pages.end(),
                    notice.page) != pages.end())
        continue;  // a page named twice (stored again by a third worker): once is enough
      pages.push_back(notice.page);
      generations.push_back(notice.generation);
    }
  }

  // Forget the notices of the worker in `slot` (it left, or starts over).
  void clear_notices(int slot) {
    if (slot >= 0 && static_cast<std::size_t>(slot) < notices_.size())
      notices_[static_cast<std::size_t>(slot)].clear();
  }

  // At most this many notices wait for one worker; the oldest go first. Those waiting
  // are dropped (they are advice; a ring never holds more than the limit).
  void set_notice_limit(std::size_t limit) {
    notice_limit_ = limit;
    for (NoticeRing& waiting : notices_) waiting.clear();
  }
  std::size_t notice_limit() const { return notice_limit_; }
  int64_t notices_issued() const { return notices_issued_; }
  int64_t notices_overflowed() const { return notices_overflowed_; }
  std::size_t notices_waiting(int slot) const {
    if (slot < 0 || static_cast<std::size_t>(slot) >= notices_.size()) return 0;
    return notices_[static_cast<std::size_t>(slot)].size();
  }

  // Move each named holding of the worker to its new page id, generation and tier; ids
  // it does not hold are counted; false: a new id is the worker's id of an ancestor of
  // the page it is to name (the moves before it stay made).
  bool demote(PageMap& map, int slot, const int64_t* pages, const int64_t* new_pages,
              const int64_t* generations, std::size_t count, int tier, Tally& tally) {
    check_tier(tier);
    for (std::size_t i = 0; i < count; ++i) {
      int64_t node = map.get(pages[i]);
      if (node == kNone) {
        ++tally.unknown;
        continue;
      }
      int64_t taken = map.get(new_pages[i]);
      if (taken != kNone && taken != node) {
        if (is_ancestor_or_self(taken, node)) return false;
        drop_subtree(map, slot, taken, nullptr, tally);
      }
      hold(map, slot, node, new_pages[i], generations[i], tier, kNoColumn, tally);
      ++tally.demoted;
    }
    return true;
  }

  // Drop the named pages of the worker and what it holds below them, counted in
  // `tally.removed`; unknown ids are counted.
  void drop_pages(PageMap& map, int slot, const int64_t* pages, std::size_t count, Tally& tally) {
    for (std::size_t i = 0; i < count; ++i) {
      int64_t node = map.get(pages[i]);
      if (node == kNone)
        ++tally.unknown;
      else
        drop_subtree(map, slot, node, tally.removed, tally);
    }
  }

  // Drop every holding of the worker; `removed` (may be null) counts them by tier.
  std::size_t drop_all(PageMap& map, int slot, int64_t* removed, Tally& tally) {
    clear_notices(slot);  // its page ids name nothing any more
    auto held = map.items();
    // Any order works: a node emptied here has no holders below it (prefix closure), so
    // it goes when the last of its children does, whichever comes last.
    for (auto [page, node] : held) {
      release(map, slot, node, removed, tally);
      prune(node);
    }
    if (map.size() != 0) throw std::logic_error("a holding outlived dropping them all");
    map.clear();
    return held.size();
  }

  // Drop the worker's holdings of `top` and of everything it holds beneath it.
  std::size_t drop_subtree(PageMap& map, int slot, int64_t top, int64_t* removed, Tally& tally) {
    held_.clear();
    stack_.assign(1, top);
    while (!stack_.empty()) {
      int64_t node = stack_.back();
      stack_.pop_back();
      if (column_of(node, slot) == kNoColumn) continue;  // nothing of its below either
      held_.push_back(node);
      for (int64_t child = c_.first_child[node]; child != kNone; child = c_.next_sibling[child]) {
        need(child);
        stack_.push_back(child);
      }
    }
    std::vector<int64_t> held = std::move(held_);
    for (auto node = held.rbegin(); node != held.rend(); ++node) {
      // Children before parents, so pruning climbs once.
      release(map, slot, *node, removed, tally);
      prune(*node);
    }
    held_ = std::move(held);
    return held_.size();
  }

  // The path of packed prompt `data` below `root` (kNone: none) and every holder's span
  // along it; `touch`: the matched pages' last access becomes `clock`. Returns the
  // matched length in pages. Each holder holds a leading run of the path (prefix
  // closure) in one column (column consistency): see holders.py.
  std::size_t match(int64_t root, const char* data, std::size_t bytes, std::size_t max_runs,
                    bool touch, int64_t clock, std::vector<Span>& spans) {
    Path path = walker_.walk(root, data, bytes, max_runs, allocated_, max_depth_);
    std::size_t length = path.length;
    spans.clear();
    if (length == 0) return 0;
    std::vector<int64_t>& nodes = path.nodes;
    if (!path.listed)
      for (auto [first, pages] : path.runs)
        for (std::size_t i = 0; i < pages; ++i) nodes.push_back(first + static_cast<int64_t>(i));
    for (int64_t node : nodes) need(node);
    if (touch)
      for (int64_t node : nodes) c_.last_access[node] = clock;
    int64_t first = nodes.front(), last = nodes.back();
    for (int column = 0; column < kInline; ++column) {
      int16_t slot = c_.slot[first * kInline + column];
      if (slot == -1) continue;
      std::size_t held = length;
      if (c_.slot[last * kInline + column] != slot) {
        std::size_t low = 1, high = length - 1;  // pages [0, low) held, page high not
        while (low < high) {
          std::size_t middle = (low + high) / 2;
          if (c_.slot[nodes[middle] * kInline + column] == slot)
            low = middle + 1;
          else
            high = middle;
        }
        held = low;
      }
      Span& span = spans.emplace_back();
      span.slot = slot;
      span.held = held;
      span.pages.resize(held * 4);
      span.generations.resize(held * 8);
      span.tiers.resize(held);
      for (std::size_t i = 0; i < held; ++i) {
        std::size_t at = static_cast<std::size_t>(nodes[i]) * kInline + column;
        std::memcpy(&span.pages[i * 4], &c_.page[at], 4);
        std::memcpy(&span.generations[i * 8], &c_.generation[at], 8);
        span.tiers[i] = static_cast<char>(c_.tier[at]);
      }
    }
    auto beyond = extra_.find(static_cast<int32_t>(first));
    if (beyond != extra_.end()) {
      for (const Holding& top : beyond->second) {
        Span& span = spans.emplace_back();
        span.slot = top.slot;
        for (std::size_t i = 0; i < length; ++i) {
          const Holding* found = nullptr;
          if (i == 0) {
            found = &top;
          } else if (auto it = extra_.find(static_cast<int32_t>(nodes[i])); it != extra_.end()) {
            for (const Holding& h : it->second)
              if (h.slot == top.slot) found = &h;
          }
          if (found == nullptr) break;
          span.pages.append(reinterpret_cast<const char*>(&found->page), 4);
          span.generations.append(reinterpret_cast<const char*>(&found->generation), 8);
          span.tiers.push_back(static_cast<char>(found->tier));
          ++span.held;
        }
      }
    }
    return length;
  }

  bool is_ancestor_or_self(int64_t ancestor, int64_t node) const {
    for (std::size_t steps = 0; node != kNone; ++steps) {
      need(node);
      if (node == ancestor) return true;
      if (steps > c_.capacity) throw std::logic_error("the parent links loop");
      node = c_.parent[node];
    }
    return false;
  }

  std::size_t nbytes() const {
    std::size_t bytes = free_.capacity() * sizeof(int32_t) + keys_scratch_.capacity() * 8;
    for (const auto& [node, held] : extra_) bytes += 64 + held.capacity() * sizeof(Holding);
    for (const auto& waiting : notices_) bytes += 40 + waiting.capacity() * sizeof(Notice);
    return bytes;
  }

 private:
  void need(int64_t node) const {
    if (node < 0 || static_cast<std::size_t>(node) >= allocated_)
      throw std::out_of_range("a node id outside the nodes handed out");
  }

  void check_tier(int tier) const {
    if (tier < 0 || tier >= tiers_) throw std::out_of_range("a tier outside TIERS");
  }


  // A notice for every holder of `node` but `slot` (whatever its tier).
  void superseded(int64_t node, int slot) {
    int inline_holders = 0;
    for (int column = 0; column < kInline; ++column) {
      std::size_t at = static_cast<std::size_t>(node) * kInline + column;
      int16_t holder = c_.slot[at];
      if (holder == -1) continue;
      ++inline_holders;
      if (holder != slot) notify(holder, c_.page[at], c_.generation[at]);
    }
    if (c_.count[node] <= inline_holders) return;  // none beside the columns
    auto found = extra_.find(static_cast<int32_t>(node));
    if (found != extra_.end())
      for (const Holding& holding : found->second)
        if (holding.slot != slot) notify(holding.slot, holding.page, holding.generation);
  }

  void notify(int16_t slot, int32_t page, int64_t generation) {
    if (static_cast<std::size_t>(slot) >= notices_.size()) notices_.resize(slot + 1);
    if (notice_limit_ == 0) {
      ++notices_overflowed_;
      return;
    }
    if (!notices_[static_cast<std::size_t>(slot)].push(Notice{page, generation}, notice_limit_))
      ++notices_overflowed_;
    ++notices_issued_;
  }

  int64_t allocate() {
    if (!free_.empty()) {
      int64_t node = free_.back();
      free_.pop_back();
      return node;
    }
    if (allocated_ == c_.capacity) throw std::length_error("no room for another node");
    return static_cast<int64_t>(allocated_++);
  }

  int64_t new_node(int64_t parent, int64_t key, const char* tokens) {
    int64_t node = allocate();
    std::memcpy(c_.tokens + node * static_cast<int64_t>(c_.page_bytes), tokens, c_.page_bytes);
    table_.insert(key, static_cast<int32_t>(node));
    c_.key[node] = key;
    int32_t depth = c_.depth[node] = c_.depth[parent] + 1;
    max_depth_ = std::max(max_depth_, static_cast<std::size_t>(depth));
    c_.parent[node] = static_cast<int32_t>(parent);
    c_.chained[node] = parent == node - 1;
    int32_t first = c_.first_child[parent];
    c_.next_sibling[node] = first;
    c_.prev_sibling[node] = -1;
    if (first != kNone) c_.prev_sibling[first] = static_cast<int32_t>(node);
    c_.first_child[parent] = static_cast<int32_t>(node);
    ++num_pages_;
    return node;
  }

  // Unlink an empty, childless page node from its parent and free it.
  void release_node(int64_t node) {
    int64_t parent = c_.parent[node];
    int32_t prev = c_.prev_sibling[node], following = c_.next_sibling[node];
    if (prev != kNone)
      c_.next_sibling[prev] = following;
    else
      c_.first_child[parent] = following;
    if (following != kNone) c_.prev_sibling[following] = prev;
    if (!table_.remove(c_.key[node], static_cast<int32_t>(node)))
      throw std::logic_error("a node was missing from the key table");
    --num_pages_;
    reset(node);
  }

  void reset(int64_t node) {
    c_.parent[node] = kNone;
    c_.next_sibling[node] = c_.prev_sibling[node] = -1;
    c_.key[node] = 0;
    c_.chained[node] = 0;
    free_.push_back(static_cast<int32_t>(node));
  }

  // Remove `node`, then its ancestors, while they have no holders and no children; a
  // root left empty is noted for the caller (it owns the namespace maps).
  void prune(int64_t node) {
    while (c_.count[node] == 0 && c_.first_child[node] == kNone) {
      int64_t parent = c_.parent[node];
      if (parent == kNone) {
        emptied_roots_.push_back(node);
        return;
      }
      need(parent);
      release_node(node);
      node = parent;
    }
  }

  // Record the worker's holding of `node` as `page` in `tier`; `parent_column` is its
  // column on the parent (kNoColumn for a first page or a node it holds already): its
  // column here too, and free here (see holders.py). Returns the column.
  int hold(PageMap& map, int slot, int64_t node, int64_t page, int64_t generation, int tier,
           int parent_column, Tally& tally) {
    int column = column_of(node, slot);
    bool had = false;
    int64_t old_page = 0;
    int old_tier = 0;
    if (column == kNoColumn) {
      ++c_.count[node];
      column = parent_column;
      if (column == kNoColumn) {  // a first page: any free column will do
        column = kExtra;
        for (int c = 0; c < kInline; ++c)
          if (c_.slot[node * kInline + c] == -1) {
            column = c;
            break;
          }
      }
    } else {
      if (parent_column != kNoColumn && parent_column != column)
        throw std::logic_error("a worker's holding changed columns along its path");
      had = true;
    }
    if (column < kExtra) {
      std::size_t at = static_cast<std::size_t>(node) * kInline + column;
      if (had) {
        old_page = c_.page[at];
        old_tier = c_.tier[at];
      } else if (c_.slot[at] != -1) {
        throw std::logic_error("a holder column taken by another worker");
      }
      c_.slot[at] = static_cast<int16_t>(slot);
      c_.page[at] = static_cast<int32_t>(page);
      c_.generation[at] = generation;
      c_.tier[at] = static_cast<uint8_t>(tier);
    } else {
      auto& held = extra_[static_cast<int32_t>(node)];
      Holding now{static_cast<int16_t>(slot), static_cast<int32_t>(page), generation,
                  static_cast<uint8_t>(tier)};
      auto same = std::find_if(held.begin(), held.end(),
                               [slot](const Holding& h) { return h.slot == slot; });
      if (same != held.end()) {
        had = true;
        old_page = same->page;
        old_tier = same->tier;
        *same = now;
      } else {
        held.push_back(now);
      }
    }
    if (had) {
      check_tier(old_tier);
      --tally.tier_delta[old_tier];
      if (old_page != page) map.pop(old_page);  // held under a new id now: newest wins
    }
    ++tally.tier_delta[tier];
    map.set(page, node);
    return column;
  }

  // Take the worker's holding off `node`; `removed` (may be null) counts it by tier.
  void release(PageMap& map, int slot, int64_t node, int64_t* removed, Tally& tally) {
    int column = column_of(node, slot);
    if (column == kNoColumn)
      throw std::logic_error("a worker's page map names a node it does not hold");
    --c_.count[node];
    int64_t page;
    int tier;
    if (column < kExtra) {
      std::size_t at = static_cast<std::size_t>(node) * kInline + column;
      c_.slot[at] = -1;
      page = c_.page[at];
      tier = c_.tier[at];
    } else {
      auto found = extra_.find(static_cast<int32_t>(node));
      auto& held = found->second;
      auto same = std::find_if(held.begin(), held.end(),
                               [slot](const Holding& h) { return h.slot == slot; });
      page = same->page;
      tier = same->tier;
      held.erase(same);
      if (held.empty()) extra_.erase(found);
    }
    if (map.pop(page) != node) throw std::logic_error("a worker's page map names another node");
    check_tier(tier);
    --tally.tier_delta[tier];
    if (removed != nullptr) ++removed[tier];
  }

  KeyTable& table_;
  ChainKeys& keys_;
  int tiers_;
  TrieColumns c_{};
  NodeColumns view_{};
  Walker walker_;
  std::size_t allocated_ = 0;
  std::size_t num_pages_ = 0;
  std::size_t max_depth_ = 0;
  std::vector<int32_t> free_;
  std::unordered_map<int32_t, std::vector<Holding>> extra_;
  std::vector<NoticeRing> notices_;  // by worker slot (see take_notices)
  std::size_t notice_limit_ = 4096;
  int64_t notices_issued_ = 0;
  int64_t notices_overflowed_ = 0;
  std::vector<int64_t> emptied_roots_;
  std::vector<int64_t> keys_scratch_, held_, stack_;
};

}  // namespace kvmesh
