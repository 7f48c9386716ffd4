//! The real binary's error paths on a host without a ublk device: one or two lines on
//! stderr, a non-zero exit, no panic and no backtrace.

use std::path::Path;
use std::process::{Command, Output};

fn trueno_ublk(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_trueno-ublk"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("the binary runs")
}

fn assert_clean_failure(output: &Output, expect: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "should fail: {stderr}");
    assert!(
        stderr.contains(expect),
        "stderr should say {expect:?}: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "no panic: {stderr}");
    assert!(!stderr.contains("backtrace"), "no backtrace: {stderr}");
    assert!(
        stderr.trim().lines().count() <= 2,
        "one or two lines: {stderr}"
    );
}

#[test]
fn create_without_the_driver_names_the_module() {
    if Path::new("/dev/ublk-control").exists() {
        eprintln!("skipped: this host has /dev/ublk-control");
        return;
    }
    let output = trueno_ublk(&["create", "--size", "1G"]);
    assert_clean_failure(&output, "modprobe ublk_drv");
    let output = trueno_ublk(&["create", "--size", "1G", "--foreground"]);
    assert_clean_failure(&output, "modprobe ublk_drv");
    let output = trueno_ublk(&["list"]);
    assert_clean_failure(&output, "modprobe ublk_drv");
}

#[test]
fn bad_sizes_are_refused_before_anything_else() {
    for size in ["0", "lots", "-1G", "12X"].map(|s| format!("--size={s}")) {
        let output = trueno_ublk(&["create", &size]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success());
        assert!(stderr.contains("bad size"), "{size}: {stderr}");
        assert!(!stderr.contains("panicked"));
    }
    let output = trueno_ublk(&["create", "--size", "1024T"]);
    assert_clean_failure(&output, "RAM");
}

#[test]
fn a_config_file_needs_a_device_id() {
    let output = trueno_ublk(&["create", "--config", "/nonexistent.conf"]);
    assert_clean_failure(&output, "--id");
}

#[test]
fn a_config_file_named_but_missing_is_refused() {
    for command in ["create", "swapon"] {
        let output = trueno_ublk(&[command, "--config", "/nonexistent.conf", "--id", "0"]);
        assert_clean_failure(&output, "/nonexistent.conf does not exist");
    }
}

#[test]
fn bad_recompress_settings_are_refused_before_anything_else() {
    for (flag, value) in [
        ("--recompress", "lz4"),
        ("--recompress", "zstd:99"),
        ("--recompress-idle", "soon"),
        ("--recompress-idle", "1.5s"),
    ] {
        let output = trueno_ublk(&["create", "--size", "1G", flag, value]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{flag} {value}");
        assert!(stderr.contains(flag), "{flag} {value}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    // In range for the parser, out of range for the setting.
    let output = trueno_ublk(&["create", "--size", "1G", "--recompress-idle", "10ms"]);
    assert_clean_failure(&output, "recompress-idle");
}

#[test]
fn output_into_a_pipe_nobody_reads_ends_quietly() {
    // `trueno-ublk ... | head`: the reader has gone before the command prints.
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let output = Command::new(env!("CARGO_BIN_EXE_trueno-ublk"))
        .args(["swapon", "--id", "0", "--dry-run"])
        .env("RUST_BACKTRACE", "1")
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("the binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{:?}: {stderr}", output.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn an_error_into_a_pipe_nobody_reads_is_still_exit_1() {
    // `trueno-ublk ... 2>&1 | head`: the reader has gone before the error is said.
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let status = Command::new(env!("CARGO_BIN_EXE_trueno-ublk"))
        .args(["stat", "--id", "5"])
        .env("RUST_BACKTRACE", "1")
        .stderr(writer)
        .status()
        .expect("the binary runs");
    assert_eq!(status.code(), Some(1), "{status:?}");
}

#[test]
fn fault_in_names_a_missing_process() {
    // Pid numbers end at pid_max (at most 2^22): this one never names a process.
    let output = trueno_ublk(&["fault-in", "--pid", "999999999"]);
    assert_clean_failure(&output, "no process 999999999");
}
