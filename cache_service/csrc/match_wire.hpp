// The MATCH request and its reply on the wire, read and written without building the
// msgpack objects in between (cache_service/protocol/codec.py keeps the general path;
// this is the one-per-lookup one).
//
// A reader over untrusted bytes: every length is checked against what is left before it
// is used, and anything but the exact shape of a well-formed MATCH request (another type,
// a missing or repeated key, a value of another msgpack type or past a limit, trailing
// bytes) makes it give up: the caller then decodes the frame the general way, which
// names what is wrong.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace kvmesh {

class MsgpackReader {
 public:
  MsgpackReader(const unsigned char* data, std::size_t size) : p_(data), end_(data + size) {}

  bool done() const { return p_ == end_; }

  // A map header: its entry count.
  bool map(std::size_t* count) { return header(0x80, 0xde, 0xdf, count); }

  // An array header: its item count.
  bool array(std::size_t* count) { return header(0x90, 0xdc, 0xdd, count); }

  // A str: its bytes (valid while the frame lives).
  bool str(std::string_view* out) {
    if (left() < 1) return false;
    unsigned char tag = *p_;
    std::size_t size;
    if ((tag & 0xe0) == 0xa0) {
      ++p_;
      size = tag & 0x1f;
    } else if (tag == 0xd9) {
      if (!length(1, 1, &size)) return false;
    } else if (tag == 0xda) {
      if (!length(1, 2, &size)) return false;
    } else if (tag == 0xdb) {
      if (!length(1, 4, &size)) return false;
    } else {
      return false;
    }
    return take(size, out);
  }

  bool bin(std::string_view* out) {
    if (left() < 1) return false;
    unsigned char tag = *p_;
    std::size_t size;
    if (tag == 0xc4) {
      if (!length(1, 1, &size)) return false;
    } else if (tag == 0xc5) {
      if (!length(1, 2, &size)) return false;
    } else if (tag == 0xc6) {
      if (!length(1, 4, &size)) return false;
    } else {
      return false;
    }
    return take(size, out);
  }

  bool nil() {
    if (left() < 1 || *p_ != 0xc0) return false;
    ++p_;
    return true;
  }

  bool is_nil() const { return left() >= 1 && *p_ == 0xc0; }

  // A non-negative int that fits int64.
  bool uint(uint64_t* out) {
    if (left() < 1) return false;
    unsigned char tag = *p_;
    if (tag <= 0x7f) {
      ++p_;
      *out = tag;
      return true;
    }
    std::size_t bytes = tag == 0xcc ? 1 : tag == 0xcd ? 2 : tag == 0xce ? 4 : tag == 0xcf ? 8 : 0;
    if (bytes == 0 || left() < 1 + bytes) return false;
    uint64_t v = 0;
    for (std::size_t i = 1; i <= bytes; ++i) v = (v << 8) | p_[i];
    if (v > static_cast<uint64_t>(INT64_MAX)) return false;
    p_ += 1 + bytes;
    *out = v;
    return true;
  }

 private:
  std::size_t left() const { return static_cast<std::size_t>(end_ - p_); }

  // A container header: a fix form (`fix` in the high nibble, the count in the low one),
  // or a 16- or 32-bit count after `tag16` / `tag32`.
  bool header(unsigned fix, unsigned tag16, unsigned tag32, std::size_t* count) {
    if (left() < 1) return false;
    unsigned char tag = *p_;
    if ((tag & 0xf0) == fix) {
      ++p_;
      *count = tag & 0x0f;
      return true;
    }
    if (tag == tag16) return length(1, 2, count);
    if (tag == tag32) return length(1, 4, count);
    return false;
  }

  // A tag then a big-endian length of `bytes` bytes.
  bool length(std::size_t tag, std::size_t bytes, std::size_t* out) {
    if (left() < tag + bytes) return false;
    std::size_t v = 0;
    for (std::size_t i = 0; i < bytes; ++i) v = (v << 8) | p_[tag + i];
    p_ += tag + bytes;
    *out = v;
    return true;
  }

  bool take(std::size_t size, std::string_view* out) {
    if (left() < size) return false;
    *out = std::string_view(reinterpret_cast<const char*>(p_), size);
    p_ += size;
    return true;
  }

  const unsigned char* p_;
  const unsigned char* end_;
};

// A MATCH request's fields, as views into the frame.
struct MatchRequest {
  uint64_t request_id = 0;
  std::string_view model, adapter, salt, tokens, requester;
  bool has_requester = false;
};

struct MatchLimits {
  uint64_t version;        // the protocol version this side speaks
  std::size_t str_bytes;   // the longest str msgpack may read (bytes)
  std::size_t token_bytes; // the longest packed prompt
};

// Reads a MATCH request envelope {"v", "t": "match", "id", "b": {"namespace": [model,
// adapter, salt], "tokens": bin, "requester": str | nil}}, keys in any order; false for
// anything else (see the file's comment).
inline bool read_match(const unsigned char* data, std::size_t size, const MatchLimits& limits,
                       MatchRequest* out) {
  MsgpackReader r(data, size);
  std::size_t count;
  if (!r.map(&count) || count != 4) return false;
  unsigned seen = 0;
  for (std::size_t i = 0; i < count; ++i) {
    std::string_view key;
    if (!r.str(&key)) return false;
    if (key == "v") {
      uint64_t version;
      if ((seen & 1) || !r.uint(&version) || version != limits.version) return false;
      seen |= 1;
    } else if (key == "t") {
      std::string_view kind;
      if ((seen & 2) || !r.str(&kind) || kind != "match") return false;
      seen |= 2;
    } else if (key == "id") {
      if ((seen & 4) || !r.uint(&out->request_id) || out->request_id < 1) return false;
      seen |= 4;
    } else if (key == "b") {
      if (seen & 8) return false;
      seen |= 8;
      std::size_t fields;
      if (!r.map(&fields) || fields != 3) return false;
      unsigned got = 0;
      for (std::size_t j = 0; j < fields; ++j) {
        std::string_view name;
        if (!r.str(&name)) return false;
        if (name == "namespace") {
          std::size_t parts;
          if ((got & 1) || !r.array(&parts) || parts != 3 || !r.str(&out->model) ||
              !r.str(&out->adapter) || !r.str(&out->salt))
            return false;
          got |= 1;
        } else if (name == "tokens") {
          if ((got & 2) || !r.bin(&out->tokens) || out->tokens.size() % 4 != 0 ||
              out->tokens.size() > limits.token_bytes)
            return false;
          got |= 2;
        } else if (name == "requester") {
          if (got & 4) return false;
          got |= 4;
          if (r.is_nil()) {
            r.nil();
            out->has_requester = false;
          } else {
            if (!r.str(&out->requester) || out->requester.empty()) return false;
            out->has_requester = true;
          }
        } else {
          return false;
        }
      }
      if (got != 7) return false;
    } else {
      return false;
    }
  }
  if (seen != 15 || !r.done()) return false;
  for (std::string_view text : {out->model, out->adapter, out->salt, out->requester})
    if (text.size() > limits.str_bytes) return false;
  return true;
}

// msgpack, written as msgpack-python's Packer(use_bin_type=True) writes it.
class MsgpackWriter {
 public:
  std::string out;

  void map(std::size_t n) { header(n, 0x80, 16, 0xde, 0xdf); }
  void array(std::size_t n) { header(n, 0x90, 16, 0xdc, 0xdd); }

  void str(std::string_view s) {
    std::size_t n = s.size();
    if (n < 32) {
      out.push_back(static_cast<char>(0xa0 | n));
    } else if (n < 256) {
      out.push_back(static_cast<char>(0xd9));
      big(n, 1);
    } else if (n < 65536) {
      out.push_back(static_cast<char>(0xda));
      big(n, 2);
    } else {
      out.push_back(static_cast<char>(0xdb));
      big(n, 4);
    }
    out.append(s);
  }

  void bin(std::string_view s) {
    std::size_t n = s.size();
    if (n < 256) {
      out.push_back(static_cast<char>(0xc4));
      big(n, 1);
    } else if (n < 65536) {
      out.push_back(static_cast<char>(0xc5));
      big(n, 2);
    } else {
      out.push_back(static_cast<char>(0xc6));
      big(n, 4);
    }
    out.append(s);
  }

  // A non-negative int.
  void uint(uint64_t v) {
    if (v < 128) {
      out.push_back(static_cast<char>(v));
    } else if (v < 256) {
      out.push_back(static_cast<char>(0xcc));
      big(v, 1);
    } else if (v < 65536) {
      out.push_back(static_cast<char>(0xcd));
      big(v, 2);
    } else if (v <= 0xffffffffu) {
      out.push_back(static_cast<char>(0xce));
      big(v, 4);
    } else {
      out.push_back(static_cast<char>(0xcf));
      big(v, 8);
    }
  }

 private:
  void header(std::size_t n, unsigned fix, std::size_t fix_max, unsigned tag16, unsigned tag32) {
    if (n < fix_max) {
      out.push_back(static_cast<char>(fix | n));
    } else if (n < 65536) {
      out.push_back(static_cast<char>(tag16));
      big(n, 2);
    } else {
      out.push_back(static_cast<char>(tag32));
      big(n, 4);
    }
  }

  void big(uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; --i) out.push_back(static_cast<char>(v >> (8 * i)));
  }
};

}  // namespace kvmesh
