//! Arbitrary text as a config file (/etc/trueno-ublk.conf): the parser must return a
//! ConfigFile or an error with a message, never panic. What it accepts must also survive
//! what the daemon does with it next: looking a section up and evaluating its sizes.
//!
//! Run with `scripts/fuzz.sh` (stable toolchain) or `cargo fuzz run parse_config`.

#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use trueno_ublk::config::{parse, MemLimit};

/// RAM sizes to evaluate `ram`-relative sizes against: none, a small VM, a big machine, the
/// largest value /proc/meminfo could give.
const RAM_BYTES: [u64; 4] = [0, 256 << 20, 1 << 40, u64::MAX];

fuzz_target!(|data: &[u8]| {
    // Config files are read as UTF-8 text; a file that is not is refused before parsing.
    let text = String::from_utf8_lossy(data);
    match parse(&text, Path::new("/etc/trueno-ublk.conf")) {
        Ok(file) => {
            for (id, section) in &file.devices {
                assert!(file.device(*id).is_some(), "section [ublkb{id}] is found by id");
                for ram in RAM_BYTES {
                    if let Some(size) = section.size {
                        let _ = size.value.evaluate(ram);
                    }
                    if let Some(MemLimit::Size(limit)) = section.mem_limit.map(|s| s.value) {
                        let _ = limit.evaluate(ram);
                    }
                }
            }
        }
        // The message a user sees: formatting it must not panic either.
        Err(error) => drop(error.to_string()),
    }
});
