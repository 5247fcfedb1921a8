// lmcache.storage.redis._native: the resp connector for NativeConnectorL2Adapter.
#include <pybind11/pybind11.h>

#include "connector_pybind_utils.h"
#include "resp_connector.h"

namespace py = pybind11;
using lmcache::storage::redis::RespConnector;
using lmcache::storage::redis::RespOptions;

static RespConnector* make_client(const std::string& host, int port, int num_workers,
                                  const std::string& username, const std::string& password,
                                  int db, int pipeline_depth, double socket_timeout_s) {
  RespOptions o;
  o.host = host;
  o.port = port;
  o.username = username;
  o.password = password;
  o.db = db;
  o.pipeline_depth = pipeline_depth;
  o.socket_timeout_s = socket_timeout_s;
  return new RespConnector(o, num_workers);
}

PYBIND11_MODULE(_native, m) {
  m.doc() = "C++ RESP2 connector (resp / redis)";
  py::class_<RespConnector>(m, "LMCacheRedisClient")
      .def(py::init(&make_client), py::arg("host"), py::arg("port"), py::arg("num_workers") = 8,
           py::arg("username") = "", py::arg("password") = "", py::arg("db") = 0,
           py::arg("pipeline_depth") = 16, py::arg("socket_timeout_s") = 10.0)
          LMCACHE_BIND_CONNECTOR_METHODS(RespConnector);
}
