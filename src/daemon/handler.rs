//! The daemon's `BlockHandler`: block requests answered from the page store.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::codec::Algorithm;
use crate::store::BatchedPageStore;
use crate::ublk::{BlockHandler, Op, Request};

/// Serves block requests from the page store.
pub(super) struct StoreHandler {
    store: Arc<BatchedPageStore>,
    algorithm: Algorithm,
    errors: AtomicU64,
}

impl StoreHandler {
    pub(super) fn new(store: Arc<BatchedPageStore>, algorithm: Algorithm) -> Self {
        Self {
            store,
            algorithm,
            errors: AtomicU64::new(0),
        }
    }
}

impl BlockHandler for StoreHandler {
    fn prepare_thread(&self) {
        crate::codec::prepare_thread(self.algorithm);
    }

    fn handle(&self, request: &Request, data: &mut [u8]) -> Result<(), i32> {
        let result = match request.op {
            Op::Read => self.store.read(request.offset, data),
            Op::Write => self.store.write(request.offset, data),
            // Pages are in daemon memory as soon as a write is acknowledged: nothing to flush.
            Op::Flush => Ok(()),
            Op::Discard | Op::WriteZeroes => self.store.discard(request.offset, request.len),
            Op::Unsupported(_) => return Err(-libc::EOPNOTSUPP),
        };
        result.map_err(|error| {
            // Log the first errors and then every 1024th, so a full device cannot flood the log.
            let count = self.errors.fetch_add(1, Ordering::Relaxed);
            if count < 16 || count % 1024 == 0 {
                tracing::warn!(?request, %error, errors = count + 1, "request failed");
            }
            error.errno()
        })
    }
}
