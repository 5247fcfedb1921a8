// pybind11 glue for connectors built on ConnectorBase
// (docs/design/storage-engine.md#native-contract, docs/design/storage-engine.md#native-framework).
//
//   py::class_<MyConnector>(m, "MyConnector")
//       .def(py::init<std::string, int>(), py::arg("path"), py::arg("num_workers"))
//       LMCACHE_BIND_CONNECTOR_METHODS(MyConnector);
//
// Buffers are read through the buffer protocol while the GIL is held; submits and drains run
// without it, so Python threads keep running while workers do I/O.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "connector_types.h"

namespace lmcache {
namespace connector {
namespace pybind_detail {

namespace py = pybind11;

// Extracts (ptr, len) of every buffer; len is the buffer's size in bytes (size x itemsize).
inline void extract_buffers(const py::sequence& views, bool writable, std::vector<void*>& ptrs,
                            std::vector<size_t>& lens) {
  const size_t n = py::len(views);
  ptrs.reserve(n);
  lens.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    py::object obj = views[i];
    Py_buffer view;
    int flags = PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view, flags) != 0) {
      PyErr_Clear();
      throw std::runtime_error("buffer " + std::to_string(i) +
                               (writable ? " is not a writable buffer" : " is not a buffer") +
                               " (pass a memoryview or tensor storage)");
    }
    const bool contiguous = PyBuffer_IsContiguous(&view, 'C') != 0;
    void* ptr = view.buf;
    const size_t len = static_cast<size_t>(view.len);
    PyBuffer_Release(&view);
    if (!contiguous)
      throw std::runtime_error("buffer " + std::to_string(i) + " is not C-contiguous");
    ptrs.push_back(ptr);
    lens.push_back(len);
  }
}

template <typename T>
uint64_t submit_with_buffers(T& self, Op op, const std::vector<std::string>& keys,
                             const py::sequence& memoryviews) {
  if (keys.size() != static_cast<size_t>(py::len(memoryviews)))
    throw std::runtime_error("keys and memviews size mismatch");
  if (keys.empty()) throw std::runtime_error("keys list is empty");
  std::vector<void*> ptrs;
  std::vector<size_t> lens;
  extract_buffers(memoryviews, op == Op::BATCH_TILE_GET, ptrs, lens);
  const size_t chunk = lens.front();
  py::gil_scoped_release release;
  if (op == Op::BATCH_TILE_GET) return self.submit_batch_get(keys, ptrs, lens, chunk);
  return self.submit_batch_set(keys, ptrs, lens, chunk);
}

template <typename T>
uint64_t submit_keys_only(T& self, Op op, const std::vector<std::string>& keys) {
  if (keys.empty()) throw std::runtime_error("keys list is empty");
  py::gil_scoped_release release;
  if (op == Op::BATCH_TILE_EXISTS) return self.submit_batch_exists(keys);
  return self.submit_batch_delete(keys);
}

// -> list[tuple[future_id, ok, error, list[bool] | None]]
template <typename T>
py::list drain(T& self) {
  std::vector<Completion> completions;
  {
    py::gil_scoped_release release;
    completions = self.drain_completions();
  }
  py::list out;
  for (auto& c : completions) {
    py::object results = py::none();
    if (!c.result_bytes.empty()) {
      py::list bools(c.result_bytes.size());
      for (size_t i = 0; i < c.result_bytes.size(); ++i)
        bools[i] = py::bool_(c.result_bytes[i] != 0);
      results = std::move(bools);
    }
    out.append(py::make_tuple(c.future_id, c.ok, c.error, results));
  }
  return out;
}

template <typename T>
void close(T& self) {
  py::gil_scoped_release release;
  self.close();
}

}  // namespace pybind_detail
}  // namespace connector
}  // namespace lmcache

// Appends the connector's Python methods to a py::class_<Type> chain.
#define LMCACHE_BIND_CONNECTOR_METHODS(Type)                                                   \
  .def("event_fd", [](Type& self) { return self.event_fd(); })                                 \
      .def(                                                                                    \
          "submit_batch_get",                                                                  \
          [](Type& self, const std::vector<std::string>& keys,                                 \
             const pybind11::sequence& memoryviews) {                                          \
            return ::lmcache::connector::pybind_detail::submit_with_buffers(                   \
                self, ::lmcache::connector::Op::BATCH_TILE_GET, keys, memoryviews);            \
          },                                                                                   \
          pybind11::arg("keys"), pybind11::arg("memoryviews"))                                 \
      .def(                                                                                    \
          "submit_batch_set",                                                                  \
          [](Type& self, const std::vector<std::string>& keys,                                 \
             const pybind11::sequence& memoryviews) {                                          \
            return ::lmcache::connector::pybind_detail::submit_with_buffers(                   \
                self, ::lmcache::connector::Op::BATCH_TILE_SET, keys, memoryviews);            \
          },                                                                                   \
          pybind11::arg("keys"), pybind11::arg("memoryviews"))                                 \
      .def(                                                                                    \
          "submit_batch_exists",                                                               \
          [](Type& self, const std::vector<std::string>& keys) {                               \
            return ::lmcache::connector::pybind_detail::submit_keys_only(                      \
                self, ::lmcache::connector::Op::BATCH_TILE_EXISTS, keys);                      \
          },                                                                                   \
          pybind11::arg("keys"))                                                               \
      .def(                                                                                    \
          "submit_batch_delete",                                                               \
          [](Type& self, const std::vector<std::string>& keys) {                               \
            return ::lmcache::connector::pybind_detail::submit_keys_only(                      \
                self, ::lmcache::connector::Op::BATCH_TILE_DELETE, keys);                      \
          },                                                                                   \
          pybind11::arg("keys"))                                                               \
      .def("drain_completions",                                                                \
           [](Type& self) { return ::lmcache::connector::pybind_detail::drain(self); })        \
      .def("close", [](Type& self) { ::lmcache::connector::pybind_detail::close(self); })
