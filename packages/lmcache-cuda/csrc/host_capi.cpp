// C entry point to the kernel's host emulation, for tests that load it with ctypes
// (built with any C++ compiler; no CUDA toolkit needed).
#include <cstdio>
#include <cstring>
#include <exception>

#include "kv_transfer.h"

extern "C" int lmc_block_kv_transfer_host(int64_t paged_ptrs, int64_t num_paged_ptrs,
                                          const int64_t* objs, int64_t num_objs,
                                          int64_t block_ids, int64_t num_block_ids,
                                          int block_ids_int32, int direction, int fmt, int nl,
                                          int64_t nb, int64_t bs, int64_t nh, int64_t hs,
                                          int64_t elem, int64_t chunk_tokens, int64_t skip,
                                          char* err, int64_t err_len) {
  try {
    const std::vector<int64_t> objects(objs, objs + num_objs);
    lmc::multi_layer_block_kv_transfer_host({paged_ptrs, num_paged_ptrs, objects, block_ids,
                                             num_block_ids, block_ids_int32 != 0, direction, fmt,
                                             nl, nb, bs, nh, hs, elem, chunk_tokens, skip});
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, (size_t)err_len, "%s", e.what());
    return -1;
  }
}
