// cache_service._native: the compiled parts both sides of the mesh use on every request:
// packing token ids (cache_service/tokens.py), the chain of page digests
// (workers/store/digests.py), and a MATCH request and its reply on the wire
// (cache_service/protocol/codec.py). CPython's C API only, as the index's module.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "blake2b.hpp"
#include "match_wire.hpp"
#include "msgpack_scan.hpp"

namespace {

// A Python int's value when it is small (one digit: below 2**30 in magnitude), read from
// the object itself as the C API's own fast paths do; false for any other int.
inline bool small_int(PyObject* item, long* value) {
#if PY_VERSION_HEX >= 0x030C0000
  if (!PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject*>(item))) return false;
  *value = static_cast<long>(PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject*>(item)));
  return true;
#else
  Py_ssize_t size = Py_SIZE(item);
  if (size < -1 || size > 1) return false;
  *value = static_cast<long>(size) * static_cast<long>(reinterpret_cast<PyLongObject*>(item)->ob_digit[0]);
  return true;
#endif
}

// The ids of a list or tuple as little-endian int32 into `raw`; false when one is not an
// exact int in int32 (out of range, a bool, an int subclass, a numpy scalar).
bool pack_exact(PyObject** items, Py_ssize_t count, unsigned char* raw) {
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = items[i];
    if (!PyLong_CheckExact(item)) return false;
    int overflow = 0;
    long value = 0;
    if (!small_int(item, &value)) value = PyLong_AsLongAndOverflow(item, &overflow);
    if (overflow != 0 || value < INT32_MIN || value > INT32_MAX) return false;
    auto word = static_cast<uint32_t>(static_cast<int32_t>(value));
    raw[4 * i] = static_cast<unsigned char>(word);
    raw[4 * i + 1] = static_cast<unsigned char>(word >> 8);
    raw[4 * i + 2] = static_cast<unsigned char>(word >> 16);
    raw[4 * i + 3] = static_cast<unsigned char>(word >> 24);
  }
  return true;
}

// pack_int32(ids: list | tuple) -> bytes (little-endian int32), or None when an id is not
// an exact int in int32: the caller's general path then packs those or names the bad id.
PyObject* pack_int32(PyObject*, PyObject* ids) {
  if (!PyList_CheckExact(ids) && !PyTuple_CheckExact(ids))
    return PyErr_Format(PyExc_TypeError, "pack_int32 takes a list or a tuple, got %s",
                        Py_TYPE(ids)->tp_name);
  Py_ssize_t count = PySequence_Fast_GET_SIZE(ids);
  PyObject* out = PyBytes_FromStringAndSize(nullptr, count * 4);
  if (out == nullptr) return nullptr;
  if (!pack_exact(PySequence_Fast_ITEMS(ids), count,
                  reinterpret_cast<unsigned char*>(PyBytes_AS_STRING(out)))) {
    Py_DECREF(out);
    Py_RETURN_NONE;
  }
  return out;
}

constexpr std::size_t kDigest = 16;
const unsigned char kPagePerson[] = "kvmesh-page-v1";  // 14 bytes, zero-padded to 16

// Whether a digest is all zeros (what an unpublished page records).
bool all_zero(const unsigned char* digest) {
  for (std::size_t i = 0; i < kDigest; ++i)
    if (digest[i] != 0) return false;
  return true;
}

// One page's digest under `parent` (never all zeros: that means "nothing published").
void page_digest(const unsigned char* parent, const unsigned char* page, std::size_t bytes,
                 unsigned char* out) {
  kvmesh::Blake2b hash(kDigest, kPagePerson, sizeof(kPagePerson) - 1);
  hash.update(parent, kDigest);
  hash.update(page, bytes);
  hash.final(out);
  if (all_zero(out)) out[0] = 1;
}

// A parent digest and a byte buffer, the two first arguments of the digest functions: both
// acquired (the caller releases them), or false with an exception set and neither held.
bool digest_and_bytes(PyObject* const* args, Py_buffer* parent, Py_buffer* data) {
  if (PyObject_GetBuffer(args[0], parent, PyBUF_SIMPLE) != 0) return false;
  if (parent->len != static_cast<Py_ssize_t>(kDigest)) {
    PyErr_Format(PyExc_ValueError, "a digest is %zu bytes, got %zd", kDigest, parent->len);
    PyBuffer_Release(parent);
    return false;
  }
  if (PyObject_GetBuffer(args[1], data, PyBUF_SIMPLE) != 0) {
    PyBuffer_Release(parent);
    return false;
  }
  return true;
}

// chain_digests(parent, packed, page_bytes) -> [digest of each full page of `packed`,
// each under the one before, the first under `parent`].
PyObject* chain_digests(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3)
    return PyErr_Format(PyExc_TypeError,
                        "chain_digests(parent, packed, page_bytes) takes 3 arguments");
  Py_ssize_t page_bytes = PyLong_AsSsize_t(args[2]);
  if (page_bytes == -1 && PyErr_Occurred()) return nullptr;
  if (page_bytes < 1) return PyErr_Format(PyExc_ValueError, "page_bytes must be >= 1");
  Py_buffer parent, packed;
  if (!digest_and_bytes(args, &parent, &packed)) return nullptr;
  Py_ssize_t pages = packed.len / page_bytes;
  PyObject* out = PyList_New(pages);
  unsigned char digest[kDigest];
  std::memcpy(digest, parent.buf, kDigest);
  const auto* data = static_cast<const unsigned char*>(packed.buf);
  for (Py_ssize_t i = 0; out != nullptr && i < pages; ++i) {
    page_digest(digest, data + i * page_bytes, static_cast<std::size_t>(page_bytes), digest);
    PyObject* item = PyBytes_FromStringAndSize(reinterpret_cast<char*>(digest), kDigest);
    if (item == nullptr) {
      Py_CLEAR(out);
      break;
    }
    PyList_SET_ITEM(out, i, item);
  }
  PyBuffer_Release(&parent);
  PyBuffer_Release(&packed);
  return out;
}

// next_digest(parent, page) -> the digest of one page (of any length) under `parent`.
PyObject* next_digest(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) return PyErr_Format(PyExc_TypeError, "next_digest(parent, page) takes 2");
  Py_buffer parent, page;
  if (!digest_and_bytes(args, &parent, &page)) return nullptr;
  unsigned char digest[kDigest];
  page_digest(static_cast<const unsigned char*>(parent.buf),
              static_cast<const unsigned char*>(page.buf), static_cast<std::size_t>(page.len),
              digest);
  PyBuffer_Release(&parent);
  PyBuffer_Release(&page);
  return PyBytes_FromStringAndSize(reinterpret_cast<char*>(digest), kDigest);
}

// blake2b(data, digest_bytes, person) -> bytes: the hash itself, for the tests that hold
// it to hashlib's.
PyObject* blake2b(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) return PyErr_Format(PyExc_TypeError, "blake2b(data, digest_bytes, person)");
  Py_ssize_t size = PyLong_AsSsize_t(args[1]);
  if (size == -1 && PyErr_Occurred()) return nullptr;
  if (size < 1 || size > 64) return PyErr_Format(PyExc_ValueError, "digest_bytes in [1, 64]");
  Py_buffer data, person;
  if (PyObject_GetBuffer(args[0], &data, PyBUF_SIMPLE) != 0) return nullptr;
  if (PyObject_GetBuffer(args[2], &person, PyBUF_SIMPLE) != 0) {
    PyBuffer_Release(&data);
    return nullptr;
  }
  if (person.len > 16) {
    PyBuffer_Release(&data);
    PyBuffer_Release(&person);
    return PyErr_Format(PyExc_ValueError, "a personalisation is at most 16 bytes");
  }
  kvmesh::Blake2b hash(static_cast<std::size_t>(size),
                       static_cast<const unsigned char*>(person.buf),
                       static_cast<std::size_t>(person.len));
  hash.update(static_cast<const unsigned char*>(data.buf), static_cast<std::size_t>(data.len));
  unsigned char out[64];
  hash.final(out);
  PyBuffer_Release(&data);
  PyBuffer_Release(&person);
  return PyBytes_FromStringAndSize(reinterpret_cast<char*>(out), size);
}

// `count` non-negative sizes from `args`; false with an exception set otherwise.
bool sizes(PyObject* const* args, int count, Py_ssize_t* out, const char* function) {
  for (int i = 0; i < count; ++i) {
    out[i] = PyLong_AsSsize_t(args[i]);
    if (out[i] == -1 && PyErr_Occurred()) return false;
    if (out[i] < 0) {
      PyErr_Format(PyExc_ValueError, "%s: a negative limit", function);
      return false;
    }
  }
  return true;
}

// read_match(frame, version, str_bytes, str_chars, token_bytes) -> (request_id, model,
// adapter, salt, tokens, requester) of a well-formed MATCH request, or None for anything
// else (the general decoder then reads it and names what is wrong).
PyObject* read_match(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5)
    return PyErr_Format(PyExc_TypeError,
                        "read_match(frame, version, str_bytes, str_chars, token_bytes)");
  Py_ssize_t numbers[4];
  if (!sizes(args + 1, 4, numbers, "read_match")) return nullptr;
  Py_buffer frame;
  if (PyObject_GetBuffer(args[0], &frame, PyBUF_SIMPLE) != 0) return nullptr;
  kvmesh::MatchRequest request;
  kvmesh::MatchLimits limits{static_cast<uint64_t>(numbers[0]),
                             static_cast<std::size_t>(numbers[1]),
                             static_cast<std::size_t>(numbers[3])};
  PyObject* out = nullptr;
  if (kvmesh::read_match(static_cast<const unsigned char*>(frame.buf),
                         static_cast<std::size_t>(frame.len), limits, &request)) {
    PyObject* texts[4] = {};
    std::string_view views[4] = {request.model, request.adapter, request.salt,
                                 request.requester};
    int wanted = request.has_requester ? 4 : 3;
    bool fine = true;
    for (int i = 0; i < wanted && fine; ++i) {
      texts[i] = PyUnicode_DecodeUTF8(views[i].data(), static_cast<Py_ssize_t>(views[i].size()),
                                      "strict");
      fine = texts[i] != nullptr && PyUnicode_GET_LENGTH(texts[i]) <= numbers[2];
    }
    PyObject* tokens = fine ? PyBytes_FromStringAndSize(
                                  request.tokens.data(),
                                  static_cast<Py_ssize_t>(request.tokens.size()))
                            : nullptr;
    if (tokens != nullptr) {
      if (!request.has_requester) {
        Py_INCREF(Py_None);
        texts[3] = Py_None;
      }
      out = Py_BuildValue("(KNNNNN)", static_cast<unsigned long long>(request.request_id),
                          texts[0], texts[1], texts[2], tokens, texts[3]);
    } else {
      for (PyObject* text : texts) Py_XDECREF(text);
      PyErr_Clear();  // not UTF-8, or too long: the general decoder says which
    }
  }
  PyBuffer_Release(&frame);
  if (out == nullptr && !PyErr_Occurred()) Py_RETURN_NONE;
  return out;
}

// scan_msgpack(frame, max_containers, max_depth) -> (status, offset): a walk over the
// frame's msgpack object that builds nothing (msgpack_scan.hpp; status 0 is whole and
// within the bounds, offset where the walk stopped).
PyObject* scan_msgpack(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3)
    return PyErr_Format(PyExc_TypeError, "scan_msgpack(frame, max_containers, max_depth)");
  Py_ssize_t bounds[2];
  if (!sizes(args + 1, 2, bounds, "scan_msgpack")) return nullptr;
  Py_buffer frame;
  if (PyObject_GetBuffer(args[0], &frame, PyBUF_SIMPLE) != 0) return nullptr;
  kvmesh::ScanResult result;
  Py_BEGIN_ALLOW_THREADS
  result = kvmesh::scan_msgpack(static_cast<const unsigned char*>(frame.buf),
                                static_cast<std::size_t>(frame.len),
                                static_cast<std::size_t>(bounds[0]),
                                static_cast<std::size_t>(bounds[1]));
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&frame);
  return Py_BuildValue("(in)", static_cast<int>(result.status),
                       static_cast<Py_ssize_t>(result.offset));
}

// An exact int's value, -1 for anything else (a negative or too large one included).
long page_number(PyObject* item) {
  long value = -1;
  if (!PyLong_CheckExact(item)) return -1;
  if (small_int(item, &value)) return value;
  int overflow = 0;
  value = PyLong_AsLongAndOverflow(item, &overflow);
  if (value == -1 && PyErr_Occurred()) PyErr_Clear();
  return overflow != 0 ? -1 : value;
}

// record_digests(view, free_flags, pages, digests) -> None once `digests[i]` is written at
// `view[16 * pages[i]]` for every i; else (fault, i) and nothing written: fault 1 a page
// out of range, 2 a free page, 3 a digest that is not 16 bytes, 4 the empty digest.
// Every item is checked before the first write. The page pool's set_digests
// (workers/store/page_pool.py): a publish records each page of its run here.
PyObject* record_digests(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4)
    return PyErr_Format(PyExc_TypeError, "record_digests(view, free_flags, pages, digests)");
  PyObject* pages = args[2];
  PyObject* digests = args[3];
  if (!PyList_CheckExact(pages) || !PyList_CheckExact(digests))
    return PyErr_Format(PyExc_TypeError, "record_digests takes lists of pages and digests");
  Py_ssize_t count = PyList_GET_SIZE(pages);
  if (PyList_GET_SIZE(digests) != count)
    return PyErr_Format(PyExc_ValueError, "%zd digests for %zd pages",
                        PyList_GET_SIZE(digests), count);
  Py_buffer view, flags;
  if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) != 0) return nullptr;
  if (PyObject_GetBuffer(args[1], &flags, PyBUF_SIMPLE) != 0) {
    PyBuffer_Release(&view);
    return nullptr;
  }
  Py_ssize_t num_pages = flags.len;
  if (view.len != num_pages * static_cast<Py_ssize_t>(kDigest)) {
    PyErr_Format(PyExc_ValueError, "a digest view of %zd bytes for %zd pages", view.len,
                 num_pages);
    PyBuffer_Release(&flags);
    PyBuffer_Release(&view);
    return nullptr;
  }
  // The faults in the order they are named: every page's range, then free pages, then
  // the digests; the first item of the first kind found.
  std::vector<long> numbers(static_cast<std::size_t>(count));
  const auto* free = static_cast<const unsigned char*>(flags.buf);
  int fault = 0;
  Py_ssize_t at = 0;
  for (; fault == 0 && at < count; ++at) {
    numbers[at] = page_number(PyList_GET_ITEM(pages, at));
    if (numbers[at] < 0 || numbers[at] >= num_pages) fault = 1;
  }
  for (at = fault ? at : 0; fault == 0 && at < count; ++at)
    if (free[numbers[at]] != 0) fault = 2;
  for (at = fault ? at : 0; fault == 0 && at < count; ++at) {
    PyObject* digest = PyList_GET_ITEM(digests, at);
    if (!PyBytes_CheckExact(digest) || PyBytes_GET_SIZE(digest) != Py_ssize_t{kDigest})
      fault = 3;
    else if (all_zero(reinterpret_cast<const unsigned char*>(PyBytes_AS_STRING(digest))))
      fault = 4;
  }
  PyObject* out;
  if (fault != 0) {
    out = Py_BuildValue("(in)", fault, at - 1);
  } else {
    auto* target = static_cast<unsigned char*>(view.buf);
    for (Py_ssize_t i = 0; i < count; ++i)
      std::memcpy(target + numbers[i] * kDigest, PyBytes_AS_STRING(PyList_GET_ITEM(digests, i)),
                  kDigest);
    Py_INCREF(Py_None);
    out = Py_None;
  }
  PyBuffer_Release(&flags);
  PyBuffer_Release(&view);
  return out;
}

// A span's fields as the wire holds them: (worker_id, tier, page_ids, generations, tiers),
// str, str and bytes; false for anything else (a HolderSpan's int tuples, say).
bool packed_span(PyObject* span, std::string_view fields[5]) {
  if (!PyTuple_Check(span) || PyTuple_GET_SIZE(span) != 5) return false;
  for (int i = 0; i < 5; ++i) {
    PyObject* item = PyTuple_GET_ITEM(span, i);
    if (i < 2) {
      if (!PyUnicode_CheckExact(item)) return false;
      Py_ssize_t size;
      const char* text = PyUnicode_AsUTF8AndSize(item, &size);
      if (text == nullptr) {
        PyErr_Clear();
        return false;
      }
      fields[i] = std::string_view(text, static_cast<std::size_t>(size));
    } else {
      if (!PyBytes_CheckExact(item)) return false;
      fields[i] = std::string_view(PyBytes_AS_STRING(item),
                                   static_cast<std::size_t>(PyBytes_GET_SIZE(item)));
    }
  }
  return true;
}

// write_match_reply(version, request_id, matched_tokens, spans) -> the OK reply's frame,
// the bytes msgpack's packer writes for the general path's envelope; None when a span is
// not packed (the general path then encodes it).
PyObject* write_match_reply(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4)
    return PyErr_Format(PyExc_TypeError,
                        "write_match_reply(version, request_id, matched_tokens, spans)");
  unsigned long long numbers[3];
  for (int i = 0; i < 3; ++i) {
    if (!PyLong_CheckExact(args[i])) Py_RETURN_NONE;
    numbers[i] = PyLong_AsUnsignedLongLong(args[i]);
    if (PyErr_Occurred() || numbers[i] > static_cast<unsigned long long>(INT64_MAX)) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
  }
  PyObject* spans = args[3];
  if (!PyTuple_CheckExact(spans)) Py_RETURN_NONE;
  kvmesh::MsgpackWriter w;
  w.out.reserve(64);
  w.map(5);
  w.str("v");
  w.uint(numbers[0]);
  w.str("t");
  w.str("ok");
  w.str("id");
  w.uint(numbers[1]);
  w.str("b");
  w.map(2);
  w.str("matched_tokens");
  w.uint(numbers[2]);
  w.str("spans");
  Py_ssize_t count = PyTuple_GET_SIZE(spans);
  w.array(static_cast<std::size_t>(count));
  for (Py_ssize_t i = 0; i < count; ++i) {
    std::string_view fields[5];
    if (!packed_span(PyTuple_GET_ITEM(spans, i), fields)) Py_RETURN_NONE;
    w.array(fields[4].empty() ? 4 : 5);
    w.str(fields[0]);
    w.str(fields[1]);
    w.bin(fields[2]);
    w.bin(fields[3]);
    if (!fields[4].empty()) w.bin(fields[4]);
  }
  w.str("r");
  w.str("match");
  return PyBytes_FromStringAndSize(w.out.data(), static_cast<Py_ssize_t>(w.out.size()));
}

#define FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f)), METH_FASTCALL

PyMethodDef methods[] = {
    {"pack_int32", pack_int32, METH_O,
     "pack_int32(ids) -> bytes (little-endian int32), or None when an id is not an exact "
     "int in int32."},
    {"chain_digests", FASTCALL(chain_digests),
     "chain_digests(parent, packed, page_bytes) -> [16-byte digest of each full page, each "
     "under the one before]."},
    {"next_digest", FASTCALL(next_digest),
     "next_digest(parent, page) -> the 16-byte digest of one page under `parent`."},
    {"read_match", FASTCALL(read_match),
     "read_match(frame, version, str_bytes, str_chars, token_bytes) -> (request_id, model, "
     "adapter, salt, tokens, requester) of a well-formed MATCH request, else None."},
    {"scan_msgpack", FASTCALL(scan_msgpack),
     "scan_msgpack(frame, max_containers, max_depth) -> (status, offset): 0 when the frame "
     "is one whole msgpack object within the bounds; 1 too many lists and maps, 2 truncated, "
     "3 trailing bytes, 4 too deep, 5 an ext type, 6 malformed."},
    {"record_digests", FASTCALL(record_digests),
     "record_digests(view, free_flags, pages, digests) -> None once each digest is written "
     "at its page's 16 bytes of view, else (fault, index) and nothing written."},
    {"write_match_reply", FASTCALL(write_match_reply),
     "write_match_reply(version, request_id, matched_tokens, spans) -> the frame of an OK "
     "reply to MATCH with packed spans, else None."},
    {"blake2b", FASTCALL(blake2b),
     "blake2b(data, digest_bytes, person) -> BLAKE2b of data, unkeyed, personalised."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_native",
                          "The compiled wire and digests.", -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__native(void) {
#if PY_BIG_ENDIAN
  PyErr_SetString(PyExc_ImportError, "the compiled parts read little-endian tokens");
  return nullptr;
#endif
  return PyModule_Create(&module_def);
}
