// pybind11 module lmcache.devices.<cuda|rocm>._C: integers in, integers out.
// The Python shim (cuda_ops.py) turns tensors into addresses and passes the
// current stream handle, so this module never touches torch's C++ ABI.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

#include "kv_transfer.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "LMCache CUDA/HIP KV-transfer kernels (raw pointers + stream handle)";
  py::register_exception<std::invalid_argument>(m, "KernelArgumentError", PyExc_ValueError);

  m.def(
      "block_kv_transfer",
      [](int64_t paged_ptrs, int64_t num_paged_ptrs, std::vector<int64_t> objs, int64_t block_ids,
         int64_t num_block_ids, bool block_ids_int32, int direction, int fmt, int nl, int64_t nb,
         int64_t bs, int64_t nh, int64_t hs, int64_t elem, int64_t chunk_tokens, int64_t skip,
         int64_t stream) {
        const lmc::BlockTransferArgs a{paged_ptrs, num_paged_ptrs, std::move(objs), block_ids,
                                       num_block_ids, block_ids_int32, direction, fmt, nl, nb, bs,
                                       nh, hs, elem, chunk_tokens, skip};
        py::gil_scoped_release release;
        lmc::multi_layer_block_kv_transfer(a, stream);
      },
      "Launch the block KV transfer on `stream` (all addresses device-visible).");

  m.def(
      "block_kv_transfer_host",
      [](int64_t paged_ptrs, int64_t num_paged_ptrs, std::vector<int64_t> objs, int64_t block_ids,
         int64_t num_block_ids, bool block_ids_int32, int direction, int fmt, int nl, int64_t nb,
         int64_t bs, int64_t nh, int64_t hs, int64_t elem, int64_t chunk_tokens, int64_t skip) {
        lmc::multi_layer_block_kv_transfer_host({paged_ptrs, num_paged_ptrs, std::move(objs),
                                                 block_ids, num_block_ids, block_ids_int32,
                                                 direction, fmt, nl, nb, bs, nh, hs, elem,
                                                 chunk_tokens, skip});
      },
      "The kernel's address math run on the CPU over host memory (tests only).");

  m.def(
      "memcpy_async",
      [](int64_t dest, int64_t src, int64_t nbytes, int direction, int64_t host_buffer_offset,
         int64_t host_buffer_alignments, int64_t stream) {
        py::gil_scoped_release release;
        lmc::memcpy_async(dest, src, nbytes, direction, host_buffer_offset,
                          host_buffer_alignments, stream);
      },
      "Stream-ordered copy split at host_buffer_alignments boundaries.");

  m.def("host_pieces", &lmc::host_pieces,
        "(offset, length) pieces lmcache_memcpy_async issues for a host range.");

  m.def("paged_layout", [](int fmt, int nl, int64_t nb, int64_t bs, int64_t nh, int64_t hs,
                           int64_t elem) {
    const lmc::PagedLayout L = lmc::paged_layout(fmt, nl, nb, bs, nh, hs, elem);
    py::dict d;
    d["ok"] = L.ok != 0;
    d["ptr_mode"] = L.ptr_mode;
    d["kv_size"] = L.kv_size;
    d["num_ptrs"] = L.num_ptrs;
    d["s_block"] = L.s_block;
    d["s_tok"] = L.s_tok;
    d["s_head"] = L.s_head;
    d["kv_off"] = L.kv_off;
    d["layer_off"] = L.layer_off;
    return d;
  });
  m.attr("MAX_OBJECTS_PER_LAUNCH") = lmc::kMaxObjects;
}
