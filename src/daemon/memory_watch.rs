//! Whether the system is short of memory, looked at by the serving process's main thread at
//! every poll (see `super::activity`) and told to the store, which then compresses new pages
//! with its stronger codec (see `BatchedPageStore::set_memory_short`), and to the thread that
//! chooses OOM candidates when it has just gone short.

#![forbid(unsafe_code)]

use crate::config::{MEMORY_SHORT_BELOW_DIVISOR, MEMORY_SHORT_UNTIL_DIVISOR};
use crate::os::{MeminfoReader, MemoryAvailable};
use crate::store::BatchedPageStore;

/// Short of memory once `MemAvailable` falls below a share of RAM, and until it is back above
/// a larger share, so that a machine swapping near the line does not flip at every look.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Hysteresis {
    short: bool,
}

impl Hysteresis {
    /// Whether memory is short after a look that found `memory`.
    pub(super) fn look(&mut self, memory: MemoryAvailable) -> bool {
        let below = memory.total / MEMORY_SHORT_BELOW_DIVISOR;
        let until = memory.total / MEMORY_SHORT_UNTIL_DIVISOR;
        self.short = if self.short {
            memory.available < until
        } else {
            memory.available < below
        };
        self.short
    }
}

/// /proc/meminfo and the state last told to the store.
pub(super) struct MemoryWatch {
    meminfo: MeminfoReader,
    state: Hysteresis,
}

impl MemoryWatch {
    /// `None` (with the reason in the log) where /proc/meminfo cannot be read: new pages then
    /// always get the store's own algorithm.
    pub(super) fn open() -> Option<Self> {
        match MeminfoReader::open().and_then(|mut meminfo| meminfo.read().map(|_| meminfo)) {
            Ok(meminfo) => Some(Self {
                meminfo,
                state: Hysteresis::default(),
            }),
            Err(error) => {
                tracing::warn!(%error, "cannot read /proc/meminfo: new pages get the store's algorithm even when memory is short");
                None
            }
        }
    }

    /// Look at the system's memory and tell `store` whether it is short: true when it has
    /// just gone short.
    pub(super) fn look(&mut self, store: &BatchedPageStore) -> bool {
        let Ok(memory) = self.meminfo.read() else {
            return false;
        };
        let was = self.state;
        let short = self.state.look(memory);
        if self.state != was {
            let (available_mib, total_mib) = (memory.available >> 20, memory.total >> 20);
            if short {
                tracing::info!(
                    available_mib,
                    total_mib,
                    "memory short: new pages get the stronger codec while it lasts"
                );
            } else {
                tracing::info!(
                    available_mib,
                    total_mib,
                    "memory back: new pages get the store's own codec again"
                );
            }
            store.set_memory_short(short);
        }
        short && !was.short
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory(available: u64) -> MemoryAvailable {
        MemoryAvailable {
            total: 1600,
            available,
        }
    }

    #[test]
    fn short_below_a_sixteenth_until_above_an_eighth() {
        assert_eq!(
            (MEMORY_SHORT_BELOW_DIVISOR, MEMORY_SHORT_UNTIL_DIVISOR),
            (16, 8)
        );
        let mut state = Hysteresis::default();
        assert!(!state.look(memory(800)));
        assert!(!state.look(memory(100)), "at a sixteenth: not yet");
        assert!(state.look(memory(99)));
        assert!(state.look(memory(150)), "between the two: still short");
        assert!(state.look(memory(199)));
        assert!(!state.look(memory(200)), "back at an eighth");
        assert!(!state.look(memory(150)), "between the two: still not short");
    }
}
