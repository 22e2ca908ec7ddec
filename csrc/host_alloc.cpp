// Page-aligned NUMA-placed host allocations (see host_alloc.h).
#include "host_alloc.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace h3t {

namespace {

constexpr int kMpolPreferred = 1;      // MPOL_PREFERRED from <linux/mempolicy.h>
constexpr unsigned long kMpolFNode = 1;  // MPOL_F_NODE
constexpr unsigned long kMpolFAddr = 2;  // MPOL_F_ADDR

std::size_t page_size() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }

std::size_t round_to_pages(std::size_t nbytes) {
  const std::size_t page = page_size();
  return std::max(page, (nbytes + page - 1) / page * page);
}

}  // namespace

void* alloc_host(std::size_t nbytes, int numa_node, bool populate) {
  const std::size_t len = round_to_pages(nbytes);
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    throw std::runtime_error("alloc_host: mmap of " + std::to_string(len) + " bytes failed: " +
                             std::strerror(errno));
  }
  if (numa_node >= 0) {
    constexpr std::size_t kBits = 8 * sizeof(unsigned long);
    if (static_cast<std::size_t>(numa_node) >= 16 * kBits) {
      munmap(p, len);
      throw std::runtime_error("alloc_host: numa_node " + std::to_string(numa_node) + " is out of range");
    }
    unsigned long mask[16] = {0};
    mask[numa_node / kBits] = 1UL << (numa_node % kBits);
    if (syscall(SYS_mbind, p, len, kMpolPreferred, mask, 16 * kBits, 0) != 0) {
      const int err = errno;
      munmap(p, len);
      throw std::runtime_error("alloc_host: mbind to numa node " + std::to_string(numa_node) +
                               " failed: " + std::strerror(err));
    }
  }
  if (populate) {
    const std::size_t page = page_size();
    volatile char* c = static_cast<char*>(p);
    for (std::size_t off = 0; off < len; off += page) c[off] = 0;
  }
  return p;
}

void free_host(void* ptr, std::size_t nbytes) {
  if (ptr != nullptr) munmap(ptr, round_to_pages(nbytes));
}

int pci_numa_node(const std::string& pci_bus_id) {
  std::string id = pci_bus_id;
  std::transform(id.begin(), id.end(), id.begin(), [](unsigned char ch) { return std::tolower(ch); });
  for (char ch : id) {
    if (!(std::isxdigit(static_cast<unsigned char>(ch)) || ch == ':' || ch == '.')) return -1;
  }
  // POSIX read and strtol, not iostreams: a file stream here crashed inside the CUDA module on the first GPU run
  // (std::codecvt::do_unshift, with the iostream code of another libstdc++ already in the Python process).
  const std::string path = "/sys/bus/pci/devices/" + id + "/numa_node";
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char buf[32] = {0};
  const ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return -1;
  char* end = nullptr;
  errno = 0;
  const long node = std::strtol(buf, &end, 10);
  if (end == buf || errno != 0 || node < -1 || node > INT_MAX) return -1;
  return static_cast<int>(node);
}

int numa_node_of(const void* ptr) {
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0UL, ptr, kMpolFNode | kMpolFAddr) != 0) return -1;
  return node;
}

}  // namespace h3t
