//! A socket that becomes readable when a signal arrives, for a thread that waits in poll(2) on
//! other descriptors too: signal-hook's `Signals` iterator, which says which signals came, has
//! no descriptor of its own to poll, and a poll with a timeout only to look at it wakes an
//! idle process for nothing.

#![forbid(unsafe_code)]

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;

use signal_hook::SigId;

/// Readable once one of its signals came (until `drain`ed); its handlers are removed when it
/// is dropped.
pub(super) struct SignalWake {
    socket: UnixStream,
    registered: Vec<SigId>,
}

impl SignalWake {
    /// A socket written to at each of `signals`, beside their other handlers (a `Signals`
    /// iterator's).
    pub(super) fn new(signals: &[i32]) -> std::io::Result<Self> {
        let (socket, sender) = UnixStream::pair()?;
        // Neither end ever blocks: a handler's write into a full socket is dropped (one
        // unread byte wakes the poll as well as many), and `drain` stops at empty.
        socket.set_nonblocking(true)?;
        sender.set_nonblocking(true)?;
        let mut wake = Self {
            socket,
            registered: Vec::with_capacity(signals.len()),
        };
        for &signal in signals {
            let sender = sender.try_clone()?;
            wake.registered
                .push(signal_hook::low_level::pipe::register(signal, sender)?);
        }
        Ok(wake)
    }

    /// Take what the handlers wrote, so that the next poll waits for another signal.
    pub(super) fn drain(&self) {
        let mut buffer = [0u8; 256];
        while std::io::Read::read(&mut &self.socket, &mut buffer).is_ok_and(|n| n > 0) {}
    }
}

impl AsFd for SignalWake {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

impl Drop for SignalWake {
    fn drop(&mut self) {
        for id in self.registered.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_makes_the_socket_readable_until_drained() {
        let readable = |wake: &SignalWake| {
            let mut fds = [nix::poll::PollFd::new(
                wake.as_fd(),
                nix::poll::PollFlags::POLLIN,
            )];
            nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO).unwrap() > 0
        };
        // SIGWINCH: ignored by default, so a stray one (none is expected) ends nothing.
        let wake = SignalWake::new(&[libc::SIGWINCH]).unwrap();
        assert!(!readable(&wake));
        signal_hook::low_level::raise(libc::SIGWINCH).unwrap();
        assert!(readable(&wake));
        wake.drain();
        assert!(!readable(&wake));
        drop(wake);
    }
}
