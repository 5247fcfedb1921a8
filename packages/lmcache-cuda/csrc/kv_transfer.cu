// CUDA/HIP kernels: multi_layer_block_kv_transfer and lmcache_memcpy_async.
#include <stdexcept>
#include <string>

#include "gpu_compat.h"
#include "kv_transfer.h"

namespace lmc {

namespace {


// grid: x = flat block position - p_begin, y = layer, z = kv. One CTA copies the
// block's BS*NH rows; threads stride over the row units.
__global__ void block_kv_transfer_kernel(TransferParams P) {
  const int64_t p = P.p_begin + blockIdx.x;
  const int layer = blockIdx.y;
  const int kv = blockIdx.z;
  if (p >= P.p_end) return;
  // Unit chosen once per CTA from the block's first row: every row offset is a
  // multiple of `row`, so the first row's alignment holds for all of them.
  int64_t paged0 = 0, chunk0 = 0;
  if (!row_addresses(P, p, layer, kv, 0, 0, &paged0, &chunk0)) return;
  const int unit = copy_unit(paged0, chunk0, P.row);
  const int64_t units_per_row = P.row / unit;
  const int64_t rows = P.bs * P.nh;
  const int64_t total = rows * units_per_row;
  for (int64_t i = threadIdx.x; i < total; i += blockDim.x) {
    const int64_t r = i / units_per_row;
    const int64_t c = i - r * units_per_row;
    const int64_t tok = r / P.nh;
    const int64_t head = r - tok * P.nh;
    int64_t paged = 0, chunk = 0;
    row_addresses(P, p, layer, kv, tok, head, &paged, &chunk);
    char* dst = reinterpret_cast<char*>(P.direction == D2H ? chunk : paged) + c * unit;
    const char* src = reinterpret_cast<const char*>(P.direction == D2H ? paged : chunk) + c * unit;
    switch (unit) {
      case 16: *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src); break;
      case 8: *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src); break;
      case 4: *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src); break;
      case 2: *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src); break;
      default: *dst = *src; break;
    }
  }
}

void check(gpuError_t err, const char* what) {
  if (err != gpuSuccess)
    throw std::runtime_error(std::string(what) + " failed: " + gpuGetErrorString(err));
}

}  // namespace

void multi_layer_block_kv_transfer(const BlockTransferArgs& a, int64_t stream) {
  TransferParams P = plan_params(a);
  auto s = reinterpret_cast<gpuStream_t>(stream);
  for (int64_t first = 0; first < (int64_t)a.objs.size(); first += kMaxObjects) {
    if (!select_object_group(a, P, first)) continue;
    const dim3 grid((unsigned)(P.p_end - P.p_begin), (unsigned)P.nl, (unsigned)P.L.kv_size);
    block_kv_transfer_kernel<<<grid, 256, 0, s>>>(P);
    check(gpuGetLastError(), "block_kv_transfer_kernel launch");
  }
}

void memcpy_async(int64_t dest, int64_t src, int64_t nbytes, int direction,
                  int64_t host_buffer_offset, int64_t host_buffer_alignments, int64_t stream) {
  if (direction != H2D && direction != D2H)
    throw std::invalid_argument("direction=" + std::to_string(direction) +
                                " must be H2D (0) or D2H (1)");
  auto s = reinterpret_cast<gpuStream_t>(stream);
  for (const auto& piece : host_pieces(host_buffer_offset, nbytes, host_buffer_alignments)) {
    check(gpuMemcpyAsync(reinterpret_cast<void*>(dest + piece.first),
                         reinterpret_cast<const void*>(src + piece.first), (size_t)piece.second,
                         gpuMemcpyDefault, s),
          "lmcache_memcpy_async");
  }
}

}  // namespace lmc
