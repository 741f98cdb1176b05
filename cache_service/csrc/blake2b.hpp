// BLAKE2b (RFC 7693), unkeyed, with a digest length and a personalisation: the hash of
// the page digests (workers/store/digests.py), computed here a chain at a time.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvmesh {

class Blake2b {
 public:
  static constexpr std::size_t kBlock = 128;

  // A hasher of `digest_bytes` (1..64) digests, personalised with `person` (up to 16
  // bytes, zero-padded).
  Blake2b(std::size_t digest_bytes, const unsigned char* person, std::size_t person_bytes)
      : out_(digest_bytes) {
    for (int i = 0; i < 8; ++i) h_[i] = kIv[i];
    h_[0] ^= 0x01010000u ^ static_cast<uint64_t>(digest_bytes);  // fanout 1, depth 1, no key
    unsigned char padded[16] = {};
    std::memcpy(padded, person, person_bytes < 16 ? person_bytes : 16);
    h_[6] ^= load64(padded);
    h_[7] ^= load64(padded + 8);
  }

  void update(const unsigned char* data, std::size_t bytes) {
    while (bytes > 0) {
      if (fill_ == kBlock) {  // a full buffer is compressed only once more data follows
        count(kBlock);
        compress(buffer_, false);
        fill_ = 0;
      }
      std::size_t take = kBlock - fill_ < bytes ? kBlock - fill_ : bytes;
      std::memcpy(buffer_ + fill_, data, take);
      fill_ += take;
      data += take;
      bytes -= take;
    }
  }

  void final(unsigned char* out) {
    count(fill_);
    std::memset(buffer_ + fill_, 0, kBlock - fill_);
    compress(buffer_, true);
    unsigned char full[64];
    for (int i = 0; i < 8; ++i) store64(full + 8 * i, h_[i]);
    std::memcpy(out, full, out_);
  }

 private:
  static constexpr uint64_t kIv[8] = {
      0x6a09e667f3bcc908ull, 0xbb67ae8584caa73bull, 0x3c6ef372fe94f82bull,
      0xa54ff53a5f1d36f1ull, 0x510e527fade682d1ull, 0x9b05688c2b3e6c1full,
      0x1f83d9abfb41bd6bull, 0x5be0cd19137e2179ull};
  static constexpr uint8_t kSigma[12][16] = {
      {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
      {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
      {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
      {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
      {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
      {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
      {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
      {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
      {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
      {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
      {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
      {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

  static uint64_t load64(const unsigned char* p) {  // little-endian (the module checks)
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
  }
  static void store64(unsigned char* p, uint64_t v) { std::memcpy(p, &v, 8); }
  static uint64_t rotr(uint64_t v, int n) { return (v >> n) | (v << (64 - n)); }

  void count(std::size_t bytes) {
    t_[0] += bytes;
    if (t_[0] < bytes) ++t_[1];
  }

  void compress(const unsigned char* block, bool last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; ++i) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; ++i) {
      v[i] = h_[i];
      v[i + 8] = kIv[i];
    }
    v[12] ^= t_[0];
    v[13] ^= t_[1];
    if (last) v[14] = ~v[14];
#pragma GCC unroll 12
    for (int round = 0; round < 12; ++round) {
      const uint8_t* s = kSigma[round];
      mix(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
      mix(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
      mix(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
      mix(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
      mix(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
      mix(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
      mix(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
      mix(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; ++i) h_[i] ^= v[i] ^ v[i + 8];
  }

  static void mix(uint64_t* v, int a, int b, int c, int d, uint64_t x, uint64_t y) {
    v[a] = v[a] + v[b] + x;
    v[d] = rotr(v[d] ^ v[a], 32);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 24);
    v[a] = v[a] + v[b] + y;
    v[d] = rotr(v[d] ^ v[a], 16);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 63);
  }

  uint64_t h_[8];
  uint64_t t_[2] = {0, 0};
  unsigned char buffer_[kBlock] = {};
  std::size_t fill_ = 0;
  std::size_t out_;
};

}  // namespace kvmesh
