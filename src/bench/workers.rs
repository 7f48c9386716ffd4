//! Writer and reader threads over the store, as the daemon's queue threads use it, and the
//! check of what comes back.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use parking_lot::Mutex;
use rayon::prelude::*;

use super::progress::Progress;
use super::{BenchError, REQUESTS_PER_GRAB};
use crate::codec::PAGE_SIZE;
use crate::store::{BatchedPageStore, StoreError};

/// Check every page of `got` against `expected(page index)`.
pub fn verify<'a>(
    phase: &'static str,
    got: &[u8],
    expected: impl Fn(usize) -> &'a [u8] + Sync,
) -> Result<(), BenchError> {
    let bad: Vec<usize> = got
        .par_chunks(PAGE_SIZE)
        .enumerate()
        .filter(|(index, page)| *page != expected(*index))
        .map(|(index, _)| index)
        .collect();
    match bad.first() {
        None => Ok(()),
        Some(&first_page) => Err(BenchError::Mismatch {
            phase,
            first_page,
            pages: bad.len(),
        }),
    }
}

/// The first error of several worker threads; once there is one, the others stop.
#[derive(Default)]
struct FirstError {
    stop: AtomicBool,
    error: Mutex<Option<StoreError>>,
}

impl FirstError {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    fn set(&self, error: StoreError) {
        self.error.lock().get_or_insert(error);
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Run `work` on `threads` threads until each returns; the first store error fails `phase`.
fn on_threads(
    threads: usize,
    phase: &'static str,
    work: impl Fn(&FirstError) + Sync,
) -> Result<(), BenchError> {
    let errors = FirstError::default();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| work(&errors));
        }
    });
    match errors.error.into_inner() {
        Some(source) => Err(BenchError::Store { phase, source }),
        None => Ok(()),
    }
}

/// Run `count` write requests on `threads` threads; request `i` is `request(i)`, an
/// `(offset, data)` pair. Stops at the first error.
pub(super) fn write_requests<'a>(
    store: &BatchedPageStore,
    threads: usize,
    count: usize,
    progress: &Progress,
    phase: &'static str,
    request: impl Fn(usize) -> (u64, &'a [u8]) + Sync,
) -> Result<(), BenchError> {
    let next = AtomicUsize::new(0);
    on_threads(threads, phase, |errors| {
        while !errors.stopped() {
            let first = next.fetch_add(REQUESTS_PER_GRAB, Ordering::Relaxed);
            if first >= count {
                break;
            }
            let mut bytes = 0;
            for index in first..(first + REQUESTS_PER_GRAB).min(count) {
                let (offset, data) = request(index);
                if let Err(error) = store.write(offset, data) {
                    errors.set(error);
                    return;
                }
                bytes += data.len();
            }
            progress.advance(bytes as u64);
        }
    })
}

/// Read the whole device into `out` with `threads` threads in requests of `request_bytes`.
pub(super) fn read_all(
    store: &BatchedPageStore,
    threads: usize,
    request_bytes: usize,
    out: &mut [u8],
    progress: &Progress,
    phase: &'static str,
) -> Result<(), BenchError> {
    let grab_bytes = request_bytes * REQUESTS_PER_GRAB;
    let work = Mutex::new(out.chunks_mut(grab_bytes).enumerate());
    on_threads(threads, phase, |errors| {
        while !errors.stopped() {
            let Some((grab, chunk)) = work.lock().next() else {
                break;
            };
            let base = (grab * grab_bytes) as u64;
            for (index, request) in chunk.chunks_mut(request_bytes).enumerate() {
                let offset = base + (index * request_bytes) as u64;
                if let Err(error) = store.read(offset, request) {
                    errors.set(error);
                    return;
                }
            }
            progress.advance(chunk.len() as u64);
        }
    })
}

pub(super) fn flush(store: &BatchedPageStore, phase: &'static str) -> Result<(), BenchError> {
    store
        .flush_pending()
        .map_err(|source| BenchError::Store { phase, source })
}
