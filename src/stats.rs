//! `trueno-ublk stat`: live statistics read from each running daemon's endpoint.
//!
//! SKELETON: filled in by the operability work.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum StatError {
    #[error("stat is not implemented yet")]
    NotYet,
}

pub fn stat(_args: &crate::cli::StatArgs) -> Result<(), StatError> {
    Err(StatError::NotYet)
}
