/* LD_PRELOAD shim for the fs_native short-write test: write() and pwrite() on files under
 * $SHORT_WRITE_DIR move at most $SHORT_WRITE_MAX bytes per call, as a slow or interrupted
 * filesystem may, and every shortened call is counted in $SHORT_WRITE_DIR/../short_writes. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int under_dir(int fd) {
  const char* dir = getenv("SHORT_WRITE_DIR");
  if (!dir || !*dir) return 0;
  char link[64], path[4096];
  snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, path, sizeof(path) - 1);
  if (n <= 0) return 0;
  path[n] = '\0';
  return strncmp(path, dir, strlen(dir)) == 0;
}

static void count_one(void) {
  const char* dir = getenv("SHORT_WRITE_DIR");
  char path[4096];
  snprintf(path, sizeof(path), "%s/../short_writes", dir);
  static ssize_t (*real_write)(int, const void*, size_t) = NULL;
  if (!real_write) real_write = (ssize_t (*)(int, const void*, size_t))dlsym(RTLD_NEXT, "write");
  int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd >= 0) {
    real_write(fd, "x", 1);
    close(fd);
  }
}

static size_t limit_for(int fd, size_t count) {
  const char* max = getenv("SHORT_WRITE_MAX");
  size_t m = max ? (size_t)strtoull(max, NULL, 10) : 0;
  if (m == 0 || count <= m || !under_dir(fd)) return count;
  count_one();
  return m;
}

ssize_t write(int fd, const void* buf, size_t count) {
  static ssize_t (*real)(int, const void*, size_t) = NULL;
  if (!real) real = (ssize_t (*)(int, const void*, size_t))dlsym(RTLD_NEXT, "write");
  return real(fd, buf, limit_for(fd, count));
}

ssize_t pwrite(int fd, const void* buf, size_t count, off_t off) {
  static ssize_t (*real)(int, const void*, size_t, off_t) = NULL;
  if (!real) real = (ssize_t (*)(int, const void*, size_t, off_t))dlsym(RTLD_NEXT, "pwrite");
  return real(fd, buf, limit_for(fd, count), off);
}
