// GPU device rules for cgroup v2: a BPF_PROG_TYPE_CGROUP_DEVICE program, loaded
// with bcc by agent/platform/cgroups/devices_v2.py, which prepends the VCUDA_*
// #defines. One compiled program serves every container: it is attached (with
// BPF_F_ALLOW_MULTI) to each guarded container's cgroup, and the policy of that
// container sits in `policies`, keyed by the cgroup id (inode) of the directory
// it was attached to. The kernel runs it for tasks in that cgroup and below
// (crun's `container` subgroup), so the task's cgroup and its ancestors are
// looked up; the deepest match wins.
//
// Return 1 allows, 0 denies. The kernel ANDs all programs attached on the path,
// so this program can only take access away, never grant it.

#include <uapi/linux/bpf.h>

#ifndef VCUDA_MAX_POLICIES
#define VCUDA_MAX_POLICIES 4096
#endif
#ifndef VCUDA_MAX_DEPTH
#define VCUDA_MAX_DEPTH 16  // cgroup levels looked at (kubepods → qos → pod → scope → leaf ...)
#endif
#ifndef VCUDA_MAX_CAPS
#define VCUDA_MAX_CAPS 16  // nvidia-caps minors one policy allows (two per MIG device)
#endif

#define NVIDIA_MAJOR 195
#define NVIDIA_CTL_MINOR 255

#define POLICY_HAS_GPU 1u  // the pod has a GPU allocation (else: no NVIDIA device at all)
#define POLICY_AUDIT 2u    // count what would be denied, deny nothing

// Classes of the dynamic NVIDIA majors (from /proc/devices), in `majors`.
#define MAJOR_UVM 1    // nvidia-uvm(-tools): allowed with a GPU
#define MAJOR_CAPS 2   // nvidia-caps-*: always denied
#define MAJOR_OTHER 3  // nvswitch, nvlink, ...: denied without a GPU
#define MAJOR_MIG_CAPS 4  // nvidia-caps: the policy's capability minors only (its MIG devices)

struct policy {
    u64 gpu_minors[4];         // bit N set: /dev/nvidiaN (195:N) allowed
    u32 flags;                 // POLICY_*
    u32 ncaps;                 // how many of caps[] are set
    u32 caps[VCUDA_MAX_CAPS];  // nvidia-caps minors allowed: each MIG device's GI and CI access
    u64 denied;                // accesses denied (or, in audit, that would have been)
};

BPF_HASH(policies, u64, struct policy, VCUDA_MAX_POLICIES);
BPF_HASH(majors, u32, u32, 64);

static __always_inline int allowed(struct policy *p, u32 major, u32 minor) {
    int has_gpu = p->flags & POLICY_HAS_GPU;
    if (major == NVIDIA_MAJOR) {
        if (!has_gpu)
            return 0;
        if (minor == NVIDIA_CTL_MINOR)
            return 1;
        if (minor >= 256)
            return 0;
        return (p->gpu_minors[(minor >> 6) & 3] >> (minor & 63)) & 1;
    }
    u32 *class = majors.lookup(&major);
    if (!class)
        return 1;  // not an NVIDIA device: never ours to decide
    if (*class == MAJOR_CAPS)
        return 0;
    if (*class == MAJOR_MIG_CAPS) {
        if (!has_gpu)
            return 0;
#pragma unroll
        for (int i = 0; i < VCUDA_MAX_CAPS; i++) {
            if (i < p->ncaps && p->caps[i] == minor)
                return 1;
        }
        return 0;
    }
    return has_gpu;
}

int vcuda_devguard(struct bpf_cgroup_dev_ctx *ctx) {
    if ((ctx->access_type & 0xFFFF) != BPF_DEVCG_DEV_CHAR)
        return 1;
    u32 major = ctx->major;
    if (major != NVIDIA_MAJOR && !majors.lookup(&major))
        return 1;  // the common case, decided before any policy lookup

    struct policy *p = NULL;
    for (int level = 0; level < VCUDA_MAX_DEPTH; level++) {
        u64 id = bpf_get_current_ancestor_cgroup_id(level);
        if (id == 0)
            break;  // deeper than the task's own cgroup
        struct policy *found = policies.lookup(&id);
        if (found)
            p = found;
    }
    if (!p)
        return 1;  // attached above a guarded cgroup only, or the entry was just removed
    if (allowed(p, major, ctx->minor))
        return 1;
    __sync_fetch_and_add(&p->denied, 1);
    return (p->flags & POLICY_AUDIT) ? 1 : 0;
}
