//! What a ublk server implements to answer block requests: `BlockHandler`, called from every
//! queue thread (`queue`) and from a thread it lends to large reads (`shared_read`).

#![forbid(unsafe_code)]

use std::time::Instant;

use super::io::Request;

/// What serves the requests: the daemon's store adapter. Called from every queue thread.
pub trait BlockHandler: Send + Sync {
    /// Called once on each queue thread before its first request, its stack already faulted
    /// in: make what `handle` needs on this thread now, while allocating cannot wait on this
    /// device, and fault in the free heap it will allocate from while serving, beside what
    /// the queue's setup and fetch allocate (a few KiB; see `mem::prepare_io_thread`).
    fn prepare_thread(&self);

    /// Whether the queue may watch its ring for the next request after serving some, before
    /// it sleeps in it (hybrid polling, see `Queue::poll_briefly`). A handler says no while
    /// the CPU is better left to others. By default yes.
    fn may_poll(&self) -> bool {
        true
    }

    /// Serve one checked request. For `Read` fill `data`, for `Write` take `data` (both exactly
    /// `request.len` bytes); other ops get an empty slice.
    fn handle(&self, request: &Request, data: &mut [u8]) -> Result<(), Failure>;

    /// As `handle`, but a request that would wait (a write waiting for memory) may be given
    /// back as `Handled::Deferred`: the queue serves its other requests meanwhile and calls
    /// again with the rest of it. `deferred_since`: when it was first deferred (`None` on its
    /// first try). By default nothing is deferred.
    fn try_handle(
        &self,
        request: &Request,
        data: &mut [u8],
        deferred_since: Option<Instant>,
    ) -> Handled {
        let _ = deferred_since;
        Handled::Done(self.handle(request, data))
    }

    /// Run `job` on a thread of the handler's, if it has one to lend: a READ larger than the
    /// user-copy staging buffer is then served in pieces on two threads (see `shared_read`;
    /// `job` calls `handle` there). The job may run late, even once its request is done; it
    /// then finds nothing to do. By default no thread is lent: the job is dropped and the
    /// queue thread serves every piece.
    fn lend_thread(&self, job: Box<dyn FnOnce() + Send>) {
        drop(job);
    }
}

/// A request that failed, and how much of it was served before it did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failure {
    /// A negative errno.
    pub errno: i32,
    /// Its first bytes, served all the same (a READ of several pages whose first were read
    /// before a bad one). The queue commits them as a partial result, which the driver
    /// completes while it sends the rest again as a new request (that one then fails at its
    /// first block): a swap-in merged with its neighbours' fails only from the bad page on.
    pub done_bytes: u64,
}

impl From<i32> for Failure {
    /// Failed whole, with negative errno `errno`.
    fn from(errno: i32) -> Self {
        Self {
            errno,
            done_bytes: 0,
        }
    }
}

/// What became of a request given to `BlockHandler::try_handle`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handled {
    /// Served, or failed.
    Done(Result<(), Failure>),
    /// Its first `done_bytes` are served; the rest would wait: try it again later.
    Deferred { done_bytes: u64 },
}
