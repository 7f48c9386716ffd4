//! A wake-up at each OOM kill: a BPF program at the kernel's `oom:mark_victim` tracepoint
//! writes a record into a ring buffer the daemon waits on with poll(2).
//!
//! Why: the daemon releases the memory of the OOM killer's victims (`daemon::oom_victims`)
//! as soon as it hears of a kill. Without the probe, it reads the kernel's count of OOM kills
//! in /proc/vmstat every 20 ms while memory is short: up to 20 ms late, about 1 s of a
//! real-time thread's CPU in 30 s under the test VM's emulation (the kernel formats every
//! counter into a buffer it allocates for each read), and that allocation is made exactly when
//! no memory is left. The probe's thread sleeps until the kill, and reads nothing to learn of
//! it.
//!
//! The tracepoint fires in `mark_oom_victim`, after the victim was sent SIGKILL, so a look
//! for processes being killed made after the wake-up finds it. For every kill the kernel's OOM
//! killer makes (the whole system's or a memory cgroup's), and for a task it marks as a victim
//! because it was exiting already. Optional: without it (a kernel before 5.8, no permission)
//! the daemon reads the count as before.

#![forbid(unsafe_code)]

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use crate::bpf::insn::{
    insn, Insn, ADD64_K, CALL, EXIT, FP, HELPER_RINGBUF_OUTPUT, LD_IMM64, MOV64_K, MOV64_X,
    PSEUDO_MAP_FD, R0, R1, R2, R3, R4, ST_DW,
};
use crate::bpf::sys;

/// The tracepoint (`oom:mark_victim`), named as raw tracepoints are: without its group.
const TRACEPOINT: &str = "mark_victim";
/// The ring buffer's size: the smallest the kernel takes (a page). A full ring only drops
/// records, and one unread record is all a wake-up needs.
const RING_BYTES: u32 = 4096;
/// `bpf_ringbuf_output`'s flag that wakes the reader at every record, not only at the first
/// one it has not read (`BPF_RB_FORCE_WAKEUP`).
const FORCE_WAKEUP: i32 = 2;

/// Why there is no OOM kill probe.
#[derive(Debug, thiserror::Error)]
pub enum OomKillProbeError {
    #[error("{what}: {source} (needs Linux 5.8+, root with CAP_BPF and CAP_PERFMON or CAP_SYS_ADMIN, and the bpf system call)")]
    Kernel {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("the kernel's verifier refused the OOM kill probe: {error}: {log}")]
    Verifier { error: std::io::Error, log: String },
}

/// The attached probe: dropping it detaches it.
pub struct OomKillProbe {
    ring: sys::RingBufferReader,
    /// Keeps the program at the tracepoint.
    _attached: OwnedFd,
}

impl OomKillProbe {
    pub fn attach() -> Result<Self, OomKillProbeError> {
        let kernel = |what| move |source| OomKillProbeError::Kernel { what, source };
        let ring = sys::create_ring_buffer(RING_BYTES, "trueno_ooms")
            .map_err(kernel("creating the ring buffer"))?;
        let code = program(ring.as_raw_fd());
        let program = sys::load_program(&code, sys::ProgramType::RawTracepoint, "trueno_ooms")
            .map_err(|(error, log)| {
                if log.is_empty() {
                    OomKillProbeError::Kernel {
                        what: "loading the program",
                        source: error,
                    }
                } else {
                    OomKillProbeError::Verifier { error, log }
                }
            })?;
        let attached = sys::attach_raw_tracepoint(TRACEPOINT, &program).map_err(kernel(
            "attaching the program to the tracepoint oom:mark_victim",
        ))?;
        let ring = sys::RingBufferReader::map(ring).map_err(kernel("mapping the ring buffer"))?;
        Ok(Self {
            ring,
            _attached: attached,
        })
    }

    /// Wait for an OOM kill, until `also` is readable (or closed) or for up to `timeout`
    /// (`None`: no limit): whether one (or more) came since the last call that said so. Kills
    /// that come while the caller acts on one make the next call return at once.
    pub fn wait(
        &self,
        also: Option<BorrowedFd<'_>>,
        timeout: Option<Duration>,
    ) -> std::io::Result<bool> {
        let killed = self.ring.wait(also, timeout)?;
        if killed {
            self.ring.skip_all();
        }
        Ok(killed)
    }
}

/// The program: one 8-byte record of zeros into the ring buffer `ring_fd`, waking its reader.
fn program(ring_fd: i32) -> Vec<Insn> {
    vec![
        insn(ST_DW, FP, 0, -8, 0),
        insn(LD_IMM64, R1, PSEUDO_MAP_FD, 0, ring_fd),
        insn(0, 0, 0, 0, 0),
        insn(MOV64_X, R2, FP, 0, 0),
        insn(ADD64_K, R2, 0, 0, -8),
        insn(MOV64_K, R3, 0, 0, 8),
        insn(MOV64_K, R4, 0, 0, FORCE_WAKEUP),
        insn(CALL, 0, 0, 0, HELPER_RINGBUF_OUTPUT),
        insn(MOV64_K, R0, 0, 0, 0),
        insn(EXIT, 0, 0, 0, 0),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_program_writes_one_zeroed_word_from_its_stack_to_the_ring_and_returns_zero() {
        let code = program(9);
        assert_eq!(code[0], insn(ST_DW, FP, 0, -8, 0));
        let map = code.iter().position(|i| i.code == LD_IMM64).unwrap();
        assert_eq!((code[map].regs >> 4, code[map].imm), (PSEUDO_MAP_FD, 9));
        let call = code.iter().position(|i| i.code == CALL).unwrap();
        assert_eq!(code[call].imm, HELPER_RINGBUF_OUTPUT);
        assert!(map < call && code[..call].contains(&insn(MOV64_K, R3, 0, 0, 8)));
        assert_eq!(
            code[code.len() - 2..],
            [insn(MOV64_K, R0, 0, 0, 0), insn(EXIT, 0, 0, 0, 0)]
        );
    }

    /// On a kernel that lets this test load programs (root), the probe passes the verifier,
    /// attaches, and does not wake without a kill. Skipped otherwise, as the daemon then reads
    /// the kill count instead. That it wakes at a kill is the VM test's (an OOM kill in this
    /// test would take a process of the machine running it).
    #[test]
    fn the_probe_attaches_where_the_kernel_allows_it_and_stays_quiet_without_a_kill() {
        match OomKillProbe::attach() {
            Ok(probe) => {
                // An OOM kill elsewhere on this machine meanwhile wakes it, rightly.
                let kills = || {
                    crate::os::OomKillCount::open()
                        .and_then(|mut count| count.read())
                        .unwrap()
                };
                let before = kills();
                let woke = probe.wait(None, Some(Duration::from_millis(50))).unwrap();
                assert!(!woke || kills() != before, "woke without an OOM kill");
            }
            Err(OomKillProbeError::Verifier { error, log }) => {
                panic!("the verifier refused the probe: {error}: {log}")
            }
            Err(error) => eprintln!("skipped: {error}"),
        }
    }
}
