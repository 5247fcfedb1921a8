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
    lmc::BlockTransferArgs a;
    a.paged_ptrs = paged_ptrs;
    a.num_paged_ptrs = num_paged_ptrs;
    a.objs.assign(objs, objs + num_objs);
    a.block_ids = block_ids;
    a.num_block_ids = num_block_ids;
    a.block_ids_int32 = block_ids_int32 != 0;
    a.direction = direction;
    a.fmt = fmt;
    a.nl = nl;
    a.nb = nb;
    a.bs = bs;
    a.nh = nh;
    a.hs = hs;
    a.elem = elem;
    a.chunk_tokens = chunk_tokens;
    a.skip_prefix_n_blocks = skip;
    lmc::multi_layer_block_kv_transfer_host(a);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, (size_t)err_len, "%s", e.what());
    return -1;
  }
}
