// Launchers for the CUDA/HIP KV-transfer kernels. Raw pointers and a stream
// handle only: nothing here links against torch's C++ ABI.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kv_layout.h"

namespace lmc {

// Callers build it by aggregate initialization, in this field order.
struct BlockTransferArgs {
  int64_t paged_ptrs;  // device address of an int64 array of plane addresses
  int64_t num_paged_ptrs;
  std::vector<int64_t> objs;  // chunk addresses (pinned host or device)
  int64_t block_ids;          // device (or pinned host) address of the flat ids
  int64_t num_block_ids;
  bool block_ids_int32;
  int direction;
  int fmt;
  int nl;
  int64_t nb, bs, nh, hs, elem;
  int64_t chunk_tokens;
  int64_t skip_prefix_n_blocks;
};

// Validates the arguments (throws std::invalid_argument naming the bad value),
// then launches one kernel per group of kMaxObjects objects on `stream`.
void multi_layer_block_kv_transfer(const BlockTransferArgs& a, int64_t stream);

// The same copy done by the CPU through the kernel's own address math; host memory
// only. Used by the host-side tests to check the kernel logic without a GPU.
void multi_layer_block_kv_transfer_host(const BlockTransferArgs& a);

// Stream-ordered copy split at host_buffer_alignments boundaries.
void memcpy_async(int64_t dest, int64_t src, int64_t nbytes, int direction,
                  int64_t host_buffer_offset, int64_t host_buffer_alignments, int64_t stream);

// Launch planning shared by the GPU launcher and the host emulation: validates the
// arguments (std::invalid_argument naming the bad value) and fills the launch parameters;
// select_object_group() narrows them to objects [first, first + kMaxObjects) and returns
// false when that group has nothing to copy.
TransferParams plan_params(const BlockTransferArgs& a);
bool select_object_group(const BlockTransferArgs& a, TransferParams& P, int64_t first);

// (offset, length) pieces of the split above; exposed for tests.
std::vector<std::pair<int64_t, int64_t>> host_pieces(int64_t host_buffer_offset, int64_t nbytes,
                                                     int64_t host_buffer_alignments);

}  // namespace lmc
