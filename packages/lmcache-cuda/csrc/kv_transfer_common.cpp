// Argument checks and launch planning shared by the GPU launcher and the host
// emulation. Plain C++ (no device code).
#include <cstring>
#include <stdexcept>
#include <string>

#include "kv_transfer.h"

namespace lmc {

namespace {
std::string str(int64_t v) { return std::to_string(v); }
}  // namespace

TransferParams plan_params(const BlockTransferArgs& a) {
  if (a.chunk_tokens <= 0 || a.bs <= 0 || a.chunk_tokens % a.bs != 0)
    throw std::invalid_argument("lmcache_chunk_size=" + str(a.chunk_tokens) +
                                " must be positive and divisible by block size " + str(a.bs));
  if (a.skip_prefix_n_blocks < 0)
    throw std::invalid_argument("skip_prefix_n_blocks=" + str(a.skip_prefix_n_blocks) +
                                " must be >= 0");
  if (a.direction != H2D && a.direction != D2H)
    throw std::invalid_argument("direction=" + str(a.direction) + " must be H2D (0) or D2H (1)");
  TransferParams P{};
  P.L = paged_layout(a.fmt, a.nl, a.nb, a.bs, a.nh, a.hs, a.elem);
  if (!P.L.ok)
    throw std::invalid_argument("engine_kv_format=" + str(a.fmt) +
                                " has no pointer form or the shape is invalid");
  if (a.num_paged_ptrs != P.L.num_ptrs)
    throw std::invalid_argument("engine_kv_format=" + str(a.fmt) + " needs " +
                                str(P.L.num_ptrs) + " paged pointers, got " +
                                str(a.num_paged_ptrs));
  const int64_t bpo = a.chunk_tokens / a.bs;
  if (a.num_block_ids > (int64_t)a.objs.size() * bpo)
    throw std::invalid_argument("len(block_ids)=" + str(a.num_block_ids) + " exceeds " +
                                str((int64_t)a.objs.size()) + " objects x " + str(bpo) +
                                " blocks per object");
  P.paged_ptrs = reinterpret_cast<const int64_t*>(a.paged_ptrs);
  P.block_ids = reinterpret_cast<const void*>(a.block_ids);
  P.block_ids_int32 = a.block_ids_int32 ? 1 : 0;
  P.bpo = bpo;
  P.chunk_tokens = a.chunk_tokens;
  P.nl = a.nl;
  P.bs = a.bs;
  P.nh = a.nh;
  P.row = a.hs * a.elem;
  P.direction = a.direction;
  return P;
}

bool select_object_group(const BlockTransferArgs& a, TransferParams& P, int64_t first) {
  const int64_t n = (int64_t)a.objs.size();
  const int64_t last = first + kMaxObjects < n ? first + kMaxObjects : n;
  P.num_objs = (int)(last - first);
  P.obj_base = first;
  for (int64_t i = first; i < last; ++i) P.objs[i - first] = a.objs[i];
  const int64_t begin = first * P.bpo;
  P.p_begin = begin > a.skip_prefix_n_blocks ? begin : a.skip_prefix_n_blocks;
  const int64_t end = last * P.bpo;
  P.p_end = end < a.num_block_ids ? end : a.num_block_ids;
  return P.p_begin < P.p_end;
}

void multi_layer_block_kv_transfer_host(const BlockTransferArgs& a) {
  TransferParams P = plan_params(a);
  for (int64_t first = 0; first < (int64_t)a.objs.size(); first += kMaxObjects) {
    if (!select_object_group(a, P, first)) continue;
    for (int64_t p = P.p_begin; p < P.p_end; ++p)
      for (int layer = 0; layer < P.nl; ++layer)
        for (int kv = 0; kv < P.L.kv_size; ++kv)
          for (int64_t tok = 0; tok < P.bs; ++tok)
            for (int64_t head = 0; head < P.nh; ++head) {
              int64_t paged = 0, chunk = 0;
              if (!row_addresses(P, p, layer, kv, tok, head, &paged, &chunk)) continue;
              void* dst = reinterpret_cast<void*>(P.direction == D2H ? chunk : paged);
              const void* src = reinterpret_cast<const void*>(P.direction == D2H ? paged : chunk);
              std::memmove(dst, src, (size_t)P.row);
            }
  }
}

std::vector<std::pair<int64_t, int64_t>> host_pieces(int64_t host_buffer_offset, int64_t nbytes,
                                                     int64_t host_buffer_alignments) {
  if (host_buffer_alignments <= 0 || (host_buffer_alignments & (host_buffer_alignments - 1)))
    throw std::invalid_argument("host_buffer_alignments=" + str(host_buffer_alignments) +
                                " must be a positive power of two");
  if (nbytes < 0 || host_buffer_offset < 0)
    throw std::invalid_argument("nbytes=" + str(nbytes) + " and host_buffer_offset=" +
                                str(host_buffer_offset) + " must be >= 0");
  const int n = split_host_ranges(host_buffer_offset, nbytes, host_buffer_alignments, nullptr,
                                  nullptr, 0);
  std::vector<int64_t> offs(n), lens(n);
  split_host_ranges(host_buffer_offset, nbytes, host_buffer_alignments, offs.data(), lens.data(),
                    n);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int i = 0; i < n; ++i) out.emplace_back(offs[i], lens[i]);
  return out;
}

}  // namespace lmc
