#include <pybind11/pybind11.h>

#include "connector.h"
#include "connector_pybind_utils.h"

namespace py = pybind11;
using lmc_example::ExampleFSConnector;
using lmc_example::ExampleMemoryConnector;

PYBIND11_MODULE(_native, m) {
  m.doc() = "Example native connectors for the lmcache native_plugin L2 type";
  py::class_<ExampleFSConnector>(m, "ExampleFSConnector")
      .def(py::init<std::string, int>(), py::arg("base_path"), py::arg("num_workers") = 2)
      .def_property_readonly("base_path", &ExampleFSConnector::base_path)
          LMCACHE_BIND_CONNECTOR_METHODS(ExampleFSConnector);
  py::class_<ExampleMemoryConnector>(m, "ExampleMemoryConnector")
      .def(py::init<int>(), py::arg("num_workers") = 2)
      .def("__len__", &ExampleMemoryConnector::size)
          LMCACHE_BIND_CONNECTOR_METHODS(ExampleMemoryConnector);
}
