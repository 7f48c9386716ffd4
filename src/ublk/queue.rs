//! One queue: its own thread, its own io_uring (no SQPOLL), the mmapped descriptor array,
//! a locked staging buffer that request data is copied through (user copy, the default) or
//! one locked buffer per tag, FETCH_REQ for every tag, then the COMMIT_AND_FETCH_REQ loop.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use io_uring::{opcode, types, IoUring};

use super::ctrl::opcode_for;
use super::handler::{BlockHandler, Handled};
use super::io::{failure_result, Op, Request};
use super::mmap::{DescArray, IoBuffers};
use super::params::BLOCK_SIZE;
use super::poll::PollWindow;
use super::shared_read::{self, LentBuffer, SharedRead};
use super::sys::{self, IoCmd};
use super::timing::IoTiming;
use super::UblkError;

/// The tag a completion's `user_data` names: we put the tag there when submitting. Anything
/// wider than a tag becomes one past every depth, which the loop retires as invalid.
fn tag_of(user_data: u64) -> u16 {
    u16::try_from(user_data).unwrap_or(u16::MAX)
}

/// A request the queue holds from its arrival until it is served: its tag stays with the
/// queue, uncommitted, for as long as the handler defers it.
#[derive(Clone, Copy, Debug)]
struct HeldRequest {
    tag: u16,
    /// The part still to serve.
    rest: Request,
    /// Where `rest` starts in the tag's buffer.
    buffer_offset: usize,
    /// When it was first deferred (`None` before that).
    deferred_since: Option<Instant>,
    /// When its completion arrived, for `IoTiming`.
    arrived: Instant,
    /// What it commits once served: the bytes of data of the whole request.
    served: i32,
}

/// Where a try of a request left it.
enum Progress {
    /// Done: commit with this (bytes done or a negative errno).
    Served(i32),
    /// Deferred again, with what is left.
    Deferred(HeldRequest),
}

/// How a piece of a request ended (see `Queue::serve_piece`).
enum Piece {
    /// Served whole.
    Whole,
    /// The handler deferred the rest of it.
    Deferred,
}

/// Where a queue is and what it may receive.
#[derive(Clone, Copy, Debug)]
pub struct QueueSetup {
    pub q_id: u16,
    pub depth: u16,
    pub max_io_bytes: u32,
    pub dev_bytes: u64,
    pub ioctl_encode: bool,
    /// The device moves data by pread/pwrite on the char device (`UBLK_F_USER_COPY`).
    pub user_copy: bool,
}

/// Where a request's data is while its queue thread serves it.
enum DataPath {
    /// A buffer per tag, which the kernel fills with a WRITE's data before the tag's command
    /// completes and copies a READ's data from when the tag is committed.
    TagBuffers(IoBuffers),
    /// `UBLK_F_USER_COPY`: one staging buffer, since the thread serves one request at a time
    /// (a larger one a piece at a time). The thread reads a WRITE's data from the request
    /// (pread on the char device) and writes a READ's into it (pwrite) before committing the
    /// tag: a system call more per piece, and `depth` times less locked memory. `lent`: the
    /// buffer of the thread the handler lends for a READ larger than `staging` (see
    /// `shared_read`); none where no request can be that large.
    UserCopy {
        staging: IoBuffers,
        lent: Option<LentBuffer>,
    },
}

/// Bytes of the user-copy staging buffer: larger requests go through it a piece at a time
/// (a pread or pwrite each, far less than a request's round trip through the ring). A
/// shared read's piece (see `shared_read`): the staging buffer and the lent thread's
/// together are the 64 KiB the one staging buffer was until 2026-12-01, since near OOM every
/// locked KiB counts.
const USER_COPY_STAGING_BYTES: usize = shared_read::PIECE_BYTES;

impl DataPath {
    fn new(setup: &QueueSetup) -> std::io::Result<Self> {
        let max_io = setup.max_io_bytes as usize;
        // A user-copy position has 25 bits for the offset in a request: a larger request (a
        // device another program made, resumed) would read and write another tag's data.
        if setup.user_copy && max_io > 1 << sys::UBLK_IO_BUF_BITS {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "the device takes requests of up to {max_io} bytes, more than user copy \
                     addresses ({} bytes): it was not made by trueno-ublk",
                    1u32 << sys::UBLK_IO_BUF_BITS
                ),
            ));
        }
        Ok(if setup.user_copy {
            let staging = max_io.min(USER_COPY_STAGING_BYTES);
            Self::UserCopy {
                staging: IoBuffers::new(1, staging)?,
                lent: (max_io > staging)
                    .then(shared_read::lent_buffer)
                    .transpose()?,
            }
        } else {
            Self::TagBuffers(IoBuffers::new(setup.depth, max_io)?)
        })
    }

    /// The buffer address a tag's command names: none with user copy (the driver refuses one).
    fn command_addr(&self, tag: u16) -> u64 {
        match self {
            Self::TagBuffers(buffers) => buffers.addr(tag),
            Self::UserCopy { .. } => 0,
        }
    }
}

/// How long the loop sleeps in the kernel before it looks at the stop flag: only the fallback,
/// since a stop wakes it at once through the wake-up socket; long, so that an idle device's
/// thread stays asleep (a laptop's `powertop` counts wake-ups).
const STOP_POLL: types::Timespec = types::Timespec::new().sec(10);
/// How long the loop sleeps at most while requests are deferred, before it tries them again
/// (only while a write waits for memory: an idle device never polls).
const DEFERRED_POLL: types::Timespec = types::Timespec::new().nsec(2_000_000);
/// How long the queue pauses before it submits again when the kernel had no memory for it.
const SUBMIT_RETRY: std::time::Duration = std::time::Duration::from_millis(1);
/// How long `Queue::submit_all` waits out a kernel with no memory for the commands it
/// submits (a queue's fetches when it is set up, its last commits when it stops) before it
/// fails, and `map_descriptors` for the mapping of the descriptors.
const SUBMIT_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// Whether a system call's `error` may pass if tried again: the kernel had no memory for it
/// (EAGAIN, ENOMEM) or a signal came (EINTR).
fn worth_retrying(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EAGAIN | libc::ENOMEM | libc::EINTR)
    )
}

/// Map queue `q_id`'s descriptor array, waiting out a kernel with no memory for it (EAGAIN,
/// ENOMEM) for up to `SUBMIT_PATIENCE`, as the fetches that follow do. Why: after
/// START_USER_RECOVERY a queue that gives up leaves a device the 6.12 driver may never let
/// anyone resume (see `device::Standby`), and a takeover happens with RAM at the watermark.
fn map_descriptors(char_dev: &File, q_id: u16, depth: u16) -> std::io::Result<DescArray> {
    let started = Instant::now();
    loop {
        match DescArray::map(char_dev, q_id, depth) {
            Err(error) if worth_retrying(&error) && started.elapsed() < SUBMIT_PATIENCE => {
                std::thread::sleep(SUBMIT_RETRY);
            }
            mapped => return mapped,
        }
    }
}
/// `user_data` of the wake-up poll: above every tag, so never mistaken for one.
const WAKE: u64 = 1 << 32;
/// `user_data` of the NOPs that warm the ring's request cache (`QueueParts::prepare`).
const WARM_UP: u64 = WAKE + 1;

/// What a queue thread makes before it may touch the device: its ring and its tags' buffers.
/// Made ahead so that a recovery, which must fetch every tag soon after START_USER_RECOVERY,
/// only maps the descriptors and submits.
pub struct QueueParts {
    setup: QueueSetup,
    ring: IoUring,
    data: DataPath,
}

impl QueueParts {
    pub fn prepare(setup: QueueSetup) -> Result<Self, UblkError> {
        if let Err(error) = crate::os::set_io_flusher() {
            tracing::warn!(q = setup.q_id, %error, "PR_SET_IO_FLUSHER failed: swap I/O may deadlock under memory pressure");
        }
        if let Err(error) = crate::os::raise_thread_priority() {
            tracing::warn!(q = setup.q_id, %error, "could not raise the queue thread's priority");
        }
        let io = |what| move |source| UblkError::Io { what, source };
        let data = DataPath::new(&setup).map_err(io("allocating I/O buffers"))?;
        // Room for a command per tag and the wake-up poll. Cooperative task running: the
        // driver's completion of a command (a new request) wakes this thread when it sleeps
        // in the ring, but does not interrupt it with an IPI while it serves other requests;
        // it picks the completions up at its next wait, all at once. Safe because the thread
        // that waits on the ring is the one that submitted its commands (Linux 5.19, older
        // than every ublk driver).
        let new_ring = || {
            IoUring::builder()
                .setup_coop_taskrun()
                .setup_taskrun_flag()
                .build((u32::from(setup.depth) + 1).next_power_of_two())
                .map_err(io("creating a queue io_uring"))
        };
        let mut parts = Self {
            setup,
            ring: new_ring()?,
            data,
        };
        if let Err(error) = parts.warm_request_cache() {
            tracing::warn!(q = setup.q_id, %error, "could not warm the queue ring's request cache: a resume under memory pressure may wait in reclaim");
            // NOPs the failed warm-up left queued would take the slots of the fetches.
            parts.ring = new_ring()?;
        }
        Ok(parts)
    }

    /// Have the kernel allocate the ring's requests now: a NOP in every submission slot,
    /// submitted and reaped. The ring keeps finished requests for reuse, so the fetch of
    /// every tag at a resume (and every command after it) takes no new memory. Why: without
    /// it that fetch allocated its requests from the slab at the takeover, with RAM at the
    /// watermark and the device quiesced until the fetch is done; the queue thread then spun
    /// in reclaim that could free nothing (seen in the VM: `__io_alloc_req_refill` →
    /// `try_to_free_pages`, swap stalled for 28 s once and for good in CI on 2026-11-26).
    fn warm_request_cache(&mut self) -> std::io::Result<()> {
        let slots = self.ring.params().sq_entries();
        let nop = opcode::Nop::new().build().user_data(WARM_UP);
        for _ in 0..slots {
            // SAFETY: a NOP names no memory.
            unsafe { self.ring.submission().push(&nop) }
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
        }
        let want = usize::try_from(slots).unwrap_or(usize::MAX);
        self.ring.submit_and_wait(want)?;
        // Every completion reaped, failed or not (the serving loop takes only tags).
        let (mut completed, mut failed) = (0usize, None);
        for entry in self.ring.completion() {
            completed += 1;
            if entry.result() < 0 {
                failed = failed.or(Some(-entry.result()));
            }
        }
        if let Some(errno) = failed {
            return Err(std::io::Error::from_raw_os_error(errno));
        }
        if completed < want {
            return Err(std::io::Error::other(format!(
                "{completed} of {want} NOPs completed"
            )));
        }
        Ok(())
    }
}

/// A queue with every tag fetched, ready for START_DEV (or END_USER_RECOVERY).
pub struct Queue {
    setup: QueueSetup,
    ring: IoUring,
    descs: DescArray,
    data: DataPath,
    /// Declared after the ring, so dropped after it: the ring's commands name this file.
    char_dev: Arc<File>,
    /// The read end of the device's wake-up socket, polled by the ring (see `Device`).
    wake: Arc<UnixStream>,
    /// Tags whose command is with the kernel.
    in_flight: usize,
    /// Requests refused or failed in copying their data, to log some of (a stopping device
    /// aborts every request in flight).
    failures: Arc<crate::os::LogThrottle>,
}

impl Queue {
    /// Set the queue up on the calling thread (the driver binds a queue to the thread that
    /// fetched its tags) and submit FETCH_REQ for every tag. When this returns Ok, every
    /// fetch has entered the kernel, so START_DEV can complete.
    pub fn fetch_all(
        parts: QueueParts,
        char_dev: Arc<File>,
        wake: Arc<UnixStream>,
    ) -> Result<Self, UblkError> {
        let QueueParts { setup, ring, data } = parts;
        let io = |what| move |source| UblkError::Io { what, source };
        let descs = map_descriptors(&char_dev, setup.q_id, setup.depth)
            .map_err(io("mapping the descriptor array"))?;
        let mut queue = Self {
            setup,
            ring,
            descs,
            data,
            char_dev,
            wake,
            in_flight: 0,
            failures: Arc::default(),
        };
        for tag in 0..setup.depth {
            queue.push_command(sys::UBLK_U_IO_FETCH_REQ, tag, 0)?;
        }
        let poll = opcode::PollAdd::new(
            types::Fd(queue.wake.as_raw_fd()),
            u32::try_from(libc::POLLIN).unwrap_or(1),
        )
        .build()
        .user_data(WAKE);
        // SAFETY: a poll names no memory of ours, only the socket, which the queue holds.
        unsafe { queue.ring.submission().push(&poll) }.map_err(|_| UblkError::Io {
            what: "queueing the wake-up poll",
            source: std::io::ErrorKind::OutOfMemory.into(),
        })?;
        // Every fetch must enter the kernel. No memory for its request structures now is
        // waited out, as `serve` does: at a takeover (after START_USER_RECOVERY) memory is
        // at its scarcest, and a queue that gave up there would leave the device with no
        // daemon that can ever take it over (6.12 refuses the next recovery).
        queue.submit_all("submitting FETCH_REQ")?;
        Ok(queue)
    }

    /// Submit every queued entry, waiting out a kernel with no memory for their requests
    /// (EAGAIN/ENOMEM, or only some taken) for up to `SUBMIT_PATIENCE`.
    fn submit_all(&mut self, what: &'static str) -> Result<(), UblkError> {
        let started = Instant::now();
        while !self.ring.submission().is_empty() {
            match self.ring.submit() {
                // All of them, or some, taken: the rest (if any) go with the next try.
                Ok(_) if started.elapsed() < SUBMIT_PATIENCE => {}
                Ok(_) => {
                    return Err(UblkError::Io {
                        what,
                        source: std::io::ErrorKind::TimedOut.into(),
                    })
                }
                Err(error) if worth_retrying(&error) && started.elapsed() < SUBMIT_PATIENCE => {
                    std::thread::sleep(SUBMIT_RETRY);
                }
                Err(source) => return Err(UblkError::Io { what, source }),
            }
        }
        Ok(())
    }

    fn push_command(&mut self, encoded_op: u32, tag: u16, result: i32) -> Result<(), UblkError> {
        let cmd = IoCmd {
            q_id: self.setup.q_id,
            tag,
            result,
            addr: self.data.command_addr(tag),
        };
        let entry = opcode::UringCmd16::new(
            types::Fd(self.char_dev.as_raw_fd()),
            opcode_for(encoded_op, self.setup.ioctl_encode),
        )
        .cmd(sys::command_bytes(&cmd))
        .build()
        .user_data(u64::from(tag));
        // SAFETY: the command names tag `tag`'s buffer (or none, with user copy), which lives in
        // `self.data` for as long as the queue (and so the ring, declared before it and
        // dropped first) exists.
        unsafe { self.ring.submission().push(&entry) }.map_err(|_| UblkError::Io {
            what: "queueing an I/O command",
            source: std::io::ErrorKind::OutOfMemory.into(),
        })?;
        self.in_flight += 1;
        Ok(())
    }

    /// Serve requests until every tag has been aborted (the device was stopped) or `stop` is
    /// set (what had arrived by then is served and committed first). The queue (ring, mappings, commands still with
    /// the kernel) stays as it is: its owner drops it, or keeps it open past the thread's end
    /// for a hand-over (see `Device::hand_over`).
    /// Each request's time from its completion's arrival to its commit being queued, and each
    /// wait's number of completions, go to `timing`.
    pub fn serve(
        &mut self,
        handler: &Arc<dyn BlockHandler>,
        stop: &AtomicBool,
        timing: &IoTiming,
    ) -> Result<(), UblkError> {
        let depth = usize::from(self.setup.depth);
        let mut ready: Vec<(u16, i32)> = Vec::with_capacity(depth);
        let mut deferred: Vec<HeldRequest> = Vec::with_capacity(depth);
        let mut still_deferred: Vec<HeldRequest> = Vec::with_capacity(depth);
        let idle_wait = types::SubmitArgs::new().timespec(&STOP_POLL);
        let deferred_wait = types::SubmitArgs::new().timespec(&DEFERRED_POLL);
        let mut busy = false;
        let mut poll = PollWindow::new();
        while self.in_flight > 0 || !deferred.is_empty() {
            // When the requests served last were done: the gap to the next one's arrival
            // sizes the window (see `poll`).
            let mut served_at = None;
            if busy && deferred.is_empty() && handler.may_poll() {
                served_at = Some(Instant::now());
                self.poll_briefly(poll.window());
            }
            let args = if deferred.is_empty() {
                &idle_wait
            } else {
                &deferred_wait
            };
            match self.ring.submitter().submit_with_args(1, args) {
                Ok(_) => {}
                // EBUSY: completions wait to be reaped first, which the loop does below.
                Err(error)
                    if matches!(
                        error.raw_os_error(),
                        Some(libc::ETIME | libc::EINTR | libc::EBUSY)
                    ) => {}
                // No memory for the kernel's request structures now (memory short): the
                // commands stay queued and go out with the next try. Ending the queue here
                // would abort every request it holds.
                Err(error) if matches!(error.raw_os_error(), Some(libc::EAGAIN | libc::ENOMEM)) => {
                    std::thread::sleep(SUBMIT_RETRY);
                }
                Err(source) => {
                    return Err(UblkError::Io {
                        what: "waiting for I/O",
                        source,
                    })
                }
            }
            // Only commands name tags: the wake-up poll (which completes once, when a stop is
            // asked for) and a warm-up NOP that completed late are no tag.
            ready.extend(
                self.ring
                    .completion()
                    .filter(|cqe| cqe.user_data() < WAKE)
                    .map(|cqe| (tag_of(cqe.user_data()), cqe.result())),
            );
            let arrived = Instant::now();
            busy = !ready.is_empty();
            if let (true, Some(served_at)) = (busy, served_at) {
                poll.note_gap(arrived.saturating_duration_since(served_at));
            }
            if busy {
                timing.record_wait(ready.len());
            }
            let stopping = stop.load(Ordering::Acquire);
            // Deferred requests first, oldest first; at a stop they may wait no longer.
            for waiting in deferred.drain(..) {
                let (tag, op, arrived) = (waiting.tag, waiting.rest.op, waiting.arrived);
                match self.serve_part(waiting, handler, !stopping) {
                    Progress::Deferred(waiting) => still_deferred.push(waiting),
                    Progress::Served(result) => self.commit(tag, op, result, arrived, timing)?,
                }
            }
            std::mem::swap(&mut deferred, &mut still_deferred);
            for (tag, res) in ready.drain(..) {
                self.in_flight -= 1;
                if res == sys::UBLK_IO_RES_ABORT {
                    continue;
                }
                if res != sys::UBLK_IO_RES_OK || tag >= self.setup.depth {
                    // The driver refused a command of ours: a request it carried the answer
                    // of is still ours, and nothing here would ever answer it again (the
                    // request timeout only restarts its timer while the daemon lives). End
                    // the queue: the kernel then fails what the queue holds, or, with user
                    // recovery, keeps it for the next daemon.
                    tracing::error!(
                        q = self.setup.q_id,
                        tag,
                        res,
                        "I/O command failed; ending the queue"
                    );
                    return Err(UblkError::Io {
                        what: "an I/O command (the driver refused it)",
                        source: std::io::Error::from_raw_os_error(if res < 0 {
                            res.saturating_neg()
                        } else {
                            libc::EIO
                        }),
                    });
                }
                let request = match self.decode(tag) {
                    Ok(request) => request,
                    Err(errno) => {
                        self.push_command(sys::UBLK_U_IO_COMMIT_AND_FETCH_REQ, tag, errno)?;
                        timing.record_request(None, elapsed_ns(arrived));
                        continue;
                    }
                };
                let first = HeldRequest {
                    tag,
                    rest: request,
                    buffer_offset: 0,
                    deferred_since: None,
                    arrived,
                    served: data_len(&request),
                };
                match self.serve_part(first, handler, !stopping) {
                    Progress::Deferred(waiting) => {
                        timing.record_deferred();
                        deferred.push(waiting);
                    }
                    Progress::Served(result) => {
                        self.commit(tag, request.op, result, arrived, timing)?;
                    }
                }
            }
            if stopping {
                // Stop now, even while requests keep coming (waiting for a quiet moment took
                // 14 s under a steady load in the VM): commit what was served, so that every
                // tag is with the kernel again, where a hand-over's end cancels it at once.
                // (A tag left with us would be re-issued to the next daemon, but if every tag
                // were, only a request timeout would quiesce the device.) Deferred requests
                // were served to the end above, waiting as long as the handler's rule lets
                // them.
                self.submit_all("committing the last requests")?;
                break;
            }
        }
        Ok(())
    }

    /// Hybrid polling, after a wait that brought requests: hand the commits to the kernel,
    /// then watch the ring for up to `window` (see `poll`) before sleeping in it, so that the
    /// next request of a busy client (a page fault waiting on a swap-in, say) is picked up
    /// without this thread going to sleep and being woken. The ring flags pending completions
    /// (`taskrun`: the driver's task work waits for this thread to enter the kernel), and the
    /// wait that follows runs them at once. An idle device never polls: the window follows
    /// only a wait that brought requests. A failed submission (EINTR, say) skips the
    /// polling: the wait that follows submits again and reports what is wrong.
    fn poll_briefly(&mut self, window: std::time::Duration) {
        if self.ring.submit().is_err() {
            return;
        }
        let since = Instant::now();
        while !self.ring.submission().taskrun() && self.ring.completion().is_empty() {
            if since.elapsed() >= window {
                break;
            }
            std::hint::spin_loop();
        }
    }

    /// Decode tag `tag`'s descriptor; `Err`: the negative errno to commit it with.
    fn decode(&self, tag: u16) -> Result<Request, i32> {
        let desc = self.descs.get(tag);
        Request::decode(
            &desc,
            self.setup.dev_bytes,
            BLOCK_SIZE,
            u64::from(self.setup.max_io_bytes),
        )
        .map_err(|error| {
            if let Some(failures) = self.failures.note() {
                tracing::warn!(q = self.setup.q_id, tag, ?desc, %error, failures, "request refused");
            }
            error.errno()
        })
    }

    /// Commit tag `tag` (a request of `op`) with `result` (bytes done or a negative errno) and
    /// fetch its next request; its time since `arrived` goes to `timing`.
    fn commit(
        &mut self,
        tag: u16,
        op: Op,
        result: i32,
        arrived: Instant,
        timing: &IoTiming,
    ) -> Result<(), UblkError> {
        self.push_command(sys::UBLK_U_IO_COMMIT_AND_FETCH_REQ, tag, result)?;
        timing.record_request(Some(op), elapsed_ns(arrived));
        Ok(())
    }

    /// Serve what is left of `request`, a piece at a time when its data moves through the
    /// user-copy staging buffer and is larger than it; unless `may_defer`, the handler waits
    /// as long as its rule lets it.
    fn serve_part(
        &mut self,
        mut request: HeldRequest,
        handler: &Arc<dyn BlockHandler>,
        may_defer: bool,
    ) -> Progress {
        if let Some(result) = self.serve_shared_read(&request, handler) {
            return Progress::Served(result);
        }
        loop {
            match self.serve_piece(&mut request, handler, may_defer) {
                Err(result) => return Progress::Served(result),
                Ok(_) if request.rest.len == 0 => return Progress::Served(request.served),
                Ok(Piece::Whole) => {}
                Ok(Piece::Deferred) => {
                    request.deferred_since.get_or_insert_with(Instant::now);
                    return Progress::Deferred(request);
                }
            }
        }
    }

    /// Serve a READ larger than the user-copy staging buffer on two threads (see
    /// `shared_read`): its result, or `None` for any other request.
    fn serve_shared_read(
        &mut self,
        request: &HeldRequest,
        handler: &Arc<dyn BlockHandler>,
    ) -> Option<i32> {
        // Every request passes here: the op first, the cheapest test.
        if request.rest.op != Op::Read || request.buffer_offset != 0 {
            return None;
        }
        let DataPath::UserCopy {
            staging,
            lent: Some(lent),
        } = &mut self.data
        else {
            return None;
        };
        let staging = staging.tag_mut(0);
        if usize::try_from(request.rest.len).is_ok_and(|len| len <= staging.len()) {
            return None;
        }
        Some(SharedRead::serve(
            handler,
            (&self.char_dev, &self.failures),
            (self.setup.q_id, request.tag),
            request.rest,
            staging,
            lent,
        ))
    }

    /// Serve the first piece of `request.rest` (all of it unless the staging buffer is
    /// smaller) and take what was served off it: all of the piece, or, deferred, part of it.
    /// `Err`: what the request is committed with, having failed: a negative errno, or, where
    /// its first bytes were served before the failure, their count (see `Failure`).
    fn serve_piece(
        &mut self,
        request: &mut HeldRequest,
        handler: &Arc<dyn BlockHandler>,
        may_defer: bool,
    ) -> Result<Piece, i32> {
        let (tag, q_id) = (request.tag, self.setup.q_id);
        let rest_len = usize::try_from(data_len(&request.rest)).map_err(|_| -libc::EIO)?;
        // The piece's buffer and, with user copy, the char device and where in it the piece's
        // data begins.
        let (data, user_copy) = match &mut self.data {
            DataPath::TagBuffers(buffers) => (
                buffers
                    .tag_mut(tag)
                    .get_mut(request.buffer_offset..request.buffer_offset + rest_len),
                None,
            ),
            DataPath::UserCopy { staging, .. } => {
                let staging = staging.tag_mut(0);
                let len = rest_len.min(staging.len());
                (
                    staging.get_mut(..len),
                    Some((
                        self.char_dev.as_ref(),
                        sys::user_copy_pos(q_id, tag, request.buffer_offset),
                    )),
                )
            }
        };
        let data = data.ok_or(-libc::EIO)?;
        let piece = Request {
            len: if rest_len == 0 {
                request.rest.len
            } else {
                data.len() as u64
            },
            ..request.rest
        };
        if let (Some((char_dev, at)), Op::Write) = (user_copy, piece.op) {
            if let Err(error) = char_dev.read_exact_at(data, at) {
                if let Some(failures) = self.failures.note() {
                    tracing::warn!(q = q_id, tag, request = ?piece, %error, failures, "reading a write's data from the request failed; request failed with EIO");
                }
                return Err(-libc::EIO);
            }
        }
        let deferred_since = request.deferred_since;
        let handled = catch_unwind(AssertUnwindSafe(|| {
            if may_defer {
                handler.try_handle(&piece, data, deferred_since)
            } else {
                Handled::Done(handler.handle(&piece, data))
            }
        }));
        let (done_bytes, end) = match handled {
            Ok(Handled::Done(Ok(()))) => (piece.len, Ok(Piece::Whole)),
            // Whole blocks only: the driver completes what is committed as done.
            Ok(Handled::Done(Err(failure))) => (
                failure.done_bytes.min(piece.len) & !(BLOCK_SIZE - 1),
                Err(failure.errno),
            ),
            Ok(Handled::Deferred { done_bytes }) => {
                (done_bytes.min(piece.len), Ok(Piece::Deferred))
            }
            Err(_) => {
                tracing::error!(
                    q = q_id,
                    tag,
                    request = ?piece,
                    "handler panicked; request failed with EIO"
                );
                return Err(-libc::EIO);
            }
        };
        let done = usize::try_from(done_bytes).map_err(|_| -libc::EIO)?;
        if let (Some((char_dev, at)), Op::Read) = (user_copy, piece.op) {
            // What the handler read, into the request before its commit (a deferred part's
            // data would not survive in the staging buffer).
            if let Err(error) = char_dev.write_all_at(&data[..done], at) {
                if let Some(failures) = self.failures.note() {
                    tracing::warn!(q = q_id, tag, request = ?piece, %error, failures, "writing a read's data into the request failed; request failed with EIO");
                }
                return Err(-libc::EIO);
            }
        }
        request.rest.offset += done_bytes;
        request.rest.len -= done_bytes;
        if rest_len > 0 {
            request.buffer_offset += done;
        }
        end.map_err(|errno| partial_result(request, errno))
    }
}

/// What `request`, failed with `errno` after what it served, commits: the bytes of data served
/// (the driver completes those and sends the rest again), or, where none were, the errno.
fn partial_result(request: &HeldRequest, errno: i32) -> i32 {
    let served = u64::try_from(request.served).unwrap_or(0);
    match served.checked_sub(request.rest.len) {
        Some(done) if done > 0 && matches!(request.rest.op, Op::Read | Op::Write) => {
            i32::try_from(done).unwrap_or_else(|_| failure_result(errno))
        }
        _ => failure_result(errno),
    }
}

/// Bytes of data a request carries (what a served one commits).
fn data_len(request: &Request) -> i32 {
    match request.op {
        Op::Read | Op::Write => i32::try_from(request.len).unwrap_or(-libc::EIO),
        _ => 0,
    }
}

fn elapsed_ns(since: Instant) -> u64 {
    crate::units::nanos(since.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(op: Op, len: u64, rest_len: u64) -> HeldRequest {
        HeldRequest {
            tag: 0,
            rest: Request {
                op,
                flags: 0,
                offset: 8 * BLOCK_SIZE + (len - rest_len),
                len: rest_len,
            },
            buffer_offset: 0,
            deferred_since: None,
            arrived: Instant::now(),
            served: data_len(&Request {
                op,
                flags: 0,
                offset: 0,
                len,
            }),
        }
    }

    /// A request that failed part way commits the bytes before the failure, which the driver
    /// completes before it sends the rest again; one that failed at its start, or that moves
    /// no data, commits the errno (or EIO for a failure that is not one).
    #[test]
    fn a_failure_part_way_commits_what_was_served_before_it() {
        let page = BLOCK_SIZE;
        assert_eq!(
            partial_result(&held(Op::Read, 8 * page, 5 * page), -libc::EIO),
            i32::try_from(3 * page).unwrap()
        );
        assert_eq!(
            partial_result(&held(Op::Write, 8 * page, page), -libc::ENOMEM),
            i32::try_from(7 * page).unwrap()
        );
        assert_eq!(
            partial_result(&held(Op::Read, 8 * page, 8 * page), -libc::EIO),
            -libc::EIO
        );
        assert_eq!(
            partial_result(&held(Op::Read, 8 * page, 8 * page), 0),
            -libc::EIO
        );
        assert_eq!(
            partial_result(&held(Op::Discard, 8 * page, 0), -libc::EIO),
            -libc::EIO
        );
    }
}
