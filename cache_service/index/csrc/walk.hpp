// The match walk over the trie's node columns (see walk.py for the shape of a path).
//
// Pages published in one chain have consecutive node ids, so the walk goes by runs: find
// the node of the next page through its key (checking its parent and tokens), then take
// as many of the following node ids as continue the chain (the `chained` flag) and hold
// the prompt's next pages. A path of more than `max_runs` runs is finished with every
// remaining page's key at once, checked as a whole, or page by page when that check
// fails (a collision). Every node id read from a column or the key table is checked
// against the columns' length before use.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "chain_keys.hpp"
#include "key_table.hpp"

namespace kvmesh {

constexpr int64_t kNone = -1;

// Read-only views of the node columns (owned elsewhere), `capacity` nodes each.
struct NodeColumns {
  const char* tokens;        // capacity x page_bytes: each node's page of int32 tokens
  const int32_t* parent;     // kNone for a root
  const int32_t* first_child;
  const uint8_t* chained;    // 1: the node's parent is node id - 1
  const int64_t* key;
  std::size_t capacity;
  std::size_t page_bytes;

  bool valid(int64_t node) const { return node >= 0 && static_cast<std::size_t>(node) < capacity; }
  const char* page(int64_t node) const { return tokens + static_cast<std::size_t>(node) * page_bytes; }
};

struct Path {
  std::size_t length = 0;
  std::vector<std::pair<int64_t, std::size_t>> runs;  // (first node, pages); or:
  std::vector<int64_t> nodes;                         // every node, when `listed`
  bool listed = false;
};

class Walker {
 public:
  Walker(const NodeColumns& columns, KeyTable& table, ChainKeys& keys)
      : c_(columns), table_(table), keys_(keys) {}

  // The child of `parent` holding exactly `tokens` (one page), found through `key`.
  int64_t child(int64_t parent, int64_t key, const char* tokens) {
    if (!c_.valid(parent) || c_.first_child[parent] == kNone) return kNone;
    found_.clear();
    table_.candidates(key, found_);
    for (int32_t node : found_) {
      if (c_.valid(node) && c_.parent[node] == parent &&
          std::memcmp(c_.page(node), tokens, c_.page_bytes) == 0)
        return node;
    }
    return kNone;
  }

  // The path of packed prompt `data` below `root` (kNone: no root).
  Path walk(int64_t root, const char* data, std::size_t bytes, std::size_t max_runs,
            std::size_t allocated, std::size_t max_depth) {
    Path path;
    std::size_t pages = std::min(bytes / c_.page_bytes, max_depth);
    allocated = std::min(allocated, c_.capacity);
    if (!c_.valid(root) || pages == 0) return path;
    int64_t parent = root;
    std::size_t done = 0;
    while (done < pages && c_.first_child[parent] != kNone) {
      if (path.runs.size() == max_runs) {
        for (auto [first, length] : path.runs)
          for (std::size_t i = 0; i < length; ++i) path.nodes.push_back(first + static_cast<int64_t>(i));
        lookup(parent, done, pages, data, path.nodes);
        path.runs.clear();
        path.listed = true;
        path.length = path.nodes.size();
        return path;
      }
      int64_t node = child(parent, keys_.page(c_.key[parent], done, data, bytes),
                           data + done * c_.page_bytes);
      if (node == kNone) break;
      std::size_t length = run_length(node, done, pages, data, allocated);
      path.runs.emplace_back(node, length);
      done += length;
      parent = node + static_cast<int64_t>(length) - 1;
    }
    path.length = done;
    return path;
  }

 private:
  // How many consecutive node ids from `node` (which holds prompt page `depth`) continue
  // its chain and hold the prompt's following pages.
  std::size_t run_length(int64_t node, std::size_t depth, std::size_t pages, const char* data,
                         std::size_t allocated) const {
    std::size_t first = static_cast<std::size_t>(node);
    std::size_t most = std::min(pages - depth, allocated > first ? allocated - first : 1);
    std::size_t length = 1;
    while (length < most && c_.chained[first + length] &&
           std::memcmp(c_.page(node + static_cast<int64_t>(length)),
                       data + (depth + length) * c_.page_bytes, c_.page_bytes) == 0)
      ++length;
    return length;
  }

  // The nodes of prompt pages depth .. pages - 1 below `parent`, appended to `out`: all
  // keys at once, the key table's first candidate of each, one check of them all; page
  // by page (every candidate) when that check fails.
  void lookup(int64_t parent, std::size_t depth, std::size_t pages, const char* data,
              std::vector<int64_t>& out) {
    std::size_t size = c_.page_bytes;
    const char* rest = data + depth * size;
    std::size_t count = pages - depth;
    std::vector<int64_t> keys(count), found(count);
    keys_.chain(c_.key[parent], depth, rest, count * size, keys.data());
    std::size_t run = table_.find_run(keys.data(), count, found.data());
    bool exact = true;
    int64_t above = parent;
    for (std::size_t i = 0; i < run && exact; ++i) {
      int64_t node = found[i];
      exact = c_.valid(node) && c_.parent[node] == above &&
              std::memcmp(c_.page(node), rest + i * size, size) == 0;
      above = node;
    }
    if (exact) {
      out.insert(out.end(), found.begin(), found.begin() + static_cast<std::ptrdiff_t>(run));
      return;
    }
    for (std::size_t i = 0; i < count; ++i) {
      parent = child(parent, keys[i], rest + i * size);
      if (parent == kNone) return;
      out.push_back(parent);
    }
  }

  const NodeColumns& c_;
  KeyTable& table_;
  ChainKeys& keys_;
  std::vector<int32_t> found_;
};

}  // namespace kvmesh
