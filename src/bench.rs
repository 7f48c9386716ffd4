//! `trueno-ublk bench`: the page store's write and read paths on a corpus of pages, and kernel
//! zram on the same pages with `--compare-zram`.
//!
//! SKELETON: filled in by the bench work.

use clap::Args;
use thiserror::Error;

#[derive(Clone, Debug, Args)]
pub struct BenchArgs {
    /// Corpus file of 4 KiB pages (default: a built-in realistic mix)
    #[arg(long)]
    pub input: Option<std::path::PathBuf>,
    /// Print one JSON object
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub store: crate::cli::StoreArgs,
}

#[derive(Debug, Error)]
pub enum BenchError {
    #[error("bench is not implemented yet")]
    NotYet,
}

pub fn run(_args: &BenchArgs) -> Result<(), BenchError> {
    Err(BenchError::NotYet)
}
