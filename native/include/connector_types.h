// Value types shared by the native connector framework
// (docs/design/storage-engine.md#native-framework).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace lmcache {
namespace connector {

enum class Op { BATCH_TILE_GET, BATCH_TILE_SET, BATCH_TILE_EXISTS, BATCH_TILE_DELETE };

inline const char* op_name(Op op) {
  switch (op) {
    case Op::BATCH_TILE_GET:
      return "get";
    case Op::BATCH_TILE_SET:
      return "set";
    case Op::BATCH_TILE_EXISTS:
      return "exists";
    case Op::BATCH_TILE_DELETE:
      return "delete";
  }
  return "unknown";
}

// Shared by every tile of one submitted batch. The last tile to finish turns it into
// exactly one Completion.
struct BatchState {
  std::atomic<int> remaining_tiles{0};
  std::atomic<bool> any_failed{false};
  std::mutex error_mutex;
  std::string first_error;
  // One byte per key (never vector<bool>: tiles write neighbouring entries concurrently).
  // Empty for set, which reports no per-key results.
  std::vector<uint8_t> per_key_results;

  void record_error(const std::string& error) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!any_failed.exchange(true)) first_error = error;
  }
};

// One tile: a contiguous slice [start_idx, start_idx + keys.size()) of a batch.
struct Request {
  uint64_t future_id = 0;
  Op op = Op::BATCH_TILE_GET;
  std::vector<std::string> keys;
  std::vector<void*> buf_ptrs;   // empty for exists/delete
  std::vector<size_t> buf_lens;  // empty for exists/delete
  std::shared_ptr<BatchState> batch;
  size_t start_idx = 0;
  // Length of the batch's first buffer, passed for source compatibility; every key is
  // processed with its own buf_lens[i].
  size_t batch_chunk_num_bytes = 0;
};

struct Completion {
  uint64_t future_id = 0;
  bool ok = false;
  // Per key (1 = found / done) for get, exists and delete; empty for set.
  std::vector<uint8_t> result_bytes;
  std::string error;
};

// Dedicated worker pools per operation. Lane keys: "lookup" (exists), "retrieve" (get),
// "store" (set), "delete". Ops without a lane share the main pool.
struct WorkerPoolConfig {
  std::map<std::string, int> per_op_workers;
};

}  // namespace connector
}  // namespace lmcache
