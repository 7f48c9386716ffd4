//! trueno-ublk: a compressed-RAM block device (for swap) served in user space through the
//! Linux ublk driver.
//!
//! Dependencies flow one way (see ARCHITECTURE.md): the leaves `units` and `os`; then `mem`
//! and `codec`; then `ublk` (the kernel protocol), `store` (the pages) and `gpu` (one more
//! batch codec); then `config` (everything a user can set, every default); then `daemon`,
//! `devices`, `stats`, `swap` and `bench`; then `cli`, which parses and prints.

pub mod bench;
pub mod blockdev;
pub mod bpf;
pub mod cli;
pub mod codec;
pub mod config;
pub mod daemon;
pub mod devices;
pub mod generator;
pub mod gpu;
pub mod mem;
pub mod oom_kills;
pub mod os;
pub mod procstat;
pub mod slotfree;
pub mod stats;
pub mod store;
pub mod swap;
pub mod ublk;
pub mod units;
