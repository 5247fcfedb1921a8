// The abstract connector: what the pybind layer and NativeConnectorL2Adapter drive
// (docs/design/storage-engine.md#native-contract, docs/design/storage-engine.md#native-framework).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "connector_types.h"

namespace lmcache {
namespace connector {

class IStorageConnector {
 public:
  virtual ~IStorageConnector() = default;

  // One fd for every op; readable once at least one completion is waiting.
  virtual int event_fd() const = 0;

  // Each submit returns a future id at once and never blocks on I/O. Every accepted
  // submit yields exactly one Completion. Buffers must stay valid until that completion
  // has been drained.
  virtual uint64_t submit_batch_get(const std::vector<std::string>& keys,
                                    const std::vector<void*>& bufs,
                                    const std::vector<size_t>& lens,
                                    size_t batch_chunk_num_bytes) = 0;
  virtual uint64_t submit_batch_set(const std::vector<std::string>& keys,
                                    const std::vector<void*>& bufs,
                                    const std::vector<size_t>& lens,
                                    size_t batch_chunk_num_bytes) = 0;
  virtual uint64_t submit_batch_exists(const std::vector<std::string>& keys) = 0;
  virtual uint64_t submit_batch_delete(const std::vector<std::string>& keys) = 0;

  virtual std::vector<Completion> drain_completions() = 0;

  // Idempotent. Stops the workers; synthesises no completions.
  virtual void close() = 0;
};

}  // namespace connector
}  // namespace lmcache
