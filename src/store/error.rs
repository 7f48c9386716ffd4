//! The store's errors and the errno each one gives a block request.

#![forbid(unsafe_code)]

use thiserror::Error;

/// Errors of the store; `errno()` gives what the block request completes with.
#[derive(Debug, Error)]
pub enum StoreError {
    #[error("request at byte {offset} of length {len} is beyond the device end ({size} bytes)")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("request at byte {offset} of length {len} is not 4 KiB aligned")]
    Misaligned { offset: u64, len: u64 },
    #[error(
        "memory limit of {limit} bytes reached (raise --mem-limit or free pages with discard)"
    )]
    NoSpace { limit: u64 },
    #[error(
        "no memory for compressed pages: a write waited {waited_ms} ms while the flusher waited for the system to give the store some"
    )]
    OutOfMemory { waited_ms: u64 },
    #[error("stored page {page} failed to decompress: {source}")]
    Corrupt {
        page: u64,
        source: crate::codec::CodecError,
    },
    #[error(
        "stored page {page} does not match its checksum (its memory changed since it was stored)"
    )]
    ChecksumMismatch { page: u64 },
    #[error(
        "page {page}'s table entry does not match its check (its memory changed since the page was written)"
    )]
    EntryMismatch { page: u64 },
    #[error("invalid store configuration: {0}")]
    Config(String),
    #[error("page {page} was lost when the store was resumed (its entry did not hold together); it reads as an error until it is written again")]
    Lost { page: u64 },
    #[error("the page arena's address space is used up (a bug: please report it)")]
    ArenaFull,
    #[error("page {page} was written while its part of the page table had no memory (a bug: please report it); the write was not stored")]
    TableAbsent { page: u64 },
    #[error("{0}")]
    Layout(String),
    #[error("{what}: {source}")]
    Memory {
        what: String,
        source: std::io::Error,
    },
}

impl StoreError {
    /// The page whose own data is bad or gone, where that is the failure: a read that fails
    /// with it has read every page before it (see `BatchedPageStore::read`).
    pub fn bad_page(&self) -> Option<u64> {
        match self {
            StoreError::Corrupt { page, .. }
            | StoreError::ChecksumMismatch { page }
            | StoreError::EntryMismatch { page }
            | StoreError::Lost { page } => Some(*page),
            _ => None,
        }
    }

    /// The negative errno a block request fails with.
    pub fn errno(&self) -> i32 {
        match self {
            StoreError::OutOfRange { .. }
            | StoreError::Corrupt { .. }
            | StoreError::ChecksumMismatch { .. }
            | StoreError::EntryMismatch { .. }
            | StoreError::Lost { .. }
            | StoreError::TableAbsent { .. }
            | StoreError::Layout(_)
            | StoreError::Memory { .. } => -libc::EIO,
            StoreError::Misaligned { .. } | StoreError::Config(_) => -libc::EINVAL,
            StoreError::NoSpace { .. } | StoreError::ArenaFull => -libc::ENOSPC,
            StoreError::OutOfMemory { .. } => -libc::ENOMEM,
        }
    }
}
