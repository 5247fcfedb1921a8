// fs_native: one file per key under base_path, written through an unnamed O_TMPFILE inode
// (or, where the filesystem lacks O_TMPFILE, a uniquely named temp file) and published
// without ever replacing an existing file (docs/design/storage-engine.md#backend-fs).
//
// O_TMPFILE halves the directory operations per key (no temp name to create and unlink),
// which is most of the cost of a store on ext4, and a writer killed before publishing leaves
// nothing behind: the inode was never linked.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>

#include "connector_base.h"

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif

namespace lmcache {
namespace storage {
namespace fs {

struct FSConnection {
  std::mt19937_64 rng;
  // ".<pid>-<tid>-": the fixed part of this worker's temp names, built once per worker
  // (create_connection runs on the worker thread) instead of two syscalls per key.
  std::string tmp_tag;
  bool published_in_tile = false;
};

// "model/x@000000ff@0@abcd[@salt]" -> "model-SEP-x@0x000000ff@0@abcd[@salt].data"
inline std::string native_key_to_filename(const std::string& key) {
  const size_t at = key.find('@');
  if (at == std::string::npos || at == 0) throw std::invalid_argument("malformed key: " + key);
  std::string out;
  out.reserve(key.size() + 16);
  for (size_t i = 0; i < at; ++i) {
    if (key[i] == '/')
      out += "-SEP-";
    else
      out += key[i];
  }
  out += "@0x";
  out.append(key, at + 1, std::string::npos);
  out += ".data";
  if (out.find('/') != std::string::npos || out.find('\0') != std::string::npos)
    throw std::invalid_argument("malformed key: " + key);
  return out;
}

inline std::string errno_text(const std::string& what, const std::string& path, int err) {
  return what + " " + path + ": " + std::strerror(err);
}

class FSConnector : public connector::ConnectorBase<FSConnection> {
 public:
  FSConnector(std::string base_path, int num_workers, std::string relative_tmp_dir,
              bool use_odirect, size_t read_ahead_size, bool fsync, bool allow_tmpfile = true)
      : connector::ConnectorBase<FSConnection>(num_workers),
        base_(strip_slash(std::move(base_path))),
        use_odirect_(use_odirect),
        read_ahead_(read_ahead_size),
        fsync_(fsync) {
    if (base_.empty()) throw std::invalid_argument("base_path must be a non-empty string");
    make_dirs(base_);
    tmp_dir_ = base_;
    if (!relative_tmp_dir.empty()) {
      if (relative_tmp_dir[0] == '/' || relative_tmp_dir.find("..") != std::string::npos)
        throw std::invalid_argument("Invalid relative_tmp_dir: " + relative_tmp_dir);
      tmp_dir_ = base_ + "/" + strip_slash(relative_tmp_dir);
      make_dirs(tmp_dir_);
    }
    struct statvfs vfs;
    if (::statvfs(base_.c_str(), &vfs) == 0 && vfs.f_bsize >= 512) block_ = vfs.f_bsize;
    use_tmpfile_ = allow_tmpfile && tmpfile_publish_works();
    start_workers();
  }

  ~FSConnector() override { close(); }

  const std::string& base_path() const { return base_; }
  uint64_t fsync_count() const { return fsync_count_.load(std::memory_order_relaxed); }
  // "tmpfile" (unnamed inode, then linkat) or "named_temp" (<stem>.<pid>-<tid>-<hex>.tmp).
  std::string publish_mode() const { return use_tmpfile_ ? "tmpfile" : "named_temp"; }

 protected:
  FSConnection create_connection() override {
    std::random_device rd;
    FSConnection conn{std::mt19937_64((uint64_t(rd()) << 32) ^ rd()), {}, false};
    conn.tmp_tag = "." + std::to_string(::getpid()) + "-" +
                   std::to_string(static_cast<long>(::syscall(SYS_gettid))) + "-";
    return conn;
  }

  bool do_single_get(FSConnection&, const std::string& key, void* buf, size_t len,
                     size_t) override {
    const std::string path = base_ + "/" + native_key_to_filename(key);
    const bool direct = aligned(buf, len);
    int fd = open_retry(path, O_RDONLY | O_CLOEXEC, direct);
    if (fd < 0) return false;  // missing file: a miss
    struct stat st;
    bool ok = ::fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= len;
    if (ok && read_ahead_ > 0) ::posix_fadvise(fd, 0, read_ahead_, POSIX_FADV_WILLNEED);
    size_t done = 0;
    while (ok && done < len) {
      ssize_t n = ::pread(fd, static_cast<char*>(buf) + done, len - done, done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) ok = false;  // error or short file: a miss
      else done += static_cast<size_t>(n);
    }
    ::close(fd);
    return ok;
  }

  void do_single_set(FSConnection& conn, const std::string& key, const void* buf, size_t len,
                     size_t) override {
    conn.published_in_tile |= store_one(conn, key, buf, len);
  }

  void do_batch_set(FSConnection& conn, const connector::Request& req) override {
    conn.published_in_tile = false;
    connector::ConnectorBase<FSConnection>::do_batch_set(conn, req);
    // One directory fsync per tile makes every link() of the tile durable.
    if (conn.published_in_tile && fsync_) fsync_dir(base_);
  }

  bool do_single_exists(FSConnection&, const std::string& key) override {
    struct stat st;
    const std::string path = base_ + "/" + native_key_to_filename(key);
    return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0;
  }

  bool do_single_delete(FSConnection&, const std::string& key) override {
    const std::string path = base_ + "/" + native_key_to_filename(key);
    return ::unlink(path.c_str()) == 0;
  }

 private:
  static std::string strip_slash(std::string p) {
    while (p.size() > 1 && p.back() == '/') p.pop_back();
    return p;
  }

  static void make_dirs(const std::string& path) {
    std::string partial;
    size_t pos = 0;
    while (pos != std::string::npos) {
      pos = path.find('/', pos + 1);
      partial = path.substr(0, pos);
      if (partial.empty()) continue;
      if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST)
        throw std::runtime_error(errno_text("cannot create directory", partial, errno));
    }
  }

  bool aligned(const void* buf, size_t len) const {
    return use_odirect_ && len > 0 && reinterpret_cast<uintptr_t>(buf) % block_ == 0 &&
           len % block_ == 0;
  }

  // Opens with O_DIRECT when asked, falling back to buffered I/O where the filesystem
  // refuses it (tmpfs, some overlays).
  static int open_retry(const std::string& path, int flags, bool direct, mode_t mode = 0) {
    int fd = -1;
    if (direct) {
      do {
        fd = ::open(path.c_str(), flags | O_DIRECT, mode);
      } while (fd < 0 && errno == EINTR);
      if (fd >= 0 || errno != EINVAL) return fd;
    }
    do {
      fd = ::open(path.c_str(), flags, mode);
    } while (fd < 0 && errno == EINTR);
    return fd;
  }

  void fsync_dir(const std::string& dir) {
    int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return;
    if (::fsync(dfd) == 0) fsync_count_.fetch_add(1, std::memory_order_relaxed);
    ::close(dfd);
  }

  // Returns true when this call published the file, false when it already existed.
  bool store_one(FSConnection& conn, const std::string& key, const void* buf, size_t len) {
    const std::string name = native_key_to_filename(key);
    const std::string final_path = base_ + "/" + name;
    struct stat st;
    if (::stat(final_path.c_str(), &st) == 0) return false;  // first writer wins

    const bool direct = aligned(buf, len);
    std::string tmp_path;  // empty for an unnamed O_TMPFILE inode
    int fd;
    if (use_tmpfile_) {
      fd = open_retry(tmp_dir_, O_TMPFILE | O_WRONLY | O_CLOEXEC, direct, 0644);
      if (fd < 0) throw std::runtime_error(errno_text("cannot create a temp file in", tmp_dir_, errno));
    } else {
      tmp_path = named_tmp_path(conn, name);
      fd = open_retry(tmp_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, direct, 0644);
      if (fd < 0) throw std::runtime_error(errno_text("cannot create", tmp_path, errno));
    }
    const std::string& shown = tmp_path.empty() ? final_path : tmp_path;
    auto discard = [&](const std::string& what, int err) {
      ::close(fd);
      if (!tmp_path.empty()) ::unlink(tmp_path.c_str());
      throw std::runtime_error(errno_text(what, shown, err));
    };
    size_t done = 0;
    while (done < len) {
      ssize_t n = ::write(fd, static_cast<const char*>(buf) + done, len - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) discard("write failed for", n < 0 ? errno : EIO);
      done += static_cast<size_t>(n);  // short writes are retried
    }
    if (fsync_) {
      if (::fsync(fd) != 0) discard("fsync failed for", errno);
      fsync_count_.fetch_add(1, std::memory_order_relaxed);
    }

    int rc, err;
    if (use_tmpfile_) {
      // linkat() never replaces: EEXIST means another writer won and our inode just goes away.
      rc = link_fd(fd, final_path);
      err = rc == 0 ? 0 : errno;
      ::close(fd);
    } else {
      ::close(fd);
      rc = publish_named(tmp_path, final_path);
      err = rc == 0 ? 0 : errno;
      ::unlink(tmp_path.c_str());
    }
    if (err == EEXIST) return false;
    if (rc != 0) throw std::runtime_error(errno_text("cannot publish", final_path, err));
    return true;
  }

  std::string named_tmp_path(FSConnection& conn, const std::string& name) const {
    char rand_hex[16];
    std::snprintf(rand_hex, sizeof(rand_hex), "%08x",
                  static_cast<unsigned>(conn.rng() & 0xffffffffu));
    std::string tmp_path = tmp_dir_ + "/";
    tmp_path.append(name, 0, name.size() - 5);  // minus ".data"
    tmp_path += conn.tmp_tag;
    tmp_path += rand_hex;
    tmp_path += ".tmp";
    return tmp_path;
  }

  // Gives an O_TMPFILE inode its name. /proc/self/fd works without CAP_DAC_READ_SEARCH,
  // which linkat(AT_EMPTY_PATH) would need.
  static int link_fd(int fd, const std::string& final_path) {
    const std::string proc_path = "/proc/self/fd/" + std::to_string(fd);
    return ::linkat(AT_FDCWD, proc_path.c_str(), AT_FDCWD, final_path.c_str(), AT_SYMLINK_FOLLOW);
  }

  // Publishes a named temp file without replacing: link(), or an atomic no-replace rename on
  // filesystems without hard links. Sets errno on failure (EEXIST: another writer won).
  static int publish_named(const std::string& tmp_path, const std::string& final_path) {
    if (::link(tmp_path.c_str(), final_path.c_str()) == 0) return 0;
    if (errno == EEXIST) return -1;
    return static_cast<int>(::syscall(SYS_renameat2, AT_FDCWD, tmp_path.c_str(), AT_FDCWD,
                                      final_path.c_str(), RENAME_NOREPLACE));
  }

  // O_TMPFILE needs filesystem support (ext4, xfs, btrfs, tmpfs have it; NFS and many FUSE
  // filesystems do not) and a mounted /proc for linkat; try both once with a probe file.
  bool tmpfile_publish_works() const {
    int fd = ::open(tmp_dir_.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0) return false;
    std::random_device rd;
    char probe[64];
    std::snprintf(probe, sizeof(probe), "/.lmcache-tmpfile-probe.%d-%08x", static_cast<int>(::getpid()),
                  static_cast<unsigned>(rd()));
    const std::string probe_path = base_ + probe;
    const bool linked = link_fd(fd, probe_path) == 0;
    ::close(fd);
    if (linked) ::unlink(probe_path.c_str());
    return linked;
  }

  std::string base_;
  std::string tmp_dir_;
  bool use_odirect_;
  size_t read_ahead_;
  bool fsync_;
  std::atomic<uint64_t> fsync_count_{0};  // successful file + directory fsyncs, for status
  size_t block_ = 4096;
  bool use_tmpfile_ = false;
};

}  // namespace fs
}  // namespace storage
}  // namespace lmcache
