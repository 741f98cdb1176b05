// A walk over one msgpack object that builds nothing: is the frame whole, does it end where
// the object ends, how deep does it nest, and how many lists and maps would decoding build.
// cache_service/protocol/frames.py asks it before decoding any frame that is not a short
// hot message, so that a frame of a million tiny nested lists is refused at the speed of
// reading its first headers instead of after msgpack has built (and Python has counted)
// thousands of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvmesh {

enum class ScanStatus : int {
  ok = 0,
  too_many_containers = 1,  // more lists and maps than the budget
  truncated = 2,            // the frame ends inside the object
  trailing = 3,             // bytes after the object
  too_deep = 4,             // nested deeper than the depth limit
  ext = 5,                  // an ext type (no part of the protocol)
  malformed = 6,            // the never-used tag 0xc1
};

struct ScanResult {
  ScanStatus status;
  std::size_t offset;  // where the walk stopped: the object's end when ok or trailing
};

// Walks the msgpack object at `data`. Every length is checked against what is left before
// it is used; a container announcing more items than bytes are left is truncated at once.
inline ScanResult scan_msgpack(const unsigned char* data, std::size_t size,
                               std::size_t max_containers, std::size_t max_depth) {
  const unsigned char* p = data;
  const unsigned char* const end = data + size;
  auto stop = [&](ScanStatus status) { return ScanResult{status, static_cast<std::size_t>(p - data)}; };
  auto big_endian = [&](std::size_t at, std::size_t bytes) {
    std::size_t v = 0;
    for (std::size_t i = 0; i < bytes; ++i) v = (v << 8) | p[at + i];
    return v;
  };
  // Items still to read in each open container; the root is one item to read.
  std::vector<std::size_t> open{1};
  std::size_t containers = 0;
  while (!open.empty()) {
    if (open.back() == 0) {
      open.pop_back();
      continue;
    }
    --open.back();
    std::size_t left = static_cast<std::size_t>(end - p);
    if (left < 1) return stop(ScanStatus::truncated);
    unsigned char tag = *p;
    std::size_t skip = 0;       // bytes of this object when it is a scalar
    std::size_t items = 0;      // items of this object when it is a container
    bool container = false;
    if (tag <= 0x7f || tag >= 0xe0 || tag == 0xc0 || tag == 0xc2 || tag == 0xc3) {
      skip = 1;
    } else if (tag <= 0x8f) {
      container = true, items = 2 * static_cast<std::size_t>(tag & 0x0f), skip = 1;
    } else if (tag <= 0x9f) {
      container = true, items = tag & 0x0f, skip = 1;
    } else if (tag <= 0xbf) {
      skip = 1 + static_cast<std::size_t>(tag & 0x1f);
    } else if (tag == 0xc1) {
      return stop(ScanStatus::malformed);
    } else if ((tag >= 0xc7 && tag <= 0xc9) || (tag >= 0xd4 && tag <= 0xd8)) {
      return stop(ScanStatus::ext);
    } else if (tag == 0xc4 || tag == 0xd9 || tag == 0xc5 || tag == 0xda || tag == 0xc6 ||
               tag == 0xdb) {
      std::size_t bytes = (tag == 0xc4 || tag == 0xd9) ? 1 : (tag == 0xc5 || tag == 0xda) ? 2 : 4;
      if (left < 1 + bytes) return stop(ScanStatus::truncated);
      skip = 1 + bytes + big_endian(1, bytes);
    } else if (tag == 0xca) {
      skip = 5;
    } else if (tag == 0xcb) {
      skip = 9;
    } else if (tag >= 0xcc && tag <= 0xd3) {
      skip = 1 + (std::size_t{1} << ((tag - 0xcc) & 3));
    } else {  // 0xdc..0xdf: array16, array32, map16, map32
      std::size_t bytes = (tag == 0xdc || tag == 0xde) ? 2 : 4;
      if (left < 1 + bytes) return stop(ScanStatus::truncated);
      container = true, skip = 1 + bytes;
      items = big_endian(1, bytes) * (tag >= 0xde ? 2 : 1);
    }
    if (left < skip) return stop(ScanStatus::truncated);
    p += skip;
    if (!container) continue;
    if (++containers > max_containers) return stop(ScanStatus::too_many_containers);
    if (items == 0) continue;
    if (items > static_cast<std::size_t>(end - p)) return stop(ScanStatus::truncated);
    if (open.size() > max_depth) return stop(ScanStatus::too_deep);
    open.push_back(items);
  }
  return stop(p == end ? ScanStatus::ok : ScanStatus::trailing);
}

}  // namespace kvmesh
