//! `trueno-ublk swapon`: enable a device as swap with the priority its config section gives,
//! and discard on.

#![forbid(unsafe_code)]

use std::path::Path;

use thiserror::Error;

use crate::config::{self, ConfigError, DEFAULT_SWAP_PRIORITY};
use crate::ublk::device::block_path;

#[derive(Debug, Error)]
pub enum SwapError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("'{command}' failed: {source}")]
    Swapon {
        command: String,
        source: std::io::Error,
    },
}

/// The swap priority of device `id`: its section's `swap-priority` in `config_path`, else the
/// default.
pub fn priority(id: u32, config_path: Option<&Path>) -> Result<u16, ConfigError> {
    let file = config::load_for(config_path, Some(id))?;
    Ok(config::pick(
        None,
        file.device(id).and_then(|section| section.swap_priority),
        DEFAULT_SWAP_PRIORITY,
    ))
}

/// The swapon command line for device `id`: discard on (a ublk device gets no swap-slot-free
/// notification, so discard is how freed slots give memory back) and the priority. Short
/// options, because util-linux and busybox both accept them.
pub fn swapon_command(id: u32, priority: u16) -> Vec<String> {
    vec![
        "swapon".to_string(),
        "-d".to_string(),
        "-p".to_string(),
        priority.to_string(),
        block_path(id),
    ]
}

/// Enable `/dev/ublkb{id}` as swap with `priority` and discard: swapon(2) itself, because
/// busybox's swapon (in minimal systems) has no priority option.
pub fn swapon(id: u32, priority: u16) -> Result<(), SwapError> {
    let failed = |source| SwapError::Swapon {
        command: swapon_command(id, priority).join(" "),
        source,
    };
    let path = std::ffi::CString::new(block_path(id))
        .map_err(|_| failed(std::io::ErrorKind::InvalidInput.into()))?;
    crate::os::swapon(&path, priority).map_err(failed)
}
