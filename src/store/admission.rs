//! Admission of writes: the memory limit, a pending slot for each page, and the starvation
//! rule: when the system gives the store no memory, ask for an OOM kill if swapping frees
//! nothing (see `oom`), and fail writes with ENOMEM.

#![forbid(unsafe_code)]

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::counters::{add, sub};
use super::nanos;
use super::pending::{PendingBatch, Reserve};
use super::reserve::Stall;
use super::table_memory::TableMemory;
use super::{BatchedPageStore, StoreError, PAGE_SIZE};

/// A writer that has waited this long for memory (a pending slot while the flusher waits for
/// chunk memory, or a chunk itself) while the refill thread has committed none in that time
/// (`reserve::Stall`), fails its write with `ENOMEM` (unless an OOM kill asked for lately may
/// still free memory: `MEMORY_BACK_AFTER_KILL`), and so do the writes after it for
/// `FAIL_FAST_PERIOD` or until the flusher frees a batch. A refill that is slow but commits
/// keeps writes waiting: at the onset of pressure memory comes back in well under a second per
/// commit group, and failing then only logs write errors. Why: the daemon serves swap, and when
/// the system has no memory to give the store, a write that waits holds its bio, and with it
/// every task in reclaim (they wait for bios and writeback), the swap-ins queued behind it, and
/// the OOM killer, which the kernel does not call while writeback is pending. Failing the write
/// lets reclaim go on (the kernel keeps the page and tries again later) and, if memory really
/// is gone, the OOM killer act. Bursts, in which the refill thread catches up within
/// milliseconds, never fail. This is the patience while pages do not compress (see `oom`);
/// while they do, `SLOW_REFILL_PATIENCE`.
const STARVED_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// A writer's patience while the pages written lately compress: then every write that
/// completes frees memory (the kernel drops the page, the store keeps a fraction of it), so
/// the refill thread's commit, slow as it may be while the programs filling RAM race it for
/// the pages reclaim frees, does complete, and failing the write would only log a write error
/// and keep the page in RAM (seen in the VM: after a takeover at the watermark, one commit took
/// 1.01 s and the writes that waited for it failed with ENOMEM, about 1 run in 20 of
/// `scripts/vm-test.sh --recovery`). Still bounded: a store that truly gets no memory fails.
const SLOW_REFILL_PATIENCE: Duration = Duration::from_secs(5);
/// After a write gave up, later writes fail at once for this long, then wait again: the
/// queue serves swap-ins too, and must not hold each write for a whole timeout.
const FAIL_FAST_PERIOD: Duration = Duration::from_millis(200);
/// A writer starving this long asks for an OOM kill when swapping frees nothing (see `oom`):
/// well before its write would fail, and long enough that a burst the refill thread catches up
/// with never asks. The reserve's last quarter is taken from then on, too.
const OOM_NUDGE_AFTER: Duration = super::reserve::LAST_RESORT_AFTER;
/// For this long after an OOM kill was asked for, a refill thread stuck in a commit is woken
/// from the kernel's reclaim throttle (see `rouse_stuck_refill`), and a starving writer keeps
/// waiting (up to `SLOW_REFILL_PATIENCE` in all, as while pages compress: memory is coming):
/// the victim's memory comes back within it, and the writes fail at its end if it did not.
/// Why not only the writer's own timeout: a kill is asked for 300 ms into a write's wait
/// (`OOM_NUDGE_AFTER`), or later where one was asked for within `oom`'s interval, so a writer
/// that gave up at 1 s gave the victim 0.7 s or less to exit and its memory to reach the
/// refill thread, and on Linux 7.3 under emulation that was too little (the near-OOM stage on
/// 7.3.4, 2026-11-28 and 29: writes failed in 19 of 45 move-inv cases, zram's in none, each
/// 0.004-0.7 s after the last kill asked for where the log shows it; with this rule, 0 of
/// 12). Why not a shorter bound than 5 s (a waiting write holds its request, and with the
/// queue full of them a task swapping out in reclaim waits for a tag): with 2 s, writes
/// failed in 3 of 12 cases, and a process that only sleeps and wakes still once waited 9.8 s,
/// for tags, as writes waited 2 s, failed, and the next ones waited again (2026-11-29).
const MEMORY_BACK_AFTER_KILL: Duration = STARVED_WRITE_TIMEOUT;

/// How far on, in table groups, swap's next new cluster lies: on a fresh device Linux 6.12's
/// swap hands out its 2 MiB clusters 0, 32, 64, ... then 1, 33, ... (`setup_clusters` lays
/// its free list out in 32 columns), so the next one is 64 MiB on, eight groups.
pub(super) const SWAP_STRIDE_GROUPS: usize = 8;

/// The groups asked for beyond the last one a write lands in: the next, for writers moving
/// forward through the device (a file system, fio, dd), and the one swap's next cluster lands
/// in. At the onset of a swap storm (64 MiB in about a second in the VM) the refill thread may
/// be in a slow commit, and a group a write must wait for stops that write at once, where
/// chunks and pending batches would have carried it for a while (seen in the VM: with only
/// the next group asked for, a write waited 301 ms for one at the first storm). Asking for
/// the eight between as well (as before) made the whole table committed once a 32nd of the
/// device was in use, and the group needed next the last of eight commits. Not while a
/// write waits for memory, nor while free memory is down at the reclaim throttle's floor
/// (`mem::free_memory_is_back`; the rule is `may_provide_ahead`): then each
/// page of a group may take the refill thread a second in the throttle, and writes waited
/// for chunks meanwhile (seen in the VM's near-OOM stage, 2026-11-27: the refill thread 5 to
/// 15 s in a fault of the table's memory, its kernel stack `shmem_fault` < ... <
/// `throttle_direct_reclaim`, while writes starved and failed).
const TABLE_GROUPS_AHEAD: [usize; 2] = [1, SWAP_STRIDE_GROUPS];

/// A reserved pending slot. Dropping it commits the slot, whatever happened in between (a
/// panic included), so the flusher, which waits for every reserved slot of a batch it seals to
/// be committed, never waits forever. A slot committed without its page's entry pointing at
/// it is simply not installed.
pub(super) struct SlotGuard<'a> {
    batch: &'a PendingBatch,
    pub(super) batch_index: usize,
    pub(super) slot: usize,
}

impl SlotGuard<'_> {
    pub(super) fn batch(&self) -> &PendingBatch {
        self.batch
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        self.batch.commit();
    }
}

/// The table groups of a write's pages, pinned (see `TableMemory::pin`) until dropped.
pub(super) struct TablePins<'a> {
    memory: &'a TableMemory,
    groups: Range<usize>,
}

impl Drop for TablePins<'_> {
    fn drop(&mut self) {
        for group in self.groups.clone() {
            self.memory.unpin(group);
        }
    }
}

/// What a writer does while every pending batch is full (the flusher waits for memory).
#[derive(Clone, Copy, Debug)]
pub(super) enum SlotWait {
    /// Wait for the flusher.
    Block,
    /// Give the write back to the caller, which tries again later (see
    /// `BatchedPageStore::try_write`): `since`, when its first try was given back.
    Defer { since: Option<Instant> },
}

/// Whether a writer starving while swapping frees nothing gives up, having waited `waited`,
/// with `kill_under_way` if an OOM kill asked for within `MEMORY_BACK_AFTER_KILL` may still
/// free memory: after `STARVED_WRITE_TIMEOUT` if none may, and after `SLOW_REFILL_PATIENCE`
/// whatever the kills asked for meanwhile.
fn gives_up_while_swap_frees_nothing(waited: Duration, kill_under_way: bool) -> bool {
    waited >= SLOW_REFILL_PATIENCE || (waited >= STARVED_WRITE_TIMEOUT && !kill_under_way)
}

impl BatchedPageStore {
    pub(super) fn failing_fast(&self) -> bool {
        self.now_ns() < self.fail_fast_until.load(Ordering::Acquire)
    }

    /// The starvation rule, for a writer that has waited `waited` for memory by its `Stall`:
    /// true if it gives up (then `starved_write`). While writes fail fast it gives up at once;
    /// otherwise only while a taker waits for the refill thread (the flusher, or this writer):
    /// if swapping frees nothing, first asking for an OOM kill after `OOM_NUDGE_AFTER`, then
    /// giving up after `STARVED_WRITE_TIMEOUT` once no kill asked for within
    /// `MEMORY_BACK_AFTER_KILL` may still free memory (`gives_up_while_swap_frees_nothing`);
    /// while pages compress, giving up after `SLOW_REFILL_PATIENCE`.
    pub(super) fn gives_up(&self, waited: Duration) -> bool {
        self.gives_up_waiting(self.alloc.reserve.starving(), waited)
    }

    /// `gives_up`, where `for_refill` says whether a taker waits for the refill thread.
    fn gives_up_waiting(&self, for_refill: bool, waited: Duration) -> bool {
        if self.failing_fast() {
            return true;
        }
        if !for_refill {
            return false;
        }
        self.rouse_stuck_refill();
        let now = self.now_ns();
        if !self.oom.swap_frees_nothing(now, waited) {
            return waited >= SLOW_REFILL_PATIENCE;
        }
        if waited >= OOM_NUDGE_AFTER && self.oom.nudge(now, waited) {
            add(&self.counters.oom_kills_asked, 1);
        }
        gives_up_while_swap_frees_nothing(waited, self.kill_under_way(now))
    }

    /// Whether an OOM kill asked for within `MEMORY_BACK_AFTER_KILL` before `now_ns` may still
    /// free memory.
    fn kill_under_way(&self, now_ns: u64) -> bool {
        self.oom.asked_within(now_ns, MEMORY_BACK_AFTER_KILL)
    }

    /// `pages` pages were compressed for writes, `raw` of them did not compress (see
    /// `oom::OomNudge::note_compressed`). While most did not, the reserve keeps each pool's last
    /// quarter for writes that waited (see `reserve::ChunkReserve::pop_committed`): only then
    /// is an OOM kill the way on, and its victim's exit waits for writes to complete. While
    /// pages compress, every completed write frees memory, and a kept quarter would only make
    /// writes wait.
    pub(super) fn note_compressed(&self, pages: u64, raw: u64) {
        let now = self.now_ns();
        self.oom.note_compressed(now, pages, raw);
        self.alloc
            .reserve
            .keep_last_quarter(self.oom.swap_frees_nothing(now, Duration::ZERO));
    }

    /// Wake the refill thread from the kernel's reclaim throttle (`crate::mem::throttle`) if it
    /// has been stuck in a commit and memory is back or coming: an OOM kill was asked for
    /// lately, or free memory is above the throttle's floor. For the threads that wait for it
    /// or give back past it. Why: near OOM its commit slept out the throttle's second while
    /// the kill's victim freed its memory, which the programs filling RAM took meanwhile, and
    /// the writes that waited for the commit failed (the near-OOM stage of
    /// `scripts/vm-test.sh --stress`, 2026-11-27: every write that starved met the refill
    /// thread asleep in `throttle_direct_reclaim` for 1000 ms, with 1.0-3.0 MB free). Woken,
    /// it allocates as a real-time task may (below the min watermark) as soon as a page is free.
    pub(super) fn rouse_stuck_refill(&self) {
        let reserve = &self.alloc.reserve;
        if reserve.refill_stuck()
            && (self.kill_under_way(self.now_ns()) || crate::mem::free_memory_is_back())
        {
            reserve.rouse_refill();
        }
    }

    /// A write gives up waiting for memory: count it, make the writes after it fail at once for
    /// a while (unless that is already so), and say why.
    pub(super) fn starved_write(&self, waited: Duration) -> StoreError {
        if !self.failing_fast() {
            let period = nanos(FAIL_FAST_PERIOD);
            self.fail_fast_until
                .store(self.now_ns().saturating_add(period), Ordering::Release);
            // Once per fail-fast period at most: where the memory the write waited for is.
            let reserve = &self.alloc.reserve;
            let (refill, refill_for) = reserve.refill_activity();
            let (chunk_pages_waited, list_room_waited) = reserve.waited_for();
            let refill_kernel_stack = match reserve.refill_kernel_stack() {
                Some(Ok(stack)) => stack,
                Some(Err(error)) => format!("unreadable: {error}"),
                None => "no refill thread".to_string(),
            };
            tracing::warn!(
                waited_ms = waited.as_millis(),
                ?refill,
                refill_for_ms = refill_for.as_millis(),
                refill_kernel_stack,
                refill_commits = reserve.commits(),
                refill_committing = reserve
                    .refill_commit()
                    .map(|(chunks, pages)| format!("{chunks} x {pages} pages")),
                ?chunk_pages_waited,
                list_room_waited,
                list_room_last_waited_object_bytes = self.alloc.room_waited_object_bytes(),
                table_waited = self.table.memory().any_wanted(),
                reserve_kib = reserve.held_bytes() >> 10,
                fail_ms = FAIL_FAST_PERIOD.as_millis(),
                "a write starved for memory: writes fail with ENOMEM for a while"
            );
        }
        add(&self.counters.starved_writes, 1);
        StoreError::OutOfMemory {
            waited_ms: u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// A deferred write was stored `waited` after it was first deferred: counted, and said
    /// when that is over a second and the longest wait yet.
    pub(super) fn note_write_wait(&self, waited: Duration) {
        let ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
        let longest = self
            .counters
            .longest_write_wait_ms
            .fetch_max(ms, Ordering::Relaxed);
        if waited >= STARVED_WRITE_TIMEOUT {
            add(&self.counters.long_waited_writes, 1);
            if ms > longest {
                let (refill, refill_for) = self.alloc.reserve.refill_activity();
                tracing::warn!(
                    waited_ms = ms,
                    ?refill,
                    refill_for_ms = refill_for.as_millis(),
                    "a write waited over a second for memory before it was stored (the longest wait yet)"
                );
            }
        }
    }

    /// Pin the table groups of pages `first..first + pages` for a write (see `table_memory`),
    /// asking the refill thread to commit those that are not, and the `TABLE_GROUPS_AHEAD`
    /// after the last when it may provide ahead (`may_provide_ahead`: so that writes moving
    /// through the device find them committed). A group not committed yet takes a spare slot if the
    /// refill thread has one ready (`TableMemory::take_spare`); if not, with `SlotWait::Block`
    /// the write waits for it; with `SlotWait::Defer`, returns `None` (the caller tries again
    /// later); both unless the starvation rule gives up.
    pub(super) fn pin_table(
        &self,
        first: u64,
        pages: usize,
        wait: SlotWait,
    ) -> Result<Option<TablePins<'_>>, StoreError> {
        let memory = self.table.memory();
        let start = TableMemory::group_of(first);
        let mut pins = TablePins {
            memory,
            groups: start..start,
        };
        if pages == 0 {
            return Ok(Some(pins));
        }
        let last = TableMemory::group_of(first + pages as u64 - 1);
        for group in start..=last {
            if !self.pin_group(group, wait)? {
                return Ok(None);
            }
            pins.groups.end = group + 1;
        }
        if !self.may_provide_ahead() {
            return Ok(Some(pins));
        }
        let mut asked = false;
        for ahead in TABLE_GROUPS_AHEAD {
            if last + ahead < memory.groups() {
                asked |= memory.want(last + ahead);
            }
        }
        if asked {
            self.alloc.reserve.wake_refill();
        }
        Ok(Some(pins))
    }

    /// Give table group `group` a spare slot if the refill thread has one ready: no wait at
    /// all (counted; the refill thread is woken to replace it). True if it took one.
    fn take_spare_slot(&self, group: usize) -> bool {
        let taken = self.table.memory().take_spare(group);
        if taken {
            add(&self.counters.table_spares_taken, 1);
            self.alloc.reserve.wake_refill();
        }
        taken
    }

    /// Pin table group `group`, committed first (see `pin_table`); false if deferred.
    fn pin_group(&self, group: usize, wait: SlotWait) -> Result<bool, StoreError> {
        let memory = self.table.memory();
        if memory.pin(group) {
            return Ok(true);
        }
        let reserve = &self.alloc.reserve;
        let commit_here = || {
            memory.commit(group).map_err(|source| StoreError::Memory {
                what: "committing the page table's memory".into(),
                source,
            })
        };
        if !reserve.refill_running() {
            // No refill thread (tests, bench): nothing else would commit it.
            loop {
                commit_here()?;
                if memory.pin(group) {
                    return Ok(true);
                }
            }
        }
        if self.take_spare_slot(group) && memory.pin(group) {
            return Ok(true);
        }
        if memory.want(group) {
            add(&self.counters.table_group_waits, 1);
            reserve.wake_refill();
        }
        match wait {
            SlotWait::Defer { since } => {
                let waited =
                    since.map_or(Duration::ZERO, |since| Stall::since(since).waited(reserve));
                if self.gives_up_waiting(true, waited) {
                    return Err(self.starved_write(waited));
                }
                Ok(false)
            }
            SlotWait::Block => {
                reserve.note_waiting();
                let stall = Stall::new();
                let pinned = loop {
                    if memory.pin(group) {
                        break Ok(true);
                    }
                    if self.take_spare_slot(group) {
                        continue;
                    }
                    if !reserve.refill_running() {
                        // The refill thread ended (it unwound, or the store is closing)
                        // while this writer waited for it: nothing else will commit it.
                        if let Err(error) = commit_here() {
                            break Err(error);
                        }
                        continue;
                    }
                    memory.want(group);
                    let waited = stall.waited(reserve);
                    if self.gives_up(waited) {
                        break Err(self.starved_write(waited));
                    }
                    reserve.await_refill_unless(&|| memory.is_committed_group(group));
                };
                reserve.note_served();
                pinned
            }
        }
    }

    /// Reserve a page's worth of the memory limit for a page about to be compressed.
    pub(super) fn admit(&self) -> Result<(), StoreError> {
        let Some(limit) = self.config.mem_limit else {
            add(&self.reserved_bytes, PAGE_SIZE as u64);
            return Ok(());
        };
        let before = self
            .reserved_bytes
            .fetch_add(PAGE_SIZE as u64, Ordering::Relaxed);
        if self.alloc.chunk_bytes() + before + PAGE_SIZE as u64 > limit {
            sub(&self.reserved_bytes, PAGE_SIZE as u64);
            add(&self.counters.mem_limit_hits, 1);
            return Err(StoreError::NoSpace { limit });
        }
        Ok(())
    }

    /// A free pending slot. While every batch is full: with `SlotWait::Block`, waits for the
    /// flusher; with `SlotWait::Defer`, returns `None` (the caller tries again later) unless
    /// the starvation rule gives up.
    pub(super) fn reserve_slot(&self, wait: SlotWait) -> Result<Option<SlotGuard<'_>>, StoreError> {
        // Set once every batch is full: how long this writer has starved since.
        let mut stall: Option<Stall> = match wait {
            SlotWait::Block | SlotWait::Defer { since: None } => None,
            SlotWait::Defer { since: Some(since) } => Some(Stall::since(since)),
        };
        loop {
            let b = self.current.load(Ordering::Acquire);
            match self.batches[b].reserve() {
                Reserve::Slot(slot) => {
                    return Ok(Some(SlotGuard {
                        batch: &self.batches[b],
                        batch_index: b,
                        slot,
                    }))
                }
                Reserve::Closed => std::thread::yield_now(),
                Reserve::Full => {
                    let waited = stall
                        .get_or_insert_with(Stall::new)
                        .waited(&self.alloc.reserve);
                    if self.gives_up(waited) {
                        return Err(self.starved_write(waited));
                    }
                    let mut ctl = self.control.lock();
                    if !ctl.flusher_running {
                        drop(ctl);
                        self.flush_open_batch();
                    } else if matches!(wait, SlotWait::Defer { .. }) {
                        return Ok(None);
                    } else if self.current.load(Ordering::Acquire) == b && self.batches[b].is_full()
                    {
                        // Bounded, so a flusher that starts starving is noticed.
                        self.writers_wake
                            .wait_for(&mut ctl, Duration::from_millis(5));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_writer_without_memory_gives_the_victim_of_a_kill_time_to_free_its_memory() {
        let ms = Duration::from_millis;
        // No kill under way: the write fails after its second.
        assert!(!gives_up_while_swap_frees_nothing(ms(999), false));
        assert!(gives_up_while_swap_frees_nothing(ms(1000), false));
        // A kill asked for lately: the write waits on for its victim's memory.
        assert!(!gives_up_while_swap_frees_nothing(ms(1000), true));
        assert!(!gives_up_while_swap_frees_nothing(ms(4999), true));
        // However many kills were asked for, a write waits 5 s at most.
        assert!(gives_up_while_swap_frees_nothing(ms(5000), true));
    }
}
