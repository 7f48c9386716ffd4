//! One device's life on the kernel side.
//!
//! A new device: ADD_DEV and SET_PARAMS (`Device::add`), then a thread per queue with every tag
//! fetched and START_DEV (`AddedDevice::start`). A device whose daemon died or handed it over:
//! queue threads made in advance (`Device::standby`), a wait until the kernel has quiesced it
//! (`Standby::wait_resumable`), START_USER_RECOVERY, the fetches, END_USER_RECOVERY
//! (`Standby::resume`). At the end, either STOP_DEV,
//! the queue threads joined and DEL_DEV (`Device::shutdown`), or the queue threads ended and
//! every file closed with the device left quiesced for the next daemon (`Device::hand_over`).
//!
//! What the 6.12 driver does when a daemon goes (`drivers/block/ublk_drv.c`): a queue thread's
//! exit (or its ring's release) cancels its commands (`ublk_uring_cmd_cancel_fn`), which
//! requeues the requests the daemon had taken (`ublk_abort_queue`, with
//! `UBLK_F_USER_RECOVERY_REISSUE`) and schedules `ublk_quiesce_work_fn`: the queue stops and
//! the state becomes QUIESCED. New I/O waits in the requeue list meanwhile, with no time limit.
//! START_USER_RECOVERY needs that state and the old `/dev/ublkcN` file released
//! (`ublk_ctrl_start_recovery`, EBUSY otherwise). Closing `/dev/ublkcN` itself does nothing
//! (`ublk_ch_release` only clears the open bit): the cancel of the commands is what quiesces.

#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::ctrl::Control;
use super::handler::BlockHandler;
use super::params::{device_params, survives_daemon, unservable, DeviceSpec};
use super::queue::{Queue, QueueParts, QueueSetup};
use super::sys::{self, CtrlDevInfo};
use super::timing::IoTiming;
use super::UblkError;

/// How long the char device may take to appear after ADD_DEV (devtmpfs or udev).
const CHAR_DEV_WAIT: Duration = Duration::from_secs(5);
/// How long a resume waits for the kernel to quiesce a device whose daemon has gone, for that
/// daemon's process to be gone entirely (it may still be closing its store after a hand-over),
/// and for its `/dev/ublkcN` to be released. Usually a few milliseconds (measured in the VM);
/// but when every tag was with the dead daemon (possible only where `IN_FLIGHT_SPARE` could
/// not be set), no command of it is left for the kernel to cancel, and only a request's
/// timeout (`ublk_timeout`) starts the quiesce: up to `REQUEST_TIMEOUT_MS` rounded up to a
/// whole second, or the block layer's 30 s default where that could not be set.
const QUIESCE_WAIT: Duration = Duration::from_secs(45);
/// The device's request timeout (`/sys/block/ublkbN/queue/io_timeout`), set for a device that
/// outlives its daemon. While its daemon lives, a request that takes longer only has its
/// timer restarted (`ublk_timeout`: `BLK_EH_RESET_TIMER`); once the daemon is dying, the
/// first timeout aborts the requests it held and quiesces the device. With `IN_FLIGHT_SPARE`
/// the kernel never has to wait for it; it stays as the fallback for a queue whose request
/// limit someone reset (a change of I/O scheduler does). The block layer rounds the timer up
/// to a whole second, so a shorter value would gain little.
pub const REQUEST_TIMEOUT_MS: u32 = 1000;
/// How many tags of each queue the block layer may never hand us at once
/// (`/sys/block/ublkbN/queue/nr_requests` = depth - this). A tag left with the kernel keeps a
/// FETCH command there, and when a daemon dies, io_uring cancels that command, which makes
/// the kernel abort (re-issue) the requests the daemon held and quiesce the device at once.
/// If the daemon held every tag, nothing would be cancelled, and only a request timeout
/// would start the quiesce: the worst pause in the VM was 1.39 s after a kill, against
/// 0.27 s typical. Costs one tag of the queue's depth.
const IN_FLIGHT_SPARE: u16 = 1;
/// How long a device that is live with a live daemon gets to show that the daemon is dying
/// (a `kill -9` a moment ago) before a resume calls it in use.
const LIVE_DAEMON_GRACE: Duration = Duration::from_secs(2);
/// How long a hand-over waits for the kernel to report the device quiesced.
const HAND_OVER_WAIT: Duration = Duration::from_secs(5);
/// Poll interval of those waits: short, since every waiting request pauses that long.
const POLL: Duration = Duration::from_millis(2);
/// START_USER_RECOVERY refused this many times in a row (a second of `POLL`s) is worth a
/// warning: the device is quiesced, and every task that reclaims memory waits with it.
const SLOW_RELEASE_TRIES: u32 = 500;

pub fn block_path(dev_id: u32) -> String {
    format!("/dev/ublkb{dev_id}")
}

pub fn char_path(dev_id: u32) -> String {
    format!("/dev/ublkc{dev_id}")
}

/// `/sys/class/ublk-char/ublkcN`: present from ADD_DEV until DEL_DEV (even a DEL_DEV that
/// still waits for the device's last user).
pub fn char_class_path(dev_id: u32) -> String {
    format!("/sys/class/ublk-char/ublkc{dev_id}")
}

/// Whether device `dev_id` exists (added, not deleted): its `char_class_path` is there.
pub fn device_exists(dev_id: u32) -> bool {
    std::path::Path::new(&char_class_path(dev_id)).exists()
}

/// A device added (ADD_DEV, SET_PARAMS) but not started: its id is known, no handler is
/// needed yet. Dropping it deletes the device.
pub struct AddedDevice {
    control: Option<Control>,
    info: CtrlDevInfo,
    size_bytes: u64,
}

impl AddedDevice {
    pub fn id(&self) -> u32 {
        self.info.dev_id
    }

    /// Whether the device outlives its daemon (the driver took `USER_RECOVERY` with
    /// `_REISSUE`): a daemon that dies leaves it quiesced, and a new one resumes it.
    pub fn survives_daemon(&self) -> bool {
        survives_daemon(self.info.flags)
    }

    /// Queue threads with every tag fetched, then START_DEV: returns once the block device is
    /// live. On failure the device is deleted.
    pub fn start(mut self, handler: Arc<dyn BlockHandler>) -> Result<Device, UblkError> {
        let wake = wake_pair()?;
        let control = self.control.take().ok_or(UblkError::QueueSetup(
            "the device was already started".into(),
        ))?;
        // From here on a failure must undo ADD_DEV: the device's `Drop` does it, since the
        // device has never been live and holds nothing worth keeping.
        let mut device = Device::new(control, self.info, self.size_bytes, false, wake);
        let go = device.spawn_queues(handler)?;
        let char_dev = Arc::new(open_char_dev(device.id())?);
        device.fetch_all(go, &char_dev)?;
        // Every FETCH_REQ of every queue has entered the kernel: START_DEV can complete.
        device.control.start_dev(device.id(), std::process::id())?;
        // Kept on drop only once nothing here can fail: a new device whose start failed
        // holds nothing, and is deleted.
        device.info = device.control.dev_info(device.id())?;
        device.keep_on_drop = device.survives_daemon();
        if device.survives_daemon() {
            tune_for_survival(device.id(), device.info.queue_depth);
        }
        Ok(device)
    }
}

impl Drop for AddedDevice {
    fn drop(&mut self) {
        let Some(control) = self.control.as_mut() else {
            return;
        };
        if let Err(error) = control.del_dev(self.info.dev_id) {
            tracing::error!(id = self.info.dev_id, %error, "deleting a device that never started failed");
        }
    }
}

/// A device another daemon serves (or served), and this process ready to take it over: its
/// queue threads made, with their rings and buffers, waiting. Nothing in the kernel has
/// changed. `wait_resumable` waits until the other daemon is gone and the kernel has
/// quiesced the device; `resume` then takes it over.
///
/// Why everything is made beforehand: while a device waits for a daemon, any task that
/// reclaims memory by swapping to it blocks (for a tag of the quiesced queue, in
/// `blk_mq_get_tag`), the new daemon included if it still has memory to fault in. A standby
/// made while the device was served resumes it with next to nothing left to allocate.
/// And a trap of the 6.12 driver: START_USER_RECOVERY forgets every queue, and until one queue
/// has fetched all its tags again, a second START_USER_RECOVERY fails with EINVAL
/// (`ublk_ctrl_start_recovery`: `!ub->nr_queues_ready`); a daemon that died in that window
/// would leave a device no daemon can resume (only DEL_DEV removes it). With two queues or
/// more it is worse: once one queue has fetched all its tags, the next START_USER_RECOVERY
/// passes that check and resets every queue, and a queue that had not fetched all of its own
/// has no daemon task for the driver to release (a NULL `put_task_struct`: a kernel oops with
/// the device's mutex held). Having the threads ready keeps that window to the fetches
/// themselves, and a queue's setup waits out a kernel short of memory (`Queue::fetch_all`)
/// rather than give up inside it.
pub struct Standby {
    // Declared first, so dropped first: queue threads still waiting for the char device see
    // their channel close and end before `device`'s drop joins them.
    go: Go,
    device: Device,
}

impl Standby {
    pub fn id(&self) -> u32 {
        self.device.id()
    }

    /// Ask the kernel for the device's state (GET_DEV_INFO), as a standby does now and then
    /// while it waits: the driver runs every control command on an io_uring worker thread
    /// (it refuses the inline, non-blocking try), and the worker exits after some idle
    /// seconds; kept busy, the worker is there when the takeover's commands come, and no
    /// thread is made (its kernel stack allocated) while the device waits. Also says whether
    /// the device still exists.
    pub fn ping(&mut self) -> Result<u16, UblkError> {
        let id = self.id();
        Ok(self.device.control.dev_info(id)?.state)
    }

    /// Wait until the device can be resumed by this process: it outlives its daemon, is
    /// `size_bytes` long, is quiesced, and the daemon that served it has exited (so nothing of
    /// that process still touches what it shared). Waits boundedly for a daemon that is dying
    /// or handing over; changes nothing in the kernel.
    pub fn wait_resumable(&mut self, size_bytes: u64) -> Result<(), UblkError> {
        let id = self.id();
        let control = &mut self.device.control;
        let started = Instant::now();
        loop {
            let info = match control.dev_info(id) {
                Err(UblkError::Command {
                    errno: libc::ENODEV,
                    ..
                }) => return Err(UblkError::NoSuchDevice(id)),
                other => other?,
            };
            // Gone also when its pid now names another program: after a stop with swap on,
            // the kernel keeps the old daemon's pid, which any process may get since; this
            // process too (a container restarted: a fresh pid namespace, the same pids).
            let old_daemon_gone = u32::try_from(info.ublksrv_pid)
                .is_ok_and(|pid| pid == std::process::id())
                || !crate::os::same_program_alive(info.ublksrv_pid);
            match info.state {
                sys::UBLK_S_DEV_DEAD => {
                    // Never started and stopped look the same (Linux 6.12 sets the pid to -1
                    // at ADD_DEV as at STOP_DEV).
                    let reason = if device_exists(id) {
                        format!(
                            "it is not started (its daemon ended before it served, or it was \
                             stopped): delete it (`trueno-ublk delete --id {id}`) and create it \
                             again"
                        )
                    } else {
                        format!(
                            "it was deleted but something still holds its old block device \
                             open (a swap area shown as `{} (deleted)` in /proc/swaps?); the \
                             id is free once that lets go",
                            block_path(id)
                        )
                    };
                    return Err(UblkError::CannotResume { id, reason });
                }
                sys::UBLK_S_DEV_LIVE
                    if !old_daemon_gone && started.elapsed() > LIVE_DAEMON_GRACE =>
                {
                    return Err(UblkError::IdInUse(id));
                }
                sys::UBLK_S_DEV_QUIESCED if old_daemon_gone => {
                    let device_bytes = control.device_bytes(id)?;
                    if device_bytes != size_bytes {
                        return Err(UblkError::CannotResume {
                            id,
                            reason: format!(
                                "it is {device_bytes} bytes and {size_bytes} were asked for; \
                                 resume it with its own size"
                            ),
                        });
                    }
                    // The queue threads were made for the device as the standby found it:
                    // one deleted and added again meanwhile, of other queues or depth, would
                    // leave the kernel waiting for tags no thread fetches.
                    let made = &self.device.info;
                    let shape = |i: &CtrlDevInfo| {
                        (i.nr_hw_queues, i.queue_depth, i.max_io_buf_bytes, i.flags)
                    };
                    if shape(&info) != shape(made) {
                        return Err(UblkError::CannotResume {
                            id,
                            reason: format!(
                                "it was made again while this daemon waited, with other \
                                 queues, depth or flags ({} queues of {}, flags {:#x}; this \
                                 standby was made for {} of {}, flags {:#x}); start a daemon \
                                 for it afresh",
                                info.nr_hw_queues,
                                info.queue_depth,
                                info.flags,
                                made.nr_hw_queues,
                                made.queue_depth,
                                made.flags
                            ),
                        });
                    }
                    self.device.info = info;
                    return Ok(());
                }
                _ if started.elapsed() > QUIESCE_WAIT => {
                    let state = state_name(info.state);
                    return Err(UblkError::CannotResume {
                        id,
                        reason: if old_daemon_gone {
                            format!(
                                "its daemon (pid {}) is gone but the kernel still reports it \
                                 {state} after {} s",
                                info.ublksrv_pid,
                                QUIESCE_WAIT.as_secs()
                            )
                        } else {
                            format!(
                                "its daemon (pid {}) is still running after {} s (state \
                                 {state})",
                                info.ublksrv_pid,
                                QUIESCE_WAIT.as_secs()
                            )
                        },
                    });
                }
                _ => std::thread::sleep(POLL),
            }
        }
    }

    /// START_USER_RECOVERY, every tag fetched, END_USER_RECOVERY: returns once the device is
    /// live again, served by this process's handler; the requests that waited are then on
    /// their way. Call after `wait_resumable`. On failure the device is left quiesced, never
    /// deleted.
    pub fn resume(self) -> Result<Device, UblkError> {
        let Standby { go, mut device } = self;
        let id = device.id();
        let started = Instant::now();
        let opened = device
            .start_user_recovery(started)
            .and_then(|busy_tries| Ok((busy_tries, open_char_dev(id)?)));
        let (busy_tries, char_dev) = match opened {
            Ok(opened) => opened,
            Err(error) => {
                // The queue threads wait for `go` before anything else, and `device`'s drop
                // joins them: `go` goes first (the destructuring above would drop it last).
                drop(go);
                return Err(error);
            }
        };
        let char_dev = Arc::new(char_dev);
        let recovery_started = Instant::now();
        device.fetch_all(go, &char_dev)?;
        let fetched = Instant::now();
        device.control.end_user_recovery(id, std::process::id())?;
        let ended = Instant::now();
        // Where a slow resume waited: for the kernel to let go of the old daemon, for the
        // queue threads to fetch every tag, or in END_USER_RECOVERY.
        tracing::info!(
            id,
            release_wait_ms = (recovery_started - started).as_millis(),
            busy_tries,
            fetch_ms = (fetched - recovery_started).as_millis(),
            end_ms = (ended - fetched).as_millis(),
            "resume: queues started"
        );
        device.info = device.control.dev_info(id)?;
        // Again, for a device that an older build started (only what differs is written: a
        // write of nr_requests freezes the queue, even with the value it has).
        tune_for_survival(id, device.info.queue_depth);
        Ok(device)
    }
}

/// A live device served by this process.
pub struct Device {
    control: Control,
    info: CtrlDevInfo,
    size_bytes: u64,
    stop: Arc<AtomicBool>,
    /// Written to wake every queue thread at once when `stop` is set; the other end is polled
    /// by each queue's ring.
    wake: UnixStream,
    wake_rx: Arc<UnixStream>,
    queues: Vec<JoinHandle<QueueExit>>,
    exited_tx: Sender<u16>,
    exited: Receiver<u16>,
    char_dev: Option<Arc<File>>,
    finished: bool,
    /// What an unexpected drop does: hand the device over (it has been live, or was resumed,
    /// and outlives its daemon: its data must stay) or stop and delete it.
    keep_on_drop: bool,
    timing: Arc<IoTiming>,
}

/// What a queue thread leaves when it ends: its queue, still open (dropped by whoever joins
/// the thread, after the thread has exited; see `Device::hand_over`), and how serving ended.
type QueueExit = (Option<Queue>, Result<(), UblkError>);

/// What a queue thread reports while it starts.
enum QueueReady {
    /// Ring and buffers made; waiting for the char device.
    Prepared,
    /// Every tag fetched.
    Fetched,
    Failed(String),
}

/// Tells the device that a queue thread ended, however it ends (a panic included): the daemon
/// watches for that, and a queue that ended unseen would leave it serving a device whose
/// requests nobody answers.
struct SaysExited {
    exited: Sender<u16>,
    q_id: u16,
}

impl Drop for SaysExited {
    fn drop(&mut self) {
        let _ = self.exited.send(self.q_id);
    }
}

/// Reports a queue thread's panic to whoever waits for the threads' start (`Go::wait_all`):
/// with two queues or more, the others hold their ends of the channel open (waiting for the
/// char device, or serving), so the thread's own end going does not end that wait.
struct ReportsPanic<'a>(&'a Sender<QueueReady>);

impl Drop for ReportsPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self
                .0
                .send(QueueReady::Failed("a queue thread panicked".into()));
        }
    }
}

/// Starts each queue thread's fetches: the char device, and a channel per thread for it.
struct Go {
    senders: Vec<Sender<Arc<File>>>,
    ready: Receiver<QueueReady>,
}

impl Device {
    /// ADD_DEV and SET_PARAMS: the device exists (its id is known, `/dev/ublkcN` appears) but
    /// serves nothing yet. On failure nothing is left behind in the kernel. `added` hears the
    /// id the moment ADD_DEV made it (before SET_PARAMS), for whoever must remove the device
    /// should this process be killed before it is live.
    pub fn add(spec: DeviceSpec, added: impl FnOnce(u32)) -> Result<AddedDevice, UblkError> {
        spec.validate()?;
        let mut control = Control::open()?;
        let features = control.features();
        tracing::info!(
            features = format_args!("{features:#x}"),
            names = %sys::feature_names(features),
            "ublk driver features"
        );
        let mut info = spec.dev_info(features);
        match (control.add_dev(&mut info), spec.id) {
            (Ok(()), _) => {}
            (
                Err(UblkError::Command {
                    errno: libc::EEXIST,
                    ..
                }),
                Some(id),
            ) => {
                // A deleted device keeps its id while its disk is held open; it has no char
                // device any more.
                let deleted = !device_exists(id)
                    && control
                        .dev_info(id)
                        .is_ok_and(|info| info.state == sys::UBLK_S_DEV_DEAD);
                return Err(if deleted {
                    UblkError::IdHeld(id)
                } else {
                    UblkError::IdInUse(id)
                });
            }
            (Err(error), _) => return Err(error),
        }
        added(info.dev_id);
        let mut added = AddedDevice {
            control: Some(control),
            info,
            size_bytes: spec.size_bytes,
        };
        // A refusal drops `added`, which deletes the device.
        spec.check_tag_buffers(&added.info)?;
        let id = added.id();
        let params = device_params(spec.size_bytes, added.info.max_io_buf_bytes);
        if let Some(control) = added.control.as_mut() {
            // A failure here drops `added`, which deletes the device.
            control.set_params(id, &params)?;
        }
        Ok(added)
    }

    /// A standby for device `id`, which exists (served by another daemon, or left quiesced by
    /// one): queue threads made for its queues and depth, waiting; `handler` serves its
    /// requests once it is resumed. Changes nothing in the kernel.
    pub fn standby(id: u32, handler: Arc<dyn BlockHandler>) -> Result<Standby, UblkError> {
        let wake = wake_pair()?;
        let mut control = Control::open()?;
        let info = match control.dev_info(id) {
            Err(UblkError::Command {
                errno: libc::ENODEV,
                ..
            }) => return Err(UblkError::NoSuchDevice(id)),
            other => other?,
        };
        if !survives_daemon(info.flags) {
            return Err(
                if info.state == sys::UBLK_S_DEV_LIVE
                    && !crate::os::process_exited(info.ublksrv_pid)
                {
                    UblkError::IdInUse(id)
                } else {
                    UblkError::CannotResume {
                        id,
                        reason: "it was made without user recovery (by an older trueno-ublk, or \
                             on a kernel without it), so no other daemon can serve it"
                            .into(),
                    }
                },
            );
        }
        let params = control.params(id)?;
        if let Some(why) = unservable(info.flags, params.basic.logical_bs_shift) {
            return Err(UblkError::CannotResume {
                id,
                reason: format!("it is not a device this daemon can serve: {why}"),
            });
        }
        let size_bytes = params.basic.dev_sectors << 9;
        let mut device = Device::new(control, info, size_bytes, true, wake);
        let go = device.spawn_queues(handler)?;
        Ok(Standby { go, device })
    }

    /// Serve device `id` (of `size_bytes`) again with `handler`, taking over from a daemon
    /// that died or handed it over: `standby`, `wait_resumable` and `resume` in one.
    pub fn recover(
        id: u32,
        size_bytes: u64,
        handler: Arc<dyn BlockHandler>,
    ) -> Result<Self, UblkError> {
        let mut standby = Self::standby(id, handler)?;
        standby.wait_resumable(size_bytes)?;
        standby.resume()
    }

    fn new(
        control: Control,
        info: CtrlDevInfo,
        size_bytes: u64,
        keep_on_drop: bool,
        (wake, wake_rx): (UnixStream, UnixStream),
    ) -> Self {
        let (exited_tx, exited) = crossbeam_channel::unbounded();
        Self {
            control,
            info,
            size_bytes,
            stop: Arc::new(AtomicBool::new(false)),
            wake,
            wake_rx: Arc::new(wake_rx),
            queues: Vec::new(),
            exited_tx,
            exited,
            char_dev: None,
            finished: false,
            keep_on_drop,
            timing: Arc::default(),
        }
    }

    /// A thread per queue, each with its ring and buffers made, waiting for the char device.
    fn spawn_queues(&mut self, handler: Arc<dyn BlockHandler>) -> Result<Go, UblkError> {
        let id = self.info.dev_id;
        let queues = self.info.nr_hw_queues;
        let (ready_tx, ready) = crossbeam_channel::bounded(2 * usize::from(queues));
        let ioctl_encode = self.info.flags & sys::UBLK_F_CMD_IOCTL_ENCODE != 0;
        let mut senders = Vec::with_capacity(usize::from(queues));
        for q_id in 0..queues {
            let setup = QueueSetup {
                q_id,
                depth: self.info.queue_depth,
                max_io_bytes: self.info.max_io_buf_bytes,
                dev_bytes: self.size_bytes,
                ioctl_encode,
                user_copy: self.user_copy(),
            };
            let (go_tx, go_rx) = crossbeam_channel::bounded::<Arc<File>>(1);
            let (handler, stop, wake) = (handler.clone(), self.stop.clone(), self.wake_rx.clone());
            let timing = self.timing.clone();
            let (ready_tx, exited) = (ready_tx.clone(), self.exited_tx.clone());
            let thread = std::thread::Builder::new()
                .name(format!("ublk{id}-q{q_id}"))
                .stack_size(crate::mem::IO_THREAD_STACK_BYTES)
                .spawn(move || {
                    let _exited = SaysExited { exited, q_id };
                    run_queue(setup, &handler, &stop, &timing, wake, &go_rx, &ready_tx)
                })
                .map_err(|source| UblkError::Io {
                    what: "starting a queue thread",
                    source,
                })?;
            self.queues.push(thread);
            senders.push(go_tx);
        }
        // Only the threads' clones from here on: with one queue, a thread that ends before it
        // reports then ends the wait below (with more, see `ReportsPanic`).
        drop(ready_tx);
        let go = Go { senders, ready };
        go.wait_all(queues, |r| matches!(r, QueueReady::Prepared))?;
        Ok(go)
    }

    /// START_USER_RECOVERY, retried while the kernel still holds the old daemon's char device
    /// (EBUSY until the last of its io_uring commands is gone) for up to `QUIESCE_WAIT` from
    /// `started`; the tries that found it busy.
    fn start_user_recovery(&mut self, started: Instant) -> Result<u32, UblkError> {
        let id = self.id();
        let deadline = started + QUIESCE_WAIT;
        let mut busy_tries = 0u32;
        loop {
            match self.control.start_user_recovery(id) {
                Ok(()) => return Ok(busy_tries),
                Err(UblkError::Command {
                    errno: libc::EBUSY, ..
                }) => {
                    // Busy also when the device is no longer quiesced (stopped by a `delete
                    // --lose-pages`, or live under another resumer): no wait mends that.
                    let state = self.control.dev_info(id)?.state;
                    if state != sys::UBLK_S_DEV_QUIESCED {
                        return Err(UblkError::CannotResume {
                            id,
                            reason: format!(
                                "it is {}, no longer quiesced, so there is nothing to resume \
                                 (START_USER_RECOVERY: busy); check `trueno-ublk list`",
                                state_name(state)
                            ),
                        });
                    }
                    if Instant::now() >= deadline {
                        return Err(UblkError::CannotResume {
                            id,
                            reason: format!(
                                "the kernel still holds its old daemon's {} after {} s \
                                 (START_USER_RECOVERY: busy); check `trueno-ublk list` and retry",
                                char_path(id),
                                QUIESCE_WAIT.as_secs()
                            ),
                        });
                    }
                    busy_tries += 1;
                    if busy_tries == SLOW_RELEASE_TRIES {
                        tracing::warn!(
                            id,
                            waited_ms = started.elapsed().as_millis(),
                            "the kernel has not yet released the old daemon's {}: the device stays quiesced until it does",
                            char_path(id)
                        );
                    }
                    std::thread::sleep(POLL);
                }
                Err(UblkError::Command {
                    errno: libc::EINVAL,
                    ..
                }) => {
                    return Err(UblkError::CannotResume {
                        id,
                        reason: format!(
                            "the kernel refuses to start a recovery (START_USER_RECOVERY: \
                             invalid argument): a daemon died while resuming it, before its \
                             queues were ready, and this kernel cannot resume it after that; \
                             `trueno-ublk delete --id {id} --lose-pages` removes it"
                        ),
                    })
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Hand every queue thread the char device and wait until all have fetched their tags.
    fn fetch_all(&mut self, go: Go, char_dev: &Arc<File>) -> Result<(), UblkError> {
        self.char_dev = Some(char_dev.clone());
        for sender in &go.senders {
            sender
                .send(char_dev.clone())
                .map_err(|_| UblkError::QueueSetup("a queue thread died during setup".into()))?;
        }
        go.wait_all(self.info.nr_hw_queues, |r| matches!(r, QueueReady::Fetched))
    }

    pub fn id(&self) -> u32 {
        self.info.dev_id
    }

    pub fn info(&self) -> &CtrlDevInfo {
        &self.info
    }

    /// Whether request data moves by pread/pwrite on the char device (`UBLK_F_USER_COPY`)
    /// rather than through a buffer per tag: fixed when the device was added.
    pub fn user_copy(&self) -> bool {
        self.info.flags & sys::UBLK_F_USER_COPY != 0
    }

    /// Whether the device outlives this daemon (see `AddedDevice::survives_daemon`): then
    /// `hand_over` leaves it to the next daemon.
    pub fn survives_daemon(&self) -> bool {
        survives_daemon(self.info.flags)
    }

    /// Where requests' time went so far (every queue).
    pub fn timing(&self) -> Arc<IoTiming> {
        self.timing.clone()
    }

    /// Receives a queue id whenever a queue thread ends (the device was stopped by someone
    /// else, or a queue failed): the daemon then shuts down.
    pub fn queue_exits(&self) -> &Receiver<u16> {
        &self.exited
    }

    /// STOP_DEV, join the queue threads, DEL_DEV.
    pub fn shutdown(self) -> Result<(), UblkError> {
        self.shutdown_holding(None)
    }

    /// `shutdown`, holding `claim` (the block device opened with `O_EXCL`, see
    /// `crate::blockdev`) until the device is stopped: no swapon or mount can take the device
    /// between the caller's finding it unused and STOP_DEV, which would fail their I/O.
    pub fn shutdown_holding(mut self, claim: Option<File>) -> Result<(), UblkError> {
        self.finished = true;
        self.delete(claim)
    }

    /// Stop serving without stopping the device: the queue threads end (the kernel cancels
    /// their commands as each exits, requeues the requests this daemon had taken, and
    /// quiesces the device), then their rings and `/dev/ublkcN` are closed. Returns once the
    /// kernel reports the device quiesced: I/O waits from here on, with no time limit, until
    /// the next daemon resumes it. Only for a device that `survives_daemon`; otherwise the
    /// kernel would stop it and fail its I/O, so this refuses.
    ///
    /// Why the threads end before the rings close: a request the kernel hands to a queue
    /// thread at the last moment completes to the thread only while the thread is alive;
    /// once it is exiting, the driver requeues such a request instead
    /// (`__ublk_rq_task_work`). Closing a ring while its thread lives could leave one
    /// request taken by nobody, and the quiesce would wait for it forever.
    pub fn hand_over(mut self) -> Result<(), UblkError> {
        self.finished = true;
        if !self.survives_daemon() {
            return Err(UblkError::HandOver(format!(
                "device {} was made without user recovery: it cannot outlive this daemon",
                self.id()
            )));
        }
        self.end_queues()?;
        let id = self.id();
        let deadline = Instant::now() + HAND_OVER_WAIT;
        loop {
            let info = self.control.dev_info(id)?;
            if info.state == sys::UBLK_S_DEV_QUIESCED {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(UblkError::HandOver(format!(
                    "device {id} is still {} {} s after its queues ended; the next daemon \
                     waits for the kernel to quiesce it",
                    state_name(info.state),
                    HAND_OVER_WAIT.as_secs()
                )));
            }
            std::thread::sleep(POLL);
        }
    }

    /// Set the stop flag, wake the queue threads, join them, then drop what they left (rings
    /// close after their threads exited) and our char device handle.
    fn end_queues(&mut self) -> Result<(), UblkError> {
        self.stop.store(true, Ordering::Release);
        // One byte wakes every queue's poll (level-triggered); ignore a full or closed socket:
        // the loop also looks at the flag once a second.
        let _ = (&self.wake).write(&[1]);
        let mut queue_error = None;
        let mut left = Vec::with_capacity(self.queues.len());
        for thread in self.queues.drain(..) {
            match thread.join() {
                Ok((queue, result)) => {
                    left.push(queue);
                    if let Err(error) = result {
                        queue_error = Some(error);
                    }
                }
                Err(_) => {
                    queue_error = Some(UblkError::QueueSetup("a queue thread panicked".into()))
                }
            }
        }
        drop(left);
        self.char_dev = None;
        queue_error.map_or(Ok(()), Err)
    }

    fn delete(&mut self, claim: Option<File>) -> Result<(), UblkError> {
        let id = self.info.dev_id;
        let stopped = match self.control.stop_dev(id) {
            // Already stopped, e.g. by `trueno-ublk delete` from another process.
            Err(UblkError::Command {
                errno: libc::ENODEV,
                ..
            }) => Ok(()),
            other => other,
        };
        // Stopped: the disk is gone, and DEL_DEV waits for its last opener.
        drop(claim);
        let queues = self.end_queues();
        // Bounded: DEL_DEV would wait for the stopped disk's last opener (a process that
        // keeps it open without a claim), and the daemon with it, its store's locked memory
        // never freed. Stopped, the disk sends us nothing more, so the store can go. Waited
        // for a while all the same, so that a `create` of the id right after this process
        // exits finds it free, as after DEL_DEV.
        let deleted = self.control.del_dev_bounded(id);
        stopped.and(deleted)?;
        // Deleted: what is left to do (the caller frees the device's memory) does not depend
        // on how the queues ended, so a queue's failure is only told.
        if let Err(error) = queues {
            tracing::warn!(id, %error, "a queue failed before the device was deleted");
        }
        Ok(())
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let id = self.info.dev_id;
        if self.keep_on_drop {
            // Its pages may be someone's swap: leave it quiesced for the next daemon.
            if let Err(error) = self.end_queues() {
                tracing::error!(id, %error, "ending the queues of a device left to the next daemon failed");
            }
        } else if let Err(error) = self.delete(None) {
            tracing::error!(id, %error, "tearing the device down failed");
        }
    }
}

/// One queue thread's life: make the ring and buffers, wait for the char device, fetch every
/// tag, serve until stopped. Returns the queue still open (see `QueueExit`).
fn run_queue(
    setup: QueueSetup,
    handler: &Arc<dyn BlockHandler>,
    stop: &AtomicBool,
    timing: &IoTiming,
    wake: Arc<UnixStream>,
    go: &Receiver<Arc<File>>,
    ready: &Sender<QueueReady>,
) -> QueueExit {
    let _reports_panic = ReportsPanic(ready);
    // The handler readies the heap, for what its `handle` keeps there.
    crate::mem::prefault_stack();
    handler.prepare_thread();
    let parts = match QueueParts::prepare(setup) {
        Ok(parts) => parts,
        Err(error) => {
            let _ = ready.send(QueueReady::Failed(error.to_string()));
            return (None, Ok(()));
        }
    };
    let _ = ready.send(QueueReady::Prepared);
    // The device gave up before the fetches (its channel closed): nothing to serve.
    let Ok(char_dev) = go.recv() else {
        return (None, Ok(()));
    };
    // Real-time while it fetches, as the thread that resumes a device is: until every tag is
    // fetched the device waits (for a resume, quiesced, with RAM at the watermark), and the
    // kernel lets a real-time task allocate below the min watermark what the fetch still
    // needs (the descriptors' mapping, the commands' data).
    let fetched = {
        let _realtime = crate::os::RealtimeWhile::enter(crate::os::REALTIME_PRIORITY);
        Queue::fetch_all(parts, char_dev, wake)
    };
    match fetched {
        Ok(mut queue) => {
            let _ = ready.send(QueueReady::Fetched);
            let result = queue.serve(handler, stop, timing);
            (Some(queue), result)
        }
        Err(error) => {
            let _ = ready.send(QueueReady::Failed(error.to_string()));
            (None, Ok(()))
        }
    }
}

impl Go {
    /// Wait for one report matching `want` from each of `queues` threads.
    fn wait_all(&self, queues: u16, want: impl Fn(&QueueReady) -> bool) -> Result<(), UblkError> {
        for _ in 0..queues {
            match self.ready.recv() {
                Ok(QueueReady::Failed(message)) => return Err(UblkError::QueueSetup(message)),
                Ok(report) if want(&report) => {}
                Ok(_) => {
                    return Err(UblkError::QueueSetup(
                        "a queue thread reported out of order".into(),
                    ))
                }
                Err(_) => {
                    return Err(UblkError::QueueSetup(
                        "a queue thread died during setup".into(),
                    ))
                }
            }
        }
        Ok(())
    }
}

/// Tune a device that outlives its daemon so that a death is noticed at once: the request
/// limit to `IN_FLIGHT_SPARE` below the depth and the request timeout to
/// `REQUEST_TIMEOUT_MS` (see there). A sandbox with a read-only /sys (systemd's
/// ProtectKernelTunables=) leaves both to the service manager (trueno-ublk@.service's
/// ExecStartPost=+...).
fn tune_for_survival(id: u32, depth: u16) {
    let limit = depth.saturating_sub(IN_FLIGHT_SPARE);
    // The block layer takes no limit below BLKDEV_MIN_RQ (4); such a shallow queue keeps
    // only the timeout.
    if limit >= 4 {
        write_queue_knob(id, "nr_requests", limit, "a daemon that dies holding every request leaves the device live for up to 2 s (the request timeout) before the next one can resume it");
    }
    write_queue_knob(id, "io_timeout", REQUEST_TIMEOUT_MS, "a daemon that dies holding every request leaves the device live for up to 30 s before the next one can resume it");
}

fn write_queue_knob(id: u32, name: &str, value: impl std::fmt::Display, without_it: &str) {
    let knob = format!("/sys/block/ublkb{id}/queue/{name}");
    let value = value.to_string();
    if std::fs::read_to_string(&knob).is_ok_and(|now| now.trim() == value) {
        return;
    }
    match std::fs::write(&knob, value) {
        Ok(()) => {}
        Err(error) if error.raw_os_error() == Some(libc::EROFS) => {
            tracing::info!(
                knob,
                "read-only /sys here: this queue setting is left to the service manager"
            );
        }
        Err(error) => {
            tracing::warn!(%error, knob, "could not tune the queue: {without_it}");
        }
    }
}

/// The queues' wake-up socket: `Device` writes one end, every queue's ring polls the other.
fn wake_pair() -> Result<(UnixStream, UnixStream), UblkError> {
    UnixStream::pair().map_err(|source| UblkError::Io {
        what: "making the queues' wake-up socket",
        source,
    })
}

fn open_char_dev(dev_id: u32) -> Result<File, UblkError> {
    let path = char_path(dev_id);
    let deadline = Instant::now() + CHAR_DEV_WAIT;
    loop {
        match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) => return Ok(file),
            Err(error)
                if error.kind() == std::io::ErrorKind::NotFound && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(source) => {
                return Err(UblkError::Io {
                    what: "opening the ublk char device",
                    source,
                })
            }
        }
    }
}

/// State of a device as `list` shows it.
pub fn state_name(state: u16) -> &'static str {
    match state {
        sys::UBLK_S_DEV_DEAD => "dead",
        sys::UBLK_S_DEV_LIVE => "live",
        sys::UBLK_S_DEV_QUIESCED => "quiesced",
        _ => "unknown",
    }
}
