// cache_service.index._compiled: the index's compiled parts, through CPython's C API
// (nothing to build against but Python's headers: the package builds offline wherever
// it installs).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "chain_keys.hpp"
#include "key_table.hpp"
#include "trie.hpp"
#include "walk.hpp"

namespace {

PyObject* frombuffer = nullptr;  // numpy.frombuffer: arrays out, without numpy's headers

// A writable int64 numpy array holding a copy of `count` values.
PyObject* int64_array(const void* values, std::size_t count) {
  PyObject* bytes = PyByteArray_FromStringAndSize(static_cast<const char*>(values),
                                                  static_cast<Py_ssize_t>(count * 8));
  if (bytes == nullptr) return nullptr;
  PyObject* array = PyObject_CallFunction(frombuffer, "Os", bytes, "<i8");
  Py_DECREF(bytes);
  return array;
}

struct KeyTableObject {
  PyObject_HEAD
  kvmesh::KeyTable* table;
};

// A Python int as an int64 key; false (with an exception set) when it is not one.
bool as_key(PyObject* value, int64_t* key) {
  long long v = PyLong_AsLongLong(value);
  if (v == -1 && PyErr_Occurred()) return false;
  *key = static_cast<int64_t>(v);
  return true;
}

bool as_node(PyObject* value, int32_t* node) {
  long v = PyLong_AsLong(value);
  if (v == -1 && PyErr_Occurred()) return false;
  if (v < 0 || v > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "a node id must be in [0, 2**31), got %ld", v);
    return false;
  }
  *node = static_cast<int32_t>(v);
  return true;
}

PyObject* table_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* self = reinterpret_cast<KeyTableObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->table = new (std::nothrow) kvmesh::KeyTable();
  if (self->table == nullptr) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  return reinterpret_cast<PyObject*>(self);
}

void table_dealloc(PyObject* object) {
  auto* self = reinterpret_cast<KeyTableObject*>(object);
  delete self->table;
  Py_TYPE(object)->tp_free(object);
}

// (key, node) arguments of `method`; false (with an exception set) when they are not.
bool key_and_node(const char* method, PyObject* const* args, Py_ssize_t nargs, int64_t* key,
                  int32_t* node) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "%s(key, node) takes 2 arguments, got %zd", method, nargs);
    return false;
  }
  return as_key(args[0], key) && as_node(args[1], node);
}

PyObject* table_insert(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<KeyTableObject*>(object);
  int64_t key;
  int32_t node;
  if (!key_and_node("insert", args, nargs, &key, &node)) return nullptr;
  try {
    self->table->insert(key, node);
  } catch (const std::invalid_argument& error) {
    return PyErr_Format(PyExc_ValueError, "%s, got %lld", error.what(), (long long)key);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  Py_RETURN_NONE;
}

PyObject* table_remove(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<KeyTableObject*>(object);
  int64_t key;
  int32_t node;
  if (!key_and_node("remove", args, nargs, &key, &node)) return nullptr;
  bool removed;
  try {
    removed = self->table->remove(key, node);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  if (!removed)
    return PyErr_Format(PyExc_KeyError, "node %d is not in the key table under %lld", (int)node,
                        (long long)key);
  Py_RETURN_NONE;
}

PyObject* table_candidates(PyObject* object, PyObject* arg) {
  auto* self = reinterpret_cast<KeyTableObject*>(object);
  int64_t key;
  if (!as_key(arg, &key)) return nullptr;
  std::vector<int32_t> found;
  self->table->candidates(key, found);
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(found.size()));
  if (out == nullptr) return nullptr;
  for (std::size_t i = 0; i < found.size(); ++i) {
    PyObject* node = PyLong_FromLong(found[i]);
    if (node == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), node);
  }
  return out;
}

PyObject* table_find_run(PyObject* object, PyObject* arg) {
  auto* self = reinterpret_cast<KeyTableObject*>(object);
  Py_buffer view;  // one dimension, any stride (a numpy slice with a step, say)
  if (PyObject_GetBuffer(arg, &view, PyBUF_STRIDES | PyBUF_FORMAT) != 0) return nullptr;
  std::string format = view.format == nullptr ? "B" : view.format;
  if (view.ndim != 1 || view.itemsize != 8 ||
      (format != "q" && format != "l" && format != "<q" && format != "=q")) {
    PyBuffer_Release(&view);
    return PyErr_Format(PyExc_TypeError, "find_run takes one dimension of int64 keys, got "
                        "%d dimensions of format %s", view.ndim, format.c_str());
  }
  std::size_t count = static_cast<std::size_t>(view.shape[0]);
  std::vector<int64_t> keys(count);
  const char* base = static_cast<const char*>(view.buf);
  for (std::size_t i = 0; i < count; ++i)
    std::memcpy(&keys[i], base + static_cast<Py_ssize_t>(i) * view.strides[0], 8);
  PyBuffer_Release(&view);
  std::vector<int64_t> nodes(count);
  std::size_t run = self->table->find_run(keys.data(), count, nodes.data());
  return int64_array(nodes.data(), run);
}

PyObject* table_check(PyObject* object, PyObject*) {
  auto* self = reinterpret_cast<KeyTableObject*>(object);
  std::vector<int64_t> keys;
  std::vector<int32_t> nodes;
  std::string wrong;
  try {
    wrong = self->table->check(keys, nodes);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  if (!wrong.empty()) return PyErr_Format(PyExc_AssertionError, "%s", wrong.c_str());
  std::vector<int64_t> wide(nodes.begin(), nodes.end());
  PyObject* key_array = int64_array(keys.data(), keys.size());
  if (key_array == nullptr) return nullptr;
  PyObject* node_array = int64_array(wide.data(), wide.size());
  if (node_array == nullptr) {
    Py_DECREF(key_array);
    return nullptr;
  }
  return Py_BuildValue("(NN)", key_array, node_array);
}

PyObject* table_size(PyObject* object, void*) {
  return PyLong_FromSize_t(reinterpret_cast<KeyTableObject*>(object)->table->size());
}

PyObject* table_bits(PyObject* object, void*) {
  return PyLong_FromLong(reinterpret_cast<KeyTableObject*>(object)->table->bits());
}

PyObject* table_nbytes(PyObject* object, void*) {
  return PyLong_FromSize_t(reinterpret_cast<KeyTableObject*>(object)->table->slots() * 12);
}

PyMethodDef table_methods[] = {
    {"insert", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(table_insert)),
     METH_FASTCALL, "insert(key, node): add node under an odd int64 key."},
    {"remove", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(table_remove)),
     METH_FASTCALL, "remove(key, node): drop that entry (KeyError when absent)."},
    {"candidates", table_candidates, METH_O,
     "candidates(key) -> tuple of the nodes stored under key, in probe order."},
    {"find_run", table_find_run, METH_O,
     "find_run(int64 keys) -> int64 array: for the longest leading run of keys present, "
     "each one's first node (candidates to verify)."},
    {"check", table_check, METH_NOARGS,
     "check() -> (int64 keys, int64 nodes) arrays of the occupied slots; "
     "AssertionError naming what is wrong with the layout."},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef table_getset[] = {
    {"size", table_size, nullptr, "entries stored", nullptr},
    {"bits", table_bits, nullptr, "log2 of its home slots", nullptr},
    {"nbytes", table_nbytes, nullptr, "bytes of its two arrays", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject KeyTableType = {PyVarObject_HEAD_INIT(nullptr, 0) nullptr};  // set at import

// ---- ChainKeys ---------------------------------------------------------------------

struct ChainKeysObject {
  PyObject_HEAD
  kvmesh::ChainKeys* keys;
};

PyObject* keys_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"page_tokens", "secret", "collide", nullptr};
  Py_ssize_t page_tokens;
  unsigned long long secret;
  int collide = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nK|p", const_cast<char**>(names),
                                   &page_tokens, &secret, &collide))
    return nullptr;
  if (page_tokens <= 0)
    return PyErr_Format(PyExc_ValueError, "page_tokens must be positive, got %zd", page_tokens);
  auto* self = reinterpret_cast<ChainKeysObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->keys = new (std::nothrow)
      kvmesh::ChainKeys(static_cast<std::size_t>(page_tokens), secret, collide != 0);
  if (self->keys == nullptr) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  return reinterpret_cast<PyObject*>(self);
}

void keys_dealloc(PyObject* object) {
  delete reinterpret_cast<ChainKeysObject*>(object)->keys;
  Py_TYPE(object)->tp_free(object);
}

// (key, depth, data) arguments of `method`: `view` holds data's bytes when true.
bool key_depth_data(const char* method, PyObject* const* args, Py_ssize_t nargs, int64_t* key,
                    std::size_t* depth, Py_buffer* view) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "%s(key, depth, data) takes 3 arguments, got %zd", method,
                 nargs);
    return false;
  }
  if (!as_key(args[0], key)) return false;
  Py_ssize_t d = PyLong_AsSsize_t(args[1]);
  if (d == -1 && PyErr_Occurred()) return false;
  if (d < 0) {
    PyErr_Format(PyExc_ValueError, "%s: depth must be >= 0, got %zd", method, d);
    return false;
  }
  *depth = static_cast<std::size_t>(d);
  return PyObject_GetBuffer(args[2], view, PyBUF_SIMPLE) == 0;
}

// Runs `call`, turning the C++ exceptions of the index's parts into Python's: bad input
// into ValueError, a broken invariant into AssertionError; false when it threw.
template <typename Call>
bool guarded(Call call) {
  try {
    call();
    return true;
  } catch (const std::length_error& error) {
    PyErr_SetString(PyExc_ValueError, error.what());
  } catch (const std::out_of_range& error) {
    PyErr_SetString(PyExc_ValueError, error.what());
  } catch (const std::invalid_argument& error) {
    PyErr_SetString(PyExc_ValueError, error.what());
  } catch (const std::logic_error& error) {
    PyErr_SetString(PyExc_AssertionError, error.what());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  }
  return false;
}

PyObject* keys_chain(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* keys = reinterpret_cast<ChainKeysObject*>(object)->keys;
  int64_t start;
  std::size_t depth;
  Py_buffer view;
  if (!key_depth_data("chain_keys", args, nargs, &start, &depth, &view)) return nullptr;
  std::size_t bytes = static_cast<std::size_t>(view.len);
  std::vector<int64_t> out(bytes / (4 * keys->page_tokens()));
  bool done = guarded([&] {
    keys->chain(start, depth, static_cast<const char*>(view.buf), bytes, out.data());
  });
  PyBuffer_Release(&view);
  if (!done) return nullptr;
  return int64_array(out.data(), out.size());
}

PyObject* keys_page(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* keys = reinterpret_cast<ChainKeysObject*>(object)->keys;
  int64_t parent;
  std::size_t depth;
  Py_buffer view;
  if (!key_depth_data("page_key", args, nargs, &parent, &depth, &view)) return nullptr;
  int64_t key = 0;
  bool done = guarded([&] {
    key = keys->page(parent, depth, static_cast<const char*>(view.buf),
                     static_cast<std::size_t>(view.len));
  });
  PyBuffer_Release(&view);
  if (!done) return nullptr;
  return PyLong_FromLongLong(key);
}

PyObject* keys_coefficients(PyObject* object, PyObject* arg) {
  auto* keys = reinterpret_cast<ChainKeysObject*>(object)->keys;
  Py_ssize_t count = PyLong_AsSsize_t(arg);
  if (count == -1 && PyErr_Occurred()) return nullptr;
  if (count < 0) return PyErr_Format(PyExc_ValueError, "count must be >= 0, got %zd", count);
  const uint64_t* first = nullptr;
  if (!guarded([&] { first = keys->coefficients(static_cast<std::size_t>(count)); }))
    return nullptr;
  return int64_array(first, static_cast<std::size_t>(count));
}

PyMethodDef keys_methods[] = {
    {"chain_keys", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(keys_chain)),
     METH_FASTCALL,
     "chain_keys(start, depth, data) -> int64 array: the keys of the full pages of packed "
     "tokens `data` hung below a node of key `start` at page depth `depth`."},
    {"page_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(keys_page)),
     METH_FASTCALL,
     "page_key(parent_key, depth, data) -> int: the key of page `depth` of `data` as a child "
     "of a node of key `parent_key`."},
    {"coefficients", keys_coefficients, METH_O,
     "coefficients(count) -> int64 array: the first `count` coefficients (for checks)."},
    {nullptr, nullptr, 0, nullptr},
};

PyObject* keys_nbytes(PyObject* object, void*) {
  return PyLong_FromSize_t(reinterpret_cast<ChainKeysObject*>(object)->keys->nbytes());
}

PyGetSetDef keys_getset[] = {
    {"nbytes", keys_nbytes, nullptr, "bytes of its coefficients", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject ChainKeysType = {PyVarObject_HEAD_INIT(nullptr, 0) nullptr};  // set at import

// ---- PageMap: one worker's page id -> node map --------------------------------------

struct PageMapObject {
  PyObject_HEAD
  kvmesh::PageMap* map;
};

PyTypeObject PageMapType = {PyVarObject_HEAD_INIT(nullptr, 0) nullptr};  // set at import

PyObject* map_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* self = reinterpret_cast<PageMapObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->map = new (std::nothrow) kvmesh::PageMap();
  if (self->map == nullptr) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  return reinterpret_cast<PyObject*>(self);
}

void map_dealloc(PyObject* object) {
  delete reinterpret_cast<PageMapObject*>(object)->map;
  Py_TYPE(object)->tp_free(object);
}

PyObject* node_or_none(int64_t node) {
  if (node == kvmesh::kNone) Py_RETURN_NONE;
  return PyLong_FromLongLong(node);
}

PyObject* map_get(PyObject* object, PyObject* arg) {
  auto* map = reinterpret_cast<PageMapObject*>(object)->map;
  int64_t page, node = kvmesh::kNone;
  if (!as_key(arg, &page) || !guarded([&] { node = map->get(page); })) return nullptr;
  return node_or_none(node);
}

PyObject* map_pop(PyObject* object, PyObject* arg) {
  auto* map = reinterpret_cast<PageMapObject*>(object)->map;
  int64_t page, node = kvmesh::kNone;
  if (!as_key(arg, &page) || !guarded([&] { node = map->pop(page); })) return nullptr;
  return node_or_none(node);
}

PyObject* map_set(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* map = reinterpret_cast<PageMapObject*>(object)->map;
  int64_t page, node;
  if (nargs != 2) return PyErr_Format(PyExc_TypeError, "set(page, node) takes 2 arguments");
  if (!as_key(args[0], &page) || !as_key(args[1], &node)) return nullptr;
  if (node < 0 || node > INT32_MAX)
    return PyErr_Format(PyExc_ValueError, "a node id must be in [0, 2**31), got %lld",
                        static_cast<long long>(node));
  if (!guarded([&] { map->set(page, node); })) return nullptr;
  Py_RETURN_NONE;
}

PyObject* map_items(PyObject* object, PyObject*) {
  auto* map = reinterpret_cast<PageMapObject*>(object)->map;
  std::vector<std::pair<int64_t, int64_t>> items;
  if (!guarded([&] { items = map->items(); })) return nullptr;
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(items.size()));
  if (out == nullptr) return nullptr;
  for (std::size_t i = 0; i < items.size(); ++i) {
    PyObject* pair = Py_BuildValue("(LL)", static_cast<long long>(items[i].first),
                                   static_cast<long long>(items[i].second));
    if (pair == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), pair);
  }
  return out;
}

PyObject* map_clear(PyObject* object, PyObject*) {
  reinterpret_cast<PageMapObject*>(object)->map->clear();
  Py_RETURN_NONE;
}

PyObject* map_size(PyObject* object, void*) {
  return PyLong_FromSize_t(reinterpret_cast<PageMapObject*>(object)->map->size());
}

PyObject* map_nbytes(PyObject* object, void*) {
  return PyLong_FromSize_t(reinterpret_cast<PageMapObject*>(object)->map->nbytes());
}

PyMethodDef map_methods[] = {
    {"get", map_get, METH_O, "get(page) -> node or None."},
    {"pop", map_pop, METH_O, "pop(page) -> node or None: the page's node, forgotten."},
    {"set", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(map_set)), METH_FASTCALL,
     "set(page, node): map the page to the node (the trie checks every node it reads)."},
    {"items", map_items, METH_NOARGS, "items() -> [(page, node)], by page."},
    {"clear", map_clear, METH_NOARGS, "clear(): forget every page."},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef map_getset[] = {
    {"size", map_size, nullptr, "pages mapped", nullptr},
    {"nbytes", map_nbytes, nullptr, "bytes it holds (estimated for the hash part)", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

// ---- Trie: the walk and the writes over a Nodes object's columns ----------------------

constexpr int kColumns = 14;
const char* const kColumnNames[kColumns] = {
    "tokens", "parent",  "first_child", "next_sibling", "prev_sibling", "key",        "depth",
    "last_access", "chained", "count", "slot", "page", "generation", "tier"};
// Bytes an item, and items a node (0: page_bytes / itemsize, for the tokens).
const Py_ssize_t kItemSize[kColumns] = {4, 4, 4, 4, 4, 8, 4, 8, 1, 2, 2, 4, 8, 1};
const Py_ssize_t kPerNode[kColumns] = {0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 4, 4, 4, 4};

struct TrieObject {
  PyObject_HEAD
  Py_buffer buffers[kColumns];
  int held;        // buffers acquired
  PyObject* table;  // the KeyTable and ChainKeys objects it works with
  PyObject* keys;
  kvmesh::Trie* trie;
  int tiers;
};

void release_buffers(TrieObject* self) {
  for (int i = 0; i < self->held; ++i) PyBuffer_Release(&self->buffers[i]);
  self->held = 0;
}

void trie_dealloc(PyObject* object) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  delete self->trie;
  release_buffers(self);
  Py_XDECREF(self->table);
  Py_XDECREF(self->keys);
  Py_TYPE(object)->tp_free(object);
}

PyObject* trie_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"table", "keys", "tiers", nullptr};
  PyObject *table, *keys;
  int tiers;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!i", const_cast<char**>(names),
                                   &KeyTableType, &table, &ChainKeysType, &keys, &tiers))
    return nullptr;
  if (tiers <= 0 || tiers > kvmesh::kMaxTiers)
    return PyErr_Format(PyExc_ValueError, "tiers must be in [1, %d], got %d", kvmesh::kMaxTiers,
                        tiers);
  auto* self = reinterpret_cast<TrieObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  Py_INCREF(table);
  Py_INCREF(keys);
  self->table = table;
  self->keys = keys;
  self->tiers = tiers;
  self->trie = new (std::nothrow)
      kvmesh::Trie(*reinterpret_cast<KeyTableObject*>(table)->table,
                   *reinterpret_cast<ChainKeysObject*>(keys)->keys, tiers);
  if (self->trie == nullptr) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  return reinterpret_cast<PyObject*>(self);
}

// attach(*columns): hold the 14 columns (writable, C-contiguous, one length in nodes).
PyObject* trie_attach(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  if (nargs != kColumns)
    return PyErr_Format(PyExc_TypeError, "attach takes the %d columns, got %zd", kColumns, nargs);
  Py_buffer buffers[kColumns];
  int held = 0;
  auto fail = [&]() -> PyObject* {
    for (int i = 0; i < held; ++i) PyBuffer_Release(&buffers[i]);
    return nullptr;
  };
  auto page_bytes =
      static_cast<Py_ssize_t>(4 * reinterpret_cast<ChainKeysObject*>(self->keys)->keys->page_tokens());
  Py_ssize_t capacity = -1;
  for (int i = 0; i < kColumns; ++i) {
    if (PyObject_GetBuffer(args[i], &buffers[i], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0)
      return fail();
    held = i + 1;
    Py_ssize_t per_node = kPerNode[i] ? kPerNode[i] * kItemSize[i] : page_bytes;
    if (buffers[i].itemsize != kItemSize[i] || buffers[i].len % per_node != 0) {
      PyErr_Format(PyExc_TypeError, "attach: column %s has %zd-byte items, not %zd, or a "
                   "length that is not whole nodes", kColumnNames[i], buffers[i].itemsize,
                   kItemSize[i]);
      return fail();
    }
    Py_ssize_t nodes = buffers[i].len / per_node;
    if (capacity >= 0 && nodes != capacity) {
      PyErr_Format(PyExc_ValueError, "attach: column %s has %zd nodes, the others %zd",
                   kColumnNames[i], nodes, capacity);
      return fail();
    }
    capacity = nodes;
  }
  kvmesh::TrieColumns columns{
      static_cast<char*>(buffers[0].buf),      static_cast<int32_t*>(buffers[1].buf),
      static_cast<int32_t*>(buffers[2].buf),   static_cast<int32_t*>(buffers[3].buf),
      static_cast<int32_t*>(buffers[4].buf),   static_cast<int64_t*>(buffers[5].buf),
      static_cast<int32_t*>(buffers[6].buf),   static_cast<int64_t*>(buffers[7].buf),
      static_cast<uint8_t*>(buffers[8].buf),   static_cast<int16_t*>(buffers[9].buf),
      static_cast<int16_t*>(buffers[10].buf),  static_cast<int32_t*>(buffers[11].buf),
      static_cast<int64_t*>(buffers[12].buf),  static_cast<uint8_t*>(buffers[13].buf),
      static_cast<std::size_t>(capacity),      static_cast<std::size_t>(page_bytes)};
  if (!guarded([&] { self->trie->attach(columns); })) return fail();
  release_buffers(self);
  std::memcpy(self->buffers, buffers, sizeof(buffers));
  self->held = kColumns;
  Py_RETURN_NONE;
}

PyObject* trie_detach(PyObject* object, PyObject*) {
  release_buffers(reinterpret_cast<TrieObject*>(object));
  Py_RETURN_NONE;
}

bool attached(TrieObject* self) {
  if (self->held == kColumns) return true;
  PyErr_SetString(PyExc_RuntimeError, "the trie has no columns attached");
  return false;
}

// A sequence of ints (page ids, generations) as int64s; false with an exception set.
bool int64s(PyObject* sequence, std::vector<int64_t>& out, const char* what) {
  PyObject* fast = PySequence_Fast(sequence, what);
  if (fast == nullptr) return false;
  Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  out.resize(static_cast<std::size_t>(count));
  for (Py_ssize_t i = 0; i < count; ++i) {
    long long value = PyLong_AsLongLong(items[i]);
    if (value == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
    out[static_cast<std::size_t>(i)] = value;
  }
  Py_DECREF(fast);
  return true;
}

bool as_int(PyObject* value, int* out, const char* what) {
  long v = PyLong_AsLong(value);
  if (v == -1 && PyErr_Occurred()) return false;
  if (v < INT16_MIN || v > INT16_MAX) {
    PyErr_Format(PyExc_ValueError, "%s out of range: %ld", what, v);
    return false;
  }
  *out = static_cast<int>(v);
  return true;
}

kvmesh::PageMap* page_map(PyObject* value) {
  if (!PyObject_TypeCheck(value, &PageMapType)) {
    PyErr_Format(PyExc_TypeError, "expected a PageMap, got %s", Py_TYPE(value)->tp_name);
    return nullptr;
  }
  return reinterpret_cast<PageMapObject*>(value)->map;
}

PyObject* tier_tuple(const int64_t* counts, int tiers) {
  PyObject* out = PyTuple_New(tiers);
  if (out == nullptr) return nullptr;
  for (int i = 0; i < tiers; ++i) {
    PyObject* count = PyLong_FromLongLong(counts[i]);
    if (count == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, i, count);
  }
  return out;
}

// (result, tier_delta, removed, demoted, unknown): what every write returns.
PyObject* written(TrieObject* self, PyObject* result, const kvmesh::Tally& tally) {
  PyObject* delta = tier_tuple(tally.tier_delta, self->tiers);
  PyObject* removed = delta ? tier_tuple(tally.removed, self->tiers) : nullptr;
  if (removed == nullptr) {
    Py_XDECREF(delta);
    Py_DECREF(result);
    return nullptr;
  }
  return Py_BuildValue("(NNNLL)", result, delta, removed, static_cast<long long>(tally.demoted),
                       static_cast<long long>(tally.unknown));
}

// The (pages, slot) every write starts with.
bool map_and_slot(TrieObject* self, PyObject* const* args, kvmesh::PageMap** map, int* slot) {
  if (!attached(self)) return false;
  *map = page_map(args[0]);
  return *map != nullptr && as_int(args[1], slot, "slot");
}

PyObject* trie_store(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  if (nargs != 8 && nargs != 9)
    return PyErr_Format(PyExc_TypeError, "store(pages, slot, parent, data, page_ids, "
                        "generations, tier, clock[, notify]) takes 8 or 9 arguments, "
                        "got %zd", nargs);
  kvmesh::PageMap* map;
  int slot, tier;
  int64_t parent, clock;
  std::vector<int64_t> pages, generations;
  if (!map_and_slot(self, args, &map, &slot) || !as_key(args[2], &parent) ||
      !int64s(args[4], pages, "page ids must be a sequence") ||
      !int64s(args[5], generations, "generations must be a sequence") ||
      !as_int(args[6], &tier, "tier") || !as_key(args[7], &clock))
    return nullptr;
  int notify = nargs == 9 ? PyObject_IsTrue(args[8]) : 0;
  if (notify < 0) return nullptr;
  if (generations.size() != pages.size())
    return PyErr_Format(PyExc_ValueError, "%zu generations for %zu pages", generations.size(),
                        pages.size());
  Py_buffer data;
  if (PyObject_GetBuffer(args[3], &data, PyBUF_SIMPLE) != 0) return nullptr;
  kvmesh::Tally tally;
  bool placed = false;
  bool done = guarded([&] {
    placed = self->trie->store(*map, slot, parent, static_cast<const char*>(data.buf),
                               static_cast<std::size_t>(data.len), pages.data(),
                               generations.data(), pages.size(), tier, clock, tally,
                               notify != 0);
  });
  PyBuffer_Release(&data);
  if (!done) return nullptr;
  return written(self, PyBool_FromLong(placed), tally);
}

PyObject* trie_demote(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  if (nargs != 6)
    return PyErr_Format(PyExc_TypeError, "demote(pages, slot, page_ids, new_page_ids, "
                        "generations, tier) takes 6 arguments, got %zd", nargs);
  kvmesh::PageMap* map;
  int slot, tier;
  std::vector<int64_t> pages, new_pages, generations;
  if (!map_and_slot(self, args, &map, &slot) ||
      !int64s(args[2], pages, "page ids must be a sequence") ||
      !int64s(args[3], new_pages, "new page ids must be a sequence") ||
      !int64s(args[4], generations, "generations must be a sequence") ||
      !as_int(args[5], &tier, "tier"))
    return nullptr;
  if (new_pages.size() != pages.size() || generations.size() != pages.size())
    return PyErr_Format(PyExc_ValueError, "%zu new page ids and %zu generations for %zu pages",
                        new_pages.size(), generations.size(), pages.size());
  kvmesh::Tally tally;
  bool moved = false;
  if (!guarded([&] {
        moved = self->trie->demote(*map, slot, pages.data(), new_pages.data(),
                                   generations.data(), pages.size(), tier, tally);
      }))
    return nullptr;
  return written(self, PyBool_FromLong(moved), tally);
}

PyObject* trie_drop_pages(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  if (nargs != 3)
    return PyErr_Format(PyExc_TypeError, "drop_pages(pages, slot, page_ids) takes 3 arguments");
  kvmesh::PageMap* map;
  int slot;
  std::vector<int64_t> pages;
  if (!map_and_slot(self, args, &map, &slot) ||
      !int64s(args[2], pages, "page ids must be a sequence"))
    return nullptr;
  kvmesh::Tally tally;
  if (!guarded([&] { self->trie->drop_pages(*map, slot, pages.data(), pages.size(), tally); }))
    return nullptr;
  Py_INCREF(Py_None);
  return written(self, Py_None, tally);
}

PyObject* trie_drop_subtree(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  if (nargs != 4)
    return PyErr_Format(PyExc_TypeError, "drop_subtree(pages, slot, node, counted) takes 4 "
                        "arguments");
  kvmesh::PageMap* map;
  int slot;
  int64_t node;
  if (!map_and_slot(self, args, &map, &slot) || !as_key(args[2], &node)) return nullptr;
  int counted = PyObject_IsTrue(args[3]);
  if (counted < 0) return nullptr;
  kvmesh::Tally tally;
  std::size_t dropped = 0;
  if (!guarded([&] {
        dropped = self->trie->drop_subtree(*map, slot, node, counted ? tally.removed : nullptr,
                                           tally);
      }))
    return nullptr;
  return written(self, PyLong_FromSize_t(dropped), tally);
}

PyObject* trie_drop_all(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  if (nargs != 3)
    return PyErr_Format(PyExc_TypeError, "drop_all(pages, slot, counted) takes 3 arguments");
  kvmesh::PageMap* map;
  int slot;
  if (!map_and_slot(self, args, &map, &slot)) return nullptr;
  int counted = PyObject_IsTrue(args[2]);
  if (counted < 0) return nullptr;
  kvmesh::Tally tally;
  std::size_t dropped = 0;
  if (!guarded([&] {
        dropped = self->trie->drop_all(*map, slot, counted ? tally.removed : nullptr, tally);
      }))
    return nullptr;
  return written(self, PyLong_FromSize_t(dropped), tally);
}

PyObject* int64_tuple(const std::vector<int64_t>& values);

PyObject* trie_take_notices(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  if (nargs != 3)
    return PyErr_Format(PyExc_TypeError, "take_notices(pages, slot, limit) takes 3 arguments");
  kvmesh::PageMap* map;
  int slot;
  int64_t limit;
  if (!map_and_slot(self, args, &map, &slot) || !as_key(args[2], &limit)) return nullptr;
  if (limit < 0) return PyErr_Format(PyExc_ValueError, "limit must be >= 0");
  std::vector<int64_t> pages, generations;
  if (!guarded([&] {
        self->trie->take_notices(*map, slot, static_cast<std::size_t>(limit), pages,
                                 generations);
      }))
    return nullptr;
  PyObject* page_ids = int64_tuple(pages);
  PyObject* gens = page_ids ? int64_tuple(generations) : nullptr;
  if (gens == nullptr) {
    Py_XDECREF(page_ids);
    return nullptr;
  }
  return Py_BuildValue("(NN)", page_ids, gens);
}

PyObject* trie_clear_notices(PyObject* object, PyObject* arg) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  int slot;
  if (!as_int(arg, &slot, "slot")) return nullptr;
  self->trie->clear_notices(slot);
  Py_RETURN_NONE;
}

PyObject* trie_notices_waiting(PyObject* object, PyObject* arg) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  int slot;
  if (!as_int(arg, &slot, "slot")) return nullptr;
  return PyLong_FromSize_t(self->trie->notices_waiting(slot));
}

PyObject* trie_notices(PyObject* object, void*) {
  auto* trie = reinterpret_cast<TrieObject*>(object)->trie;
  return Py_BuildValue("(LL)", static_cast<long long>(trie->notices_issued()),
                       static_cast<long long>(trie->notices_overflowed()));
}

PyObject* trie_get_notice_limit(PyObject* object, void*) {
  return PyLong_FromSize_t(reinterpret_cast<TrieObject*>(object)->trie->notice_limit());
}

int trie_set_notice_limit(PyObject* object, PyObject* value, void*) {
  int64_t limit;
  if (value == nullptr || !as_key(value, &limit)) {
    if (value == nullptr) PyErr_SetString(PyExc_TypeError, "notice_limit cannot be deleted");
    return -1;
  }
  if (limit < 0) {
    PyErr_SetString(PyExc_ValueError, "notice_limit must be >= 0");
    return -1;
  }
  reinterpret_cast<TrieObject*>(object)->trie->set_notice_limit(static_cast<std::size_t>(limit));
  return 0;
}

PyObject* trie_new_root(PyObject* object, PyObject* arg) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  int64_t key, node = kvmesh::kNone;
  if (!attached(self) || !as_key(arg, &key) ||
      !guarded([&] { node = self->trie->new_root(key); }))
    return nullptr;
  return PyLong_FromLongLong(node);
}

PyObject* trie_release_root(PyObject* object, PyObject* arg) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  int64_t node;
  if (!attached(self) || !as_key(arg, &node) ||
      !guarded([&] { self->trie->release_root(node); }))
    return nullptr;
  Py_RETURN_NONE;
}

PyObject* int64_tuple(const std::vector<int64_t>& values) {
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  if (out == nullptr) return nullptr;
  for (std::size_t i = 0; i < values.size(); ++i) {
    PyObject* value = PyLong_FromLongLong(values[i]);
    if (value == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), value);
  }
  return out;
}

PyObject* trie_take_emptied_roots(PyObject* object, PyObject*) {
  return int64_tuple(reinterpret_cast<TrieObject*>(object)->trie->take_emptied_roots());
}

PyObject* trie_column_of(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  if (nargs != 2) return PyErr_Format(PyExc_TypeError, "column_of(node, slot) takes 2 arguments");
  int64_t node;
  int slot, column = kvmesh::kNoColumn;
  if (!attached(self) || !as_key(args[0], &node) || !as_int(args[1], &slot, "slot") ||
      !guarded([&] { column = self->trie->column_of(node, slot); }))
    return nullptr;
  if (column == kvmesh::kNoColumn) Py_RETURN_NONE;
  return PyLong_FromLong(column);
}

PyObject* holding_tuple(const kvmesh::Holding& h) {
  return Py_BuildValue("(iiLi)", static_cast<int>(h.slot), static_cast<int>(h.page),
                       static_cast<long long>(h.generation), static_cast<int>(h.tier));
}

PyObject* trie_extra(PyObject* object, PyObject* arg) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  int64_t node;
  if (!as_key(arg, &node)) return nullptr;
  const auto& extra = self->trie->extra();
  auto found = node < 0 || node > INT32_MAX ? extra.end() : extra.find(static_cast<int32_t>(node));
  if (found == extra.end()) return PyTuple_New(0);
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(found->second.size()));
  if (out == nullptr) return nullptr;
  for (std::size_t i = 0; i < found->second.size(); ++i) {
    PyObject* holding = holding_tuple(found->second[i]);
    if (holding == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), holding);
  }
  return out;
}

PyObject* trie_extra_nodes(PyObject* object, PyObject*) {
  const auto& extra = reinterpret_cast<TrieObject*>(object)->trie->extra();
  std::vector<int64_t> nodes;
  nodes.reserve(extra.size());
  for (const auto& [node, held] : extra) nodes.push_back(node);
  std::sort(nodes.begin(), nodes.end());
  return int64_tuple(nodes);
}

// walk(root, data, max_runs) -> (length, runs, nodes): the path alone, for checks.
// The (root, data, max_runs) that walk and match start with: `data` acquired (the caller
// releases it), or false with an exception set and nothing held.
bool walk_args(TrieObject* self, const char* method, PyObject* const* args, int64_t* root,
               Py_ssize_t* max_runs, Py_buffer* data) {
  if (!attached(self)) return false;
  *root = kvmesh::kNone;
  if (args[0] != Py_None && !as_key(args[0], root)) return false;
  *max_runs = PyLong_AsSsize_t(args[2]);
  if (*max_runs == -1 && PyErr_Occurred()) return false;
  if (*max_runs < 0) {
    PyErr_Format(PyExc_ValueError, "%s: a negative count of runs", method);
    return false;
  }
  return PyObject_GetBuffer(args[1], data, PyBUF_SIMPLE) == 0;
}

PyObject* trie_walk(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  if (nargs != 3)
    return PyErr_Format(PyExc_TypeError, "walk(root, data, max_runs) takes 3 arguments");
  int64_t root;
  Py_ssize_t max_runs;
  Py_buffer data;
  if (!walk_args(self, "walk", args, &root, &max_runs, &data)) return nullptr;
  kvmesh::Trie* trie = self->trie;
  kvmesh::Path path;
  bool done = guarded([&] {
    path = trie->walker().walk(root, static_cast<const char*>(data.buf),
                               static_cast<std::size_t>(data.len),
                               static_cast<std::size_t>(max_runs), trie->allocated(),
                               trie->max_depth());
  });
  PyBuffer_Release(&data);
  if (!done) return nullptr;
  if (path.listed) {
    PyObject* nodes = int64_tuple(path.nodes);
    if (nodes == nullptr) return nullptr;
    return Py_BuildValue("(n()N)", static_cast<Py_ssize_t>(path.length), nodes);
  }
  PyObject* runs = PyTuple_New(static_cast<Py_ssize_t>(path.runs.size()));
  if (runs == nullptr) return nullptr;
  for (std::size_t i = 0; i < path.runs.size(); ++i) {
    PyObject* run = Py_BuildValue("(Ln)", static_cast<long long>(path.runs[i].first),
                                  static_cast<Py_ssize_t>(path.runs[i].second));
    if (run == nullptr) {
      Py_DECREF(runs);
      return nullptr;
    }
    PyTuple_SET_ITEM(runs, static_cast<Py_ssize_t>(i), run);
  }
  return Py_BuildValue("(nNO)", static_cast<Py_ssize_t>(path.length), runs, Py_None);
}

// (length, spans): each span (slot, held, tier, page_ids, generations, tiers), the ids
// and generations as little-endian bytes, `tiers` empty when every page is in `tier`.
PyObject* trie_match(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  if (nargs != 4)
    return PyErr_Format(PyExc_TypeError, "match(root, data, max_runs, clock) takes 4 arguments");
  int64_t clock = 0;
  bool touch = args[3] != Py_None;
  if (touch && !as_key(args[3], &clock)) return nullptr;
  int64_t root;
  Py_ssize_t max_runs;
  Py_buffer data;
  if (!walk_args(self, "match", args, &root, &max_runs, &data)) return nullptr;
  std::vector<kvmesh::Span> spans;
  std::size_t length = 0;
  bool done = guarded([&] {
    length = self->trie->match(root, static_cast<const char*>(data.buf),
                               static_cast<std::size_t>(data.len),
                               static_cast<std::size_t>(max_runs), touch, clock, spans);
  });
  PyBuffer_Release(&data);
  if (!done) return nullptr;
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(spans.size()));
  if (out == nullptr) return nullptr;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const kvmesh::Span& span = spans[i];
    int tier = static_cast<unsigned char>(span.tiers[0]);
    bool one_tier = span.tiers.find_first_not_of(span.tiers[0]) == std::string::npos;
    PyObject* item = Py_BuildValue(
        "(iniNNN)", span.slot, static_cast<Py_ssize_t>(span.held), tier,
        PyBytes_FromStringAndSize(span.pages.data(), static_cast<Py_ssize_t>(span.pages.size())),
        PyBytes_FromStringAndSize(span.generations.data(),
                                  static_cast<Py_ssize_t>(span.generations.size())),
        PyBytes_FromStringAndSize(one_tier ? "" : span.tiers.data(),
                                  one_tier ? 0 : static_cast<Py_ssize_t>(span.tiers.size())));
    if (item == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), item);
  }
  return Py_BuildValue("(nN)", static_cast<Py_ssize_t>(length), out);
}

PyObject* trie_free(PyObject* object, void*) {
  const auto& free = reinterpret_cast<TrieObject*>(object)->trie->free_nodes();
  return int64_tuple(std::vector<int64_t>(free.begin(), free.end()));
}

PyObject* trie_allocated(PyObject* object, void*) {
  return PyLong_FromSize_t(reinterpret_cast<TrieObject*>(object)->trie->allocated());
}

PyObject* trie_num_pages(PyObject* object, void*) {
  return PyLong_FromSize_t(reinterpret_cast<TrieObject*>(object)->trie->num_pages());
}

PyObject* trie_max_depth(PyObject* object, void*) {
  return PyLong_FromSize_t(reinterpret_cast<TrieObject*>(object)->trie->max_depth());
}

PyObject* trie_room(PyObject* object, void*) {
  auto* self = reinterpret_cast<TrieObject*>(object);
  if (!attached(self)) return nullptr;
  return PyLong_FromSize_t(self->trie->room());
}

PyObject* trie_nbytes(PyObject* object, void*) {
  return PyLong_FromSize_t(reinterpret_cast<TrieObject*>(object)->trie->nbytes());
}

#define FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f)), METH_FASTCALL

PyMethodDef trie_methods[] = {
    {"attach", FASTCALL(trie_attach),
     "attach(tokens, parent, first_child, next_sibling, prev_sibling, key, depth, "
     "last_access, chained, count, slot, page, generation, tier): hold these columns "
     "(after they grew)."},
    {"detach", trie_detach, METH_NOARGS,
     "detach(): let go of the columns (so they can be resized); nothing works until attach."},
    {"walk", FASTCALL(trie_walk),
     "walk(root, data, max_runs) -> (length, runs, nodes): the path `match` takes, as "
     "(first node, pages) runs of consecutive node ids, or, past max_runs runs, every "
     "node (a tuple; runs then empty)."},
    {"match", FASTCALL(trie_match),
     "match(root, data, max_runs, clock) -> (pages, spans): the path of packed prompt "
     "`data` below node `root` (None: no root) and each holder's span along it, "
     "(slot, pages, tier, page_ids, generations, tiers): ids and generations as "
     "little-endian int32 and int64 bytes, tiers one byte a page, empty when all are in "
     "`tier`. Past max_runs runs of consecutive nodes the rest is looked up by keys at "
     "once. clock: the matched pages' last access (None: unchanged)."},
    {"store", FASTCALL(trie_store),
     "store(pages, slot, parent, data, page_ids, generations, tier, clock[, notify]) -> "
     "(placed, tier_delta, removed, demoted, unknown): hang a chain below node `parent`; "
     "placed False: a page id of the chain names a node on its own path. With notify, "
     "each other holder of a node the worker newly holds gets a notice (take_notices)."},
    {"take_notices", FASTCALL(trie_take_notices),
     "take_notices(pages, slot, limit) -> (page_ids, generations): the slot's notices "
     "that still hold (that page id at that generation, held by someone else too), at "
     "most `limit`, each taken once."},
    {"clear_notices", trie_clear_notices, METH_O, "clear_notices(slot): forget its notices."},
    {"notices_waiting", trie_notices_waiting, METH_O,
     "notices_waiting(slot) -> notices waiting for the slot."},
    {"demote", FASTCALL(trie_demote),
     "demote(pages, slot, page_ids, new_page_ids, generations, tier) -> (moved, ...): "
     "move holdings in place; moved False: a new id names an ancestor."},
    {"drop_pages", FASTCALL(trie_drop_pages),
     "drop_pages(pages, slot, page_ids) -> (None, ...): drop the pages and what the worker "
     "holds below them, counted in `removed`."},
    {"drop_subtree", FASTCALL(trie_drop_subtree),
     "drop_subtree(pages, slot, node, counted) -> (dropped, ...)."},
    {"drop_all", FASTCALL(trie_drop_all), "drop_all(pages, slot, counted) -> (dropped, ...)."},
    {"new_root", trie_new_root, METH_O, "new_root(key) -> node: a root with that key."},
    {"release_root", trie_release_root, METH_O, "release_root(node): free an empty root."},
    {"take_emptied_roots", trie_take_emptied_roots, METH_NOARGS,
     "take_emptied_roots() -> roots left without children by the writes since the last call."},
    {"column_of", FASTCALL(trie_column_of),
     "column_of(node, slot) -> the column of the slot's holding (4: beside the columns), "
     "or None."},
    {"extra", trie_extra, METH_O,
     "extra(node) -> ((slot, page, generation, tier), ...): its holders beyond the columns."},
    {"extra_nodes", trie_extra_nodes, METH_NOARGS,
     "extra_nodes() -> the nodes with holders beyond the columns, sorted."},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef trie_getset[] = {
    {"allocated", trie_allocated, nullptr, "node ids handed out", nullptr},
    {"num_pages", trie_num_pages, nullptr, "page nodes in use", nullptr},
    {"max_depth", trie_max_depth, nullptr, "the deepest page ever made", nullptr},
    {"free", trie_free, nullptr, "the free node ids", nullptr},
    {"room", trie_room, nullptr, "nodes it can hand out before the columns grow", nullptr},
    {"nbytes", trie_nbytes, nullptr, "bytes of its own (free list, extra holders)", nullptr},
    {"notices", trie_notices, nullptr, "(notices issued, notices dropped unread)", nullptr},
    {"notice_limit", trie_get_notice_limit, trie_set_notice_limit,
     "notices that wait for one slot at most (the oldest go first)", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject TrieType = {PyVarObject_HEAD_INIT(nullptr, 0) nullptr};  // set at import

// first_outside(values, low, high, distinct) -> the index of the first value that is not
// an int in [low, high] (or, with distinct, repeats an earlier one); -1 when none is.
PyObject* first_outside(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4)
    return PyErr_Format(PyExc_TypeError,
                        "first_outside(values, low, high, distinct) takes 4 arguments");
  int64_t low, high;
  if (!as_key(args[1], &low) || !as_key(args[2], &high)) return nullptr;
  int distinct = PyObject_IsTrue(args[3]);
  if (distinct < 0) return nullptr;
  PyObject* fast = PySequence_Fast(args[0], "values must be a sequence");
  if (fast == nullptr) return nullptr;
  Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  std::vector<std::pair<int64_t, Py_ssize_t>> seen;
  Py_ssize_t bad = -1;
  for (Py_ssize_t i = 0; i < count && bad < 0; ++i) {
    if (!PyLong_Check(items[i])) {
      bad = i;
      break;
    }
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (overflow != 0 || value < low || value > high) bad = i;
    if (distinct) seen.emplace_back(value, i);
  }
  Py_DECREF(fast);
  if (bad < 0 && distinct && seen.size() > 1) {
    std::sort(seen.begin(), seen.end());
    for (std::size_t i = 1; i < seen.size(); ++i)
      if (seen[i].first == seen[i - 1].first && (bad < 0 || seen[i].second < bad))
        bad = seen[i].second;  // the later of the two: pairs sort by value, then index
  }
  return PyLong_FromSsize_t(bad);
}

PyMethodDef module_methods[] = {
    {"first_outside", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(first_outside)),
     METH_FASTCALL,
     "first_outside(values, low, high, distinct) -> the index of the first value that is not "
     "an int in [low, high] (with distinct: or that repeats an earlier one), -1 when none."},
    {nullptr, nullptr, 0, nullptr},
};

// Fill in and ready one of the module's types.
bool ready(PyTypeObject* type, const char* name, const char* doc, std::size_t size, newfunc make,
           destructor dealloc, PyMethodDef* methods, PyGetSetDef* getset) {
  type->tp_name = name;
  type->tp_doc = doc;
  type->tp_basicsize = static_cast<Py_ssize_t>(size);
  type->tp_flags = Py_TPFLAGS_DEFAULT;
  type->tp_new = make;
  type->tp_dealloc = dealloc;
  type->tp_methods = methods;
  type->tp_getset = getset;
  return PyType_Ready(type) == 0;
}

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_compiled",
                          "The global index's compiled parts.", -1, module_methods};

}  // namespace

PyMODINIT_FUNC PyInit__compiled(void) {
#if PY_BIG_ENDIAN
  PyErr_SetString(PyExc_ImportError, "the index's compiled part reads little-endian tokens");
  return nullptr;
#endif
  PyObject* numpy = PyImport_ImportModule("numpy");
  if (numpy == nullptr) return nullptr;
  frombuffer = PyObject_GetAttrString(numpy, "frombuffer");
  Py_DECREF(numpy);
  if (frombuffer == nullptr) return nullptr;
  if (!ready(&KeyTableType, "cache_service.index._compiled.KeyTable",
             "Prefix key -> node ids: a multimap over open addressing (see key_table.hpp).",
             sizeof(KeyTableObject), table_new, table_dealloc, table_methods, table_getset) ||
      !ready(&ChainKeysType, "cache_service.index._compiled.ChainKeys",
             "ChainKeys(page_tokens, secret, collide=False): chained prefix keys "
             "(chain_keys.hpp).",
             sizeof(ChainKeysObject), keys_new, keys_dealloc, keys_methods, keys_getset) ||
      !ready(&PageMapType, "cache_service.index._compiled.PageMap",
             "PageMap(): one worker's page id -> node map (trie.hpp).", sizeof(PageMapObject),
             map_new, map_dealloc, map_methods, map_getset) ||
      !ready(&TrieType, "cache_service.index._compiled.Trie",
             "Trie(table, keys, tiers): the match walk and the writes over a Nodes object's "
             "columns (trie.hpp, walk.hpp), which it holds from `attach` on.",
             sizeof(TrieObject), trie_new, trie_dealloc, trie_methods, trie_getset))
    return nullptr;
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  if (PyModule_AddObjectRef(module, "KeyTable", reinterpret_cast<PyObject*>(&KeyTableType)) < 0 ||
      PyModule_AddObjectRef(module, "ChainKeys", reinterpret_cast<PyObject*>(&ChainKeysType)) <
          0 ||
      PyModule_AddObjectRef(module, "PageMap", reinterpret_cast<PyObject*>(&PageMapType)) < 0 ||
      PyModule_AddObjectRef(module, "Trie", reinterpret_cast<PyObject*>(&TrieType)) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
