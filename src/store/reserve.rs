//! Where chunks come from: the page arena (`crate::mem`), with a reserve of committed chunks
//! kept ready so that storing a page never waits for the kernel to find a free page.
//!
//! Why: the daemon serves swap. When memory runs short the kernel frees memory by swapping
//! pages out *through this store*. If storing them needed fresh pages from the kernel, the
//! flusher would wait in reclaim for a swap-out that waits for the flusher: a deadlock the
//! kernel does not break, because an I/O flusher's allocations (PR_SET_IO_FLUSHER) retry
//! instead of invoking the OOM killer. So chunks come from this reserve, and a refill thread
//! tops it back up while the I/O path carries on. The daemon makes the refill thread an I/O
//! flusher too: its reclaim then takes pages whose swap-out has completed (clean pages) rather
//! than starting swap-outs, whose bios would queue behind the very flusher that waits for this
//! thread (seen in the VM). Whether a taker waits for it (`starving`) tells the store
//! when to stop accepting writes. Freed chunks return to the reserve while it is below its
//! target, and give their pages back to the system (a hole punched in the arena) beyond it:
//! the refill thread punches them; while it has been stuck in one commit, the thread that
//! frees swap slots does (`give_back_past_stuck_refill`), and a thread that finds the surplus
//! list full gives it back itself (`give_back`). A run of slot frees keeps the chunks it
//! empties and gives them back itself, together (`FreedTogether`).

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};
use smallvec::SmallVec;

use super::cold::ColdPages;
use super::nanos;
use crate::codec::PAGE_SIZE;
use crate::mem::{Arena, ArenaChunk, CarveFailed, ThrottledThread};

/// The latest ready chunks of a pool a taker looks at for a run to join (`join_smaller`): a
/// bound on its work under the pool's lock, on the stack.
const JOIN_LOOK: usize = 64;
/// Chunks joined into one, most of the time at most (the room on the stack; more spill to
/// the heap): a chunk of the allocator's largest size, 8 pages, from one-page ones.
const MAX_JOINED_PARTS: usize = 8;

/// How often the refill thread looks even when nobody woke it.
const REFILL_PERIOD: Duration = Duration::from_millis(50);
/// ...and once `QUIET_PASSES` passes in a row saw nothing happen (no chunk taken, none given
/// back, no taker waiting, memory not short, the reserve's size unchanged by the pass): an
/// idle daemon's refill thread then wakes once a second instead of twenty times (a laptop's
/// `powertop` counts wake-ups). The next chunk taken wakes it at once (see `sleeping`).
const REFILL_IDLE_PERIOD: Duration = Duration::from_secs(1);
/// Two seconds of passes: longer than `QUIET_AFTER`, so that the reserve has shrunk to its
/// quiet target before the thread sleeps longer.
const QUIET_PASSES: u32 = 40;
/// Between commits, the refill thread's other provisions (`run_refill`'s `also`: the page
/// table's groups, the batches, the allocator's lists) at most this often. Why: while memory
/// is short a commit is one chunk, and looking at every size class's lists before each one
/// cost the refill thread 2.5 of its 13 CPU s in the near-OOM stage's 100 MiB case (207,683
/// commits; a diagnostic build, 2026-12-05 13:47). A taker waiting for one of those waits
/// at most this much longer.
const ALSO_INTERVAL: Duration = Duration::from_millis(1);
/// How long a taker with no refill thread to wait for tries again a commit the system
/// refuses (see `ChunkReserve::take`).
const COMMIT_RETRY_FOR: Duration = Duration::from_secs(10);
/// Room kept in each pool's lists for chunks given back on the I/O path or committed by the
/// refill thread (see `provision`); more than one commit group holds.
const POOL_SLACK: usize = 1024;
/// Chunks are committed this many bytes at a time (one system call).
const COMMIT_GROUP_BYTES: usize = 256 << 10;
/// A reserve nobody took a chunk from for this long, while memory is not short, keeps only
/// `1 / QUIET_TARGET_DIVISOR` of its target ready (see `target_for_pass`). One second: once a
/// program that swapped exits, the daemon's memory is to be back near its idle footprint
/// within two.
pub const QUIET_AFTER: Duration = Duration::from_secs(1);
const QUIET_TARGET_DIVISOR: u64 = 4;
/// ...and never more than this: the target grows with RAM (up to 64 MiB), the idle footprint
/// must not (16 MiB locked on an idle 16 GiB machine before this; 1 MiB until 2026-11-29).
/// Memory getting short, which comes before swap does, brings the whole target back.
const QUIET_TARGET_MAX_BYTES: u64 = 512 << 10;
/// A reserve in use holds up to this fraction of its target beyond it before giving chunks
/// back (see `trim_above`).
const TRIM_SLACK_DIVISOR: u64 = 8;
/// Chunks emptied by a run of frees outside the I/O path that are given back together (see
/// `FreedTogether`): 4 MiB of one-page chunks, the pages a killed program's incompressible
/// data leaves, in room of 16 KiB kept for it.
const FREED_TOGETHER: usize = 1024;
/// The most chunks in one commit group (of one-page chunks).
const GROUP_CHUNKS: usize = COMMIT_GROUP_BYTES / PAGE_SIZE;
/// The refill thread counts as stuck once it has been in one activity other than waiting this
/// long: then chunks given back beyond the target are punched by another thread
/// (`give_back_past_stuck_refill`). A commit that finds memory takes well under a millisecond;
/// one that waits in reclaim, up to a second at a time (`throttle_direct_reclaim`).
const REFILL_STUCK_AFTER: Duration = Duration::from_millis(50);
/// A taker that has waited this long for the refill thread opens the pools' last quarters
/// (see `pop_committed`, `last_resort_open`): long enough that a burst the refill thread
/// catches up with never does.
pub(super) const LAST_RESORT_AFTER: Duration = Duration::from_millis(300);

/// Chunks committed or given back together, in one system call per run of adjacent ones
/// (`ArenaChunk::recommit_all`, `decommit_all`); on the stack, so that the refill thread
/// allocates nothing to move memory.
type ChunkGroup = SmallVec<[ArenaChunk; GROUP_CHUNKS]>;

/// Why a taker got no chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Shortage {
    /// The refill thread committed nothing for the taker's patience: the system has no memory
    /// for the store now.
    Starved { waited: Duration },
    /// The arena's address space is used up (its size rules that out).
    ArenaFull,
}

/// How long a taker has waited for memory with the refill thread committing none: a refill
/// that is slow but commits starts it again, one the system gives no memory does not. The one
/// clock of the store's starvation rule (see `admission`), for writers waiting on a pending
/// slot (or deferred by their queue, from when it first deferred them) and takers waiting here
/// alike.
pub(super) struct Stall {
    since: Instant,
}

impl Stall {
    /// Waiting from now.
    pub(super) fn new() -> Self {
        Self::since(Instant::now())
    }

    /// Waiting since `since`.
    pub(super) fn since(since: Instant) -> Self {
        Self { since }
    }

    /// Time since the latest of the start of the wait, the refill thread's last commit and
    /// the moment a taker began to wait for it with none waiting before.
    pub(super) fn waited(&self, reserve: &ChunkReserve) -> Duration {
        [reserve.last_commit(), reserve.waiting_since()]
            .into_iter()
            .flatten()
            .fold(self.since, Instant::max)
            .elapsed()
    }
}

/// What the refill thread is doing: for the log line of a write that starved, which says
/// where the memory it waited for got stuck.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RefillActivity {
    /// Asleep until woken or the next period (or no refill thread runs).
    Waiting,
    /// Making room in the reserve's own lists (heap).
    Provisioning,
    /// Committing the page table's memory for writers, or giving back empty parts of it.
    Table,
    /// Committing the pending batches' slots, or giving back all but their quiet ones.
    Batches,
    /// Growing or shrinking the allocator's lists (mapped buffers faulted in).
    Lists,
    /// Committing chunk memory (faulting it in: where it waits in reclaim).
    Committing,
    /// Giving chunks' pages back (hole punches).
    GivingBack,
}

impl RefillActivity {
    const ALL: [RefillActivity; 7] = [
        RefillActivity::Waiting,
        RefillActivity::Provisioning,
        RefillActivity::Table,
        RefillActivity::Batches,
        RefillActivity::Lists,
        RefillActivity::Committing,
        RefillActivity::GivingBack,
    ];
}

/// `RefillActivity` and since when, and the commit under way, in one word each, written by
/// the refill thread alone (or, without one, by takers that commit for themselves).
struct RefillState {
    activity: AtomicU8,
    /// Since `epoch`.
    since_ns: AtomicU64,
    epoch: Instant,
    /// The chunks being committed: their size in pages in the low half, how many in the high
    /// half; 0 between commits.
    commit: AtomicU64,
}

impl RefillState {
    fn new() -> Self {
        Self {
            activity: AtomicU8::new(RefillActivity::Waiting as u8),
            since_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            commit: AtomicU64::new(0),
        }
    }

    /// A commit of `chunks` chunks of `pages` pages starts (0, 0: it ended).
    fn note_commit(&self, pages: usize, chunks: usize) {
        let half = |n: usize| u64::from(u32::try_from(n).unwrap_or(u32::MAX));
        self.commit
            .store(half(chunks) << 32 | half(pages), Ordering::Relaxed);
    }

    /// The commit under way: chunks and their size in pages, if one is.
    fn commit(&self) -> Option<(usize, usize)> {
        let word = self.commit.load(Ordering::Relaxed);
        let half = |n: u64| usize::try_from(n & u64::from(u32::MAX)).unwrap_or(usize::MAX);
        (word != 0).then(|| (half(word >> 32), half(word)))
    }

    fn set(&self, activity: RefillActivity) {
        if self.activity.load(Ordering::Relaxed) != activity as u8 {
            let now = nanos(self.epoch.elapsed());
            self.since_ns.store(now, Ordering::Relaxed);
            self.activity.store(activity as u8, Ordering::Relaxed);
        }
    }

    fn get(&self) -> (RefillActivity, Duration) {
        let activity = RefillActivity::ALL
            .get(usize::from(self.activity.load(Ordering::Relaxed)))
            .copied()
            .unwrap_or(RefillActivity::Waiting);
        let since = Duration::from_nanos(self.since_ns.load(Ordering::Relaxed));
        (activity, self.epoch.elapsed().saturating_sub(since))
    }
}

#[derive(Default)]
struct Pool {
    /// Committed chunks, ready.
    ready: Vec<ArenaChunk>,
    /// Chunks given back beyond the target while the refill thread runs, still committed: the
    /// I/O path frees chunks, and a hole punch there would make swap I/O wait on the segment
    /// file's lock (seen in the VM when commits held it: a queue thread freeing a chunk waited
    /// there while every swap bio waited for it). The refill thread punches their holes, or
    /// another thread while it is stuck (`give_back_past_stuck_refill`).
    surplus: Vec<ArenaChunk>,
    /// Chunks kept for takers that have waited `LAST_RESORT_AFTER` (see `pop_committed`): a
    /// quarter of the pool's share, set by each refill pass.
    last_resort: usize,
}

/// A pool's part of `target` by its `demand` of `total` alone (`ChunkReserve::share` adds a
/// floor; giving back beyond demand goes by this).
fn demand_share(demand: u64, total: u64, target: u64) -> u64 {
    target * demand / total.max(1)
}

/// In `sorted` (page, index) pairs by page, where the first run of `len` entries each `step`
/// pages after the one before ends (its last entry's position), if there is one.
fn run_end(sorted: &[(usize, usize)], step: usize, len: usize) -> Option<usize> {
    let mut start = 0;
    for i in 0..sorted.len() {
        if i > 0 && sorted[i].0 != sorted[i - 1].0 + step {
            start = i;
        }
        if i + 1 - start == len {
            return Some(i);
        }
    }
    None
}

/// Push `chunk` onto `list` if it has room, without growing it; the chunk back otherwise.
fn push_with_room(list: &mut Vec<ArenaChunk>, chunk: ArenaChunk) -> Result<(), ArenaChunk> {
    if list.len() == list.capacity() {
        return Err(chunk);
    }
    list.push(chunk);
    Ok(())
}

/// Marks the refill thread running while it lives, and stopped even if it unwinds: takers
/// that wait for it (a flush never gives up) commit for themselves then.
struct RefillRunning<'a>(&'a ChunkReserve);

impl<'a> RefillRunning<'a> {
    fn start(reserve: &'a ChunkReserve) -> Self {
        reserve.refill_running.store(true, Ordering::Release);
        RefillRunning(reserve)
    }
}

impl Drop for RefillRunning<'_> {
    fn drop(&mut self) {
        self.0.refill_running.store(false, Ordering::Release);
        let _guard = self.0.wake_lock.lock();
        self.0.refilled.notify_all();
    }
}

/// Chunks emptied by a run of frees outside the I/O path (the slots swap reported freed: a
/// killed program's pages), given back together (`ChunkReserve::give_back_all`) whenever
/// `FREED_TOGETHER` are held and when it is dropped.
pub(super) struct FreedTogether<'a> {
    reserve: &'a ChunkReserve,
    chunks: MutexGuard<'a, Vec<ArenaChunk>>,
    punches: Punches,
}

/// The hole punches with which a run of frees gave memory back to the system (see
/// `FreedTogether`): for the log of a large free, where near OOM they are most of its time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Punches {
    /// System calls, one per run of adjacent chunks.
    pub calls: usize,
    /// Pages given back by them.
    pub pages: usize,
    /// How long they took.
    pub time: Duration,
}

impl Punches {
    fn add(&mut self, more: Punches) {
        self.calls += more.calls;
        self.pages += more.pages;
        self.time += more.time;
    }
}

impl FreedTogether<'_> {
    pub(super) fn push(&mut self, chunk: ArenaChunk) {
        if self.chunks.len() == self.chunks.capacity() {
            let punched = self.reserve.give_back_all(&mut self.chunks);
            self.punches.add(punched);
        }
        // Never grows the list: it has room now (`give_back_all` empties it).
        self.chunks.push(chunk);
    }

    /// Give back what is held, as dropping it does: the punches of the whole run of frees.
    pub(super) fn finish(mut self) -> Punches {
        let punched = self.reserve.give_back_all(&mut self.chunks);
        self.punches.add(punched);
        self.punches
    }
}

impl Drop for FreedTogether<'_> {
    fn drop(&mut self) {
        self.reserve.give_back_all(&mut self.chunks);
    }
}

pub(super) struct ChunkReserve {
    arena: Arc<Arena>,
    /// Chunks by size: `pools[k]` holds chunks of `k + 1` pages.
    pools: Box<[Mutex<Pool>]>,
    /// Chunks of each size taken lately (plus, at the start, the number of size classes using
    /// that size, as a prior), halved at every refill pass: each pool's share of the target
    /// follows recent demand, not what the device held long ago.
    demand: Box<[AtomicU64]>,
    held_bytes: AtomicU64,
    /// The target while chunks are taken or memory is short.
    target_bytes: u64,
    /// The target of the refill thread's latest pass: `target_bytes`, or less while the
    /// reserve is quiet (see `target_for_pass`).
    current_target: AtomicU64,
    /// Chunks taken since the refill thread's latest pass.
    taken: AtomicU64,
    /// When the refill thread last saw a chunk taken, or memory short.
    last_busy: Mutex<Instant>,
    /// Chunks that had to be committed on the I/O path because the reserve was empty.
    misses: AtomicU64,
    /// Bytes given back from pools nobody waited on for one a taker waited on (`steal_for`)
    /// or for bookkeeping faulted in (`make_room_for`).
    stolen_bytes: AtomicU64,
    /// Chunks a taker cut from a larger ready one (`split_larger`).
    split_chunks: AtomicU64,
    /// Chunks a taker joined from adjacent smaller ready ones (`join_smaller`).
    joined_chunks: AtomicU64,
    /// Takers waiting for the refill thread now.
    waiters: AtomicUsize,
    /// When the first of them began to wait, the count having been 0 (ns since
    /// `refill_state.epoch`, 0: none yet): a writer deferred while nobody waited for the
    /// refill thread (the flusher busy with other work) has not starved for memory meanwhile
    /// (see `Stall`).
    waiting_since_ns: AtomicU64,
    /// Of them, those waiting for room in the allocator's lists (`note_waiting_for_room`).
    room_waiters: AtomicUsize,
    /// Commit groups committed so far.
    commits: AtomicU64,
    /// When the last of them was committed (ns since `refill_state.epoch`, 0: none yet): how a
    /// waiting writer tells a slow refill from a stuck one (see `Stall`).
    last_commit_ns: AtomicU64,
    /// Pools (bit `k` for chunks of `k + 1` pages) a taker waits on: refilled first.
    wanted: AtomicU64,
    wake: Condvar,
    wake_lock: Mutex<()>,
    /// Signalled by the refill thread after each pass.
    refilled: Condvar,
    /// Whether a refill thread is running; without one, takers commit memory themselves.
    refill_running: AtomicBool,
    /// Surplus chunks wait for the refill thread to give their pages back.
    surplus_waiting: AtomicBool,
    /// The refill thread waits `REFILL_IDLE_PERIOD`: the next taker wakes it.
    sleeping: AtomicBool,
    /// The arena's pages given back, for chunks of every size (see `store::cold`).
    cold: ColdPages,
    /// The room of `FreedTogether` (faulted in: freeing never allocates).
    freed_together: Mutex<Vec<ArenaChunk>>,
    /// Bytes given back by other threads than the refill thread: while it was stuck
    /// (`give_back_past_stuck_refill`) or behind (a full surplus list, `give_back`).
    given_back_past_refill: AtomicU64,
    refill_state: RefillState,
    /// The refill thread, for waking it from the kernel's reclaim throttle
    /// (`rouse_stuck_refill`).
    refill_thread: ThrottledThread,
    /// How often it was woken so.
    refill_rousings: AtomicU64,
    /// Until when (ns since the refill state's epoch) every taker may take a pool's last
    /// quarter (`last_resort_open`).
    last_resort_until_ns: AtomicU64,
    /// Whether pools keep their last quarter at all (`keep_last_quarter`).
    keeps_last_quarter: AtomicBool,
    /// The system is short of memory (the daemon's `MemAvailable` watch, through the store).
    memory_short: AtomicBool,
    stop: AtomicBool,
}

impl ChunkReserve {
    /// A reserve of about `target_bytes` in an arena of `arena_bytes` of address space;
    /// `classes_per_size[k]` is how many size classes use chunks of `k + 1` pages. A zero
    /// target keeps nothing ready beyond one commit group.
    pub(super) fn new(target_bytes: u64, arena: Arc<Arena>, classes_per_size: &[u64]) -> Self {
        let reserve = Self {
            arena,
            pools: classes_per_size
                .iter()
                .map(|_| Mutex::new(Pool::default()))
                .collect(),
            demand: classes_per_size
                .iter()
                .map(|&n| AtomicU64::new(n))
                .collect(),
            held_bytes: AtomicU64::new(0),
            target_bytes,
            current_target: AtomicU64::new(target_bytes),
            taken: AtomicU64::new(0),
            last_busy: Mutex::new(Instant::now()),
            misses: AtomicU64::new(0),
            stolen_bytes: AtomicU64::new(0),
            split_chunks: AtomicU64::new(0),
            joined_chunks: AtomicU64::new(0),
            waiters: AtomicUsize::new(0),
            waiting_since_ns: AtomicU64::new(0),
            room_waiters: AtomicUsize::new(0),
            commits: AtomicU64::new(0),
            last_commit_ns: AtomicU64::new(0),
            wanted: AtomicU64::new(0),
            wake: Condvar::new(),
            wake_lock: Mutex::new(()),
            refilled: Condvar::new(),
            refill_running: AtomicBool::new(false),
            surplus_waiting: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            cold: ColdPages::new(),
            freed_together: Mutex::new(crate::mem::faulted_in_vec(FREED_TOGETHER)),
            given_back_past_refill: AtomicU64::new(0),
            refill_state: RefillState::new(),
            refill_thread: ThrottledThread::default(),
            refill_rousings: AtomicU64::new(0),
            last_resort_until_ns: AtomicU64::new(0),
            keeps_last_quarter: AtomicBool::new(false),
            memory_short: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        };
        // A resumed store's free space is marked cold before any thread carves. Refused, it
        // is tried again before the first carve; pages it cannot mark meanwhile are only
        // address space lost (`ColdPages::mark`).
        if let Err(error) = reserve
            .cold
            .cover(reserve.arena.carved().div_ceil(PAGE_SIZE))
        {
            tracing::warn!(%error, "no room to note the arena's free pages");
        }
        reserve
    }

    /// Whether the system is short of memory: then a pool a taker waits on is refilled with
    /// the memory of other pools' ready chunks first (see `steal_for`).
    pub(super) fn set_memory_short(&self, short: bool) {
        self.memory_short.store(short, Ordering::Relaxed);
        if short {
            // The whole target is due (see `target_for_pass`), before swap's writes come.
            self.wake_refill_if_sleeping();
        }
    }

    /// Whether the system is short of memory, as last told (`set_memory_short`).
    pub(super) fn memory_short(&self) -> bool {
        self.memory_short.load(Ordering::Relaxed)
    }

    /// What the refill thread is doing, and for how long it has been.
    pub(super) fn refill_activity(&self) -> (RefillActivity, Duration) {
        self.refill_state.get()
    }

    /// The refill thread's commit under way, for the log line of a write that starved:
    /// how many chunks of how many pages, if one is.
    pub(super) fn refill_commit(&self) -> Option<(usize, usize)> {
        self.refill_state.commit()
    }

    /// Where the refill thread is in the kernel (see `ThrottledThread::kernel_stack`).
    pub(super) fn refill_kernel_stack(&self) -> Option<std::io::Result<String>> {
        self.refill_thread.kernel_stack()
    }

    pub(super) fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// How many pages the next chunk a resumed store keeps ready should have: of the pool
    /// furthest below its share (by the demand prior, as `refill` fills it) whose chunks fit
    /// in `pages`; `None` once no such pool is short.
    pub(super) fn ready_chunk_wanted(&self, pages: usize) -> Option<usize> {
        let demand: Vec<u64> = self
            .demand
            .iter()
            .map(|d| d.load(Ordering::Relaxed))
            .collect();
        let total: u64 = demand.iter().sum::<u64>().max(1);
        (0..self.pools.len().min(pages))
            .filter_map(|k| {
                let chunk_bytes = ((k + 1) * PAGE_SIZE) as u64;
                let share = self.share(demand[k], total, self.target_bytes);
                let held = self.pools[k].lock().ready.len() as u64 * chunk_bytes;
                let short = share.saturating_sub(held);
                (short >= chunk_bytes).then_some((short, k + 1))
            })
            .max()
            .map(|(_, pages)| pages)
    }

    /// A free chunk of a resumed store whose pages are still in memory, kept ready (see
    /// `ready_chunk_wanted`).
    pub(super) fn adopt_ready(&self, chunk: ArenaChunk) {
        let k = chunk.len() / PAGE_SIZE - 1;
        self.held_bytes
            .fetch_add(chunk.len() as u64, Ordering::Relaxed);
        self.pools[k].lock().ready.push(chunk);
    }

    /// A free chunk whose pages were given back already (a resumed store's free space).
    pub(super) fn adopt_cold(&self, chunk: ArenaChunk) {
        self.make_cold(&[chunk]);
    }

    pub(super) fn enabled(&self) -> bool {
        self.target_bytes > 0
    }

    /// Bytes held ready now.
    pub(super) fn held_bytes(&self) -> u64 {
        self.held_bytes.load(Ordering::Relaxed)
    }

    /// Bytes of the reserve's own lists (ready, surplus, the cold map): bookkeeping, for the
    /// stats.
    pub(super) fn list_bytes(&self) -> u64 {
        let chunk_entry = std::mem::size_of::<ArenaChunk>();
        let pools: usize = self
            .pools
            .iter()
            .map(|pool| {
                let pool = pool.lock();
                (pool.ready.capacity() + pool.surplus.capacity()) * chunk_entry
            })
            .sum();
        (pools + self.cold.bytes()) as u64
    }

    pub(super) fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }

    pub(super) fn stolen_bytes(&self) -> u64 {
        self.stolen_bytes.load(Ordering::Relaxed)
    }

    pub(super) fn split_chunks(&self) -> u64 {
        self.split_chunks.load(Ordering::Relaxed)
    }

    pub(super) fn joined_chunks(&self) -> u64 {
        self.joined_chunks.load(Ordering::Relaxed)
    }

    /// Whether a taker waits for the refill thread now: the system has, for the moment, no
    /// memory to give the store.
    pub(super) fn starving(&self) -> bool {
        self.waiters.load(Ordering::Relaxed) > 0
    }

    /// Commit groups committed so far (it only grows).
    pub(super) fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// When the last commit group was committed, if one was.
    fn last_commit(&self) -> Option<Instant> {
        self.instant_of(&self.last_commit_ns)
    }

    /// The moment a word of ns since `refill_state.epoch` holds (0: none yet).
    fn instant_of(&self, ns: &AtomicU64) -> Option<Instant> {
        match ns.load(Ordering::Acquire) {
            0 => None,
            ns => Some(self.refill_state.epoch + Duration::from_nanos(ns)),
        }
    }

    /// A taker starts waiting for the refill thread (see `starving`).
    pub(super) fn note_waiting(&self) {
        if self.waiters.fetch_add(1, Ordering::AcqRel) == 0 {
            let now = nanos(self.refill_state.epoch.elapsed());
            self.waiting_since_ns.store(now.max(1), Ordering::Release);
        }
    }

    /// When the takers waiting for the refill thread now began to wait (see
    /// `waiting_since_ns`).
    fn waiting_since(&self) -> Option<Instant> {
        self.instant_of(&self.waiting_since_ns)
    }

    /// A taker stops waiting for the refill thread.
    pub(super) fn note_served(&self) {
        self.waiters.fetch_sub(1, Ordering::Relaxed);
    }

    /// A thread starts waiting for the refill thread to make room in the allocator's lists
    /// (it waits as a taker does: see `note_waiting`).
    pub(super) fn note_waiting_for_room(&self) {
        self.room_waiters.fetch_add(1, Ordering::Relaxed);
        self.note_waiting();
    }

    /// A thread stops waiting for room in the allocator's lists.
    pub(super) fn note_stopped_waiting_for_room(&self) {
        self.room_waiters.fetch_sub(1, Ordering::Relaxed);
        self.note_served();
    }

    /// What takers wait for the refill thread to provide now, for the log line of a write
    /// that starved: the chunk sizes (in pages) waited on, and whether a thread waits for
    /// room in the allocator's lists.
    pub(super) fn waited_for(&self) -> (SmallVec<[usize; 8]>, bool) {
        let wanted = self.wanted.load(Ordering::Relaxed);
        let pages = (0..self.pools.len())
            .filter(|k| wanted & (1 << k) != 0)
            .map(|k| k + 1)
            .collect();
        (pages, self.room_waiters.load(Ordering::Relaxed) > 0)
    }

    /// A taker waiting on pool `k` was served (or gave up).
    fn served(&self, k: usize) {
        self.wanted.fetch_and(!(1 << k), Ordering::Relaxed);
        self.note_served();
    }

    /// A chunk of `pages` pages if one is ready now, for background work (the recompressor,
    /// compaction): without waiting, or counting as a waiter (which would put the store's
    /// writes under the starvation rule), or taking a pool's last quarter (kept for writes
    /// that waited), or committing memory. `None` when none is ready; the refill thread is
    /// asked for one.
    pub(super) fn take_ready(&self, pages: usize) -> Option<ArenaChunk> {
        let k = pages - 1;
        let chunk = self.ready_chunk(k, false);
        if chunk.is_none() && self.enabled() {
            self.wanted.fetch_or(1 << k, Ordering::Relaxed);
            self.wake_refill();
        }
        chunk
    }

    /// A chunk of `pages` pages: from the reserve, or committed now if the reserve has none.
    /// A taker that waits for the refill thread asks `give_up` how long it has waited (see
    /// `Stall`) at least every `REFILL_PERIOD`, and gives up when told to (the starvation rule
    /// of `admission`; `None`: never gives up waiting for it). A taker with no refill thread
    /// to wait for commits itself, and fails (`ArenaFull`) once the system has refused that
    /// for `COMMIT_RETRY_FOR`: then nothing in reach frees memory (a limit on the daemon's own
    /// cgroup), and failing a page is better than a device that never serves again.
    pub(super) fn take(
        &self,
        pages: usize,
        give_up: Option<&dyn Fn(Duration) -> bool>,
    ) -> Result<ArenaChunk, Shortage> {
        let k = pages - 1;
        self.demand[k].fetch_add(1, Ordering::Relaxed);
        self.taken.fetch_add(1, Ordering::Relaxed);
        self.wake_refill_if_sleeping();
        // Without a refill thread to wait for, no quarter is kept. Ready chunks of other
        // sizes serve too before the taker counts as a miss and a waiter (which changes how
        // the refill thread works: see `starving`).
        let waits_for_refill = self.refill_serves();
        let keep_none = !waits_for_refill;
        if let Some(chunk) = self.ready_chunk(k, keep_none) {
            return Ok(chunk);
        }
        if waits_for_refill {
            // The I/O path must not commit memory itself: under memory pressure that waits in
            // reclaim for a swap-out through this very store. Wait for the refill thread,
            // which may wait in reclaim.
            let misses = self.misses.fetch_add(1, Ordering::Relaxed);
            if misses.is_power_of_two() {
                tracing::warn!(
                    misses = misses + 1,
                    "chunk reserve empty: waiting for the refill thread"
                );
            }
            self.note_waiting();
            let stall = Stall::new();
            loop {
                let waited = stall.waited(self);
                let last_resort = self.last_resort_open(stall.since);
                if let Some(chunk) = self.ready_chunk(k, last_resort) {
                    self.served(k);
                    return Ok(chunk);
                }
                // Stopped, or the refill thread ended (it unwound): commit here instead.
                if self.stop.load(Ordering::Acquire) || !self.refill_running() {
                    self.served(k);
                    break;
                }
                if give_up.is_some_and(|give_up| give_up(waited)) {
                    self.served(k);
                    return Err(Shortage::Starved { waited });
                }
                // Again each time: another taker of this size may have cleared it.
                self.wanted.fetch_or(1 << k, Ordering::Relaxed);
                let mut guard = self.wake_lock.lock();
                self.wake.notify_one();
                self.refilled.wait_for(&mut guard, REFILL_PERIOD);
            }
        }
        // Another taker of this size may pop what this one committed: commit again then. A
        // commit the system refuses (no memory for now: a takeover's first flush, before the
        // refill thread runs, or a shutdown's last one) is tried again, with what other sizes
        // hold tried in between, for `COMMIT_RETRY_FOR` or until `give_up` says so; only an
        // arena used up ends it at once. Before, such a refusal failed the page it was for.
        let started = Instant::now();
        let mut wanted = usize::MAX;
        loop {
            let committed = self.commit_more(k, wanted);
            if let Some(chunk) = self.ready_chunk(k, true) {
                return Ok(chunk);
            }
            if committed {
                continue;
            }
            if wanted != 1 {
                // A group may not fit where one chunk still does: one at a time from here on.
                wanted = 1;
                continue;
            }
            let used_up = self.arena.carved() + pages * PAGE_SIZE > self.arena.len();
            let waited = started.elapsed();
            if used_up || waited >= COMMIT_RETRY_FOR {
                tracing::error!(
                    pages,
                    used_up,
                    waited_ms = waited.as_millis(),
                    "no chunk could be committed"
                );
                return Err(Shortage::ArenaFull);
            }
            if give_up.is_some_and(|give_up| give_up(waited)) {
                return Err(Shortage::Starved { waited });
            }
            std::thread::sleep(REFILL_PERIOD);
        }
    }

    /// Whether pools keep their last quarter for takers that waited (see `pop_committed`): the
    /// store says so while the pages it stores lately do not compress.
    pub(super) fn keep_last_quarter(&self, keep: bool) {
        self.keeps_last_quarter.store(keep, Ordering::Relaxed);
    }

    /// Whether a taker waiting since `since` may take a pool's last quarter: once one taker has
    /// waited `LAST_RESORT_AFTER` by its own clock, every taker may for as long again. By the
    /// taker's own wait, not the `Stall`'s: the refill thread's slow commits near OOM restart
    /// that each time, and each one went to the kept quarter. For every taker: a flush takes
    /// a chunk per raw page, and each take would wait anew.
    fn last_resort_open(&self, since: Instant) -> bool {
        let now = nanos(self.refill_state.epoch.elapsed());
        if since.elapsed() >= LAST_RESORT_AFTER {
            self.last_resort_until_ns.fetch_max(
                now.saturating_add(nanos(LAST_RESORT_AFTER)),
                Ordering::Relaxed,
            );
            return true;
        }
        now < self.last_resort_until_ns.load(Ordering::Relaxed)
    }

    /// A ready chunk of size class `k`: its own pool's, or one split from a larger ready one,
    /// or one joined of smaller ones (`last_resort`: as `pop_committed`'s).
    fn ready_chunk(&self, k: usize, last_resort: bool) -> Option<ArenaChunk> {
        self.pop_committed(k, last_resort)
            .or_else(|| self.split_larger(k, last_resort))
            .or_else(|| self.join_smaller(k, last_resort))
    }

    /// A committed chunk of `k + 1` pages, if the pool has one: a ready chunk (waking the
    /// refill thread when the reserve falls below three quarters of its target), else a
    /// surplus one; the pool's last quarter only if `last_resort` (see `last_resort_open`).
    /// Why keep one: near OOM the writes waiting for memory hold the bios that every task in
    /// reclaim waits for, the OOM victim's exit included (its last allocations swap out too),
    /// so the memory the victim would free cannot come until some of those writes complete;
    /// without memory kept for them they failed after a second (the near-OOM stage of
    /// `scripts/vm-test.sh --stress`, 2026-11-27: a victim in `mempool_alloc` for a bio 2.4 s
    /// after its kill, and asked-for kills finding nothing to kill while it lived).
    fn pop_committed(&self, k: usize, last_resort: bool) -> Option<ArenaChunk> {
        let mut pool = self.pools[k].lock();
        if self.keeps_back(&pool, last_resort) {
            return None;
        }
        if let Some(chunk) = pool.ready.pop() {
            drop(pool);
            let held = self
                .held_bytes
                .fetch_sub(chunk.len() as u64, Ordering::Relaxed);
            if held < self.current_target.load(Ordering::Relaxed) * 3 / 4 {
                self.wake_refill();
            }
            return Some(chunk);
        }
        pool.surplus.pop()
    }

    /// Whether `pool` is down to the last quarter it keeps for takers that have waited (see
    /// `pop_committed`), which a taker that may not have it (`last_resort` false) must leave,
    /// whether it takes a chunk as it is or cuts or joins one.
    fn keeps_back(&self, pool: &Pool, last_resort: bool) -> bool {
        !last_resort
            && self.keeps_last_quarter.load(Ordering::Relaxed)
            && pool.ready.len() + pool.surplus.len() <= pool.last_resort
    }

    /// A chunk of `k + 1` pages cut from a larger ready chunk, the rest of which stays ready
    /// in the pool of its size; `None` if no larger one is ready (or the rest's list has no
    /// room: the I/O path never grows a list). Why: a taker whose pool ran dry otherwise waits
    /// for the refill thread's commit, which with memory short waits in reclaim, while the
    /// reserve's memory sits ready in other sizes (the near-OOM stage of `scripts/vm-test.sh
    /// --stress`, 2026-11-25 04:36: writes starved for a second, then failed, with 0.7-3.5
    /// MiB held ready).
    fn split_larger(&self, k: usize, last_resort: bool) -> Option<ArenaChunk> {
        let len = (k + 1) * PAGE_SIZE;
        for j in k + 1..self.pools.len() {
            // Larger pool first, then the rest's (always smaller): nothing else holds two.
            let mut larger = self.pools[j].lock();
            let mut rest_pool = self.pools[j - k - 1].lock();
            if rest_pool.ready.len() == rest_pool.ready.capacity()
                || self.keeps_back(&larger, last_resort)
            {
                continue;
            }
            let Some(chunk) = larger.ready.pop() else {
                continue;
            };
            match chunk.split(len) {
                Ok((head, rest)) => {
                    rest_pool.ready.push(rest);
                    self.held_bytes.fetch_sub(len as u64, Ordering::Relaxed);
                    self.split_chunks.fetch_add(1, Ordering::Relaxed);
                    return Some(head);
                }
                Err(chunk) => larger.ready.push(chunk),
            }
        }
        None
    }

    /// A chunk of `k + 1` pages joined from adjacent ready chunks of one smaller size that
    /// divides it, found among the latest `JOIN_LOOK` of that pool's ready chunks (chunks are
    /// committed in runs of adjacent ones). Why: a taker whose pool ran dry, with no larger
    /// chunk to split, otherwise waits for the refill thread's commit, which near OOM may
    /// spend over a second in reclaim, while the reserve's memory sits ready in smaller sizes
    /// (the near-OOM stage on the 7.3 kernel, 2026-11-29: a write starved a second for a
    /// 3-page chunk, the refill thread in the commit of a 1-page one, 364 KiB ready).
    fn join_smaller(&self, k: usize, last_resort: bool) -> Option<ArenaChunk> {
        let pages = k + 1;
        for part in (1..pages).rev().filter(|part| pages.is_multiple_of(*part)) {
            let parts = pages / part;
            let mut run: SmallVec<[ArenaChunk; MAX_JOINED_PARTS]> = {
                let mut pool = self.pools[part - 1].lock();
                if self.keeps_back(&pool, last_resort) {
                    continue;
                }
                let from = pool.ready.len().saturating_sub(JOIN_LOOK);
                // (page, index in `ready`) of the latest ready chunks, by page.
                let mut latest = [(0usize, 0usize); JOIN_LOOK];
                let latest = &mut latest[..pool.ready.len() - from];
                for (entry, (index, chunk)) in latest
                    .iter_mut()
                    .zip(pool.ready.iter().enumerate().skip(from))
                {
                    *entry = (chunk.page(), index);
                }
                latest.sort_unstable();
                let Some(end) = run_end(latest, part, parts) else {
                    continue;
                };
                let mut indexes: SmallVec<[usize; MAX_JOINED_PARTS]> = latest
                    [end + 1 - parts..=end]
                    .iter()
                    .map(|&(_, index)| index)
                    .collect();
                // Highest first: a `swap_remove` moves only the last entry, never one of
                // the run still to take.
                indexes.sort_unstable_by(|a, b| b.cmp(a));
                indexes
                    .iter()
                    .map(|&index| pool.ready.swap_remove(index))
                    .collect()
            };
            self.held_bytes
                .fetch_sub((pages * PAGE_SIZE) as u64, Ordering::Relaxed);
            run.sort_unstable_by_key(ArenaChunk::page);
            let mut pieces = run.into_iter();
            let mut joined = pieces.next()?;
            while let Some(piece) = pieces.next() {
                joined = match ArenaChunk::join(joined, piece) {
                    Ok(joined) => joined,
                    // Not reachable: the run's chunks lie one after the other in one arena.
                    Err((joined, piece)) => {
                        tracing::error!(
                            page = joined.page(),
                            "adjacent ready chunks would not join"
                        );
                        self.give_back(joined);
                        self.give_back(piece);
                        pieces.for_each(|rest| self.give_back(rest));
                        return None;
                    }
                };
            }
            self.joined_chunks.fetch_add(1, Ordering::Relaxed);
            return Some(joined);
        }
        None
    }

    /// Take back a chunk that is no longer used: kept ready while the reserve is below its
    /// target, its pages given back to the system otherwise (by the refill thread, if one runs).
    /// Never grows a list under a pool's lock: a list with no room left is not added to. Why:
    /// growing one faults fresh heap pages in, which near OOM waits in reclaim, and every taker
    /// of that size waits for the lock meanwhile (seen in the VM, 2026-11-27: the main thread,
    /// freeing 60 MiB of a killed worker's slots, faulted in a grown surplus list in reclaim
    /// for good while the queue thread waited for the pool's lock and every swap bio for it).
    pub(super) fn give_back(&self, chunk: ArenaChunk) {
        let len = chunk.len() as u64;
        let k = chunk.len() / PAGE_SIZE - 1;
        let chunk = if self.held_bytes.load(Ordering::Relaxed) + len
            <= self.current_target.load(Ordering::Relaxed)
        {
            // Bound first: a guard in the match's scrutinee would live through its arms.
            let kept = self.keep_ready(&mut self.pools[k].lock(), chunk);
            match kept {
                Ok(()) => return,
                Err(chunk) => chunk,
            }
        } else {
            chunk
        };
        let chunk = if self.refill_running.load(Ordering::Acquire) {
            let pushed = push_with_room(&mut self.pools[k].lock().surplus, chunk);
            match pushed {
                Ok(()) => {
                    // Memory follows the data: the refill thread punches the hole now rather
                    // than at its next period, so a discard's pages are back with the system at
                    // once. One wake-up per pass is enough; it takes every surplus chunk.
                    if !self.surplus_waiting.swap(true, Ordering::AcqRel) {
                        self.wake_refill();
                    }
                    return;
                }
                Err(chunk) => {
                    // The refill thread has not kept up (it waits in reclaim): this thread
                    // gives the surplus back, a run of adjacent chunks per hole punch, outside
                    // the lock.
                    let given_back = self.settle_surplus_to_target(k);
                    self.note_given_back_past_refill(given_back + len, "behind");
                    chunk
                }
            }
        } else {
            chunk
        };
        self.decommit(&mut [chunk]);
    }

    /// Room for the chunks a run of frees empties, given back together (see `FreedTogether`).
    /// For one thread at a time (the one freeing the slots swap reports); another waits.
    pub(super) fn freed_together(&self) -> FreedTogether<'_> {
        FreedTogether {
            reserve: self,
            chunks: self.freed_together.lock(),
            punches: Punches::default(),
        }
    }

    /// Give back `chunks`, emptied together by a run of frees, and leave the list empty: kept
    /// ready while the reserve is below its target, as `give_back` does, and the pages of the
    /// rest given back to the system from this thread, one hole punch per run of adjacent
    /// chunks. Why not one by one through the surplus lists and the refill thread: a killed
    /// program's incompressible pages are a one-page chunk each, and near OOM the kernel's
    /// OOM killer races the daemon for their memory (see `crate::slotfree::POLL_MEMORY_SHORT`).
    /// One by one, the surplus list filled faster than the refill thread emptied it, and both
    /// threads punched the runs each happened to hold, contending for the pools' locks:
    /// `cargo bench --bench store -- slot_frees` (17,000 such chunks) took 26.6-26.8 ms for
    /// the frees alone, the refill thread punching part of the holes after them, and takes
    /// 21.4 with every hole punched (this project's machine, 2026-11-30). A hole punch costs
    /// about 14 µs for one page and 1.2 µs a page for runs of 64, the kernel's own freeing of
    /// a shared-memory page about 1.
    /// A taker waiting for a chunk is told at once of those kept ready (it would otherwise
    /// wait for the refill thread, near OOM in reclaim, or its period). The punches run
    /// real-time, above the refill thread: near OOM under the VM's emulation the thread that
    /// frees shared the CPUs with the store's other threads, the refill thread (real-time)
    /// and reclaim: 39-48 µs a page given back over the near-OOM stage's four cases, against
    /// 18 with the punches real-time (`scripts/vm-stress-rounds.sh`, three rounds each,
    /// alternated, 2026-12-06; an idle VM punches runs of six pages at 5-7 µs a page), while
    /// the kernel's OOM killer waits for that memory. A punch takes no lock of ours.
    fn give_back_all(&self, chunks: &mut Vec<ArenaChunk>) -> Punches {
        let target = self.current_target.load(Ordering::Relaxed);
        let mut kept = false;
        while let Some(chunk) = chunks.pop() {
            if self.held_bytes.load(Ordering::Relaxed) + chunk.len() as u64 > target {
                chunks.push(chunk);
                break;
            }
            let k = chunk.len() / PAGE_SIZE - 1;
            if let Err(chunk) = self.keep_ready(&mut self.pools[k].lock(), chunk) {
                chunks.push(chunk);
                break;
            }
            kept = true;
        }
        if kept {
            self.tell_waiters();
        }
        if chunks.is_empty() {
            return Punches::default();
        }
        let started = Instant::now();
        let calls = self.decommit_with(chunks, || {
            crate::os::RealtimeWhile::enter(crate::os::REALTIME_PRIORITY_ABOVE)
        });
        let punched = Punches {
            calls,
            pages: chunks.iter().map(|chunk| chunk.len() / PAGE_SIZE).sum(),
            time: started.elapsed(),
        };
        chunks.clear();
        punched
    }

    /// Keep `chunk` ready in `pool` (counted as held) if its list has room; the chunk back
    /// otherwise.
    fn keep_ready(&self, pool: &mut Pool, chunk: ArenaChunk) -> Result<(), ArenaChunk> {
        let len = chunk.len() as u64;
        push_with_room(&mut pool.ready, chunk)?;
        self.held_bytes.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    /// Give back the surplus chunks (freed beyond the target) while the refill thread, which
    /// otherwise does, has been stuck in one activity for `REFILL_STUCK_AFTER`: kept ready
    /// while the reserve is below its target, their pages given back to the system beyond it.
    /// Why: near OOM the refill thread's commit waits in reclaim for as long as the system has
    /// no page for it, and the pages the system most needs then are those of the chunks a
    /// killed program's swap slots leave: the kernel's OOM killer, finding that the workers it
    /// killed freed no RAM (their pages were in this store), went on to the shell and then
    /// panicked, "System is deadlocked on memory" (the near-OOM stage of `scripts/vm-test.sh
    /// --stress`, 2026-11-26: 3 runs of 20 lost; one held 102 MiB for 31 MiB of swap).
    pub(super) fn give_back_past_stuck_refill(&self) {
        self.give_back_past_refill_stuck_for(REFILL_STUCK_AFTER);
    }

    /// `give_back_past_stuck_refill` with the refill thread counted stuck after `stuck_after`.
    fn give_back_past_refill_stuck_for(&self, stuck_after: Duration) {
        if !self.refill_stuck_for(stuck_after) {
            return;
        }
        let given_back = (0..self.pools.len())
            .map(|k| self.settle_surplus_to_target(k))
            .sum();
        self.note_given_back_past_refill(given_back, "stuck");
    }

    /// The surplus chunks of pool `k`, settled from a thread other than the refill thread:
    /// kept ready while the reserve is below its target, given back beyond it. Bytes given back.
    fn settle_surplus_to_target(&self, k: usize) -> u64 {
        let chunk_bytes = ((k + 1) * PAGE_SIZE) as u64;
        let target = self.current_target.load(Ordering::Relaxed);
        self.settle_surplus_keeping(k, |_| self.held_bytes() + chunk_bytes <= target, || ())
    }

    /// Count `bytes` given back by another thread because the refill thread was `why` (said
    /// the first time).
    fn note_given_back_past_refill(&self, bytes: u64, why: &'static str) {
        if bytes == 0 {
            return;
        }
        if self
            .given_back_past_refill
            .fetch_add(bytes, Ordering::Relaxed)
            == 0
        {
            let (refill, refill_for) = self.refill_activity();
            tracing::info!(
                given_back_kib = bytes >> 10,
                why,
                ?refill,
                refill_for_ms = refill_for.as_millis(),
                "freed chunks given back to the system past the refill thread"
            );
        }
    }

    /// Bytes given back past the refill thread so far.
    pub(super) fn given_back_past_refill(&self) -> u64 {
        self.given_back_past_refill.load(Ordering::Relaxed)
    }

    /// Whether the refill thread has been in one activity other than waiting for
    /// `REFILL_STUCK_AFTER` (near OOM: in a commit, waiting in reclaim).
    pub(super) fn refill_stuck(&self) -> bool {
        self.refill_stuck_for(REFILL_STUCK_AFTER)
    }

    fn refill_stuck_for(&self, stuck_after: Duration) -> bool {
        let (activity, for_how_long) = self.refill_activity();
        self.refill_running() && activity != RefillActivity::Waiting && for_how_long >= stuck_after
    }

    /// Wake the refill thread from the kernel's reclaim throttle (see `crate::mem::throttle`),
    /// for a thread that knows memory to be back.
    pub(super) fn rouse_refill(&self) {
        if self.refill_thread.wake() {
            self.refill_rousings.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// How often the refill thread was woken from the reclaim throttle (`rouse_stuck_refill`).
    pub(super) fn refill_rousings(&self) -> u64 {
        self.refill_rousings.load(Ordering::Relaxed)
    }

    /// Give the pages of `chunks` back to the system; they wait as cold pages. How many
    /// system calls that took (0, with the failure logged, where one failed).
    fn decommit(&self, chunks: &mut [ArenaChunk]) -> usize {
        self.decommit_with(chunks, || ())
    }

    /// `decommit`, with what `during` returns alive while the pages go back (and no longer:
    /// the cold pages' map is locked after).
    fn decommit_with<T>(&self, chunks: &mut [ArenaChunk], during: impl FnOnce() -> T) -> usize {
        let given_back = {
            let _during = during();
            ArenaChunk::decommit_all(chunks)
        };
        let calls = given_back.unwrap_or_else(|error| {
            tracing::warn!(%error, "giving a chunk's memory back failed");
            0
        });
        self.make_cold(chunks);
        calls
    }

    /// Note `chunks`, whose pages were given back, as cold.
    fn make_cold(&self, chunks: &[ArenaChunk]) {
        for chunk in chunks {
            self.cold.mark(chunk.page(), chunk.len() / PAGE_SIZE);
        }
    }

    /// Make at least one more chunk of `k + 1` pages ready, and at most `wanted`: a group of
    /// cold ones committed again, or a group carved from the arena (one chunk while a taker
    /// waits, `one_at_a_time`, or memory is short). False if none could be. Why at most
    /// `wanted`: a whole group for a pool one chunk short of its share put up to a group per
    /// pool (2 MiB for the eight sizes) of locked memory beyond the target, and `trim` then
    /// gave it back.
    fn commit_more(&self, k: usize, wanted: usize) -> bool {
        let chunk_bytes = (k + 1) * PAGE_SIZE;
        // One chunk at a time while memory is short: each commit then waits in reclaim for
        // one chunk, not for a group, and this thread gets back sooner to its hole punches
        // (near-OOM stage of `scripts/vm-test.sh --stress`, 2026-11-26 00:00: with cold chunks
        // recommitted by the group, one run of four left the serving process holding 132 MiB
        // for 25 MiB of swap and the VM wedged, another ended in the OOM panic) and to a
        // taker of another size that came meanwhile (on the 7.3 kernel, whose reclaim keeps
        // the committing thread busy for as long as it finds no page, a write starved 1.3 s
        // for a one-page chunk behind a commit, with 420 KiB ready right after: likely a group
        // carved for another size, 2026-11-29; the starved-write line now names the commit).
        let count = if self.one_at_a_time() || self.memory_short.load(Ordering::Relaxed) {
            1
        } else {
            (COMMIT_GROUP_BYTES / chunk_bytes).clamp(1, wanted.max(1))
        };
        let mut cold = ChunkGroup::new();
        while cold.len() < count {
            let Some(page) = self.cold.take(k + 1) else {
                break;
            };
            match self
                .arena
                .chunk_at(page.saturating_mul(PAGE_SIZE), chunk_bytes)
            {
                Ok(chunk) => cold.push(chunk),
                // Not reachable: cold pages lie in the carved part.
                Err(error) => {
                    tracing::error!(%error, page, "cold pages outside the arena dropped")
                }
            }
        }
        let committing = if cold.is_empty() { count } else { cold.len() };
        self.refill_state.note_commit(k + 1, committing);
        let committed = if cold.is_empty() {
            let carved_pages = (self.arena.carved() + chunk_bytes * count).div_ceil(PAGE_SIZE);
            // Nothing carved that the cold map could not mark once given back.
            match self
                .cold
                .cover(carved_pages)
                .map(|()| self.arena.carve(chunk_bytes, count))
            {
                Ok(Ok(Some(chunks))) => Ok(chunks.into_iter().collect()),
                Ok(Ok(None)) => {
                    self.refill_state.note_commit(0, 0);
                    return false;
                }
                Ok(Err(CarveFailed { error, chunks })) => {
                    // Carved, and given back by the carve: cold, for a later commit to try
                    // again (left out, they were arena lost until the next resume).
                    self.make_cold(&chunks);
                    Err(error)
                }
                Err(error) => Err(error),
            }
        } else {
            match ArenaChunk::recommit_all(&mut cold) {
                Ok(()) => Ok(cold),
                Err(error) => {
                    // Still cold; a later commit tries them again. What the failed commit
                    // did fault in goes back first: cold chunks hold no memory.
                    if let Err(undo) = ArenaChunk::decommit_all(&mut cold) {
                        tracing::warn!(%undo, "giving back chunks whose commit failed");
                    }
                    self.make_cold(&cold);
                    Err(error)
                }
            }
        };
        self.refill_state.note_commit(0, 0);
        match committed {
            Ok(mut chunks) => {
                self.commits.fetch_add(1, Ordering::Relaxed);
                let since_epoch = self.refill_state.epoch.elapsed().as_nanos();
                self.last_commit_ns.store(
                    u64::try_from(since_epoch).unwrap_or(u64::MAX).max(1),
                    Ordering::Release,
                );
                // Room made before the lock, under which no list grows (the refill thread
                // provisioned it before its commit, but frees given back meanwhile may have
                // filled it); whatever still finds none goes back cold.
                Self::make_room(&self.pools[k], |p| &mut p.ready, chunks.len(), GROUP_CHUNKS);
                {
                    let mut pool = self.pools[k].lock();
                    let room = pool.ready.capacity() - pool.ready.len();
                    let kept = chunks.len().min(room);
                    self.held_bytes
                        .fetch_add((kept * chunk_bytes) as u64, Ordering::Relaxed);
                    pool.ready.extend(chunks.drain(..kept));
                }
                if !chunks.is_empty() {
                    if let Err(error) = ArenaChunk::decommit_all(&mut chunks) {
                        tracing::warn!(%error, "giving back committed chunks with no room in the reserve");
                    }
                    self.make_cold(&chunks);
                }
                true
            }
            Err(error) => {
                tracing::warn!(%error, "committing chunk memory failed");
                false
            }
        }
    }

    /// `provision` every pool, from the calling thread (a resumed store's, before its device
    /// is live and its refill thread runs).
    pub(super) fn provision_pools(&self) {
        for pool in self.pools.iter() {
            Self::provision(pool);
        }
    }

    /// Keep room in each pool's `ready` and `surplus` lists for `POOL_SLACK` more chunks, so
    /// that giving a chunk back on the I/O path never grows a list there: growing it could
    /// fault in fresh heap pages under memory pressure.
    fn provision(pool: &Mutex<Pool>) {
        Self::make_room(pool, |p| &mut p.ready, POOL_SLACK / 2, POOL_SLACK);
        Self::make_room(pool, |p| &mut p.surplus, POOL_SLACK / 2, POOL_SLACK);
    }

    /// Room in one of `pool`'s lists for `at_least` more chunks: where it has less, a new list
    /// with room for `slack` more than it holds, allocated and faulted in here, outside the
    /// pool's lock; only the move of the entries happens under it.
    fn make_room(
        pool: &Mutex<Pool>,
        list: fn(&mut Pool) -> &mut Vec<ArenaChunk>,
        at_least: usize,
        slack: usize,
    ) {
        let spare = |list: &Vec<ArenaChunk>| list.capacity() - list.len();
        let len = {
            let mut pool = pool.lock();
            let list = list(&mut pool);
            if spare(list) >= at_least {
                return;
            }
            list.len()
        };
        let mut fresh = crate::mem::faulted_in_vec(len + slack.max(at_least));
        let mut pool = pool.lock();
        let list = list(&mut pool);
        // Moved only if it still fits: nothing may allocate under the pool lock.
        if spare(list) < at_least && list.len() <= fresh.capacity() {
            fresh.append(list);
            std::mem::swap(list, &mut fresh);
        }
    }

    /// Commit chunks until every pool holds its share of the target (by demand); surplus
    /// chunks make up the share first, and beyond it give their pages back.
    pub(super) fn refill(&self) {
        self.refill_and(&|| ());
    }

    /// `refill`, running `also` between commits (at most every `ALSO_INTERVAL`): what else the
    /// refill thread provides must not wait behind commits that wait in reclaim.
    fn refill_and(&self, also: &dyn Fn()) {
        let mut also_ran: Option<Instant> = None;
        self.surplus_waiting.store(false, Ordering::Release);
        let target = self.target_for_pass();
        let demand: Vec<u64> = self
            .demand
            .iter()
            .map(|d| {
                let seen = d.load(Ordering::Relaxed);
                d.fetch_sub(seen / 2, Ordering::Relaxed);
                seen
            })
            .collect();
        let total: u64 = demand.iter().sum::<u64>().max(1);
        let limit = self.trim_above(target);
        let trimming = self.held_bytes() > limit;
        // Pools a taker waits on first; the others are left as soon as one is waited on.
        let wanted = self.wanted.load(Ordering::Relaxed);
        let is_wanted = |k: usize| wanted & (1 << k) != 0;
        let order: Vec<usize> = (0..self.pools.len())
            .filter(|&k| is_wanted(k))
            .chain((0..self.pools.len()).filter(|&k| !is_wanted(k)))
            .collect();
        for k in order {
            let pool = &self.pools[k];
            let chunk_bytes = ((k + 1) * PAGE_SIZE) as u64;
            let share = self.share(demand[k], total, target);
            pool.lock().last_resort = usize::try_from(share / chunk_bytes / 4).unwrap_or(0);
            self.refill_state.set(RefillActivity::Provisioning);
            Self::provision(pool);
            self.settle_surplus(k, share);
            if trimming {
                self.trim(k, share, target);
            }
            while !self.stop.load(Ordering::Relaxed) {
                let held = pool.lock().ready.len() as u64 * chunk_bytes;
                if held + chunk_bytes > share {
                    break;
                }
                let waited_on = self.wanted.load(Ordering::Relaxed);
                if waited_on != 0 && waited_on & (1 << k) == 0 {
                    break; // another size is waited on: the next pass serves it first
                }
                // Beyond the target only for a size running low (waited on, or below half its
                // share). Why: shares follow demand, which shifts between sizes from pass to
                // pass, and each size committed up to its share while the others still held
                // theirs kept the reserve above its target, so that `trim` gave chunks back
                // that this loop committed again moments later: in `trueno-ublk bench --input
                // <400 MiB of real pages> --algorithm lz4 --recompress off --overwrites 0`
                // (2026-11-29, 64 MiB target) 45-60 MiB of 209 MiB committed, each give-back
                // a hole punch that flushes every CPU's TLB; without it the refill thread
                // spent 0.08-0.10 s instead of 0.14-0.16 s, and the writes went 4% faster.
                let room = target.saturating_sub(self.held_bytes()) / chunk_bytes;
                let running_low = waited_on & (1 << k) != 0 || held * 2 < share;
                if room == 0 && !running_low {
                    break;
                }
                self.refill_state.set(RefillActivity::Provisioning);
                Self::provision(pool);
                if also_ran.is_none_or(|at| at.elapsed() >= ALSO_INTERVAL) {
                    also_ran = Some(Instant::now());
                    also();
                }
                if self.commits_may_wait() {
                    self.refill_state.set(RefillActivity::GivingBack);
                    // Chunks freed since the pass began first: with memory short, this thread
                    // may commit for one size for seconds, and the pages of the chunks a
                    // killed program's slots left are what its own commit waits for in
                    // reclaim (punched by another thread only once this one is stuck, see
                    // `give_back_past_stuck_refill`).
                    if self.surplus_waiting.swap(false, Ordering::AcqRel) {
                        for (j, &seen) in demand.iter().enumerate() {
                            self.settle_surplus(j, self.share(seen, total, target));
                        }
                    }
                    self.steal_for(k, waited_on, &demand, total, target);
                }
                self.refill_state.set(RefillActivity::Committing);
                // What the share misses, not a whole group beyond it.
                let mut missing = (share - held) / chunk_bytes;
                if !running_low {
                    missing = missing.min(room);
                }
                let missing = usize::try_from(missing).unwrap_or(usize::MAX);
                // By what the commit says, not by the reserve's bytes before and after: a
                // taker popping meanwhile made a commit look like none, and the waiters were
                // not told.
                if !self.commit_more(k, missing) {
                    break; // nothing could be committed
                }
                self.tell_waiters();
            }
            // Asked for and ready now: not waited on any more. Only a waiting taker's
            // `served` cleared the bit, and one set by background work (`take_ready`, which
            // never waits) stayed for good once a writer of that size took the chunk made
            // for it, every other size left refilled only by takers that missed. A taker
            // still waiting sets it again at its next look.
            if self.wanted.load(Ordering::Relaxed) & (1 << k) != 0 && !pool.lock().ready.is_empty()
            {
                self.wanted.fetch_and(!(1 << k), Ordering::Relaxed);
            }
        }
    }

    /// The surplus chunks of pool `k` (given back beyond the target): kept ready up to the
    /// pool's `share`, their pages given back to the system beyond it.
    fn settle_surplus(&self, k: usize, share: u64) {
        let chunk_bytes = ((k + 1) * PAGE_SIZE) as u64;
        self.settle_surplus_keeping(
            k,
            |pool| (pool.ready.len() as u64 + 1) * chunk_bytes <= share,
            || self.refill_state.set(RefillActivity::GivingBack),
        );
    }

    /// The surplus chunks of pool `k`: each kept ready while `keep` says so of the pool as it
    /// is, its pages given back to the system otherwise (`giving_back` first, each time).
    /// Bytes given back.
    fn settle_surplus_keeping(
        &self,
        k: usize,
        keep: impl Fn(&Pool) -> bool,
        giving_back: impl Fn(),
    ) -> u64 {
        let chunk_bytes = ((k + 1) * PAGE_SIZE) as u64;
        let mut given_back = 0;
        loop {
            let mut beyond = ChunkGroup::new();
            let more = {
                let mut pool = self.pools[k].lock();
                while beyond.len() < GROUP_CHUNKS {
                    let Some(chunk) = pool.surplus.pop() else {
                        break;
                    };
                    if !keep(&pool) {
                        beyond.push(chunk);
                    } else if let Err(chunk) = self.keep_ready(&mut pool, chunk) {
                        beyond.push(chunk);
                    }
                }
                !pool.surplus.is_empty()
            };
            if !beyond.is_empty() {
                giving_back();
                given_back += beyond.len() as u64 * chunk_bytes;
                self.decommit(&mut beyond);
            }
            if !more {
                return given_back;
            }
        }
    }

    /// Before a commit for pool `k` while one may wait (`commits_may_wait`): give back the ready
    /// chunks that other pools nobody waits on (`wanted` has a bit per pool waited on) hold beyond
    /// their share, as much as the commit takes; for a size a taker waits on, beyond their share
    /// by `demand` alone (without `share`'s floor). Why: with memory short a commit waits in
    /// reclaim, and writes whose pool ran dry starved for a second (then fail with ENOMEM) while
    /// the reserve held 1.7 MiB ready in the floors of the sizes nobody wrote (the near-OOM stage
    /// of `scripts/vm-test.sh --stress`, 2026-11-25 04:28, incompressible pages: every starved
    /// write was logged with its refill thread in `Committing` for over a second and 1752 KiB
    /// held). Pages given back go to this CPU's free lists, where the commit right after finds
    /// them: the reserve's memory moves to the size in demand instead of waiting for reclaim.
    /// Why the floors only for a waiting taker: the next pass commits a floor again, so taking
    /// floors for every commit gave back and committed the same memory pass after pass (about
    /// 480 KiB a pass in the test below, each a hole punch and a commit for nothing; in the
    /// VM's near-OOM stage, move-inv at 2 x 80 MiB, 2026-11-30: 1.6 GiB given back in the
    /// case's 30 s and the refill thread at 14.7 CPU s, against 164 MiB and 8.5 s since).
    fn steal_for(&self, k: usize, wanted: u64, demand: &[u64], total: u64, target: u64) {
        // As `commit_more` sizes its commit: one chunk while memory is short too.
        let one_chunk = self.one_at_a_time() || self.memory_short.load(Ordering::Relaxed);
        let needed = if self.cold.pages() <= k && !one_chunk {
            COMMIT_GROUP_BYTES
        } else {
            (k + 1) * PAGE_SIZE
        };
        let waited_on = wanted & (1 << k) != 0;
        self.steal(needed, |j| {
            let seen = demand.get(j).copied().unwrap_or(0);
            (j != k && wanted & (1 << j) == 0).then(|| {
                if waited_on {
                    demand_share(seen, total, target)
                } else {
                    self.share(seen, total, target)
                }
            })
        });
    }

    /// Before the refill thread faults in `bytes` of bookkeeping (the page table's memory, the
    /// allocator's lists) while it may wait (`commits_may_wait`): give back as much of the ready
    /// chunks that pools nobody waits on hold beyond their share by recent demand, as `steal_for`
    /// does before a commit of chunks. Why: such a fault waits in reclaim like a commit does, and
    /// writers wait for it (a table group, room in a list) and for the chunks the refill thread
    /// commits after it: in a clean-clone CI run (2026-11-27 12:21, the three-process swap run)
    /// writes starved 5 s with the refill thread provisioning and 1 MiB ready in the reserve, and a
    /// diagnostic build found such waits in one fault of a table group.
    pub(super) fn make_room_for(&self, bytes: usize) {
        if !self.commits_may_wait() {
            return;
        }
        let wanted = self.wanted.load(Ordering::Relaxed);
        let target = self.current_target.load(Ordering::Relaxed);
        let total = self
            .demand
            .iter()
            .map(|d| d.load(Ordering::Relaxed))
            .sum::<u64>()
            .max(1);
        self.steal(bytes, |j| {
            let demand = self.demand.get(j)?.load(Ordering::Relaxed);
            (wanted & (1 << j) == 0).then(|| demand_share(demand, total, target))
        });
    }

    /// Give back ready chunks of the pools `share` names, each pool down to the share it
    /// gives (`None`: leave the pool alone), until `needed` bytes or more are given back or
    /// no pool holds more beyond its share.
    fn steal(&self, needed: usize, share: impl Fn(usize) -> Option<u64>) {
        let mut stolen = 0;
        for j in 0..self.pools.len() {
            let Some(share) = share(j) else {
                continue;
            };
            let chunk_bytes = ((j + 1) * PAGE_SIZE) as u64;
            while stolen < needed {
                let mut taken = ChunkGroup::new();
                {
                    let mut pool = self.pools[j].lock();
                    while stolen < needed
                        && taken.len() < GROUP_CHUNKS
                        && pool.ready.len() as u64 * chunk_bytes > share
                    {
                        let Some(chunk) = pool.ready.pop() else {
                            break;
                        };
                        stolen += chunk.len();
                        self.held_bytes
                            .fetch_sub(chunk.len() as u64, Ordering::Relaxed);
                        taken.push(chunk);
                    }
                }
                if taken.is_empty() {
                    break;
                }
                self.decommit(&mut taken);
            }
        }
        if stolen > 0 {
            self.stolen_bytes
                .fetch_add(stolen as u64, Ordering::Relaxed);
        }
    }

    /// Whether a commit may wait in reclaim now, so that the refill thread gives back what
    /// nobody waits on before it commits or faults in bookkeeping (`steal_for`,
    /// `make_room_for`): memory is short, or a taker already waits for this thread. Why the
    /// second: the memory watch looks at `MemAvailable`, which counts page cache that the
    /// refill thread, an I/O flusher, may not be able to reclaim; in a clean-clone CI run
    /// (2026-11-27 16:07, the three-process swap run, memory "back" by the watch for 36 s) a
    /// write starved 5 s behind one commit of a 7-page chunk while the reserve held 4 MiB
    /// ready in other sizes.
    fn commits_may_wait(&self) -> bool {
        self.memory_short.load(Ordering::Relaxed) || self.starving()
    }

    /// Whether commits are of one chunk instead of a group: while a taker waits. Why: with RAM
    /// at the watermark the pages of a commit come one by one as reclaim frees them, and a
    /// group's 64 took over a second after a takeover during a fill, the waiting writes
    /// failing with ENOMEM meanwhile (clean-clone CI run of 2026-11-25 04:49: the starved
    /// write's log line had the refill thread in one commit for 1011 ms); the taker needs one.
    fn one_at_a_time(&self) -> bool {
        self.starving()
    }

    /// A pool's share of `target`, by its `demand` of `total`: at least one commit group's
    /// worth, so no size ever starves, but no more than an equal part of the target: the
    /// floors alone keep 2 MiB, more than a quiet reserve's smaller target or a memory limit
    /// below 2 MiB allows (with `--mem-limit 1M`, the reserve held 1.5 MiB of chunks).
    fn share(&self, demand: u64, total: u64, target: u64) -> u64 {
        let floor = (COMMIT_GROUP_BYTES as u64).min(target / self.pools.len().max(1) as u64);
        demand_share(demand, total, target).max(floor)
    }

    /// The target of a refill pass: `target_bytes`, or a quarter of it (at most 512 KiB) once no chunk has been
    /// taken for `QUIET_AFTER` while memory is not short. Why: the reserve is locked memory
    /// held for the next burst of writes, and a swap device is idle most of its life (the
    /// issue's idle footprint); the first chunk taken, or memory getting short, brings the
    /// whole target back at the next pass, which the taker wakes.
    fn target_for_pass(&self) -> u64 {
        let taken = self.taken.swap(0, Ordering::Relaxed);
        let mut last_busy = self.last_busy.lock();
        if taken > 0 || self.memory_short.load(Ordering::Relaxed) {
            *last_busy = Instant::now();
        }
        let target = if last_busy.elapsed() >= QUIET_AFTER {
            (self.target_bytes / QUIET_TARGET_DIVISOR).min(QUIET_TARGET_MAX_BYTES)
        } else {
            self.target_bytes
        };
        self.current_target.store(target, Ordering::Relaxed);
        target
    }

    /// What the reserve may hold before a pass gives chunks back (`trim`): `target`, or while
    /// chunks are taken and memory is not short, `1 / TRIM_SLACK_DIVISOR` more, so that the
    /// commits for sizes running low (see `refill_and`) do not each bring a give-back.
    fn trim_above(&self, target: u64) -> u64 {
        if target < self.target_bytes || self.memory_short.load(Ordering::Relaxed) {
            target
        } else {
            target + target / TRIM_SLACK_DIVISOR
        }
    }

    /// Give back the ready chunks of pool `k` beyond its `share` while the reserve holds more
    /// than `target` (once past `trim_above`): demand moved to other sizes, a commit group
    /// overshot, or the reserve went quiet. Without it the reserve only grows (seen on the old
    /// layout: 7.5 MiB held for a 4 MiB target after a fill and its discard), and all of it is
    /// locked memory nobody else can use.
    fn trim(&self, k: usize, share: u64, target: u64) {
        let chunk_bytes = ((k + 1) * PAGE_SIZE) as u64;
        loop {
            let mut cut = ChunkGroup::new();
            {
                let mut pool = self.pools[k].lock();
                while cut.len() < GROUP_CHUNKS
                    && self.held_bytes() > target
                    && pool.ready.len() as u64 * chunk_bytes > share
                {
                    let Some(chunk) = pool.ready.pop() else {
                        break;
                    };
                    self.held_bytes.fetch_sub(chunk_bytes, Ordering::Relaxed);
                    cut.push(chunk);
                }
            }
            if cut.is_empty() {
                return;
            }
            self.refill_state.set(RefillActivity::GivingBack);
            self.decommit(&mut cut);
        }
    }

    /// Whether a refill thread runs (and so provisions the allocator's bookkeeping).
    pub(super) fn refill_running(&self) -> bool {
        self.refill_running.load(Ordering::Acquire)
    }

    /// Whether takers wait for the refill thread rather than commit memory themselves.
    pub(super) fn refill_serves(&self) -> bool {
        self.enabled() && self.refill_running()
    }

    /// Say a refill thread runs where none does: one that never commits or provisions
    /// anything, as when the system gives it no memory.
    #[cfg(test)]
    pub(super) fn pretend_refill_running(&self, running: bool) {
        self.refill_running.store(running, Ordering::Release);
    }

    /// Wake the refill thread and wait until it has made a pass (or a period has gone by).
    pub(super) fn await_refill_pass(&self) {
        self.await_refill_unless(&|| false);
    }

    /// Wake the refill thread and wait until it has made a pass, a period has gone by, or
    /// `done` (asked under the lock the refill thread wakes waiters under, so no wake-up is
    /// missed).
    pub(super) fn await_refill_unless(&self, done: &dyn Fn() -> bool) {
        let mut guard = self.wake_lock.lock();
        if done() {
            return;
        }
        self.wake.notify_one();
        self.refilled.wait_for(&mut guard, REFILL_PERIOD);
    }

    /// Wake the takers waiting for the refill thread, if any, after a commit: a pass may
    /// commit the whole target, and a taker woken only at its end (or its period) waited tens
    /// of milliseconds for a chunk that was ready (`bench` wrote at a quarter of the speed it
    /// has without a reserve).
    pub(super) fn tell_waiters(&self) {
        if self.waiters.load(Ordering::Relaxed) > 0 {
            let _guard = self.wake_lock.lock();
            self.refilled.notify_all();
        }
    }

    /// Note what the refill thread does next, for `also`'s parts (see `run_refill`): called
    /// from the refill thread alone.
    pub(super) fn note_refill_activity(&self, activity: RefillActivity) {
        self.refill_state.set(activity);
    }

    pub(super) fn wake_refill(&self) {
        let _guard = self.wake_lock.lock();
        self.wake.notify_one();
    }

    /// Wake the refill thread if it sleeps for `REFILL_IDLE_PERIOD`: activity again. One
    /// load when it does not (every take asks).
    fn wake_refill_if_sleeping(&self) {
        if self.sleeping.load(Ordering::Relaxed) && self.sleeping.swap(false, Ordering::AcqRel) {
            self.wake_refill();
        }
    }

    /// Whether the refill thread sleeps for `REFILL_IDLE_PERIOD` now.
    #[cfg(test)]
    fn refill_sleeps(&self) -> bool {
        self.sleeping.load(Ordering::Acquire)
    }

    /// The refill thread's loop, until `stop`; `also` runs after each pass (the allocator
    /// grows its bookkeeping there).
    pub(super) fn run_refill(&self, also: impl Fn()) {
        let _registered = self.refill_thread.register();
        let _running = RefillRunning::start(self);
        let mut quiet_passes = 0_u32;
        while !self.stop.load(Ordering::Acquire) {
            also();
            let held_before = self.held_bytes();
            let active = self.taken.load(Ordering::Relaxed) > 0
                || self.memory_short()
                || self.wanted.load(Ordering::Relaxed) != 0
                || self.waiters.load(Ordering::Relaxed) > 0
                || self.surplus_waiting.load(Ordering::Relaxed);
            self.refill_and(&also);
            quiet_passes = if active || self.held_bytes() != held_before {
                0
            } else {
                quiet_passes.saturating_add(1)
            };
            self.refill_state.set(RefillActivity::Waiting);
            let mut guard = self.wake_lock.lock();
            self.refilled.notify_all();
            if !self.stop.load(Ordering::Acquire) {
                if quiet_passes >= QUIET_PASSES {
                    self.sleeping.store(true, Ordering::Release);
                    self.wake.wait_for(&mut guard, REFILL_IDLE_PERIOD);
                    self.sleeping.store(false, Ordering::Release);
                } else {
                    self.wake.wait_for(&mut guard, REFILL_PERIOD);
                }
            }
        }
    }

    pub(super) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let _guard = self.wake_lock.lock();
        self.wake.notify_all();
        self.refilled.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arena() -> Arc<Arena> {
        Arena::private(64 << 20).unwrap()
    }

    #[test]
    fn without_a_refill_thread_the_arena_is_taken_to_its_last_chunk() {
        // 70 pages: a commit group of one-page chunks (64) fits once, a second does not; the
        // six pages left are taken one at a time, and then the arena is used up at once.
        let reserve = ChunkReserve::new(0, Arena::private(70 * PAGE_SIZE).unwrap(), &[1, 1]);
        let taken: Vec<ArenaChunk> = (0..70).map(|_| reserve.take(1, None).unwrap()).collect();
        assert_eq!(taken.len(), 70);
        let asked = Instant::now();
        assert!(matches!(reserve.take(1, None), Err(Shortage::ArenaFull)));
        assert!(
            asked.elapsed() < COMMIT_RETRY_FOR / 2,
            "{:?}",
            asked.elapsed()
        );
    }

    #[test]
    fn takers_are_served_from_the_pool_and_by_the_refill_thread() {
        let reserve = ChunkReserve::new(512 * PAGE_SIZE as u64, arena(), &[1, 1]);
        reserve.refill();
        assert!(reserve.held_bytes() > 0 && reserve.held_bytes() <= 512 * PAGE_SIZE as u64);
        for _ in 0..20 {
            assert_eq!(reserve.take(2, None).unwrap().len(), 2 * PAGE_SIZE);
        }
        assert_eq!(reserve.misses(), 0, "the first chunks came from the pool");
        let reserve = Arc::new(reserve);
        let refill = {
            let reserve = Arc::clone(&reserve);
            std::thread::spawn(move || reserve.run_refill(|| ()))
        };
        while !reserve.refill_running.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
        // Far more than the pool held: takers are served by the refill thread (waiting for it
        // when the pool runs dry), never left hanging.
        for _ in 0..300 {
            assert_eq!(reserve.take(2, None).unwrap().len(), 2 * PAGE_SIZE);
        }
        reserve.stop();
        refill.join().unwrap();
    }

    #[test]
    fn an_idle_refill_thread_sleeps_longer_and_the_next_take_wakes_it() {
        let reserve = Arc::new(ChunkReserve::new(64 * PAGE_SIZE as u64, arena(), &[1]));
        let passes = Arc::new(AtomicUsize::new(0));
        let refill = {
            let (reserve, passes) = (Arc::clone(&reserve), Arc::clone(&passes));
            std::thread::spawn(move || {
                reserve.run_refill(|| {
                    passes.fetch_add(1, Ordering::Relaxed);
                })
            })
        };
        // Nothing taken: once the reserve is down to its quiet target and `QUIET_PASSES`
        // passes saw nothing happen, the thread sleeps for `REFILL_IDLE_PERIOD`.
        let started = Instant::now();
        while !reserve.refill_sleeps() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "never slept longer"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let before = passes.load(Ordering::Relaxed);
        let taken = Instant::now();
        assert_eq!(reserve.take(1, None).unwrap().len(), PAGE_SIZE);
        assert!(!reserve.refill_sleeps(), "the taker woke it");
        while passes.load(Ordering::Relaxed) == before {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            taken.elapsed() < REFILL_IDLE_PERIOD / 2,
            "a pass {:?} after the take: not woken by it",
            taken.elapsed()
        );
        reserve.stop();
        refill.join().unwrap();
    }

    #[test]
    fn a_taker_waiting_for_a_refill_thread_that_unwinds_commits_for_itself() {
        let reserve = Arc::new(ChunkReserve::new(8 * PAGE_SIZE as u64, arena(), &[1]));
        let (waiting_tx, waiting_rx) = std::sync::mpsc::channel::<()>();
        let waiting_rx = std::sync::Mutex::new(waiting_rx);
        let refill = {
            let reserve = Arc::clone(&reserve);
            std::thread::spawn(move || {
                // Dies on its first round, once a taker waits for it (a bug in the thread).
                reserve.run_refill(|| {
                    waiting_rx.lock().unwrap().recv().unwrap();
                    panic!("refill bug (test)");
                })
            })
        };
        while !reserve.refill_running() {
            std::thread::yield_now();
        }
        let (taken_tx, taken_rx) = std::sync::mpsc::channel();
        {
            let reserve = Arc::clone(&reserve);
            std::thread::spawn(move || taken_tx.send(reserve.take(1, None).map(|c| c.len())));
        }
        while !reserve.starving() {
            std::thread::sleep(Duration::from_millis(5));
        }
        waiting_tx.send(()).unwrap();
        assert!(refill.join().is_err(), "the refill thread unwound");
        assert!(!reserve.refill_running());
        // (A taker left waiting for good is left behind by the failed test.)
        let taken = taken_rx.recv_timeout(Duration::from_secs(20));
        assert_eq!(taken, Ok(Ok(PAGE_SIZE)), "the taker was served");
    }

    #[test]
    fn a_taker_left_waiting_by_the_refill_thread_shows_as_starvation() {
        let reserve = Arc::new(ChunkReserve::new(8 * PAGE_SIZE as u64, arena(), &[1]));
        assert!(!reserve.starving());
        // A refill thread that never commits anything: the system has no memory to give.
        reserve.pretend_refill_running(true);
        let taker = {
            let reserve = Arc::clone(&reserve);
            std::thread::spawn(move || {
                (0..64)
                    .map(|_| reserve.take(1, None).unwrap().len())
                    .sum::<usize>()
            })
        };
        while !reserve.starving() {
            std::thread::sleep(Duration::from_millis(5));
        }
        // Stopping releases the taker (it commits for itself) and ends the starvation.
        reserve.stop();
        assert_eq!(taker.join().unwrap(), 64 * PAGE_SIZE);
        assert!(!reserve.starving());
    }

    #[test]
    fn runs_are_found_among_pages_in_order() {
        let pairs = |pages: &[usize]| -> Vec<(usize, usize)> {
            pages.iter().enumerate().map(|(i, &p)| (p, i)).collect()
        };
        assert_eq!(run_end(&pairs(&[0, 1, 2]), 1, 3), Some(2));
        assert_eq!(run_end(&pairs(&[0, 2, 3, 4, 9]), 1, 3), Some(3));
        assert_eq!(run_end(&pairs(&[0, 2, 4, 6]), 2, 2), Some(1));
        assert_eq!(run_end(&pairs(&[0, 2, 4]), 1, 2), None);
        assert_eq!(run_end(&pairs(&[5]), 1, 2), None);
        assert_eq!(run_end(&[], 1, 2), None);
    }

    #[test]
    fn a_taker_whose_size_ran_dry_joins_adjacent_smaller_ready_chunks() {
        // Sizes of 1, 2 and 3 pages; only one-page chunks ready, committed as a run.
        let reserve = ChunkReserve::new(512 * PAGE_SIZE as u64, arena(), &[1, 1, 1]);
        assert!(reserve.commit_more(0, 16));
        let ready = reserve.pools[0].lock().ready.len();
        assert!(ready >= 6);
        let held = reserve.held_bytes();
        // A refill thread that never commits: the taker is served from what is ready.
        reserve.pretend_refill_running(true);
        let never = |_: Duration| -> bool { panic!("the taker waited") };
        let chunk = reserve.take(3, Some(&never)).unwrap();
        assert_eq!(chunk.len(), 3 * PAGE_SIZE);
        assert_eq!(reserve.joined_chunks(), 1);
        assert_eq!(reserve.held_bytes(), held - 3 * PAGE_SIZE as u64);
        assert_eq!(reserve.pools[0].lock().ready.len(), ready - 3);
        // Two pages from one-page chunks too (the 2-page pool is empty).
        assert_eq!(reserve.take(2, Some(&never)).unwrap().len(), 2 * PAGE_SIZE);
        assert_eq!(reserve.joined_chunks(), 2);
        // Ready chunks that are not adjacent do not join: every other one-page chunk left.
        let mut pool = reserve.pools[0].lock();
        let odd: Vec<ArenaChunk> = {
            pool.ready.sort_unstable_by_key(ArenaChunk::page);
            let mut kept = Vec::new();
            let mut taken = Vec::new();
            for (i, chunk) in pool.ready.drain(..).enumerate() {
                if i % 2 == 0 {
                    kept.push(chunk);
                } else {
                    taken.push(chunk);
                }
            }
            pool.ready.extend(kept);
            taken
        };
        drop(pool);
        assert!(reserve.join_smaller(1, true).is_none());
        drop(odd);
        reserve.pretend_refill_running(false);
    }

    #[test]
    fn with_memory_short_chunks_are_committed_one_at_a_time() {
        let ready = |reserve: &ChunkReserve| -> u64 {
            reserve
                .pools
                .iter()
                .map(|pool| pool.lock().ready.len() as u64)
                .sum()
        };
        // Memory plentiful: a commit is a group of chunks.
        let reserve = ChunkReserve::new(512 * PAGE_SIZE as u64, arena(), &[1, 1]);
        reserve.refill();
        assert!(reserve.commits() < ready(&reserve));
        // Short: each commit, carved or cold, is one chunk (so that a taker of another size
        // waits for one chunk's reclaim at most).
        let reserve = ChunkReserve::new(512 * PAGE_SIZE as u64, arena(), &[1, 1]);
        reserve.set_memory_short(true);
        reserve.refill();
        assert!(ready(&reserve) > 1);
        assert_eq!(reserve.commits(), ready(&reserve));
        assert_eq!(reserve.refill_commit(), None, "no commit under way");
    }

    #[test]
    fn with_memory_short_the_size_in_demand_is_refilled_from_the_others_first() {
        let reserve = ChunkReserve::new(512 * PAGE_SIZE as u64, arena(), &[1, 1]);
        reserve.refill();
        assert!(!reserve.pools[0].lock().ready.is_empty());
        // Writes take two-page chunks only: that size is in demand, the other is not.
        let drain = || {
            while !reserve.pools[1].lock().ready.is_empty() {
                reserve.take(2, None).unwrap();
            }
        };
        drain();
        // With memory plentiful the other pool's chunks are not touched to refill it.
        reserve.refill();
        assert_eq!(reserve.stolen_bytes(), 0);
        assert!(!reserve.pools[1].lock().ready.is_empty());
        drain();
        let ready = reserve.pools[0].lock().ready.len();
        let carved = reserve.arena.carved();
        assert!(ready > 0);
        reserve.set_memory_short(true);
        reserve.refill();
        assert!(
            !reserve.pools[1].lock().ready.is_empty(),
            "the size in demand is refilled"
        );
        let stolen = usize::try_from(reserve.stolen_bytes()).unwrap();
        assert!(stolen >= COMMIT_GROUP_BYTES, "{stolen} bytes stolen");
        assert!(reserve.pools[0].lock().ready.len() <= ready - stolen / PAGE_SIZE);
        // The stolen chunks' pages, given back, were committed again for the size in demand.
        let refilled = reserve.pools[1].lock().ready.len() * 2 * PAGE_SIZE;
        assert!(
            reserve.arena.carved() - carved < refilled,
            "{} bytes carved for {refilled} refilled",
            reserve.arena.carved() - carved
        );
    }

    #[test]
    fn with_memory_short_a_size_nobody_writes_is_not_committed_only_to_be_given_back() {
        let reserve = ChunkReserve::new(512 * PAGE_SIZE as u64, arena(), &[1, 1, 1, 1]);
        reserve.set_memory_short(true);
        reserve.refill();
        // Writes take two-page chunks only, pass after pass, while memory stays short.
        let mut stolen_per_pass = Vec::new();
        for _ in 0..12 {
            for _ in 0..64 {
                drop(reserve.take(2, None).unwrap());
            }
            let before = reserve.stolen_bytes();
            reserve.refill();
            stolen_per_pass.push(reserve.stolen_bytes() - before);
        }
        // What the other sizes held beyond their floor moved to the size in demand in the
        // first passes; after that nothing churns: a floor committed in one pass and given
        // back in the next is a commit and a hole punch for nothing.
        assert_eq!(
            stolen_per_pass[6..].iter().sum::<u64>(),
            0,
            "given back per pass: {stolen_per_pass:?}"
        );
    }

    #[test]
    fn with_memory_short_room_for_the_page_table_comes_from_sizes_nobody_waits_on() {
        let reserve = ChunkReserve::new(512 * PAGE_SIZE as u64, arena(), &[1, 1]);
        reserve.refill();
        // Writes took two-page chunks lately: one-page chunks are beyond their demand.
        for _ in 0..8 {
            reserve.take(2, None).unwrap();
        }
        let held = reserve.held_bytes();
        let one_page = reserve.pools[0].lock().ready.len();
        assert!(one_page > 8);
        // With memory plentiful nothing is given back for the table.
        reserve.make_room_for(7 * PAGE_SIZE);
        assert_eq!(reserve.held_bytes(), held);
        // With memory short as much as the table's fault takes, from the size nobody waits on.
        reserve.set_memory_short(true);
        let two_pages = reserve.pools[1].lock().ready.len();
        reserve.wanted.store(1 << 1, Ordering::Relaxed);
        reserve.make_room_for(7 * PAGE_SIZE);
        assert_eq!(reserve.stolen_bytes(), 7 * PAGE_SIZE as u64);
        assert_eq!(reserve.held_bytes(), held - 7 * PAGE_SIZE as u64);
        assert_eq!(reserve.pools[0].lock().ready.len(), one_page - 7);
        assert_eq!(
            reserve.pools[1].lock().ready.len(),
            two_pages,
            "waited on: kept"
        );
    }

    #[test]
    fn while_a_taker_waits_its_size_is_refilled_from_the_others_though_memory_looks_plentiful() {
        let reserve = ChunkReserve::new(512 * PAGE_SIZE as u64, arena(), &[1, 1]);
        reserve.refill();
        while !reserve.pools[1].lock().ready.is_empty() {
            reserve.take(2, None).unwrap();
        }
        let one_page = reserve.pools[0].lock().ready.len();
        assert!(one_page > 0);
        // The memory watch says nothing is short, but a taker of two-page chunks waits: the
        // commits for it may wait in reclaim all the same.
        reserve.note_waiting();
        reserve.wanted.store(1 << 1, Ordering::Relaxed);
        reserve.refill();
        assert!(!reserve.pools[1].lock().ready.is_empty());
        assert!(reserve.stolen_bytes() >= 2 * PAGE_SIZE as u64);
        assert!(reserve.pools[0].lock().ready.len() < one_page);
        // Nothing is given back for bookkeeping once the taker is served.
        let stolen = reserve.stolen_bytes();
        reserve.note_served();
        reserve.make_room_for(PAGE_SIZE);
        assert_eq!(reserve.stolen_bytes(), stolen);
    }

    /// A size background work asked for (`take_ready` found none) is not taken as waited on
    /// for good: once a pass made it ready, the other sizes are refilled as before.
    #[test]
    fn a_size_asked_for_by_background_work_is_not_waited_on_once_ready() {
        let reserve = ChunkReserve::new(512 * PAGE_SIZE as u64, arena(), &[1, 1]);
        reserve.refill();
        while reserve.pop_committed(1, true).is_some() {}
        while reserve.pop_committed(0, true).is_some() {}
        assert!(reserve.take_ready(2).is_none());
        assert_ne!(reserve.wanted.load(Ordering::Relaxed) & (1 << 1), 0);
        reserve.refill();
        assert!(!reserve.pools[1].lock().ready.is_empty());
        assert_eq!(reserve.wanted.load(Ordering::Relaxed), 0, "still waited on");
        assert!(
            !reserve.pools[0].lock().ready.is_empty(),
            "the other size was left empty"
        );
    }

    /// Background work cuts no chunk from a pool down to its kept quarter, nor joins one from
    /// it: the quarter is for writes that waited.
    #[test]
    fn background_work_cuts_and_joins_nothing_from_a_kept_quarter() {
        let reserve = ChunkReserve::new(64 * PAGE_SIZE as u64, arena(), &[1, 2]);
        reserve.refill();
        reserve.keep_last_quarter(true);
        // Each size down to its quarter.
        for k in 0..2 {
            while reserve.pop_committed(k, false).is_some() {}
            assert!(reserve.pools[k].lock().last_resort > 0, "size {}", k + 1);
        }
        let held = reserve.held_bytes();
        assert!(reserve.split_larger(0, false).is_none());
        assert!(reserve.join_smaller(1, false).is_none());
        assert_eq!(reserve.held_bytes(), held);
        // A taker that waited long enough may.
        assert!(reserve.split_larger(0, true).is_some());
    }

    #[test]
    fn a_pools_last_quarter_is_kept_for_takers_that_waited() {
        let reserve = ChunkReserve::new(64 * PAGE_SIZE as u64, arena(), &[1]);
        reserve.refill();
        assert!(
            reserve.pop_committed(0, false).is_some(),
            "no quarter kept unless told"
        );
        reserve.keep_last_quarter(true);
        let kept = reserve.pools[0].lock().last_resort;
        assert!(kept > 0);
        while reserve.pop_committed(0, false).is_some() {}
        assert_eq!(reserve.pools[0].lock().ready.len(), kept);
        // A refill thread that commits nothing: the taker gets a kept chunk once it has
        // waited `LAST_RESORT_AFTER`, and not before.
        reserve.pretend_refill_running(true);
        let start = Instant::now();
        reserve.take(1, None).unwrap();
        assert!(start.elapsed() >= LAST_RESORT_AFTER);
        assert_eq!(reserve.pools[0].lock().ready.len(), kept - 1);
        // Then every taker may, for as long again: the next one waits for nothing.
        let start = Instant::now();
        reserve.take(1, None).unwrap();
        assert!(start.elapsed() < LAST_RESORT_AFTER);
        reserve.stop();
    }

    #[test]
    fn a_taker_whose_size_ran_dry_cuts_a_larger_ready_chunk() {
        let reserve = ChunkReserve::new(512 * PAGE_SIZE as u64, arena(), &[1, 1]);
        reserve.refill();
        while reserve.pop_committed(0, true).is_some() {}
        let held = reserve.held_bytes();
        let larger = reserve.pools[1].lock().ready.len();
        // A refill thread that commits nothing (memory is short): the taker is served at once
        // from the two-page pool, and the other page stays ready as a one-page chunk.
        reserve.pretend_refill_running(true);
        let chunk = reserve.take(1, None).unwrap();
        assert_eq!(chunk.len(), PAGE_SIZE);
        assert_eq!(reserve.split_chunks(), 1);
        assert_eq!(reserve.pools[1].lock().ready.len(), larger - 1);
        assert_eq!(reserve.pools[0].lock().ready.len(), 1);
        assert_eq!(reserve.held_bytes(), held - PAGE_SIZE as u64);
        assert_eq!(reserve.take(1, None).unwrap().page(), chunk.page() + 1);
        reserve.stop();
    }

    #[test]
    fn while_a_taker_waits_commits_are_of_one_chunk() {
        let reserve = ChunkReserve::new(512 * PAGE_SIZE as u64, arena(), &[1, 1]);
        assert!(reserve.commit_more(1, usize::MAX));
        assert_eq!(
            reserve.pools[1].lock().ready.len(),
            COMMIT_GROUP_BYTES / (2 * PAGE_SIZE)
        );
        reserve.note_waiting();
        assert!(reserve.commit_more(0, usize::MAX));
        assert_eq!(reserve.pools[0].lock().ready.len(), 1);
        reserve.note_served();
    }

    #[test]
    fn a_refill_commits_each_pool_up_to_its_share_and_no_further() {
        let target = 4 << 20;
        let reserve = ChunkReserve::new(target, arena(), &[3, 1, 1, 1, 1, 1, 1, 1]);
        reserve.refill();
        // Shares of 1.2 MiB and 0.4 MiB: whole commit groups would pass them.
        assert!(reserve.held_bytes() <= target, "{}", reserve.held_bytes());
        assert!(reserve.held_bytes() >= target - 8 * 8 * PAGE_SIZE as u64);
    }

    #[test]
    fn demand_moving_between_sizes_gives_nothing_back_while_the_reserve_is_in_use() {
        let target = 1 << 20;
        let reserve = ChunkReserve::new(target, arena(), &[1, 1]);
        reserve.refill();
        for round in 0..6 {
            // All of the demand on one size, then all of it on the other.
            for _ in 0..64 {
                reserve.take(1 + round % 2, None).unwrap();
            }
            reserve.refill();
            let held = reserve.held_bytes();
            assert!(held <= target + target / TRIM_SLACK_DIVISOR, "{held}");
            for k in 0..2 {
                let ready = reserve.pools[k].lock().ready.len() as u64;
                assert!(ready > 0, "size {} ran dry", k + 1);
            }
        }
        assert_eq!(
            reserve.cold.pages(),
            0,
            "chunks given back and committed again"
        );
    }

    #[test]
    fn with_memory_short_chunks_freed_during_a_pass_are_settled_before_the_next_commit() {
        let reserve = ChunkReserve::new(64 * PAGE_SIZE as u64, arena(), &[1, 1]);
        let freed: Vec<ArenaChunk> = (0..64).map(|_| reserve.take(2, None).unwrap()).collect();
        reserve.refill();
        while reserve.pop_committed(0, true).is_some() {}
        reserve.pretend_refill_running(true);
        reserve.set_memory_short(true);
        // One chunk per commit (a taker waits): the pass commits for one-page chunks many times.
        reserve.note_waiting();
        let freed = Mutex::new(freed);
        let commits = AtomicUsize::new(0);
        let surplus_seen = Mutex::new(Vec::new());
        reserve.refill_and(&|| {
            if commits.fetch_add(1, Ordering::Relaxed) == 0 {
                // A program's pages freed while the pass commits: beyond the target, surplus.
                for chunk in freed.lock().drain(..) {
                    reserve.give_back(chunk);
                }
                assert!(!reserve.pools[1].lock().surplus.is_empty());
            } else {
                surplus_seen
                    .lock()
                    .push(reserve.pools[1].lock().surplus.len());
            }
            // So that the next commit runs this again (`ALSO_INTERVAL`).
            std::thread::sleep(ALSO_INTERVAL);
        });
        reserve.note_served();
        let surplus_seen = surplus_seen.into_inner();
        assert!(surplus_seen.len() > 1, "{surplus_seen:?}");
        assert!(surplus_seen.iter().all(|&n| n == 0), "{surplus_seen:?}");
        assert!(reserve.cold.pages() > 0, "pages given back");
    }

    #[test]
    fn a_quiet_reserve_keeps_a_quarter_of_its_target_at_most_512_kib_until_a_chunk_is_taken() {
        for target in [1 << 20, 4 << 20, 16 << 20] {
            let reserve = ChunkReserve::new(target, arena(), &[1; 8]);
            reserve.refill();
            let full = reserve.held_bytes();
            assert!(full > target / 2, "{full}");
            let quiet = || {
                *reserve.last_busy.lock() = Instant::now()
                    .checked_sub(QUIET_AFTER + Duration::from_secs(1))
                    .unwrap();
            };
            // Short of memory, the whole target stays however quiet the reserve is.
            reserve.set_memory_short(true);
            quiet();
            reserve.refill();
            assert_eq!(reserve.held_bytes(), full);
            reserve.set_memory_short(false);
            quiet();
            reserve.refill();
            let quiet_target = (target / QUIET_TARGET_DIVISOR).min(QUIET_TARGET_MAX_BYTES);
            let held = reserve.held_bytes();
            assert!(held <= quiet_target, "{held} of a {target}-byte target");
            assert!(held >= quiet_target / 2, "{held} of a {target}-byte target");
            // A chunk taken brings the whole target back at the next pass.
            reserve.take(1, None).unwrap();
            reserve.refill();
            let held = reserve.held_bytes();
            assert!(held > target / 2, "{held} of a {target}-byte target");
        }
    }

    #[test]
    fn a_chunk_split_from_a_ready_larger_one_is_no_miss() {
        // A refill pass keeps chunks ready (and gives the pools' lists room: a split puts
        // the rest back); then none of one page is left.
        let reserve = ChunkReserve::new(64 * PAGE_SIZE as u64, arena(), &[1; 8]);
        reserve.take(8, None).unwrap();
        reserve.refill();
        let one_page: Vec<ArenaChunk> = reserve.pools[0].lock().ready.drain(..).collect();
        assert!((1..8).any(|k| !reserve.pools[k].lock().ready.is_empty()));
        reserve.pretend_refill_running(true);
        assert_eq!(reserve.take(1, None).unwrap().len(), PAGE_SIZE);
        assert_eq!(reserve.misses(), 0, "served at once, by a split");
        assert!(!reserve.starving());
        reserve.pretend_refill_running(false);
        drop(one_page);
    }

    #[test]
    fn demand_steers_the_refill() {
        let reserve = ChunkReserve::new(512 * PAGE_SIZE as u64, arena(), &[1, 1]);
        for _ in 0..200 {
            reserve.take(2, None).unwrap();
        }
        reserve.refill();
        let two_page = reserve.pools[1].lock().ready.len() * 2;
        let one_page = reserve.pools[0].lock().ready.len();
        assert!(two_page > 4 * one_page, "{two_page} vs {one_page} pages");
    }

    #[test]
    fn without_a_target_chunks_still_come_and_go_back_to_the_system() {
        let reserve = ChunkReserve::new(0, arena(), &[1; 8]);
        let chunk = reserve.take(3, None).unwrap();
        assert_eq!(chunk.len(), 3 * PAGE_SIZE);
        assert_eq!(reserve.misses(), 0);
        reserve.give_back(chunk);
        assert_eq!(reserve.cold.pages(), 3);
        let again = reserve.take(3, None).unwrap();
        assert!(again.iter().all(|&b| b == 0));
    }

    #[test]
    fn a_run_of_frees_counts_a_hole_punch_per_run_of_adjacent_chunks_given_back() {
        // No target: every chunk freed goes back to the system.
        let reserve = ChunkReserve::new(0, arena(), &[1; 8]);
        let mut chunks: Vec<ArenaChunk> = (0..10).map(|_| reserve.take(1, None).unwrap()).collect();
        chunks.sort_unstable_by_key(ArenaChunk::page);
        // One stays taken: the others are freed in an order of their own.
        let kept = chunks.remove(5);
        let mut pages: Vec<usize> = chunks.iter().map(ArenaChunk::page).collect();
        pages.sort_unstable();
        let runs = 1 + pages.windows(2).filter(|w| w[1] != w[0] + 1).count();
        let mut freed = reserve.freed_together();
        for chunk in chunks.into_iter().rev() {
            freed.push(chunk);
        }
        let punches = freed.finish();
        assert_eq!(punches.calls, runs);
        assert_eq!(punches.pages, 9);
        assert_eq!(reserve.cold.pages(), 9);
        // Nothing held: a run with no frees punches nothing.
        assert_eq!(reserve.freed_together().finish(), Punches::default());
        drop(kept);
    }

    #[test]
    fn pages_given_back_as_small_chunks_come_back_as_large_ones_whole_and_zeroed() {
        let reserve = ChunkReserve::new(0, arena(), &[1; 8]);
        let chunks: Vec<ArenaChunk> = (0..12_000)
            .map(|_| reserve.take(1, None).unwrap())
            .collect();
        for chunk in chunks {
            reserve.give_back(chunk);
        }
        assert_eq!(reserve.cold.pages(), 12_000);
        let carved = reserve.arena.carved();
        // A bit a page, not a list entry.
        assert!(reserve.cold.bytes() < 4 << 10, "{}", reserve.cold.bytes());
        // Eight-page chunks from the one-page chunks' pages: nothing carved anew.
        let large: Vec<ArenaChunk> = (0..1_000).map(|_| reserve.take(8, None).unwrap()).collect();
        assert_eq!(reserve.arena.carved(), carved);
        assert!(large.iter().all(|chunk| chunk.len() == 8 * PAGE_SIZE));
        assert!(large.iter().all(|chunk| chunk.iter().all(|&b| b == 0)));
        let mut pages: Vec<usize> = large
            .iter()
            .flat_map(|chunk| chunk.page()..chunk.page() + 8)
            .collect();
        pages.sort_unstable();
        pages.dedup();
        assert_eq!(pages.len(), 8_000, "no page in two chunks");
        assert!(reserve.cold.pages() <= 4_000);
    }

    #[test]
    fn given_back_chunks_are_kept_up_to_the_target() {
        let reserve = ChunkReserve::new(4 * PAGE_SIZE as u64, arena(), &[1]);
        let chunks: Vec<ArenaChunk> = (0..10).map(|_| reserve.take(1, None).unwrap()).collect();
        let held_before = reserve.held_bytes();
        for chunk in chunks {
            reserve.give_back(chunk);
        }
        assert!(reserve.held_bytes() <= (4 * PAGE_SIZE) as u64 + held_before);
        assert!(reserve.cold.pages() > 0);
    }

    #[test]
    fn freed_chunks_are_given_back_past_a_refill_thread_stuck_in_a_commit() {
        let target = 4 * PAGE_SIZE as u64;
        let reserve = ChunkReserve::new(target, arena(), &[1]);
        let chunks: Vec<ArenaChunk> = (0..40).map(|_| reserve.take(1, None).unwrap()).collect();
        // A refill thread runs, and is in a commit: chunks beyond the target wait for it.
        ChunkReserve::provision(&reserve.pools[0]);
        reserve.pretend_refill_running(true);
        reserve.refill_state.set(RefillActivity::Committing);
        for chunk in chunks {
            reserve.give_back(chunk);
        }
        let surplus = reserve.pools[0].lock().surplus.len();
        assert!(surplus >= 30, "{surplus} surplus chunks");
        // Not stuck yet: they stay for it.
        reserve.give_back_past_refill_stuck_for(Duration::from_secs(60));
        assert_eq!(reserve.pools[0].lock().surplus.len(), surplus);
        assert_eq!(reserve.given_back_past_refill(), 0);
        // Stuck: given back to the system (the reserve holds its target already: the rest of
        // the commit group the takes began).
        let held = reserve.held_bytes();
        assert!(held >= target);
        reserve.give_back_past_refill_stuck_for(Duration::ZERO);
        let pool = reserve.pools[0].lock();
        assert!(pool.surplus.is_empty());
        assert_eq!(reserve.held_bytes(), held);
        assert_eq!(reserve.cold.pages(), surplus);
        assert_eq!(
            reserve.given_back_past_refill(),
            surplus as u64 * PAGE_SIZE as u64
        );
        drop(pool);
        // Given back chunks come back zeroed.
        reserve.pretend_refill_running(false);
        let again: Vec<ArenaChunk> = (0..30).map(|_| reserve.take(1, None).unwrap()).collect();
        assert!(again.iter().all(|chunk| chunk.iter().all(|&b| b == 0)));
    }

    #[test]
    fn chunks_freed_together_are_back_with_the_system_when_the_run_ends() {
        let target = 4 * PAGE_SIZE as u64;
        let reserve = ChunkReserve::new(target, arena(), &[1, 1]);
        // More than the room of one run (the full list is given back in the middle), of two
        // sizes, taken in an order that leaves them in runs of adjacent chunks.
        let count = FREED_TOGETHER + 300;
        let chunks: Vec<ArenaChunk> = (0..count)
            .map(|i| reserve.take(1 + i % 2, None).unwrap())
            .collect();
        let bytes: u64 = chunks.iter().map(|chunk| chunk.len() as u64).sum();
        // A refill thread runs (and would punch the holes of chunks in the surplus lists
        // later), and the lists have room: a run of frees does not leave the chunks to it.
        for pool in reserve.pools.iter() {
            ChunkReserve::provision(pool);
        }
        reserve.pretend_refill_running(true);
        let held_before = reserve.held_bytes();
        let cold_before = reserve.cold.pages();
        let room = reserve.freed_together.lock().capacity();
        {
            let mut freed = reserve.freed_together();
            for chunk in chunks {
                freed.push(chunk);
            }
        }
        assert!(reserve
            .pools
            .iter()
            .all(|pool| pool.lock().surplus.is_empty()));
        assert!(reserve.freed_together.lock().is_empty());
        assert_eq!(
            reserve.freed_together.lock().capacity(),
            room,
            "no list grew"
        );
        let kept = reserve.held_bytes() - held_before;
        assert!(reserve.held_bytes() <= target.max(held_before));
        let given_back = (reserve.cold.pages() - cold_before) as u64 * PAGE_SIZE as u64;
        assert_eq!(kept + given_back, bytes);
        // Given back chunks come back zeroed.
        reserve.pretend_refill_running(false);
        let again: Vec<ArenaChunk> = (0..count).map(|_| reserve.take(1, None).unwrap()).collect();
        assert!(again.iter().all(|chunk| chunk.iter().all(|&b| b == 0)));
    }

    #[test]
    fn a_chunk_given_back_to_a_full_list_is_given_back_to_the_system_and_no_list_grows() {
        let target = 4 * PAGE_SIZE as u64;
        let reserve = ChunkReserve::new(target, arena(), &[1]);
        let chunks: Vec<ArenaChunk> = (0..40).map(|_| reserve.take(1, None).unwrap()).collect();
        // A refill thread runs but has not made room in the lists (it waits in reclaim).
        reserve.pretend_refill_running(true);
        let (ready_room, surplus_room) = {
            let pool = reserve.pools[0].lock();
            (pool.ready.capacity(), pool.surplus.capacity())
        };
        for chunk in chunks {
            reserve.give_back(chunk);
        }
        let pool = reserve.pools[0].lock();
        assert_eq!(pool.ready.capacity(), ready_room);
        assert_eq!(pool.surplus.capacity(), surplus_room);
        // The one commit group the takes began, all accounted for.
        assert_eq!(
            reserve.cold.pages() + pool.surplus.len() + pool.ready.len(),
            GROUP_CHUNKS
        );
        assert!(
            reserve.cold.pages() >= 40 - surplus_room,
            "{} given back",
            reserve.cold.pages()
        );
        assert!(reserve.given_back_past_refill() >= PAGE_SIZE as u64);
    }

    #[test]
    fn the_refill_threads_activity_is_told_with_its_age() {
        let state = RefillState::new();
        assert_eq!(state.get().0, RefillActivity::Waiting);
        state.set(RefillActivity::Committing);
        std::thread::sleep(Duration::from_millis(20));
        // The same activity again keeps its start.
        state.set(RefillActivity::Committing);
        let (activity, committing_for) = state.get();
        assert_eq!(activity, RefillActivity::Committing);
        assert!(
            committing_for >= Duration::from_millis(20),
            "{committing_for:?}"
        );
        state.set(RefillActivity::GivingBack);
        let (activity, age) = state.get();
        assert_eq!(activity, RefillActivity::GivingBack);
        assert!(age < committing_for, "{age:?}");
    }

    #[test]
    fn a_taker_with_patience_gives_up_when_the_refill_thread_commits_nothing() {
        let reserve = ChunkReserve::new(8 * PAGE_SIZE as u64, arena(), &[1]);
        // A refill thread that never commits anything: the system has no memory to give.
        reserve.pretend_refill_running(true);
        let patience = Duration::from_millis(100);
        match reserve.take(1, Some(&|waited| waited >= patience)) {
            Err(Shortage::Starved { waited }) => assert!(waited >= patience),
            other => panic!("{other:?}"),
        }
        assert!(!reserve.starving(), "the taker no longer counts as waiting");
    }

    #[test]
    fn a_stall_counts_from_the_later_of_its_start_and_the_last_commit() {
        let reserve = ChunkReserve::new(8 * PAGE_SIZE as u64, arena(), &[1]);
        let minute = Duration::from_secs(60);
        // A write first deferred a minute ago, no commit since: it has starved that long.
        let long_ago = Instant::now().checked_sub(minute).unwrap();
        assert!(Stall::since(long_ago).waited(&reserve) >= minute);
        // The refill thread commits: the stall starts again from there.
        assert!(reserve.commit_more(0, usize::MAX));
        assert!(Stall::since(long_ago).waited(&reserve) < minute);
        // A wait that starts later counts from its own start.
        let stall = Stall::new();
        assert!(stall.waited(&reserve) < minute);
        // A write deferred a minute ago while nobody waited for the refill thread (the
        // flusher busy with other work) starts starving when the first taker waits.
        let reserve = ChunkReserve::new(8 * PAGE_SIZE as u64, arena(), &[1]);
        assert!(Stall::since(long_ago).waited(&reserve) >= minute);
        reserve.note_waiting();
        assert!(Stall::since(long_ago).waited(&reserve) < minute);
        // A second waiter does not start the clock again.
        std::thread::sleep(Duration::from_millis(20));
        reserve.note_waiting();
        assert!(Stall::since(long_ago).waited(&reserve) >= Duration::from_millis(20));
        reserve.note_served();
        reserve.note_served();
    }

    #[test]
    fn a_target_below_the_pools_floors_is_kept() {
        // A memory limit of 256 KiB makes the target that small; takes of every size, as a
        // store's classes make them, once asked each pool for its floor of a commit group.
        let target = 256 << 10;
        let reserve = ChunkReserve::new(target, Arena::private(256 << 20).unwrap(), &[15; 8]);
        let mut most = 0;
        for _ in 0..20 {
            let taken: Vec<ArenaChunk> = (1..=8).map(|p| reserve.take(p, None).unwrap()).collect();
            for chunk in taken {
                reserve.give_back(chunk);
            }
            reserve.refill();
            most = most.max(reserve.held_bytes());
        }
        assert!(most <= 2 * target, "held {most} for a target of {target}");
    }
}
