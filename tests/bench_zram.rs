//! `--compare-zram` against the machine's real zram. These add a zram device (or reset zram0
//! where the kernel cannot add one) and need root, so they are ignored by default: run them by
//! hand with `cargo test --test bench_zram -- --ignored --test-threads 1`.

use trueno_ublk::bench::corpus::{AlignedBuf, Corpus};
use trueno_ublk::bench::{zram, Progress};

#[test]
#[ignore = "adds and removes a zram device; needs root"]
fn zram_stores_and_returns_the_same_pages() {
    let zram_devices = || {
        let mut names: Vec<String> = std::fs::read_dir("/sys/block")
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with("zram"))
            .collect();
        names.sort();
        names
    };
    let before = zram_devices();
    let corpus = Corpus::generated(4096, 3);
    let mut scratch = AlignedBuf::zeroed(corpus.bytes().len());
    for streams in [1, 2] {
        let report =
            zram::compare(&corpus, &mut scratch, streams, "lz4", &Progress::hidden()).unwrap();
        assert_eq!(report.algorithm, "lz4");
        assert_eq!(report.streams, streams);
        assert_eq!(report.orig_data_size, 16 << 20);
        assert!(report.write_gbps > 0.0 && report.read_gbps > 0.0);
        assert!(report.ratio > 1.5 && report.mem_ratio > 1.0, "{report:?}");
        assert!(report.same_pages > 0 && report.huge_pages > 0, "{report:?}");
        assert_eq!(scratch.as_slice(), corpus.bytes());
    }
    assert_eq!(
        zram_devices(),
        before,
        "the bench's zram device was not removed"
    );
}
