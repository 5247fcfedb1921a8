#include "connector.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace lmc_example {

namespace {

std::atomic<uint64_t> g_tmp_counter{0};

void write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw std::runtime_error(std::string("write failed: ") + std::strerror(errno));
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

// ---- ExampleFSConnector ---------------------------------------------------------------------

ExampleFSConnector::ExampleFSConnector(std::string base_path, int num_workers)
    : lmcache::connector::ConnectorBase<NoConnection>(num_workers), base_path_(std::move(base_path)) {
  if (base_path_.empty()) throw std::invalid_argument("base_path must be a non-empty string");
  if (::mkdir(base_path_.c_str(), 0755) != 0 && errno != EEXIST)
    throw std::runtime_error("cannot create " + base_path_ + ": " + std::strerror(errno));
  start_workers();  // last: workers call the virtual methods above
}

ExampleFSConnector::~ExampleFSConnector() { close(); }

std::string ExampleFSConnector::path_for(const std::string& key) const {
  std::string name;
  for (char c : key) {
    if (c == '/')
      name += "-SEP-";
    else
      name += c;
  }
  return base_path_ + "/" + name + ".bin";
}

bool ExampleFSConnector::do_single_get(NoConnection&, const std::string& key, void* buf,
                                       size_t len, size_t) {
  int fd = ::open(path_for(key).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st;
  bool ok = ::fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == len;
  size_t done = 0;
  while (ok && done < len) {
    ssize_t r = ::pread(fd, static_cast<char*>(buf) + done, len - done, done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) ok = false;
    else done += static_cast<size_t>(r);
  }
  ::close(fd);
  return ok;
}

void ExampleFSConnector::do_single_set(NoConnection&, const std::string& key, const void* buf,
                                       size_t len, size_t) {
  const std::string final_path = path_for(key);
  const std::string tmp = final_path + "." + std::to_string(::getpid()) + "." +
                          std::to_string(g_tmp_counter.fetch_add(1)) + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create " + tmp + ": " + std::strerror(errno));
  try {
    write_all(fd, static_cast<const char*>(buf), len);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  // Publish: link() never replaces a file another writer already published.
  int rc = ::link(tmp.c_str(), final_path.c_str());
  int err = errno;
  ::unlink(tmp.c_str());
  if (rc != 0 && err != EEXIST)
    throw std::runtime_error("cannot publish " + final_path + ": " + std::strerror(err));
}

bool ExampleFSConnector::do_single_exists(NoConnection&, const std::string& key) {
  struct stat st;
  return ::stat(path_for(key).c_str(), &st) == 0;
}

bool ExampleFSConnector::do_single_delete(NoConnection&, const std::string& key) {
  return ::unlink(path_for(key).c_str()) == 0;
}

// ---- ExampleMemoryConnector -----------------------------------------------------------------

ExampleMemoryConnector::ExampleMemoryConnector(int num_workers)
    : lmcache::connector::ConnectorBase<NoConnection>(num_workers) {
  start_workers();
}

ExampleMemoryConnector::~ExampleMemoryConnector() { close(); }

size_t ExampleMemoryConnector::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return data_.size();
}

bool ExampleMemoryConnector::do_single_get(NoConnection&, const std::string& key, void* buf,
                                           size_t len, size_t) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = data_.find(key);
  if (it == data_.end() || it->second.size() != len) return false;  // size-checked
  std::memcpy(buf, it->second.data(), len);
  return true;
}

void ExampleMemoryConnector::do_single_set(NoConnection&, const std::string& key,
                                           const void* buf, size_t len, size_t) {
  const auto* p = static_cast<const uint8_t*>(buf);
  std::vector<uint8_t> value(p, p + len);
  std::lock_guard<std::mutex> lock(mutex_);
  data_.emplace(key, std::move(value));  // the first writer wins
}

bool ExampleMemoryConnector::do_single_exists(NoConnection&, const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return data_.count(key) != 0;
}

bool ExampleMemoryConnector::do_single_delete(NoConnection&, const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return data_.erase(key) != 0;
}

}  // namespace lmc_example
