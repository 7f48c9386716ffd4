//! Command-line parsing and output.

/// Run the command line; returns the process exit code.
pub fn main() -> i32 {
    0
}
