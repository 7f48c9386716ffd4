//! Waking a thread that the kernel's reclaim throttle holds, once memory is back.
//!
//! Why: an allocation that may not enter file systems (every allocation of an I/O flusher
//! thread, `PR_SET_IO_FLUSHER`, is `GFP_NOIO`) and finds free memory below half the min
//! watermark sleeps in `throttle_direct_reclaim` for up to a second, woken early only by kswapd.
//! Near OOM kswapd itself waits for a free bio, held by a write waiting for this very
//! allocation. So the thread that commits memory sleeps out its second even after an OOM kill
//! has freed tens of MiB, and the writes that waited for it fail (seen in the VM's near-OOM
//! stage, `scripts/vm-test.sh --stress`, 2026-11-27: every write that starved, 1000 ms after it
//! began, met a refill thread in its commit for 1000 ms, 0.7 s after the kill). The sleep is
//! interruptible: a signal ends it, and with a no-op handler nothing else changes (a populate
//! is not cut short by one; only fatal signals end it).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// At most one wake-up per this long: each one that finds memory short again only costs the
/// woken thread one trip through reclaim without its nap.
const WAKE_INTERVAL: Duration = Duration::from_millis(20);
/// Frames of a kernel stack given in a log line (`ThrottledThread::kernel_stack`): enough to
/// reach from where a thread sleeps to the system call that brought it there.
const KERNEL_STACK_FRAMES: usize = 14;

/// The signal that wakes a throttled thread, with a handler that does nothing, installed once.
/// `None` if it could not be installed (then nothing is ever sent: the default action of a
/// real-time signal is to end the process).
fn wake_signal() -> Option<libc::c_int> {
    static SIGNAL: OnceLock<Option<libc::c_int>> = OnceLock::new();
    *SIGNAL.get_or_init(|| {
        let signal = libc::SIGRTMIN();
        // SAFETY: the action does nothing, so it is async-signal-safe; signal-hook installs it
        // with SA_RESTART, so calls it interrupts are restarted where the kernel can.
        match unsafe { signal_hook::low_level::register(signal, || {}) } {
            Ok(_) => Some(signal),
            Err(error) => {
                tracing::warn!(%error, "cannot install the reclaim wake-up signal: a thread asleep in the kernel's reclaim throttle sleeps its full second");
                None
            }
        }
    })
}

/// The free memory, in bytes, above which an allocation no longer sleeps in the throttle and
/// succeeds at the min watermark: twice `vm.min_free_kbytes` (the throttle wakes above half of
/// it). Read when the first thread registers, not under memory pressure. Unreadable (a
/// sandbox hiding /proc/sys), 0: memory then always counts as back, so the store never asks
/// the OOM killer to act on a floor it does not know (writes that starve fail instead).
fn free_memory_floor() -> u64 {
    static FLOOR: OnceLock<u64> = OnceLock::new();
    *FLOOR.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/vm/min_free_kbytes")
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
            .map_or(0, |kib| kib.saturating_mul(2 << 10))
    })
}

/// Free memory in bytes (`sysinfo`'s freeram); `None` if it cannot be read.
fn free_memory() -> Option<u64> {
    // SAFETY: an all-zero sysinfo is a valid value of this plain C struct.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: sysinfo writes one struct into `info`, which we own and which outlives the call.
    if unsafe { libc::sysinfo(&mut info) } != 0 {
        return None;
    }
    info.freeram.checked_mul(u64::from(info.mem_unit))
}

/// Whether free memory is back above the throttle's floor (`free_memory_floor`).
pub fn free_memory_is_back() -> bool {
    free_memory().is_some_and(|free| free > free_memory_floor())
}

/// A thread that may sleep in the reclaim throttle, which other threads wake (`wake`) once it
/// has registered itself (`register`).
#[derive(Debug)]
pub struct ThrottledThread {
    /// The thread's id while registered, else 0.
    tid: AtomicI32,
    /// Its `stat` and `stack` in /proc, opened when it registered (`kernel_stack`); `None`
    /// while no thread is registered.
    task_files: Mutex<Option<std::io::Result<TaskFiles>>>,
    /// When it was last woken (ns since `epoch`).
    woken_ns: AtomicU64,
    epoch: Instant,
}

impl Default for ThrottledThread {
    fn default() -> Self {
        Self {
            tid: AtomicI32::new(0),
            task_files: Mutex::new(None),
            woken_ns: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

/// The calling thread registered (see `ThrottledThread::register`) until dropped.
pub struct Registered<'a>(&'a ThrottledThread);

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.0.tid.store(0, Ordering::Release);
        if let Ok(mut files) = self.0.task_files.lock() {
            *files = None;
        }
    }
}

impl ThrottledThread {
    /// The calling thread may be woken from now on (where the wake-up signal's handler could
    /// be installed: `wake` sends nothing otherwise), and its kernel stack read, until the
    /// guard is dropped. Installs that handler and reads the free-memory floor, if not done
    /// yet.
    pub fn register(&self) -> Registered<'_> {
        wake_signal();
        free_memory_floor();
        let files = TaskFiles::open();
        if let Ok(mut slot) = self.task_files.lock() {
            *slot = Some(files);
        }
        self.tid
            .store(nix::unistd::gettid().as_raw(), Ordering::Release);
        Registered(self)
    }

    /// Where the registered thread is in the kernel: its scheduler state (`R` running or
    /// runnable, `S` asleep, `D` asleep and not to be interrupted) and the innermost frames
    /// of `/proc/self/task/TID/stack`, "D: fn < caller < ...", for a log line that says what
    /// a commit waits for (reclaim's throttle, writeback, a lock). The kernel gives no stack
    /// of a thread that is on a CPU at that moment (its unwinder refuses a task running
    /// elsewhere), which the line then says. `None` if no thread is registered; the error if
    /// the stack cannot be read (it takes `CAP_SYS_ADMIN`). Read through the files the thread
    /// opened when it registered, into a buffer on the stack: a look (a starved write's log
    /// line, on a queue thread, with memory at its floor) makes the kernel allocate nothing
    /// new for a file of its own.
    pub fn kernel_stack(&self) -> Option<std::io::Result<String>> {
        if self.tid.load(Ordering::Acquire) == 0 {
            return None;
        }
        let files = self.task_files.lock().ok()?;
        Some(match files.as_ref()? {
            Ok(files) => files.read(),
            Err(error) => Err(std::io::Error::new(error.kind(), error.to_string())),
        })
    }

    /// Signal the registered thread, unless it was within `WAKE_INTERVAL`: a sleep in the
    /// reclaim throttle ends, and nothing else changes for it. True if it was signalled.
    pub fn wake(&self) -> bool {
        // No thread registered: nothing to signal, and no handler to install from this
        // thread (which allocates, maybe under memory pressure).
        let tid = self.tid.load(Ordering::Acquire);
        if tid == 0 {
            return false;
        }
        let Some(signal) = wake_signal() else {
            return false;
        };
        let now = crate::units::nanos(self.epoch.elapsed());
        let last = self.woken_ns.load(Ordering::Relaxed);
        let interval = crate::units::nanos(WAKE_INTERVAL);
        if last != 0 && now.saturating_sub(last) < interval {
            return false;
        }
        if self
            .woken_ns
            .compare_exchange(last, now.max(1), Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return false; // another thread wakes it now
        }
        // SAFETY: tgkill takes no pointers; it sends `signal`, whose handler does nothing, to
        // one thread of this process (the registered one, or, had its id been reused after it
        // ended, another of ours, for which the signal is as harmless).
        unsafe { libc::tgkill(nix::unistd::getpid().as_raw(), tid, signal) == 0 }
    }
}

/// A registered thread's `/proc/thread-self/{stat,stack}`, opened by the thread itself:
/// they name it whichever thread reads them later.
#[derive(Debug)]
struct TaskFiles {
    stat: File,
    stack: File,
}

impl TaskFiles {
    fn open() -> std::io::Result<Self> {
        Ok(Self {
            stat: File::open("/proc/thread-self/stat")?,
            stack: File::open("/proc/thread-self/stack")?,
        })
    }

    /// "STATE: fn < caller < ..." (see `ThrottledThread::kernel_stack`).
    fn read(&self) -> std::io::Result<String> {
        let mut buffer = [0u8; 4096];
        let text = |file: &File, buffer: &mut [u8; 4096]| -> std::io::Result<String> {
            let n = file.read_at(buffer, 0)?;
            Ok(String::from_utf8_lossy(&buffer[..n]).into_owned())
        };
        let state = text(&self.stat, &mut buffer)?;
        let stack = text(&self.stack, &mut buffer)?;
        let frames = stack
            .lines()
            .filter_map(|line| line.split_once(' ').map(|(_, frame)| frame))
            .map(|frame| {
                frame
                    .split_once('+')
                    .map_or(frame, |(function, _)| function)
            })
            .take(KERNEL_STACK_FRAMES)
            .collect::<Vec<_>>();
        let frames = if frames.is_empty() {
            "no frames (a task on a CPU has none)".to_string()
        } else {
            frames.join(" < ")
        };
        let state = crate::os::process_state(&state).unwrap_or('?');
        Ok(format!("{state}: {frames}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_registered_thread_is_woken_from_an_interruptible_sleep() {
        let thread = Arc::new(ThrottledThread::default());
        let (registered_tx, registered_rx) = std::sync::mpsc::channel();
        let sleeper = {
            let thread = Arc::clone(&thread);
            std::thread::spawn(move || {
                let _registered = thread.register();
                registered_tx.send(()).unwrap();
                let start = Instant::now();
                // poll(2) is never restarted after a handler: like the reclaim throttle's
                // interruptible sleep, a signal ends it.
                // SAFETY: poll with no descriptors only sleeps.
                let slept = unsafe { libc::poll(std::ptr::null_mut(), 0, 10_000) };
                let error = std::io::Error::last_os_error().raw_os_error();
                (slept, error, start.elapsed())
            })
        };
        registered_rx.recv().unwrap();
        // The sleeper may not be in poll yet: signal until it returns.
        while !sleeper.is_finished() {
            thread.wake();
            std::thread::sleep(Duration::from_millis(25));
        }
        let (slept, error, took) = sleeper.join().unwrap();
        assert_eq!((slept, error), (-1, Some(libc::EINTR)));
        assert!(took < Duration::from_secs(5), "woken after {took:?}");
        assert!(!thread.wake(), "an unregistered thread is not signalled");
    }

    #[test]
    fn the_registered_threads_kernel_stack_is_read_from_another_thread() {
        let thread = Arc::new(ThrottledThread::default());
        assert!(thread.kernel_stack().is_none(), "no thread registered");
        let (registered_tx, registered_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let sleeper = {
            let thread = Arc::clone(&thread);
            std::thread::spawn(move || {
                let _registered = thread.register();
                registered_tx.send(()).unwrap();
                done_rx.recv().unwrap(); // asleep in a futex wait meanwhile
            })
        };
        registered_rx.recv().unwrap();
        // With CAP_SYS_ADMIN another thread's stack is read (here, asleep in its wait, once
        // it got there from the send); without it, an error, never a panic or garbage.
        let mut read = thread.kernel_stack();
        for _ in 0..500 {
            if !matches!(&read, Some(Ok(stack)) if !stack.starts_with("S: ")) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
            read = thread.kernel_stack();
        }
        done_tx.send(()).unwrap();
        sleeper.join().unwrap();
        match read {
            Some(Ok(stack)) => {
                assert!(stack.starts_with("S: "), "asleep, then its frames: {stack}");
                assert!(!stack.contains("[<"), "addresses left out: {stack}");
                assert!(!stack.contains('+'), "offsets left out: {stack}");
            }
            Some(Err(_)) => assert!(
                std::fs::read_to_string("/proc/thread-self/stack").is_err(),
                "the stack is readable here"
            ),
            None => panic!("the thread was registered"),
        }
    }

    #[test]
    fn a_running_thread_reads_as_running() {
        let thread = Arc::new(ThrottledThread::default());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (registered_tx, registered_rx) = std::sync::mpsc::channel();
        let spinner = {
            let (thread, stop) = (Arc::clone(&thread), Arc::clone(&stop));
            std::thread::spawn(move || {
                let _registered = thread.register();
                registered_tx.send(()).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        registered_rx.recv().unwrap();
        let read = thread.kernel_stack();
        stop.store(true, Ordering::Relaxed);
        spinner.join().unwrap();
        // On a CPU: no frames (the kernel refuses to unwind it); preempted: where it was.
        match read {
            Some(Ok(stack)) => assert!(stack.starts_with("R: "), "running or runnable: {stack}"),
            Some(Err(_)) => assert!(
                std::fs::read_to_string("/proc/thread-self/stack").is_err(),
                "the stack is readable here"
            ),
            None => panic!("the thread was registered"),
        }
    }

    #[test]
    fn wake_ups_are_spaced() {
        let thread = ThrottledThread::default();
        let _registered = thread.register();
        assert!(thread.wake());
        assert!(
            !thread.wake(),
            "a second wake-up within the interval is skipped"
        );
        std::thread::sleep(WAKE_INTERVAL);
        assert!(thread.wake());
    }

    #[test]
    fn free_memory_is_read() {
        assert!(free_memory().is_some_and(|free| free > 0));
        assert!(free_memory_floor() > 0);
    }
}
