// lmcache.storage.fs._native: the fs_native connector for NativeConnectorL2Adapter.
#include <pybind11/pybind11.h>

#include "connector_pybind_utils.h"
#include "fs_connector.h"

namespace py = pybind11;
using lmcache::storage::fs::FSConnector;

PYBIND11_MODULE(_native, m) {
  m.doc() = "C++ file-per-key connector (fs_native)";
  py::class_<FSConnector>(m, "LMCacheFSClient")
      .def(py::init<std::string, int, std::string, bool, size_t, bool, bool>(),
           py::arg("base_path"), py::arg("num_workers") = 4, py::arg("relative_tmp_dir") = "",
           py::arg("use_odirect") = false, py::arg("read_ahead_size") = 0,
           py::arg("fsync") = true, py::arg("allow_tmpfile") = true)
      .def_property_readonly("base_path", &FSConnector::base_path)
      .def_property_readonly("fsync_count", &FSConnector::fsync_count,
                             "Successful file and directory fsyncs so far.")
      .def_property_readonly("publish_mode", &FSConnector::publish_mode,
                             "\"tmpfile\" (O_TMPFILE + linkat) or \"named_temp\".")
          LMCACHE_BIND_CONNECTOR_METHODS(FSConnector);
  m.def("native_key_to_filename", &lmcache::storage::fs::native_key_to_filename, py::arg("key"),
        "The file name fs_native uses for a native key string.");
}
