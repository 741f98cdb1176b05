// cache_service.index._compiled: the index's compiled parts, through CPython's C API
// (nothing to build against but Python's headers: the package builds offline wherever
// it installs).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "chain_keys.hpp"
#include "key_table.hpp"
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

// Runs `call`, turning the C++ exceptions of ChainKeys into Python's; false when it threw.
template <typename Call>
bool guarded(Call call) {
  try {
    call();
    return true;
  } catch (const std::length_error& error) {
    PyErr_SetString(PyExc_ValueError, error.what());
  } catch (const std::out_of_range& error) {
    PyErr_SetString(PyExc_ValueError, error.what());
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

// ---- NodeView: the walk over a Nodes object's columns ------------------------------

struct NodeViewObject {
  PyObject_HEAD
  Py_buffer buffers[5];  // tokens, parent, first_child, chained, key
  int held;              // buffers acquired so far
  PyObject* table;       // the KeyTable and ChainKeys objects it walks with
  PyObject* keys;
  kvmesh::NodeColumns columns;
  kvmesh::Walker* walker;
};

void view_dealloc(PyObject* object) {
  auto* self = reinterpret_cast<NodeViewObject*>(object);
  delete self->walker;
  for (int i = 0; i < self->held; ++i) PyBuffer_Release(&self->buffers[i]);
  Py_XDECREF(self->table);
  Py_XDECREF(self->keys);
  Py_TYPE(object)->tp_free(object);
}

// Acquire column `i` of the view: C-contiguous, `itemsize` bytes an item, at least
// `count` items (0: any). False with an exception set when it is not such a buffer.
bool column(NodeViewObject* self, int i, PyObject* array, const char* name, Py_ssize_t itemsize) {
  if (PyObject_GetBuffer(array, &self->buffers[i], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0)
    return false;
  self->held = i + 1;
  if (self->buffers[i].itemsize != itemsize) {
    PyErr_Format(PyExc_TypeError, "NodeView: column %s has %zd-byte items, not %zd", name,
                 self->buffers[i].itemsize, itemsize);
    return false;
  }
  return true;
}

PyObject* view_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"tokens", "parent", "first_child", "chained",
                                "key",    "table",  "keys",        nullptr};
  PyObject *tokens, *parent, *first_child, *chained, *key, *table, *keys;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO!O!", const_cast<char**>(names),
                                   &tokens, &parent, &first_child, &chained, &key,
                                   &KeyTableType, &table, &ChainKeysType, &keys))
    return nullptr;
  auto* self = reinterpret_cast<NodeViewObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  PyObject* object = reinterpret_cast<PyObject*>(self);
  if (!column(self, 0, tokens, "tokens", 4) || !column(self, 1, parent, "parent", 8) ||
      !column(self, 2, first_child, "first_child", 4) || !column(self, 3, chained, "chained", 1) ||
      !column(self, 4, key, "key", 8)) {
    Py_DECREF(object);
    return nullptr;
  }
  Py_ssize_t capacity = self->buffers[1].len / 8;
  auto* chain = reinterpret_cast<ChainKeysObject*>(keys)->keys;
  auto page_bytes = static_cast<Py_ssize_t>(4 * chain->page_tokens());
  if (self->buffers[2].len / 4 != capacity || self->buffers[3].len != capacity ||
      self->buffers[4].len / 8 != capacity || self->buffers[0].len != capacity * page_bytes) {
    Py_DECREF(object);
    return PyErr_Format(PyExc_ValueError, "NodeView: columns of different lengths, or pages "
                        "of another size than the keys' (%zd nodes)", capacity);
  }
  Py_INCREF(table);
  Py_INCREF(keys);
  self->table = table;
  self->keys = keys;
  self->columns = kvmesh::NodeColumns{
      static_cast<const char*>(self->buffers[0].buf),
      static_cast<const int64_t*>(self->buffers[1].buf),
      static_cast<const int32_t*>(self->buffers[2].buf),
      static_cast<const uint8_t*>(self->buffers[3].buf),
      static_cast<const int64_t*>(self->buffers[4].buf),
      static_cast<std::size_t>(capacity),
      static_cast<std::size_t>(page_bytes)};
  self->walker = new (std::nothrow) kvmesh::Walker(
      self->columns, *reinterpret_cast<KeyTableObject*>(table)->table, *chain);
  if (self->walker == nullptr) {
    Py_DECREF(object);
    return PyErr_NoMemory();
  }
  return object;
}

PyObject* view_walk(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<NodeViewObject*>(object);
  if (nargs != 5)
    return PyErr_Format(PyExc_TypeError,
                        "walk(root, data, max_runs, allocated, max_depth) takes 5 arguments");
  int64_t root = kvmesh::kNone;
  if (args[0] != Py_None && !as_key(args[0], &root)) return nullptr;
  Py_ssize_t numbers[3];
  for (int i = 0; i < 3; ++i) {
    numbers[i] = PyLong_AsSsize_t(args[2 + i]);
    if (numbers[i] == -1 && PyErr_Occurred()) return nullptr;
    if (numbers[i] < 0) return PyErr_Format(PyExc_ValueError, "walk: a negative count");
  }
  Py_buffer data;
  if (PyObject_GetBuffer(args[1], &data, PyBUF_SIMPLE) != 0) return nullptr;
  kvmesh::Path path;
  bool done = guarded([&] {
    path = self->walker->walk(root, static_cast<const char*>(data.buf),
                              static_cast<std::size_t>(data.len),
                              static_cast<std::size_t>(numbers[0]),
                              static_cast<std::size_t>(numbers[1]),
                              static_cast<std::size_t>(numbers[2]));
  });
  PyBuffer_Release(&data);
  if (!done) return nullptr;
  if (path.listed) {
    PyObject* nodes = int64_array(path.nodes.data(), path.nodes.size());
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

PyObject* view_child(PyObject* object, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<NodeViewObject*>(object);
  int64_t parent, key;
  if (nargs != 3)
    return PyErr_Format(PyExc_TypeError, "child(parent, key, tokens) takes 3 arguments");
  if (!as_key(args[0], &parent) || !as_key(args[1], &key)) return nullptr;
  Py_buffer tokens;
  if (PyObject_GetBuffer(args[2], &tokens, PyBUF_SIMPLE) != 0) return nullptr;
  int64_t node = kvmesh::kNone;
  if (static_cast<std::size_t>(tokens.len) == self->columns.page_bytes)
    node = self->walker->child(parent, key, static_cast<const char*>(tokens.buf));
  PyBuffer_Release(&tokens);
  if (node == kvmesh::kNone) Py_RETURN_NONE;
  return PyLong_FromLongLong(node);
}

PyMethodDef view_methods[] = {
    {"child", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(view_child)),
     METH_FASTCALL,
     "child(parent, key, tokens) -> node or None: the child of `parent` whose page is "
     "exactly `tokens` (one page), found through its key."},
    {"walk", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(view_walk)),
     METH_FASTCALL,
     "walk(root, data, max_runs, allocated, max_depth) -> (length, runs, nodes): the path "
     "of packed prompt `data` below node `root` (None: no root), as (first node, pages) "
     "runs, or, past max_runs runs, every node (an int64 array; runs then empty)."},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject NodeViewType = {PyVarObject_HEAD_INIT(nullptr, 0) nullptr};  // set at import

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
                          "The global index's compiled parts.", -1, nullptr};

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
      !ready(&NodeViewType, "cache_service.index._compiled.NodeView",
             "NodeView(tokens, parent, first_child, chained, key, table, keys): the match "
             "walk over a Nodes object's columns (walk.hpp), which it holds while it lives.",
             sizeof(NodeViewObject), view_new, view_dealloc, view_methods, nullptr))
    return nullptr;
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  if (PyModule_AddObjectRef(module, "KeyTable", reinterpret_cast<PyObject*>(&KeyTableType)) < 0 ||
      PyModule_AddObjectRef(module, "ChainKeys", reinterpret_cast<PyObject*>(&ChainKeysType)) <
          0 ||
      PyModule_AddObjectRef(module, "NodeView", reinterpret_cast<PyObject*>(&NodeViewType)) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
