//! `trueno-ublk-generator`: a systemd generator (the `trueno-ublk` binary run under that
//! name, a link that scripts/install.sh puts in a system-generators directory). At boot and
//! at every `systemctl daemon-reload` it reads /etc/trueno-ublk.conf and, for each
//! `[ublkbN]` section with `swap = yes`, writes `dev-ublkbN.swap` into the directory systemd
//! gives it and links it into swap.target.wants, as zram-generator does for zram.
//!
//! Why a real swap unit rather than a service that runs swapon: systemd makes a
//! `dev-ublkbN.swap` unit for every swap it sees in /proc/swaps anyway, and at poweroff runs
//! its own swapoff for it. A service running swapon and swapoff itself is then a second swap
//! owner without ordering against the daemon: its swapoff and systemd's race, and the daemon
//! can be stopped while pages are still being read back. With the unit written here there is
//! exactly one owner, ordered after the daemon both ways; systemd runs swapon outside any
//! service sandbox, so /proc/swaps names /dev/ublkbN.

#![forbid(unsafe_code)]

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::config::{self, ConfigFile, DEFAULT_CONFIG_PATH, DEFAULT_SWAP_PRIORITY};

/// The name this binary answers to as a generator (argv[0]'s file name).
pub const GENERATOR_NAME: &str = "trueno-ublk-generator";

/// `(id, priority)` of every device the file marks `swap = yes`.
pub fn swap_devices(file: &ConfigFile) -> Vec<(u32, u16)> {
    file.devices
        .iter()
        .filter(|(_, section)| section.swap.is_some_and(|s| s.value))
        .map(|(id, _)| (*id, file.swap_priority(*id)))
        .collect()
}

/// The unit file `dev-ublkb{id}.swap`.
pub fn swap_unit(id: u32, priority: u16, config: &Path) -> String {
    let config = config.display();
    format!(
        "\
# Written by {GENERATOR_NAME} from {config} ([ublkb{id}] swap = yes); edit that file,
# then `systemctl daemon-reload`. The only swap unit of /dev/ublkb{id}: systemd runs
# swapon and swapoff (outside any sandbox, so /proc/swaps names /dev/ublkb{id}).
[Unit]
Description=trueno-ublk compressed-RAM swap on /dev/ublkb{id}
SourcePath={config}
# The daemon serving the device. Wants=, not Requires=/BindsTo=/PartOf=: those would
# carry a `systemctl restart trueno-ublk@{id}` (a package upgrade) over to this unit, and
# its swapoff then has to read every swapped-out page back into a RAM that is short, gets
# OOM-killed, and the daemon is stopped under live swap. A stop or restart of the daemon
# leaves this unit alone; the daemon hands the device over (its pages kept) while the swap
# is on, and the next start resumes it.
Wants=trueno-ublk@{id}.service
# Ordered after the daemon both ways: swapon once the device is live, and where both stop
# in one transaction (poweroff) the daemon's stop waits until swapoff has finished. By hand,
# stop this unit first, then the daemon, in two commands (see the README).
After=trueno-ublk@{id}.service
# A fresh swap signature on the new, empty device before every swapon.
Requires=trueno-ublk-mkswap@{id}.service
After=trueno-ublk-mkswap@{id}.service
Before=swap.target

[Swap]
What=/dev/ublkb{id}
Priority={priority}
# Freed swap slots give their memory back as the kernel frees them where the daemon's
# slot-free probe runs; discard is how they do otherwise (and for a slot freed while no
# process serves the device).
Options=discard
# swapoff reads every swapped-out page back into RAM: give it time.
TimeoutSec=10min
"
    )
}

/// The smallest swap area mkswap makes: 10 pages (util-linux's `MIN_GOODPAGES`).
const MIN_SWAP_BYTES: u64 = 10 * 4096;

/// The devices of `swap_devices` whose daemon can start: a section the daemon would refuse (a
/// value out of range, a recompression that cannot save anything, a size beyond 32 times
/// RAM, or too small for a swap area) gets no swap unit, and a
/// message, rather than one that holds the boot up waiting for a device that never comes
/// (systemd's device timeout, 90 s). A device that exists already keeps its unit: its daemon
/// serves it without the file (`daemon::create`), and the unit orders swapoff before the
/// daemon's stop.
fn startable_swap_devices(file: &ConfigFile, config: &Path) -> Vec<(u32, u16)> {
    let ram_bytes = match config::ram_bytes() {
        Ok(bytes) => bytes,
        Err(error) => {
            say(&format!(
                "{GENERATOR_NAME}: {error}; the sections are not checked"
            ));
            return swap_devices(file);
        }
    };
    let mut devices = swap_devices(file);
    devices.retain(|&(id, _)| {
        let options = config::DeviceOptions {
            id: Some(id),
            config: Some(config.to_path_buf()),
            ..Default::default()
        };
        let startable = config::resolve_with(&options, file, ram_bytes)
            .map_err(|error| error.to_string())
            .and_then(|settings| {
                crate::daemon::check_startable(&settings).map_err(|error| error.to_string())?;
                if settings.size_bytes < MIN_SWAP_BYTES {
                    return Err(format!(
                        "size {} bytes is too small for a swap area (mkswap needs \
                         {MIN_SWAP_BYTES})",
                        settings.size_bytes
                    ));
                }
                Ok(())
            })
            // Which section, where several ask for swap.
            .map_err(|error| format!("[ublkb{id}]: {error}"));
        let Err(error) = startable else {
            return true;
        };
        let exists = crate::ublk::device::device_exists(id);
        say(&format!(
            "{GENERATOR_NAME}: {error}; {}",
            if exists {
                "the device exists: its swap unit is kept"
            } else {
                "no swap unit written for this device"
            }
        ));
        exists
    });
    devices
}

/// Ids of the `/dev/ublkbN` that `fstab` (/etc/fstab's text) lists as swap. Such a line wins
/// over `swap = yes`: systemd's fstab generator writes the same unit name, and which of two
/// generators run side by side writes it first is chance.
fn ublk_swaps_in_fstab(fstab: &str) -> Vec<u32> {
    fstab
        .lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(2) != Some(&"swap") {
                return None;
            }
            crate::os::numbered_name(fields.first()?, "/dev/ublkb")
        })
        .collect()
}

/// `(id, priority)` of every swap area on a `/dev/ublkbN` in `swaps` (/proc/swaps's text).
fn ublk_swaps_on(swaps: &str) -> Vec<(u32, u16)> {
    swaps
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let id = crate::os::numbered_name(fields.first()?, "/dev/ublkb")?;
            // Negative where swapon gave none; the priority only matters to a swapon.
            let priority = fields.get(4)?.parse::<i32>().ok()?;
            Some((id, u16::try_from(priority).unwrap_or(DEFAULT_SWAP_PRIORITY)))
        })
        .collect()
}

/// Write the swap units of `devices` (`(id, priority)`) into `dir` (systemd's "normal"
/// generator directory).
pub fn generate(
    devices: &[(u32, u16)],
    config: &Path,
    dir: &Path,
) -> std::io::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let wants = dir.join("swap.target.wants");
    for &(id, priority) in devices {
        let name = format!("dev-ublkb{id}.swap");
        let path = dir.join(&name);
        let text = swap_unit(id, priority, config);
        if !write_unit(dir, &name, &text)? {
            // Generators run side by side, and the first to write a unit keeps it (as
            // systemd's own do): an fstab line for the device, say.
            say(&format!(
                "{GENERATOR_NAME}: {} was written by another generator (an fstab line for \
                 /dev/ublkb{id}?); left as it is",
                path.display()
            ));
            continue;
        }
        std::fs::create_dir_all(&wants)?;
        let link = wants.join(&name);
        match std::fs::remove_file(&link) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
        std::os::unix::fs::symlink(Path::new("..").join(&name), &link)?;
        written.push(path);
    }
    Ok(written)
}

/// Write unit `name` holding `text` into `dir`, whole or not at all (written aside, then
/// linked into place, which fails if the name exists); false if another unit of that name is
/// there (the same text is this generator's own, from an earlier run into the directory).
fn write_unit(dir: &Path, name: &str, text: &str) -> std::io::Result<bool> {
    let path = dir.join(name);
    match std::fs::read_to_string(&path) {
        Ok(existing) => return Ok(existing == text),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(error),
    }
    let aside = dir.join(format!(".{name}.{}", std::process::id()));
    let placed = std::fs::File::create(&aside)
        .and_then(|mut unit| unit.write_all(text.as_bytes()))
        .and_then(|()| std::fs::hard_link(&aside, &path));
    let _ = std::fs::remove_file(&aside);
    match placed {
        Ok(()) => Ok(true),
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(error) => Err(error),
    }
}

/// `LOG_DAEMON | LOG_WARNING`, the priority of the generator's lines in the kernel log: a
/// facility other than the kernel's has journald take the text before the colon as the
/// line's identifier (`journalctl -t trueno-ublk-generator`).
const KMSG_PRIORITY: libc::c_int = libc::LOG_DAEMON | libc::LOG_WARNING;

/// Tell the administrator `line`: in the kernel log (so the journal) where stderr leads
/// nowhere, as when systemd runs generators (their stderr is /dev/null, at boot and on
/// `daemon-reload`: `man systemd.generator` asks for /dev/kmsg), else on stderr (a generator
/// run by hand, tests).
fn say(line: &str) {
    use std::io::Write;
    if stderr_is_dev_null() {
        if let Ok(mut kmsg) = std::fs::OpenOptions::new().write(true).open("/dev/kmsg") {
            // One write per record: the kernel takes each write as one line, and refuses
            // one over 1 KiB (EINVAL), so a longer line is cut.
            let mut end = line.len().min(KMSG_MAX_TEXT);
            while !line.is_char_boundary(end) {
                end -= 1;
            }
            if kmsg
                .write_all(format!("<{KMSG_PRIORITY}>{}\n", &line[..end]).as_bytes())
                .is_ok()
            {
                return;
            }
        }
    }
    crate::os::print_err(line);
}

/// The longest text `say` writes as one kernel log record: the record (priority and newline
/// included) must stay within the kernel's 1024 bytes.
const KMSG_MAX_TEXT: usize = 1000;

/// Whether this process's stderr is /dev/null (the character device 1:3).
fn stderr_is_dev_null() -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let null = std::fs::metadata("/dev/null");
    let stderr = nix::sys::stat::fstat(std::io::stderr());
    match (null, stderr) {
        (Ok(null), Ok(stderr)) => {
            null.file_type().is_char_device()
                && stderr.st_mode & libc::S_IFMT == libc::S_IFCHR
                && stderr.st_rdev == null.rdev()
        }
        _ => false,
    }
}

/// Entry point when run as `trueno-ublk-generator NORMAL_DIR [EARLY_DIR LATE_DIR]`. The
/// config path can be overridden with TRUENO_UBLK_CONFIG (tests; systemd passes no such
/// variable). Messages go to the kernel log when run by systemd, else to stderr (`say`).
pub fn main() -> i32 {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let Some(dir) = args.first().map(PathBuf::from) else {
        say(&format!("{GENERATOR_NAME}: usage: {GENERATOR_NAME} NORMAL_DIR [EARLY_DIR LATE_DIR] (systemd runs it at boot)"));
        return 2;
    };
    let config_path = std::env::var_os("TRUENO_UBLK_CONFIG")
        .map_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH), PathBuf::from);
    let devices = match config::load(&config_path) {
        Ok(file) => startable_swap_devices(&file, &config_path),
        Err(error) => {
            // The swap areas on ublk devices that are on keep their units (a daemon-reload
            // after an edit with a typo): without, the unit systemd makes from /proc/swaps
            // is not ordered before the daemon's stop, and at poweroff swapoff would wait
            // on a device whose daemon has handed it over.
            let on = ublk_swaps_on(&std::fs::read_to_string("/proc/swaps").unwrap_or_default());
            say(&format!(
                "{GENERATOR_NAME}: {error}; no swap units written{}",
                if on.is_empty() {
                    String::new()
                } else {
                    format!(" but for the ublk swap areas that are on ({})", on.len())
                }
            ));
            if on.is_empty() {
                return 1;
            }
            on
        }
    };
    let in_fstab = ublk_swaps_in_fstab(&std::fs::read_to_string("/etc/fstab").unwrap_or_default());
    let devices: Vec<(u32, u16)> = devices
        .into_iter()
        .filter(|&(id, _)| {
            let listed = in_fstab.contains(&id);
            if listed {
                say(&format!(
                    "{GENERATOR_NAME}: /etc/fstab lists /dev/ublkb{id} as swap: its line makes \
                     the swap unit, not `swap = yes` (remove it, or give dev-ublkb{id}.swap a \
                     drop-in with Wants= and After=trueno-ublk@{id}.service, Requires= and \
                     After=trueno-ublk-mkswap@{id}.service: x-systemd options do nothing on a \
                     swap line; see the README)"
                ));
            }
            !listed
        })
        .collect();
    match generate(&devices, &config_path, &dir) {
        Ok(_) => 0,
        Err(error) => {
            say(&format!(
                "{GENERATOR_NAME}: writing units into {}: {error}",
                dir.display()
            ));
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_fstab_swap_line_for_a_device_is_found() {
        let fstab = "# /dev/ublkb9 none swap sw 0 0\n/dev/sda1 / ext4 defaults 0 1\n\
                     /dev/ublkb0 none swap sw,discard 0 0\n  /dev/ublkb3\tnone\tswap\tsw\n\
                     /dev/ublkb1 /mnt ext4 defaults 0 2\n/dev/ublkbx none swap sw\n\
                     /dev/ublkb+4 none swap sw\n";
        assert_eq!(ublk_swaps_in_fstab(fstab), vec![0, 3]);
    }

    #[test]
    fn only_sections_with_swap_yes_get_a_swap_unit() {
        let text = "[ublkb0]\nswap = yes\n[ublkb1]\nswap-priority = 5\n[ublkb2]\nswap = yes\nswap-priority = 7\n[ublkb3]\nswap = no\n";
        let file = config::parse(text, Path::new("t.conf")).unwrap();
        assert_eq!(
            swap_devices(&file),
            vec![(0, DEFAULT_SWAP_PRIORITY), (2, 7)]
        );
    }

    #[test]
    fn ublk_swap_areas_that_are_on_are_read_from_proc_swaps() {
        let swaps = "Filename\tType\tSize\tUsed\tPriority\n\
                     /dev/ublkb0                             partition\t374800\t0\t100\n\
                     /dev/zram0                              partition\t1000\t0\t5\n\
                     /dev/ublkb3                             partition\t1000\t0\t-2\n\
                     /dev/ublkb4\\040(deleted)               partition\t1000\t0\t7\n";
        assert_eq!(
            ublk_swaps_on(swaps),
            vec![(0, 100), (3, DEFAULT_SWAP_PRIORITY)]
        );
    }

    #[test]
    fn a_section_the_daemon_would_refuse_gets_no_swap_unit() {
        // Both parse, but recompressing with zstd at a level no higher than the pages' own
        // cannot make them smaller: refused when the daemon starts. Ids no device has here.
        let text = "[ublkb1040001]\nswap = yes\nalgorithm = zstd\nzstd-level = 9\n\
                    recompress = zstd:3\n\
                    [ublkb1040002]\nswap = yes\nalgorithm = zstd\nrecompress = zstd:1\n\
                    [ublkb1040003]\nswap = yes\n\
                    [ublkb1040004]\nswap = yes\nsize = 512T\n\
                    [ublkb1040005]\nswap = yes\nsize = 36K\n";
        let file = config::parse(text, Path::new("t.conf")).unwrap();
        assert_eq!(swap_devices(&file).len(), 5);
        assert_eq!(
            startable_swap_devices(&file, Path::new("t.conf")),
            vec![(1_040_003, DEFAULT_SWAP_PRIORITY)]
        );
    }

    /// A generator output directory, removed when the test ends.
    fn scratch_dir() -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix("trueno-ublk-gen-")
            .tempdir()
            .unwrap()
    }

    #[test]
    fn generated_units_and_links() {
        let scratch = scratch_dir();
        let dir = scratch.path();
        let file =
            config::parse("[ublkb3]\nswap = yes\nswap-priority = 42\n", Path::new("c")).unwrap();
        // Twice: a daemon-reload runs generators into a fresh directory, but a rerun into
        // the same one must not fail on the existing link.
        let devices = swap_devices(&file);
        generate(&devices, Path::new("/etc/trueno-ublk.conf"), dir).unwrap();
        let written = generate(&devices, Path::new("/etc/trueno-ublk.conf"), dir).unwrap();
        assert_eq!(written, vec![dir.join("dev-ublkb3.swap")]);
        let unit = std::fs::read_to_string(dir.join("dev-ublkb3.swap")).unwrap();
        assert!(unit.contains("\nWhat=/dev/ublkb3\n"));
        assert!(unit.contains("\nPriority=42\n"));
        assert!(unit.contains("\nWants=trueno-ublk@3.service\n"));
        assert!(unit.contains("\nAfter=trueno-ublk@3.service\n"));
        assert!(!unit.contains("Requires=trueno-ublk@"));
        let link = std::fs::read_link(dir.join("swap.target.wants/dev-ublkb3.swap")).unwrap();
        assert_eq!(link, Path::new("../dev-ublkb3.swap"));
        // Nothing but the unit and its link: the copy written aside is gone.
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(names, ["dev-ublkb3.swap", "swap.target.wants"]);
    }

    /// A unit of the same name another generator wrote first (an fstab line for the device)
    /// is left as it is, and not linked; the other devices still get theirs.
    #[test]
    fn a_unit_another_generator_wrote_is_left_alone() {
        let scratch = scratch_dir();
        let dir = scratch.path();
        let fstab = "[Swap]\nWhat=/dev/ublkb3\n";
        std::fs::write(dir.join("dev-ublkb3.swap"), fstab).unwrap();
        let config = Path::new("/etc/trueno-ublk.conf");
        let written = generate(&[(3, 5), (4, 5)], config, dir).unwrap();
        assert_eq!(written, vec![dir.join("dev-ublkb4.swap")]);
        assert_eq!(
            std::fs::read_to_string(dir.join("dev-ublkb3.swap")).unwrap(),
            fstab
        );
        assert!(!dir.join("swap.target.wants/dev-ublkb3.swap").exists());
        assert!(dir.join("swap.target.wants/dev-ublkb4.swap").exists());
    }
}
