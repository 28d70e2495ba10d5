// Memory registrations as the emulated NIC sees them: a key (lkey or rkey) names an address range, and the NIC
// reaches that range through a pointer of its own. For the CPU proxy the pointer is the host address; for the
// device-side NIC it will be an NVLink peer pointer to the GPU that plays the remote node.
#pragma once
#include <cstdint>

#include "../runtime/internode_limits.hpp"
#include "mem_ops.hpp"

namespace dc::transport {

// Our own region and one per rail peer (the same local index on every other node): the internode path registers
// nothing else. 32 regions of 32 bytes: the table travels by value as a kernel argument (1 KiB of the 4 KiB).
constexpr int kMaxRegions = kInternodeMaxNodes;

struct MemRegion {
  uint32_t key;
  uint64_t addr;    // first address as WQEs name it
  uint64_t length;
  uint8_t* ptr;     // where addr lives for the NIC
};

struct KeyTable {
  MemRegion regions[kMaxRegions];
  int count;

  // The NIC's pointer for [addr, addr + bytes) under key, or nullptr when no region with that key covers it.
  DC_HD uint8_t* translate(uint32_t key, uint64_t addr, uint64_t bytes) const {
    for (int i = 0; i < count; ++i) {
      const MemRegion& r = regions[i];
      if (r.key == key && addr >= r.addr && bytes <= r.length && addr - r.addr <= r.length - bytes)
        return r.ptr + (addr - r.addr);
    }
    return nullptr;
  }
};

}  // namespace dc::transport
