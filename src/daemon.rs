//! Wiring one device: store, queues, signals, readiness.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum DaemonError {
    #[error("not implemented yet")]
    NotYet,
}

pub fn create(_args: crate::cli::CreateArgs) -> Result<(), DaemonError> {
    Err(DaemonError::NotYet)
}
