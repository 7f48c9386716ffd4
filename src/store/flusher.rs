//! The store's own threads: the flusher, which compresses a pending batch when it is full or
//! old enough, the reserve's refill thread (see `reserve`), with recompression on, the
//! recompressor (see `recompress`), and a compaction when one is asked for.

#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::time::Duration;

use super::admission::SWAP_STRIDE_GROUPS;
use super::counters::add;
use super::nanos;
use super::pending::SpanChange;
use super::reserve::RefillActivity;
use super::table_memory::GroupState;
use super::{BatchedPageStore, Compaction};

/// Slots of a batch the refill thread commits at once when batches grow (64 KiB).
const GROW_STEP_SLOTS: usize = 16;

/// The store's own threads, as `start_flusher`'s `thread_init` is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreThread {
    /// Compresses the pending batches and installs them.
    Flusher,
    /// Commits chunk memory ahead of need (see `reserve`).
    Refill,
    /// Recompresses idle pages (see `recompress`); runs at the lowest priority whatever
    /// `thread_init` does.
    Recompress,
}

/// Joins the flusher thread when dropped after `BatchedPageStore::shutdown` (dropping it
/// first shuts the store down).
pub struct FlusherHandle {
    store: Arc<BatchedPageStore>,
    thread: Option<std::thread::JoinHandle<()>>,
    refill_thread: Option<std::thread::JoinHandle<()>>,
    recompress_thread: Option<std::thread::JoinHandle<()>>,
}

impl FlusherHandle {
    /// Whether the flusher thread has ended (a store without batching ends it at once).
    #[cfg(test)]
    pub(super) fn flusher_finished(&self) -> bool {
        self.thread
            .as_ref()
            .is_none_or(std::thread::JoinHandle::is_finished)
    }
}

impl Drop for FlusherHandle {
    fn drop(&mut self) {
        self.store.shutdown();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the flusher thread panicked");
            }
        }
        if let Some(t) = self.refill_thread.take() {
            if t.join().is_err() {
                tracing::error!("the reserve refill thread panicked");
            }
        }
        if let Some(t) = self.recompress_thread.take() {
            if t.join().is_err() {
                tracing::error!("the recompressor thread panicked");
            }
        }
    }
}

/// Run the calling thread at nice 19: the recompressor only uses CPU nobody else wants. Not
/// `SCHED_IDLE`: it briefly holds entry and allocator locks that the I/O path waits for, and a
/// nice-19 thread preempted there still gets the CPU back soon on a busy machine.
fn lowest_priority() {
    if let Err(error) = crate::os::set_thread_nice(19) {
        tracing::warn!(%error, "could not lower the recompressor's priority");
    }
}

/// Marks the flusher running while it lives, and stopped even if it unwinds, so writers
/// flush for themselves.
struct FlusherRunning<'a>(&'a BatchedPageStore);

impl<'a> FlusherRunning<'a> {
    fn start(store: &'a BatchedPageStore) -> Self {
        store.control.lock().flusher_running = true;
        FlusherRunning(store)
    }
}

impl Drop for FlusherRunning<'_> {
    fn drop(&mut self) {
        self.0.control.lock().flusher_running = false;
        self.0.writers_wake.notify_all();
    }
}

/// One of the store's threads, started and readied (`thread_init` done), waiting for the
/// store it works for.
struct ReadyThread {
    thread: std::thread::JoinHandle<()>,
    store: SyncSender<Arc<BatchedPageStore>>,
}

/// The store's threads, started before there is a store for them. Why: a standby makes them
/// while memory is there, so that its takeover, with RAM at the watermark, allocates none.
/// Made at the takeover, the refill thread faulted in its stack in reclaim while writers,
/// with no refill thread running yet, committed chunks themselves, all in reclaim that
/// waited for the very writes they were to store (seen in the VM: a kill -9 during a fill
/// left swap stalled for good). A role the store turns out not to need (no reserve, no
/// recompression) ends its thread as soon as it is handed the store.
pub struct StoreThreads {
    flusher: ReadyThread,
    refill: ReadyThread,
    recompress: ReadyThread,
}

impl StoreThreads {
    /// Start the threads; `thread_init` runs first on each, told which it is (the daemon
    /// readies them for the I/O path and makes them I/O flushers: see `reserve` for why the
    /// refill thread is one too).
    pub fn start(
        thread_init: impl Fn(StoreThread) + Send + Sync + Clone + 'static,
    ) -> std::io::Result<Self> {
        let ready = |role: StoreThread, name: &str| -> std::io::Result<ReadyThread> {
            let init = thread_init.clone();
            // Room for the store before it comes: sending then allocates nothing.
            let (store, handed) = sync_channel::<Arc<BatchedPageStore>>(1);
            let thread = std::thread::Builder::new()
                .name(name.into())
                .stack_size(crate::mem::IO_THREAD_STACK_BYTES)
                .spawn(move || {
                    init(role);
                    if role == StoreThread::Recompress {
                        lowest_priority();
                    }
                    if let Ok(store) = handed.recv() {
                        store.run_thread(role);
                    }
                })?;
            Ok(ReadyThread { thread, store })
        };
        Ok(StoreThreads {
            flusher: ready(StoreThread::Flusher, "trueno-flusher")?,
            refill: ready(StoreThread::Refill, "trueno-reserve")?,
            recompress: ready(StoreThread::Recompress, "trueno-recompress")?,
        })
    }
}

impl BatchedPageStore {
    /// Start the flusher thread and, when the store keeps a chunk reserve, its refill thread,
    /// and with recompression on, the recompressor: `StoreThreads::start(thread_init)`, then
    /// `start_threads`.
    pub fn start_flusher(
        self: &Arc<Self>,
        thread_init: impl Fn(StoreThread) + Send + Sync + Clone + 'static,
    ) -> std::io::Result<FlusherHandle> {
        self.start_threads(StoreThreads::start(thread_init)?)
    }

    /// Hand the store to its threads, started ahead (see `StoreThreads`).
    pub fn start_threads(
        self: &Arc<Self>,
        threads: StoreThreads,
    ) -> std::io::Result<FlusherHandle> {
        {
            let mut ctl = self.control.lock();
            if ctl.flusher_started || ctl.stop {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "the flusher is already running or the store is shut down",
                ));
            }
            ctl.flusher_started = true;
        }
        // The handle stops and joins whatever was handed the store if a later hand-over fails.
        let mut handle = FlusherHandle {
            store: Arc::clone(self),
            thread: None,
            refill_thread: None,
            recompress_thread: None,
        };
        let hand = |ready: ReadyThread| -> std::io::Result<std::thread::JoinHandle<()>> {
            match ready.store.send(Arc::clone(self)) {
                Ok(()) => Ok(ready.thread),
                Err(_) => Err(std::io::Error::other(
                    "a store thread ended before it was handed the store",
                )),
            }
        };
        // The refill thread first: until it runs, takers commit chunks themselves.
        handle.refill_thread = Some(hand(threads.refill)?);
        handle.thread = Some(hand(threads.flusher)?);
        handle.recompress_thread = Some(hand(threads.recompress)?);
        Ok(handle)
    }

    /// The refill thread's work besides the reserve's chunks, before each of its commits
    /// (`ChunkReserve::run_refill`): the page table's memory, the pending batches' and the
    /// allocator's lists.
    pub(super) fn provide(&self) {
        let reserve = &self.alloc.reserve;
        reserve.note_refill_activity(RefillActivity::Table);
        self.provide_table();
        reserve.note_refill_activity(RefillActivity::Batches);
        self.provide_batches();
        reserve.note_refill_activity(RefillActivity::Lists);
        // Room ahead even at the reclaim throttle's floor (unlike `may_provide_ahead`): a
        // class's lists grow by an eighth at a time, a few pages, and a class left to fill
        // them makes its next taker wait for the growth (on the 7.3 kernel, with lists grown
        // only once full at the floor, a write starved a second for room while the reserve
        // held 980 KiB, 2026-11-29).
        if !reserve.starving() {
            self.alloc.provision();
        } else {
            self.alloc.provision_where_full();
        }
    }

    /// The refill thread's part for the page table (see `table_memory`): commit the groups
    /// writers asked for, waking them, keep spare groups ready (while no write waits for
    /// memory), and give back groups whose pages were all emptied (while memory is not
    /// short).
    fn provide_table(&self) {
        let memory = self.table.memory();
        let reserve = &self.alloc.reserve;
        match memory.commit_wanted(|bytes| reserve.make_room_for(bytes)) {
            Ok(0) => {}
            Ok(_) => reserve.tell_waiters(),
            Err(error) => {
                tracing::warn!(%error, "committing the page table's memory failed; writes to its new part wait");
            }
        }
        // Spares even at the floor, as room in the lists above: a write to a new group
        // would wait for one.
        if !reserve.starving() {
            if let Err(error) = memory.keep_spares(|bytes| reserve.make_room_for(bytes)) {
                tracing::warn!(%error, "committing a spare part of the page table failed; a write to a new part waits for one");
            }
        }
        // Not while memory is short: swap is then at its busiest, and a group given back is
        // one a write may wait for.
        if self.memory_short() {
            return;
        }
        let mut spares = 0;
        for group in memory.groups_to_look_at() {
            // Up to `SWAP_STRIDE_GROUPS` empty groups at most that far after a group in use
            // stay (looked at again, so that they go once that group is empty): the writes of
            // a swap run that starts after all was discarded (`swapon -d`) begin in the
            // groups after the one with swap's header, and one given back is one a write
            // waits for at the onset of the storm (seen in the VM: 300 ms).
            // A group that holds pages is not a spare (`retire` leaves it, and it is looked
            // at again after its next free), and must not use up the spares' count.
            if spares < SWAP_STRIDE_GROUPS
                && memory.state(group) == GroupState::Committed
                && !self.table.holds_pages(group)
                && (group.saturating_sub(SWAP_STRIDE_GROUPS)..group)
                    .any(|g| self.table.holds_pages(g))
            {
                spares += 1;
                memory.note_emptied(group);
                continue;
            }
            if let Err(error) = self.table.retire(group) {
                tracing::warn!(group, %error, "giving an empty part of the page table back failed");
            }
        }
    }

    /// The refill thread's part for the pending batches (see `BatchSpan`): commit every
    /// slot when writes fill quiet batches or memory gets short, give all but the quiet
    /// slots back when none came for a while and memory is not short.
    pub(super) fn provide_batches(&self) {
        let flushes = self.counters.batch_flushes.load(Ordering::Relaxed);
        match self.span.next(flushes, self.alloc.reserve.memory_short()) {
            None => {}
            // Quiet batches still take writes, so growing waits for memory that comes
            // without a wait (the next quiet fill asks again).
            Some(SpanChange::Grow) if self.span.is_offered() || self.may_provide_ahead() => {
                if !self.span.is_offered() {
                    let quiet = self.span.quiet_slots();
                    for batch in self.batches.iter() {
                        // A step at a time, looking again before each. A grow that stops
                        // keeps what it committed for the next pass that asks (memory short,
                        // a quiet fill), or gives it back once none does (`AbandonGrow`): the
                        // span stays quiet, and only a whole span is ever shrunk.
                        for from in (quiet..batch.capacity()).step_by(GROW_STEP_SLOTS) {
                            if !self.may_provide_ahead() {
                                self.span.note_grow_stopped();
                                return;
                            }
                            let to = (from + GROW_STEP_SLOTS).min(batch.capacity());
                            if let Err(error) = batch.commit_slots(from..to) {
                                tracing::warn!(%error, "committing the pending batches' memory failed; batches stay small");
                                self.span.note_grow_stopped();
                                return;
                            }
                        }
                    }
                    self.span.offer_whole();
                }
                // Taken by the next flush, or here under the flush mutex if no flush holds it
                // (if one does, the next pass tries again).
                if let Some(_flush) = self.flush.try_lock() {
                    self.take_span_offer();
                }
            }
            // Waits for memory that comes without a wait; what a grow that stopped committed
            // stays meanwhile.
            Some(SpanChange::Grow) => {}
            // Not offered (an offer asks to grow): batches open quiet, so no batch uses
            // the slots past the quiet span.
            Some(SpanChange::AbandonGrow) => self.give_back_batch_tails(),
            Some(SpanChange::Shrink) => {
                let quiet = self.span.quiet_slots();
                {
                    // Under the flush mutex every batch but the open one is flushed and opens
                    // next with the span set here; the open one must be empty to shrink.
                    let Some(_flush) = self.flush.try_lock() else {
                        return;
                    };
                    let open = &self.batches[self.current.load(Ordering::Acquire)];
                    if !open.shrink_empty(quiet) {
                        return;
                    }
                    self.span.set_quiet();
                }
                self.give_back_batch_tails();
                add(&self.counters.batch_span_shrinks, 1);
            }
        }
    }

    /// Under the flush mutex: batches open whole from now on if that was offered.
    pub(super) fn take_span_offer(&self) {
        if self.span.take_offer() {
            add(&self.counters.batch_span_grows, 1);
        }
    }

    /// Whether the refill thread may fault in the larger parts it provides ahead of need (the
    /// batches' slots past the quiet span, the page table's groups asked for ahead,
    /// `admission`): not while a write waits for memory (that commit comes first), nor while
    /// memory is short and free memory down at the reclaim throttle's floor, where each page
    /// faulted in may sleep a second, and a write that comes meanwhile waits behind it. Seen
    /// in the VM's near-OOM stage: a store whose batches gave back their memory while idle,
    /// and had to have it again before a flush could go on, spent over a second so at the
    /// onset of a swap storm. The small parts (spare table groups, room in the allocator's
    /// lists) wait only while a write waits (`provide`): on the 7.3 kernel writes failed
    /// with ENOMEM after waiting a second for a one-page chunk while the refill thread grew a
    /// size class's lists ahead, in direct reclaim (2026-11-29, `STRESS_CASES=...
    /// VM_KERNEL_SUITE=trixie-backports bash scripts/vm-stress-rounds.sh 2`: `refill=Lists`,
    /// `list_room_waited=false`).
    pub(super) fn may_provide_ahead(&self) -> bool {
        // The memory-short flag first: free memory is only looked at (a system call) then.
        !self.alloc.reserve.starving()
            && (!self.alloc.reserve.memory_short() || crate::mem::free_memory_is_back())
    }

    /// Give back the memory of the slots past the quiet span: only while no batch may use
    /// them: batches open quiet and the open one was opened quiet (a grow that stopped before
    /// its offer) or is empty (a shrink), both in `provide_batches`, or before any opens.
    pub(super) fn give_back_batch_tails(&self) {
        let quiet = self.span.quiet_slots();
        for batch in self.batches.iter() {
            if let Err(error) = batch.decommit_slots(quiet..batch.capacity()) {
                tracing::warn!(%error, "giving the pending batches' spare memory back failed");
            }
        }
    }

    /// What a store thread does once handed the store.
    fn run_thread(&self, role: StoreThread) {
        match role {
            // Without batching there is nothing to flush: its batches have no slots, so the
            // loop would find the open one "full" forever and spin on a core.
            StoreThread::Flusher => {
                if self.config.batched {
                    let _running = FlusherRunning::start(self);
                    self.flusher_loop();
                }
            }
            StoreThread::Refill => {
                if self.alloc.reserve.enabled() {
                    let reserve = &self.alloc.reserve;
                    reserve.run_refill(|| self.provide());
                }
            }
            StoreThread::Recompress => {
                if let Some(config) = self.config.recompress {
                    self.recompress_loop(config);
                }
            }
        }
    }

    /// Compact now in a thread of its own at the lowest priority (`trueno-ublk compact`),
    /// started by `thread_init` (a store thread that needs no codec: compaction moves
    /// compressed bytes), then `done` with what it did. False if a compaction asked for
    /// earlier still runs.
    pub fn start_compaction(
        self: &Arc<Self>,
        thread_init: impl FnOnce() + Send + 'static,
        done: impl FnOnce(Compaction) + Send + 'static,
    ) -> std::io::Result<bool> {
        if self.compacting.swap(true, Ordering::AcqRel) {
            return Ok(false);
        }
        let store = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("trueno-compact".into())
            .stack_size(crate::mem::IO_THREAD_STACK_BYTES)
            .spawn(move || {
                /// Lets the next compaction start however this one ends (a panic included).
                struct Compacting<'a>(&'a BatchedPageStore);
                impl Drop for Compacting<'_> {
                    fn drop(&mut self) {
                        self.0.compacting.store(false, Ordering::Release);
                    }
                }
                let running = Compacting(&store);
                thread_init();
                lowest_priority();
                let compaction = store.compact();
                drop(running);
                done(compaction);
            });
        match spawned {
            Ok(_) => Ok(true),
            Err(error) => {
                self.compacting.store(false, Ordering::Release);
                Err(error)
            }
        }
    }

    fn flusher_loop(&self) {
        let timeout_ns = nanos(self.config.flush_timeout);
        let mut ctl = self.control.lock();
        while !ctl.stop {
            let batch = &self.batches[self.current.load(Ordering::Acquire)];
            if !batch.is_full() {
                // Not full: wait for the first page's writer to note its time (it wakes us),
                // then until that page is `flush_timeout` old, or for the batch to fill.
                let Some(first) = batch.first_write_ns() else {
                    self.flusher_wake.wait(&mut ctl);
                    continue;
                };
                let deadline = first.saturating_add(timeout_ns);
                let now = self.now_ns();
                if now < deadline {
                    let wait = Duration::from_nanos(deadline - now);
                    self.flusher_wake.wait_for(&mut ctl, wait);
                    continue;
                }
            }
            drop(ctl);
            self.flush_open_batch();
            ctl = self.control.lock();
        }
        drop(ctl);
        self.flush_open_batch();
    }

    pub(super) fn now_ns(&self) -> u64 {
        nanos(self.epoch.elapsed())
    }

    pub(super) fn wake_flusher(&self) {
        let _ctl = self.control.lock();
        self.flusher_wake.notify_one();
    }
}
