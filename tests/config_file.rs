//! The boot configuration: parsing, errors that name the key and line, and the merge
//! command line > config file > default.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use clap::Parser;
use trueno_ublk::cli::{Cli, Command as CliCommand};
use trueno_ublk::codec::{Algorithm, Backend};
use trueno_ublk::config::{
    self, parse, resolve_with, ConfigError, ConfigFile, DeviceOptions, DeviceSettings,
    RecompressChoice, SizeExpr,
};
use trueno_ublk::store::RecompressConfig;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn create_args(flags: &[&str]) -> DeviceOptions {
    let argv = ["trueno-ublk", "create"].iter().chain(flags);
    match Cli::try_parse_from(argv).expect("valid flags").command {
        CliCommand::Create(args) => args.options(),
        other => panic!("not create: {other:?}"),
    }
}

fn conf(text: &str) -> ConfigFile {
    parse(text, Path::new("test.conf")).expect("valid config")
}

/// A scratch directory, removed when the test ends, passed or failed.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("trueno-ublk-config-{name}-"))
        .tempdir()
        .unwrap()
}

#[test]
fn example_config_parses_and_means_the_defaults() {
    let text = include_str!("../systemd/trueno-ublk.conf.example");
    let file = parse(text, Path::new("trueno-ublk.conf.example")).unwrap();
    let args = create_args(&["--id", "0"]);
    for ram in [GIB, 16 * GIB] {
        let from_example = resolve_with(&args, &file, ram).unwrap();
        let from_nothing = resolve_with(&args, &ConfigFile::default(), ram).unwrap();
        assert_eq!(from_example, from_nothing, "ram {ram}");
    }
    // An administrator who changes one value gets that change alone: the example's other
    // lines still mean the defaults (recompression's default is off for zstd, say).
    for algorithm in ["zstd", "adaptive"] {
        let text = text.replace(
            "\nalgorithm = lz4\n",
            &format!("\nalgorithm = {algorithm}\n"),
        );
        let file = parse(&text, Path::new("edited.conf")).unwrap();
        let from_example = resolve_with(&args, &file, GIB).unwrap();
        let args = create_args(&["--id", "0", "--algorithm", algorithm]);
        let from_nothing = resolve_with(&args, &ConfigFile::default(), GIB).unwrap();
        assert_eq!(from_example, from_nothing, "algorithm = {algorithm}");
    }
}

#[test]
fn a_byte_order_mark_before_the_first_section_is_skipped() {
    let with_mark = conf("\u{feff}[ublkb0]\nswap = yes\nswap-priority = 5\n");
    assert_eq!(with_mark, conf("[ublkb0]\nswap = yes\nswap-priority = 5\n"));
    assert_eq!(with_mark.swap_priority(0), 5);
}

#[test]
fn defaults_follow_zram_generator() {
    let args = create_args(&[]);
    let cases = [
        (2 * GIB, GIB),
        (8 * GIB, 4 * GIB),
        (64 * GIB, 4 * GIB),
        // Half of an odd RAM size is rounded down to whole pages.
        (1000 * MIB + 4096 * 3, 500 * MIB + 4096),
    ];
    for (ram, want) in cases {
        let settings = resolve_with(&args, &ConfigFile::default(), ram).unwrap();
        assert_eq!(settings.size_bytes, want, "ram {ram}");
    }
    let settings = resolve_with(&args, &ConfigFile::default(), 8 * GIB).unwrap();
    assert_eq!(settings.id, None);
    assert_eq!(settings.queues, 1);
    assert_eq!(settings.depth, 32);
    assert_eq!(ConfigFile::default().swap_priority(0), 100);
    // LZ4 for new pages, and zstd:3 for pages idle 30 s (and for new pages while memory is
    // short, which the threads that compress new pages get contexts for).
    assert_eq!(settings.store.algorithm, Algorithm::Lz4);
    assert_eq!(
        settings.store.recompress,
        Some(RecompressConfig {
            algorithm: Algorithm::Zstd { level: 3 },
            idle: Duration::from_secs(30),
            min_saving_divisor: 8,
            cpu_percent: 50,
        })
    );
    assert_eq!(settings.store.recompress_name(), "zstd:3,idle=30s");
    assert_eq!(
        settings.store.thread_algorithm(),
        Algorithm::Zstd { level: 3 }
    );
    // zstd for new pages: no recompression, and nothing else to switch to.
    let zstd = resolve_with(
        &create_args(&["--algorithm", "zstd"]),
        &ConfigFile::default(),
        8 * GIB,
    )
    .unwrap();
    assert_eq!(zstd.store.algorithm, Algorithm::Zstd { level: 1 });
    assert_eq!(zstd.store.recompress_name(), "off");
    assert_eq!(zstd.store.thread_algorithm(), Algorithm::Zstd { level: 1 });
    assert_eq!(settings.store.forced_backend, None);
    assert!(settings.store.batched);
    assert_eq!(settings.store.batch_threshold, None);
    assert_eq!(settings.store.flush_timeout, Duration::from_millis(10));
    assert_eq!(settings.store.mem_limit, None);
}

#[test]
fn command_line_beats_config_beats_default() {
    let file = conf(
        "# test\n\
         [ublkb1]\n\
         size = 2G\n\
         algorithm = zstd\n\
         zstd-level = 5\n\
         queues = 4\n\
         depth = 128\n\
         batched = no\n\
         batch-threshold = 200\n\
         swap-priority = 7\n\
         \n\
         [ublkb2]\n\
         size = 3G\n",
    );
    let from_file = resolve_with(&create_args(&["--id", "1"]), &file, 8 * GIB).unwrap();
    assert_eq!(from_file.id, Some(1));
    assert_eq!(from_file.size_bytes, 2 * GIB);
    assert_eq!(from_file.queues, 4);
    assert_eq!(from_file.depth, 128);
    assert_eq!(from_file.store.algorithm, Algorithm::Zstd { level: 5 });
    assert!(!from_file.store.batched);
    assert_eq!(from_file.store.batch_threshold, Some(200));
    assert_eq!(file.swap_priority(1), 7);
    // Keys the section leaves out take the defaults.
    assert_eq!(from_file.store.flush_timeout, Duration::from_millis(10));

    let args = create_args(&[
        "--id",
        "1",
        "--size",
        "1G",
        "--queues",
        "2",
        "--zstd-level",
        "9",
        "--batch-threshold",
        "50",
    ]);
    let mixed = resolve_with(&args, &file, 8 * GIB).unwrap();
    assert_eq!(mixed.size_bytes, GIB);
    assert_eq!(mixed.queues, 2);
    assert_eq!(mixed.depth, 128);
    assert_eq!(mixed.store.algorithm, Algorithm::Zstd { level: 9 });
    assert_eq!(mixed.store.batch_threshold, Some(50));

    // Another id picks its own section; an id without one gets the defaults.
    let two = resolve_with(&create_args(&["--id", "2"]), &file, 8 * GIB).unwrap();
    assert_eq!(two.size_bytes, 3 * GIB);
    assert_eq!(file.swap_priority(2), 100);
    let five = resolve_with(&create_args(&["--id", "5"]), &file, 8 * GIB).unwrap();
    assert_eq!(five.size_bytes, 4 * GIB);
}

#[test]
fn relative_sizes_and_caps() {
    let cases: &[(&str, u64, u64)] = &[
        ("size = ram / 2\n", 16 * GIB, 8 * GIB),
        ("size = ram / 2\nmax-size = 4G\n", 16 * GIB, 4 * GIB),
        ("size = ram * 0.25\n", 16 * GIB, 4 * GIB),
        ("size = ram*1.5\n", 2 * GIB, 3 * GIB),
        ("size = ram\n", GIB, GIB),
        ("size = 512M\nmax-size = 256M\n", GIB, 256 * MIB),
        // max-size also caps the default.
        ("max-size = 1G\n", 16 * GIB, GIB),
        ("max-size = 8G\n", 16 * GIB, 8 * GIB),
    ];
    let args = create_args(&["--id", "0"]);
    for (body, ram, want) in cases {
        let file = conf(&format!("[ublkb0]\n{body}"));
        let settings = resolve_with(&args, &file, *ram).unwrap();
        assert_eq!(settings.size_bytes, *want, "{body:?} with ram {ram}");
        assert_eq!(settings.size_bytes % 4096, 0);
    }
    // --size wins over both size and max-size.
    let file = conf("[ublkb0]\nsize = ram / 2\nmax-size = 1G\n");
    let args = create_args(&["--id", "0", "--size", "6G"]);
    assert_eq!(resolve_with(&args, &file, GIB).unwrap().size_bytes, 6 * GIB);
}

#[test]
fn memory_limit_absolute_relative_or_none() {
    let args = create_args(&["--id", "0"]);
    let cases: &[(&str, Option<u64>)] = &[
        ("mem-limit = 1G", Some(GIB)),
        ("mem-limit = ram / 4", Some(2 * GIB)),
        ("mem-limit = none", None),
        ("mem-limit = NONE", None),
    ];
    for (line, want) in cases {
        let file = conf(&format!("[ublkb0]\n{line}\n"));
        let settings = resolve_with(&args, &file, 8 * GIB).unwrap();
        assert_eq!(settings.store.mem_limit, *want, "{line}");
        assert_eq!(
            settings.store_config(false, 8 * GIB).mem_limit,
            *want,
            "{line}"
        );
    }
    // The command line wins over the file either way, in the file's words.
    let args = create_args(&["--id", "0", "--mem-limit", "512M"]);
    let file = conf("[ublkb0]\nmem-limit = none\n");
    let settings = resolve_with(&args, &file, 8 * GIB).unwrap();
    assert_eq!(settings.store.mem_limit, Some(512 * MIB));
    let file = conf("[ublkb0]\nmem-limit = 1G\n");
    for (flag, want) in [("none", None), ("ram / 8", Some(GIB))] {
        let args = create_args(&["--id", "0", "--mem-limit", flag]);
        let settings = resolve_with(&args, &file, 8 * GIB).unwrap();
        assert_eq!(settings.store.mem_limit, want, "--mem-limit {flag}");
    }
    // Less than a page is refused, naming where it came from.
    let args = create_args(&["--id", "0", "--mem-limit", "ram / 10000000000"]);
    let error = resolve_with(&args, &file, 8 * GIB).unwrap_err();
    assert!(error.to_string().contains("--mem-limit"), "{error}");
    let file = conf("[ublkb0]\nmem-limit = ram / 10000000000\n");
    let error = resolve_with(&create_args(&["--id", "0"]), &file, 8 * GIB).unwrap_err();
    assert!(error.to_string().contains(":2"), "{error}");
}

#[test]
fn store_config_carries_every_setting() {
    let file = conf(
        "[ublkb3]\nalgorithm = adaptive\nbackend = simd-parallel\nflush-timeout-ms = 25\n\
         batch-threshold = 64\nmem-limit = 64M\nsize = 1G\n",
    );
    let settings = resolve_with(&create_args(&["--id", "3"]), &file, 8 * GIB).unwrap();
    let store = settings.store_config(false, 8 * GIB);
    assert_eq!(store.size_bytes, GIB);
    assert_eq!(store.algorithm, Algorithm::Adaptive);
    assert_eq!(store.forced_backend, Some(Backend::SimdParallel));
    assert_eq!(store.flush_timeout, Duration::from_millis(25));
    assert_eq!(store.batch_threshold, 64);
    assert_eq!(store.mem_limit, Some(64 * MIB));
    assert!(store.batched);
    assert_eq!(settings.store.algorithm_name(), "adaptive");
    assert_eq!(settings.store.backend_name(), "simd-parallel");

    let args = create_args(&["--algorithm", "zstd", "--zstd-level", "3", "--no-batched"]);
    let settings = resolve_with(&args, &ConfigFile::default(), 8 * GIB).unwrap();
    assert_eq!(settings.store.algorithm_name(), "zstd:3");
    assert!(!settings.store_config(false, 8 * GIB).batched);

    let args = create_args(&["--algorithm", "lz4", "--backend", "gpu"]);
    let settings = resolve_with(&args, &ConfigFile::default(), 8 * GIB).unwrap();
    assert_eq!(settings.store.backend_name(), "gpu");
    assert_eq!(
        settings.store_config(false, 8 * GIB).forced_backend,
        Some(Backend::Gpu)
    );
}

/// The GPU compresses LZ4 only: any other algorithm with it is refused where the settings are
/// read (the command line, or the file's line), not first when the daemon starts.
#[test]
fn the_gpu_backend_with_another_algorithm_is_refused() {
    let args = create_args(&["--algorithm", "zstd", "--backend", "gpu"]);
    let refused = resolve_with(&args, &ConfigFile::default(), 8 * GIB)
        .err()
        .unwrap()
        .to_string();
    assert!(refused.contains("command line (--backend)"), "{refused}");
    assert!(refused.contains("LZ4 only"), "{refused}");
    // The default algorithm (LZ4) goes with it.
    let file = conf("[ublkb0]\nsize = 1G\nbackend = gpu\n");
    assert!(resolve_with(&create_args(&["--id", "0"]), &file, 8 * GIB).is_ok());
    let file = conf("[ublkb0]\nsize = 1G\nalgorithm = adaptive\nbackend = gpu\n");
    let refused = resolve_with(&create_args(&["--id", "0"]), &file, 8 * GIB)
        .err()
        .unwrap()
        .to_string();
    assert!(refused.contains(".conf:4:"), "{refused}");
}

#[test]
fn recompression_from_file_and_command_line() {
    let recompress = |flags: &[&str], body: &str| {
        let file = conf(&format!("[ublkb0]\n{body}"));
        let mut args = vec!["--id", "0"];
        args.extend_from_slice(flags);
        let settings = resolve_with(&create_args(&args), &file, 8 * GIB).unwrap();
        (
            settings.store.recompress_name(),
            settings.store_config(false, 8 * GIB).recompress,
        )
    };
    assert_eq!(
        recompress(&[], "recompress = zstd:7\nrecompress-idle = 2m\n").0,
        "zstd:7,idle=2m"
    );
    assert_eq!(recompress(&[], "recompress = zstd\n").0, "zstd:3,idle=30s");
    // Spaces around the colon, as around the `=`, are no part of the name or the level.
    assert_eq!(
        recompress(&[], "recompress = zstd : 5\n").0,
        "zstd:5,idle=30s"
    );
    assert_eq!(
        recompress(&["--recompress", "zstd: 7"], "").0,
        "zstd:7,idle=30s"
    );
    assert_eq!(
        recompress(&[], "recompress = off\n"),
        ("off".to_string(), None)
    );
    // The command line wins, key by key.
    assert_eq!(
        recompress(
            &["--recompress", "zstd:12"],
            "recompress = off\nrecompress-idle = 5s\n"
        )
        .0,
        "zstd:12,idle=5s"
    );
    assert_eq!(
        recompress(
            &["--recompress-idle", "500ms"],
            "algorithm = lz4\nrecompress-idle = 1h\n"
        )
        .0,
        "zstd:3,idle=500ms"
    );
    assert_eq!(
        recompress(&[], "algorithm = lz4\nrecompress-idle = 1h\n").0,
        "zstd:3,idle=1h"
    );
    assert_eq!(
        recompress(&["--recompress", "off"], "recompress = zstd:5\n").1,
        None
    );
    // Without a recompress setting, zstd pages stay as they are; asked for, a higher level
    // is allowed.
    assert_eq!(
        recompress(&[], "algorithm = zstd\nzstd-level = 3\n").1,
        None
    );
    assert_eq!(
        recompress(&[], "algorithm = zstd\nrecompress-idle = 5s\n").0,
        "off"
    );
    assert_eq!(
        recompress(&[], "recompress-idle = 5s\n").0,
        "zstd:3,idle=5s"
    );
    assert_eq!(
        recompress(&["--recompress", "zstd"], "algorithm = zstd\n").0,
        "zstd:3,idle=30s",
        "zstd:1 pages recompress to zstd:3 when asked"
    );
    assert_eq!(
        recompress(&["--algorithm", "adaptive"], "").0,
        "zstd:3,idle=30s"
    );
    // Asked for explicitly, it is an error that says why.
    let file = conf("[ublkb0]\nalgorithm = zstd\nzstd-level = 9\nrecompress = zstd:3\n");
    let message = resolve_with(&create_args(&["--id", "0"]), &file, GIB)
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("test.conf:4") && message.contains("recompress"),
        "{message}"
    );
    let message = resolve_with(
        &create_args(&["--algorithm", "zstd", "--recompress", "zstd:1"]),
        &ConfigFile::default(),
        GIB,
    )
    .unwrap_err()
    .to_string();
    assert!(message.contains("--recompress"), "{message}");
    let message = resolve_with(
        &create_args(&["--recompress-idle", "2d"]),
        &ConfigFile::default(),
        GIB,
    )
    .unwrap_err()
    .to_string();
    assert!(message.contains("--recompress-idle"), "{message}");
    assert_eq!(
        RecompressChoice::parse("ZSTD:19"),
        Ok(RecompressChoice::Zstd { level: 19 })
    );
}

/// Each bad file is rejected with a message naming the line (and the key where there is one).
#[test]
fn bad_files_name_the_line_and_key() {
    let cases: &[(&str, &str, &[&str])] = &[
        ("[ublkb0]\nsize = 8X\n", "test.conf:2", &["size", "8X"]),
        ("[ublkb0]\nsize = 0\n", "test.conf:2", &["size"]),
        ("[ublkb0]\nsize = ram / 0\n", "test.conf:2", &["size"]),
        ("[ublkb0]\nsize = ram - 1G\n", "test.conf:2", &["size"]),
        ("[ublkb0]\nsize = ram * 0\n", "test.conf:2", &["size"]),
        (
            "[ublkb0]\nsize = 8G # comment\n",
            "test.conf:2",
            &["size", "comments go on a line of their own"],
        ),
        ("[ublkb0]\n\n# c\nqueues = 0\n", "test.conf:4", &["queues"]),
        ("[ublkb0]\ndepth = 5000\n", "test.conf:2", &["depth"]),
        ("[ublkb0]\ndepth = -1\n", "test.conf:2", &["depth"]),
        (
            "[ublkb0]\nalgorithm = lzo\n",
            "test.conf:2",
            &["algorithm", "lz4"],
        ),
        (
            "[ublkb0]\nbackend = cuda\n",
            "test.conf:2",
            &["backend", "simd-parallel"],
        ),
        ("[ublkb0]\nbatched = maybe\n", "test.conf:2", &["batched"]),
        (
            "[ublkb0]\nzstd-level = 99\n",
            "test.conf:2",
            &["zstd-level"],
        ),
        (
            "[ublkb0]\nbatch-threshold = 0\n",
            "test.conf:2",
            &["batch-threshold"],
        ),
        (
            "[ublkb0]\nflush-timeout-ms = x\n",
            "test.conf:2",
            &["flush-timeout-ms"],
        ),
        (
            "[ublkb0]\nmem-limit = lots\n",
            "test.conf:2",
            &["mem-limit"],
        ),
        (
            "[ublkb0]\nswap-priority = 40000\n",
            "test.conf:2",
            &["swap-priority"],
        ),
        (
            "[ublkb0]\nswap-priority = -1\n",
            "test.conf:2",
            &["swap-priority"],
        ),
        ("[ublkb0]\nmax-size = 0\n", "test.conf:2", &["max-size"]),
        (
            "[ublkb0]\nrecompress = lz4\n",
            "test.conf:2",
            &["recompress", "zstd"],
        ),
        (
            "[ublkb0]\nrecompress = zstd:99\n",
            "test.conf:2",
            &["recompress"],
        ),
        (
            "[ublkb0]\nrecompress-idle = soon\n",
            "test.conf:2",
            &["recompress-idle", "30s"],
        ),
        ("[ublkb0]\nsiez = 8G\n", "test.conf:2", &["siez"]),
        ("[ublkb0]\nsize = 1G\nsize = 2G\n", "test.conf:3", &["size"]),
        (
            "[ublkb0]\nthis is not a key\n",
            "test.conf:2",
            &["key = value"],
        ),
        ("size = 8G\n", "test.conf:1", &["size", "[ublkb0]"]),
        ("[zram0]\n", "test.conf:1", &["zram0"]),
        ("[ublkb]\n", "test.conf:1", &["ublkb"]),
        ("[ublkb0\n", "test.conf:1", &["]"]),
        (
            "[ublkb0]  # main\n",
            "test.conf:1",
            &["text after", "# main", "own line"],
        ),
        ("[ublkb0]\n[ublkb0]\n", "test.conf:2", &["twice"]),
    ];
    for (text, location, words) in cases {
        let error = parse(text, Path::new("test.conf")).expect_err(text);
        let message = error.to_string();
        assert!(
            message.contains(location),
            "{text:?}: '{message}' lacks {location}"
        );
        for word in *words {
            assert!(message.contains(word), "{text:?}: '{message}' lacks {word}");
        }
    }
}

#[test]
fn merged_values_out_of_range_are_errors() {
    // Zero queues or depth cannot come from the file (rejected while parsing) but can from
    // the command line.
    let error = resolve_with(
        &create_args(&["--queues", "0"]),
        &ConfigFile::default(),
        GIB,
    )
    .unwrap_err();
    assert!(error.to_string().contains("--queues"), "{error}");
    let error = resolve_with(
        &create_args(&["--zstd-level", "1000"]),
        &ConfigFile::default(),
        GIB,
    )
    .unwrap_err();
    assert!(error.to_string().contains("zstd-level"), "{error}");
    // A share of RAM that comes to less than a page.
    let file = conf("[ublkb0]\nsize = ram / 1000000\n");
    let error = resolve_with(&create_args(&["--id", "0"]), &file, 4 * MIB).unwrap_err();
    let message = error.to_string();
    assert!(
        message.contains("test.conf:2") && message.contains("size"),
        "{message}"
    );
}

#[test]
fn missing_file_means_defaults_and_config_needs_an_id() {
    let scratch = temp_dir("missing");
    let dir = scratch.path();
    let path = dir.join("absent.conf");
    let file = config::load(&path).unwrap();
    assert!(file.devices.is_empty());

    let args = create_args(&["--config", path.to_str().unwrap()]);
    let error = config::resolve(&args).unwrap_err();
    assert!(matches!(error, ConfigError::NeedsId { .. }), "{error}");
    assert!(error.to_string().contains("--id"));

    // A file named on the command line that is not there is most likely a typo: refused,
    // naming it, rather than a device set up with the defaults.
    let args = create_args(&["--config", path.to_str().unwrap(), "--id", "0"]);
    let error = config::resolve(&args).unwrap_err();
    assert!(matches!(error, ConfigError::Missing { .. }), "{error}");
    assert!(error.to_string().contains("absent.conf"), "{error}");

    // An empty file is the defaults: --size as given, else min(RAM / 2, 4 GiB).
    std::fs::write(&path, "").unwrap();
    let args = create_args(&[
        "--config",
        path.to_str().unwrap(),
        "--id",
        "0",
        "--size",
        "1G",
    ]);
    let settings = config::resolve(&args).unwrap();
    assert_eq!(settings.size_bytes, GIB);
    assert_eq!(settings.id, Some(0));

    let args = create_args(&["--config", path.to_str().unwrap(), "--id", "0"]);
    let settings = config::resolve(&args).unwrap();
    let ram = config::ram_bytes().unwrap();
    assert_eq!(settings.size_bytes, ((ram / 2) & !4095).min(4 * GIB));

    // A directory where the file should be is a read error, not "defaults".
    let args = create_args(&["--config", dir.to_str().unwrap(), "--id", "0"]);
    assert!(matches!(
        config::resolve(&args).unwrap_err(),
        ConfigError::Read { .. }
    ));
}

#[test]
fn size_expressions() {
    let cases: &[(&str, Option<SizeExpr>)] = &[
        ("8G", Some(SizeExpr::Bytes(8 * GIB))),
        (
            "ram",
            Some(SizeExpr::RamFraction {
                numerator: 1,
                denominator: 1,
            }),
        ),
        (
            "ram / 3",
            Some(SizeExpr::RamFraction {
                numerator: 1,
                denominator: 3,
            }),
        ),
        (
            "ram * 0.5",
            Some(SizeExpr::RamFraction {
                numerator: 5,
                denominator: 10,
            }),
        ),
        (
            "ram * 2",
            Some(SizeExpr::RamFraction {
                numerator: 2,
                denominator: 1,
            }),
        ),
        (
            "ram * .5",
            Some(SizeExpr::RamFraction {
                numerator: 5,
                denominator: 10,
            }),
        ),
        ("ram * 1.2.3", None),
        ("ram * -1", None),
        ("ram / 2.5", None),
        ("ram +", None),
        ("ramp", None),
        ("", None),
    ];
    for (text, want) in cases {
        assert_eq!(config::parse_size_expr(text).ok(), *want, "{text:?}");
    }
    // Too many digits is said as such, not as something that is no number.
    for text in ["ram * 0.3333333", "ram * 1000000"] {
        let error = config::parse_size_expr(text).expect_err(text);
        assert!(error.contains("more than 6 digits"), "{text}: {error}");
    }
    let third = SizeExpr::RamFraction {
        numerator: 1,
        denominator: 3,
    };
    assert_eq!(third.evaluate(3 * GIB), GIB);
    assert_eq!(third.evaluate(10 * 4096) % 4096, 0);
}

#[test]
fn mem_total_is_read_in_bytes() {
    let meminfo = "MemTotal:       16318412 kB\nMemFree:         1000 kB\n";
    assert_eq!(
        trueno_ublk::os::parse_mem_total(meminfo),
        Some(16318412 * 1024)
    );
    assert_eq!(trueno_ublk::os::parse_mem_total("MemFree: 1 kB\n"), None);
    assert_eq!(
        trueno_ublk::os::parse_mem_total("MemTotal: many kB\n"),
        None
    );
    assert!(config::ram_bytes().unwrap() > 0);
}

#[test]
fn swapon_uses_the_configured_priority_with_discard() {
    assert_eq!(
        trueno_ublk::swap::swapon_command(3, 42),
        ["swapon", "-d", "-p", "42", "/dev/ublkb3"]
    );
    let scratch = temp_dir("swapon");
    let dir = scratch.path();
    let path = dir.join("trueno-ublk.conf");
    std::fs::write(&path, "[ublkb0]\nswap-priority = 42\n[ublkb1]\nsize = 1G\n").unwrap();
    let run = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_trueno-ublk"))
            .arg("swapon")
            .args(args)
            .arg("--dry-run")
            .output()
            .unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let conf = path.to_str().unwrap();
    let (code, out, _) = run(&["--id", "0", "--config", conf]);
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "swapon -d -p 42 /dev/ublkb0\n")
    );
    let (code, out, _) = run(&["--id", "1", "--config", conf]);
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "swapon -d -p 100 /dev/ublkb1\n")
    );
    let (code, out, _) = run(&["--id", "0"]);
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "swapon -d -p 100 /dev/ublkb0\n")
    );
    let (code, out, err) = run(&[
        "--id",
        "0",
        "--config",
        dir.join("none.conf").to_str().unwrap(),
    ]);
    assert_eq!((code, out.as_str()), (Some(1), ""));
    assert!(err.contains("none.conf does not exist"), "{err}");

    std::fs::write(&path, "[ublkb0]\nswap-priority = high\n").unwrap();
    let (code, out, err) = run(&["--id", "0", "--config", conf]);
    assert_eq!(code, Some(1));
    assert!(out.is_empty());
    assert!(
        err.contains(":2:") && err.contains("swap-priority"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn device_switches_are_on_unless_the_file_or_the_command_line_turns_them_off() {
    type Switch = fn(&DeviceSettings) -> bool;
    let switches: [(&str, &str, Switch); 3] = [
        ("slot-free-probe", "--no-slot-free-probe", |s| {
            s.slot_free_probe
        }),
        ("user-copy", "--no-user-copy", |s| s.user_copy),
        ("oom-kill", "--no-oom-kill", |s| s.oom_kill),
    ];
    for (key, flag, switch) in switches {
        let off_in_file = conf(&format!("[ublkb0]\n{key} = no\n"));
        let on_in_file = conf(&format!("[ublkb0]\n{key} = yes\n"));
        let resolve = |flags: &[&str], file: &ConfigFile| {
            switch(&resolve_with(&create_args(flags), file, 8 * GIB).unwrap())
        };
        assert!(resolve(&["--id", "0"], &ConfigFile::default()), "{key}");
        assert!(resolve(&["--id", "0"], &on_in_file), "{key}");
        assert!(!resolve(&["--id", "0"], &off_in_file), "{key}");
        assert!(!resolve(&["--id", "0", flag], &on_in_file), "{key}");
        let error = parse(&format!("[ublkb0]\n{key} = maybe\n"), Path::new("t.conf")).unwrap_err();
        assert!(error.to_string().contains(key), "{error}");
    }
}

/// zstd's negative (faster) levels are taken on the command line as `--zstd-level -5`, not
/// read as a flag `-5`.
#[test]
fn a_negative_zstd_level_is_a_level() {
    let args = create_args(&["--algorithm", "zstd", "--zstd-level", "-5"]);
    let settings = resolve_with(&args, &ConfigFile::default(), 8 * GIB).unwrap();
    assert_eq!(settings.store.algorithm_name(), "zstd:-5");
}

/// zstd level 0 is zstd's default (3), not a level below 1: refused wherever it is given, so
/// that a recompression "to 0" of pages stored at level 1 or 2 cannot look like a gain.
#[test]
fn zstd_level_zero_is_refused_everywhere() {
    let args = create_args(&["--algorithm", "zstd", "--zstd-level", "0"]);
    let refused = resolve_with(&args, &ConfigFile::default(), 8 * GIB)
        .err()
        .unwrap()
        .to_string();
    assert!(refused.contains("write 3"), "{refused}");
    for body in ["zstd-level = 0\n", "recompress = zstd:0\n"] {
        let refused = config::parse(&format!("[ublkb0]\n{body}"), Path::new("test.conf"))
            .err()
            .unwrap()
            .to_string();
        assert!(
            refused.contains("test.conf:2") && refused.contains("write 3"),
            "{refused}"
        );
    }
    assert!(RecompressChoice::parse("zstd:0").is_err());
}
