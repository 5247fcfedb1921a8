// Host-side unit tests of the kernel address math (no GPU needed): for every
// pointer-form format, the CPU emulation of the kernel must produce the canonical
// token-major chunk computed here by explicit N-d indexing, and H2D must restore it.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "../kv_transfer.h"

using namespace lmc;

static int failures = 0;
#define EXPECT(cond, ...)                  \
  do {                                     \
    if (!(cond)) {                         \
      ++failures;                          \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);            \
      std::printf("\n");                   \
    }                                      \
  } while (0)

struct Shape {
  int nl;
  int64_t nb, bs, nh, hs;
};

// Element index of (layer, kv, block, tok, head, d) in the engine tensors, as the
// spec's shapes (docs/design/platform.md#kv-formats) define them. Returns {tensor index, offset}.
static std::pair<int64_t, int64_t> engine_index(int fmt, const Shape& s, int layer, int kv,
                                                int64_t b, int64_t t, int64_t h, int64_t d) {
  const int64_t NB = s.nb, BS = s.bs, NH = s.nh, HS = s.hs, NL = s.nl;
  switch (fmt) {
    case 0: return {0, (((((b * NL + layer) * 2 + kv) * BS + t) * NH + h) * HS + d)};
    case 8: return {0, (((((b * NL + layer) * 2 + kv) * NH + h) * BS + t) * HS + d)};
    case 1: return {layer, ((((kv * NB + b) * BS + t) * NH + h) * HS + d)};
    case 2: return {layer, ((((b * 2 + kv) * BS + t) * NH + h) * HS + d)};
    case 6: case 15: return {layer, ((((kv * NB + b) * NH + h) * BS + t) * HS + d)};
    case 7: return {layer, ((((b * 2 + kv) * NH + h) * BS + t) * HS + d)};
    case 3: case 5: case 14: return {layer, ((b * BS + t) * HS + d)};
    case 4: case 9: return {kv * NL + layer, (((b * BS + t) * NH + h) * HS + d)};
    case 10: case 12: return {layer, (((b * NH + h) * BS + t) * HS + d)};
    default: return {layer, (((b * BS + t) * NH + h) * HS + d)};  // 11, 13, 18
  }
}

static int kv_size_of(int fmt) {
  switch (fmt) {
    case 3: case 5: case 14: case 10: case 11: case 12: case 13: case 18: return 1;
    default: return 2;
  }
}

// Calls check(layer, kv, tok, head, d) for every element of one block's rows, in order;
// stops at the first false and returns whether all passed (one report per format).
template <class Check>
static bool every_row_element(const Shape& s, int kv, Check check) {
  for (int layer = 0; layer < s.nl; ++layer)
    for (int k = 0; k < kv; ++k)
      for (int64_t t = 0; t < s.bs; ++t)
        for (int64_t h = 0; h < s.nh; ++h)
          for (int64_t d = 0; d < s.hs; ++d)
            if (!check(layer, k, t, h, d)) return false;
  return true;
}

static void check_format(int fmt, int64_t skip, int64_t n_blocks_used) {
  const bool mla = fmt == 3 || fmt == 5 || fmt == 14;
  Shape s{3, 7, 4, mla ? 1 : 2, 8};
  const int64_t elem = 2, T = 8, bpo = T / s.bs;
  const int kv = kv_size_of(fmt);
  const PagedLayout L = paged_layout(fmt, s.nl, s.nb, s.bs, s.nh, s.hs, elem);
  EXPECT(L.ok, "format %d rejected", fmt);
  EXPECT(L.kv_size == kv, "format %d kv_size %d", fmt, L.kv_size);
  const int64_t tensor_elems = (fmt == 0 || fmt == 8) ? s.nb * s.nl * 2 * s.bs * s.nh * s.hs
                               : (kv == 2 && fmt != 4 && fmt != 9) ? 2 * s.nb * s.bs * s.nh * s.hs
                                                                   : s.nb * s.bs * s.nh * s.hs;
  std::vector<std::vector<uint16_t>> tensors(L.num_ptrs, std::vector<uint16_t>(tensor_elems));
  uint16_t v = 1;
  for (auto& t : tensors)
    for (auto& x : t) x = v++;
  std::vector<int64_t> ptrs;
  for (auto& t : tensors) ptrs.push_back((int64_t)t.data());

  std::vector<int64_t> block_ids = {5, 0, 3, 6, 2};
  block_ids.resize(n_blocks_used);
  const int64_t n_objs = (n_blocks_used + bpo - 1) / bpo;
  const int64_t width = s.nh * s.hs;
  const int64_t chunk_elems = kv * s.nl * T * width;
  std::vector<std::vector<uint16_t>> chunks(n_objs, std::vector<uint16_t>(chunk_elems, 0xBEEF));
  std::vector<int64_t> objs;
  for (auto& c : chunks) objs.push_back((int64_t)c.data());

  BlockTransferArgs a{(int64_t)ptrs.data(), (int64_t)ptrs.size(), objs, (int64_t)block_ids.data(),
                      n_blocks_used, false, D2H, fmt, s.nl, s.nb, s.bs, s.nh, s.hs, elem, T,
                      skip};
  multi_layer_block_kv_transfer_host(a);

  for (int64_t p = 0; p < n_blocks_used; ++p) {
    const int64_t obj = p / bpo, t0 = (p % bpo) * s.bs;
    const bool same = every_row_element(s, kv, [&](int layer, int k, int64_t t, int64_t h,
                                                   int64_t d) {
      auto e = engine_index(fmt, s, layer, k, block_ids[p], t, h, d);
      const uint16_t want = p < skip ? 0xBEEF : tensors[e.first][e.second];
      const int64_t ci = ((k * s.nl + layer) * T + t0 + t) * width + h * s.hs + d;
      EXPECT(chunks[obj][ci] == want, "fmt %d skip %ld: D2H p=%ld mismatch", fmt, (long)skip,
             (long)p);
      return chunks[obj][ci] == want;
    });
    if (!same) return;
  }
  // H2D into zeroed engine tensors restores exactly the covered blocks.
  auto original = tensors;
  for (auto& t : tensors) std::fill(t.begin(), t.end(), 0);
  a.direction = H2D;
  multi_layer_block_kv_transfer_host(a);
  for (int64_t p = skip; p < n_blocks_used; ++p) {
    const bool same = every_row_element(s, kv, [&](int layer, int k, int64_t t, int64_t h,
                                                   int64_t d) {
      auto e = engine_index(fmt, s, layer, k, block_ids[p], t, h, d);
      EXPECT(tensors[e.first][e.second] == original[e.first][e.second], "fmt %d: H2D mismatch",
             fmt);
      return tensors[e.first][e.second] == original[e.first][e.second];
    });
    if (!same) return;
  }
  // Blocks before the skip were never written.
  for (int64_t p = 0; p < skip && p < n_blocks_used; ++p) {
    auto e = engine_index(fmt, s, 0, 0, block_ids[p], 0, 0, 0);
    EXPECT(tensors[e.first][e.second] == 0, "fmt %d: H2D wrote a skipped block", fmt);
  }
}

static void check_pieces() {
  auto p = host_pieces(60, 100, 64);  // crosses 64 and 128
  EXPECT(p.size() == 3, "pieces %zu", p.size());
  EXPECT(p[0].first == 0 && p[0].second == 4, "first piece");
  EXPECT(p[1].first == 4 && p[1].second == 64, "second piece");
  EXPECT(p[2].first == 68 && p[2].second == 32, "third piece");
  EXPECT(host_pieces(0, 0, 64).empty(), "empty copy");
  bool threw = false;
  try {
    host_pieces(0, 10, 48);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  EXPECT(threw, "non power-of-two alignment accepted");
}

static void check_rejections() {
  EXPECT(!paged_layout(16, 2, 4, 4, 2, 8, 2).ok, "tuple format 16 has no pointer form");
  EXPECT(!paged_layout(17, 2, 4, 4, 2, 8, 2).ok, "tuple format 17 has no pointer form");
  BlockTransferArgs a{};
  a.fmt = 1;
  a.nl = 1;
  a.nb = a.bs = a.nh = a.hs = a.elem = 4;
  a.num_paged_ptrs = 1;
  a.chunk_tokens = 6;  // not divisible by bs
  a.objs = {0};
  bool threw = false;
  try {
    multi_layer_block_kv_transfer_host(a);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  EXPECT(threw, "chunk size not divisible by block size accepted");
}

int main() {
  const int formats[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 18};
  for (int fmt : formats) {
    check_format(fmt, 0, 5);  // partial last chunk (5 blocks, 2 per chunk)
    check_format(fmt, 1, 5);  // skip inside the first chunk
    check_format(fmt, 3, 4);  // skip into the second chunk, full chunks
    check_format(fmt, 5, 5);  // skip >= len: no-op
  }
  check_pieces();
  check_rejections();
  if (failures) {
    std::printf("%d host-side check(s) failed\n", failures);
    return 1;
  }
  std::printf("all host-side kernel checks passed\n");
  return 0;
}
