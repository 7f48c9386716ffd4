//! The operating system's calls that are not the ublk protocol: thread and process hardening
//! for a daemon that serves swap, swapon(2), and what the machine has (RAM). A leaf: it knows
//! nothing of ublk, the store or the command line. Every raw call goes through `cvt`.

use nix::sys::mman::{mlockall, MlockAllFlags};

/// The result of a libc call that returns -1 and sets errno on failure.
pub fn cvt(rc: libc::c_int) -> std::io::Result<()> {
    if rc == -1 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Counts events of one kind that are logged, and says which to log: the first 16, then every
/// 1024th, so that a flood of them (a full device's failed writes, a stopping device's aborted
/// requests) cannot fill the log or the disk under it.
#[derive(Debug, Default)]
pub struct LogThrottle(std::sync::atomic::AtomicU64);

impl LogThrottle {
    /// Count one event: `Some(count so far)` where this one is to be logged.
    pub fn note(&self) -> Option<u64> {
        let count = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        (count <= 16 || count.is_multiple_of(1024)).then_some(count)
    }
}

/// Write `line` and a newline to standard error. A reader that has gone (`2>&1 | head`) loses
/// it quietly, where `eprintln!` would panic, and a panic part-way through a command (`delete
/// --all`) leaves the devices after it undeleted.
pub fn print_err(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// `PR_SET_IO_FLUSHER` from `include/uapi/linux/prctl.h` (Linux 5.6+).
const PR_SET_IO_FLUSHER: libc::c_int = 57;

/// Mark the calling thread as an I/O flusher (`PR_SET_IO_FLUSHER`): its allocations do not
/// recurse into I/O, so a thread that serves swap never waits on swap. Needs CAP_SYS_RESOURCE.
pub fn set_io_flusher() -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) takes no pointers; it only sets a flag on
    // the calling thread.
    cvt(unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) })
}

/// Give the calling thread the highest CPU priority (nice -20). A thread that serves swap
/// competes with the very tasks whose memory it swaps out: when it loses, their faults wait
/// on it for longer. Needs CAP_SYS_NICE.
pub fn raise_thread_priority() -> std::io::Result<()> {
    set_thread_nice(-20)
}

/// Set the calling thread's nice value (Linux keeps one per thread). Lowering a thread's
/// priority needs no privilege; raising it needs CAP_SYS_NICE.
pub fn set_thread_nice(nice: libc::c_int) -> std::io::Result<()> {
    let tid = libc::id_t::try_from(nix::unistd::gettid().as_raw())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: setpriority takes no pointers; for PRIO_PROCESS with a thread id (Linux) it only
    // changes that thread's nice value.
    cvt(unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) })
}

/// CPU time the calling thread has used (`CLOCK_THREAD_CPUTIME_ID`); zero if it cannot be read.
pub fn thread_cpu_time() -> std::time::Duration {
    cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time this process has used, in every thread it has had, those that ended included
/// (`CLOCK_PROCESS_CPUTIME_ID`); zero if it cannot be read.
pub fn process_cpu_time() -> std::time::Duration {
    cpu_clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn cpu_clock(clock: libc::clockid_t) -> std::time::Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `now`, which we own and which outlives
    // the call.
    let read = cvt(unsafe { libc::clock_gettime(clock, &mut now) });
    match (read, u64::try_from(now.tv_sec), u32::try_from(now.tv_nsec)) {
        (Ok(()), Ok(secs), Ok(nanos)) => std::time::Duration::new(secs, nanos),
        _ => std::time::Duration::ZERO,
    }
}

/// One thread of this process and the CPU time it has used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadCpu {
    pub tid: u32,
    /// Its `comm`: the name it was given, at most 15 bytes.
    pub name: String,
    pub cpu: std::time::Duration,
}

/// Each live thread of this process with its CPU time: the first field of
/// `/proc/self/task/TID/schedstat`, nanoseconds run on a CPU. A thread that ends while this
/// reads is left out.
pub fn thread_cpu_times() -> std::io::Result<Vec<ThreadCpu>> {
    let mut threads = Vec::new();
    for task in std::fs::read_dir("/proc/self/task")? {
        let task = task?;
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let path = task.path();
        let (Ok(comm), Ok(schedstat)) = (
            std::fs::read_to_string(path.join("comm")),
            std::fs::read_to_string(path.join("schedstat")),
        ) else {
            continue;
        };
        let Some(nanos) = schedstat
            .split_whitespace()
            .next()
            .and_then(|ns| ns.parse::<u64>().ok())
        else {
            continue;
        };
        threads.push(ThreadCpu {
            tid,
            name: comm.trim_end().to_string(),
            cpu: std::time::Duration::from_nanos(nanos),
        });
    }
    Ok(threads)
}

/// The real-time priority (`SCHED_FIFO`) of the daemon's real-time threads: the lowest, so
/// that the kernel's own real-time threads (50 and above) still come first.
pub const REALTIME_PRIORITY: libc::c_int = 1;
/// One above `REALTIME_PRIORITY`: work that must preempt even those threads while it lasts
/// (see `RealtimeWhile`).
pub const REALTIME_PRIORITY_ABOVE: libc::c_int = REALTIME_PRIORITY + 1;

/// Run the calling thread under `SCHED_FIFO` at `priority`. The kernel's page allocator lets
/// real-time tasks dip below the min watermark (`ALLOC_MIN_RESERVE`; `ALLOC_HARDER` before
/// Linux 6.3), and the scheduler runs them before any normal task.
pub fn make_thread_realtime(priority: libc::c_int) -> std::io::Result<()> {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: `param` is a valid sched_param that outlives the call, which only reads it; pid 0
    // is the calling thread.
    cvt(unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) })
}

/// The calling thread real-time (`SCHED_FIFO` at a priority) while this lives, then under the
/// normal scheduler again, at the nice value it kept meanwhile. For a bounded stretch of work
/// that takes no lock a thread of lower priority may hold (a real-time thread that spins or
/// yields on such a lock keeps the holder off its CPU). A thread that may not be made
/// real-time (no CAP_SYS_NICE), or is real-time already, stays as it is.
pub struct RealtimeWhile {
    changed: bool,
}

impl RealtimeWhile {
    pub fn enter(priority: libc::c_int) -> Self {
        // SAFETY: sched_getscheduler takes no pointers; pid 0 is the calling thread.
        let normal = unsafe { libc::sched_getscheduler(0) } == libc::SCHED_OTHER;
        Self {
            changed: normal && make_thread_realtime(priority).is_ok(),
        }
    }
}

impl Drop for RealtimeWhile {
    fn drop(&mut self) {
        if self.changed {
            if let Err(error) = make_thread_normal() {
                tracing::warn!(%error, "could not take a thread back from real time");
            }
        }
    }
}

/// Run the calling thread under the normal scheduler again (`SCHED_OTHER`), after
/// `make_thread_realtime`, at the nice value it had (sched_setscheduler(2) keeps it).
pub fn make_thread_normal() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: as in `make_thread_realtime`: `param` outlives the call, which only reads it.
    cvt(unsafe { libc::sched_setscheduler(0, libc::SCHED_OTHER, &param) })
}

/// `mlockall(MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT)`: lock every page the process has and
/// every page it faults in later. On fault, not up front: with plain `MCL_FUTURE` every new
/// mapping is populated on the spot, the page arena's whole address space included, and a
/// heap extension under memory pressure would wait in reclaim (which swaps out through this
/// very daemon) while holding the mmap lock that the queue threads may need.
pub fn lock_memory() -> nix::Result<()> {
    // libc's, per architecture (powerpc and sparc number it otherwise); nix names no such flag.
    let flags = libc::MCL_CURRENT | libc::MCL_FUTURE | libc::MCL_ONFAULT;
    mlockall(MlockAllFlags::from_bits_retain(flags))
}

/// `prctl(PR_SET_THP_DISABLE)`: no transparent huge pages anywhere in this process's memory
/// (kept across fork and exec).
pub fn disable_huge_pages() -> nix::Result<()> {
    nix::sys::prctl::set_thp_disable(true)
}

/// Name the calling thread (and, on the main thread, the process as `/proc/PID/comm` and
/// `pidof` show it). A process started as `/proc/self/exe` would otherwise be called "exe".
pub fn set_process_name(name: &std::ffi::CStr) -> nix::Result<()> {
    nix::sys::prctl::set_name(name)
}

/// Have the kernel send `signal` to this process when the thread that forked it ends
/// (`PR_SET_PDEATHSIG`): a child told so by its parent's death, which nothing else tells.
pub fn set_parent_death_signal(signal: nix::sys::signal::Signal) -> nix::Result<()> {
    nix::sys::prctl::set_pdeathsig(signal)
}

/// Ignore terminal job control (SIGTSTP: Ctrl-Z; SIGTTIN, SIGTTOU: a background job's
/// terminal I/O), in this process and, since an ignored signal stays ignored across exec, in
/// the processes it starts: a stopped daemon would freeze every swap-in from its device.
pub fn ignore_job_control() -> nix::Result<()> {
    use nix::sys::signal::{signal, SigHandler, Signal};
    for job_control in [Signal::SIGTSTP, Signal::SIGTTIN, Signal::SIGTTOU] {
        // SAFETY: SIG_IGN installs no handler, so no code of ours runs in signal context.
        unsafe { signal(job_control, SigHandler::SigIgn) }?;
    }
    Ok(())
}

/// The name every process of the daemon gives itself (`set_process_name`), whatever its
/// binary is called: `pidof trueno-ublk`, and `same_program_alive`, go by it.
pub const DAEMON_NAME: &std::ffi::CStr = c"trueno-ublk";

/// argv[0] of every process of the daemon (the detached one, the supervisor's serving process
/// and standby; the systemd unit gives the supervisor the same). systemd-shutdown, the last
/// step of every shutdown, kills every process but root's whose argv[0] starts with '@'
/// (root storage daemons), then swaps off; where that swapoff has pages to read (a tmpfs's
/// after `systemctl poweroff --force`, which stops no unit) it would otherwise wait for good
/// on a device whose daemon it killed.
pub const DAEMON_ARGV0: &str = "@trueno-ublk";

/// Whether `pid` is a live daemon process (named `DAEMON_NAME`) of the same user as this
/// process (so not a recycled pid of something else). The user counts because a name does
/// not: any user may call a process of theirs "trueno-ublk", and one that got an old
/// daemon's pid (which the kernel keeps for a device that waits for its next daemon) would
/// otherwise hold that device's takeover off. Every uid of it counts, not only the
/// effective one: a user's set-uid-root program run through a link named `trueno-ublk`
/// (`su` waiting at its prompt) has root's effective uid, and its real uid is the user's.
pub fn same_program_alive(pid: i32) -> bool {
    // A zombie has exited (its memory is gone) but keeps its comm until its parent reaps
    // it, which an orphan's init may never do (the VM test's busybox init does not).
    if process_exited(pid) {
        return false;
    }
    let read = |file: &str| std::fs::read_to_string(format!("/proc/{pid}/{file}")).ok();
    let named_as_daemon = read("comm").is_some_and(|comm| {
        DAEMON_NAME
            .to_str()
            .is_ok_and(|name| comm.trim_end() == name)
    });
    let ours = nix::unistd::geteuid().to_string();
    let same_user = read("status").is_some_and(|theirs| only_uid(&theirs) == Some(ours.as_str()));
    named_as_daemon && same_user
}

/// A live daemon process of ours (`same_program_alive`), held by a pidfd: a signal sent
/// through it reaches that process or none. By pid alone, a daemon that exited between the
/// check and the `kill` would leave its pid to whatever process got it next.
pub struct OurDaemon {
    pidfd: std::os::fd::OwnedFd,
}

impl OurDaemon {
    /// Process `pid` if it is a live daemon of ours now.
    pub fn find(pid: i32) -> Option<Self> {
        // 0 and negative pids name process groups to kill(2), and no process here.
        if pid <= 0 {
            return None;
        }
        let process = rustix::process::Pid::from_raw(pid)?;
        // Opened before the check: if `pid` was reused in between, the pidfd holds the
        // process that exited, which no signal reaches.
        let pidfd =
            rustix::process::pidfd_open(process, rustix::process::PidfdFlags::empty()).ok()?;
        same_program_alive(pid).then_some(Self { pidfd })
    }

    /// Send it `signal`; ESRCH once it has exited and been reaped.
    pub fn signal(&self, signal: nix::sys::signal::Signal) -> nix::Result<()> {
        let signal = rustix::process::Signal::from_named_raw(signal as libc::c_int)
            .ok_or(nix::errno::Errno::EINVAL)?;
        rustix::process::pidfd_send_signal(&self.pidfd, signal)
            .map_err(|error| nix::errno::Errno::from_raw(error.raw_os_error()))
    }

    /// Whether every thread of it has exited (it may be a zombie still): its pidfd is
    /// readable then.
    pub fn exited(&self) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use std::os::fd::AsFd;
        let mut ready = [PollFd::new(self.pidfd.as_fd(), PollFlags::POLLIN)];
        matches!(poll(&mut ready, PollTimeout::ZERO), Ok(n) if n > 0)
    }
}

/// The user id of a `/proc/PID/status` text if its `Uid:` line (real, effective, saved, file
/// system) has that one four times; `None` for a process whose ids differ (a set-uid program)
/// or a text without the line. Unlike the owner of `/proc/PID`, which is root for a process
/// that made itself non-dumpable, these are the process's own.
fn only_uid(status: &str) -> Option<&str> {
    let mut ids = status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))?
        .split_whitespace();
    let first = ids.next()?;
    let mut count = 1;
    for id in ids {
        if id != first {
            return None;
        }
        count += 1;
    }
    (count == 4).then_some(first)
}

/// Whether process `pid` has ended: no such process, or only its zombie is left (an orphan's
/// zombie may wait long for a parent that never reaps it). A pid of 0 or less names none. The
/// main thread's zombie is not enough: the process's other threads outlive it while they
/// finish the system call they were in (a daemon's hole punch in a store the next one has
/// resumed, say), and the process has ended only once they are gone too.
pub fn process_exited(pid: i32) -> bool {
    if pid <= 0 {
        return true;
    }
    let ended = |stat: std::io::Result<String>| match stat {
        Ok(stat) => matches!(process_state(&stat), Some('Z' | 'X') | None),
        Err(_) => true,
    };
    if !ended(std::fs::read_to_string(format!("/proc/{pid}/stat"))) {
        return false;
    }
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    tasks.flatten().all(|task| {
        task.file_name().to_str() == Some(pid.to_string().as_str())
            || ended(std::fs::read_to_string(task.path().join("stat")))
    })
}

/// The state letter of a `/proc/PID/stat` (or `/proc/PID/task/TID/stat`) line: the field
/// after the command name, which is in parentheses and may itself hold spaces and parentheses.
pub fn process_state(stat: &str) -> Option<char> {
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Keep the OOM killer away from this process (`oom_score_adj` -1000).
pub fn protect_from_oom_killer() -> std::io::Result<()> {
    std::fs::write("/proc/self/oom_score_adj", "-1000")
}

/// A way to ask the kernel's OOM killer to kill a task now: `/proc/sysrq-trigger`, opened
/// here (under memory pressure, opening it then could wait in reclaim), written `f` on each
/// call. Writes to that file are allowed to root whatever `kernel.sysrq` says (it masks the
/// keyboard only); it is read-only under systemd's `ProtectKernelTunables=`.
pub fn oom_kill_trigger() -> std::io::Result<impl Fn() -> std::io::Result<()>> {
    use std::io::Write;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/sysrq-trigger")?;
    Ok(move || (&file).write_all(b"f"))
}

// swapon(2) flags, from `include/linux/swap.h`.
const SWAP_FLAG_PREFER: libc::c_int = 0x8000;
const SWAP_FLAG_PRIO_MASK: libc::c_int = 0x7fff;
const SWAP_FLAG_DISCARD: libc::c_int = 0x10000;

/// Enable `path` as swap with `priority` and discard (a ublk device gets no swap-slot-free
/// notification, so discard is how freed slots give their memory back). The system call
/// itself, because busybox's swapon has no priority option.
pub fn swapon(path: &std::ffi::CStr, priority: u16) -> std::io::Result<()> {
    let flags =
        SWAP_FLAG_PREFER | (libc::c_int::from(priority) & SWAP_FLAG_PRIO_MASK) | SWAP_FLAG_DISCARD;
    // SAFETY: `path` is NUL-terminated and outlives the call; the kernel only reads it.
    cvt(unsafe { libc::swapon(path.as_ptr(), flags) })
}

/// Total RAM from /proc/meminfo (`MemTotal`).
pub fn ram_bytes() -> std::io::Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")?;
    parse_mem_total(&text).ok_or_else(|| std::io::Error::other("/proc/meminfo has no MemTotal"))
}

/// The `MemTotal:  16318412 kB` line, in bytes.
pub fn parse_mem_total(meminfo: &str) -> Option<u64> {
    meminfo_bytes(meminfo, "MemTotal:")
}

/// The value of /proc/meminfo's line `key` (with its colon), in bytes.
fn meminfo_bytes(meminfo: &str, key: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with(key))?;
    let mut words = line[key.len()..].split_whitespace();
    let kib: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => kib.checked_mul(1024),
        _ => None,
    }
}

/// RAM in total and RAM available to programs without swapping (`MemTotal`, `MemAvailable`), in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryAvailable {
    pub total: u64,
    pub available: u64,
}

impl MemoryAvailable {
    pub fn parse(meminfo: &str) -> Option<Self> {
        Some(Self {
            total: meminfo_bytes(meminfo, "MemTotal:")?,
            available: meminfo_bytes(meminfo, "MemAvailable:")?,
        })
    }
}

/// A /proc file kept open and read again at offset 0 into the same buffer: a look costs no
/// allocation of ours, so a thread on the I/O path may take it under memory pressure.
struct ProcFile {
    file: std::fs::File,
    buf: Vec<u8>,
}

impl ProcFile {
    /// `path`, read into a buffer of `capacity` bytes: room for the whole file, which one
    /// read at offset 0 returns.
    fn open(path: &str, capacity: usize) -> std::io::Result<Self> {
        Ok(Self {
            file: std::fs::File::open(path)?,
            buf: vec![0; capacity],
        })
    }

    fn read(&mut self) -> std::io::Result<&str> {
        use std::os::unix::fs::FileExt;
        let n = self.file.read_at(&mut self.buf, 0)?;
        std::str::from_utf8(&self.buf[..n]).map_err(std::io::Error::other)
    }
}

/// /proc/meminfo (about 1.5 KiB), kept open (see `ProcFile`).
pub struct MeminfoReader(ProcFile);

impl MeminfoReader {
    pub fn open() -> std::io::Result<Self> {
        ProcFile::open("/proc/meminfo", 8192).map(Self)
    }

    pub fn read(&mut self) -> std::io::Result<MemoryAvailable> {
        MemoryAvailable::parse(self.0.read()?)
            .ok_or_else(|| std::io::Error::other("/proc/meminfo has no MemTotal or MemAvailable"))
    }
}

/// The kernel's count of OOM kills since boot (`oom_kill` in /proc/vmstat, about 5 KiB), kept
/// open (see `ProcFile`).
pub struct OomKillCount(ProcFile);

impl OomKillCount {
    pub fn open() -> std::io::Result<Self> {
        ProcFile::open("/proc/vmstat", 32 << 10).map(Self)
    }

    pub fn read(&mut self) -> std::io::Result<u64> {
        parse_oom_kills(self.0.read()?)
            .ok_or_else(|| std::io::Error::other("/proc/vmstat has no oom_kill"))
    }
}

/// The `oom_kill N` line of /proc/vmstat (Linux 4.13+).
fn parse_oom_kills(vmstat: &str) -> Option<u64> {
    vmstat
        .lines()
        .find_map(|line| line.strip_prefix("oom_kill "))?
        .trim()
        .parse()
        .ok()
}

/// `SIGKILL`'s bit in the signal masks of /proc/PID/status.
const SIGKILL_BIT: u64 = 1 << (libc::SIGKILL - 1);

/// The address range of a mapping's first line in a `/proc/PID/smaps` text
/// ("7f0000-7f2000 rw-p 00000000 00:00 0"); `None` for the lines of its fields.
pub fn smaps_mapping_range(line: &str) -> Option<std::ops::Range<u64>> {
    let (start, end) = line.split_once(' ')?.0.split_once('-')?;
    Some(u64::from_str_radix(start, 16).ok()?..u64::from_str_radix(end, 16).ok()?)
}

/// Whether a /proc/PID/status text says the process is being killed: SIGKILL pending, for
/// the process (`ShdPnd`, where the OOM killer sends it) or its thread (`SigPnd`, where the
/// kernel puts it on each thread as the signal is delivered), and not yet a zombie.
pub fn being_killed(status: &str) -> bool {
    let mut pending = false;
    for line in status.lines() {
        if let Some(state) = line.strip_prefix("State:") {
            if matches!(state.trim_start().chars().next(), Some('Z' | 'X')) {
                return false;
            }
        }
        let mask = line
            .strip_prefix("SigPnd:")
            .or_else(|| line.strip_prefix("ShdPnd:"));
        if let Some(mask) = mask.and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok()) {
            pending |= mask & SIGKILL_BIT != 0;
        }
    }
    pending
}

/// A process held by a pidfd (so a pid reused meanwhile names none of ours), whose memory can
/// be released once it is being killed.
pub struct HeldProcess {
    pidfd: std::os::fd::OwnedFd,
}

impl HeldProcess {
    /// `ESRCH` for no such process.
    pub fn open(pid: i32) -> std::io::Result<Self> {
        let process = rustix::process::Pid::from_raw(pid)
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ESRCH))?;
        let pidfd = rustix::process::pidfd_open(process, rustix::process::PidfdFlags::empty())?;
        Ok(Self { pidfd })
    }

    /// Free its memory now, if it is being killed, rather than as it exits: process_mrelease(2)
    /// (Linux 5.15+) does what the kernel's OOM reaper does 2 s after an OOM kill, unmapping
    /// the process's private memory (its pages in RAM and its swap slots). Allocates nothing
    /// of its own. `EINVAL` for a process that is not being killed, `ESRCH` for one whose
    /// memory is gone; `Ok` too for one whose memory was released already.
    pub fn release_memory_if_killed(&self) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        process_mrelease(self.pidfd.as_raw_fd())
    }
}

/// The numbers that name entries of directory `dir` after `prefix` (`tty` for `/dev/tty1`,
/// none for the pids in /proc), in the directory's order; none for a directory that cannot
/// be read.
pub fn numbered_entries<'a>(dir: &str, prefix: &'a str) -> impl Iterator<Item = u32> + 'a {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(move |entry| numbered_name(entry.file_name().to_str()?, prefix))
}

/// The number in `name` after `prefix` (`ublkb7` → 7 after `ublkb`): decimal digits only,
/// since `str::parse` alone takes `ublkb+7` as 7 too.
pub fn numbered_name(name: &str, prefix: &str) -> Option<u32> {
    let digits = name.strip_prefix(prefix)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The kernel's OOM badness score of process `pid` (/proc/PID/oom_score, 0 to 2000): the
/// OOM killer kills the process with the highest.
pub fn oom_score(pid: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/oom_score"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Whether process_mrelease(2) is there to call: the kernel has it (`ENOSYS` where not) and
/// no seccomp filter refuses it (a service manager's `SystemCallFilter=`: `EPERM`).
pub fn process_mrelease_available() -> std::io::Result<()> {
    match process_mrelease(-1) {
        Err(error) if error.raw_os_error() == Some(libc::EBADF) => Ok(()),
        other => other,
    }
}

fn process_mrelease(pidfd: libc::c_int) -> std::io::Result<()> {
    // SAFETY: process_mrelease(pidfd, flags) takes a descriptor and flags and no pointers;
    // a descriptor that is not a pidfd is refused with EBADF.
    let rc = unsafe { libc::syscall(libc::SYS_process_mrelease, pidfd, 0) };
    if rc == -1 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_throttle_passes_the_first_16_then_every_1024th() {
        let throttle = LogThrottle::default();
        let logged: Vec<u64> = (0..5000).filter_map(|_| throttle.note()).collect();
        let mut want: Vec<u64> = (1..=16).collect();
        want.extend([1024, 2048, 3072, 4096]);
        assert_eq!(logged, want);
    }

    #[test]
    fn a_numbered_name_is_its_prefix_and_decimal_digits() {
        assert_eq!(numbered_name("ublkb7", "ublkb"), Some(7));
        assert_eq!(numbered_name("ublkb007", "ublkb"), Some(7));
        assert_eq!(numbered_name("1234", ""), Some(1234));
        for name in [
            "ublkb",
            "ublkb+7",
            "ublkb-7",
            "ublkb 7",
            "ublkb7x",
            "ublkc7",
            "ublkb99999999999",
        ] {
            assert_eq!(numbered_name(name, "ublkb"), None, "{name}");
        }
    }

    #[test]
    fn the_oom_kill_count_is_read_from_vmstat() {
        assert_eq!(
            parse_oom_kills("pgfault 12\noom_kill 7\nnuma_hit 3\n"),
            Some(7)
        );
        assert_eq!(parse_oom_kills("oom_killer 1\n"), None);
        assert_eq!(parse_oom_kills(""), None);
        OomKillCount::open()
            .and_then(|mut count| count.read())
            .expect("this machine's /proc/vmstat has oom_kill");
    }

    #[test]
    fn a_process_is_being_killed_while_sigkill_is_pending_and_it_is_no_zombie() {
        let status = |state: &str, sig: &str, shd: &str| {
            format!("Name:\tx\nState:\t{state}\nSigPnd:\t{sig}\nShdPnd:\t{shd}\n")
        };
        let none = "0000000000000000";
        let kill = "0000000000000100";
        assert!(being_killed(&status("D (disk sleep)", none, kill)));
        assert!(being_killed(&status("R (running)", kill, none)));
        assert!(!being_killed(&status("S (sleeping)", none, none)));
        assert!(
            !being_killed(&status("S (sleeping)", "0000000000004000", none)),
            "SIGTERM pending is no kill"
        );
        assert!(!being_killed(&status("Z (zombie)", kill, kill)));
        let ours = std::fs::read_to_string("/proc/self/status").unwrap();
        assert!(!being_killed(&ours));
    }

    /// process_mrelease refuses a process that is not being killed, and one that has gone.
    /// Skipped where the call is missing (a kernel before 5.15) or refused (a container's
    /// seccomp profile), as the daemon then does without it.
    #[test]
    fn the_memory_of_a_live_process_is_not_released() {
        if let Err(error) = process_mrelease_available() {
            eprintln!("skipped: process_mrelease(2) unavailable here: {error}");
            return;
        }
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        assert!(oom_score(child.id()).is_some());
        let held = HeldProcess::open(pid).unwrap();
        let error = held.release_memory_if_killed().unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EINVAL), "{error}");
        child.kill().unwrap();
        child.wait().unwrap();
        let error = held.release_memory_if_killed().unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::ESRCH), "{error}");
        let error = HeldProcess::open(pid).err().unwrap();
        assert_eq!(error.raw_os_error(), Some(libc::ESRCH), "{error}");
        assert_eq!(oom_score(child.id()), None);
    }

    #[test]
    fn process_states_are_read_past_odd_command_names() {
        assert_eq!(process_state("42 (trueno-ublk) S 1 42 42"), Some('S'));
        assert_eq!(process_state("42 (a) b) Z 1 42"), Some('Z'));
        assert_eq!(process_state("garbage"), None);
        assert!(!process_exited(i32::try_from(std::process::id()).unwrap()));
        assert!(process_exited(0));
        assert!(process_exited(-1));
    }

    /// A process whose main thread has ended (a zombie) while another thread runs on has not
    /// exited; once that thread ends, it has. Needs python3 (for `pthread_exit` from the main
    /// thread); skipped without it.
    #[test]
    fn a_process_with_a_thread_left_has_not_exited() {
        let script = "import ctypes, os, sys, threading, time\n\
                      threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0))).start()\n\
                      ctypes.CDLL(None).pthread_exit(None)\n";
        let Ok(mut child) = std::process::Command::new("python3")
            .args(["-c", script])
            .stdin(std::process::Stdio::piped())
            .spawn()
        else {
            eprintln!("skipped: no python3");
            return;
        };
        let pid = i32::try_from(child.id()).unwrap();
        let leader_ended = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|stat| process_state(&stat) == Some('Z'))
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !leader_ended() {
            assert!(
                std::time::Instant::now() < deadline,
                "the main thread never ended"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!process_exited(pid), "a thread of it still runs");
        drop(child.stdin.take());
        child.wait().unwrap();
        assert!(process_exited(pid));
    }

    /// Real time while the guard lives (where this process may: CAP_SYS_NICE, as root), the
    /// normal scheduler and the same nice value after; a thread real-time already stays so.
    #[test]
    fn a_thread_is_real_time_while_the_guard_lives_and_as_it_was_after() {
        std::thread::spawn(|| {
            // SAFETY: sched_getscheduler takes no pointers; 0 is this thread.
            let policy = || unsafe { libc::sched_getscheduler(0) };
            let nice = || {
                let tid = libc::id_t::try_from(nix::unistd::gettid().as_raw()).unwrap();
                // SAFETY: as in `set_thread_nice`: no pointers, this thread's nice value.
                unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) }
            };
            set_thread_nice(5).unwrap();
            let permitted = make_thread_realtime(REALTIME_PRIORITY).is_ok();
            make_thread_normal().unwrap();
            assert_eq!((policy(), nice()), (libc::SCHED_OTHER, 5));
            {
                let _realtime = RealtimeWhile::enter(REALTIME_PRIORITY_ABOVE);
                let inside = if permitted {
                    libc::SCHED_FIFO
                } else {
                    libc::SCHED_OTHER
                };
                assert_eq!(policy(), inside);
            }
            assert_eq!((policy(), nice()), (libc::SCHED_OTHER, 5));
            if permitted {
                make_thread_realtime(REALTIME_PRIORITY).unwrap();
                drop(RealtimeWhile::enter(REALTIME_PRIORITY_ABOVE));
                assert_eq!(
                    policy(),
                    libc::SCHED_FIFO,
                    "real-time before, real-time after"
                );
                make_thread_normal().unwrap();
            } else {
                eprintln!("not permitted to run real-time here: only the fallback checked");
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_daemon_is_known_by_its_name_and_user() {
        // A set-uid program run by user 1000 is not root's.
        let status = "Name:\ttrueno-ublk\nUid:\t1000\t0\t0\t0\nGid:\t0\t0\t0\t0\n";
        assert_eq!(only_uid(status), None);
        assert_eq!(only_uid("Name:\tx\nUid:\t0\t0\t0\t0\n"), Some("0"));
        assert_eq!(only_uid("Name:\tx\nUid:\t0\t0\t0\n"), None);
        assert_eq!(only_uid("Name:\tx\n"), None);
        // The test binary is not called trueno-ublk; pid 1 is no daemon either.
        assert!(!same_program_alive(
            i32::try_from(std::process::id()).unwrap()
        ));
        assert!(!same_program_alive(1));
        // A thread named so is (its /proc/TID is read as a process's).
        let named = std::thread::spawn(|| {
            set_process_name(DAEMON_NAME).unwrap();
            same_program_alive(nix::unistd::gettid().as_raw())
        });
        assert!(named.join().unwrap());
    }

    #[test]
    fn a_daemon_held_by_its_pidfd_gets_signals_and_no_later_process_does() {
        // A copy of `sleep` called trueno-ublk: its comm is the daemon's name.
        let dir = std::env::temp_dir().join(format!("our-daemon-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let program = dir.join(DAEMON_NAME.to_str().unwrap());
        std::fs::copy("/bin/sleep", &program).unwrap();
        let mut child = std::process::Command::new(&program)
            .arg("60")
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let daemon = loop {
            // Until the child has exec'd (its comm is the parent's before).
            if let Some(daemon) = OurDaemon::find(pid) {
                break daemon;
            }
            assert!(std::time::Instant::now() < deadline, "never found");
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        assert!(!daemon.exited());
        daemon.signal(nix::sys::signal::Signal::SIGTERM).unwrap();
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGTERM)
        );
        assert!(daemon.exited());
        // Reaped: its pid may be anyone's now, and the pidfd reaches no one.
        assert_eq!(
            daemon.signal(nix::sys::signal::Signal::SIGTERM),
            Err(nix::errno::Errno::ESRCH)
        );
        assert!(OurDaemon::find(pid).is_none());
        // Not a daemon of ours: this test's own process.
        assert!(OurDaemon::find(i32::try_from(std::process::id()).unwrap()).is_none());
        assert!(OurDaemon::find(0).is_none() && OurDaemon::find(-1).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn available_memory_is_read_from_meminfo() {
        let text = "MemTotal:        1000 kB\nMemFree:  10 kB\nMemAvailable:     250 kB\n";
        assert_eq!(
            MemoryAvailable::parse(text),
            Some(MemoryAvailable {
                total: 1000 * 1024,
                available: 250 * 1024
            })
        );
        assert_eq!(MemoryAvailable::parse("MemTotal: 1000 kB\n"), None);
        let mut reader = MeminfoReader::open().unwrap();
        let first = reader.read().unwrap();
        let second = reader.read().unwrap();
        assert!(first.available <= first.total && second.total == first.total);
    }

    #[test]
    fn a_named_thread_shows_with_the_cpu_time_it_used() {
        let (done, wait) = std::sync::mpsc::channel::<()>();
        let (spent, told) = std::sync::mpsc::channel();
        let busy = std::thread::Builder::new()
            .name("os-test-busy".into())
            .spawn(move || {
                let start = thread_cpu_time();
                while thread_cpu_time() - start < std::time::Duration::from_millis(30) {}
                spent.send(thread_cpu_time()).unwrap();
                wait.recv().unwrap();
            })
            .unwrap();
        let used = told.recv().unwrap();
        let threads = thread_cpu_times().unwrap();
        done.send(()).unwrap();
        busy.join().unwrap();
        let seen = &threads
            .iter()
            .find(|thread| thread.name == "os-test-busy")
            .unwrap()
            .cpu;
        // schedstat and the thread's clock count the same run time, read at different moments.
        assert!(*seen >= std::time::Duration::from_millis(30), "{seen:?}");
        assert!(
            *seen <= used + std::time::Duration::from_millis(50),
            "{seen:?} {used:?}"
        );
        assert!(process_cpu_time() >= *seen);
    }

    #[test]
    fn cvt_turns_minus_one_into_errno() {
        // SAFETY: close(-1) touches nothing; it fails with EBADF.
        let error = cvt(unsafe { libc::close(-1) }).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EBADF));
        assert!(cvt(0).is_ok());
    }
}
