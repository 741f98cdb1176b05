// Chained prefix keys: one 64-bit key per page, naming its whole prefix (see keys.py).
//
//   key(page i) = parent key + sum of coefficient[t] * token[t] over the page's token
//   positions t (mod 2**64)
//
// Coefficients are secret, even, and one per token position, drawn from a splitmix64
// stream of the index's secret and grown on demand; with odd root keys every key is odd.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace kvmesh {

class ChainKeys {
 public:
  // The most token positions a key reaches: a prompt past it is refused, so no request
  // can make the coefficients grow without bound.
  static constexpr std::size_t kMaxPositions = std::size_t{1} << 26;

  // collide: every coefficient zero, so every page of a namespace has its root's key (for
  // tests of the exact comparisons behind the keys).
  ChainKeys(std::size_t page_tokens, uint64_t secret, bool collide = false)
      : page_tokens_(page_tokens), secret_(secret), collide_(collide) {
    if (page_tokens == 0) throw std::invalid_argument("page_tokens must be positive");
  }

  std::size_t page_tokens() const { return page_tokens_; }
  std::size_t nbytes() const { return coefficients_.capacity() * sizeof(uint64_t); }

  // The keys of the full pages of `data` (little-endian int32 tokens), hung below a node
  // of key `start` at page depth `depth`, into `out` (one per full page); their count.
  std::size_t chain(int64_t start, std::size_t depth, const char* data, std::size_t bytes,
                    int64_t* out) {
    std::size_t pages = bytes / (4 * page_tokens_);
    const uint64_t* coefficient = grow(depth * page_tokens_, pages * page_tokens_);
    uint64_t key = static_cast<uint64_t>(start);
    for (std::size_t page = 0; page < pages; ++page) {
      key += page_sum(data + page * 4 * page_tokens_, coefficient + page * page_tokens_);
      out[page] = static_cast<int64_t>(key);
    }
    return pages;
  }

  // The key of page `depth` of `data` as a child of a node of key `parent_key`.
  int64_t page(int64_t parent_key, std::size_t depth, const char* data, std::size_t bytes) {
    std::size_t size = 4 * page_tokens_;
    if (bytes / size <= depth) throw std::out_of_range("no such page in the prompt");
    const uint64_t* coefficient = grow(depth * page_tokens_, page_tokens_);
    return static_cast<int64_t>(static_cast<uint64_t>(parent_key) +
                                page_sum(data + depth * size, coefficient));
  }

  // The first `count` coefficients (as int64), grown to them.
  const uint64_t* coefficients(std::size_t count) { return grow(0, count); }

 private:
  uint64_t page_sum(const char* page, const uint64_t* coefficient) const {
    uint64_t sum = 0;
    for (std::size_t t = 0; t < page_tokens_; ++t) {
      int32_t token;
      std::memcpy(&token, page + 4 * t, 4);  // little-endian hosts only (checked at import)
      sum += static_cast<uint64_t>(static_cast<int64_t>(token)) * coefficient[t];
    }
    return sum;
  }

  const uint64_t* grow(std::size_t first, std::size_t count) {
    std::size_t need = first + count;
    if (need > kMaxPositions) throw std::length_error("a prompt past the index's longest key");
    if (coefficients_.size() < need) {
      std::size_t size = std::max(need, std::max<std::size_t>(2 * coefficients_.size(), 4096));
      size = std::min(size, kMaxPositions);
      std::size_t from = coefficients_.size();
      coefficients_.resize(size);
      for (std::size_t i = from; i < size; ++i) coefficients_[i] = collide_ ? 0 : draw(i);
    }
    return coefficients_.data() + first;
  }

  // Position i's coefficient: splitmix64 of the secret's stream at i, made even.
  uint64_t draw(std::size_t i) const {
    uint64_t z = secret_ + (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return (z ^ (z >> 31)) & ~uint64_t{1};
  }

  std::size_t page_tokens_;
  uint64_t secret_;
  bool collide_;
  std::vector<uint64_t> coefficients_;
};

}  // namespace kvmesh
