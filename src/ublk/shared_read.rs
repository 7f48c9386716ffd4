//! A READ larger than the user-copy staging buffer, its pieces served by two threads: the
//! queue thread and, when the handler lends one (`BlockHandler::lend_thread`), a thread of the
//! handler's. Each thread reads a piece from the handler into a buffer of its own and writes
//! it into the request (pwrite on the char device), so pieces may be served in any order.
//!
//! The queue thread never waits for the lent thread to start: both take the next piece from
//! one counter, and the queue thread, once none is left, waits only while the lent thread is
//! inside a piece. A lent thread that starts late (its pool busy compressing) finds nothing
//! left and returns; its piece buffer is the queue's, which only one request uses at a time.
//!
//! Why: a large read is a decompression per page, and the queue thread alone does every one
//! of them on one CPU while the client waits. In the VM's 1 MiB read row (fio, QD4) one vCPU
//! ran the queue thread while the other idled, waiting for it (2026-12-01).

#![forbid(unsafe_code)]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::Thread;

use parking_lot::Mutex;

use super::handler::BlockHandler;
use super::io::{failure_result, Request};
use super::mmap::IoBuffers;
use super::params::BLOCK_SIZE;
use super::sys;
use crate::os::LogThrottle;

/// Bytes of a piece, of the lent thread's buffer and of the queue's staging buffer: 8 pages,
/// small enough that the two threads finish a 1 MiB read close together, large enough that a
/// piece's pwrite costs little beside its decompression.
pub(super) const PIECE_BYTES: usize = 32 << 10;

/// The buffer a queue lends with its requests' pieces, made with the queue (so locked and
/// faulted in before the device is live).
pub(super) type LentBuffer = Arc<Mutex<IoBuffers>>;

pub(super) fn lent_buffer() -> std::io::Result<LentBuffer> {
    Ok(Arc::new(Mutex::new(IoBuffers::new(1, PIECE_BYTES)?)))
}

/// One read being served in pieces.
pub(super) struct SharedRead {
    handler: Arc<dyn BlockHandler>,
    char_dev: Arc<File>,
    /// The queue's count of failed copies, to log some of.
    failures: Arc<LogThrottle>,
    q_id: u16,
    tag: u16,
    /// The read (all of it: reads are never deferred).
    request: Request,
    pieces: usize,
    /// The next piece to take; `pieces` and above: none left.
    next: AtomicUsize,
    /// Whether the lent thread is inside a piece (or about to take one).
    lent_busy: AtomicBool,
    /// Whether a piece failed: no more are taken.
    failed: AtomicBool,
    /// The failure nearest the read's start: the bytes before it, all served, and its errno.
    /// Pieces are taken in order, so every piece before a failed one was taken, and is
    /// served (or failed nearer) by the time both threads are done.
    first_failure: Mutex<Option<(usize, i32)>>,
    queue_thread: Thread,
}

impl SharedRead {
    /// Serve `request` (a READ of tag `tag`) on the calling queue thread, through `staging`
    /// (`PIECE_BYTES`), and on a thread the handler lends, through `lent` (`char_dev`: the
    /// device's, and the queue's count of failed copies); the result to commit: the bytes
    /// read (all, or those before the first that failed; see `Failure`), or, where the first
    /// failed, its negative errno.
    pub(super) fn serve(
        handler: &Arc<dyn BlockHandler>,
        (char_dev, failures): (&Arc<File>, &Arc<LogThrottle>),
        (q_id, tag): (u16, u16),
        request: Request,
        staging: &mut [u8],
        lent: &LentBuffer,
    ) -> i32 {
        let Ok(len) = usize::try_from(request.len) else {
            return -libc::EIO;
        };
        let Ok(served) = i32::try_from(request.len) else {
            return -libc::EIO;
        };
        let shared = Arc::new(Self {
            handler: handler.clone(),
            char_dev: char_dev.clone(),
            failures: failures.clone(),
            q_id,
            tag,
            request,
            pieces: len.div_ceil(PIECE_BYTES),
            next: AtomicUsize::new(0),
            lent_busy: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            first_failure: Mutex::new(None),
            queue_thread: std::thread::current(),
        });
        // The lent thread's job holds the read weakly: one that starts after the read was
        // answered (its pool busy) finds it gone, and one still queued keeps neither the
        // char device (whose last close DEL_DEV waits for) nor the handler.
        let (helper, buffer) = (Arc::downgrade(&shared), lent.clone());
        handler.lend_thread(Box::new(move || {
            if let Some(shared) = helper.upgrade() {
                shared.serve_lent(&buffer);
            }
        }));
        shared.take_pieces(staging);
        // Every piece is taken; wait for the one the lent thread may still be serving.
        while shared.lent_busy.load(Ordering::SeqCst) {
            std::thread::park();
        }
        let first_failure = *shared.first_failure.lock();
        match first_failure {
            None => served,
            Some((0, errno)) => failure_result(errno),
            Some((done, errno)) => i32::try_from(done).unwrap_or_else(|_| failure_result(errno)),
        }
    }

    /// The lent thread's part: the pieces it takes, through the queue's lent buffer.
    fn serve_lent(&self, buffer: &LentBuffer) {
        // Busy first, then the counter: a queue thread that finds the lent thread not busy
        // after its own last take knows every later take here finds nothing (both SeqCst).
        self.lent_busy.store(true, Ordering::SeqCst);
        let _done = LentDone(self);
        if self.next.load(Ordering::SeqCst) < self.pieces {
            // Only the request being served takes the buffer (a late thread of an earlier
            // one finds no piece left above), so it is free; if not, the queue thread serves
            // every piece.
            if let Some(mut buffer) = buffer.try_lock() {
                self.take_pieces(buffer.tag_mut(0));
            }
        }
    }

    /// Serve pieces through `buffer` until none is left or one failed.
    fn take_pieces(&self, buffer: &mut [u8]) {
        while !self.failed.load(Ordering::SeqCst) {
            let piece = self.next.fetch_add(1, Ordering::SeqCst);
            if piece >= self.pieces {
                return;
            }
            if let Err((done, errno)) = self.serve_piece(piece, buffer) {
                let mut first = self.first_failure.lock();
                if first.is_none_or(|(first_done, _)| done < first_done) {
                    *first = Some((done, errno));
                }
                self.failed.store(true, Ordering::SeqCst);
            }
        }
    }

    /// Read piece `piece` from the handler into `buffer` and write it into the request.
    /// `Err`: where the read failed (its bytes before the failure, this piece's of them
    /// written into the request), and the failure's negative errno.
    fn serve_piece(&self, piece: usize, buffer: &mut [u8]) -> Result<(), (usize, i32)> {
        let start = piece * PIECE_BYTES;
        let failed_whole = |errno| (start, errno);
        let len = usize::try_from(self.request.len)
            .ok()
            .and_then(|len| len.checked_sub(start))
            .ok_or(failed_whole(-libc::EIO))?;
        let data = buffer
            .get_mut(..len.min(PIECE_BYTES))
            .ok_or(failed_whole(-libc::EIO))?;
        let part = Request {
            offset: self.request.offset + start as u64,
            len: data.len() as u64,
            ..self.request
        };
        let (done, failure) = match catch_unwind(AssertUnwindSafe(|| {
            self.handler.handle(&part, data)
        })) {
            Ok(Ok(())) => (data.len(), None),
            // Whole blocks only: the driver completes what is committed as done.
            Ok(Err(failure)) => (
                usize::try_from(failure.done_bytes.min(part.len) & !(BLOCK_SIZE - 1)).unwrap_or(0),
                Some(failure.errno),
            ),
            Err(_) => {
                tracing::error!(q = self.q_id, tag = self.tag, request = ?part, "handler panicked; request failed with EIO");
                return Err(failed_whole(-libc::EIO));
            }
        };
        let at = sys::user_copy_pos(self.q_id, self.tag, start);
        self.char_dev.write_all_at(&data[..done], at).map_err(|error| {
            if let Some(failures) = self.failures.note() {
                tracing::warn!(q = self.q_id, tag = self.tag, request = ?part, %error, failures, "writing a read's data into the request failed; request failed with EIO");
            }
            failed_whole(-libc::EIO)
        })?;
        match failure {
            None => Ok(()),
            Some(errno) => Err((start + done, errno)),
        }
    }
}

/// Ends the lent thread's part, however it ends: the queue thread waits for this.
struct LentDone<'a>(&'a SharedRead);

impl Drop for LentDone<'_> {
    fn drop(&mut self) {
        self.0.lent_busy.store(false, Ordering::SeqCst);
        self.0.queue_thread.unpark();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ublk::{Failure, Op};

    /// Reads as each byte's device offset (mod 251), fails a read at `fail_at` with the value
    /// it gives; lends a
    /// thread as `lend` says.
    struct Pattern {
        lend: Lend,
        fail_at: Option<(u64, i32)>,
        late: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
    }

    #[derive(Clone, Copy)]
    enum Lend {
        Never,
        Now,
        /// Kept, to run after the read is done.
        Late,
    }

    impl BlockHandler for Pattern {
        fn prepare_thread(&self) {}

        fn handle(&self, request: &Request, data: &mut [u8]) -> Result<(), Failure> {
            for (i, byte) in data.iter_mut().enumerate() {
                *byte = ((request.offset + i as u64) % 251) as u8;
            }
            let end = request.offset + request.len;
            match self.fail_at {
                Some((at, errno)) if (request.offset..end).contains(&at) => Err(Failure {
                    errno,
                    done_bytes: at - request.offset,
                }),
                _ => Ok(()),
            }
        }

        fn lend_thread(&self, job: Box<dyn FnOnce() + Send>) {
            match self.lend {
                Lend::Never => drop(job),
                Lend::Now => {
                    std::thread::spawn(job);
                }
                Lend::Late => self.late.lock().push(job),
            }
        }
    }

    /// A file standing in for the char device: the pieces land at their user-copy positions.
    fn char_dev(name: &str) -> (Arc<File>, std::path::PathBuf) {
        let path =
            std::env::temp_dir().join(format!("trueno-shared-read-{}-{name}", std::process::id()));
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("temp file");
        (Arc::new(file), path)
    }

    fn read(offset: u64, len: u64) -> Request {
        Request {
            op: Op::Read,
            flags: 0,
            offset,
            len,
        }
    }

    /// Serve `request` as tag 3 of queue 1 and return the result and what the file got.
    fn serve(handler: Pattern, request: Request, name: &str) -> (i32, Vec<u8>, Arc<Pattern>) {
        let handler = Arc::new(handler);
        let dyn_handler: Arc<dyn BlockHandler> = handler.clone();
        let (file, path) = char_dev(name);
        file.set_len(sys::user_copy_pos(1, 3, 0) + request.len)
            .expect("sparse temp file");
        let lent = lent_buffer().expect("lent buffer");
        let mut staging = vec![0u8; PIECE_BYTES];
        let result = SharedRead::serve(
            &dyn_handler,
            (&file, &Arc::default()),
            (1, 3),
            request,
            &mut staging,
            &lent,
        );
        let mut got = vec![0u8; usize::try_from(request.len).expect("a test's length")];
        file.read_exact_at(&mut got, sys::user_copy_pos(1, 3, 0))
            .expect("the request's bytes");
        std::fs::remove_file(path).expect("remove temp file");
        (result, got, handler)
    }

    fn expected(request: Request) -> Vec<u8> {
        (0..request.len)
            .map(|i| ((request.offset + i) % 251) as u8)
            .collect()
    }

    #[test]
    fn every_piece_lands_where_the_request_wants_it_whether_a_thread_is_lent_or_not() {
        // 1 MiB and an odd tail (a last piece shorter than the rest).
        for (len, name) in [(1u64 << 20, "mib"), ((200 << 10) + 4096, "tail")] {
            for lend in [Lend::Never, Lend::Now, Lend::Late] {
                let request = read(7 << 20, len);
                let handler = Pattern {
                    lend,
                    fail_at: None,
                    late: Mutex::new(Vec::new()),
                };
                let (result, got, _) = serve(handler, request, name);
                assert_eq!(u64::try_from(result).ok(), Some(len));
                assert!(got == expected(request), "{name}: wrong bytes");
            }
        }
    }

    #[test]
    fn a_thread_lent_late_finds_the_read_done_and_touches_nothing() {
        let request = read(0, 1 << 20);
        let handler = Pattern {
            lend: Lend::Late,
            fail_at: None,
            late: Mutex::new(Vec::new()),
        };
        let (result, _, handler) = serve(handler, request, "late");
        assert_eq!(result, 1 << 20);
        // The queued job holds nothing of the read: not the handler (nor the char device,
        // whose last close a DEL_DEV waits for).
        assert_eq!(Arc::strong_count(&handler), 1);
        let jobs = std::mem::take(&mut *handler.late.lock());
        assert_eq!(jobs.len(), 1);
        // Its file is gone: a piece it served now would fail and be logged, never silently
        // land; it serves none and returns.
        for job in jobs {
            job();
        }
    }

    /// A piece that fails past the read's first page commits the bytes before it (the driver
    /// completes them and sends the rest again), whichever thread served which piece; one that
    /// fails at the first fails the read with its errno, and a failure that is not a negative
    /// errno (0, a count) with EIO: taken as given, 0 let the other pieces finish and the read
    /// pass whole with a hole.
    #[test]
    fn a_failed_piece_ends_the_read_where_it_failed() {
        for lend in [Lend::Never, Lend::Now] {
            let request = read(1 << 20, 1 << 20);
            let handler = Pattern {
                lend,
                fail_at: Some(((1 << 20) + (700 << 10), -libc::ENOMEM)),
                late: Mutex::new(Vec::new()),
            };
            let (result, got, _) = serve(handler, request, "partial");
            assert_eq!(result, 700 << 10);
            assert!(got[..700 << 10] == expected(request)[..700 << 10]);
            for (error, result_wanted) in [
                (-libc::ENOMEM, -libc::ENOMEM),
                (0, -libc::EIO),
                (4096, -libc::EIO),
            ] {
                let handler = Pattern {
                    lend,
                    fail_at: Some((1 << 20, error)),
                    late: Mutex::new(Vec::new()),
                };
                let (result, _, _) = serve(handler, request, "fail");
                assert_eq!(result, result_wanted, "handler failed with {error}");
            }
        }
    }
}
