//! `list` and `delete`: ublk devices as the kernel sees them, whether or not a daemon is alive.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum DevicesError {
    #[error("not implemented yet")]
    NotYet,
}

pub fn list(_args: &crate::cli::ListArgs) -> Result<(), DevicesError> {
    Err(DevicesError::NotYet)
}

pub fn delete(_args: &crate::cli::DeleteArgs) -> Result<(), DevicesError> {
    Err(DevicesError::NotYet)
}
