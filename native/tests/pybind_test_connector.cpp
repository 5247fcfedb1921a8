// A pybind11 test connector for the Python-side tests of LMCACHE_BIND_CONNECTOR_METHODS:
// an in-memory map whose submits can be slowed down (to prove the GIL is released) and whose
// connections can be made to fail (to prove failure completions reach Python).
#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "connector_base.h"
#include "connector_pybind_utils.h"

namespace py = pybind11;
using namespace lmcache::connector;

struct TestConn {};

class TestConnector : public ConnectorBase<TestConn> {
 public:
  TestConnector(int num_workers, bool fail_connect_at_start)
      : ConnectorBase<TestConn>(num_workers) {
    fail_connect = fail_connect_at_start;
    start_workers();
  }
  ~TestConnector() override { close(); }

  std::atomic<int> submit_delay_ms{0};
  std::atomic<int> drain_delay_ms{0};
  std::atomic<bool> fail_connect{false};
  // True while a delay runs inside a submit or drain: a Python thread that sees it true ran
  // while the calling thread was inside C++, i.e. the GIL was released.
  std::atomic<bool> in_delay{false};

  std::vector<Completion> drain_completions() override {
    delay(drain_delay_ms.load());
    return ConnectorBase<TestConn>::drain_completions();
  }

 protected:
  TestConn create_connection() override {
    if (fail_connect.load()) throw std::runtime_error("test backend down");
    return TestConn{};
  }
  size_t choose_num_tiles(Op op, size_t n) override {
    // Runs inside submit: a slow submit shows whether the GIL is held.
    delay(submit_delay_ms.load());
    return ConnectorBase<TestConn>::choose_num_tiles(op, n);
  }
  bool do_single_get(TestConn&, const std::string& key, void* buf, size_t len, size_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = data_.find(key);
    if (it == data_.end() || it->second.size() != len) return false;
    std::memcpy(buf, it->second.data(), len);
    return true;
  }
  void do_single_set(TestConn&, const std::string& key, const void* buf, size_t len,
                     size_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    data_[key] = std::string(static_cast<const char*>(buf), len);
  }
  bool do_single_exists(TestConn&, const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    return data_.count(key) != 0;
  }
  bool do_single_delete(TestConn&, const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    return data_.erase(key) != 0;
  }

 private:
  void delay(int ms) {
    if (ms <= 0) return;
    in_delay = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    in_delay = false;
  }

  std::mutex mu_;
  std::unordered_map<std::string, std::string> data_;
};

PYBIND11_MODULE(_lmcache_test_connector, m) {
  py::class_<TestConnector>(m, "TestConnector")
      .def(py::init<int, bool>(), py::arg("num_workers") = 2, py::arg("fail_connect") = false)
      .def("set_submit_delay_ms", [](TestConnector& c, int ms) { c.submit_delay_ms = ms; })
      .def("set_drain_delay_ms", [](TestConnector& c, int ms) { c.drain_delay_ms = ms; })
      .def("in_delay", [](TestConnector& c) { return c.in_delay.load(); })
      .def("set_fail_connect", [](TestConnector& c, bool f) { c.fail_connect = f; })
          LMCACHE_BIND_CONNECTOR_METHODS(TestConnector);
}
