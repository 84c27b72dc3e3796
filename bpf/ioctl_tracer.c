// NVIDIA RM ioctl attribution per (cgroup, process): loaded with bcc by
// agent/platform/bpf/ioctl_tracer.py, which prepends the VCUDA_* #defines.
//
// Every ioctl whose cmd is _IOWR('F', escape, size) is counted per
// (cgroup id, tgid, escape): calls, errors (syscall return < 0) and a log2
// latency histogram (entry to exit of the same thread); one map lookup per
// call. RM_ALLOC and RM_FREE are decoded from user memory so video memory and
// GPFIFO channels (GPU contexts) are accounted per (cgroup id, tgid) as they
// are created and freed, matched by (tgid, hRoot, handle). Every map is
// bounded; what happens when one is full is counted in `drops`.

#include <uapi/linux/ptrace.h>

#ifndef VCUDA_MAX_ESCAPES
#define VCUDA_MAX_ESCAPES 65536
#endif
#ifndef VCUDA_MAX_PROCS
#define VCUDA_MAX_PROCS 10240
#endif
#ifndef VCUDA_MAX_OBJECTS
#define VCUDA_MAX_OBJECTS 65536
#endif
#ifndef VCUDA_MAX_INFLIGHT
#define VCUDA_MAX_INFLIGHT 10240
#endif
#ifndef VCUDA_TASK_STORAGE
#define VCUDA_TASK_STORAGE 1
#endif

// _IOWR('F', nr, size): direction bits 0xC0000000 and type byte 0x46. The mask
// keeps fbdev's plain 0x46xx ioctls (no direction, no size) out.
#define NV_IOCTL_MASK 0xC000FF00u
#define NV_IOCTL_MATCH 0xC0004600u

#define NV_CMD_RM_FREE 0xC0104629u          // NVOS00, 16 bytes
#define NV_CMD_RM_ALLOC_21 0xC020462Bu      // NVOS21, 32 bytes
#define NV_CMD_RM_ALLOC_64_OLD 0xC028462Bu  // NVOS64 before driver 535, 40 bytes
#define NV_CMD_RM_ALLOC_64 0xC030462Bu      // NVOS64 from driver 535, 48 bytes

// Offsets inside the ioctl argument.
#define NVOS_HOBJECT_NEW 8
#define NVOS_ALLOC_PARAMS 16
#define NVOS00_STATUS 12
#define NVOS21_STATUS 28
#define NVOS64_OLD_STATUS 36
#define NVOS64_STATUS 40
#define NV_MEMORY_ALLOCATION_SIZE 64  // NV_MEMORY_ALLOCATION_PARAMS.size (u64)

#define NV01_MEMORY_LOCAL_USER 0x40

#define LATENCY_SLOTS 32

enum object_kind { KIND_VIDMEM = 1, KIND_CHANNEL = 2 };

enum drop_kind {
    DROP_INFLIGHT = 0,  // no per-thread state: the call is not counted
    DROP_ESCAPES = 1,   // no room for a (cgroup, pid, escape): the call is not counted
    DROP_PROCS = 2,     // no room for a (cgroup, pid): an allocation or free is not counted
    DROP_OBJECTS = 3,   // allocation counted but not remembered: its free is not subtracted
    DROP_KINDS = 4,
};

struct escape_key {
    u64 cgroup_id;
    u32 tgid;
    u32 escape;  // cmd & 0xff
};

struct escape_stats {
    u64 calls;
    u64 errors;
    u64 latency[LATENCY_SLOTS];  // slot i: [2^i, 2^(i+1)) ns; slot 0 includes 0, the last is open
};

struct proc_key {
    u64 cgroup_id;
    u32 tgid;
    u32 pad;
};

struct proc_objects {
    u64 vidmem_allocs;
    u64 vidmem_frees;
    u64 vidmem_bytes_allocated;
    u64 vidmem_bytes_freed;
    u64 channels_created;
    u64 channels_freed;
};

struct inflight {
    u64 active;  // 1 between entry and exit
    u64 start_ns;
    u64 cgroup_id;
    u64 arg;
    u32 cmd;
    u32 h_root;
    u32 h_object;  // RM_FREE: hObjectOld
    u32 h_class;   // RM_ALLOC: hClass
};

struct object_key {
    u32 tgid;
    u32 h_root;
    u32 h_object;
    u32 pad;
};

struct object_val {
    u64 size;
    u64 cgroup_id;
    u32 kind;
    u32 pad;
};

// Not preallocated: memory follows the entries in use, not the bounds.
BPF_F_TABLE("hash", struct escape_key, struct escape_stats, escape_stats, VCUDA_MAX_ESCAPES, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", struct proc_key, struct proc_objects, proc_objects, VCUDA_MAX_PROCS, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", struct object_key, struct object_val, objects, VCUDA_MAX_OBJECTS, BPF_F_NO_PREALLOC);
BPF_ARRAY(drops, u64, DROP_KINDS);
// Zero value used to create escape_stats entries (too large to build on the stack each time).
BPF_ARRAY(zero_stats, struct escape_stats, 1);

#if VCUDA_TASK_STORAGE
// Per-thread state in task-local storage (Linux >= 5.11 with BTF): no map update or delete per
// call, which is most of the cost otherwise, and it goes away with the thread.
BPF_TASK_STORAGE(inflight, struct inflight);

static __always_inline struct inflight *inflight_for_entry(void) {
    return inflight.task_storage_get(bpf_get_current_task_btf(), 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
}

static __always_inline struct inflight *inflight_for_exit(void) {
    return inflight.task_storage_get(bpf_get_current_task_btf(), 0, 0);
}
#else
// Keyed by thread id, LRU: a thread killed inside an ioctl never reaches the exit probe; its entry ages out.
BPF_TABLE("lru_hash", u64, struct inflight, inflight, VCUDA_MAX_INFLIGHT);

static __always_inline struct inflight *inflight_for_entry(void) {
    u64 id = bpf_get_current_pid_tgid();
    struct inflight zero = {};
    inflight.update(&id, &zero);
    return inflight.lookup(&id);
}

static __always_inline struct inflight *inflight_for_exit(void) {
    u64 id = bpf_get_current_pid_tgid();
    return inflight.lookup(&id);
}
#endif

static __always_inline void count_drop(int kind) {
    u64 *n = drops.lookup(&kind);
    if (n)
        __sync_fetch_and_add(n, 1);
}

static __always_inline struct escape_stats *escape_stats_for(struct escape_key *key) {
    struct escape_stats *s = escape_stats.lookup(key);
    if (s)
        return s;
    int zero = 0;
    struct escape_stats *init = zero_stats.lookup(&zero);
    if (!init)
        return 0;
    escape_stats.insert(key, init);  // BPF_NOEXIST: another thread may have created it first
    s = escape_stats.lookup(key);
    if (!s)
        count_drop(DROP_ESCAPES);
    return s;
}

static __always_inline struct proc_objects *objects_for(u64 cgroup_id, u32 tgid) {
    struct proc_key key = {.cgroup_id = cgroup_id, .tgid = tgid};
    struct proc_objects *p = proc_objects.lookup(&key);
    if (p)
        return p;
    struct proc_objects zero = {};
    proc_objects.insert(&key, &zero);
    p = proc_objects.lookup(&key);
    if (!p)
        count_drop(DROP_PROCS);
    return p;
}

static __always_inline int is_gpfifo_class(u32 h_class) {
    switch (h_class) {
    case 0xA06F: case 0xA16F: case 0xB06F: case 0xC06F: case 0xC36F:
    case 0xC46F: case 0xC56F: case 0xC86F: case 0xC96F: case 0xCA6F:
        return 1;
    }
    return 0;
}

static __always_inline void account_free(u32 tgid, struct object_val *obj) {
    struct proc_objects *p = objects_for(obj->cgroup_id, tgid);
    if (!p)
        return;
    if (obj->kind == KIND_VIDMEM) {
        __sync_fetch_and_add(&p->vidmem_frees, 1);
        __sync_fetch_and_add(&p->vidmem_bytes_freed, obj->size);
    } else {
        __sync_fetch_and_add(&p->channels_freed, 1);
    }
}

static __always_inline void on_rm_alloc(struct inflight *f, u32 tgid) {
    u32 status_at = f->cmd == NV_CMD_RM_ALLOC_21       ? NVOS21_STATUS
                    : f->cmd == NV_CMD_RM_ALLOC_64_OLD ? NVOS64_OLD_STATUS
                                                       : NVOS64_STATUS;
    u32 status = 1;
    if (bpf_probe_read_user(&status, sizeof(status), (void *)(f->arg + status_at)) != 0 || status != 0)
        return;  // the driver refused the allocation (or the struct is unreadable)
    struct object_val obj = {.cgroup_id = f->cgroup_id};
    if (f->h_class == NV01_MEMORY_LOCAL_USER) {
        u64 params = 0;
        bpf_probe_read_user(&params, sizeof(params), (void *)(f->arg + NVOS_ALLOC_PARAMS));
        // Read at exit: the driver rounds the size up and writes it back.
        bpf_probe_read_user(&obj.size, sizeof(obj.size), (void *)(params + NV_MEMORY_ALLOCATION_SIZE));
        obj.kind = KIND_VIDMEM;
    } else if (is_gpfifo_class(f->h_class)) {
        obj.kind = KIND_CHANNEL;
    } else {
        return;
    }
    struct proc_objects *p = objects_for(f->cgroup_id, tgid);
    if (!p)
        return;
    if (obj.kind == KIND_VIDMEM) {
        __sync_fetch_and_add(&p->vidmem_allocs, 1);
        __sync_fetch_and_add(&p->vidmem_bytes_allocated, obj.size);
    } else {
        __sync_fetch_and_add(&p->channels_created, 1);
    }
    struct object_key key = {.tgid = tgid, .h_root = f->h_root};
    bpf_probe_read_user(&key.h_object, sizeof(key.h_object), (void *)(f->arg + NVOS_HOBJECT_NEW));
    // The driver accepts a handle only when it is free in that client, so an old entry under the same
    // key was freed without an RM_FREE we saw (its parent was freed): settle it first.
    struct object_val *old = objects.lookup(&key);
    if (old) {
        struct object_val gone = *old;
        account_free(tgid, &gone);
    }
    if (objects.update(&key, &obj) != 0)
        count_drop(DROP_OBJECTS);
}

static __always_inline void on_rm_free(struct inflight *f, u32 tgid) {
    u32 status = 1;
    if (bpf_probe_read_user(&status, sizeof(status), (void *)(f->arg + NVOS00_STATUS)) != 0 || status != 0)
        return;
    struct object_key key = {.tgid = tgid, .h_root = f->h_root, .h_object = f->h_object};
    struct object_val *found = objects.lookup(&key);
    if (!found)
        return;  // not an object we account (or allocated before the tracer started)
    struct object_val obj = *found;
    objects.delete(&key);
    account_free(tgid, &obj);
}

static __always_inline int on_enter(u32 cmd, u64 arg) {
    if ((cmd & NV_IOCTL_MASK) != NV_IOCTL_MATCH)
        return 0;
    struct inflight *f = inflight_for_entry();
    if (!f) {
        count_drop(DROP_INFLIGHT);
        return 0;
    }
    f->start_ns = bpf_ktime_get_ns();
    f->cgroup_id = bpf_get_current_cgroup_id();
    f->arg = arg;
    f->cmd = cmd;
    f->h_root = f->h_object = f->h_class = 0;
    if (cmd == NV_CMD_RM_ALLOC_21 || cmd == NV_CMD_RM_ALLOC_64 || cmd == NV_CMD_RM_ALLOC_64_OLD) {
        u32 head[4] = {};  // hRoot, hObjectParent, hObjectNew, hClass
        bpf_probe_read_user(head, sizeof(head), (void *)arg);
        f->h_root = head[0];
        f->h_class = head[3];
    } else if (cmd == NV_CMD_RM_FREE) {
        u32 head[3] = {};  // hRoot, hObjectParent, hObjectOld
        bpf_probe_read_user(head, sizeof(head), (void *)arg);
        f->h_root = head[0];
        f->h_object = head[2];
    }
    f->active = 1;
    return 0;
}

static __always_inline int on_exit(long ret) {
    struct inflight *found = inflight_for_exit();
    if (!found || !found->active)
        return 0;  // not an NVIDIA ioctl (or it began before the tracer was attached)
    struct inflight f = *found;
    found->active = 0;
    u64 elapsed = bpf_ktime_get_ns() - f.start_ns;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct escape_key key = {.cgroup_id = f.cgroup_id, .tgid = tgid, .escape = f.cmd & 0xff};
    struct escape_stats *s = escape_stats_for(&key);
    if (!s)
        return 0;
    __sync_fetch_and_add(&s->calls, 1);
    if (ret < 0)
        __sync_fetch_and_add(&s->errors, 1);
    u32 slot = bpf_log2l(elapsed) - 1;
    if (slot >= LATENCY_SLOTS)
        slot = LATENCY_SLOTS - 1;
    __sync_fetch_and_add(&s->latency[slot], 1);
    // Allocations are accounted by the driver's NVOS status, not the syscall's return (see the module
    // docstring of ioctl_tracer.py).
    if (f.cmd == NV_CMD_RM_ALLOC_21 || f.cmd == NV_CMD_RM_ALLOC_64 || f.cmd == NV_CMD_RM_ALLOC_64_OLD)
        on_rm_alloc(&f, tgid);
    else if (f.cmd == NV_CMD_RM_FREE)
        on_rm_free(&f, tgid);
    return 0;
}

#if VCUDA_ATTACH_KPROBE
// The driver's ioctl entry (nvidia_unlocked_ioctl >= 545, nvidia_frontend_unlocked_ioctl <= 535):
// only calls that reached the NVIDIA driver.
int vcuda_ioctl_enter(struct pt_regs *ctx) {
    return on_enter((u32)PT_REGS_PARM2(ctx), (u64)PT_REGS_PARM3(ctx));
}

int vcuda_ioctl_exit(struct pt_regs *ctx) {
    return on_exit((long)PT_REGS_RC(ctx));
}
#else
// Layout of the syscalls:sys_{enter,exit}_ioctl records (see their tracefs format files).
struct sys_enter_ioctl_args {
    u64 common;
    s32 syscall_nr;
    u32 pad;
    u64 fd;
    u64 cmd;
    u64 arg;
};

struct sys_exit_args {
    u64 common;
    s32 syscall_nr;
    u32 pad;
    s64 ret;
};

int vcuda_ioctl_enter(struct sys_enter_ioctl_args *ctx) {
    return on_enter((u32)ctx->cmd, ctx->arg);
}

int vcuda_ioctl_exit(struct sys_exit_args *ctx) {
    return on_exit(ctx->ret);
}
#endif
