// The key table: prefix key -> node id, a multimap in two flat arrays.
//
// Open addressing with linear probing; a key's home slot is its top `bits` bits. Keys
// are odd (see keys.py), so 0 marks an empty slot. Equal keys may repeat (two prefixes
// whose keys collide): lookups give candidates, and the caller compares tokens and
// parents exactly. Probing never wraps around: the arrays run on past the last home
// slot, and the last slot is always empty, so every probe ends at an empty slot.
// Deletion shifts later entries of the run back (no tombstones). 12 bytes a slot, at a
// load between 1/8 and 1/2.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvmesh {

class KeyTable {
 public:
  static constexpr int kMinBits = 10;
  static constexpr std::size_t kPad = 64;  // slots past the last home slot

  KeyTable() { place(kMinBits, {}, {}); }

  std::size_t size() const { return size_; }
  std::size_t slots() const { return keys_.size(); }
  int bits() const { return bits_; }

  void insert(int64_t key, int32_t node) {
    if (key == 0 || !(key & 1)) throw std::invalid_argument("a key table key must be odd");
    if (2 * (size_ + 1) > (std::size_t{1} << bits_)) place_all(bits_ + 1);
    std::size_t slot = home(key);
    while (keys_[slot]) ++slot;
    if (slot == keys_.size() - 1) {  // keep the last slot empty: lay the table out afresh
      place_all(bits_);
      insert(key, node);
      return;
    }
    keys_[slot] = key;
    nodes_[slot] = node;
    ++size_;
  }

  // Whether (key, node) was there (and is gone now).
  bool remove(int64_t key, int32_t node) {
    if (key == 0 || !(key & 1)) return false;
    std::size_t slot = home(key);
    while (keys_[slot] != key || nodes_[slot] != node) {
      if (!keys_[slot]) return false;
      ++slot;
    }
    std::size_t hole = slot;
    for (++slot; keys_[slot]; ++slot) {
      if (home(keys_[slot]) <= hole) {
        keys_[hole] = keys_[slot];
        nodes_[hole] = nodes_[slot];
        hole = slot;
      }
    }
    keys_[hole] = 0;
    --size_;
    if (bits_ > kMinBits && 8 * size_ < (std::size_t{1} << bits_)) place_all(bits_ - 1);
    return true;
  }

  // The nodes stored under `key`, in probe order, appended to `out`.
  void candidates(int64_t key, std::vector<int32_t>& out) const {
    if (key == 0) return;
    for (std::size_t slot = home(key); keys_[slot]; ++slot)
      if (keys_[slot] == key) out.push_back(nodes_[slot]);
  }

  // For the longest leading run of `keys` present, each one's first node, into `out`.
  std::size_t find_run(const int64_t* keys, std::size_t count, int64_t* out) const {
    std::size_t run = 0;
    for (; run < count; ++run) {
      int64_t key = keys[run];
      if (key == 0) break;
      std::size_t slot = home(key);
      while (keys_[slot] && keys_[slot] != key) ++slot;
      if (!keys_[slot]) break;
      out[run] = nodes_[slot];
    }
    return run;
  }

  // Check the layout; the occupied slots' (key, node) pairs into the two vectors.
  // Returns "" or what is wrong.
  std::string check(std::vector<int64_t>& keys, std::vector<int32_t>& nodes) const {
    if (keys_.size() < (std::size_t{1} << bits_) + kPad) return "the key table lost its padding";
    if (keys_.back() != 0) return "the key table's last slot is occupied";
    std::size_t last_empty = 0;  // the last empty slot seen (slot 0 counts as a gap start)
    bool seen_empty = false;
    for (std::size_t slot = 0; slot < keys_.size(); ++slot) {
      int64_t key = keys_[slot];
      if (!key) {
        last_empty = slot;
        seen_empty = true;
        continue;
      }
      if (!(key & 1)) return "an even key at slot " + std::to_string(slot);
      std::size_t h = home(key);
      if (h > slot) return "a key sits before its home slot at " + std::to_string(slot);
      if (seen_empty && last_empty >= h) return "a probe run has a gap before slot " + std::to_string(slot);
      keys.push_back(key);
      nodes.push_back(nodes_[slot]);
    }
    if (keys.size() != size_)
      return std::to_string(keys.size()) + " keys stored, size " + std::to_string(size_);
    return "";
  }

 private:
  std::size_t home(int64_t key) const {
    return static_cast<std::size_t>(static_cast<uint64_t>(key) >> (64 - bits_));
  }

  void place_all(int bits) {
    std::vector<int64_t> keys;
    std::vector<int32_t> nodes;
    keys.reserve(size_);
    nodes.reserve(size_);
    for (std::size_t slot = 0; slot < keys_.size(); ++slot) {
      if (keys_[slot]) {
        keys.push_back(keys_[slot]);
        nodes.push_back(nodes_[slot]);
      }
    }
    place(bits, keys, nodes);
  }

  // Lay the entries out afresh in a table of 2**bits home slots, in order of home slot:
  // each lands at max(its home, the slot after the previous one).
  void place(int bits, const std::vector<int64_t>& keys, const std::vector<int32_t>& nodes) {
    bits_ = bits;
    std::vector<std::size_t> order(keys.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return home(keys[a]) < home(keys[b]); });
    std::size_t next = 0;
    std::vector<std::size_t> slot_of(keys.size());
    for (std::size_t i : order) {
      next = std::max(next, home(keys[i]));
      slot_of[i] = next++;
    }
    std::size_t length = std::max(std::size_t{1} << bits, next) + kPad;
    keys_.assign(length, 0);
    nodes_.assign(length, 0);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      keys_[slot_of[i]] = keys[i];
      nodes_[slot_of[i]] = nodes[i];
    }
    size_ = keys.size();
  }

  std::vector<int64_t> keys_;
  std::vector<int32_t> nodes_;
  std::size_t size_ = 0;
  int bits_ = kMinBits;
};

}  // namespace kvmesh
