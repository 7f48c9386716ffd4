//! trueno-ublk: a compressed-RAM block device (for swap) served in user space through the
//! Linux ublk driver.
//!
//! `ublk` speaks the kernel protocol, `store` keeps pages, `codec` compresses them, `gpu` is one
//! more batch codec, `daemon` wires one device together and `cli` parses the command line.

pub mod bench;
pub mod blockdev;
pub mod cli;
pub mod codec;
pub mod config;
pub mod daemon;
pub mod devices;
pub mod generator;
pub mod gpu;
pub mod mem;
pub mod stats;
pub mod store;
pub mod ublk;
