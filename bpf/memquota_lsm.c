// GPU memory quotas enforced at allocation time (memory mode `deny`): a BPF LSM program on
// the file_ioctl hook, loaded with bcc by agent/platform/bpf/lsm.py, which prepends the
// VCUDA_* #defines. Only where the kernel runs BPF LSM ("bpf" in /sys/kernel/security/lsm);
// elsewhere the agent kills the process that went over instead (memory mode `kill`).
//
// For NV_ESC_RM_ALLOC (NVOS21 or NVOS64 argument) of class NV01_MEMORY_LOCAL_USER (0x40,
// video memory) on an NVIDIA character device (major 195), the caller's cgroup v2 id is
// looked up in `quotas`; the allocation is refused with -ENOMEM when used + size > quota.
// Every other ioctl, class, device or cgroup passes untouched.
//
// THE DECISION MUST STAY THE SAME AS agent/domain/memquota.py:lsm_allows (unit-tested there,
// since this program cannot load on the development machine): only class 0x40 is ever
// refused, and it is refused exactly when used + request > quota (== quota is allowed).
//
// `used_bytes` is written by the agent from its measurements every check period (NVML and
// the ioctl tracer). Between two writes the program reserves what it allows (adds the
// request to used_bytes atomically) so a burst of allocations cannot all slip under the same
// stale figure; the agent's next write replaces the reservation with the measured value.
// An argument the program cannot read is let through: the `kill` backstop still applies.
// The cgroup is the caller's own (leaf) cgroup, as the ioctl tracer keys them: the agent
// registers the cgroup the container's processes run in. 32-bit compat ioctls
// (file_ioctl_compat) are not hooked.

#include <linux/errno.h>
#include <linux/fs.h>

#ifndef VCUDA_MAX_QUOTAS
#define VCUDA_MAX_QUOTAS 4096
#endif

#define NV_MAJOR 195  // /dev/nvidiactl and /dev/nvidiaN
#define KERNEL_MINOR_BITS 20  // the kernel's dev_t is major << 20 | minor

// _IOWR('F', 0x2B, sizeof(params)): NV_ESC_RM_ALLOC, as bpf/ioctl_tracer.c decodes it.
#define NV_CMD_RM_ALLOC_21 0xC020462Bu      // NVOS21, 32 bytes
#define NV_CMD_RM_ALLOC_64_OLD 0xC028462Bu  // NVOS64 before driver 535, 40 bytes
#define NV_CMD_RM_ALLOC_64 0xC030462Bu      // NVOS64 from driver 535, 48 bytes

// Offsets inside the ioctl argument (the same for NVOS21 and NVOS64).
#define NVOS_HCLASS 12
#define NVOS_ALLOC_PARAMS 16
#define NV_MEMORY_ALLOCATION_SIZE 64  // NV_MEMORY_ALLOCATION_PARAMS.size (u64)

#define NV01_MEMORY_LOCAL_USER 0x40

struct quota {
    u64 quota_bytes;  // the container's vcuda-memory
    u64 used_bytes;   // measured by the agent, plus what this program allowed since
};

// cgroup v2 id of a container → its quota; written by the agent (MemoryDenyProgram.set_quota).
BPF_HASH(quotas, u64, struct quota, VCUDA_MAX_QUOTAS);

// Mirror of lsm_allows(quota_bytes, used_bytes, request_bytes, hclass).
static __always_inline int allows(u64 quota_bytes, u64 used_bytes, u64 request_bytes, u32 h_class) {
    if (h_class != NV01_MEMORY_LOCAL_USER)
        return 1;
    return used_bytes + request_bytes <= quota_bytes;
}

static __always_inline int is_rm_alloc(unsigned int cmd) {
    return cmd == NV_CMD_RM_ALLOC_21 || cmd == NV_CMD_RM_ALLOC_64 || cmd == NV_CMD_RM_ALLOC_64_OLD;
}

LSM_PROBE(file_ioctl, struct file *file, unsigned int cmd, unsigned long arg, int ret) {
    if (ret != 0)
        return ret;  // an earlier LSM already refused
    if (!is_rm_alloc(cmd))
        return 0;
    struct inode *inode = file->f_inode;
    if (!inode || (inode->i_rdev >> KERNEL_MINOR_BITS) != NV_MAJOR)
        return 0;
    u64 cgroup_id = bpf_get_current_cgroup_id();
    struct quota *q = quotas.lookup(&cgroup_id);
    if (!q)
        return 0;  // not a container with a quota
    u32 h_class = 0;
    if (bpf_probe_read_user(&h_class, sizeof(h_class), (void *)(arg + NVOS_HCLASS)) != 0)
        return 0;
    if (h_class != NV01_MEMORY_LOCAL_USER)
        return 0;
    u64 params = 0, size = 0;
    if (bpf_probe_read_user(&params, sizeof(params), (void *)(arg + NVOS_ALLOC_PARAMS)) != 0 || !params)
        return 0;
    if (bpf_probe_read_user(&size, sizeof(size), (void *)(params + NV_MEMORY_ALLOCATION_SIZE)) != 0)
        return 0;
    // Reserve first, then decide on the reserved total, so two threads cannot both pass on the
    // same figure; a refusal gives the reservation back.
    u64 used_before = __sync_fetch_and_add(&q->used_bytes, size);
    if (!allows(q->quota_bytes, used_before, size, h_class)) {
        __sync_fetch_and_add(&q->used_bytes, -size);
        return -ENOMEM;
    }
    return 0;
}
