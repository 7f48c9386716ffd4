//! One device's life on the kernel side: ADD_DEV, SET_PARAMS, a thread per queue with every
//! tag fetched, START_DEV; and at the end STOP_DEV, the queue threads joined, DEL_DEV.

#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::ctrl::Control;
use super::params::{device_params, DeviceSpec};
use super::queue::{BlockHandler, Queue, QueueSetup};
use super::sys::{self, CtrlDevInfo};
use super::timing::IoTiming;
use super::UblkError;

/// How long the char device may take to appear after ADD_DEV (devtmpfs or udev).
const CHAR_DEV_WAIT: Duration = Duration::from_secs(5);

pub fn block_path(dev_id: u32) -> String {
    format!("/dev/ublkb{dev_id}")
}

pub fn char_path(dev_id: u32) -> String {
    format!("/dev/ublkc{dev_id}")
}

/// A live device served by this process.
pub struct Device {
    control: Control,
    info: CtrlDevInfo,
    size_bytes: u64,
    stop: Arc<AtomicBool>,
    queues: Vec<JoinHandle<Result<(), UblkError>>>,
    exited: Receiver<u16>,
    char_dev: Option<Arc<File>>,
    deleted: bool,
    timing: Arc<IoTiming>,
}

impl Device {
    /// Create, configure and start a device whose requests `handler` serves. Returns once
    /// the block device is live. On failure nothing is left behind in the kernel.
    pub fn create(spec: DeviceSpec, handler: Arc<dyn BlockHandler>) -> Result<Self, UblkError> {
        spec.validate()?;
        let mut control = Control::open()?;
        let features = control.features();
        tracing::info!(
            features = format_args!("{features:#x}"),
            "ublk driver features"
        );
        let mut info = spec.dev_info(features);
        control
            .add_dev(&mut info)
            .map_err(|error| match (error, spec.id) {
                (
                    UblkError::Command {
                        errno: libc::EEXIST,
                        ..
                    },
                    Some(id),
                ) => UblkError::IdInUse(id),
                (error, _) => error,
            })?;
        let (exited_tx, exited) = crossbeam_channel::unbounded();
        let mut device = Self {
            control,
            info,
            size_bytes: spec.size_bytes,
            stop: Arc::new(AtomicBool::new(false)),
            queues: Vec::new(),
            exited,
            char_dev: None,
            deleted: false,
            timing: Arc::default(),
        };
        // From here on a failure must undo ADD_DEV: `Drop` does it.
        device.configure_and_start(handler, exited_tx)?;
        Ok(device)
    }

    fn configure_and_start(
        &mut self,
        handler: Arc<dyn BlockHandler>,
        exited: Sender<u16>,
    ) -> Result<(), UblkError> {
        let id = self.info.dev_id;
        self.control.set_params(
            id,
            &device_params(self.size_bytes, self.info.max_io_buf_bytes),
        )?;
        let char_dev = Arc::new(open_char_dev(id)?);
        self.char_dev = Some(char_dev.clone());
        let (ready_tx, ready_rx) = crossbeam_channel::bounded(self.info.nr_hw_queues as usize);
        let ioctl_encode = self.info.flags & sys::UBLK_F_CMD_IOCTL_ENCODE != 0;
        for q_id in 0..self.info.nr_hw_queues {
            let setup = QueueSetup {
                dev_id: id,
                q_id,
                depth: self.info.queue_depth,
                max_io_bytes: self.info.max_io_buf_bytes,
                dev_bytes: self.size_bytes,
                ioctl_encode,
            };
            let (char_dev, handler, stop) = (char_dev.clone(), handler.clone(), self.stop.clone());
            let timing = self.timing.clone();
            let (ready_tx, exited) = (ready_tx.clone(), exited.clone());
            let thread = std::thread::Builder::new()
                .name(format!("ublk{id}-q{q_id}"))
                .stack_size(crate::mem::IO_THREAD_STACK_BYTES)
                .spawn(move || {
                    crate::mem::prepare_io_thread();
                    handler.prepare_thread();
                    let result = match Queue::fetch_all(setup, &char_dev) {
                        Ok(queue) => {
                            let _ = ready_tx.send(Ok(()));
                            queue.serve(handler.as_ref(), &stop, &timing)
                        }
                        Err(error) => {
                            let _ = ready_tx.send(Err(error.to_string()));
                            Ok(())
                        }
                    };
                    let _ = exited.send(q_id);
                    result
                })
                .map_err(|source| UblkError::Io {
                    what: "starting a queue thread",
                    source,
                })?;
            self.queues.push(thread);
        }
        drop(ready_tx);
        for _ in 0..self.info.nr_hw_queues {
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(message)) => return Err(UblkError::QueueSetup(message)),
                Err(_) => {
                    return Err(UblkError::QueueSetup(
                        "a queue thread died during setup".into(),
                    ))
                }
            }
        }
        // Every FETCH_REQ of every queue has entered the kernel: START_DEV can complete.
        self.control.start_dev(id, std::process::id())?;
        self.info = self.control.dev_info(id)?;
        Ok(())
    }

    pub fn id(&self) -> u32 {
        self.info.dev_id
    }

    pub fn info(&self) -> &CtrlDevInfo {
        &self.info
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Receives a queue id whenever a queue thread ends (the device was stopped by someone
    /// else, or a queue failed): the daemon then shuts down.
    /// Where requests' time went so far (every queue).
    pub fn timing(&self) -> Arc<IoTiming> {
        self.timing.clone()
    }

    pub fn queue_exits(&self) -> &Receiver<u16> {
        &self.exited
    }

    /// STOP_DEV, join the queue threads, DEL_DEV.
    pub fn shutdown(mut self) -> Result<(), UblkError> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<(), UblkError> {
        if self.deleted {
            return Ok(());
        }
        self.deleted = true;
        let id = self.info.dev_id;
        let stopped = match self.control.stop_dev(id) {
            // Already stopped, e.g. by `trueno-ublk delete` from another process.
            Err(UblkError::Command {
                errno: libc::ENODEV,
                ..
            }) => Ok(()),
            other => other,
        };
        self.stop.store(true, Ordering::Release);
        let mut queue_error = None;
        for thread in self.queues.drain(..) {
            match thread.join() {
                Ok(Ok(())) => {}
                Ok(Err(error)) => queue_error = Some(error),
                Err(_) => {
                    queue_error = Some(UblkError::QueueSetup("a queue thread panicked".into()))
                }
            }
        }
        // DEL_DEV waits for the char device to be closed: drop our handle first.
        self.char_dev = None;
        let deleted = match self.control.del_dev(id) {
            Err(UblkError::Command {
                errno: libc::ENODEV,
                ..
            }) => Ok(()),
            other => other,
        };
        stopped.and(deleted)?;
        queue_error.map_or(Ok(()), Err)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if let Err(error) = self.teardown() {
            tracing::error!(id = self.info.dev_id, %error, "tearing the device down failed");
        }
    }
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
