// Two example connectors built on the lmcache native connector framework:
//   ExampleFSConnector     - one file per key under base_path, written to a temp file and
//                            published with link() so readers never see a partial value;
//   ExampleMemoryConnector - a mutex-guarded in-process map (lost on restart).
// Each overrides create_connection() and the do_single_* operations; ConnectorBase supplies
// the worker threads, batching, completions and the eventfd.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "connector_base.h"

namespace lmc_example {

struct NoConnection {};

class ExampleFSConnector : public lmcache::connector::ConnectorBase<NoConnection> {
 public:
  ExampleFSConnector(std::string base_path, int num_workers);
  ~ExampleFSConnector() override;
  const std::string& base_path() const { return base_path_; }

 protected:
  NoConnection create_connection() override { return {}; }
  bool do_single_get(NoConnection&, const std::string& key, void* buf, size_t len,
                     size_t chunk_size) override;
  void do_single_set(NoConnection&, const std::string& key, const void* buf, size_t len,
                     size_t chunk_size) override;
  bool do_single_exists(NoConnection&, const std::string& key) override;
  bool do_single_delete(NoConnection&, const std::string& key) override;

 private:
  std::string path_for(const std::string& key) const;
  std::string base_path_;
};

class ExampleMemoryConnector : public lmcache::connector::ConnectorBase<NoConnection> {
 public:
  explicit ExampleMemoryConnector(int num_workers);
  ~ExampleMemoryConnector() override;
  size_t size() const;

 protected:
  NoConnection create_connection() override { return {}; }
  bool do_single_get(NoConnection&, const std::string& key, void* buf, size_t len,
                     size_t chunk_size) override;
  void do_single_set(NoConnection&, const std::string& key, const void* buf, size_t len,
                     size_t chunk_size) override;
  bool do_single_exists(NoConnection&, const std::string& key) override;
  bool do_single_delete(NoConnection&, const std::string& key) override;

 private:
  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::vector<uint8_t>> data_;
};

}  // namespace lmc_example
