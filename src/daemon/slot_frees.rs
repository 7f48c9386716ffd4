//! The serving process's watch on freed swap slots (see `crate::slotfree`): the probe,
//! attached once the device is live, and a thread that frees the reported slots' pages
//! (looking every `slotfree::POLL`). Writes withdraw the reports of their pages
//! (`StoreHandler`).

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
    /// Closed to stop the thread.
    stop: Option<OwnedFd>,
    thread: Option<JoinHandle<()>>,
}

impl SlotFreeWatch {
    /// Attach the probe for `/dev/ublkb{id}`, of `pages` pages, and start its thread; `Err`
    /// says why not (the store then hears of freed slots only through discards).
    pub(super) fn start(id: u32, pages: u64, handler: &Arc<StoreHandler>) -> Result<Self, String> {
        let (major, minor) = block_device_number(id)?;
        let probe =
            SlotFreeProbe::attach(major, minor, pages).map_err(|error| error.to_string())?;
        let probe = Arc::new(probe);
        handler.set_slot_frees(probe.clone());
        let (stop_read, stop_write) =
            nix::unistd::pipe().map_err(|error| format!("making the stop pipe: {error}"))?;
        let thread_handler = handler.clone();
        let thread = std::thread::Builder::new()
            .name("slot-frees".into())
            .stack_size(crate::mem::IO_THREAD_STACK_BYTES)
            .spawn(move || watch(&thread_handler, &stop_read))
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

/// The thread: free what the probe reports, every `slotfree::POLL`, until `stop` is readable.
/// It holds pages' locks that the queue threads may wait for, so it is made an I/O thread
/// first (its stack and heap faulted in, an I/O flusher at the queue threads' priority): it
/// must never wait on reclaim while holding one.
fn watch(handler: &StoreHandler, stop: &OwnedFd) {
    super::harden::ready_io_thread();
    let poll_ms = u16::try_from(crate::slotfree::POLL.as_millis()).unwrap_or(u16::MAX);
    loop {
        let mut fds = [PollFd::new(stop.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(poll_ms)) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => handler.free_reported_slots(),
            Ok(_) => return,
            Err(error) => {
                tracing::warn!(%error, "slot-free probe: poll failed; freed slots now come back only through discards");
                return;
            }
        }
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
