//! The daemon's `BlockHandler`: block requests answered from the page store.

#![forbid(unsafe_code)]

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crate::codec::{Algorithm, ThreadCodecs};
use crate::slotfree::SlotFreeProbe;
use crate::store::{BatchedPageStore, WriteOutcome};
use crate::ublk::{BlockHandler, Failure, Handled, Op, Request};

use super::activity::Activity;

/// Bytes of a device page (and a swap slot).
const PAGE_BYTES: u64 = crate::codec::PAGE_SIZE as u64;
/// Frees of reported slots this large (4 MiB of pages) are logged.
const LOGGED_SLOT_FREE_PAGES: u64 = 1024;

/// Serves block requests from the page store. The store comes after the handler: a standby's
/// queue threads are made (and call `prepare_thread`) before the store may be opened, which
/// is only once the daemon it replaces is gone; it is set before the device goes live.
pub(super) struct StoreHandler {
    store: OnceLock<Arc<BatchedPageStore>>,
    /// Freed swap slots, once the probe is attached (after the device is live).
    slot_frees: OnceLock<Arc<SlotFreeProbe>>,
    algorithm: Algorithm,
    /// Failed requests, to log some of.
    errors: crate::os::LogThrottle,
    /// Told of every request, for the main thread's polls.
    activity: Activity,
}

impl StoreHandler {
    pub(super) fn new(algorithm: Algorithm) -> Self {
        Self {
            store: OnceLock::new(),
            slot_frees: OnceLock::new(),
            algorithm,
            errors: crate::os::LogThrottle::default(),
            activity: Activity::new(),
        }
    }

    /// Whether requests came lately (see `super::activity`).
    pub(super) fn activity(&self) -> &Activity {
        &self.activity
    }

    /// The store requests go to; set once, before the device goes live.
    pub(super) fn set_store(&self, store: Arc<BatchedPageStore>) {
        if self.store.set(store).is_err() {
            tracing::error!("the handler's store was set twice; the first one stays");
        }
    }

    /// The probe whose reports of freed slots a write must withdraw for its pages.
    pub(super) fn set_slot_frees(&self, probe: Arc<SlotFreeProbe>) {
        if self.slot_frees.set(probe).is_err() {
            tracing::error!("the handler's slot-free probe was set twice; the first one stays");
        }
    }

    /// Free the pages whose slots the probe reported freed (see `crate::slotfree`). A large
    /// free (a program with many pages out exited or was killed) is logged with how long it
    /// took: near OOM the kernel's next OOM decision races the memory it gives back, and the
    /// log against the kernel's kill lines says who won. With the hole punches that gave the
    /// memory back: under the VM's emulation most of that time, the kernel freeing each page.
    /// How many pages were freed.
    pub(super) fn free_reported_slots(&self) -> u64 {
        if let (Some(probe), Some(store)) = (self.slot_frees.get(), self.store.get()) {
            let started = Instant::now();
            let mut frees = store.swap_slot_frees();
            let pages = probe.free_reported(|page, still_freed| frees.free(page, still_freed));
            // The memory goes back here, before the time is taken.
            let punches = frees.finish();
            if pages >= LOGGED_SLOT_FREE_PAGES {
                tracing::info!(
                    pages,
                    took_ms = started.elapsed().as_millis(),
                    punches = punches.calls,
                    punched_pages = punches.pages,
                    punch_ms = punches.time.as_millis(),
                    memory_short = store.memory_short(),
                    "freed the pages of slots swap freed"
                );
            }
            pages
        } else {
            0
        }
    }
}

impl BlockHandler for StoreHandler {
    fn prepare_thread(&self) {
        super::harden::prepare_codec_thread(ThreadCodecs::reading(self.algorithm));
    }

    /// Not while the system is short of memory and swapping out frees little (the pages
    /// lately did not compress): there the queue thread's spinning took CPU from what gives
    /// memory back (the OOM victims' exit, the slot-free probe's frees, the refill thread),
    /// and in the VM's near-OOM stage the OOM killer went on to the shell in 2 runs of 7 with
    /// it, against none of 6 without (2026-11-26; incompressible pages). Short of memory with
    /// pages that compress (a swap storm), a program waits on each swap-in in turn, and the
    /// window saves each one the queue thread's wake-up.
    fn may_poll(&self) -> bool {
        self.store
            .get()
            .is_some_and(|store| !store.memory_short() || store.swap_frees_memory())
    }

    /// A thread of the compression pool (rayon's global pool, which the daemon builds with
    /// its threads readied for the I/O path): idle while only reads come, and a job queued
    /// behind compression finds its read done and returns.
    fn lend_thread(&self, job: Box<dyn FnOnce() + Send>) {
        rayon::spawn(job);
    }

    fn handle(&self, request: &Request, data: &mut [u8]) -> Result<(), Failure> {
        match self.serve(request, data, Writes::Wait) {
            Handled::Done(result) => result,
            // Only a write that may be deferred is.
            Handled::Deferred { .. } => Err(Failure::from(-libc::EIO)),
        }
    }

    fn try_handle(
        &self,
        request: &Request,
        data: &mut [u8],
        deferred_since: Option<Instant>,
    ) -> Handled {
        self.serve(request, data, Writes::MayDefer { deferred_since })
    }
}

/// What a write does that would wait for memory.
#[derive(Clone, Copy)]
enum Writes {
    /// Waits (`BatchedPageStore::write`).
    Wait,
    /// Is deferred (`BatchedPageStore::try_write`; `deferred_since`: when it first was).
    MayDefer { deferred_since: Option<Instant> },
}

impl StoreHandler {
    /// Serve `request`; a write that would wait for memory waits or is deferred as `writes`
    /// says.
    fn serve(&self, request: &Request, data: &mut [u8], writes: Writes) -> Handled {
        self.activity.note_request();
        // Set before the device goes live, so never missing here.
        let Some(store) = self.store.get() else {
            return Handled::Done(Err(Failure::from(-libc::EIO)));
        };
        let result = match request.op {
            Op::Read => store.read(request.offset, data),
            Op::Write => {
                // A free the probe reported for these pages is of their old data: withdrawn
                // before the new data is stored (see `crate::slotfree`).
                if let Some(probe) = self.slot_frees.get() {
                    probe.forget(request.offset / PAGE_BYTES, request.len / PAGE_BYTES);
                }
                match writes {
                    Writes::Wait => store.write(request.offset, data),
                    Writes::MayDefer { deferred_since } => {
                        match store.try_write(request.offset, data, deferred_since) {
                            Ok(WriteOutcome::Done) => Ok(()),
                            Ok(WriteOutcome::Deferred { done_bytes }) => {
                                return Handled::Deferred { done_bytes }
                            }
                            Err(error) => Err(error),
                        }
                    }
                }
            }
            // Pages are in daemon memory as soon as a write is acknowledged: nothing to flush.
            Op::Flush => Ok(()),
            Op::Discard | Op::WriteZeroes => store.discard(request.offset, request.len),
        };
        Handled::Done(result.map_err(|error| {
            if let Some(errors) = self.errors.note() {
                tracing::warn!(?request, %error, errors, "request failed");
            }
            // A read that failed at a bad page has read the pages before it.
            let done_pages = match request.op {
                Op::Read => error
                    .bad_page()
                    .and_then(|page| page.checked_sub(request.offset / PAGE_BYTES)),
                _ => None,
            };
            Failure {
                errno: error.errno(),
                done_bytes: done_pages.map_or(0, |pages| pages * PAGE_BYTES),
            }
        }))
    }
}
