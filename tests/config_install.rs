//! scripts/install.sh into a temporary DESTDIR: what it installs, that it keeps an existing
//! /etc/trueno-ublk.conf, and that --uninstall removes what it installed.

use std::path::{Path, PathBuf};
use std::process::Command;

fn install(destdir: &Path, extra: &[&str]) -> (bool, String) {
    let output = Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/install.sh"))
        .args(["--binary", env!("CARGO_BIN_EXE_trueno-ublk")])
        .args(extra)
        .env("DESTDIR", destdir)
        .output()
        .expect("bash runs");
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text)
}

fn files_under(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else {
                found.push(path.strip_prefix(root).unwrap().to_path_buf());
            }
        }
    }
    found.sort();
    found
}

#[test]
fn install_keeps_config_and_uninstall_removes_everything() {
    let scratch = tempfile::Builder::new()
        .prefix("trueno-ublk-install-")
        .tempdir()
        .unwrap();
    let dest = scratch.path().join("root");
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/systemd/trueno-ublk.conf.example"
    ))
    .unwrap();

    let (ok, log) = install(&dest, &[]);
    assert!(ok, "{log}");
    let want: Vec<PathBuf> = [
        "etc/modules-load.d/trueno-ublk.conf",
        "etc/systemd/system/trueno-ublk-failed@.service",
        "etc/systemd/system/trueno-ublk-mkswap@.service",
        "etc/systemd/system/trueno-ublk@.service",
        "etc/trueno-ublk.conf",
        "usr/local/bin/trueno-ublk",
        "usr/local/lib/systemd/system-generators/trueno-ublk-generator",
        "usr/local/share/doc/trueno-ublk/README.md",
        "usr/local/share/doc/trueno-ublk/docs/limits.md",
        "usr/local/share/doc/trueno-ublk/docs/measurements.md",
        "usr/local/share/doc/trueno-ublk/trueno-ublk.conf.example",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    assert_eq!(files_under(&dest), want);
    let installed_binary = dest.join("usr/local/bin/trueno-ublk");
    let version = Command::new(&installed_binary)
        .arg("--version")
        .output()
        .unwrap();
    assert!(version.status.success());
    // The generator is the binary under another name, linked where systemd looks.
    assert_eq!(
        std::fs::read_link(
            dest.join("usr/local/lib/systemd/system-generators/trueno-ublk-generator")
        )
        .unwrap(),
        Path::new("/usr/local/bin/trueno-ublk")
    );
    assert_eq!(
        std::fs::read_to_string(dest.join("etc/trueno-ublk.conf")).unwrap(),
        example
    );
    assert_eq!(
        std::fs::read_to_string(dest.join("etc/modules-load.d/trueno-ublk.conf")).unwrap(),
        "ublk_drv\n"
    );

    // An earlier version's swap service, enabled as its README said: the next install
    // removes it (it ran swapon itself, a second owner of the swap beside dev-ublkbN.swap).
    let old_unit = dest.join("etc/systemd/system/trueno-ublk-swap@.service");
    std::fs::write(&old_unit, "[Unit]\n").unwrap();
    let wants = dest.join("etc/systemd/system/swap.target.wants");
    std::fs::create_dir_all(&wants).unwrap();
    std::os::unix::fs::symlink(
        "/etc/systemd/system/trueno-ublk-swap@.service",
        wants.join("trueno-ublk-swap@0.service"),
    )
    .unwrap();

    // A second install with another prefix: units point at it, the edited config stays.
    std::fs::write(dest.join("etc/trueno-ublk.conf"), "[ublkb0]\nsize = 1G\n").unwrap();
    let (ok, log) = install(&dest, &["--prefix", "/opt/tu"]);
    assert!(ok, "{log}");
    assert!(log.contains("kept"), "{log}");
    assert_eq!(
        std::fs::read_to_string(dest.join("etc/trueno-ublk.conf")).unwrap(),
        "[ublkb0]\nsize = 1G\n"
    );
    let unit =
        std::fs::read_to_string(dest.join("etc/systemd/system/trueno-ublk@.service")).unwrap();
    assert!(
        unit.contains("ExecStart=@/opt/tu/bin/trueno-ublk @trueno-ublk create "),
        "{unit}"
    );
    assert!(!unit.contains("/usr/local/bin"), "{unit}");
    assert!(dest.join("opt/tu/bin/trueno-ublk").exists());
    assert!(!old_unit.exists(), "{log}");
    assert!(std::fs::symlink_metadata(wants.join("trueno-ublk-swap@0.service")).is_err());
    // A prefix systemd does not search for generators: /etc/systemd/system-generators.
    assert_eq!(
        std::fs::read_link(dest.join("etc/systemd/system-generators/trueno-ublk-generator"))
            .unwrap(),
        Path::new("/opt/tu/bin/trueno-ublk")
    );
    // An enabled daemon instance, as `systemctl enable trueno-ublk@1.service` leaves it.
    let multi_user = dest.join("etc/systemd/system/multi-user.target.wants");
    std::fs::create_dir_all(&multi_user).unwrap();
    std::os::unix::fs::symlink(
        "/etc/systemd/system/trueno-ublk@.service",
        multi_user.join("trueno-ublk@1.service"),
    )
    .unwrap();

    let (ok, log) = install(&dest, &["--prefix", "/opt/tu", "--uninstall"]);
    assert!(ok, "{log}");
    let (ok, log) = install(&dest, &["--uninstall"]);
    assert!(ok, "{log}");
    // Only the edited config is left, and the uninstall said so.
    assert_eq!(files_under(&dest), [PathBuf::from("etc/trueno-ublk.conf")]);
    assert!(log.contains("kept"), "{log}");
    assert!(std::fs::symlink_metadata(multi_user.join("trueno-ublk@1.service")).is_err());

    // An unchanged config goes with the uninstall.
    std::fs::write(dest.join("etc/trueno-ublk.conf"), &example).unwrap();
    let (ok, log) = install(&dest, &["--uninstall"]);
    assert!(ok, "{log}");
    assert!(files_under(&dest).is_empty(), "{log}");

    let (ok, log) = install(&dest, &["--bogus"]);
    assert!(!ok);
    assert!(log.contains("unknown option"), "{log}");

    // A prefix the units' command line could not take, or a relative one: nothing installed.
    for prefix in ["/opt/my apps", "/opt/a#b", "/opt/a&b", "opt/tu"] {
        let (ok, log) = install(&dest, &["--prefix", prefix]);
        assert!(!ok, "{prefix}: {log}");
        assert!(log.contains("--prefix"), "{log}");
        assert!(files_under(&dest).is_empty(), "{prefix}: {log}");
    }
}
