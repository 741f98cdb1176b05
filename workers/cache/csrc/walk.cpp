// workers.cache._walk: the local prefix trie's walk of a prompt (workers/cache/trie.py,
// Trie.match and Trie.match_length), compiled. The runs stay Python objects
// (workers/cache/runs.py, with __slots__) that the cache's other parts change; the walk
// reads them through their attributes and compares packed token bytes with memcmp, where
// the Python loop spent a bytecode dispatch, a slice and an attribute load per step.
// CPython's C API only, as the service's compiled modules.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstring>

namespace {

constexpr Py_ssize_t kTokenBytes = 4;

PyObject* s_children = nullptr;
PyObject* s_by_first = nullptr;
PyObject* s_ready = nullptr;
PyObject* s_key = nullptr;
PyObject* s_head = nullptr;

// A run's attribute as a new reference; nullptr with an exception set when it is missing.
inline PyObject* attr(PyObject* run, PyObject* name) { return PyObject_GetAttr(run, name); }

// Whether `run` is published: 1, 0, or -1 with an exception set.
int is_ready(PyObject* run) {
  PyObject* ready = attr(run, s_ready);
  if (ready == nullptr) return -1;
  int truth = PyObject_IsTrue(ready);
  Py_DECREF(ready);
  return truth;
}

// A run's packed bytes attribute (key or head), checked to be bytes.
PyObject* bytes_attr(PyObject* run, PyObject* name) {
  PyObject* value = attr(run, name);
  if (value != nullptr && !PyBytes_CheckExact(value)) {
    PyErr_Format(PyExc_TypeError, "a run's %U is %s, not bytes", name, Py_TYPE(value)->tp_name);
    Py_CLEAR(value);
  }
  return value;
}

// The child of `node` whose first page is `head` (a borrowed reference), nullptr when none;
// -1 in *error with an exception set when the node is not a run.
PyObject* child_of(PyObject* node, PyObject* head, int* error) {
  PyObject* children = attr(node, s_children);
  if (children == nullptr) {
    *error = -1;
    return nullptr;
  }
  PyObject* child = nullptr;
  if (PyDict_CheckExact(children)) {
    child = PyDict_GetItemWithError(children, head);  // borrowed; the dict keeps it alive
    if (child == nullptr && PyErr_Occurred()) *error = -1;
  } else if (children != Py_None) {
    PyErr_Format(PyExc_TypeError, "a run's children are %s, not a dict", Py_TYPE(children)->tp_name);
    *error = -1;
  }
  Py_DECREF(children);
  return child;
}

// Leading whole pages of `key` that `packed` holds from byte `at`.
Py_ssize_t common_pages(const char* key, Py_ssize_t key_len, const char* packed,
                        Py_ssize_t packed_len, Py_ssize_t at, Py_ssize_t step) {
  Py_ssize_t most = (key_len < packed_len - at ? key_len : packed_len - at) / step;
  Py_ssize_t pages = 0;
  while (pages < most && std::memcmp(key + pages * step, packed + at + pages * step, step) == 0)
    ++pages;
  return pages;
}

// Leading tokens two packed pages share.
Py_ssize_t common_tokens(const char* a, Py_ssize_t a_len, const char* b, Py_ssize_t b_len) {
  Py_ssize_t most = (a_len < b_len ? a_len : b_len) / kTokenBytes;
  Py_ssize_t tokens = 0;
  while (tokens < most &&
         std::memcmp(a + tokens * kTokenBytes, b + tokens * kTokenBytes, kTokenBytes) == 0)
    ++tokens;
  return tokens;
}

// The published child of `node` sharing the most leading tokens with `rest` (the prompt's
// next page, maybe short), as Run.starting_with would list them; *best its token count.
// A new reference or None; nullptr with an exception set.
PyObject* best_partial(PyObject* node, const char* rest, Py_ssize_t rest_len, Py_ssize_t* best) {
  PyObject* candidates = nullptr;  // a list or the values of a dict, or nullptr: no children
  PyObject* by_first = attr(node, s_by_first);
  if (by_first == nullptr) return nullptr;
  if (by_first != Py_None) {
    if (!PyDict_CheckExact(by_first)) {
      Py_DECREF(by_first);
      return PyErr_Format(PyExc_TypeError, "a run's by_first is not a dict");
    }
    PyObject* first = PyBytes_FromStringAndSize(rest, kTokenBytes);
    if (first == nullptr) {
      Py_DECREF(by_first);
      return nullptr;
    }
    candidates = PyDict_GetItemWithError(by_first, first);
    Py_DECREF(first);
    Py_XINCREF(candidates);
    Py_DECREF(by_first);
    if (candidates == nullptr && PyErr_Occurred()) return nullptr;
  } else {
    Py_DECREF(by_first);
    PyObject* children = attr(node, s_children);
    if (children == nullptr) return nullptr;
    if (PyDict_CheckExact(children)) candidates = PyDict_Values(children);
    Py_DECREF(children);
    if (candidates == nullptr && PyErr_Occurred()) return nullptr;
  }
  PyObject* partial = nullptr;
  *best = 0;
  if (candidates != nullptr) {
    if (!PyList_CheckExact(candidates)) {
      Py_DECREF(candidates);
      return PyErr_Format(PyExc_TypeError, "a run's children by first token are not a list");
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(candidates); ++i) {
      PyObject* child = PyList_GET_ITEM(candidates, i);
      PyObject* head = bytes_attr(child, s_head);
      if (head == nullptr) {
        Py_DECREF(candidates);
        Py_XDECREF(partial);
        return nullptr;
      }
      Py_ssize_t head_len = PyBytes_GET_SIZE(head);
      const char* head_bytes = PyBytes_AS_STRING(head);
      // Only children whose first token is the prompt's next one (by_first lists only
      // those; a scan of every child checks it here).
      bool starts = head_len >= kTokenBytes && std::memcmp(head_bytes, rest, kTokenBytes) == 0;
      Py_ssize_t common = starts ? common_tokens(head_bytes, head_len, rest, rest_len) : 0;
      Py_DECREF(head);
      if (common <= *best) continue;
      Py_INCREF(child);
      int ready = is_ready(child);
      Py_DECREF(child);  // the list holds it
      if (ready < 0) {
        Py_DECREF(candidates);
        Py_XDECREF(partial);
        return nullptr;
      }
      if (ready) {
        Py_INCREF(child);
        Py_XSETREF(partial, child);
        *best = common;
      }
    }
    Py_DECREF(candidates);
  }
  if (partial == nullptr) Py_RETURN_NONE;
  return partial;
}

// walk(root, packed, step, owners) -> (walked, end, partial, partial_len); see trie.py.
PyObject* walk(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) return PyErr_Format(PyExc_TypeError, "walk(root, packed, step, owners)");
  PyObject* node = args[0];
  PyObject* packed = args[1];
  PyObject* owners = args[3];
  if (!PyBytes_CheckExact(packed) || !PyDict_CheckExact(owners))
    return PyErr_Format(PyExc_TypeError, "walk takes packed bytes and a dict of owners");
  Py_ssize_t step = PyLong_AsSsize_t(args[2]);
  if (step == -1 && PyErr_Occurred()) return nullptr;
  if (step <= 0 || step % kTokenBytes != 0)
    return PyErr_Format(PyExc_ValueError, "walk: a page of %zd bytes", step);
  const char* data = PyBytes_AS_STRING(packed);
  Py_ssize_t size = PyBytes_GET_SIZE(packed);
  if (size % kTokenBytes != 0)
    return PyErr_Format(PyExc_ValueError, "walk: %zd bytes of packed tokens", size);

  PyObject* walked = PyList_New(0);
  if (walked == nullptr) return nullptr;
  Py_ssize_t end = 0;
  PyObject* inside = nullptr;  // borrowed (walked holds it): the run the prompt leaves partway
  Py_ssize_t inside_at = 0;
  bool failed = false;
  // `node` is borrowed throughout: the root from the caller, then runs that `walked` holds.
  while (node != Py_None && end + step <= size) {
    PyObject* head = PyBytes_FromStringAndSize(data + end, step);
    if (head == nullptr) {
      failed = true;
      break;
    }
    int error = 0;
    PyObject* child = child_of(node, head, &error);
    Py_DECREF(head);
    if (error) {
      failed = true;
      break;
    }
    if (child == nullptr) break;
    Py_INCREF(child);  // held while its attributes are read
    int ready = is_ready(child);
    int owned = ready != 0 ? ready : PyDict_Contains(owners, child);
    PyObject* key = owned > 0 ? bytes_attr(child, s_key) : nullptr;
    if (owned < 0 || (owned > 0 && (key == nullptr || PyList_Append(walked, child) != 0))) {
      Py_XDECREF(key);
      Py_DECREF(child);
      failed = true;
      break;
    }
    Py_DECREF(child);  // `walked` holds it from here on
    if (owned == 0) break;
    Py_ssize_t key_len = PyBytes_GET_SIZE(key);
    const char* key_bytes = PyBytes_AS_STRING(key);
    if (key_len <= size - end && std::memcmp(key_bytes, data + end, key_len) == 0) {
      Py_DECREF(key);
      end += key_len;
      node = child;
      continue;
    }
    inside = child;
    inside_at = end;
    // Its first page matched (the dict's key): at least one page.
    Py_ssize_t pages = common_pages(key_bytes, key_len, data, size, end, step);
    Py_DECREF(key);
    end += (pages > 0 ? pages : 1) * step;
    break;
  }
  if (failed) {
    Py_DECREF(walked);
    return nullptr;
  }

  PyObject* partial = nullptr;
  Py_ssize_t partial_len = 0;
  if (node != Py_None && end < size) {
    const char* rest = data + end;
    Py_ssize_t rest_len = size - end < step ? size - end : step;
    if (inside != nullptr) {
      // Left inside a run: its next page is the only candidate.
      int ready = is_ready(inside);
      if (ready < 0) {
        Py_DECREF(walked);
        return nullptr;
      }
      if (ready) {
        PyObject* key = bytes_attr(inside, s_key);
        if (key == nullptr) {
          Py_DECREF(walked);
          return nullptr;
        }
        Py_ssize_t offset = end - inside_at;
        Py_ssize_t key_len = PyBytes_GET_SIZE(key);
        Py_ssize_t page_len = offset >= key_len ? 0 : (key_len - offset < step ? key_len - offset : step);
        partial_len = common_tokens(PyBytes_AS_STRING(key) + offset, page_len, rest, rest_len);
        Py_DECREF(key);
        if (partial_len) {
          Py_INCREF(inside);
          partial = inside;
        }
      }
    } else {
      partial = best_partial(node, rest, rest_len, &partial_len);
      if (partial == nullptr) {
        Py_DECREF(walked);
        return nullptr;
      }
    }
  }
  if (partial == nullptr) {
    Py_INCREF(Py_None);
    partial = Py_None;
  }
  return Py_BuildValue("(NnNn)", walked, end, partial, partial_len);
}

#define FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f)), METH_FASTCALL

PyMethodDef methods[] = {
    {"walk", FASTCALL(walk),
     "walk(root, packed, step, owners) -> (walked, end, partial, partial_len): the runs a "
     "prompt's whole pages match from `root` (published, or pending in `owners`), the bytes "
     "they cover, and the published page sharing the most leading tokens with the next one "
     "(None, 0 when none)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_walk",
                          "The local prefix trie's walk, compiled.", -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__walk(void) {
  const char* names[] = {"children", "by_first", "ready", "key", "head"};
  PyObject** slots[] = {&s_children, &s_by_first, &s_ready, &s_key, &s_head};
  for (int i = 0; i < 5; ++i) {
    *slots[i] = PyUnicode_InternFromString(names[i]);
    if (*slots[i] == nullptr) return nullptr;
  }
  return PyModule_Create(&module_def);
}
