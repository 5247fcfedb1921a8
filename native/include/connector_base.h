// ConnectorBase<ConnectionType>: the worker-pool framework every native connector builds on
// (docs/design/storage-engine.md#native-framework).
//
// A derived connector supplies create_connection() (called once per worker thread) and the
// do_single_* operations; the base class owns the threads, tiles each batch across them,
// collects per-key results and pushes exactly one Completion per accepted submit.
//
// Rules for derived classes:
//   * call start_workers() as the LAST statement of the constructor (workers call the
//     virtual methods, so the derived object must be fully built first);
//   * call close() first thing in the destructor (the base destructor runs after the derived
//     members are gone, when workers may no longer call into them).
#pragma once

#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "connector_interface.h"
#include "connector_types.h"

namespace lmcache {
namespace connector {

template <typename ConnectionType>
class ConnectorBase : public IStorageConnector {
 public:
  explicit ConnectorBase(int num_workers) : ConnectorBase(num_workers, WorkerPoolConfig{}) {}

  ConnectorBase(int num_workers, WorkerPoolConfig config) {
    if (num_workers <= 0) throw std::invalid_argument("num_workers must be > 0");
    lanes_.push_back(std::make_unique<Lane>("shared", num_workers));
    for (int i = 0; i < 4; ++i) lane_for_op_[i] = lanes_[0].get();
    for (const auto& kv : config.per_op_workers) {
      int op_index = lane_key_to_op_index(kv.first);
      if (op_index < 0)
        throw std::invalid_argument("unknown lane key in per_op_workers: '" + kv.first + "'");
      if (kv.second <= 0)
        throw std::invalid_argument("per_op_workers count for '" + kv.first +
                                    "' must be positive");
      lanes_.push_back(std::make_unique<Lane>(kv.first, kv.second));
      lane_for_op_[op_index] = lanes_.back().get();
    }
    efd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (efd_ < 0) throw std::runtime_error("failed to create eventfd");
  }

  ConnectorBase(const ConnectorBase&) = delete;
  ConnectorBase& operator=(const ConnectorBase&) = delete;

  ~ConnectorBase() override { close(); }

  int event_fd() const override { return efd_; }

  uint64_t submit_batch_get(const std::vector<std::string>& keys, const std::vector<void*>& bufs,
                            const std::vector<size_t>& lens,
                            size_t batch_chunk_num_bytes) override {
    return submit(Op::BATCH_TILE_GET, keys, &bufs, &lens, batch_chunk_num_bytes);
  }

  uint64_t submit_batch_set(const std::vector<std::string>& keys, const std::vector<void*>& bufs,
                            const std::vector<size_t>& lens,
                            size_t batch_chunk_num_bytes) override {
    return submit(Op::BATCH_TILE_SET, keys, &bufs, &lens, batch_chunk_num_bytes);
  }

  uint64_t submit_batch_exists(const std::vector<std::string>& keys) override {
    return submit(Op::BATCH_TILE_EXISTS, keys, nullptr, nullptr, 0);
  }

  uint64_t submit_batch_delete(const std::vector<std::string>& keys) override {
    return submit(Op::BATCH_TILE_DELETE, keys, nullptr, nullptr, 0);
  }

  std::vector<Completion> drain_completions() override {
    std::vector<Completion> out;
    std::lock_guard<std::mutex> life(lifecycle_mutex_);
    if (efd_ < 0) return out;
    // Order matters. Read the fd first, then clear the flag, then empty the queue. A worker
    // that finds the flag clear writes the fd after this read, so its wake-up stays pending.
    // Clearing the flag before the read lost wake-ups: a worker could set the flag and write,
    // the read ate that write, and a second worker that queued after the queue was emptied
    // saw the flag still set and never wrote (CI: coalescing_eventfd waited 10 s for nothing).
    uint64_t counter = 0;
    while (::read(efd_, &counter, sizeof(counter)) < 0 && errno == EINTR) {
    }
    signalled_.store(false, std::memory_order_seq_cst);
    {
      std::lock_guard<std::mutex> lock(completion_mutex_);
      out.assign(std::make_move_iterator(completions_.begin()),
                 std::make_move_iterator(completions_.end()));
      completions_.clear();
    }
    return out;
  }

  void close() override {
    {
      std::lock_guard<std::mutex> life(lifecycle_mutex_);
      if (closed_) return;
      closed_ = true;
    }
    for (auto& lane : lanes_) {
      std::lock_guard<std::mutex> lock(lane->mutex);
      stopping_.store(true);
    }
    stopping_.store(true);
    for (auto& lane : lanes_) lane->cv.notify_all();
    shutdown_connections();
    for (auto& lane : lanes_) {
      for (auto& t : lane->threads) {
        if (t.joinable() && t.get_id() != std::this_thread::get_id()) t.join();
      }
      lane->threads.clear();
    }
    on_workers_stopped();
    {
      std::lock_guard<std::mutex> life(lifecycle_mutex_);
      if (efd_ >= 0) ::close(efd_);
      efd_ = -1;
    }
    for (auto& lane : lanes_) {
      std::lock_guard<std::mutex> lock(lane->mutex);
      lane->queue.clear();
    }
    std::lock_guard<std::mutex> lock(completion_mutex_);
    completions_.clear();
  }

  bool is_stopping() const { return stopping_.load(); }

  int worker_count_for_op(Op op) const { return lane_for_op_[static_cast<int>(op)]->num_threads; }

 protected:
  // ---- required overrides -------------------------------------------------------------
  // Called once per worker thread; throwing leaves that worker without a connection: its
  // requests fail (never hang) and it retries with backoff until the backend is back.
  virtual ConnectionType create_connection() = 0;
  // Returns false for a miss. An exception counts as a miss for that key only.
  virtual bool do_single_get(ConnectionType& conn, const std::string& key, void* buf, size_t len,
                             size_t chunk_size) = 0;
  // Throws on failure; the batch then completes with ok=false and the first error.
  virtual void do_single_set(ConnectionType& conn, const std::string& key, const void* buf,
                             size_t len, size_t chunk_size) = 0;
  // Throws on failure (fails the batch); returns whether the key exists.
  virtual bool do_single_exists(ConnectionType& conn, const std::string& key) = 0;

  // ---- optional overrides -------------------------------------------------------------
  // Returns whether the key was removed. An exception counts as "not removed".
  virtual bool do_single_delete(ConnectionType& /*conn*/, const std::string& /*key*/) {
    return false;
  }
  // Called by close() before joining: unblock workers stuck in I/O (e.g. shutdown sockets).
  virtual void shutdown_connections() {}
  // Called by close() after every worker has exited.
  virtual void on_workers_stopped() {}
  // How many tiles a batch of num_items is split into; must be in [1, num_items].
  virtual size_t choose_num_tiles(Op op, size_t num_items) {
    return std::min(static_cast<size_t>(worker_count_for_op(op)), num_items);
  }

  // Whole-tile hooks (override to pipeline). Per-key results go to
  // req.batch->per_key_results[req.start_idx + i]; throwing fails the batch.
  virtual void do_batch_get(ConnectionType& conn, const Request& req) {
    for (size_t i = 0; i < req.keys.size(); ++i) {
      bool found = false;
      try {
        found = do_single_get(conn, req.keys[i], req.buf_ptrs[i], req.buf_lens[i],
                              req.batch_chunk_num_bytes);
      } catch (...) {
        found = false;
      }
      req.batch->per_key_results[req.start_idx + i] = found ? 1 : 0;
    }
  }
  virtual void do_batch_set(ConnectionType& conn, const Request& req) {
    for (size_t i = 0; i < req.keys.size(); ++i) {
      do_single_set(conn, req.keys[i], req.buf_ptrs[i], req.buf_lens[i],
                    req.batch_chunk_num_bytes);
    }
  }
  virtual void do_batch_exists(ConnectionType& conn, const Request& req) {
    for (size_t i = 0; i < req.keys.size(); ++i) {
      req.batch->per_key_results[req.start_idx + i] = do_single_exists(conn, req.keys[i]) ? 1 : 0;
    }
  }
  virtual void do_batch_delete(ConnectionType& conn, const Request& req) {
    for (size_t i = 0; i < req.keys.size(); ++i) {
      bool removed = false;
      try {
        removed = do_single_delete(conn, req.keys[i]);
      } catch (...) {
        removed = false;
      }
      req.batch->per_key_results[req.start_idx + i] = removed ? 1 : 0;
    }
  }

  // Start every worker thread. Call it last in the derived constructor, exactly once.
  void start_workers() {
    if (workers_started_) return;
    workers_started_ = true;
    for (auto& lane : lanes_) {
      Lane* l = lane.get();
      for (int i = 0; i < l->num_threads; ++i) {
        l->threads.emplace_back([this, l, i] { worker_loop(*l, i); });
      }
    }
  }

 private:
  struct Lane {
    Lane(std::string n, int threads) : name(std::move(n)), num_threads(threads) {}
    std::string name;
    int num_threads;
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Request> queue;
    std::vector<std::thread> threads;
  };

  static int lane_key_to_op_index(const std::string& key) {
    if (key == "retrieve") return static_cast<int>(Op::BATCH_TILE_GET);
    if (key == "store") return static_cast<int>(Op::BATCH_TILE_SET);
    if (key == "lookup") return static_cast<int>(Op::BATCH_TILE_EXISTS);
    if (key == "delete") return static_cast<int>(Op::BATCH_TILE_DELETE);
    return -1;
  }

  uint64_t submit(Op op, const std::vector<std::string>& keys, const std::vector<void*>* bufs,
                  const std::vector<size_t>* lens, size_t chunk) {
    if (bufs != nullptr && (bufs->size() != keys.size() || lens->size() != keys.size()))
      throw std::runtime_error("keys and memviews size mismatch");
    if (keys.empty()) throw std::runtime_error("keys list is empty");
    const size_t n = keys.size();
    const size_t wanted = choose_num_tiles(op, n);
    if (wanted < 1 || wanted > n)
      throw std::logic_error("choose_num_tiles must return a value in [1, num_items]");
    const size_t per_tile = (n + wanted - 1) / wanted;
    const size_t tiles = (n + per_tile - 1) / per_tile;

    auto batch = std::make_shared<BatchState>();
    batch->remaining_tiles.store(static_cast<int>(tiles));
    if (op != Op::BATCH_TILE_SET) batch->per_key_results.assign(n, 0);

    std::vector<Request> requests(tiles);
    for (size_t t = 0; t < tiles; ++t) {
      Request& r = requests[t];
      const size_t begin = t * per_tile;
      const size_t end = std::min(n, begin + per_tile);
      r.op = op;
      r.batch = batch;
      r.start_idx = begin;
      r.batch_chunk_num_bytes = chunk;
      r.keys.assign(keys.begin() + begin, keys.begin() + end);
      if (bufs != nullptr) {
        r.buf_ptrs.assign(bufs->begin() + begin, bufs->begin() + end);
        r.buf_lens.assign(lens->begin() + begin, lens->begin() + end);
      }
    }

    Lane& lane = *lane_for_op_[static_cast<int>(op)];
    uint64_t future_id = 0;
    {
      std::lock_guard<std::mutex> lock(lane.mutex);
      if (stopping_.load()) throw std::runtime_error("connector is closed");
      future_id = next_future_id_.fetch_add(1);
      for (auto& r : requests) {
        r.future_id = future_id;
        lane.queue.push_back(std::move(r));
      }
    }
    if (tiles > 1)
      lane.cv.notify_all();
    else
      lane.cv.notify_one();
    return future_id;
  }

  void worker_loop(Lane& lane, int index) {
    std::string thread_name = "lmc-" + lane.name.substr(0, 6) + "-" + std::to_string(index);
    pthread_setname_np(pthread_self(), thread_name.substr(0, 15).c_str());

    using clock = std::chrono::steady_clock;
    std::optional<ConnectionType> conn;
    std::string conn_error;
    auto backoff = std::chrono::milliseconds(50);
    auto next_retry = clock::now();

    auto try_connect = [&]() -> bool {
      try {
        conn.emplace(create_connection());
        conn_error.clear();
        backoff = std::chrono::milliseconds(50);
        return true;
      } catch (const std::exception& e) {
        conn_error = e.what();
      } catch (...) {
        conn_error = "unknown exception";
      }
      conn.reset();
      next_retry = clock::now() + backoff;
      backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(5));
      return false;
    };

    try_connect();
    while (true) {
      Request req;
      {
        std::unique_lock<std::mutex> lock(lane.mutex);
        auto ready = [&] { return stopping_.load() || !lane.queue.empty(); };
        if (conn.has_value()) {
          lane.cv.wait(lock, ready);
        } else {
          lane.cv.wait_until(lock, next_retry, ready);
        }
        if (stopping_.load()) return;
        if (lane.queue.empty()) {
          lock.unlock();
          try_connect();  // backoff expired with nothing to do: reconnect in the background
          continue;
        }
        req = std::move(lane.queue.front());
        lane.queue.pop_front();
      }
      if (!conn.has_value()) {
        if (clock::now() >= next_retry) {
          if (!try_connect()) {
            fail_tile(req, "failed to create connection: " + conn_error);
            continue;
          }
        } else {
          fail_tile(req, "queue unavailable: " + conn_error);
          continue;
        }
      }
      run_tile(*conn, req);
    }
  }

  void run_tile(ConnectionType& conn, Request& req) {
    try {
      switch (req.op) {
        case Op::BATCH_TILE_GET:
          do_batch_get(conn, req);
          break;
        case Op::BATCH_TILE_SET:
          do_batch_set(conn, req);
          break;
        case Op::BATCH_TILE_EXISTS:
          do_batch_exists(conn, req);
          break;
        case Op::BATCH_TILE_DELETE:
          do_batch_delete(conn, req);
          break;
      }
    } catch (const std::exception& e) {
      req.batch->record_error(std::string(op_name(req.op)) + " failed: " + e.what());
    } catch (...) {
      req.batch->record_error(std::string(op_name(req.op)) + " failed: unknown exception");
    }
    finish_tile(req);
  }

  void fail_tile(Request& req, const std::string& error) {
    req.batch->record_error(error);
    finish_tile(req);
  }

  void finish_tile(Request& req) {
    BatchState& batch = *req.batch;
    if (batch.remaining_tiles.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    Completion c;
    c.future_id = req.future_id;
    {
      std::lock_guard<std::mutex> lock(batch.error_mutex);
      c.ok = !batch.any_failed.load();
      c.error = batch.first_error;
    }
    c.result_bytes = std::move(batch.per_key_results);
    {
      std::lock_guard<std::mutex> lock(completion_mutex_);
      completions_.push_back(std::move(c));
    }
    if (!signalled_.exchange(true, std::memory_order_seq_cst)) {
      uint64_t one = 1;
      while (::write(efd_, &one, sizeof(one)) < 0 && errno == EINTR) {
      }
    }
  }

  std::vector<std::unique_ptr<Lane>> lanes_;
  Lane* lane_for_op_[4] = {nullptr, nullptr, nullptr, nullptr};
  int efd_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> signalled_{false};
  std::atomic<uint64_t> next_future_id_{1};
  bool workers_started_ = false;
  bool closed_ = false;
  std::mutex lifecycle_mutex_;
  std::mutex completion_mutex_;
  std::deque<Completion> completions_;
};

}  // namespace connector
}  // namespace lmcache
