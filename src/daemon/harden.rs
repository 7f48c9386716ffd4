//! Readying the daemon's process and threads for serving swap: each step's system call is in
//! `crate::os`; here is why the daemon takes it, and the warning when it cannot.

#![forbid(unsafe_code)]

use crate::codec::ThreadCodecs;

/// The daemon serves swap, so none of its own memory may ever need swap to come back (see
/// `os::lock_memory`); and what it locks is only what it touches, so no transparent huge
/// pages. Why: with THP `always` (Debian's kernels; the kernel turns THP off below 512 MiB of
/// RAM, so the test VM never sees it) a first touch of a large anonymous mapping takes a whole
/// 2 MiB page, and the bookkeeping lists reserve 64 MiB of address space each to grow in: a
/// store's bench took 4-10 MiB of huge pages in each, for KiBs of entries, all of which the
/// daemon would lock.
pub(super) fn lock_memory() {
    if let Err(error) = crate::os::disable_huge_pages() {
        tracing::warn!(%error, "PR_SET_THP_DISABLE failed: with transparent huge pages always on, the daemon may lock 2 MiB for each bookkeeping list it touches");
    }
    if let Err(error) = crate::os::lock_memory() {
        tracing::warn!(%error, "mlockall failed: the daemon's memory may be swapped out, which can deadlock swap on this device");
    }
}

/// Reserve the address space the store's bookkeeping lists grow into (see `mem::lists`):
/// before the device is live, so that a list outgrowing the heap near OOM makes no mapping.
pub(super) fn reserve_list_space() {
    match crate::mem::reserve_list_space() {
        Ok(true) => {}
        Ok(false) => tracing::info!("strict overcommit: the store's bookkeeping lists map buffers of their own as they grow"),
        Err(error) => tracing::warn!(%error, "reserving address space for the store's bookkeeping lists failed: a list that outgrows the heap maps a buffer of its own, which near OOM may wait for the mmap lock"),
    }
}

/// Ready a thread of the store that compresses or decompresses (flusher, recompressor, rayon
/// worker) for the I/O path, as the ublk layer does its queue threads: stack faulted in, its
/// codec contexts made in heap faulted in for them with room for what its I/O path allocates
/// beside them, an I/O flusher, top CPU priority.
pub(super) fn ready_store_thread(codecs: ThreadCodecs) {
    crate::mem::prefault_stack();
    mark_io_thread();
    prepare_codec_thread(codecs);
}

/// Make this thread's codec contexts in heap faulted in for them, with room for what the
/// I/O path allocates still free beside them (see `mem::warm_heap`): its heap is its codec
/// contexts (a compressor at level 3 and a decompressor take 182 KiB, a compressor alone 88;
/// higher levels take more, level 19's compressor alone 270 KiB) and little else. For a
/// store thread (`ready_store_thread`), a queue thread (by the ublk layer, which faults its
/// stack in) and a standby's main thread.
pub(super) fn prepare_codec_thread(codecs: ThreadCodecs) {
    crate::mem::warm_heap(
        crate::codec::thread_contexts_bytes(codecs) + crate::mem::IO_ALLOCATIONS_BESIDE_CODEC_BYTES,
    );
    crate::codec::prepare_thread(codecs);
}

/// Ready a thread that touches the store but compresses nothing (the serving process's main
/// thread, which frees the slots the probe reports; the reserve's refill thread): stack and
/// heap faulted in, an I/O flusher, top CPU priority.
pub(super) fn ready_io_thread() {
    crate::mem::prepare_io_thread();
    mark_io_thread();
}

fn mark_io_thread() {
    if let Err(error) = crate::os::set_io_flusher() {
        tracing::warn!(%error, "PR_SET_IO_FLUSHER failed on a store thread");
    }
    if let Err(error) = crate::os::raise_thread_priority() {
        tracing::warn!(%error, "could not raise a store thread's priority");
    }
}

/// Ready the reserve's refill thread: an I/O thread that compresses nothing, made real-time.
/// Why real-time: it allocates the memory every stored page needs, at the moment RAM runs out,
/// in competition with the programs whose pages are being swapped out. A real-time task may
/// allocate below the min watermark (as zram, compressing in the reclaiming task, may dip into
/// the reserves), and runs as soon as it can, so the reserve refills before writes wait on it:
/// without this, the first seconds of a swap storm in a 512 MiB VM failed writes with ENOMEM,
/// and in the near-OOM stage (`scripts/vm-stress-rounds.sh 5`, 2026-11-28, at nice -20
/// instead) writes failed in 16 of 20 cases against 1 of 40 real-time, 55k of them in a case
/// whose pages compress, and a timer once waited 235 s. It sleeps between refills, so it
/// takes little CPU.
pub(super) fn ready_refill_thread() {
    ready_io_thread();
    if let Err(error) = crate::os::make_thread_realtime(crate::os::REALTIME_PRIORITY) {
        tracing::warn!(%error, "could not make the reserve's refill thread real-time (needs CAP_SYS_NICE): under sudden memory pressure writes may fail with ENOMEM");
    }
}

/// Ready the thread that releases the memory of the OOM killer's victims (see `oom_victims`):
/// an I/O flusher (its allocations never swap out to this device), made real-time, above the
/// refill thread. Its stack and heap are faulted in by a first look at /proc, not by
/// `prepare_io_thread`'s 320 KiB: it needs a few pages, and each counts in the daemon's idle
/// footprint. Why real-time: near OOM each look at the kill count and each /proc file opened
/// takes memory of the kernel's, and a normal task waits for it in the kernel's reclaim
/// throttle (seen in the VM: a victim found 1.26 s after its kill, others never before the
/// kernel's OOM reaper took them), where a real-time one may take it below the min
/// watermark; and neither the programs filling RAM nor the refill thread keep it off the CPU:
/// the victim's memory is what they all wait for. It sleeps between looks and holds no lock
/// another thread of the daemon takes.
pub(super) fn ready_oom_victims_thread() {
    mark_io_thread();
    if let Err(error) = crate::os::make_thread_realtime(crate::os::REALTIME_PRIORITY_ABOVE) {
        tracing::warn!(%error, "could not make the thread that releases OOM victims' memory real-time (needs CAP_SYS_NICE)");
    }
}

/// Ready the thread that chooses which processes the OOM victims' thread holds (see
/// `oom_victims`): at nice 0, not the -20 it inherits from the main thread. Why: it opens a
/// file per process every second while memory is short, and near OOM each open may take it
/// into direct reclaim, which at -20 took the CPU from every ordinary process (seen in the
/// VM, with the choosing done by the real-time releasing thread: a timer woke 4.1 s late in
/// every round of the 80 MiB near-OOM case, against 0.5 s without it). A late choice only
/// leaves an older one held.
pub(super) fn ready_oom_candidates_thread() {
    crate::mem::prefault_stack();
    if let Err(error) = crate::os::set_thread_nice(0) {
        tracing::warn!(%error, "could not lower the priority of the thread that chooses OOM candidates");
    }
}

/// Turn the block layer's writeback throttling off for the device, as it is for zram (a bio
/// device, which has none). Why: swap-out is writeback, and throttled swap-out parks kswapd and
/// every task in reclaim in `wbt_wait` whenever the daemon is slow for a moment, so nobody frees
/// the pages whose swap-out has completed, and the store's refill thread cannot get them.
pub(super) fn disable_writeback_throttling(id: u32) {
    let knob = format!("/sys/block/ublkb{id}/queue/wbt_lat_usec");
    match std::fs::write(&knob, "0") {
        Ok(()) => {}
        // A sandbox with a read-only /sys (systemd's ProtectKernelTunables=): the service
        // manager sets the knob instead (trueno-ublk@.service's ExecStartPost=+...).
        Err(error) if error.raw_os_error() == Some(libc::EROFS) => {
            tracing::info!(
                knob,
                "read-only /sys here: writeback throttling is left to the service manager"
            );
        }
        Err(error) => tracing::warn!(%error, knob, "could not turn writeback throttling off"),
    }
}

/// Keep the OOM killer away from the daemon: killing it would lose every page swapped to it,
/// and with them the processes that own those pages.
pub(super) fn protect_from_oom_killer() {
    if let Err(error) = crate::os::protect_from_oom_killer() {
        tracing::warn!(%error, "could not set oom_score_adj: the OOM killer may pick this daemon and lose the pages swapped to it");
    }
}
