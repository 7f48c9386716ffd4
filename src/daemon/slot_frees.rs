//! The serving process's watch on freed swap slots (see `crate::slotfree`): the probe,
//! attached once the device is live, and a thread that frees the reported slots' pages as
//! they come. The queue threads apply them too, before serving writes (`StoreHandler`).

#![forbid(unsafe_code)]

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::thread::JoinHandle;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use super::handler::StoreHandler;
use crate::slotfree::SlotFreeProbe;

/// The attached probe and its thread; dropping it stops the thread and detaches the probe.
pub(super) struct SlotFreeWatch {
    probe: Arc<SlotFreeProbe>,
    /// Written to (or closed) to stop the thread.
    stop: Option<OwnedFd>,
    thread: Option<JoinHandle<()>>,
}

impl SlotFreeWatch {
    /// Attach the probe for `/dev/ublkb{id}` and start its thread; `Err` says why not (the
    /// store then hears of freed slots only through discards).
    pub(super) fn start(id: u32, handler: &Arc<StoreHandler>) -> Result<Self, String> {
        let (major, minor) = block_device_number(id)?;
        let probe =
            Arc::new(SlotFreeProbe::attach(major, minor).map_err(|error| error.to_string())?);
        handler.set_slot_frees(probe.clone());
        let (stop_read, stop_write) =
            nix::unistd::pipe().map_err(|error| format!("making the stop pipe: {error}"))?;
        let (thread_probe, thread_handler) = (probe.clone(), handler.clone());
        let thread = std::thread::Builder::new()
            .name("slot-frees".into())
            .stack_size(crate::mem::IO_THREAD_STACK_BYTES)
            .spawn(move || watch(&thread_probe, &thread_handler, &stop_read))
            .map_err(|error| format!("starting its thread: {error}"))?;
        Ok(Self {
            probe,
            stop: Some(stop_write),
            thread: Some(thread),
        })
    }

    pub(super) fn probe(&self) -> Arc<SlotFreeProbe> {
        self.probe.clone()
    }
}

impl Drop for SlotFreeWatch {
    fn drop(&mut self) {
        // Closing the pipe's write end makes its read end readable (end of file).
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The thread: free what the probe reports, as it comes, until `stop` is readable. It holds the
/// drain's lock while it frees, and the queue threads may wait for that lock, so it is made an
/// I/O thread first (its stack and heap faulted in, an I/O flusher at the queue threads'
/// priority): it must never wait on reclaim while holding it.
fn watch(probe: &SlotFreeProbe, handler: &StoreHandler, stop: &OwnedFd) {
    super::harden::ready_io_thread();
    loop {
        let mut fds = [
            PollFd::new(probe.ring_fd(), PollFlags::POLLIN),
            PollFd::new(stop.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(error) => {
                tracing::warn!(%error, "slot-free probe: poll failed; freed slots now come back only through discards and requests");
                return;
            }
        }
        if fds[1].any().unwrap_or(true) {
            return;
        }
        handler.apply_slot_frees();
    }
}

/// `major:minor` of `/dev/ublkb{id}`, from sysfs.
fn block_device_number(id: u32) -> Result<(u32, u32), String> {
    let path = format!("/sys/block/ublkb{id}/dev");
    let text = std::fs::read_to_string(&path).map_err(|error| format!("{path}: {error}"))?;
    let (major, minor) = text
        .trim()
        .split_once(':')
        .ok_or_else(|| format!("{path}: not major:minor"))?;
    let number = |s: &str| {
        s.parse::<u32>()
            .map_err(|_| format!("{path}: not major:minor"))
    };
    Ok((number(major)?, number(minor)?))
}
