// Address math shared by the GPU kernel and its host-side emulation/tests.
// No CUDA runtime calls here: this header also compiles with a plain C++ compiler.
//
// The engine's paged KV cache is described by planes: plane (layer, kv) has a base
// address, and element (block, token-in-block, head, d) of it lives at
//   base + block * s_block + token * s_tok + head * s_head + d * elem   (bytes).
// The LMCache host chunk is token-major (docs/design/storage-formats.md#host-chunk):
//   kv_size == 2: [2, NL, T, NH*HS]      kv_size == 1: [NL, T, NH*HS]
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define LMC_HD __host__ __device__ __forceinline__
#else
#define LMC_HD inline
#endif

namespace lmc {

// Values fixed by the spec (EngineKVFormat, docs/design/platform.md#kv-formats).
enum EngineKVFormat : int {
  NB_NL_TWO_BS_NH_HS = 0,
  NL_X_TWO_NB_BS_NH_HS = 1,
  NL_X_NB_TWO_BS_NH_HS = 2,
  NL_X_NB_BS_HS = 3,
  TWO_X_NL_X_NBBS_NH_HS = 4,
  NL_X_NBBS_ONE_HS = 5,
  NL_X_TWO_NB_NH_BS_HS = 6,
  NL_X_NB_TWO_NH_BS_HS = 7,
  NB_NL_TWO_NH_BS_HS = 8,
  TWO_X_NL_X_NB_BS_NH_HS = 9,
  NL_X_NB_NH_BS_TWO_HS = 10,
  NL_X_NB_BS_NH_TWO_HS = 11,
  NL_X_NB_NH_BS_CS = 12,
  NL_X_NB_BS_NH_CS = 13,
  NL_X_NB_BSV_BSS = 14,
  NL_X_TWO_NB_NH_ONE_BS_HS = 15,
  NL_X_TWO_X_NB_BS_NH_HS = 16,
  NL_X_NP_X_NB_BS_ONE_HS = 17,
  NL_X_NB_BS_NH_HS = 18,
};

enum Direction : int { H2D = 0, D2H = 1 };

// How plane base addresses derive from the pointer array the caller passes.
enum PtrMode : int {
  PER_LAYER = 0,    // ptrs[layer] (+ kv * kv_off)
  KV_LIST = 1,      // ptrs[kv * NL + layer]
  CROSS_LAYER = 2,  // ptrs[0] + layer * layer_off + kv * kv_off
};

struct PagedLayout {
  int ok;        // 0: format has no pointer form (tuple formats) or bad shape
  int ptr_mode;  // PtrMode
  int kv_size;   // 1 or 2
  int num_ptrs;  // pointers the caller must pass
  int64_t s_block, s_tok, s_head, kv_off, layer_off;  // bytes
};

// Layout of one format for the shape (nl, nb, bs, nh, hs) with `elem`-byte elements.
// For fused-packed formats `hs` is the packed width (2*HS or CS), as in shape_desc.
LMC_HD PagedLayout paged_layout(int fmt, int nl, int64_t nb, int64_t bs, int64_t nh, int64_t hs,
                                int64_t elem) {
  PagedLayout L{};
  const int64_t row = hs * elem;        // one head's bytes
  const int64_t block = bs * nh * row;  // one block of one plane, in either row order
  const bool head_major = fmt == NB_NL_TWO_NH_BS_HS || fmt == NL_X_TWO_NB_NH_BS_HS ||
                          fmt == NL_X_TWO_NB_NH_ONE_BS_HS || fmt == NL_X_NB_TWO_NH_BS_HS ||
                          fmt == NL_X_NB_NH_BS_TWO_HS || fmt == NL_X_NB_NH_BS_CS;
  // Inside a block: HND [NH, BS, HS] or NHD [BS, NH, HS] (MLA: nh == 1).
  L.s_head = head_major ? bs * row : row;
  L.s_tok = head_major ? row : nh * row;
  L.ok = 1;
  L.kv_size = 2;
  L.ptr_mode = PER_LAYER;
  L.num_ptrs = nl;
  // Where the blocks, the K/V planes and the layers sit around that block.
  switch (fmt) {
    case NB_NL_TWO_BS_NH_HS:  // one tensor [NB, NL, 2, BS, NH, HS]
    case NB_NL_TWO_NH_BS_HS:  // one tensor [NB, NL, 2, NH, BS, HS]
      L.ptr_mode = CROSS_LAYER;
      L.num_ptrs = 1;
      L.kv_off = block;
      L.layer_off = 2 * block;
      L.s_block = nl * L.layer_off;
      break;
    case NL_X_TWO_NB_BS_NH_HS:      // [2, NB, BS, NH, HS]
    case NL_X_TWO_NB_NH_BS_HS:      // [2, NB, NH, BS, HS]
    case NL_X_TWO_NB_NH_ONE_BS_HS:  // [2, NB, NH, 1, BS, HS]: same bytes
      L.s_block = block;
      L.kv_off = nb * block;
      break;
    case NL_X_NB_TWO_BS_NH_HS:  // [NB, 2, BS, NH, HS]
    case NL_X_NB_TWO_NH_BS_HS:  // [NB, 2, NH, BS, HS]
      L.kv_off = block;
      L.s_block = 2 * block;
      break;
    case TWO_X_NL_X_NBBS_NH_HS:   // 2 x NL x [NB*BS, NH, HS]
    case TWO_X_NL_X_NB_BS_NH_HS:  // 2 x NL x [NB, BS, NH, HS]
      L.ptr_mode = KV_LIST;
      L.num_ptrs = 2 * nl;
      L.s_block = block;
      break;
    case NL_X_NB_BS_HS:         // MLA [NB, BS, HS]
    case NL_X_NBBS_ONE_HS:      // [NB*BS, 1, HS]
    case NL_X_NB_BSV_BSS:       // [NB, BS, 132] uint8
    case NL_X_NB_NH_BS_TWO_HS:  // fused HND [NB, NH, BS, hs']
    case NL_X_NB_NH_BS_CS:
    case NL_X_NB_BS_NH_TWO_HS:  // fused NHD [NB, BS, NH, hs']
    case NL_X_NB_BS_NH_CS:
    case NL_X_NB_BS_NH_HS:  // single_kv
      L.kv_size = 1;
      L.s_block = block;
      break;
    default:  // tuple formats (#16, #17) have no pointer form
      L.ok = 0;
      break;
  }
  if (nl <= 0 || nb <= 0 || bs <= 0 || nh <= 0 || hs <= 0 || elem <= 0) L.ok = 0;
  return L;
}

// Everything one launch needs; plain data, passed to the kernel by value.
constexpr int kMaxObjects = 4;  // objects per launch (by-value parameter array)

struct TransferParams {
  const int64_t* paged_ptrs;  // PagedLayout::num_ptrs plane addresses
  const void* block_ids;      // flat block ids, chunk-token order
  int block_ids_int32;        // element type of block_ids
  int64_t objs[kMaxObjects];  // chunk base addresses of objects obj_base .. obj_base+num_objs-1
  int num_objs;
  int64_t obj_base;
  int64_t p_begin, p_end;  // flat block positions handled by this launch
  int64_t bpo;             // blocks per object (chunk_size / bs)
  int64_t chunk_tokens;    // T
  int nl;
  int64_t bs, nh, row;  // row = hs * elem bytes
  int direction;
  PagedLayout L;
};

LMC_HD int64_t block_id_at(const TransferParams& P, int64_t p) {
  return P.block_ids_int32 ? (int64_t)((const int32_t*)P.block_ids)[p]
                           : ((const int64_t*)P.block_ids)[p];
}

LMC_HD int64_t plane_base(const TransferParams& P, int layer, int kv) {
  switch (P.L.ptr_mode) {
    case KV_LIST:
      return P.paged_ptrs[kv * P.nl + layer];
    case CROSS_LAYER:
      return P.paged_ptrs[0] + layer * P.L.layer_off + kv * P.L.kv_off;
    default:
      return P.paged_ptrs[layer] + kv * P.L.kv_off;
  }
}

// Byte offsets of row (token, head) of block position p, for plane (layer, kv).
// Returns false when p belongs to no object of this launch.
LMC_HD bool row_addresses(const TransferParams& P, int64_t p, int layer, int kv, int64_t tok,
                          int64_t head, int64_t* paged_addr, int64_t* chunk_addr) {
  const int64_t obj = p / P.bpo;
  const int64_t slot = obj - P.obj_base;
  if (slot < 0 || slot >= P.num_objs) return false;
  const int64_t t = (p - obj * P.bpo) * P.bs + tok;  // token inside the chunk
  const int64_t bid = block_id_at(P, p);
  *paged_addr = plane_base(P, layer, kv) + bid * P.L.s_block + tok * P.L.s_tok + head * P.L.s_head;
  const int64_t width = P.nh * P.row;
  *chunk_addr = P.objs[slot] + (((int64_t)kv * P.nl + layer) * P.chunk_tokens + t) * width + head * P.row;
  return true;
}

// Widest copy unit (16/8/4/2/1 bytes) that every address and the row length allow.
LMC_HD int copy_unit(int64_t a, int64_t b, int64_t row) {
  const uint64_t m = (uint64_t)a | (uint64_t)b | (uint64_t)row;
  if ((m & 15) == 0) return 16;
  if ((m & 7) == 0) return 8;
  if ((m & 3) == 0) return 4;
  if ((m & 1) == 0) return 2;
  return 1;
}

// Host-range splitting for lmcache_memcpy_async: pieces never cross a multiple of
// `align` measured from the allocator base (each piece stays in one registration).
// Writes at most max_pieces (offset-into-copy, length) pairs; returns the piece count.
inline int split_host_ranges(int64_t host_offset, int64_t nbytes, int64_t align, int64_t* offs,
                             int64_t* lens, int max_pieces) {
  int n = 0;
  int64_t done = 0;
  while (done < nbytes) {
    const int64_t pos = host_offset + done;
    const int64_t room = align - (pos % align);
    const int64_t len = (nbytes - done) < room ? (nbytes - done) : room;
    if (n < max_pieces) {
      offs[n] = done;
      lens[n] = len;
    }
    ++n;
    done += len;
  }
  return n;
}

}  // namespace lmc
